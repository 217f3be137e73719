"""The command-line faults of issue 45's hostile-input run, each as found: one line, exit status 2,
nothing lost or mixed. Every test here failed on the version at commit f073761."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from cli_errors import one_line_error
from PIL import Image

from nw_adapter.atomic import WriteError
from nw_adapter.correlate import loading
from nw_adapter.correlate.cli import main
from nw_adapter.models.tiny_digits import example_image_path

TINY = ["--model", "tiny", "--steps", "1"]


def run(argv: list, capsys) -> tuple[int, str, str]:
    code = main([str(a) for a in argv])
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def one_line(code: int, err: str, *words: str) -> str:
    # a finished reference's progress line (stderr is not a terminal here) comes before the error
    return one_line_error(code, err, *words, after_progress=True)


def digit(d: int) -> str:
    return str(example_image_path(d))


@pytest.fixture
def refs(tmp_path: Path) -> Path:
    folder = tmp_path / "refs"
    folder.mkdir()
    for d in (3, 7):
        shutil.copy(example_image_path(d), folder / f"digit_{d}.png")
    return folder


@pytest.fixture
def no_model_load(monkeypatch) -> list:
    """Records every attempt to resolve or load a model (none is expected)."""
    calls: list = []

    def refuse(*args, **kwargs):
        calls.append(args)
        raise AssertionError("the model was resolved or loaded")

    monkeypatch.setattr(loading, "resolve_spec", refuse)
    monkeypatch.setattr(loading, "build_pipeline", refuse)
    return calls


# --- 1, 2: a run never takes its own outputs as inputs -------------------------------------------


@pytest.mark.parametrize(
    ("where", "words"),
    [
        ("same", ("--out", "is the --image-dir folder")),
        ("inside", ("is inside the --image-dir folder",)),
        ("around", ("contains the --image-dir folder",)),
    ],
)
@pytest.mark.parametrize("swap", [False, True], ids=["rho", "compare-swap"])
def test_an_out_at_an_input_folder_is_refused_before_anything(
    refs, where, words, swap, capsys, no_model_load
):
    """Fault 1 (data loss): ``--image-dir D --out D`` twice took the first run's rho.png as references,
    deleted the finished report, and failed naming a file it had deleted."""
    image_dir = {"same": refs, "inside": refs, "around": refs}[where]
    out = {"same": refs, "inside": refs / "out", "around": refs.parent}[where]
    before = sorted(p.name for p in refs.parent.rglob("*"))
    code, _, err = run(
        [*(["--compare-swap"] if swap else []), "--image-dir", image_dir, *TINY, "--out", out], capsys
    )
    one_line(code, err, *words)
    assert sorted(p.name for p in refs.parent.rglob("*")) == before and not no_model_load


def test_an_out_holding_an_input_file_is_refused(refs, capsys, no_model_load):
    code, _, err = run(["--image", refs / "digit_3.png", *TINY, "--out", refs], capsys)
    one_line(code, err, "contains the --image file")


def test_an_out_inside_a_support_set_folder_is_refused(tmp_path, capsys, no_model_load):
    """Fault 2 (mixing): ``--out`` inside a ``--support-dir`` set folder, run twice: the first run's
    support_mass.png became a third reference of that set."""
    sets = tmp_path / "sets"
    (sets / "pair").mkdir(parents=True)
    for d in (3, 7):
        shutil.copy(example_image_path(d), sets / "pair" / f"digit_{d}.png")
    code, _, err = run(["--support-dir", sets, *TINY, "--out", sets / "pair" / "out"], capsys)
    one_line(code, err, "is inside the --support-dir folder")
    assert not (sets / "pair" / "out").exists()


@pytest.mark.parametrize("run_kind", ["rho", "compare-swap", "support-sets"])
@pytest.mark.parametrize("where", ["shipped weights", "local --model folder"])
def test_an_out_among_a_models_files_is_refused_before_anything(
    run_kind, where, refs, tmp_path, capsys, no_model_load
):
    """--model tiny --out nw_adapter/models/weights/tiny_digits wrote the run's report and images/
    into the installed package, among the model's own files."""
    from nw_adapter.correlate.outputs import SHIPPED_WEIGHTS

    if where == "shipped weights":
        model, out = ["--model", "tiny"], SHIPPED_WEIGHTS / "tiny_digits" / "not_written"
    else:
        (tmp_path / "my_model").mkdir()
        model, out = ["--model", tmp_path / "my_model"], tmp_path / "my_model"
    source = {
        "rho": ["--image-dir", refs],
        "compare-swap": ["--compare-swap", "--image-dir", refs],
        "support-sets": ["--support-set", f"{refs / 'digit_3.png'},{refs / 'digit_7.png'}"],
    }[run_kind]
    code, _, err = run([*source, *model, "--steps", "1", "--out", out], capsys)
    one_line(code, err, "a run never writes among a model's files")
    assert not (SHIPPED_WEIGHTS / "tiny_digits" / "not_written").exists() and not no_model_load
    if where != "shipped weights":
        assert list((tmp_path / "my_model").iterdir()) == []


