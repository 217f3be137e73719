"""correlate.py end to end on the tiny model with real photographs (scikit-learn's samples).

Each test runs the real command line in-process (``nw_adapter.correlate.cli.main``) with 2-3 steps at
32 x 32 pixels and checks the files it writes, their schema, and that the printed table is the
JSON's table. Option tests compare against the baseline run so that an ignored option fails.
"""

from __future__ import annotations

import contextlib
import csv
import hashlib
import io
import json
import math
import os
from pathlib import Path

import pytest
from PIL import Image
from sklearn.datasets import load_sample_image
from subprocess_limits import SUBPROCESS_TIMEOUT_S

from nw_adapter.correlate.cli import main
from nw_adapter.correlate.report import STAT_FIELDS, format_table, format_verdict, parse_table

RECORD_KEYS = {
    "reference", "call", "step", "timestep", "alpha", "sigma", "h_schedule", "layer", "block", "head", "half",
    "adapter", "image", *STAT_FIELDS,
}  # fmt: skip


@pytest.fixture(scope="module")
def photos(tmp_path_factory) -> dict[str, Path]:
    """The two real photographs bundled with scikit-learn, saved as PNG and JPEG."""
    folder = tmp_path_factory.mktemp("photos")
    china = folder / "china.png"
    Image.fromarray(load_sample_image("china.jpg")).save(china)
    flower = folder / "flower.jpg"
    Image.fromarray(load_sample_image("flower.jpg")).save(flower, quality=90)
    return {"china": china, "flower": flower}


@pytest.fixture(scope="module")
def model_args(tiny_sd15_dir, tiny_ip_adapter_dir) -> list[str]:
    return ["--model", str(tiny_sd15_dir), "--ip-adapter", str(tiny_ip_adapter_dir)]


BASE = ["--steps", "2", "--scheduler", "ddim", "--seed", "0"]


def _without(argv: list, option: str) -> list:
    """``argv`` without ``option`` and its value (an option is given once: twice is refused)."""
    if option not in argv:
        return list(argv)
    at = argv.index(option)
    return argv[:at] + argv[at + 2 :]


def run(argv: list, capsys) -> tuple[int, str, str]:
    code = main([str(a) for a in argv])
    captured = capsys.readouterr()
    return code, captured.out, captured.err


@pytest.fixture(scope="module")
def baseline(tmp_path_factory, photos, model_args) -> dict:
    """Both photos, 2 DDIM steps, maps stored: the run most tests inspect."""
    out = tmp_path_factory.mktemp("baseline") / "out"
    argv = ["--image", photos["china"], "--image", photos["flower"], *model_args, *BASE, "--store-maps"]
    argv += ["--out", out]
    stdout, stderr = io.StringIO(), TerminalStringIO()
    with contextlib.redirect_stdout(stdout), contextlib.redirect_stderr(stderr):
        code = main([str(a) for a in argv])
    assert code == 0, stderr.getvalue()
    return {"out": out, "argv": argv, "stdout": stdout.getvalue(), "stderr": stderr.getvalue()}


class TerminalStringIO(io.StringIO):
    """A captured stderr that says it is a terminal (progress bars are drawn only on terminals)."""

    def isatty(self) -> bool:
        return True


def verdict_start(lines: list[str], *, detail: bool = False) -> int:
    """Index of the verdict's conclusion line; its details follow, indented, to the end (without
    ``-v``: then one last line saying where the details are)."""
    index = next(i for i, line in enumerate(lines) if line.startswith("verdict: "))
    body = lines[index + 1 :]
    if not detail:
        assert body[-1].startswith("details: -v prints every part's interval, p and n"), body[-1:]
        body = body[:-1]
    assert all(line.startswith("  ") for line in body)
    return index


def printed_table(stdout: str, *, detail: bool = False) -> tuple[str, str]:
    """The printed table and verdict (with ``-v`` the legend between them checked: one line per column
    shown; without it no legend, and the verdict without its last line, where the details are)."""
    lines = stdout.strip().splitlines()
    assert lines[0].startswith("attention vs NW weights") and lines[1].startswith("control: ")
    index = verdict_start(lines, detail=detail)
    if not detail:
        assert not any(line.startswith("legend (") for line in lines)
        first = 3 if lines[2].startswith("note: ") else 2
        return "\n".join(lines[first:index]), "\n".join(lines[index:-1])
    legend = next(i for i, line in enumerate(lines) if line.startswith("legend (means over layers"))
    table = lines[2:legend]
    assert [line.split()[0] for line in lines[legend + 1 : index]] == table[0].split()
    return "\n".join(table), "\n".join(lines[index:])


def key_of(report: dict, stem: str) -> str:
    return next(i["key"] for i in report["images"] if i["key"].startswith(stem))


