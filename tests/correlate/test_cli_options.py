"""The option and run tables of correlate.py: every (option, run) pair is read or refused, never
ignored; the options record and the resume fingerprint derive from the tables and match those of
the version at commit f073761 (tests/correlate/data/identities_f073761.json)."""

from __future__ import annotations

import argparse
import json
import re
from pathlib import Path

import pytest
from option_walk import NEEDED, SAMPLES, context, option_argv, takes_value
from resume_identities import CASES, CHANGED, DATA, REPO, captured_identities, unportable

from nw_adapter.correlate.cli import main
from nw_adapter.correlate.option_table import OPTION_BY_DEST, OPTIONS, RUN_BY_NAME, RUNS
from nw_adapter.correlate.options import CLIError, Resolved, build_parser, options_record, parse_args

WALKED = [option for option in OPTIONS if option.dest != "example_dir"]

READ_ELSEWHERE: dict[str, str] = {
    "image": "the references (their files and keys enter the result files)",
    "image_dir": "the references",
    "model": "the resolved model (the record's model entry, through the loader)",
    "ip_adapter": "the resolved model",
    "subfolder": "the resolved model",
    "weight_name": "the resolved model",
    "image_encoder": "the resolved model",
    "device": "the resolved device",
    "dtype": "the resolved dtype",
    "true_cfg_scale": "the Flux call's arguments (rho) / the record (the other runs)",
    "labels": "the references' classes (the record names their source)",
    "out": "the output folder",
    "all_steps": "the rows of the printed table (and the steps of the stored maps)",
    "replot": "the folder redrawn",
    "quiet": "the terminal",
    "verbose": "the terminal",
    "support_set": "the support sets",
    "support_dir": "the support sets",
}
"""Options whose value reaches the run other than through the options record built from the
arguments (the walk below shows every other accepted option changing that record)."""


def _parse(argv: list[str]) -> argparse.Namespace:
    return parse_args(argv)


@pytest.mark.parametrize("run", RUNS, ids=lambda run: run.name)
@pytest.mark.parametrize("option", WALKED, ids=lambda option: option.name)
def test_every_option_is_read_or_refused_by_every_run(option, run) -> None:
    argv = [*context(run), *option_argv(option)]
    if option.dest in run.selectors and option.action is None:  # its value replaces the context's: given once
        argv = [*option_argv(option)]
    chooses = next((other for other in RUNS if option.dest in other.selectors), None)
    if chooses is not None and chooses is not run:  # it chooses its own run: read by that one, or refused
        try:
            assert _parse(argv).run is chooses
        except CLIError as refused:
            message = str(refused)
            assert "\n" not in message and (chooses.title in message or "start two different runs" in message)
        return
    if run.name not in option.runs:
        with pytest.raises(CLIError) as refused:
            _parse(argv)
        message = str(refused.value)
        refused_first = [option.name, *NEEDED.get(option.dest, [])]  # the option it needs may go first
        assert "\n" not in message and any(
            message.startswith(f"{n} is not read by {run.title}") for n in refused_first
        )
        return
    args = _parse(argv)  # read: accepted, for this run
    assert args.run is run and option.dest in args.given
    if option.dest in READ_ELSEWHERE or option.dest in run.selectors:  # a selector: the run itself
        return
    resolved = Resolved(model={"model": "m"}, resolved_model={"model": "m"}, device="cpu", dtype="float32")
    if option.dest == "true_cfg_scale":
        resolved.call = {"true_cfg_scale": args.true_cfg_scale}
    plain = _parse(context(run))
    if run.name == "replot":  # a redraw records nothing: every option it reads is in READ_ELSEWHERE
        pytest.fail(f"{option.name} is read by --replot but reaches nothing")
    assert options_record(run.name, args, resolved) != options_record(run.name, plain, resolved), (
        f"{option.name} is accepted by the {run.name} run but changes nothing it records; record it, "
        "refuse it, or name its reader in READ_ELSEWHERE"
    )


