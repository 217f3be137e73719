"""Support sets at run time: the recorder's per-reference columns (integration/support.py, processors)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from tiny_helpers import random_image

from nw_adapter.core.specification import STAT_ROWS
from nw_adapter.core.support import support_statistics
from nw_adapter.integration.config import NWProcessorConfig
from nw_adapter.integration.mixin import nw_processor
from nw_adapter.integration.recorder import NWRecorder
from nw_adapter.integration.schema import support_columns, support_mass_column
from nw_adapter.integration.support import support_references, support_rows, support_values


def test_support_values_are_the_specification_averaged_over_each_cfg_half():
    gen = torch.Generator().manual_seed(0)
    q, k = torch.randn(4, 2, 9, 8, generator=gen), torch.randn(4, 2, 12, 8, generator=gen)
    got = support_values(q, k, scale=8**-0.5, references=3, halves=2)
    spec = support_statistics(q.double(), k.double(), scale=8**-0.5, references=3)
    per_row = torch.cat([spec.mass, torch.stack([spec.entropy, spec.row_entropy], -1)], -1)
    expected = per_row.view(2, 2, 2, -1).mean(1).permute(2, 0, 1)
    assert got.shape == (len(support_columns(3)) - 1, 2, 2) == (support_rows(3), 2, 2)
    assert support_references(support_rows(3)) == 3
    torch.testing.assert_close(got.double(), expected, rtol=1e-5, atol=1e-6)


def test_the_recorder_refuses_a_support_tensor_of_the_wrong_shape():
    rec = NWRecorder(NWProcessorConfig())
    stats = torch.zeros(len(STAT_ROWS), 1, 2)
    with pytest.raises(ValueError, match="support must have shape"):
        rec.add(
            layer="l",
            adapter=0,
            image=0,
            halves=("all",),
            heads=(0, 1),
            scale=1.0,
            num_keys=8,
            stats=stats,
            support=torch.zeros(3, 1, 2),
        )  # fmt: skip  (m = 1: no support set)


@pytest.fixture(scope="module")
def digits_pipe():
    from nw_adapter.models.loaders import load_tiny_digits

    return load_tiny_digits()


def _run(pipe, images, steps: int = 2):
    with nw_processor(pipe, mode="observe") as rec:
        out = pipe("a photograph", ip_adapter_image=images, num_inference_steps=steps,
                   generator=torch.Generator().manual_seed(0), output_type="np")  # fmt: skip
    return out.images, rec.to_records()


def test_a_support_set_run_records_the_columns_and_keeps_the_output(digits_pipe):
    from nw_adapter.models.loaders import tiny_digit_image

    three, seven = tiny_digit_image(3), tiny_digit_image(7)
    images, records = _run(digits_pipe, [[three, seven]])
    stock = digits_pipe("a photograph", ip_adapter_image=[[three, seven]], num_inference_steps=2,
                        generator=torch.Generator().manual_seed(0), output_type="np").images  # fmt: skip
    np.testing.assert_array_equal(images, stock)  # observe is bit-identical with a support set too
    assert records and all(r["num_refs"] == 2 and r["num_keys"] == 8 for r in records)
    assert set(support_columns(2)) <= set(records[0])
    for r in records:
        assert r["ref_mass_0"] + r["ref_mass_1"] == pytest.approx(1.0, abs=1e-5)
    ref_columns = {key for key in records[0] if key.startswith("ref_")}
    assert ref_columns == {"ref_mass_0", "ref_mass_1", "ref_entropy", "ref_row_entropy"}  # no head-space NW
    # the unconditional half's image embeds are zeros: two identical references share the mass
    assert all(r["ref_mass_0"] == pytest.approx(0.5, abs=1e-6) for r in records if r["half"] == "uncond")
    cond = [r for r in records if r["half"] == "cond"]
    assert max(abs(r["ref_mass_0"] - 0.5) for r in cond) > 0.01  # different digits: unequal shares
    # swapping the references swaps their masses (reference r owns keys r T .. (r + 1) T - 1)
    _, swapped = _run(digits_pipe, [[seven, three]])
    by_place = {(r["step"], r["layer"], r["head"], r["half"]): r for r in swapped}
    for r in cond:
        other = by_place[(r["step"], r["layer"], r["head"], r["half"])]
        assert other[support_mass_column(1)] == pytest.approx(r[support_mass_column(0)], abs=2e-3)


def test_one_reference_records_no_support_columns(digits_pipe):
    from nw_adapter.models.loaders import tiny_digit_image

    _, records = _run(digits_pipe, tiny_digit_image(3), steps=1)
    assert records and not any("num_refs" in r or "ref_mass_0" in r for r in records)


@pytest.mark.parametrize(
    ("references", "call", "message"),
    [
        ([], {}, "no reference image"),
        (["x"], {"ip_adapter_image": "x"}, "ip_adapter_image is set by the function"),
        (["x"], {"generator": None}, "generator is set by the function"),
        ("digit", {"num_inference_steps": 0}, r"num_inference_steps must be a whole number >= 1, got 0"),
        ("digit", {"num_inference_steps": 2.5}, r"num_inference_steps must be a whole number >= 1, got 2\.5"),
    ],
)
def test_observe_support_set_refuses_bad_calls(digits_pipe, references, call, message):
    from nw_adapter.analysis.support_sets import observe_support_set
    from nw_adapter.models.loaders import tiny_digit_image

    if references == "digit":  # a real reference: only the call is wrong
        references = [tiny_digit_image(3), tiny_digit_image(7)]
    with pytest.raises(ValueError, match=message):
        observe_support_set(digits_pipe, references, **call)
    with pytest.raises(ValueError, match="observes"):
        observe_support_set(digits_pipe, ["x"], config=NWProcessorConfig(mode="swap"))


def test_observe_support_set_refuses_a_family_whose_row_takes_no_set(tiny_sd3_dir, tiny_sd3_ip_adapter_dir):
    """SD 3.5 (the registry row's ``support_sets``): one line before any generation, not diffusers'
    failure on a list per adapter."""
    from diffusers import StableDiffusion3Pipeline
    from flow_helpers import load_sd3

    from nw_adapter.analysis.support_sets import observe_support_set
    from nw_adapter.integration.families import family_named

    pipe = load_sd3(StableDiffusion3Pipeline, tiny_sd3_dir, tiny_sd3_ip_adapter_dir)
    before = dict(pipe.transformer.attn_processors)
    row = family_named("sd3")
    with pytest.raises(ValueError, match=f"cannot run on {row.label}: .*list per adapter") as error:
        observe_support_set(pipe, [random_image(1, 32), random_image(2, 32)], num_inference_steps=1)
    assert "\n" not in str(error.value) and "Stable Diffusion 1.5 / XL or Flux pipeline" in str(error.value)
    assert all(pipe.transformer.attn_processors[name] is before[name] for name in before)
