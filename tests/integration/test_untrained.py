"""The untrained-adapter builder on the tiny random pipelines: copies where shapes match, default
initialisation, seeded determinism, the pipeline untouched, keys computed as the trained branch does."""

from __future__ import annotations

import pytest
import torch
from diffusers import FluxPipeline, StableDiffusion3Pipeline, StableDiffusionPipeline
from flow_helpers import generate as generate_flow
from flow_helpers import load_flux, load_sd3
from tiny_helpers import generate, load_sd15

from nw_adapter.integration.untrained import build_untrained_adapter, untrained_keys

torch.set_num_threads(1)


@pytest.fixture(scope="module", params=["base", "plus"])
def sd15(request, tiny_sd15_dir, tiny_ip_adapter_dir):
    return load_sd15(tiny_sd15_dir, tiny_ip_adapter_dir, request.param)


@pytest.fixture(scope="module")
def flux(tiny_flux_dir, tiny_flux_ip_adapter_dir):
    return load_flux(FluxPipeline, tiny_flux_dir, tiny_flux_ip_adapter_dir)


def _state(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {name: value.detach().clone() for name, value in module.state_dict().items()}


def _check_recipe(pipe, denoiser) -> None:
    untrained = build_untrained_adapter(pipe, seed=0)
    for name, projections in untrained.key_projections.items():
        attn = denoiser.get_submodule(name.removesuffix(".processor"))
        trained = denoiser.attn_processors[name].to_k_ip
        assert len(projections) == len(trained)
        for fresh, original, copied in zip(projections, trained, untrained.copied[name], strict=True):
            assert fresh.weight.shape == original.weight.shape
            assert copied == (attn.to_k.weight.shape == original.weight.shape)
            if copied:
                assert torch.equal(fresh.weight, attn.to_k.weight)
            else:
                bound = fresh.in_features**-0.5  # nn.Linear's default: kaiming_uniform(a=sqrt 5)
                assert float(fresh.weight.abs().max()) <= bound
            assert not torch.equal(fresh.weight, original.weight)
    trained = dict(denoiser.encoder_hid_proj.named_parameters())
    layer_norms = 0
    for module_name, module in untrained.image_projection.named_modules():
        for name, fresh in module.named_parameters(recurse=False):
            full = f"{module_name}.{name}" if module_name else name
            assert fresh.shape == trained[full].shape and not fresh.requires_grad
            if isinstance(module, torch.nn.LayerNorm):  # at identity
                assert torch.equal(
                    fresh, torch.ones_like(fresh) if name == "weight" else torch.zeros_like(fresh)
                )
                layer_norms += 1
            else:
                assert not torch.equal(fresh, trained[full]), full
    assert layer_norms > 0


def test_sd15_recipe_copies_text_keys_and_reinitialises_the_projection(sd15) -> None:
    _check_recipe(sd15, sd15.unet)
    assert all(all(c) for c in build_untrained_adapter(sd15).copied.values())  # cross-attn dims match


def test_flux_recipe(flux) -> None:
    _check_recipe(flux, flux.transformer)


def test_seeded_and_deterministic_without_touching_the_pipeline_or_the_global_rng(sd15) -> None:
    before = _state(sd15.unet)
    rng = torch.get_rng_state()
    first, again, other = (build_untrained_adapter(sd15, seed=s) for s in (3, 3, 4))
    assert torch.equal(torch.get_rng_state(), rng)
    after = _state(sd15.unet)
    assert before.keys() == after.keys() and all(torch.equal(before[k], after[k]) for k in before)
    for a, b, c in zip(
        first.image_projection.parameters(),
        again.image_projection.parameters(),
        other.image_projection.parameters(),
        strict=True,
    ):
        assert torch.equal(a, b)
        if a.dim() > 1:
            assert not torch.equal(a, c)
    # the new modules share no storage with the pipeline's
    pipeline_ptrs = {p.data_ptr() for p in sd15.unet.parameters()}
    assert not any(p.data_ptr() in pipeline_ptrs for p in first.image_projection.parameters())
    assert not any(k.weight.data_ptr() in pipeline_ptrs for ks in first.key_projections.values() for k in ks)


def _capture_trained_keys(pipe, denoiser, layer: str, run) -> tuple[list[torch.Tensor], torch.Tensor]:
    """The image embeddings the denoiser received and one layer's trained to_k_ip output, first call."""
    seen: dict[str, object] = {}

    def embeds_hook(module, args, kwargs):
        if "embeds" not in seen:
            added = kwargs.get("added_cond_kwargs") or {}
            joint = kwargs.get("joint_attention_kwargs") or {}
            seen["embeds"] = [
                e.clone() for e in added.get("image_embeds", joint.get("ip_adapter_image_embeds"))
            ]

    def key_hook(module, args, output):
        seen.setdefault("keys", output.clone())

    handles = [
        denoiser.register_forward_pre_hook(embeds_hook, with_kwargs=True),
        denoiser.attn_processors[layer].to_k_ip[0].register_forward_hook(key_hook),
    ]
    try:
        run()
    finally:
        for handle in handles:
            handle.remove()
    return seen["embeds"], seen["keys"]


def _check_keys_follow_the_trained_branch(pipe, denoiser, run) -> None:
    untrained = build_untrained_adapter(pipe, seed=0)
    layer = next(iter(untrained.key_projections))
    embeds, trained_keys = _capture_trained_keys(pipe, denoiser, layer, run)
    keys = untrained_keys(untrained, layer, embeds)
    heads = untrained.heads[layer]
    batch = embeds[0].shape[0]
    expected_shape = (
        batch,
        heads,
        trained_keys[0].numel() // trained_keys.shape[-1],
        trained_keys.shape[-1] // heads,
    )
    assert tuple(keys.shape) == expected_shape
    # with the trained weights loaded into the untrained modules, the helper reproduces the branch's keys
    twin = build_untrained_adapter(pipe, seed=0)
    twin.image_projection.load_state_dict(denoiser.encoder_hid_proj.state_dict())
    twin.key_projections[layer][0].load_state_dict(denoiser.attn_processors[layer].to_k_ip[0].state_dict())
    reproduced = untrained_keys(twin, layer, embeds)
    split = trained_keys.reshape(batch, -1, heads, trained_keys.shape[-1] // heads).transpose(1, 2)
    torch.testing.assert_close(reproduced, split, rtol=1e-5, atol=1e-6)
    assert not torch.allclose(keys, split)


def test_sd15_keys_have_the_trained_branch_shape_and_computation(sd15) -> None:
    _check_keys_follow_the_trained_branch(sd15, sd15.unet, lambda: generate(sd15, steps=1))


def test_flux_keys_have_the_trained_branch_shape_and_computation(flux) -> None:
    _check_keys_follow_the_trained_branch(flux, flux.transformer, lambda: generate_flow(flux, steps=1))


def test_bad_input_is_a_clear_error(sd15, tiny_sd15_dir, tiny_sd3_dir, tiny_sd3_ip_adapter_dir) -> None:
    plain = StableDiffusionPipeline.from_pretrained(tiny_sd15_dir)
    with pytest.raises(ValueError, match="load_ip_adapter"):
        build_untrained_adapter(plain)
    with pytest.raises(ValueError, match="seed must be an int"):
        build_untrained_adapter(sd15, seed="0")
    untrained = build_untrained_adapter(sd15)
    layer = next(iter(untrained.key_projections))
    with pytest.raises(ValueError, match="has no IP branch"):
        untrained_keys(untrained, "nope", [torch.zeros(1, 1, 8)])
    with pytest.raises(ValueError, match="adapter must be"):
        untrained_keys(untrained, layer, [torch.zeros(1, 1, 8)], adapter=1)
    with pytest.raises(ValueError, match="one per loaded adapter"):
        untrained_keys(untrained, layer, [])
    sd3 = load_sd3(StableDiffusion3Pipeline, tiny_sd3_dir, tiny_sd3_ip_adapter_dir)
    sd3_untrained = build_untrained_adapter(sd3)
    with pytest.raises(ValueError, match="conditioned on the timestep"):
        untrained_keys(sd3_untrained, next(iter(sd3_untrained.key_projections)), torch.zeros(1, 4, 8))


def test_a_text_key_of_another_shape_gives_a_default_initialised_key_projection(sd15) -> None:
    """Where to_k and to_k_ip differ in shape (e.g. Flux's real joint dims), nothing is copied."""
    import copy

    pipe = copy.deepcopy(sd15)
    layer = next(iter(build_untrained_adapter(pipe).key_projections))
    attn = pipe.unet.get_submodule(layer.removesuffix(".processor"))
    attn.to_k = torch.nn.Linear(attn.to_k.in_features + 3, attn.to_k.out_features, bias=False)
    first, again = build_untrained_adapter(pipe, seed=5), build_untrained_adapter(pipe, seed=5)
    fresh = first.key_projections[layer][0]
    assert first.copied[layer] == [False]
    assert fresh.weight.shape == pipe.unet.attn_processors[layer].to_k_ip[0].weight.shape
    assert float(fresh.weight.abs().max()) <= fresh.in_features**-0.5  # nn.Linear's default bound
    assert torch.equal(fresh.weight, again.key_projections[layer][0].weight)
    assert all(all(c) for name, c in first.copied.items() if name != layer)


@pytest.fixture(scope="module")
def sd3(tiny_sd3_dir, tiny_sd3_ip_adapter_dir):
    return load_sd3(StableDiffusion3Pipeline, tiny_sd3_dir, tiny_sd3_ip_adapter_dir)


def test_sd3_recipe_copies_the_context_key_projection_and_norm_and_reinitialises_the_rest(sd3) -> None:
    """SD 3.5: to_k_ip from attn.add_k_proj (weights; shapes match in the tiny model), the key RMSNorm's
    gain from attn.norm_added_k, image_proj and norm_ip re-initialised (LayerNorms at identity)."""
    transformer = sd3.transformer
    before = _state(transformer)
    untrained = build_untrained_adapter(sd3, seed=0)
    assert untrained.family == "sd3"
    for name, (fresh,) in untrained.key_projections.items():
        attn = transformer.get_submodule(name.removesuffix(".processor"))
        processor = transformer.attn_processors[name]
        assert untrained.copied[name] == [True] and untrained.key_norm_copied[name]
        assert torch.equal(fresh.weight, attn.add_k_proj.weight) and fresh.bias is None
        assert not torch.equal(fresh.weight, processor.to_k_ip.weight)
        assert torch.equal(untrained.key_norms[name].weight, attn.norm_added_k.weight)
        trained_norm = dict(processor.norm_ip.named_parameters())
        for key, value in untrained.input_norms[name].named_parameters():
            assert value.shape == trained_norm[key].shape and not torch.equal(value, trained_norm[key])
    trained = dict(transformer.image_proj.named_parameters())
    for module_name, module in untrained.image_projection.named_modules():
        for name, fresh in module.named_parameters(recurse=False):
            full = f"{module_name}.{name}" if module_name else name
            if isinstance(module, torch.nn.LayerNorm):
                assert torch.equal(
                    fresh, torch.ones_like(fresh) if name == "weight" else torch.zeros_like(fresh)
                )
            else:
                assert not torch.equal(fresh, trained[full]), full
    after = _state(transformer)
    assert all(torch.equal(before[k], after[k]) for k in before)
    again, other = build_untrained_adapter(sd3, seed=0), build_untrained_adapter(sd3, seed=1)
    pairs = zip(untrained.image_projection.parameters(), again.image_projection.parameters(), strict=True)
    assert all(torch.equal(a, b) for a, b in pairs)
    assert not torch.equal(untrained.image_projection.proj_in.weight, other.image_projection.proj_in.weight)


def test_sd3_keys_follow_the_trained_branch(sd3) -> None:
    """With the trained weights loaded into the untrained modules, keys_from_states reproduces the keys
    the stock SD3 branch forms (norm_ip_k's output); with the untrained ones they differ."""
    transformer = sd3.transformer
    layer = next(n for n, p in transformer.attn_processors.items() if hasattr(p, "to_k_ip"))
    processor = transformer.attn_processors[layer]
    seen: dict = {}

    def inputs(module, args, kwargs):
        if "embeds" not in seen:
            seen["embeds"] = kwargs["joint_attention_kwargs"]["ip_adapter_image_embeds"].clone()
            seen["timestep"] = kwargs["timestep"].clone()

    def keys(module, args, output):
        seen.setdefault("keys", output.clone())

    handles = [
        transformer.register_forward_pre_hook(inputs, with_kwargs=True),
        processor.norm_ip_k.register_forward_hook(keys),
    ]
    try:
        generate_flow(sd3, steps=1)
    finally:
        for handle in handles:
            handle.remove()
    twin = build_untrained_adapter(sd3, seed=0)
    twin.image_projection.load_state_dict(transformer.image_proj.state_dict())
    twin.key_projections[layer][0].load_state_dict(processor.to_k_ip.state_dict())
    twin.input_norms[layer].load_state_dict(processor.norm_ip.state_dict())
    twin.key_norms[layer].load_state_dict(processor.norm_ip_k.state_dict())
    reproduced = untrained_keys(twin, layer, seen["embeds"], timestep=seen["timestep"])
    torch.testing.assert_close(reproduced, seen["keys"], rtol=1e-5, atol=1e-6)
    control = untrained_keys(build_untrained_adapter(sd3), layer, seen["embeds"], timestep=seen["timestep"])
    assert control.shape == seen["keys"].shape and not torch.allclose(control, seen["keys"])


def test_sd3_text_key_of_another_shape_gives_default_initialisations(sd3) -> None:
    import copy

    pipe = copy.deepcopy(sd3)
    layer = next(n for n, p in pipe.transformer.attn_processors.items() if hasattr(p, "to_k_ip"))
    attn = pipe.transformer.get_submodule(layer.removesuffix(".processor"))
    attn.add_k_proj = torch.nn.Linear(attn.add_k_proj.in_features + 2, attn.add_k_proj.out_features)
    attn.norm_added_k = None
    untrained = build_untrained_adapter(pipe, seed=2)
    fresh = untrained.key_projections[layer][0]
    assert untrained.copied[layer] == [False] and not untrained.key_norm_copied[layer]
    assert float(fresh.weight.abs().max()) <= fresh.in_features**-0.5
    assert torch.equal(untrained.key_norms[layer].weight, torch.ones_like(untrained.key_norms[layer].weight))
    assert torch.equal(fresh.weight, build_untrained_adapter(pipe, seed=2).key_projections[layer][0].weight)
