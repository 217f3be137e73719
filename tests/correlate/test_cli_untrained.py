"""correlate.py and the untrained-adapter control: on by default, ``--no-untrained-control`` turns it
off, ``--untrained-seed`` seeds it, ``--control-draws`` sets its draws, and all are part of the run's
fingerprint (a resumed run never mixes results with and without the control); ``rho.json`` carries
the control's meta."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from nw_adapter.correlate.cli import main, parse_args
from nw_adapter.correlate.options import CLIError, Resolved, fingerprint
from nw_adapter.correlate.rho_cli import processor_config
from nw_adapter.integration.schema import control_columns


@pytest.fixture
def image(tmp_path: Path) -> Path:
    path = tmp_path / "ref.png"
    Image.fromarray((np.random.RandomState(0).rand(32, 32, 3) * 255).astype("uint8")).save(path)
    return path


def _identity(argv: list[str]) -> str:
    args = parse_args(argv)
    resolved = Resolved(
        model={"model": "tiny"}, resolved_model={"model": "tiny"}, device="cpu", dtype="float32"
    )
    return fingerprint(args.run.name, args, resolved)


def test_default_on_flag_off_and_seed_in_the_config_and_the_fingerprint(image: Path) -> None:
    base = ["--image", str(image), "--model", "tiny"]
    on, off = parse_args(base), parse_args([*base, "--no-untrained-control"])
    assert processor_config(on).untrained_control is True and processor_config(on).untrained_seed == 0
    assert processor_config(off).untrained_control is False
    assert processor_config(parse_args([*base, "--untrained-seed", "7"])).untrained_seed == 7
    assert processor_config(on).untrained_draws == 3
    assert processor_config(parse_args([*base, "--control-draws", "1"])).untrained_draws == 1
    identities = {
        _identity(base),
        _identity([*base, "--no-untrained-control"]),
        _identity([*base, "--untrained-seed", "7"]),
        _identity([*base, "--control-draws", "2"]),
    }
    assert len(identities) == 4
    # the seed and the draws of a control that is off are refused, not ignored
    for extra in (["--untrained-seed", "7"], ["--control-draws", "5"]):
        with pytest.raises(CLIError, match="--no-untrained-control turns off; drop one of them"):
            parse_args([*base, "--no-untrained-control", *extra])


def test_bad_untrained_seed_is_one_line_exit_2(image: Path, capsys) -> None:
    code = main(["--image", str(image), "--model", "tiny", "--untrained-seed", "-3"])
    err = capsys.readouterr().err
    assert code == 2 and "--untrained-seed" in err and "Traceback" not in err


@pytest.mark.parametrize("value", ["0", "-1", "2.5", "three", "65"])
def test_bad_control_draws_is_one_line_exit_2(image: Path, capsys, value: str) -> None:
    code = main(["--image", str(image), "--model", "tiny", "--control-draws", value])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and "--control-draws" in err[0] and "Traceback" not in err[0]


def test_runs_with_and_without_the_control(
    image: Path, tmp_path: Path, tiny_sd15_dir, tiny_ip_adapter_dir, capsys
) -> None:
    common = ["--image", str(image), "--model", str(tiny_sd15_dir), "--ip-adapter", str(tiny_ip_adapter_dir)]
    common += ["--steps", "2", "--scheduler", "ddim", "-qq"]
    reports = {}
    on_args = ["--control-draws", "2", "--untrained-seed", "4"]
    variants = (("on", on_args), ("off", ["--no-untrained-control"]))
    for name, extra in variants:
        out = tmp_path / name
        assert main([*common, *extra, "--out", str(out)]) == 0, capsys.readouterr().err
        reports[name] = (out, json.loads((out / "rho.json").read_text()))
    on_out, on = reports["on"]
    off_out, off = reports["off"]
    assert on["config"]["untrained_control"] is True and off["config"]["untrained_control"] is False
    assert all(all(n in r for n in control_columns(2)) for r in on["records"])
    assert not any(n in r for r in off["records"] for n in control_columns(1))
    assert any(r["rho_control_1"] is not None for r in on["records"])
    assert "key_scale_1" in (on_out / "rho.csv").read_text().splitlines()[0].split(",")
    assert on["control"] == {
        "kind": "per-layer",
        "draws": 2,
        "seeds": [4, 5],
        "matched": "keys rescaled per layer and head to the trained keys' RMS norm",
    }
    assert "control" not in off
    assert on["table"][0]["control_draws"] == 2 and on["table"][0]["rho_control"] is not None
    # the control only observes: the generated images are the same
    generated = [out / report["images"][0]["generated"] for out, report in reports.values()]
    assert generated[0].read_bytes() == generated[1].read_bytes()
    # resuming the "on" folder without the control recomputes, never mixes
    capsys.readouterr()
    assert main([*common[:-1], "--no-untrained-control", "--out", str(on_out)]) == 0
    resumed = json.loads((on_out / "rho.json").read_text())
    assert not any(n in r for r in resumed["records"] for n in control_columns(1))


def test_end_to_end_control_from_the_command_line(
    image: Path, tmp_path: Path, tiny_sd15_dir, tiny_ip_adapter_dir, capsys
) -> None:
    """``--end-to-end-control``: the control columns come from the untrained passes (the per-layer
    control is off), rho.json names the kind, and the generated image is the observed run's."""
    common = ["--image", str(image), "--model", str(tiny_sd15_dir), "--ip-adapter", str(tiny_ip_adapter_dir)]
    common += ["--steps", "2", "--scheduler", "ddim", "-qq"]
    plain, e2e = tmp_path / "plain", tmp_path / "e2e"
    assert main([*common, "--no-untrained-control", "--out", str(plain)]) == 0, capsys.readouterr().err
    assert main([*common, "--end-to-end-control", "--end-to-end-draws", "2", "--out", str(e2e)]) == 0
    report = json.loads((e2e / "rho.json").read_text())
    assert report["control"]["kind"] == "end-to-end" and report["control"]["seeds"] == [0, 1]
    assert report["config"]["untrained_control"] is False
    columns = ("rho_control_0", "rho_control_1", "key_scale_1")
    assert all(all(n in r for n in columns) for r in report["records"])
    first = json.loads((plain / "rho.json").read_text())["images"][0]["generated"]
    assert (plain / first).read_bytes() == (e2e / report["images"][0]["generated"]).read_bytes()


def test_end_to_end_control_refuses_swap_at_once(image: Path, tmp_path: Path, capsys) -> None:
    argv = ["--image", str(image), "--model", "tiny", "--end-to-end-control", "--mode", "swap"]
    assert main([*argv, "--out", str(tmp_path / "o")]) == 2
    err = capsys.readouterr().err.strip()
    assert (
        "--mode is not read by the end-to-end control run (--end-to-end-control)" in err and "\n" not in err
    )
    assert not (tmp_path / "o").exists()
