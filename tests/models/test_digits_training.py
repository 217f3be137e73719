"""The trained tiny model's data, training stages and adapter format (no shipped weights needed)."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import load_file
from subprocess_limits import run_script

from nw_adapter.models.digits_data import class_captions, digit_features, load_digit_splits, to_model_range
from nw_adapter.models.tiny_digits import (
    ADAPTER_WEIGHT_NAME,
    adapter_state_dict_from_unet,
    build_image_encoder,
    build_text_encoder,
    build_unet,
    build_vae,
    feature_extractor,
    initial_adapter_state_dict,
    pipeline_scheduler,
    save_tokenizer,
)


def test_splits_are_deterministic_disjoint_and_stratified():
    first, second = load_digit_splits(), load_digit_splits()
    assert {name: len(part) for name, part in first.items()} == {
        "train": 1297,
        "judge": 400,
        "reference": 100,
    }
    for name in first:
        assert np.array_equal(first[name].indices, second[name].indices)
        assert np.array_equal(first[name].images, second[name].images)
    rows = [set(part.indices.tolist()) for part in first.values()]
    assert not (rows[0] & rows[1] or rows[0] & rows[2] or rows[1] & rows[2])
    assert np.bincount(first["reference"].labels, minlength=10).tolist() == [10] * 10
    images = first["train"].images
    assert images.shape[1:] == (32, 32, 3) and images.dtype == np.uint8
    assert (images[..., 0] == images[..., 2]).all()


def test_judge_features_recover_the_source_digits():
    from sklearn.datasets import load_digits

    part = load_digit_splits()["reference"]
    source = load_digits().data[part.indices]
    features = digit_features(part.images)
    correlation = np.corrcoef(features.ravel(), source.ravel())[0, 1]
    assert features.shape == (100, 64) and correlation > 0.95


def test_captions_name_the_digit():
    assert all(("3" in text) or ("three" in text) for text in class_captions(3))
    assert len(set(class_captions(3)) & set(class_captions(8))) == 0


def _in_memory_pipeline(tmp_path: Path):
    from diffusers import StableDiffusionPipeline
    from transformers import CLIPTokenizer

    torch.manual_seed(0)
    return StableDiffusionPipeline(
        vae=build_vae(),
        text_encoder=build_text_encoder(),
        tokenizer=CLIPTokenizer.from_pretrained(save_tokenizer(tmp_path / "tokenizer")),
        unet=build_unet(),
        scheduler=pipeline_scheduler(),
        safety_checker=None,
        feature_extractor=feature_extractor(),
        image_encoder=build_image_encoder(),
        requires_safety_checker=False,
    )


def test_adapter_round_trips_through_load_ip_adapter(tmp_path):
    """h94-format weights -> diffusers' conversion -> read back: the same tensors, same keys."""
    from nw_adapter.models.training.diffusion import load_adapter_for_training

    pipe = _in_memory_pipeline(tmp_path)
    state = initial_adapter_state_dict(pipe.unet, seed=3)
    cross = [name for name in pipe.unet.attn_processors if name.endswith("attn2.processor")]
    assert len(cross) == 7  # 2 down blocks x 1, 2 up blocks x 2, 1 mid
    first = dict(pipe.unet.named_modules())[cross[0].removesuffix(".processor")]
    assert torch.equal(state["ip_adapter.1.to_k_ip.weight"], first.to_k.weight)  # IP-Adapter's init
    state["ip_adapter.1.to_k_ip.weight"] = torch.randn_like(state["ip_adapter.1.to_k_ip.weight"])
    trainable = load_adapter_for_training(pipe, state)
    assert sum(p.numel() for p in trainable) == sum(v.numel() for v in state.values())
    assert not any(
        p.requires_grad for n, p in pipe.unet.named_parameters() if "_ip" not in n and "hid_proj" not in n
    )
    back = adapter_state_dict_from_unet(pipe.unet)
    assert back.keys() == state.keys()
    assert all(torch.equal(back[key], state[key]) for key in state)


