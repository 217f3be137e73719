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


def _stage1_weights(run: Path) -> dict[Path, int]:
    """:func:`_weights` of the transformer stage (stage 1) only."""
    return {path: time for path, time in _weights(run).items() if "stages/transformer" in path.as_posix()}


def _train_quick(run: Path, *flags: str):
    """``train_tiny_flow.py --quick`` into ``run`` with m = 1 in every stage-2 step and ``flags``."""
    return run_script(
        "train_tiny_flow.py", "--out", str(run), "--quick", "--no-progress", "--single-share", "1", *flags
    )


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
    variant = settings_of(replace(FluxTrainingConfig(), transformer_double_blocks=3, single_share=0.5))
    assert variant["transformer"][-1] == "transformer_double_blocks"
    assert variant["adapter"][-1] == "single_share" and "image_dropout" not in variant["adapter"]
    assert "transformer_class_free_drop" in default["transformer"]  # the shipped recipe: always recorded
    assert "adapter_transformer_lr" in default["adapter"]

    run = _copy(quick_run, tmp_path)
    with pytest.raises(
        StageMismatchError, match=r"stages/adapter.*image_dropout: 'missing' on disk, 0.1 asked"
    ):
        run_flux_training(run, replace(QUICK, image_dropout=0.1), progress=False)
    with pytest.raises(StageMismatchError, match=r"stages/transformer.*transformer_class_free_drop"):
        run_flux_training(run, replace(QUICK, transformer_class_free_drop=False), progress=False)
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


def test_shifted_images_translate_with_a_black_border_and_keep_the_image_in_the_middle():
    import numpy as np

    from nw_adapter.models.training.flux import shifted_images

    images = np.arange(2 * 5 * 5 * 3, dtype=np.uint8).reshape(2, 5, 5, 3) + 1  # no zero pixel
    views = shifted_images(images, 1)
    assert views.shape == (2, 9, 5, 5, 3)
    assert np.array_equal(views[:, 4], images)  # (dy, dx) = (0, 0)
    down_right = views[:, 8]  # (dy, dx) = (1, 1)
    assert np.array_equal(down_right[:, 1:, 1:], images[:, :-1, :-1])
    assert not down_right[:, 0].any() and not down_right[:, :, 0].any()
    up = views[:, 1]  # (dy, dx) = (-1, 0)
    assert np.array_equal(up[:, :-1], images[:, 1:]) and not up[:, -1].any()
    assert np.array_equal(shifted_images(images, 0)[:, 0], images)
    with pytest.raises(ValueError, match=r"max_shift must be in \[0, 4\], got 5"):
        shifted_images(images, 5)


@pytest.fixture(scope="module")
def single_run(quick_run, tmp_path_factory) -> Path:
    """The quick run with its adapter retrained at m = 1 in every step (the quick run's 40 images hold
    too few per class for m = 4 once an option changes which m are drawn)."""
    run = _copy(quick_run, tmp_path_factory.mktemp("flux_single"))
    shutil.rmtree(run / "stages" / "adapter")
    shutil.rmtree(run / "tiny_flux_digits")
    run_flux_training(run, replace(QUICK, single_share=1.0), progress=False)
    return run


@pytest.mark.parametrize(
    ("flags", "settings"),
    [
        (("--embed-noise", "0.5"), {"embed_noise": 0.5}),
        (("--shift-augment", "1"), {"shift_augment": 1}),
        (("--adapter-steps", "3", "--adapter-lr", "0.01"), {"adapter_steps": 3, "adapter_lr": 0.01}),
    ],
)
def test_each_stage2_flag_reaches_the_adapter_record_and_changes_the_adapter(
    single_run, tmp_path, flags, settings
):
    """The script's stage-2 options retrain the adapter only (the transformer stage is reused), are
    recorded in the adapter's stage.json, and give other adapter weights than the run without them."""
    run = _copy(single_run, tmp_path)
    transformer = _stage1_weights(run)
    baseline = load_file(run / "stages" / "adapter" / tiny_flux_digits.ADAPTER_WEIGHT_NAME)
    shutil.rmtree(run / "stages" / "adapter")
    shutil.rmtree(run / "tiny_flux_digits")
    result = _train_quick(run, *flags)
    assert result.returncode == 0, result.stderr
    record = json.loads((run / "stages" / "adapter" / "stage.json").read_text())
    assert {key: record["settings"][key] for key in settings} == settings
    assert {path: time for path, time in _weights(run).items() if path in transformer} == transformer
    trained = load_file(run / "stages" / "adapter" / tiny_flux_digits.ADAPTER_WEIGHT_NAME)
    assert any(not torch.equal(trained[key], baseline[key]) for key in baseline)