def test_files_and_schema(baseline, photos) -> None:
    out = baseline["out"]
    report = json.loads((out / "rho.json").read_text())
    assert report["schema"] == "nw-adapter/rho" and report["schema_version"] == 1
    for package in ("torch", "diffusers", "transformers", "nw_adapter", "accelerate"):
        assert report["versions"][package]
    config = report["config"]
    assert (
        config["steps"] == 2
        and config["scheduler"] == "ddim"
        and config["scheduler_class"] == "DDIMScheduler"
    )
    assert config["bandwidth"] == "matched" and config["mode"] == "observe" and config["device"] == "cpu"
    assert config["dtype"] == "float32" and config["store_maps"] is True
    assert config["model"]["weight_name"] == "ip-adapter_sd15.safetensors"
    assert [Path(i["path"]).name for i in report["images"]] == ["china.png", "flower.jpg"]
    for info in report["images"]:
        assert info["sha256"] == hashlib.sha256(Path(info["path"]).read_bytes()).hexdigest()
        folder = out / "images" / info["key"]
        assert info["generated"] == f"images/{info['key']}/generated.png"
        with Image.open(out / info["generated"]) as generated:
            assert generated.size == (32, 32) and generated.mode == "RGB"
        for name in ("result.json", "maps.safetensors", "attention_maps.png"):
            assert (folder / name).is_file()
    fitted = any(r.get("h_eff") is not None for r in report["records"])  # bandwidth.png needs h_eff
    assert sorted(p.name for p in out.iterdir()) == [
        ".nw-adapter.lock",
        *(["bandwidth.png"] if fitted else []),
        "images",
        "report.html",
        "rho.csv",
        "rho.json",
        "rho.png",
    ]
    with Image.open(out / "rho.png") as plot:
        assert plot.format == "PNG"
    records = report["records"]
    assert {r["reference"] for r in records} == {i["key"] for i in report["images"]}
    assert {r["block"] for r in records} == {"down", "mid", "up"}
    assert {r["half"] for r in records} == {"uncond", "cond"} and report["half"] == "cond"
    assert sorted({(r["step"], r["timestep"]) for r in records}) == [(0, 501.0), (1, 1.0)]
    for record in records:
        assert RECORD_KEYS <= set(record)
        for name in STAT_FIELDS:
            assert record[name] is None or isinstance(record[name], float)
    cond = [r for r in records if r["half"] == "cond"]
    assert all(r["rho"] is not None and -1 <= r["rho"] <= 1 for r in cond)
    assert all(r["neff_attn"] >= 1 and r["neff_nw"] >= 1 for r in cond)


def test_progress_bars_are_shown_on_a_terminal(baseline) -> None:
    assert "images (process 0)" in baseline["stderr"]  # over the reference images
    assert "2/2 [" in baseline["stderr"]  # diffusers' bar over the denoising steps


