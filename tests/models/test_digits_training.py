"""The trained tiny model's data, training stages and adapter format (no shipped weights needed)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import load_file

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

ROOT = Path(__file__).resolve().parents[2]


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


def test_stage1_can_train_the_text_encoder_jointly(tmp_path):
    """``train_unet(text_encoder=...)`` encodes each batch's token ids through the encoder and
    updates it (the default stage 1 keeps it frozen and reads fixed caption states)."""
    from transformers import CLIPTokenizer

    from nw_adapter.models.training.diffusion import train_unet

    tokenizer = CLIPTokenizer.from_pretrained(save_tokenizer(tmp_path / "tokenizer"))
    captions = [list(class_captions(digit)) for digit in range(10)]
    ids = tokenizer(
        sum(captions, []) + [""], padding="max_length", max_length=77, truncation=True, return_tensors="pt"
    ).input_ids
    caption_ids, empty_ids = ids[:-1].unflatten(0, (10, -1)), ids[-1:]
    torch.manual_seed(0)
    text_encoder = build_text_encoder().eval()
    before = {key: value.clone() for key, value in text_encoder.state_dict().items()}
    latents = torch.randn(8, 4, 8, 8)
    labels = torch.arange(8) % 10
    unet, losses = train_unet(
        latents,
        labels,
        None,
        None,
        steps=2,
        batch_size=4,
        seed=3,
        text_encoder=text_encoder,
        caption_ids=caption_ids,
        empty_ids=empty_ids,
        progress=False,
    )
    assert len(losses) == 2 and all(np.isfinite(losses))
    after = text_encoder.state_dict()
    assert any(not torch.equal(before[key], after[key]) for key in before)
    assert not text_encoder.training and not any(p.requires_grad for p in text_encoder.parameters())


def test_quick_training_runs_every_stage_and_loads_the_standard_way(tmp_path):
    """The smoke run of scripts/train_tiny.py: every stage, then from_pretrained + load_ip_adapter."""
    from diffusers import StableDiffusionPipeline
    from PIL import Image

    result = subprocess.run(
        [
            sys.executable,
            str(ROOT / "scripts" / "train_tiny.py"),
            "--out",
            str(tmp_path),
            "--quick",
            "--no-progress",
        ],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=600,
    )
    assert result.returncode == 0, result.stderr[-2000:]
    folder = tmp_path / "tiny_digits"
    log = json.loads((tmp_path / "stages" / "log.json").read_text())
    assert [log[stage]["steps"] for stage in ("vae", "image_encoder", "unet", "adapter")] == [2, 2, 2, 2]
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
    result = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "train_tiny.py"), "--out", str(target), "--quick"],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=120,
    )
    assert result.returncode == 2
    assert "is a file" in result.stderr and "Traceback" not in result.stderr
