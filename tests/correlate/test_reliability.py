"""Issue 20: what a hostile or unlucky user meets, end to end through ``correlate.py``.

A hand-edited result file is recomputed, not reused; a malformed ``rho.json`` is one exit-2 line
for ``--replot``; temporary files of a killed write are removed by the next run (never a user's
file); Flux's true-CFG scale without a negative prompt is refused; swap's skipped statistics are
one true note.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest
from tiny_helpers import random_image

from nw_adapter.correlate.cli import main
from nw_adapter.correlate.report import build_report, write_json


def run(argv: list, capsys) -> tuple[int, str, str]:
    code = main([str(a) for a in argv])
    captured = capsys.readouterr()
    return code, captured.out, captured.err


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("ref") / "ref.png"
    random_image(3, 48).save(path)
    return path


@pytest.fixture(scope="module")
def sd15_args(tiny_sd15_dir, tiny_ip_adapter_dir) -> list:
    return [
        "--model",
        tiny_sd15_dir,
        "--ip-adapter",
        tiny_ip_adapter_dir,
        "--steps",
        "2",
        "--scheduler",
        "ddim",
    ]


# ------------------------------------------------------------------ result.json


def test_edited_result_file_is_recomputed_not_reused(reference, sd15_args, tmp_path, capsys):
    out = tmp_path / "out"
    argv = ["--image", reference, *sd15_args, "--out", out, "-q"]
    code, _, err = run(argv, capsys)
    assert code == 0, err
    original = json.loads((out / "rho.json").read_text())
    (result_file,) = out.glob("images/*/result.json")
    result = json.loads(result_file.read_text())
    for record in result["records"]:
        record["rho"] = 0.999  # still valid JSON, still well-formed records: only the numbers lie
    result_file.write_text(json.dumps(result, indent=1))
    code, _, err = run(argv, capsys)
    assert code == 0, err
    assert "was changed after it was written" in err and "computed again" in err
    assert "reused" not in err
    again = json.loads((out / "rho.json").read_text())
    assert [r["rho"] for r in again["records"]] == [r["rho"] for r in original["records"]]
    assert again["verdict"] == original["verdict"]
    # a report write killed by SIGKILL leaves its temporary file; the resumed run removes it
    leftovers = [out / ".rho.k2x_9abq.tmp.json", result_file.parent / ".generated.ab12cd34.tmp.png"]
    for path in leftovers:
        path.write_text("half a file")
    code, _, err = run(argv, capsys)  # the recomputed file is reused as it is
    assert code == 0 and "resumed: 1 finished image(s) reused" in err
    assert not any(path.exists() for path in leftovers)


# ------------------------------------------------------------------ --replot


def saved_run(folder: Path) -> Path:
    """A finished run's rho.json (built from synthetic records; --replot loads no model)."""
    records = []
    for step, timestep in ((0, 981.0), (1, 1.0)):
        for head in (0, 1):
            records.append(
                {
                    "reference": "ref-1",
                    "call": 0,
                    "step": step,
                    "timestep": timestep,
                    "alpha": 0.5,
                    "sigma": 0.8,
                    "h_schedule": 1.6,
                    "layer": "up_blocks.1.attn2",
                    "block": "up",
                    "head": head,
                    "half": "cond",
                    "adapter": 0,
                    "image": 0,
                    "scale": 1.0,
                    "num_keys": 4,
                    "key_set": "ip",
                    "bandwidth": 1.0,
                    "rho": 0.5 + 0.1 * step,
                    "rho_perm_null": 0.0,
                    "rho_norm_matched_null": 0.2,
                    "rho_spread_null": 0.3,
                    "kl": 0.1,
                }  # fmt: skip
            )
    images = [
        {"key": "ref-1", "path": "/r/ref.png", "sha256": "ab", "generated": "images/ref-1/generated.png"}
    ]
    report = build_report(records, config={"model": {"model": "tiny"}, "steps": 2}, images=images, targets=())
    folder.mkdir(parents=True, exist_ok=True)
    write_json(folder / "rho.json", report)
    return folder