def test_vae_stage_is_deterministic_with_its_seed():
    from nw_adapter.models.training.autoencoder import train_vae

    images = to_model_range(load_digit_splits()["reference"].images[:8])
    runs = [train_vae(images, steps=2, batch_size=4, seed=5, progress=False) for _ in range(2)]
    (vae_a, losses_a), (vae_b, losses_b) = runs
    assert losses_a == losses_b
    assert all(
        torch.equal(a, b)
        for a, b in zip(vae_a.state_dict().values(), vae_b.state_dict().values(), strict=True)
    )
    assert vae_a.config.scaling_factor == vae_b.config.scaling_factor > 0


def _prompt_ids(tmp_path):
    """Token ids and labels of the 30 captions (digit) and three class-free prompts (NO_DIGIT)."""
    from transformers import CLIPTokenizer

    from nw_adapter.models.training.run import STAGE2_PROMPTS
    from nw_adapter.models.training.text_encoder import NO_DIGIT

    tokenizer = CLIPTokenizer.from_pretrained(save_tokenizer(tmp_path / "tokenizer"))
    prompts = [caption for digit in range(10) for caption in class_captions(digit)] + list(STAGE2_PROMPTS)
    labels = torch.tensor([digit for digit in range(10) for _ in range(3)] + [NO_DIGIT] * 3)
    ids = tokenizer(prompts, padding="max_length", max_length=77, truncation=True, return_tensors="pt")
    return tokenizer, ids.input_ids, labels


def _class_separation(text_encoder, ids: torch.Tensor) -> tuple[float, float]:
    """Mean distance of the states of two wordings of one digit, and of one wording of two digits."""
    with torch.no_grad():
        states = text_encoder(ids[:30])[0].unflatten(0, (10, 3))
    within = (states[:, 0] - states[:, 1]).norm(dim=(-1, -2)).mean()
    between = (states[:, 0] - states.roll(1, dims=0)[:, 0]).norm(dim=(-1, -2)).mean()
    return float(within), float(between)


def test_text_encoder_pretraining_makes_the_digit_the_main_content_of_the_states(tmp_path):
    """A random encoder's caption states differ more between wordings of one digit than between
    digits; after the classifier pretraining the digit dominates and is read at every late position."""
    from nw_adapter.models.training.text_encoder import caption_accuracy, train_text_encoder

    tokenizer, ids, labels = _prompt_ids(tmp_path)
    torch.manual_seed(0)
    within, between = _class_separation(build_text_encoder().eval(), ids)
    assert between < within
    text_encoder, head, losses = train_text_encoder(
        ids, labels, end_of_text_id=tokenizer.eos_token_id, steps=80, seed=0, progress=False
    )
    assert losses[-1] < 0.1 * losses[0]
    assert caption_accuracy(text_encoder, head, ids, labels, end_of_text_id=tokenizer.eos_token_id) == 1.0
    within, between = _class_separation(text_encoder, ids)
    assert between > 2 * within
    assert not text_encoder.training


def _train(out: Path, *extra: str) -> subprocess.CompletedProcess:
    return run_script("train_tiny.py", "--out", str(out), "--quick", "--no-progress", *extra)


def test_quick_training_runs_every_stage_and_loads_the_standard_way(tmp_path):
    """The smoke run of scripts/train_tiny.py: every stage, then from_pretrained + load_ip_adapter."""
    from diffusers import StableDiffusionPipeline
    from PIL import Image

    result = _train(tmp_path)
    assert result.returncode == 0, result.stderr[-2000:]
    folder = tmp_path / "tiny_digits"
    log = json.loads((tmp_path / "stages" / "log.json").read_text())
    stages = ("vae", "image_encoder", "text_encoder", "unet", "adapter")
    assert [log[stage]["steps"] for stage in stages] == [2] * 5
    adapter = load_file(folder / "models" / ADAPTER_WEIGHT_NAME)
    assert {key.split(".")[0] for key in adapter} == {"image_proj", "ip_adapter"}
    assert all(value.dtype == torch.float16 for value in adapter.values())
    trained = load_file(tmp_path / "stages" / "adapter" / ADAPTER_WEIGHT_NAME)
    assert all(torch.equal(adapter[key], trained[key].half()) for key in trained)
    pipe = StableDiffusionPipeline.from_pretrained(folder)
    pipe.load_ip_adapter(folder, subfolder="models", weight_name=ADAPTER_WEIGHT_NAME)
    assert {
        next(getattr(pipe, name).parameters()).dtype
        for name in ("unet", "vae", "text_encoder", "image_encoder")
    } == {torch.float32}
    image = Image.open(folder / "examples" / "digit_3.png")
    out = pipe("", ip_adapter_image=image, num_inference_steps=2, output_type="np").images
    assert out.shape == (1, 32, 32, 3) and np.isfinite(out).all()


