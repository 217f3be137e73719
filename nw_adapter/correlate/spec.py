"""Where the command line's pipeline and adapter come from: :class:`ModelSpec`, the defaults,
the tiny-model cache and the shipped folders, whether the Hub can be reached
(:func:`hub_offline_reason`), and :class:`ModelLoadError`. Imports neither torch nor diffusers.

Shared by :mod:`~nw_adapter.correlate.loading` (UNet pipelines, the loading itself) and
:mod:`~nw_adapter.correlate.families` (the SD3 / Flux defaults); both import this module and
neither imports the other's callers back (no import circle).
"""

from __future__ import annotations

import functools
import os
import socket
import urllib.parse
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

from nw_adapter.integration.families import tiny_models

DEFAULT_MODEL = "stable-diffusion-v1-5/stable-diffusion-v1-5"
DEFAULT_IP_ADAPTER = "h94/IP-Adapter"
DEFAULT_SUBFOLDER = "models"
DEFAULT_WEIGHT_NAME = "ip-adapter_sd15.safetensors"
SDXL_SUBFOLDER = "sdxl_models"
SDXL_WEIGHT_NAME = "ip-adapter_sdxl.safetensors"
TINY = "tiny"
DIGIT_MODELS: tuple[str, ...] = tiny_models(trained=True)
"""``--model`` names of the trained digits models (SD 1.5 and Flux, 32 x 32 images), whose
generations the digit judge (``nw_adapter.models.digits_quality.digit_judge``) labels."""
SHIPPED_WEIGHTS = Path(__file__).resolve().parents[1] / "models" / "weights"
"""The package's shipped model weights (the embedded models' folders)."""
TINY_DIGITS_DIR = SHIPPED_WEIGHTS / "tiny_digits"
"""``--model tiny``: the trained model shipped in the package (``nw_adapter.models.tiny_digits.SHIPPED_DIR``,
named here without importing torch)."""
EXAMPLE_DIR = TINY_DIGITS_DIR / "examples"
"""The tiny model's bundled held-out reference digits, ``digit_0.png`` ... ``digit_9.png``
(``correlate.py --example-dir`` prints it; :func:`nw_adapter.models.tiny_digits.example_image_path`)."""


class ModelLoadError(ValueError):
    """The model or the IP-Adapter could not be loaded; the message says how to fix it."""


@dataclass(frozen=True)
class ModelSpec:
    """Where the pipeline and the adapter come from.

    Attributes:
        model: Hub id, local folder or ``"tiny"``.
        ip_adapter: Hub id, local folder or ``"tiny"``.
        subfolder: Adapter subfolder (``None``: ``models``, or ``sdxl_models`` for SDXL).
        weight_name: Adapter weight file (``None``: the SD 1.5 or SDXL default).
        image_encoder: Image encoder of SD3 / Flux adapters (``None``: the family's default, see
            :mod:`~nw_adapter.correlate.families`); UNet adapters carry theirs.
    """

    model: str = DEFAULT_MODEL
    ip_adapter: str | None = None
    subfolder: str | None = None
    weight_name: str | None = None
    image_encoder: str | None = None

    def to_dict(self) -> dict[str, str | None]:
        """JSON-ready form (``image_encoder`` only when set)."""
        out = {
            "model": self.model,
            "ip_adapter": self.ip_adapter,
            "subfolder": self.subfolder,
            "weight_name": self.weight_name,
        }
        if self.image_encoder is not None:
            out["image_encoder"] = self.image_encoder
        return out


def tiny_cache_dir() -> Path:
    """Folder the tiny model is written to (see the module docstring)."""
    if os.environ.get("NW_ADAPTER_CACHE"):
        return Path(os.environ["NW_ADAPTER_CACHE"]).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "nw_adapter"


_T = TypeVar("_T")


def write_tiny_cache(model: str, root: Path, build: Callable[[], _T]) -> _T:
    """Run ``build``, which writes tiny-model folders under ``root``, with one-line errors.

    Args:
        model: the ``--model`` value (named in the message).
        root: the cache folder being written.
        build: writes the folders (:func:`nw_adapter.models.tiny.write_once`, atomic) and returns
            what the caller needs.

    Raises:
        ModelLoadError: the folders cannot be written (a full disk or a file-size limit in
            safetensors is a ``SafetensorError``, not an ``OSError``: both are caught).
    """
    from safetensors import SafetensorError

    try:
        return build()
    except (OSError, SafetensorError) as exc:
        reason = getattr(exc, "strerror", None) or " ".join(str(exc).split())
        raise ModelLoadError(
            f"--model {model}: cannot write the tiny model to '{root}' ({reason[:200]}); "
            "free space or set NW_ADAPTER_CACHE to a writable folder"
        ) from None


HUB_CONNECT_TIMEOUT_S = 5.0
"""How long :func:`hub_offline_reason` waits for a TCP connection to the Hub (or the proxy)."""


def hub_offline_reason() -> str | None:
    """Why the Hugging Face Hub cannot be used now, or None when it can.

    Asked before the first Hub call, so that no download is tried (and retried, with back-off,
    for a minute) without network: ``HF_HUB_OFFLINE`` set (huggingface_hub's own switch), or no
    TCP connection within :data:`HUB_CONNECT_TIMEOUT_S` to the Hub's endpoint (``HF_ENDPOINT``),
    or to the environment's proxy for it when one is set. The connection test runs once per
    process and endpoint.
    """
    from huggingface_hub import constants

    if constants.HF_HUB_OFFLINE:
        return "HF_HUB_OFFLINE is set"
    parts = urllib.parse.urlsplit(constants.ENDPOINT)
    host = parts.hostname or ""
    proxy = urllib.request.getproxies().get(parts.scheme or "https")
    if proxy and not urllib.request.proxy_bypass(host):
        parts = urllib.parse.urlsplit(proxy if "://" in proxy else f"http://{proxy}")
    port = parts.port or (443 if parts.scheme == "https" else 80)
    return _no_connection(parts.hostname or host, port)


@functools.lru_cache(maxsize=16)
def _no_connection(host: str, port: int) -> str | None:
    try:
        with socket.create_connection((host, port), timeout=HUB_CONNECT_TIMEOUT_S):
            return None
    except OSError as exc:
        return f"no connection to {host}:{port} ({exc.strerror or type(exc).__name__})"