CORRUPTIONS = {
    "rho is text": lambda d: d["records"][1].update(rho="high"),
    "step is null": lambda d: d["records"][1].update(step=None),
    "images is text": lambda d: d.update(images="ref-1"),
    "records hold numbers": lambda d: d.update(records=[1, 2]),
    "a record misses its block": lambda d: d["records"][1].pop("block"),
    "a record is nested": lambda d: d["records"].append([d["records"][0]]),
    "an extra nested field": lambda d: d["records"][1].update(extra={"a": 1}),
    "config is a list": lambda d: d.update(config=["tiny"]),
    "model is text": lambda d: d["config"].update(model="tiny"),
    "maps outside --out": lambda d: d["images"][0].update(maps="../../maps.safetensors"),
    "half unknown": lambda d: d["records"][1].update(half="both"),
    "timestep null": lambda d: d["records"][1].update(timestep=None),
    "head negative": lambda d: d["records"][1].update(head=-1),
    "reference unknown": lambda d: d["records"][1].update(reference="ref-2"),
}


@pytest.mark.parametrize("name", sorted(CORRUPTIONS))
def test_replot_of_a_malformed_report_is_one_line_exit_2(name, tmp_path, capsys):
    out = saved_run(tmp_path / "out")
    assert run(["--replot", out], capsys)[0] == 0
    document = json.loads((out / "rho.json").read_text())
    CORRUPTIONS[name](document)
    (out / "rho.json").write_text(json.dumps(document))
    code, stdout, err = run(["--replot", out], capsys)
    assert code == 2 and stdout == ""
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("correlate.py: error: --replot"), err
    assert "rho.json" in lines[0] and "rerun the original command" in lines[0]


def test_replot_accepts_nulls_and_extra_scalar_fields(tmp_path, capsys):
    out = saved_run(tmp_path / "out")
    document = json.loads((out / "rho.json").read_text())
    document["records"][0]["rho"] = None
    document["records"][1]["note_of_a_later_version"] = "kept"
    (out / "rho.json").write_text(json.dumps(document))
    code, stdout, err = run(["--replot", out], capsys)
    assert code == 0, err
    assert json.loads((out / "rho.json").read_text())["records"][1]["note_of_a_later_version"] == "kept"


# ------------------------------------------------------------------ leftovers of killed writes


def test_next_run_removes_killed_writes_temporary_files_and_nothing_else(tmp_path, capsys):
    out = saved_run(tmp_path / "out")
    image = out / "images" / "ref-1"
    image.mkdir(parents=True)
    ours = [
        out / ".rho.k2x_9abq.tmp.json",
        out / ".rho.0123abcd.tmp.png",
        out / ".nw-adapter-write-check-ab12cd34",
        image / ".result.a1b2c3d4.tmp.json",
        image / ".x0_step3.zzzz_111.tmp.png",
    ]
    users = [out / ".rho.notes.tmp.json", out / ".mine.k2x_9abq.tmp.json", out / "rho.k2x_9abq.tmp.json",
             image / ".result.a1b2c3d4.tmp.json.bak", out / ".rho.k2x_9abq.tmp.json.keep"]  # fmt: skip
    for path in ours + users:
        path.write_text("x")
    (out / ".rho.dir45678.tmp.json").mkdir()  # a folder is never removed
    code, _, err = run(["--replot", out], capsys)
    assert code == 0, err
    assert [p for p in ours if p.exists()] == []
    assert all(p.read_text() == "x" for p in users) and (out / ".rho.dir45678.tmp.json").is_dir()


@pytest.mark.parametrize("kind", ["compare-swap", "support-sets"])
def test_each_run_kind_removes_its_own_killed_writes_and_nothing_else(tmp_path, kind):
    """A killed ``--compare-swap`` or support-set run leaves its atomic writes' temporary files
    (report.html's too); the next run of that kind removes them, and no user's file."""
    from nw_adapter.correlate.outputs import remove_interrupted_writes

    out = tmp_path / "out"
    sets = out / "sets" / "pair"
    sets.mkdir(parents=True)
    ours = [out / ".report.ab12cd34.tmp.html", out / ".nw-adapter-write-check-ab12cd34"]
    if kind == "compare-swap":
        ours += [out / ".compare_swap.ab12cd34.tmp.json", out / ".compare_swap.zz12cd34.tmp.csv"]
        theirs = [out / ".support.ab12cd34.tmp.json", sets / ".generated.ab12cd34.tmp.png"]  # another run's
    else:
        ours += [out / ".support.ab12cd34.tmp.json", out / ".support_mass.ab12cd34.tmp.png",
                 sets / ".generated.ab12cd34.tmp.png", sets / ".mass.ab12cd34.tmp.png"]  # fmt: skip
        theirs = [out / ".compare_swap.ab12cd34.tmp.json", sets / ".rho.ab12cd34.tmp.json"]
    users = [
        out / ".report.notes.tmp.html",
        out / ".mine.ab12cd34.tmp.html",
        sets / "generated.ab12cd34.tmp.png",
    ]
    for path in ours + theirs + users:
        path.write_text("x")
    removed = remove_interrupted_writes(out, run=kind)
    assert sorted(removed) == sorted(ours) and not any(p.exists() for p in ours)
    assert all(p.read_text() == "x" for p in theirs + users)