# --- 3: units counted by content -------------------------------------------------------------------


def test_support_sets_of_the_same_content_are_one_set(tmp_path, capsys):
    """Fault 3: the same set given twice, or the same pixels as PNG and BMP, were two units (identical
    generations, n = 2, a zero-width interval). Also fault 7's missing conversion note."""
    bmp, cmyk = tmp_path / "three.bmp", tmp_path / "one.jpg"
    Image.open(example_image_path(3)).save(bmp)
    Image.open(example_image_path(1)).convert("CMYK").save(cmyk)
    argv = ["--support-set", f"{digit(3)},{digit(7)}", "--support-set", f"{digit(7)},{bmp}"]
    argv += ["--support-set", f"{digit(3)},{digit(7)}", "--support-set", f"{cmyk},{digit(2)}"]
    code, _, err = run([*argv, *TINY, "--out", tmp_path / "out"], capsys)
    assert code == 0, err
    sets = [entry["key"] for entry in json.loads((tmp_path / "out" / "support.json").read_text())["sets"]]
    assert sets == ["set00", "set03"]
    assert "set 'set01' holds the same references as set 'set00'" in err
    assert "set 'set02' holds the same references as set 'set00'" in err
    assert "one.jpg: CMYK converted to RGB" in err  # the rho run's note, printed once


@pytest.mark.parametrize("entry", ["dangling link", "folder"])
@pytest.mark.parametrize("run_kind", ["rho", "support-dir"])
def test_an_entry_with_an_image_name_that_is_no_file_is_refused(
    entry, run_kind, tmp_path, capsys, no_model_load
):
    """A dangling link or a folder named like an image in a references folder was skipped without a
    word (one reference fewer; a --support-dir set one smaller)."""
    folder = tmp_path / "sets" / "pair"
    folder.mkdir(parents=True)
    for d in (3, 7):
        shutil.copy(example_image_path(d), folder / f"digit_{d}.png")
    if entry == "dangling link":
        (folder / "digit_1.png").symlink_to(folder / "moved.png")
    else:
        (folder / "digit_1.png").mkdir()
    source = ["--image-dir", folder] if run_kind == "rho" else ["--support-dir", tmp_path / "sets"]
    code, _, err = run([*source, *TINY, "--out", tmp_path / "out"], capsys)
    words = "dangling symbolic link" if entry == "dangling link" else "not an image"
    one_line(code, err, "'digit_1.png'", words)
    assert not (tmp_path / "out").exists() and not no_model_load


def test_reference_images_of_the_same_pixels_are_one_reference(tmp_path):
    from nw_adapter.correlate.images import collect_image_paths, validate_images

    Image.open(example_image_path(3)).save(tmp_path / "three.bmp")
    (info,) = validate_images(collect_image_paths([digit(3), tmp_path / "three.bmp"]))
    assert info.duplicates == ((tmp_path / "three.bmp").resolve(),)
    assert "three.bmp has the same pixels" in info.notes[-1]


# --- the lock and the input checks before the model ------------------------------------------------


@pytest.mark.parametrize(
    "argv",
    [
        ["--image", digit(3)],
        ["--compare-swap", "--image", digit(3)],
        ["--support-set", f"{digit(3)},{digit(7)}"],
    ],
    ids=["rho", "compare-swap", "support-sets"],
)
def test_a_locked_out_is_refused_before_the_model(argv, tmp_path, capsys, no_model_load):
    """Support-set mode took the lock after resolving (and the rho run after loading) the model."""
    from nw_adapter.correlate.outputs import OutputLock

    out = tmp_path / "out"
    with OutputLock(out):
        code, _, err = run([*argv, *TINY, "--out", out], capsys)
    one_line(code, err, "another correlate.py run is writing there")
    assert not no_model_load


