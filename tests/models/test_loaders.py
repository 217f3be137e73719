"""The public loaders of the embedded models: offline, IP-Adapter loaded, the CLI's cache layout."""

from __future__ import annotations

import torch

import nw_adapter
from nw_adapter.models import loaders


def test_tiny_digits_loads_offline_and_generates_a_digit_conditioned_on_a_reference():
    torch.set_num_threads(1)
    pipe = nw_adapter.load_tiny_digits()
    assert pipe.unet.encoder_hid_proj is not None  # the IP-Adapter is loaded
    reference = nw_adapter.tiny_digit_image(3)
    assert reference.mode == "RGB" and reference.size == (32, 32)
    out = pipe(
        "a photograph",
        ip_adapter_image=reference,
        num_inference_steps=2,
        generator=torch.Generator().manual_seed(0),
        output_type="np",
    )
    assert out.images.shape == (1, 32, 32, 3)


def test_tiny_sd3_writes_once_into_the_given_folder_and_loads_its_adapter(tmp_path):
    torch.set_num_threads(1)
    pipe = loaders.load_tiny_sd3(folder=tmp_path)
    assert (tmp_path / "sd3" / "model_index.json").is_file()
    assert getattr(pipe.transformer, "encoder_hid_proj", None) is not None or pipe.image_encoder is not None
    stamp = (tmp_path / "sd3" / "model_index.json").stat().st_mtime_ns
    loaders.load_tiny_sd3(folder=tmp_path)
    assert (tmp_path / "sd3" / "model_index.json").stat().st_mtime_ns == stamp  # reused, not rewritten


def test_the_default_cache_is_the_one_the_cli_uses(monkeypatch, tmp_path):
    from nw_adapter.correlate import families, loading

    monkeypatch.setenv("NW_ADAPTER_CACHE", str(tmp_path))
    assert loaders.cache_dir() == loading.tiny_cache_dir() == tmp_path
    model, adapter, _ = families.ensure_tiny_flow_models(families.FAMILIES["sd3"], tmp_path)
    assert model == loaders.flow_cache_folder(0) / "sd3"
    assert adapter == loaders.flow_cache_folder(0) / "sd3-ip-adapter"


def test_loading_in_a_notebook_is_as_quiet_as_the_command_line():
    """A fresh interpreter (a notebook's first load, the README's imports): the companion pipelines
    import, the trained tiny models load and the plug-in field's ``from_pipe`` (docs/api.md's
    example) runs without a line on stderr (no torchvision fallback note, no float32 cast note, no
    progress bars); ``verbose=True`` shows the libraries' own output, so the quiet one is not an
    accident of the environment."""
    import subprocess
    import sys
    from pathlib import Path

    from subprocess_limits import SUBPROCESS_TIMEOUT_S

    script = (
        "import sys, nw_adapter\n"
        "from nw_adapter.pipelines import StableDiffusionNWFieldPipeline, StableDiffusionNWPipeline\n"
        "pipe = nw_adapter.load_tiny_digits(pipeline_class=StableDiffusionNWPipeline)\n"
        "StableDiffusionNWFieldPipeline.from_pipe(pipe, references=[nw_adapter.tiny_digit_image(3)])\n"
        "nw_adapter.load_tiny_flux_digits()\n"
        "print('---', file=sys.stderr)\n"
        "nw_adapter.load_tiny_digits(verbose=True)\n"
    )
    repo = Path(__file__).resolve().parents[2]
    env = {**__import__("os").environ, "PYTHONPATH": str(repo)}
    for name in ("TRANSFORMERS_VERBOSITY", "DIFFUSERS_VERBOSITY", "HF_HUB_DISABLE_PROGRESS_BARS"):
        env.pop(name, None)
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=SUBPROCESS_TIMEOUT_S
    )
    assert done.returncode == 0, done.stderr
    quiet, _, verbose = done.stderr.partition("---\n")
    assert quiet == ""
    assert "Loading pipeline components" in verbose and "float32" in verbose