def test_example_dir_answers_for_every_run(capsys) -> None:
    for run in RUNS:
        with pytest.raises(SystemExit) as done:
            _parse([*context(run), "--example-dir"])
        assert done.value.code == 0
        assert capsys.readouterr().out.strip().endswith("examples")


def test_the_walk_covers_every_option_and_the_samples_are_not_defaults() -> None:
    for option in WALKED:
        if takes_value(option):
            run = RUN_BY_NAME[sorted(option.runs)[0]]
            given_once = option.dest in run.selectors and option.action is None  # not the context's too
            args = _parse([*([] if given_once else context(run)), *option_argv(option)])
            assert getattr(args, option.dest) != option.default, option.name
    assert set(SAMPLES) == {option.dest for option in WALKED if takes_value(option)}
    assert set(READ_ELSEWHERE) <= set(OPTION_BY_DEST)


def test_the_parser_is_the_table() -> None:
    parser = build_parser()
    flags = [action.option_strings for action in parser._actions if action.option_strings]
    assert flags == [["-h", "--help"], *[list(option.flags) for option in OPTIONS]]
    text = parser.format_help()
    for option in OPTIONS:
        assert option.name in text


@pytest.mark.parametrize(
    ("argv", "words"),
    [
        # --support-set read neither --bandwidth nor --all-steps nor --control-draws (same support.csv)
        (
            ["--support-set", "a.png,b.png", "--bandwidth", "fitted"],
            "--bandwidth is not read by the support-set run (--support-set/--support-dir); its posterior "
            "over the references' latents (the space of x_t) uses the schedule's h",
        ),
        (["--support-set", "a.png,b.png", "--all-steps"], "--all-steps is not read by the support-set run"),
        (
            ["--support-set", "a.png,b.png", "--control-draws", "2"],
            "--control-draws is not read by the support-set",
        ),
        (
            ["--support-set", "a.png,b.png", "--untrained-seed", "2"],
            "--untrained-seed is not read by the support",
        ),
        # --compare-swap ignored --end-to-end-control and --no-untrained-control
        (["--compare-swap", "--image", "a.png", "--end-to-end-control"], "start two different runs"),
        (
            ["--compare-swap", "--image", "a.png", "--no-untrained-control"],
            "--no-untrained-control is not read",
        ),
        # accepted with exit 0: the control's options with the control off, the end-to-end ones without it
        (
            ["--image", "a.png", "--no-untrained-control", "--control-draws", "2"],
            "turns off; drop one of them",
        ),
        (
            ["--image", "a.png", "--no-untrained-control", "--untrained-seed", "2"],
            "turns off; drop one of them",
        ),
        (["--image", "a.png", "--end-to-end-draws", "2"], "--end-to-end-draws is not read by the rho run"),
        (["--image", "a.png", "--end-to-end-seed", "2"], "--end-to-end-seed is not read by the rho run"),
        (["--image", "a.png", "--end-to-end-control", "--control-draws", "2"], "use --end-to-end-draws"),
        (["--replot", "done", "--steps", "3"], "--steps is not read by --replot"),
    ],
)
def test_the_drifted_options_are_refused_in_one_line(argv, words, capsys, tmp_path) -> None:
    out = tmp_path / "out"
    code = main([*argv, "--out", str(out)] if "--replot" not in argv else argv)
    err = capsys.readouterr().err
    lines = err.strip().splitlines()
    assert code == 2 and len(lines) == 1 and words in lines[0], err
    assert not out.exists()


@pytest.mark.parametrize(
    "argv, words",
    [
        (["--steps", "3", "--steps", "50"], "--steps given twice with different values (3, then 50)"),
        (["--model", "tiny-sd3", "--model", "tiny"], "--model given twice with different values"),
        (["--out", "a", "--out", "b"], "--out given twice with different values (a, then b)"),
        (["--bandwidth", "fitted", "--bandwidth=matched"], "--bandwidth given twice"),
    ],
)
def test_an_option_given_twice_with_different_values_is_refused(argv, words, capsys, tmp_path) -> None:
    """argparse keeps the last value of a repeated option and drops the first without a word."""
    code = main(["--image", str(tmp_path / "a.png"), *argv])
    lines = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(lines) == 1 and words in lines[0] and "give it once" in lines[0], lines


