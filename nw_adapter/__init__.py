"""nw-adapter: IP-Adapter cross-attention as Nadaraya-Watson kernel smoothing.

Layers, bottom to top (a layer imports only the layers below it; ``tests/test_layering.py``):

- :mod:`nw_adapter.core`: the math, pure torch (kernels, bandwidth rules, paths and
  ``NWVelocityField``, sampling, metrics);
- :mod:`nw_adapter.integration`: the diffusers side (config, processors, recorder, noise
  levels, mixin / apply / remove / context manager);
- :mod:`nw_adapter.analysis`: reports of the records (summary, CSV, figures, heat maps), the
  records file and its checks, ``compare_swap``;
- :mod:`nw_adapter.correlate`: the ``correlate`` application (the only layer that prints);
- :mod:`nw_adapter.models`: embedded tiny models; :mod:`nw_adapter.experiments`: the failure
  regimes; :mod:`nw_adapter.atomic`: stdlib-only atomic file writes used by every layer.

The public names below are imported on first use, so ``import nw_adapter`` stays light.

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
    "NWProcessorConfig": "nw_adapter.integration.config",
    "NWRecorder": "nw_adapter.integration.recorder",
    "NWIPAdapterAttnProcessor": "nw_adapter.integration.processors",
    "NWIPAdapterAttnProcessor2_0": "nw_adapter.integration.processors",
    "NWIPAdapterMixin": "nw_adapter.integration.mixin",
    "apply_nw_processor": "nw_adapter.integration.mixin",
    "remove_nw_processor": "nw_adapter.integration.mixin",
    "nw_processor": "nw_adapter.integration.mixin",
    "NWVelocityField": "nw_adapter.core.paths",
    "load_tiny_digits": "nw_adapter.models.loaders",
    "load_tiny_sd3": "nw_adapter.models.loaders",
    "load_tiny_flux": "nw_adapter.models.loaders",
    "load_tiny_flux_digits": "nw_adapter.models.loaders",
    "tiny_digit_image": "nw_adapter.models.loaders",
    "compare_attention": "nw_adapter.core.compare",
    "compare_swap": "nw_adapter.analysis.consequence",
    "observe_support_set": "nw_adapter.analysis.support_sets",
    "verdict": "nw_adapter.correlate.verdict",
    "format_verdict": "nw_adapter.correlate.verdict",
    "comparison_records": "nw_adapter.correlate.comparisons",
    "observe_call": "nw_adapter.integration.calibration",
    "scale_matched_keys": "nw_adapter.correlate.comparisons",
    "report": "nw_adapter.correlate.html_report.build",
}

__all__ = ["__version__", *_LAZY]


def __getattr__(name: str) -> Any:
    """Import the public names on first access (PEP 562)."""
    if name in _LAZY:
        value = getattr(importlib.import_module(_LAZY[name]), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'nw_adapter' has no attribute {name!r}")
