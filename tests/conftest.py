"""Shared fixtures: single-threaded torch for stable results, tiny offline model folders."""

from __future__ import annotations

import os

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("HF_HUB_DISABLE_TELEMETRY", "1")
torch.set_num_threads(1)


@pytest.fixture(scope="session")
def tiny_sd15_dir(tmp_path_factory: pytest.TempPathFactory):
    """A tiny SD 1.5-layout pipeline folder (random weights, written once per test session)."""
    from nw_adapter.models.tiny import save_tiny_sd15

    return save_tiny_sd15(tmp_path_factory.mktemp("tiny") / "sd15")


@pytest.fixture(scope="session")
def tiny_sdxl_dir(tmp_path_factory: pytest.TempPathFactory):
    """A tiny SDXL-layout pipeline folder."""
    from nw_adapter.models.tiny import save_tiny_sdxl

    return save_tiny_sdxl(tmp_path_factory.mktemp("tiny") / "sdxl")


@pytest.fixture(scope="session")
def tiny_ip_adapter_dir(tmp_path_factory: pytest.TempPathFactory):
    """A tiny IP-Adapter repository folder in the h94/IP-Adapter layout.

    Holds ``models/ip-adapter_sd15.safetensors``, ``models/ip-adapter-plus_sd15.safetensors``,
    ``models/image_encoder/`` and the SDXL twins under ``sdxl_models/``.
    """
    from nw_adapter.models.tiny import save_tiny_ip_adapter

    path = tmp_path_factory.mktemp("tiny") / "ip-adapter"
    for sdxl in (False, True):
        for variant in ("base", "plus"):
            save_tiny_ip_adapter(path, variant=variant, sdxl=sdxl)
    return path


@pytest.fixture(scope="session")
def tiny_sd3_dir(tmp_path_factory: pytest.TempPathFactory):
    """A tiny Stable Diffusion 3.5-layout pipeline folder (flow matching, shift 3)."""
    from nw_adapter.models.tiny_flow import save_tiny_sd3

    return save_tiny_sd3(tmp_path_factory.mktemp("tiny") / "sd3")


@pytest.fixture(scope="session")
def tiny_sd3_ip_adapter_dir(tmp_path_factory: pytest.TempPathFactory):
    """A tiny SD 3.5 IP-Adapter in the InstantX layout (``ip-adapter.bin``, SigLIP in ``siglip/``)."""
    from nw_adapter.models.tiny_flow import save_tiny_sd3_ip_adapter

    return save_tiny_sd3_ip_adapter(tmp_path_factory.mktemp("tiny") / "sd3-ip-adapter")


@pytest.fixture(scope="session")
def tiny_flux_dir(tmp_path_factory: pytest.TempPathFactory):
    """A tiny Flux-dev-layout pipeline folder (guidance embedding, dynamic shifting)."""
    from nw_adapter.models.tiny_flow import save_tiny_flux

    return save_tiny_flux(tmp_path_factory.mktemp("tiny") / "flux")


@pytest.fixture(scope="session")
def tiny_flux_ip_adapter_dir(tmp_path_factory: pytest.TempPathFactory):
    """A tiny Flux IP-Adapter in the XLabs layout (``ip_adapter.safetensors``, CLIP in its folder)."""
    from nw_adapter.models.tiny_flow import save_tiny_flux_ip_adapter

    return save_tiny_flux_ip_adapter(tmp_path_factory.mktemp("tiny") / "flux-ip-adapter")
