"""correlate.py on SD 3.5 and Flux: the family comes from the pipeline, with its adapter defaults.

The tiny SD3 / Flux folders of the session fixtures stand in for the Hub models (no network):
they are recognised from their ``model_index.json``, get their family's adapter, weight file and
image encoder, and run end to end (Flux with true CFG).
"""

from __future__ import annotations

import csv
import json
from pathlib import Path

import pytest
from tiny_helpers import random_image

from nw_adapter.correlate import families
from nw_adapter.correlate.cli import build_parser, main
from nw_adapter.correlate.loading import ModelSpec, resolve_spec
from nw_adapter.models.tiny_flow import CLIP_FOLDER, SIGLIP_FOLDER


def run(argv: list, capsys) -> tuple[int, str, str]:
    code = main([str(a) for a in argv])
    captured = capsys.readouterr()
    return code, captured.out, captured.err


@pytest.fixture
def reference(tmp_path: Path) -> Path:
    path = tmp_path / "ref.png"
    random_image(3, 48).save(path)
    return path


@pytest.mark.parametrize(
    ("class_name", "family"),
    [
        ("StableDiffusion3Pipeline", "sd3"),
        ("StableDiffusion3NWPipeline", "sd3"),
        ("FluxPipeline", "flux"),
        ("StableDiffusionXLPipeline", "unet"),
        (None, "unet"),
    ],
)
def test_family_of_class_name(class_name, family):
    assert families.family_of_class_name(class_name) == family


def test_local_sd3_and_flux_folders_get_their_family_defaults(tiny_sd3_dir, tiny_flux_dir, tiny_sd15_dir):
    sd3 = resolve_spec(ModelSpec(str(tiny_sd3_dir)))
    assert (sd3.ip_adapter, sd3.weight_name) == ("InstantX/SD3.5-Large-IP-Adapter", "ip-adapter.bin")
    assert sd3.image_encoder == "google/siglip-so400m-patch14-384"
    flux = resolve_spec(ModelSpec(str(tiny_flux_dir)))
    assert (flux.ip_adapter, flux.weight_name) == ("XLabs-AI/flux-ip-adapter", "ip_adapter.safetensors")
    assert flux.image_encoder == "openai/clip-vit-large-patch14"
    unet = resolve_spec(ModelSpec(str(tiny_sd15_dir)))
    assert (unet.ip_adapter, unet.image_encoder) == ("h94/IP-Adapter", None)  # unchanged for UNets


def test_help_names_the_family_defaults(monkeypatch):
    monkeypatch.setenv("COLUMNS", "2000")  # no wrapping inside the hyphenated repository names
    text = build_parser().format_help()
    names = ["InstantX/SD3.5-Large-IP-Adapter", "XLabs-AI/flux-ip-adapter", "ip-adapter.bin"]
    names += ["ip_adapter.safetensors", "google/siglip-so400m-patch14-384", "openai/clip-vit-large-patch14"]
    for name in [*names, "tiny-sd3", "tiny-flux", "--true-cfg-scale"]:
        assert name in " ".join(text.split()), name


def test_flux_end_to_end_with_true_cfg(tiny_flux_dir, tiny_flux_ip_adapter_dir, reference, tmp_path, capsys):
    out = tmp_path / "out"
    argv = [
        "--image", reference, "--model", tiny_flux_dir, "--ip-adapter", tiny_flux_ip_adapter_dir,
        "--image-encoder", tiny_flux_ip_adapter_dir / CLIP_FOLDER, "--steps", "3", "--height", "32",
        "--width", "32", "--true-cfg-scale", "2", "--negative-prompt", "blurry", "--all-steps",
        "--out", out, "--quiet",
    ]  # fmt: skip
    code, stdout, err = run(argv, capsys)
    assert code == 0, err
    report = json.loads((out / "rho.json").read_text())
    records = report["records"]
    assert {(r["step"], r["half"]) for r in records} == {(s, h) for s in range(3) for h in ("cond", "uncond")}
    from diffusers import FluxPipeline

    pipe = FluxPipeline.from_pretrained(tiny_flux_dir)
    planned = families.planned_timesteps(pipe, 3, 32, 32)
    assert sorted({(r["step"], r["timestep"]) for r in records}) == list(enumerate(planned))
    assert report["config"]["true_cfg_scale"] == 2.0
    assert "step  timestep" in stdout