def test_a_reference_the_digit_judge_cannot_read_is_refused_before_the_model(tmp_path, capsys, no_model_load):
    """The judge raised after the generation on a reference that is not 32 x 32."""
    big = tmp_path / "big.png"
    Image.open(example_image_path(3)).resize((48, 48)).save(big)
    code, _, err = run(["--support-set", f"{big},{digit(7)}", *TINY, "--out", tmp_path / "out"], capsys)
    one_line(code, err, "48 x 48 pixels", "reads 32 x 32 images")
    assert not (tmp_path / "out").exists()


# --- devices and model folders ------------------------------------------------------------------


@pytest.mark.parametrize("device", ["meta", "xla", "cuda:x", "gpu"])
def test_a_device_this_tool_does_not_compute_on_is_one_line(device, tmp_path, capsys, no_model_load):
    """``--device meta`` / ``--device xla`` ended in tracebacks at the first copy to the device."""
    code, _, err = run(["--image", digit(3), *TINY, "--device", device, "--out", tmp_path / "out"], capsys)
    one_line(code, err, f"--device must be auto, cpu, mps, cuda or cuda:N, got '{device}'")


def test_a_model_folder_without_unet_weights_is_one_line_naming_the_safetensors_file(tmp_path, capsys):
    """diffusers printed its own line first, and the message named the .bin file it tried last."""
    from nw_adapter.correlate.spec import TINY_DIGITS_DIR

    model = tmp_path / "model"
    shutil.copytree(TINY_DIGITS_DIR, model)
    for weights in (model / "unet").glob("*.safetensors"):
        weights.unlink()
    argv = ["--image", digit(3), "--model", model, "--ip-adapter", "tiny", "--steps", "1"]
    code, _, err = run([*argv, "--out", tmp_path / "out"], capsys)
    one_line(code, err, f"'{model / 'unet'}' has no weights (diffusion_pytorch_model.safetensors)")
    assert ".bin" not in err and not (tmp_path / "out").exists()


def _damaged(tmp_path: Path, kind: str) -> tuple[list, str]:
    """A copy of an embedded model's files with one damaged, the options naming it, and the words."""
    from nw_adapter.correlate.spec import TINY_DIGITS_DIR
    from nw_adapter.models import tiny_flux_digits

    if kind == "adapter":
        adapter = tmp_path / "adapter"
        shutil.copytree(TINY_DIGITS_DIR / "models", adapter / "models")
        weights = adapter / "models" / "ip-adapter_sd15.safetensors"
        weights.write_bytes(weights.read_bytes()[:30000])
        return [*TINY, "--ip-adapter", adapter], f"--ip-adapter '{adapter}': '{weights}' is not a complete"
    if kind == "image encoder":
        encoder = tmp_path / "encoder"
        shutil.copytree(Path(tiny_flux_digits.SHIPPED_DIR) / "ip-adapter" / "image_encoder", encoder)
        weights = encoder / "model.safetensors"
        weights.write_bytes(b"")
        argv = ["--model", "tiny-flux-digits", "--image-encoder", encoder, "--steps", "1"]
        return argv, f"--image-encoder '{encoder}': '{weights}' is empty"
    model = tmp_path / "model"
    shutil.copytree(TINY_DIGITS_DIR, model, ignore=shutil.ignore_patterns("examples"))
    argv = ["--model", model, "--ip-adapter", "tiny", "--steps", "1"]
    if kind == "model index":
        (model / "model_index.json").write_text("{")
        return argv, f"--model '{model}': its model_index.json is not valid JSON"
    weights = model / "unet" / "diffusion_pytorch_model.safetensors"
    weights.write_bytes(weights.read_bytes()[:1000])
    return argv, f"--model '{model}': '{weights}' is not a complete safetensors file (1000 bytes"