def test_train_script_rejects_a_file_as_out(tmp_path):
    target = tmp_path / "file"
    target.write_text("x")
    result = run_script("train_tiny.py", "--out", str(target), "--quick")
    assert result.returncode == 2
    assert "is a file" in result.stderr and "Traceback" not in result.stderr


def test_a_resumed_run_reuses_only_stages_made_with_its_settings(tmp_path):
    """Same settings: every stage is reused as it is; other settings: exit 2 naming the stage and
    the differing setting, nothing rewritten; a stage folder without its record is not reused."""
    assert _train(tmp_path).returncode == 0
    stages = tmp_path / "stages"
    written = {path: path.stat().st_mtime_ns for path in stages.rglob("*.safetensors")}
    again = _train(tmp_path)
    assert again.returncode == 0, again.stderr[-2000:]
    assert {path: path.stat().st_mtime_ns for path in stages.rglob("*.safetensors")} == written

    other = _train(tmp_path, "--steps", "3")
    assert other.returncode == 2 and "Traceback" not in other.stderr
    assert "stages/vae" in other.stderr and "vae_steps: 2 on disk, 3 asked" in other.stderr
    assert {path: path.stat().st_mtime_ns for path in stages.rglob("*.safetensors")} == written

    (stages / "unet" / "stage.json").unlink()
    orphan = _train(tmp_path)
    assert orphan.returncode == 2 and "stages/unet" in orphan.stderr and "stage.json" in orphan.stderr


def test_a_stage_trained_on_other_inputs_is_not_reused(tmp_path):
    """A stage's record holds its inputs' records and file digests: a UNet stage is refused when the
    VAE files it was trained on changed, even though every setting matches; a malformed record
    is refused with one line, not a traceback."""
    from safetensors.torch import save_file

    assert _train(tmp_path).returncode == 0
    stages = tmp_path / "stages"
    weights = next((stages / "vae").glob("*.safetensors"))
    state = load_file(weights)
    first = next(iter(state))
    state[first] = state[first] + 1.0
    save_file(state, weights)
    changed = _train(tmp_path)
    assert changed.returncode == 2 and "Traceback" not in changed.stderr
    assert "stages/unet" in changed.stderr and "inputs.vae.files" in changed.stderr

    (stages / "vae" / "stage.json").write_text("{not json")
    broken = _train(tmp_path)
    assert broken.returncode == 2 and "Traceback" not in broken.stderr
    assert "stages/vae" in broken.stderr and "unreadable" in broken.stderr
    errors = [line for line in broken.stderr.splitlines() if "error" in line]  # not library warnings
    assert len(errors) == 1 and errors[0].startswith("train_tiny.py: error: cannot reuse")


def test_the_record_names_the_settings_environment_and_inputs_of_a_stage():
    from dataclasses import replace

    from nw_adapter.models.training.run import TrainingConfig, _stage_record, cpu_model

    config = TrainingConfig.quick()
    records = {name: _stage_record(name, config, {}) for name in ("vae", "text_encoder")}
    unet = _stage_record("unet", config, records, {"vae": "a", "text_encoder": "b"})
    assert unet["inputs"]["vae"] == {"record": records["vae"], "files": "a"}
    assert unet["environment"] == {"threads": config.threads, "torch": torch.__version__, "cpu": cpu_model()}
    assert _stage_record("unet", config, records, {"vae": "c", "text_encoder": "b"}) != unet
    assert (
        _stage_record("unet", replace(config, threads=2), records, {"vae": "a", "text_encoder": "b"}) != unet
    )
    assert (
        _stage_record("unet", replace(config, adapter_steps=9), records, {"vae": "a", "text_encoder": "b"})
        == unet
    )