def _train_adapter(image_embeds: torch.Tensor, **options):
    """Two seeded stage-2 steps on a random untrained transformer (12 targets of 2 classes).

    Returns:
        ``(losses, before, after)``: the losses and the transformer's own weights (the adapter's left
        out) before and after training.
    """
    from diffusers import FluxTransformer2DModel

    from nw_adapter.models.training.flux import FluxBatchInputs, load_adapter_for_training, train_flux_adapter

    torch.manual_seed(0)
    n = len(image_embeds)
    transformer = tiny_flux_digits.build_transformer()
    state = tiny_flux_digits.initial_adapter_state_dict(transformer, seed=1)
    before = {key: value.clone() for key, value in transformer.state_dict().items()}

    class _Pipe:  # what load_adapter_for_training uses of a FluxPipeline
        def __init__(self, model) -> None:
            self.transformer = model

        def load_ip_adapter(self, nested, **_) -> None:
            self.transformer._load_ip_adapter_weights([nested], low_cpu_mem_usage=False)

    model = FluxTransformer2DModel.from_config(transformer.config)
    model.load_state_dict(transformer.state_dict())
    parameters = load_adapter_for_training(_Pipe(model), state)
    losses = train_flux_adapter(
        model,
        parameters,
        torch.randn(n, 16, 16, generator=torch.Generator().manual_seed(2)),
        image_embeds,
        torch.zeros(32),
        torch.arange(n) % 2,
        torch.zeros(1, tiny_flux_digits.TEXT_TOKENS, 32),
        torch.zeros(1, 32),
        FluxBatchInputs(torch.zeros(16, 3), torch.zeros(tiny_flux_digits.TEXT_TOKENS, 3)),
        steps=2,
        batch_size=4,
        lr=1e-2,
        seed=3,
        progress=False,
        **options,
    )[0]
    after = model.state_dict()
    return losses, before, {key: after[key] for key in before}


def test_embed_noise_and_views_change_the_adapter_training_and_bad_noise_is_refused():
    """Noise on the embeddings, or several views of each, change the losses of the same seeded run;
    one view without noise is the plain ``(N, 32)`` run bit for bit."""
    embeds = torch.randn(12, 32, generator=torch.Generator().manual_seed(4))
    plain = _train_adapter(embeds)[0]
    assert _train_adapter(embeds[:, None])[0] == plain
    assert _train_adapter(embeds, embed_noise=0.5)[0] != plain
    assert _train_adapter(torch.stack([embeds, -embeds], dim=1))[0] != plain
    with pytest.raises(ValueError, match="embed_noise must be >= 0, got -0.1"):
        _train_adapter(embeds, embed_noise=-0.1)


def test_transformer_lr_trains_the_transformer_with_the_adapter_and_zero_leaves_it_bit_identical():
    embeds = torch.randn(12, 32, generator=torch.Generator().manual_seed(4))
    plain, before, after = _train_adapter(embeds)
    assert all(torch.equal(after[key], before[key]) for key in before)  # frozen: bit for bit
    assert _train_adapter(embeds, transformer_lr=0.0)[0] == plain
    joint, before, after = _train_adapter(embeds, transformer_lr=1e-3)
    assert joint[0] == plain[0] and joint[1] != plain[1]  # the same first batch, then another model
    unchanged = {key for key in before if torch.equal(after[key], before[key])}
    # every transformer tensor is trained but the weights that read the text, all zeros here
    assert unchanged == {"context_embedder.weight", "time_text_embed.text_embedder.linear_1.weight"}
    with pytest.raises(ValueError, match="transformer_lr must be >= 0, got -0.1"):
        _train_adapter(embeds, transformer_lr=-0.1)