def test_an_option_repeated_with_its_value_or_an_appending_one_is_read() -> None:
    args = parse_args(["--image", "a.png", "--image", "b.png", "--steps", "3", "--steps", "3", "-q", "-q"])
    assert [str(path) for path in args.image] == ["a.png", "b.png"] and args.steps == 3 and args.quiet == 2


def test_the_record_keys_of_each_run() -> None:
    """The records the tables give each run: the keys its result file's ``config`` holds."""
    resolved = Resolved(model={}, resolved_model={}, device="cpu", dtype="float32", scheduler_class="PNDM")
    rho = options_record("rho", _parse(["--image", "a.png"]), resolved)
    swap = options_record("compare-swap", _parse(["--compare-swap", "--image", "a.png"]), resolved)
    support = options_record("support-sets", _parse(["--support-set", "a.png"]), resolved)
    common = {"model", "prompt", "negative_prompt", "steps", "seed", "guidance_scale", "ip_scale", "height"}
    common |= {"width", "scheduler", "scheduler_class", "device", "dtype"}
    assert set(rho) == common | {"mode", "bandwidth", "layers", "store_maps", "untrained_control",
                                 "untrained_seed", "untrained_draws", "end_to_end_control"}  # fmt: skip
    assert set(swap) == common | {"true_cfg_scale", "rules", "labels", "judge"}
    assert set(support) == common | {"true_cfg_scale", "layers", "posterior_space", "judge"}


@pytest.mark.parametrize("case", sorted(CASES))
def test_a_run_of_the_version_at_f073761_still_resumes(case, tmp_path) -> None:
    """The objects fingerprinted for resuming equal those of f073761 (recorded from its real runs)."""
    recorded = json.loads(DATA.read_text())[case]
    assert captured_identities(CASES[case], tmp_path / "out", tmp_path / "cache") == recorded


def test_a_compare_swap_run_of_f073761_on_tiny_flux_digits_is_computed_again_naming_why(
    tmp_path, capsys, monkeypatch
) -> None:
    """f073761's compare-swap run recorded (and fingerprinted) the shipped tiny-flux-digits' image
    encoder by its install path, where this version records "tiny" (as the rho run did then and
    does now): that entry is the only difference, so such a run cannot resume. Its compare_swap.json
    (rebuilt here: f073761's fingerprint and recorded model) is computed again, and the note names
    that entry."""
    from nw_adapter.correlate import sweep
    from nw_adapter.correlate.sweep import DIGEST_FIELD, content_digest

    name = "compare-swap-tiny-flux-digits"
    then = json.loads(DATA.read_text())[name]
    cache, out = tmp_path / "cache", tmp_path / "out"
    now = captured_identities(CHANGED[name], out, cache)
    assert len(then) == len(now) == 1
    install = "<repo>/nw_adapter/models/weights/tiny_flux_digits/ip-adapter/image_encoder"
    assert then[0]["model"]["image_encoder"] == install and now[0]["model"]["image_encoder"] == "tiny"
    assert {**then[0], "model": {**then[0]["model"], "image_encoder": "tiny"}} == now[0]  # nothing else

    path = out / "compare_swap.json"
    document = json.loads(path.read_text())
    assert document["fingerprint"] == sweep.fingerprint(unportable(now[0], cache))
    document["config"]["model"]["image_encoder"] = install.replace("<repo>", str(REPO))  # as f073761 wrote
    document["fingerprint"] = sweep.fingerprint(unportable(then[0], cache))
    document[DIGEST_FIELD] = content_digest(document)
    path.write_text(json.dumps(document))
    monkeypatch.setenv("NW_ADAPTER_CACHE", str(cache))
    capsys.readouterr()
    assert main([*CHANGED[name], "--out", str(out), "-q"]) == 0
    notes = [line for line in capsys.readouterr().err.splitlines() if "compare_swap.json" in line]
    assert len(notes) == 1, notes
    encoder = install.replace("<repo>", str(REPO))
    assert (
        f"model.image_encoder: '{encoder}' then, 'tiny' now" in notes[0] and "computing it again" in notes[0]
    )
    assert json.loads(path.read_text())["fingerprint"] == sweep.fingerprint(unportable(now[0], cache))


