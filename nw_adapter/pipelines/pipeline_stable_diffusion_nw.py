"""Stable Diffusion pipeline with the NW IP-Adapter processor (``set_ip_adapter_nw_processor``).

Usable three ways: ``StableDiffusionNWPipeline.from_pretrained(folder)``,
``StableDiffusionNWPipeline.from_pipe(stock_pipe)`` (and back with
``StableDiffusionPipeline.from_pipe(nw_pipe)``), or as a community pipeline file:
``DiffusionPipeline.from_pretrained(folder, custom_pipeline="pipelines/pipeline_stable_diffusion_nw.py",
trust_remote_code=True)`` (that thin file of the repository re-exports this class).
"""

from __future__ import annotations

import functools
from typing import Any

from diffusers import StableDiffusionPipeline

from nw_adapter.integration.mixin import NWIPAdapterMixin


class StableDiffusionNWPipeline(NWIPAdapterMixin, StableDiffusionPipeline):
    """:class:`~diffusers.StableDiffusionPipeline` + :class:`~nw_adapter.integration.mixin.NWIPAdapterMixin`.

    A call that raises or is interrupted keeps the NW processors installed and drops its partial
    records (one warning); ``unset_ip_adapter_nw_processor()`` restores the originals.

    Example:
        >>> pipe = StableDiffusionNWPipeline.from_pretrained(folder)
        >>> pipe.load_ip_adapter(ip_folder, subfolder="models", weight_name="ip-adapter_sd15.safetensors")
        >>> rec = pipe.set_ip_adapter_nw_processor(mode="observe")
        >>> pipe("a cat", ip_adapter_image=ref, num_inference_steps=30)
        >>> rec.to_csv("rho.csv")
    """

    @functools.wraps(StableDiffusionPipeline.__call__)
    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self._nw_call(super().__call__, *args, **kwargs)