@pytest.mark.parametrize("kind", ["adapter", "image encoder", "model weights", "model index"])
@pytest.mark.parametrize("run_name", ["rho", "compare-swap", "support"])
def test_damaged_local_weights_are_one_line_before_the_pipeline_loads(
    kind, run_name, tmp_path, capsys, monkeypatch
):
    """A truncated or empty local weight file (the adapter's, its image encoder's, a pipeline
    component's) or a broken model_index.json: one line naming the option and the file, before the
    pipeline loads (before, the adapter's after the pipeline had loaded, the others as diffusers'
    error after ~10 s)."""

    def refuse(*args, **kwargs):
        raise AssertionError("the pipeline was loaded")

    monkeypatch.setattr(loading, "build_pipeline", refuse)
    options, words = _damaged(tmp_path, kind)
    inputs = {
        "rho": ["--image", digit(3)],
        "compare-swap": ["--compare-swap", "--image", digit(3)],
        "support": ["--support-set", f"{digit(3)},{digit(7)}"],
    }[run_name]
    code, _, err = run([*inputs, *options, "--out", tmp_path / "out"], capsys)
    one_line(code, err, words)
    assert not (tmp_path / "out").exists()


# --- --replot --------------------------------------------------------------------------------------


def test_replot_of_records_of_two_models_is_one_line(tmp_path, capsys):
    out = tmp_path / "out"
    assert main(["--image", digit(3), *TINY, "--no-untrained-control", "--out", str(out), "-qq"]) == 0
    capsys.readouterr()
    saved = json.loads((out / "rho.json").read_text())
    for record in saved["records"][::2]:
        record["model"] = "/elsewhere/another-model"
    (out / "rho.json").write_text(json.dumps(saved))
    code, stdout, err = run(["--replot", out], capsys)
    one_line(code, err, "rho.json mixes the records of 2 models", "separate --out")
    assert stdout == ""


def test_replot_of_a_file_says_it_is_no_folder(tmp_path, capsys):
    """--replot FILE said "cannot inspect 'FILE/rho.json' (Not a directory); fix its permissions"."""
    plain = tmp_path / "notes.txt"
    plain.write_text("not a run")
    code, stdout, err = run(["--replot", plain], capsys)
    one_line(code, err, f"'{plain}' is a file, not a folder", "pass --replot a folder")
    assert "permissions" not in err and stdout == ""


# --- a failed write removes its partial siblings and says what was kept ---------------------------


def test_a_failed_compare_swap_write_keeps_no_rows_file(tmp_path, capsys, monkeypatch):
    """``compare_swap.csv`` stayed without its ``.json``, and the line said "finished images are kept"."""
    import nw_adapter.correlate.report as report

    def fail(path, document):
        raise WriteError(f"cannot write {Path(path).name} (No space left on device)")

    monkeypatch.setattr(report, "write_json", fail)
    out = tmp_path / "out"
    code, _, err = run(
        ["--compare-swap", "--image", digit(3), *TINY, "--swap-rules", "matched", "--out", out], capsys
    )
    line = one_line(code, err, "compare_swap.json", "an unfinished comparison is not kept")
    assert "finished images" not in line
    assert not out.exists()  # nothing of the run: its rows file, its lock file, the folder it made


def test_a_failed_report_write_keeps_the_images_and_no_report_in_part(tmp_path, capsys, monkeypatch):
    import nw_adapter.analysis.records as records

    written = records.save_figure

    def fail(figure, path, *args, **kwargs):  # the write of rho.png, whichever function draws it
        if Path(path).name == "rho.png":
            raise WriteError("cannot write rho.png (No space left on device)")
        return written(figure, path, *args, **kwargs)

    monkeypatch.setattr(records, "save_figure", fail)
    out = tmp_path / "out"
    code, _, err = run(["--image", digit(3), *TINY, "--no-untrained-control", "--out", out], capsys)
    one_line(code, err, "rho.png", "finished images are kept")
    assert not any((out / name).exists() for name in ("rho.json", "rho.csv", "rho.png"))
    assert len(list((out / "images").glob("*/result.json"))) == 1


def test_a_failed_support_set_write_removes_the_run(tmp_path, capsys, monkeypatch):
    import nw_adapter.correlate.support_report as support_report

    def fail(*args, **kwargs):
        raise WriteError("cannot write support_mass.png (No space left on device)")

    monkeypatch.setattr(support_report, "plot_sweep", fail)
    out = tmp_path / "out"
    code, _, err = run(["--support-set", f"{digit(3)},{digit(7)}", *TINY, "--out", out], capsys)
    one_line(code, err, "support_mass.png", "an unfinished support-set run is not kept")
    assert not out.exists()  # nothing of the run: its sets, its lock file, the folder it made
