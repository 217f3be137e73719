"""The shipped trained tiny Flux digits model: layout, size, real loading calls, the support-set
convention (m images -> m x 4 image keys), ``--model tiny-flux-digits``, and class agreement on a
sample that an untrained weight file fails."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from nw_adapter.models import tiny_digits
from nw_adapter.models.digits_data import load_digit_splits
from nw_adapter.models.digits_quality import fit_judge
from nw_adapter.models.loaders import TINY_FLUX_DIGITS_CALL, tiny_digit_image
from nw_adapter.models.support_quality import measure_support_agreement, pilot_references, support_sets
from nw_adapter.models.tiny_flux_digits import (
    ADAPTER_SUBFOLDER,
    ADAPTER_WEIGHT_NAME,
    IMAGE_ENCODER_SUBFOLDER,
    IMAGE_TOKENS,
    QUALITY_TRUE_CFG_SCALE,
    SHIPPED_DIR,
    initial_adapter_state_dict,
    load_pipeline,
)

SAMPLE = 20  # support sets of one reference: 2 per class
SAMPLE_STEPS = 10  # the shipped weights: 19 of 20 agree at 10 steps (true CFG 5)
PASS_AT = 13  # of 20 (as the SD 1.5 model's test): the shipped adapter keeps the class; chance is 2


@pytest.fixture(scope="module")
def pipe():
    torch.set_num_threads(1)
    return load_pipeline()


@pytest.fixture(scope="module")
def judge():
    return fit_judge(load_digit_splits()["judge"])


def test_shipped_folder_layout_and_size_with_the_sd15_model():
    files = [
        path
        for folder in (SHIPPED_DIR, tiny_digits.SHIPPED_DIR)
        for path in folder.rglob("*")
        if path.is_file()
    ]
    assert sum(path.stat().st_size for path in files) <= 10 * 2**20  # both models together
    for name in (
        "model_index.json",
        "transformer/config.json",
        "vae/config.json",
        "text_encoder/config.json",
        "text_encoder_2/config.json",
        "tokenizer/tokenizer_config.json",
        "tokenizer_2/tokenizer_config.json",
        "scheduler/scheduler_config.json",
        f"{IMAGE_ENCODER_SUBFOLDER}/config.json",
        f"{ADAPTER_SUBFOLDER}/{ADAPTER_WEIGHT_NAME}",
        "stage.json",
        "MODEL_CARD.md",
    ):
        assert (SHIPPED_DIR / name).is_file(), name
    assert json.loads((SHIPPED_DIR / "model_index.json").read_text())["_class_name"] == "FluxPipeline"


def test_loads_through_from_pretrained_and_load_ip_adapter():
    from diffusers import FlowMatchEulerDiscreteScheduler, FluxPipeline
    from diffusers.models.transformers.transformer_flux import FluxIPAdapterAttnProcessor
    from transformers import CLIPVisionModelWithProjection

    pipe = FluxPipeline.from_pretrained(SHIPPED_DIR)
    pipe.load_ip_adapter(
        str(SHIPPED_DIR / ADAPTER_SUBFOLDER),
        weight_name=ADAPTER_WEIGHT_NAME,
        image_encoder_pretrained_model_name_or_path=str(SHIPPED_DIR / IMAGE_ENCODER_SUBFOLDER),
        image_encoder_dtype=torch.float32,
    )
    assert isinstance(pipe.scheduler, FlowMatchEulerDiscreteScheduler)
    assert isinstance(pipe.image_encoder, CLIPVisionModelWithProjection)
    adapted = [
        p for p in pipe.transformer.attn_processors.values() if isinstance(p, FluxIPAdapterAttnProcessor)
    ]
    assert len(adapted) == len(pipe.transformer.transformer_blocks) == 2
    assert {
        next(getattr(pipe, name).parameters()).dtype for name in ("transformer", "vae", "image_encoder")
    } == {torch.float32}


def _ip_keys(pipe, images) -> torch.Tensor:
    """The image keys of the first double block for ``ip_adapter_image=[images]`` (one adapter)."""
    captured = []
    processor = pipe.transformer.attn_processors["transformer_blocks.0.attn.processor"]
    handle = processor.to_k_ip[0].register_forward_hook(lambda module, args, out: captured.append(out))
    try:
        pipe(
            "a photograph",
            ip_adapter_image=[images],
            num_inference_steps=1,
            generator=torch.Generator().manual_seed(0),
            **TINY_FLUX_DIGITS_CALL,
        )
    finally:
        handle.remove()
    keys = captured[0]  # (batch, m, tokens, inner): diffusers' MultiIPAdapterImageProjection keeps m
    return keys.reshape(keys.shape[0], -1, keys.shape[-1])


def test_a_support_set_of_m_images_gives_m_times_4_distinct_image_keys(pipe):
    three, five = tiny_digit_image(3), tiny_digit_image(5)
    alone = [_ip_keys(pipe, [image]) for image in (three, five)]
    assert all(keys.shape[1] == IMAGE_TOKENS for keys in alone)
    both = _ip_keys(pipe, [three, five])
    assert both.shape[1] == 2 * IMAGE_TOKENS
    torch.testing.assert_close(both, torch.cat(alone, dim=1))  # the set's keys: each reference's, in order
    assert not torch.allclose(alone[0], alone[1])  # different references, different keys
    assert _ip_keys(pipe, [three] * 4).shape[1] == 4 * IMAGE_TOKENS


def test_support_sets_are_disjoint_one_class_each():
    references = load_digit_splits()["reference"]
    for size, count in ((1, 100), (2, 50), (3, 30), (4, 20)):
        sets = support_sets(references, size)
        assert len(sets) == count and all(len(rows) == size for rows in sets)
        rows = np.concatenate(sets)
        assert len(set(rows.tolist())) == len(rows)  # disjoint
        assert all(len(set(references.labels[s].tolist())) == 1 for s in sets)
    with pytest.raises(ValueError, match="at least one reference"):
        support_sets(references, 0)


def test_pilot_references_are_judge_digits_10_per_class_never_a_reference_or_training_digit():
    splits = load_digit_splits()
    pilot = pilot_references(splits["judge"])
    assert len(pilot) == 100 and np.array_equal(np.bincount(pilot.labels), np.full(10, 10))
    assert set(pilot.indices.tolist()) <= set(splits["judge"].indices.tolist())
    assert not set(pilot.indices.tolist()) & set(splits["reference"].indices.tolist())
    assert not set(pilot.indices.tolist()) & set(splits["train"].indices.tolist())
    row = int(np.flatnonzero(splits["judge"].indices == pilot.indices[0])[0])
    assert np.array_equal(pilot.images[0], splits["judge"].images[row])  # images travel with their rows
    assert len(support_sets(pilot, 1)) == 100
    with pytest.raises(ValueError, match=r"per_class must be in \[1, \d+\], got 0"):
        pilot_references(splits["judge"], 0)


def _agreement(pipe, judge) -> int:
    result = measure_support_agreement(
        pipe,
        judge,
        load_digit_splits()["reference"],
        1,
        steps=SAMPLE_STEPS,
        limit=SAMPLE,
        call_kwargs={
            "max_sequence_length": TINY_FLUX_DIGITS_CALL["max_sequence_length"],
            "true_cfg_scale": QUALITY_TRUE_CFG_SCALE,
            "negative_prompt": "",
        },
    )
    assert result.n == SAMPLE and result.settings["support_size"] == 1
    return result.agreed


def test_the_shipped_adapter_keeps_the_references_class(pipe, judge):
    assert _agreement(pipe, judge) >= PASS_AT


def test_an_untrained_adapter_file_fails_the_same_check(judge, tmp_path):
    folder = tmp_path / "model"
    shutil.copytree(SHIPPED_DIR, folder)
    weights = folder / ADAPTER_SUBFOLDER / ADAPTER_WEIGHT_NAME
    from diffusers import FluxTransformer2DModel

    transformer = FluxTransformer2DModel.from_pretrained(folder / "transformer")
    untrained = initial_adapter_state_dict(transformer, seed=0)
    assert set(untrained) == set(load_file(weights))  # the same file, untrained
    save_file({key: value.half().contiguous() for key, value in untrained.items()}, weights)
    assert _agreement(load_pipeline(folder), judge) < PASS_AT


def test_an_untrained_transformer_file_fails_the_same_check(judge, tmp_path):
    from diffusers import FluxTransformer2DModel

    from nw_adapter.models.tiny_flux_digits import build_transformer

    folder = tmp_path / "model"
    shutil.copytree(SHIPPED_DIR, folder)
    torch.manual_seed(0)
    untrained: FluxTransformer2DModel = build_transformer().to(torch.float16)
    shutil.rmtree(folder / "transformer")
    untrained.save_pretrained(folder / "transformer", safe_serialization=True)
    assert _agreement(load_pipeline(folder), judge) < PASS_AT


def test_the_public_loader_observes_a_support_set_bit_identically():
    import nw_adapter
    from nw_adapter.pipelines import FluxNWPipeline

    pipe = nw_adapter.load_tiny_flux_digits(pipeline_class=FluxNWPipeline)
    assert isinstance(pipe, FluxNWPipeline)
    support = [tiny_digit_image(1), tiny_digit_image(7)]
    call = {"num_inference_steps": 2, "output_type": "np", "max_sequence_length": 32}
    stock = pipe(
        "a photograph", ip_adapter_image=[support], generator=torch.Generator().manual_seed(0), **call
    )
    assert stock.images.shape == (1, 32, 32, 3)  # the loader's default size, not FluxPipeline's 512
    with nw_adapter.nw_processor(pipe, mode="observe") as recorder:
        observed = pipe(
            "a photograph", ip_adapter_image=[support], generator=torch.Generator().manual_seed(0), **call
        )
    assert np.array_equal(stock.images, observed.images)
    assert {record["num_keys"] for record in recorder.to_records()} == {2 * IMAGE_TOKENS}


def test_correlate_runs_on_tiny_flux_digits_offline(tmp_path):
    from nw_adapter.correlate.cli import main
    from nw_adapter.models.tiny_digits import example_image_path

    out = tmp_path / "out"
    code = main(
        [
            "--image",
            str(example_image_path(3)),
            "--model",
            "tiny-flux-digits",
            "--steps",
            "2",
            "--out",
            str(out),
        ]
    )
    assert code == 0
    rho = json.loads((out / "rho.json").read_text())
    assert rho["config"]["max_sequence_length"] == 32
    assert "random weights" not in json.dumps(rho.get("warning", ""))
    assert rho["config"]["model"]["model"] == "tiny-flux-digits"


def test_held_out_loss_is_lowest_with_a_reference_of_the_right_class(pipe, tmp_path):
    """The trained adapter: right < black < wrong reference on held-out digits; the untrained one
    (``to_v_ip`` at zero) adds nothing, so the three losses are equal."""
    from nw_adapter.models.tiny_flux_digits import held_out_flow_losses

    splits = load_digit_splits()
    losses = held_out_flow_losses(pipe, splits["judge"], splits["reference"], count=60)
    assert losses["right"] < losses["black"] < losses["wrong"]

    folder = tmp_path / "model"
    shutil.copytree(SHIPPED_DIR, folder)
    untrained = initial_adapter_state_dict(pipe.transformer, seed=0)
    save_file(
        {k: v.half().contiguous() for k, v in untrained.items()},
        folder / ADAPTER_SUBFOLDER / ADAPTER_WEIGHT_NAME,
    )
    flat = held_out_flow_losses(load_pipeline(folder), splits["judge"], splits["reference"], count=60)
    assert flat["right"] == flat["black"] == flat["wrong"]
