"""The tiny offline models load through the real diffusers loading code and generate."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from diffusers import StableDiffusionPipeline, StableDiffusionXLPipeline
from PIL import Image
from safetensors.torch import load_file
from tiny_helpers import generate

from nw_adapter.models.tiny import (
    TINY_IMAGE_SIZE,
    ip_adapter_weight_name,
    save_tiny_ip_adapter,
    save_tiny_sd15,
)


@pytest.fixture(scope="module")
def reference_image() -> Image.Image:
    rng = np.random.default_rng(0)
    return Image.fromarray(rng.integers(0, 256, (48, 48, 3), dtype=np.uint8))


def test_public_layout_and_original_key_names(tiny_ip_adapter_dir):
    for subfolder, sdxl in (("models", False), ("sdxl_models", True)):
        assert (tiny_ip_adapter_dir / subfolder / "image_encoder" / "config.json").is_file()
        for variant in ("base", "plus"):
            state = load_file(tiny_ip_adapter_dir / subfolder / ip_adapter_weight_name(variant, sdxl=sdxl))
            prefixes = {key.split(".")[0] for key in state}
            assert prefixes == {"image_proj", "ip_adapter"}
            layer_ids = sorted({int(key.split(".")[1]) for key in state if key.startswith("ip_adapter.")})
            assert layer_ids == [1, 3, 5, 7]  # odd ids: the original counts attn1 and attn2 layers


@pytest.mark.parametrize("variant, tokens", [("base", 4), ("plus", 16)])
def test_sd15_loads_adapter_and_image_branch_matters(
    tiny_sd15_dir, tiny_ip_adapter_dir, reference_image, variant, tokens
):
    pipe = StableDiffusionPipeline.from_pretrained(tiny_sd15_dir)
    pipe.load_ip_adapter(tiny_ip_adapter_dir, subfolder="models", weight_name=ip_adapter_weight_name(variant))
    ip_layers = [p for p in pipe.unet.attn_processors.values() if hasattr(p, "to_k_ip")]
    assert len(ip_layers) == 4
    assert all(p.num_tokens == [tokens] for p in ip_layers)

    with_image = generate(pipe, ip_adapter_image=reference_image)
    assert with_image.shape == (1, TINY_IMAGE_SIZE, TINY_IMAGE_SIZE, 3)
    pipe.set_ip_adapter_scale(0.0)
    without_image = generate(pipe, ip_adapter_image=reference_image)
    assert not np.allclose(with_image, without_image)


def test_sdxl_loads_adapter(tiny_sdxl_dir, tiny_ip_adapter_dir, reference_image):
    pipe = StableDiffusionXLPipeline.from_pretrained(tiny_sdxl_dir)
    pipe.load_ip_adapter(
        tiny_ip_adapter_dir, subfolder="sdxl_models", weight_name=ip_adapter_weight_name("base", sdxl=True)
    )
    images = generate(pipe, ip_adapter_image=reference_image)
    assert images.shape == (1, TINY_IMAGE_SIZE, TINY_IMAGE_SIZE, 3)
    assert np.isfinite(images).all()


def test_same_seed_writes_same_weights(tmp_path):
    first = save_tiny_ip_adapter(tmp_path / "a", seed=3)
    second = save_tiny_ip_adapter(tmp_path / "b", seed=3)
    name = ip_adapter_weight_name("base")
    a, b = load_file(first / "models" / name), load_file(second / "models" / name)
    assert a.keys() == b.keys()
    assert all(torch.equal(a[key], b[key]) for key in a)
    sd_a = save_tiny_sd15(tmp_path / "sd_a", seed=1)
    sd_b = save_tiny_sd15(tmp_path / "sd_b", seed=1)
    ua = load_file(sd_a / "unet" / "diffusion_pytorch_model.safetensors")
    ub = load_file(sd_b / "unet" / "diffusion_pytorch_model.safetensors")
    assert all(torch.equal(ua[key], ub[key]) for key in ua)


def test_unknown_variant_is_rejected():
    with pytest.raises(ValueError, match="variant"):
        ip_adapter_weight_name("huge")


def test_builder_fingerprint_is_a_hash_of_the_builder_source():
    from nw_adapter.models.tiny import builder_fingerprint

    fingerprint = builder_fingerprint()
    assert len(fingerprint) == 12 and int(fingerprint, 16) >= 0


def test_tiny_sd15_pipeline_writes_each_folder_once(tmp_path):
    from nw_adapter.models.tiny import tiny_sd15_pipeline

    pipe = tiny_sd15_pipeline(tmp_path, variant="plus")
    assert [p.num_tokens for p in pipe.unet.attn_processors.values() if hasattr(p, "num_tokens")][0] == [16]
    weights = tmp_path / "ip-adapter-plus-seed0" / "models" / ip_adapter_weight_name("plus")
    stamp = weights.stat().st_mtime_ns
    tiny_sd15_pipeline(tmp_path, variant="plus")
    assert weights.stat().st_mtime_ns == stamp  # reused, not rewritten
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # no staging folders left


def test_tiny_sd15_pipeline_seed_is_honoured_in_an_existing_folder(tmp_path):
    """Seed 1 asked for after seed 0 in the same folder gives seed-1 weights, not the cached seed 0."""
    import torch

    from nw_adapter.models.tiny import tiny_sd15_pipeline

    def weights(pipe) -> tuple[torch.Tensor, torch.Tensor]:
        adapter = next(p for p in pipe.unet.attn_processors.values() if hasattr(p, "to_k_ip"))
        return pipe.unet.conv_in.weight.detach().clone(), adapter.to_k_ip[0].weight.detach().clone()

    seed0 = weights(tiny_sd15_pipeline(tmp_path, seed=0))
    seed1 = weights(tiny_sd15_pipeline(tmp_path, seed=1))
    fresh1 = weights(tiny_sd15_pipeline(tmp_path / "fresh", seed=1))
    assert not torch.equal(seed0[0], seed1[0]) and not torch.equal(seed0[1], seed1[1])
    assert torch.equal(seed1[0], fresh1[0]) and torch.equal(seed1[1], fresh1[1])
