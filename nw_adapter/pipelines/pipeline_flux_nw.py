"""Flux pipeline with the NW IP-Adapter processor (``set_ip_adapter_nw_processor``).

Usable three ways: ``FluxNWPipeline.from_pretrained(folder)``,
``FluxNWPipeline.from_pipe(stock_pipe)`` (and back with ``FluxPipeline.from_pipe(nw_pipe)``),
or as a community pipeline file: ``DiffusionPipeline.from_pretrained(folder,
custom_pipeline="pipelines/pipeline_flux_nw.py", trust_remote_code=True)``.
(that thin file of the repository re-exports this class).
"""

from __future__ import annotations

import functools
from typing import Any

from diffusers import FluxPipeline

from nw_adapter.integration.mixin import NWIPAdapterMixin


class FluxNWPipeline(NWIPAdapterMixin, FluxPipeline):
    """:class:`~diffusers.FluxPipeline` + :class:`~nw_adapter.integration.mixin.NWIPAdapterMixin`.

    A call that raises or is interrupted keeps the NW processors installed and drops its partial
    records (one warning); ``unset_ip_adapter_nw_processor()`` restores the originals.

    Example:
        >>> pipe = FluxNWPipeline.from_pretrained(folder)
        >>> pipe.load_ip_adapter("XLabs-AI/flux-ip-adapter", weight_name="ip_adapter.safetensors",
        ...     image_encoder_pretrained_model_name_or_path="openai/clip-vit-large-patch14")
        >>> rec = pipe.set_ip_adapter_nw_processor(mode="observe")
        >>> pipe("a cat", ip_adapter_image=ref, true_cfg_scale=4.0, negative_prompt="blurry")
        >>> rec.to_csv("rho.csv")
    """

    @functools.wraps(FluxPipeline.__call__)
    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self._nw_call(super().__call__, *args, **kwargs)