def test_the_help_of_every_option_is_one_sentence_without_line_breaks() -> None:
    for option in OPTIONS:
        assert option.help and "\n" not in option.help and not re.search(r"\s{2,}", option.help), option.name


def test_the_support_set_run_reads_layers(tmp_path) -> None:
    """``--layers up``: support.csv holds the up blocks' rows only (before, it was byte-identical)."""
    from nw_adapter.models.tiny_digits import example_image_path

    digits = ",".join(str(example_image_path(d)) for d in (3, 7))
    base = ["--model", "tiny", "--steps", "1", "--support-set", digits, "-qq"]
    assert main([*base, "--out", str(tmp_path / "all")]) == 0
    assert main([*base, "--layers", "up", "--out", str(tmp_path / "up")]) == 0
    layers = {}
    for name in ("all", "up"):
        header, *rows = (tmp_path / name / "support.csv").read_text().splitlines()
        names = header.split(",")
        column, source = names.index("layer"), names.index("source")
        # the attention's rows (the latent posterior's rows are per step, of no layer)
        layers[name] = {row.split(",")[column] for row in rows if row.split(",")[source] == "attention"}
    assert layers["up"] and all(layer.startswith("up_blocks") for layer in layers["up"])
    assert layers["up"] < layers["all"]
    config = json.loads(Path(tmp_path / "up" / "support.json").read_text())["config"]
    assert config["layers"] == ["up_blocks"]


def test_a_new_generation_option_is_one_row_and_one_line(tmp_path, capsys, monkeypatch) -> None:
    """``--guidance-rescale`` (diffusers' guidance_rescale): the row of option_table.py and one line
    of RunModel.call_arguments make every run read it, record it (only when given, so earlier
    fingerprints stay valid), and refuse it where it cannot act."""
    from nw_adapter.models.tiny_digits import example_image_path

    monkeypatch.setenv("NW_ADAPTER_CACHE", str(tmp_path / "cache"))  # tiny-flux's folder, if written
    base = ["--image", str(example_image_path(3)), "--model", "tiny", "--steps", "2", "-qq"]
    plain, rescaled = tmp_path / "plain", tmp_path / "rescaled"
    assert main([*base, "--no-untrained-control", "--out", str(plain)]) == 0
    assert main([*base, "--no-untrained-control", "--guidance-rescale", "0.7", "--out", str(rescaled)]) == 0
    config = json.loads((rescaled / "rho.json").read_text())["config"]
    assert config["guidance_rescale"] == 0.7
    assert "guidance_rescale" not in json.loads((plain / "rho.json").read_text())["config"]
    images = [next((out / "images").glob("*/generated.png")).read_bytes() for out in (plain, rescaled)]
    assert images[0] != images[1]  # the pipeline read it
    capsys.readouterr()
    for extra, words in (
        (["--guidance-scale", "1"], "--guidance-rescale rescales classifier-free guidance"),
        (["--model", "tiny-flux"], "--guidance-rescale is not read by Flux pipelines"),
    ):
        argv = [*base, "--guidance-rescale", "0.7", *extra, "--out", str(tmp_path / "refused")]
        if "--model" in extra:  # in place of the base's (an option is given once)
            del argv[argv.index("--model") : argv.index("--model") + 2]
        code = main(argv)
        err = capsys.readouterr().err.strip()
        assert code == 2 and "\n" not in err and words in err, err
    assert not (tmp_path / "refused").exists()