def test_adapter_transformer_lr_is_recorded_saves_the_tuned_transformer_and_the_folder_holds_it(
    single_run, tmp_path
):
    """A default run (the shipped recipe) trains the transformer with the adapter: the adapter stage
    records the learning rate, writes the tuned transformer beside the adapter (every tensor changed)
    and the model folder holds it; ``--adapter-transformer-lr 0`` retrains the adapter stage alone and
    keeps the stage-1 transformer bit for bit; each refuses the other's adapter stage."""
    joint = _copy(single_run, tmp_path / "joint")
    stage1 = load_file(joint / "stages" / "transformer" / "diffusion_pytorch_model.safetensors")
    record = json.loads((joint / "stages" / "adapter" / "stage.json").read_text())
    assert record["settings"]["adapter_transformer_lr"] == FluxTrainingConfig().adapter_transformer_lr > 0
    tuned = load_file(joint / "stages" / "adapter" / "transformer" / "diffusion_pytorch_model.safetensors")
    assert tuned.keys() == stage1.keys()  # the transformer's own weights, no adapter layers
    config = (joint / "stages" / "adapter" / "transformer" / "config.json").read_text()
    assert config == (joint / "stages" / "transformer" / "config.json").read_text()  # no run path in it
    assert all(not torch.equal(tuned[key], stage1[key]) for key in stage1)
    folder = load_file(joint / "tiny_flux_digits" / "transformer" / "diffusion_pytorch_model.safetensors")
    assert all(torch.equal(folder[key], tuned[key].half()) for key in tuned)
    with pytest.raises(
        StageMismatchError, match=r"stages/adapter.*adapter_transformer_lr: 0.001 on disk, 0.0 asked"
    ):
        run_flux_training(joint, replace(QUICK, single_share=1.0, adapter_transformer_lr=0.0), progress=False)

    run = _copy(single_run, tmp_path / "frozen")
    transformer = _stage1_weights(run)
    shutil.rmtree(run / "stages" / "adapter")
    shutil.rmtree(run / "tiny_flux_digits")
    result = _train_quick(run, "--adapter-transformer-lr", "0")
    assert result.returncode == 0, result.stderr
    record = json.loads((run / "stages" / "adapter" / "stage.json").read_text())
    assert record["settings"]["adapter_transformer_lr"] == 0.0
    assert {path: time for path, time in _weights(run).items() if path in transformer} == transformer
    assert not (run / "stages" / "adapter" / "transformer").exists()
    folder = load_file(run / "tiny_flux_digits" / "transformer" / "diffusion_pytorch_model.safetensors")
    assert folder.keys() == stage1.keys()
    assert all(torch.equal(folder[key], stage1[key].half()) for key in stage1)
    with pytest.raises(
        StageMismatchError, match=r"stages/adapter.*adapter_transformer_lr: 0.0 on disk, 0.001 asked"
    ):
        run_flux_training(run, replace(QUICK, single_share=1.0), progress=False)


def test_double_blocks_reaches_the_transformer_record_and_the_adapter_gets_a_layer_pair_per_block(
    quick_run, tmp_path
):
    """``--double-blocks 3`` retrains stage 1 with 3 double blocks (recorded), the adapter gets
    ``to_k_ip`` / ``to_v_ip`` in each, and the folder still loads through the standard calls."""
    run = _copy(quick_run, tmp_path)
    for folder in ("transformer", "adapter"):
        shutil.rmtree(run / "stages" / folder)
    shutil.rmtree(run / "tiny_flux_digits")
    result = _train_quick(run, "--double-blocks", "3")
    assert result.returncode == 0, result.stderr
    record = json.loads((run / "stages" / "transformer" / "stage.json").read_text())
    assert record["settings"]["transformer_double_blocks"] == 3
    config = json.loads((run / "tiny_flux_digits" / "transformer" / "config.json").read_text())
    assert config["num_layers"] == 3
    adapter = load_file(run / "stages" / "adapter" / tiny_flux_digits.ADAPTER_WEIGHT_NAME)
    assert {key.split(".")[1] for key in adapter if key.startswith("double_blocks.")} == {"0", "1", "2"}
    pipe = tiny_flux_digits.load_pipeline(run / "tiny_flux_digits")
    assert len(pipe.transformer.transformer_blocks) == 3
    with pytest.raises(ValueError, match="double_blocks must be >= 1, got 0"):
        tiny_flux_digits.build_transformer(0)


def test_the_cards_stage_table_says_what_each_stage_trained():
    """The model card's stage table follows the training record: stage 1's caption drop, and whether
    stage 2 trained the transformer with the adapter (and at which learning rate)."""
    import importlib.util
    from dataclasses import asdict

    path = Path(__file__).resolve().parents[2] / "scripts" / "evaluate_tiny_flow.py"
    spec = importlib.util.spec_from_file_location("evaluate_tiny_flow", path)
    evaluate = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(evaluate)

    stage1, stage2 = evaluate.stage_rows(asdict(FluxTrainingConfig()))  # the shipped recipe
    assert '"a photograph"' in stage1[2] and stage1[3] == "2500 x 32, 0.001"
    assert (
        stage2[1] == "IP-Adapter and transformer (stage 2)"
        and stage2[3] == "5000 x 32, 0.005 (transformer 0.001)"
    )
    first = replace(
        FluxTrainingConfig(),
        transformer_class_free_drop=False,
        adapter_transformer_lr=0.0,
        adapter_steps=2500,
    )
    stage1, stage2 = evaluate.stage_rows(asdict(first))  # the first shipped weights' recipe
    assert stage1[2].endswith("15% empty prompt") and '"a photograph"' not in stage1[2]
    assert stage2[1] == "IP-Adapter only (stage 2)" and stage2[3] == "2500 x 32, 0.005"
