"""nw-adapter: IP-Adapter cross-attention as Nadaraya-Watson kernel smoothing.

The pure math (``kernels``, ``bandwidth``, ``paths``, ``sampling``, ``metrics``) imports torch
only. The diffusers integration (``config``, ``processor``, ``recorder``, ``mixin``) is exported
here too but imported on first use, so ``import nw_adapter`` stays light.

Example:
    >>> from nw_adapter import nw_processor
    >>> with nw_processor(pipe, mode="observe") as rec:  # doctest: +SKIP
    ...     pipe("a cat", ip_adapter_image=ref)
    >>> rec.summary()  # doctest: +SKIP
"""

from __future__ import annotations

import importlib
from typing import Any

__version__ = "0.1.0"

_LAZY = {
    "NWProcessorConfig": "nw_adapter.config",
    "NWRecorder": "nw_adapter.recorder",
    "NWIPAdapterAttnProcessor": "nw_adapter.processor",
    "NWIPAdapterAttnProcessor2_0": "nw_adapter.processor",
    "NWIPAdapterMixin": "nw_adapter.mixin",
    "apply_nw_processor": "nw_adapter.mixin",
    "remove_nw_processor": "nw_adapter.mixin",
    "nw_processor": "nw_adapter.mixin",
}

__all__ = ["__version__", *_LAZY]


def __getattr__(name: str) -> Any:
    """Import the diffusers-side names on first access (PEP 562)."""
    if name in _LAZY:
        value = getattr(importlib.import_module(_LAZY[name]), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'nw_adapter' has no attribute {name!r}")