def test_temporary_target_and_removal(tmp_path):
    import tempfile

    from nw_adapter.atomic import remove_interrupted_writes, temporary_target

    for name in ("rho.json", "maps.safetensors", "x0_step12.png", "a.tar.gz", "LOCK"):
        stem, suffix = (
            (name.split(".", 1)[0], "") if "." not in name else (Path(name).stem, Path(name).suffix)
        )
        handle, made = tempfile.mkstemp(prefix=f".{stem}.", suffix=f".tmp{suffix}", dir=tmp_path)
        assert temporary_target(Path(made).name) == name
    removed = remove_interrupted_writes(tmp_path, lambda name: name == "rho.json")
    assert [temporary_target(p.name) for p in removed] == ["rho.json"]
    assert len(list(tmp_path.iterdir())) == 4


# ------------------------------------------------------------------ messages that are true


def test_flux_true_cfg_without_negative_prompt_is_refused(tiny_flux_dir, tiny_flux_ip_adapter_dir, reference,
                                                           tmp_path, capsys):  # fmt: skip
    from nw_adapter.models.tiny_flow import CLIP_FOLDER

    base = ["--image", reference, "--model", tiny_flux_dir, "--ip-adapter", tiny_flux_ip_adapter_dir,
            "--image-encoder", tiny_flux_ip_adapter_dir / CLIP_FOLDER, "--steps", "2", "--height", "32",
            "--width", "32", "--out", tmp_path / "out"]  # fmt: skip
    for extra, expected in (
        (["--true-cfg-scale", "4"], "--true-cfg-scale 4 needs --negative-prompt"),
        (["--true-cfg-scale", "0.5", "--negative-prompt", "x"], "--true-cfg-scale 0.5 has no effect"),
    ):
        code, stdout, err = run([*base, *extra], capsys)
        assert code == 2 and stdout == ""
        assert err.strip().splitlines() == [f"correlate.py: error: {err.strip().split('error: ', 1)[1]}"]
        assert expected in err and "Traceback" not in err
    assert not (tmp_path / "out").exists()


def test_swap_schedule_note_says_the_layers_kept_the_nw_head(tiny_sd3_dir, tiny_sd3_ip_adapter_dir, reference,
                                                              tmp_path, capsys):  # fmt: skip
    from nw_adapter.models.tiny_flow import SIGLIP_FOLDER

    argv = [
        "--image",
        reference,
        "--model",
        tiny_sd3_dir,
        "--ip-adapter",
        tiny_sd3_ip_adapter_dir,
        "--image-encoder",
        tiny_sd3_ip_adapter_dir / SIGLIP_FOLDER,
        "--steps",
        "2",
        "--height",
        "32",
        "--width",
        "32",
        "--mode",
        "swap",
        "--bandwidth",
        "schedule",
        "-q",
        "--out",
        tmp_path / "out",
    ]
    import warnings

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        code, _, err = run(argv, capsys)
    assert code == 0, err
    assert not [w for w in caught if "NWRecorder" in str(w.message)]
    notes = [line for line in err.splitlines() if "were not recorded" in line]
    assert len(notes) == 1 and notes[0].startswith("note: ref.png: statistics of")
    assert "infinite at s = 1" in notes[0] and "NW head's output (swap)" in notes[0]
    assert "kept diffusers' output" not in err
    code, _, err = run([*argv[:-1], tmp_path / "out2", "-qq"], capsys)  # --out given once: out2
    assert code == 0 and "were not recorded" not in err


def test_recorder_skip_warning_names_what_the_layer_returned():
    import warnings

    from nw_adapter.integration.config import NWProcessorConfig
    from nw_adapter.integration.recorder import NWRecorder

    for mode, expected in (("observe", "kept diffusers' output"), ("swap", "kept the NW head's output")):
        recorder = NWRecorder(NWProcessorConfig(mode=mode))
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            recorder.skip("up_blocks.1.attn2", ValueError("boom"))
        (warning,) = caught
        assert expected in str(warning.message)
        assert copy.copy(recorder.skipped()["count"]) == 1