def test_captured_output_has_clean_lines_notes_and_no_library_noise(tmp_path, photos, model_args) -> None:
    """stdout and stderr into one pipe (as in a log file): no bars, no library warnings, notes kept."""
    import subprocess
    import sys

    rgba = tmp_path / "rgba.png"
    Image.open(photos["china"]).convert("RGBA").resize((48, 32)).save(rgba)
    script = Path(__file__).resolve().parents[2] / "scripts" / "correlate.py"
    argv = [
        sys.executable,
        str(script),
        "--image",
        str(rgba),
        *map(str, model_args),
        *BASE,
        "--out",
        str(tmp_path / "o"),
    ]
    env = {k: v for k, v in os.environ.items() if not k.endswith("_VERBOSITY")}
    env["PYTHONPATH"] = str(script.parents[1])
    proc = subprocess.run(argv + ["-q"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
                          timeout=SUBPROCESS_TIMEOUT_S)  # fmt: skip
    assert proc.returncode == 0, proc.stdout
    assert "\r" not in proc.stdout and "%|" not in proc.stdout
    lines = proc.stdout.splitlines()
    assert lines[0].startswith("note: rgba.png: RGBA alpha channel composited")  # -q keeps the notes
    assert lines[1].startswith("attention vs NW weights") and verdict_start(lines) > 1
    for noise in ("torchvision", "kept in float32", "Loading", "Writing model shards", "Warning"):
        assert noise not in proc.stdout
    stdout, stderr = io.StringIO(), TerminalStringIO()  # -qq: not even a note, not even on a terminal
    with contextlib.redirect_stdout(stdout), contextlib.redirect_stderr(stderr):
        assert main(argv[2:] + ["-qq"]) == 0
    assert stderr.getvalue() == "" and verdict_start(stdout.getvalue().splitlines()) > 0


def test_printed_table_equals_the_json(baseline) -> None:
    report = json.loads((baseline["out"] / "rho.json").read_text())
    table, verdict_line = printed_table(baseline["stdout"])
    assert table == format_table(report["table"])
    assert verdict_line == format_verdict(report["verdict"], detail=False)
    parsed = parse_table(table)
    assert [row["step"] for row in parsed] == [row["step"] for row in report["table"]] == [0, 1]
    for shown, row in zip(parsed, report["table"], strict=True):
        nulls = ("rho_perm_null", "rho_norm_matched_null", "rho_spread_null")
        for key in ("rho", *nulls, "frac_rho_gt_0_9"):
            assert shown[key] == pytest.approx(row[key], abs=5e-4)
        assert shown["kl"] == pytest.approx(row["kl"], abs=5e-5)
        members = [r for r in report["records"] if r["step"] == row["step"] and r["half"] == "cond"]
        assert row["rho"] == pytest.approx(sum(r["rho"] for r in members) / len(members))
        assert row["count"] == len(members) == 2 * 4 * 2  # references x layers x heads


def test_csv_matches_json(baseline) -> None:
    out = baseline["out"]
    report = json.loads((out / "rho.json").read_text())
    with (out / "rho.csv").open() as handle:
        rows = list(csv.DictReader(handle))
    assert len(rows) == len(report["records"])
    for row, record in zip(rows, report["records"], strict=True):
        assert row["reference"] == record["reference"] and int(row["step"]) == record["step"]
        if record["rho"] is None:
            assert row["rho"] == ""
        else:
            assert math.isclose(float(row["rho"]), record["rho"], rel_tol=1e-12)


def test_resume_recomputes_only_the_missing_image(baseline, capsys) -> None:
    out = baseline["out"]
    before = (out / "rho.json").read_text()
    report = json.loads(before)
    china, flower = key_of(report, "china"), key_of(report, "flower")
    kept = (out / "images" / china / "result.json").stat().st_mtime_ns
    (out / "images" / flower / "result.json").unlink()  # as if interrupted during the second image
    code, stdout, err = run(baseline["argv"], capsys)
    assert code == 0 and "resumed: 1 finished image(s)" in err
    assert stdout == baseline["stdout"]
    assert (out / "images" / china / "result.json").stat().st_mtime_ns == kept
    assert (out / "rho.json").read_text() == before  # recomputed image gives identical numbers


def test_store_maps_figure_and_tensors(baseline) -> None:
    from safetensors import safe_open

    out = baseline["out"]
    report = json.loads((out / "rho.json").read_text())
    info = report["images"][0]
    with safe_open(out / info["maps"], "pt") as maps:
        names = list(maps.keys())
        assert any(n.endswith("/attn") for n in names) and any(n.endswith("/nw") for n in names)
        steps = {int(n.split("/")[1].removeprefix("step")) for n in names}
        assert steps == {0, 1}  # the reported steps
        first = maps.get_tensor(names[0])
        assert (
            first.shape[0] == 2 and first.shape[1] == 1 and first.shape[-1] == 4
        )  # CFG rows, head mean, keys
    with Image.open(out / info["attention_maps"]) as figure:
        assert figure.format == "PNG" and figure.width > figure.height


def test_maps_rows_show_the_x0_estimate_of_their_step(baseline) -> None:
    """x0 at the last DDIM step (t=1) is nearly the final image; at t=501 it is not yet."""
    import numpy as np

    out = baseline["out"]
    folder = out / json.loads((out / "rho.json").read_text())["images"][0]["generated"]
    folder = folder.parent
    final = np.asarray(Image.open(folder / "generated.png"), dtype=float)
    gaps = {}
    for step in (0, 1):
        with Image.open(folder / f"x0_step{step}.png") as preview:
            assert preview.size == (32, 32)
            gaps[step] = np.abs(np.asarray(preview, dtype=float) - final).mean()
    assert gaps[1] < 2.0 < gaps[0], gaps  # pixel values 0..255


def test_replot_redraws_everything_from_the_saved_files(baseline, monkeypatch, capsys) -> None:
    import nw_adapter.correlate.loading as loading

    def no_model(*args, **kwargs):
        raise AssertionError("--replot must not load a model")

    monkeypatch.setattr(loading, "build_pipeline", no_model)
    out = baseline["out"]
    saved = (out / "rho.json").read_text()
    drawn = [out / "rho.png", *(out / "images").glob("*/attention_maps.png")]
    assert len(drawn) == 3
    for path in drawn:
        path.unlink()
    code, stdout, err = run(["--replot", out], capsys)
    assert code == 0, err
    assert stdout == baseline["stdout"]  # same table and verdict, nothing recomputed
    assert (out / "rho.json").read_text() == saved
    for path in drawn:
        with Image.open(path) as img:
            assert img.format == "PNG"
    code, stdout, err = run(["--replot", out, "-v"], capsys)  # -v: the legend and the full verdict
    report = json.loads(saved)
    table, verdict_lines = printed_table(stdout, detail=True)
    assert code == 0 and table == format_table(report["table"])
    assert verdict_lines == format_verdict(report["verdict"]) and "  legend:" in verdict_lines
    code, _, err = run(["--replot", out.parent / "nothing-here"], capsys)
    assert code == 2 and "no rho.json there" in err


def test_options_reach_the_run(tmp_path, photos, model_args, capsys) -> None:
    rgba = tmp_path / "china_rgba.png"
    Image.open(photos["china"]).convert("RGBA").save(rgba)
    out = tmp_path / "out"
    argv = [
        "--image", rgba, *model_args, "--steps", "3", "--scheduler", "euler", "--mode", "swap",
        "--bandwidth", "2.0", "--layers", "up", "--guidance-scale", "1.0", "--ip-scale", "0.5",
        "--all-steps", "--height", "64", "--width", "32", "--out", out,
    ]  # fmt: skip
    code, stdout, err = run(argv, capsys)
    assert code == 0
    assert "note: china_rgba.png: RGBA alpha channel composited over a white background" in err
    report = json.loads((out / "rho.json").read_text())
    records = report["records"]
    assert {r["block"] for r in records} == {"up"}  # --layers up
    assert {r["bandwidth"] for r in records} == {2.0}  # --bandwidth 2.0
    assert {r["half"] for r in records} == {"all"}  # --guidance-scale 1 (no CFG)
    assert {r["scale"] for r in records} == {0.5}  # --ip-scale 0.5
    assert report["config"]["scheduler_class"] == "EulerDiscreteScheduler"
    assert sorted({r["step"] for r in records}) == [0, 1, 2]  # --steps 3
    assert [r["step"] for r in report["table"]] == [0, 1, 2]  # --all-steps
    assert report["config"]["mode"] == "swap"
    generated = out / report["images"][0]["generated"]
    with Image.open(generated) as image:
        assert image.size == (32, 64)  # --width 32 --height 64
    assert len(printed_table(stdout)[0].splitlines()) == 1 + 3


@pytest.mark.parametrize(
    "change",
    [["--mode", "swap"], ["--seed", "1"], ["--prompt", "a red sports car"], ["--ip-scale", "0.0"]],
    ids=["mode", "seed", "prompt", "ip-scale"],
)
def test_options_change_the_generated_image(change, baseline, photos, model_args, tmp_path, capsys) -> None:
    out = tmp_path / "out"
    code, _, _ = run(
        [
            "--image",
            photos["flower"],
            *model_args,
            *_without(BASE, change[0]),
            "--quiet",
            *change,
            "--out",
            out,
        ],
        capsys,
    )
    assert code == 0
    report = json.loads((out / "rho.json").read_text())
    base = json.loads((baseline["out"] / "rho.json").read_text())
    key = key_of(report, "flower")
    changed = (out / "images" / key / "generated.png").read_bytes()
    original = (baseline["out"] / "images" / key / "generated.png").read_bytes()
    assert changed != original
    assert report["records"] and report["config"] != base["config"]


def test_maps_and_x0_previews_do_not_change_the_generation(baseline, photos, model_args, tmp_path, capsys):
    """The baseline stored maps and captured x0 estimates; without them the image is the same, bit for bit."""
    out = tmp_path / "out"
    code, _, _ = run(["--image", photos["flower"], *model_args, *BASE, "--quiet", "--out", out], capsys)
    assert code == 0
    key = key_of(json.loads((out / "rho.json").read_text()), "flower")
    plain = (out / "images" / key / "generated.png").read_bytes()
    assert plain == (baseline["out"] / "images" / key / "generated.png").read_bytes()
    assert not list((out / "images" / key).glob("x0_step*.png"))


def test_model_tiny_runs_the_shipped_trained_model(tmp_path, photos, monkeypatch, capsys) -> None:
    """``--model tiny`` loads the trained digits model shipped in the package (nothing is written
    to the cache; the random builders serve the fixtures only)."""
    from PIL import Image

    monkeypatch.setenv("NW_ADAPTER_CACHE", str(tmp_path / "cache"))
    out = tmp_path / "out"
    code, stdout, err = run(
        ["--image", photos["flower"], "--model", "tiny", *BASE, "--quiet", "--out", out], capsys
    )
    assert code == 0 and err == ""  # --quiet: no progress bars, no notes
    assert not (tmp_path / "cache").exists() and verdict_start(stdout.splitlines()) > 0
    report = json.loads((out / "rho.json").read_text())
    assert report["config"]["model"]["model"] == "tiny" and report["config"]["model"]["ip_adapter"] == "tiny"
    key = key_of(report, "flower")
    assert Image.open(out / "images" / key / "generated.png").size == (32, 32)
    assert report["records"]