def test_sd3_end_to_end(tiny_sd3_dir, tiny_sd3_ip_adapter_dir, reference, tmp_path, capsys):
    out = tmp_path / "out"
    argv = [
        "--image", reference, "--model", tiny_sd3_dir, "--ip-adapter", tiny_sd3_ip_adapter_dir,
        "--image-encoder", tiny_sd3_ip_adapter_dir / SIGLIP_FOLDER, "--steps", "2", "--height", "32",
        "--width", "32", "--out", out, "--quiet",
    ]  # fmt: skip
    code, _, err = run(argv, capsys)
    assert code == 0, err
    report = json.loads((out / "rho.json").read_text())
    records = report["records"]
    assert {r["half"] for r in records} == {"cond", "uncond"} and {r["key_set"] for r in records} == {"ip"}
    assert all(0 < r["ip_mass"] < 1 for r in records)
    (image,) = report["images"]
    with open(out / image["joint_records"]) as handle:
        joint = list(csv.DictReader(handle))
    assert len(joint) == len(records) and {r["key_set"] for r in joint} == {"joint"}
    tokens = (32 // 2 // 2) ** 2  # 2 x 2 patches of the 16 x 16 latent
    assert {int(r["num_keys"]) for r in joint} == {tokens + 4}


def test_sd15_tiny_adapter_with_an_sd3_model_is_a_one_line_error(tiny_sd3_dir, reference, tmp_path, capsys):
    out = tmp_path / "out"
    argv = ["--image", reference, "--model", tiny_sd3_dir, "--ip-adapter", "tiny", "--out", out, "--quiet"]
    code, _, err = run(argv, capsys)
    lines = [line for line in err.splitlines() if line.strip()]
    assert code == 2 and len(lines) == 1 and "Traceback" not in err, err
    assert "--ip-adapter tiny" in lines[0] and "omit --ip-adapter" in lines[0]
    assert not out.exists()


def test_scheduler_refused_for_flow_pipelines(tiny_sd3_dir):
    from diffusers import StableDiffusion3Pipeline

    from nw_adapter.correlate.loading import ModelLoadError

    pipe = StableDiffusion3Pipeline.from_pretrained(tiny_sd3_dir)
    with pytest.raises(ModelLoadError, match="flow-matching model"):
        families.check_scheduler(pipe, "ddim")
    families.check_scheduler(pipe, None)


def test_true_cfg_scale_only_for_flux(tiny_sd3_dir):
    from diffusers import StableDiffusion3Pipeline

    from nw_adapter.correlate.loading import ModelLoadError

    pipe = StableDiffusion3Pipeline.from_pretrained(tiny_sd3_dir)
    with pytest.raises(ModelLoadError, match="only Flux pipelines have true CFG"):
        families.call_kwargs(pipe, 2.0)
    assert families.call_kwargs(pipe, 1.0) == {}


@pytest.mark.parametrize("family", ["sd3", "flux"])
def test_store_maps_on_flow_families(family, request, reference, tmp_path, capsys):
    """--store-maps stores the maps and x0 previews, draws attention_maps.png and redraws it with
    --replot, for SD 3.5 and Flux (whose pipelines have a transformer, not a unet)."""
    import numpy as np
    from PIL import Image

    model, adapter = (request.getfixturevalue(f"tiny_{family}{s}_dir") for s in ("", "_ip_adapter"))
    encoder = adapter / (SIGLIP_FOLDER if family == "sd3" else CLIP_FOLDER)
    out = tmp_path / "out"
    argv = [
        "--image", reference, "--model", model, "--ip-adapter", adapter, "--image-encoder", encoder,
        "--steps", "2", "--height", "32", "--width", "32", "--store-maps", "--out", out, "-q",
    ]  # fmt: skip
    code, _, err = run(argv, capsys)
    assert code == 0, err
    report = json.loads((out / "rho.json").read_text())
    (image,) = report["images"]
    folder = out / Path(image["maps"]).parent
    names = {p.name for p in folder.iterdir()}
    assert {"maps.safetensors", "attention_maps.png", "x0_step0.png", "x0_step1.png"} <= names
    with Image.open(folder / "generated.png") as a, Image.open(folder / "x0_step1.png") as b:
        # flow matching's last Euler step lands on its x0 estimate: the preview is the generated image
        assert np.array_equal(np.asarray(a), np.asarray(b))
    (folder / "attention_maps.png").unlink()
    code, _, err = run(["--replot", out], capsys)
    assert code == 0, err
    assert (folder / "attention_maps.png").is_file()


@pytest.mark.parametrize("model", ["tiny", "tiny-sd3", "tiny-flux", "tiny-flux-digits"])
def test_shown_spec_names_every_embedded_model_tiny(model, tmp_path, monkeypatch):
    """The spec a file records never holds the install or cache path of an embedded model: every
    one's adapter and image encoder are "tiny", as the rho run records them (tiny-flux-digits'
    --compare-swap / --support-set runs recorded the image encoder's absolute install path)."""
    monkeypatch.setenv("NW_ADAPTER_CACHE", str(tmp_path / "cache"))
    resolved = resolve_spec(ModelSpec(model))
    shown = families.shown_spec(model, None, None, resolved)
    assert shown.model == model and shown.ip_adapter == "tiny"
    assert shown.image_encoder == (None if resolved.image_encoder is None else "tiny")
    assert str(tmp_path) not in json.dumps(shown.to_dict()) and "/" not in json.dumps(shown.to_dict())
    given = families.shown_spec(model, "my/adapter", "my/encoder", resolved)  # options as given
    assert given.ip_adapter == "my/adapter"
    assert given.image_encoder == (None if resolved.image_encoder is None else "my/encoder")


def test_a_compare_swap_run_that_recorded_the_install_path_is_computed_again(tmp_path, monkeypatch, capsys):
    """A tiny-flux-digits --compare-swap run of the version that recorded the image encoder's install
    path is not reused as if it were this version's: its fingerprint differs, the run says so in one
    line and computes it again; the run after that resumes."""
    from nw_adapter.correlate.spec import ModelSpec as Spec
    from nw_adapter.models.tiny_digits import example_image_path

    def old_shown_spec(model, ip_adapter, image_encoder, spec):  # the previous version's record
        return Spec(
            model, ip_adapter or "tiny", spec.subfolder, spec.weight_name, image_encoder or spec.image_encoder
        )

    out = tmp_path / "out"
    argv = ["--compare-swap", "--model", "tiny-flux-digits", "--steps", "1", "--swap-rules", "matched"]
    argv += ["--image", example_image_path(3), "--out", out, "--seed", "5"]
    with monkeypatch.context() as patch:
        patch.setattr(families, "shown_spec", old_shown_spec)
        code, _, err = run(argv, capsys)
    assert code == 0, err
    old = json.loads((out / "compare_swap.json").read_text())
    assert Path(old["config"]["model"]["image_encoder"]).is_absolute()
    code, _, err = run(argv, capsys)
    notes = [line for line in err.splitlines() if "computing it again" in line]
    assert code == 0 and len(notes) == 1 and "other options" in notes[0], err
    new = json.loads((out / "compare_swap.json").read_text())
    assert new["config"]["model"]["image_encoder"] == "tiny" and new["fingerprint"] != old["fingerprint"]
    code, _, err = run(argv, capsys)
    assert code == 0 and "resumed" in err


@pytest.mark.parametrize("size", [0, 30000], ids=["empty", "truncated"])
def test_a_damaged_adapter_file_is_one_line(size, tmp_path, capsys):
    """An empty or truncated IP-Adapter .safetensors: one line naming the file (exit 2), not
    safetensors' SafetensorError traceback."""
    import shutil

    from nw_adapter.correlate.spec import TINY_DIGITS_DIR
    from nw_adapter.models.tiny_digits import example_image_path

    adapter = tmp_path / "adapter"
    shutil.copytree(TINY_DIGITS_DIR / "models", adapter / "models")
    weights = adapter / "models" / "ip-adapter_sd15.safetensors"
    weights.write_bytes(weights.read_bytes()[:size])
    argv = ["--model", "tiny", "--ip-adapter", adapter, "--image", example_image_path(0), "--steps", "1"]
    code, _, err = run([*argv, "--out", tmp_path / "out"], capsys)
    lines = [line for line in err.splitlines() if line.strip()]
    assert code == 2 and len(lines) == 1 and "Traceback" not in err, err
    assert str(weights) in lines[0] and "download or copy the adapter again" in lines[0]
    assert ("is empty" in lines[0]) == (size == 0)
