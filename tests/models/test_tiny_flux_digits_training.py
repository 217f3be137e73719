"""Training of the tiny Flux digits model: the stages run, resume, and refuse mismatched stages."""

from __future__ import annotations

import json
import shutil
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from subprocess_limits import run_script

from nw_adapter.models import tiny_flux_digits
from nw_adapter.models.training.flux_run import FluxTrainingConfig, reused_parts_digest, run_flux_training
from nw_adapter.models.training.run import StageMismatchError

QUICK = FluxTrainingConfig.quick()


@pytest.fixture(scope="module")
def quick_run(tmp_path_factory) -> Path:
    """One smoke run (2 steps per stage on 40 images), copied by each test that changes it."""
    torch.set_num_threads(1)
    out = tmp_path_factory.mktemp("flux_quick")
    run_flux_training(out, QUICK, progress=False)
    return out


def _copy(run: Path, tmp_path: Path) -> Path:
    target = tmp_path / "run"
    shutil.copytree(run, target)
    return target


def _weights(run: Path) -> dict[Path, int]:
    return {path: path.stat().st_mtime_ns for path in (run / "stages").rglob("*.safetensors")}


def test_quick_training_runs_every_stage_and_loads_the_standard_way(quick_run):
    log = json.loads((quick_run / "stages" / "log.json").read_text())
    assert [log[stage]["steps"] for stage in ("transformer", "adapter")] == [2, 2]
    assert sum(log["adapter"]["support_sizes"].values()) == 2  # one support size m per step
    folder = quick_run / "tiny_flux_digits"
    shipped = load_file(folder / tiny_flux_digits.ADAPTER_SUBFOLDER / tiny_flux_digits.ADAPTER_WEIGHT_NAME)
    assert {key.split(".")[0] for key in shipped} == {"ip_adapter_proj_model", "double_blocks"}  # XLabs keys
    trained = load_file(quick_run / "stages" / "adapter" / tiny_flux_digits.ADAPTER_WEIGHT_NAME)
    assert all(torch.equal(shipped[key], trained[key].half()) for key in trained)
    pipe = tiny_flux_digits.load_pipeline(folder)
    assert pipe.transformer.encoder_hid_proj.num_ip_adapters == 1
    assert json.loads((folder / "vae" / "config.json").read_text())["shift_factor"] == 0.0
    out = pipe(
        "a photograph",
        ip_adapter_image=[[_digit(), _digit()]],
        num_inference_steps=2,
        max_sequence_length=tiny_flux_digits.TEXT_TOKENS,
        output_type="np",
    ).images
    assert out.shape == (1, 32, 32, 3)  # the default size is the VAE's 32 x 32, not 512 x 512


def _digit():
    from nw_adapter.models.loaders import tiny_digit_image

    return tiny_digit_image(4)


def test_the_reused_parts_are_the_shipped_sd15_models_files(quick_run):
    """The frozen VAE, text and image encoders are byte copies of the shipped SD 1.5 model's, and the
    parts stage records that model's record and their digest."""
    from nw_adapter.models.tiny_digits import SHIPPED_DIR

    parts = quick_run / "stages" / "parts"
    for ours, theirs in (
        ("vae", "vae"),
        ("text_encoder", "text_encoder"),
        ("image_encoder", "models/image_encoder"),
    ):
        for path in (SHIPPED_DIR / theirs).glob("*.safetensors"):
            assert (parts / ours / path.name).read_bytes() == path.read_bytes()
    record = json.loads((parts / "stage.json").read_text())
    assert record["inputs"]["tiny_digits"]["files"] == reused_parts_digest()
    assert record["inputs"]["tiny_digits"]["record"]["stage"] == "tiny_digits"


def test_a_rerun_reuses_every_stage_and_other_settings_are_refused(quick_run, tmp_path):
    run = _copy(quick_run, tmp_path)
    written = _weights(run)
    run_flux_training(run, QUICK, progress=False)
    assert _weights(run) == written  # nothing retrained or rewritten

    with pytest.raises(StageMismatchError, match=r"stages/adapter.*adapter_steps: 2 on disk, 3 asked"):
        run_flux_training(run, replace(QUICK, adapter_steps=3), progress=False)
    with pytest.raises(StageMismatchError, match=r"stages/transformer.*transformer_lr"):
        run_flux_training(run, replace(QUICK, transformer_lr=5e-4), progress=False)
    assert _weights(run) == written


def test_default_records_are_the_shipped_ones_and_variants_are_recorded_and_refused(quick_run, tmp_path):
    """The variant fields enter a stage's record only when not default: the shipped stage.json holds
    exactly what a default run records; a variant run retrains the stage it changes and records why."""
    from nw_adapter.models.training.flux_run import settings_of

    shipped = json.loads((tiny_flux_digits.SHIPPED_DIR / "stage.json").read_text())["inputs"]
    default = settings_of(FluxTrainingConfig())
    for stage in ("transformer", "adapter"):
        assert tuple(shipped[stage]["record"]["settings"]) == default[stage]
    variant = settings_of(replace(FluxTrainingConfig(), transformer_class_free_drop=True, single_share=0.5))
    assert variant["transformer"][-1] == "transformer_class_free_drop"
    assert variant["adapter"][-1] == "single_share" and "image_dropout" not in variant["adapter"]

    run = _copy(quick_run, tmp_path)
    with pytest.raises(
        StageMismatchError, match=r"stages/adapter.*image_dropout: 'missing' on disk, 0.1 asked"
    ):
        run_flux_training(run, replace(QUICK, image_dropout=0.1), progress=False)
    with pytest.raises(StageMismatchError, match=r"stages/transformer.*transformer_class_free_drop"):
        run_flux_training(run, replace(QUICK, transformer_class_free_drop=True), progress=False)
    for folder in ("adapter", "tiny_flux_digits"):
        shutil.rmtree(run / "stages" / folder if folder == "adapter" else run / folder)
    run_flux_training(run, replace(QUICK, single_share=1.0, adapter_steps=3), progress=False)
    log = json.loads((run / "stages" / "log.json").read_text())
    assert log["adapter"]["support_sizes"] == {"1": 3}  # every step m = 1
    record = json.loads((run / "stages" / "adapter" / "stage.json").read_text())
    assert record["settings"]["single_share"] == 1.0 and record["settings"]["adapter_steps"] == 3


def test_a_stage_trained_on_other_input_files_is_refused(quick_run, tmp_path):
    run = _copy(quick_run, tmp_path)
    weights = next((run / "stages" / "transformer").glob("*.safetensors"))
    state = load_file(weights)
    first = next(iter(state))
    state[first] = state[first] + 1.0
    save_file(state, weights)
    with pytest.raises(StageMismatchError, match=r"stages/adapter.*inputs\.transformer\.files"):
        run_flux_training(run, QUICK, progress=False)


def test_the_script_refuses_a_mismatched_stage_with_one_line_and_exit_code_2(quick_run, tmp_path):
    run = _copy(quick_run, tmp_path)
    (run / "stages" / "adapter" / "stage.json").write_text("{not json")
    result = run_script("train_tiny_flow.py", "--out", str(run), "--quick", "--no-progress")
    assert result.returncode == 2 and "Traceback" not in result.stderr
    errors = [line for line in result.stderr.splitlines() if "error" in line]
    assert len(errors) == 1 and errors[0].startswith("train_tiny_flow.py: error: cannot reuse")
    assert "stages/adapter" in errors[0] and "unreadable" in errors[0]


def test_support_sets_hold_m_distinct_images_of_the_targets_class_never_the_target():
    from nw_adapter.models.training.flux import support_sets

    labels = torch.tensor([0, 1, 0, 1, 0, 1, 0, 1, 0, 1])
    targets = torch.tensor([0, 1, 2, 9])
    rows = support_sets(targets, labels, 4, torch.Generator().manual_seed(0))
    assert rows.shape == (4, 4)
    for target, support in zip(targets.tolist(), rows.tolist(), strict=True):
        assert target not in support and len(set(support)) == 4
        assert all(labels[row] == labels[target] for row in support)
