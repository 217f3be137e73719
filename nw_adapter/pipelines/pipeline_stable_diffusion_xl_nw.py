"""Stable Diffusion XL pipeline with the NW IP-Adapter processor (``set_ip_adapter_nw_processor``).

Usable three ways: ``StableDiffusionXLNWPipeline.from_pretrained(folder)``,
``StableDiffusionXLNWPipeline.from_pipe(stock_pipe)`` (and back with
``StableDiffusionXLPipeline.from_pipe(nw_pipe)``), or as a community pipeline file:
``DiffusionPipeline.from_pretrained(folder, custom_pipeline="pipelines/pipeline_stable_diffusion_xl_nw.py",
trust_remote_code=True)`` (that thin file of the repository re-exports this class).
"""

from __future__ import annotations

import functools
from typing import Any

from diffusers import StableDiffusionXLPipeline

from nw_adapter.integration.mixin import NWIPAdapterMixin


class StableDiffusionXLNWPipeline(NWIPAdapterMixin, StableDiffusionXLPipeline):
    """:class:`~diffusers.StableDiffusionXLPipeline` + the NW mixin.

    A call that raises or is interrupted keeps the NW processors installed and drops its partial
    records (one warning); ``unset_ip_adapter_nw_processor()`` restores the originals.

    Example:
        >>> pipe = StableDiffusionXLNWPipeline.from_pretrained(folder)
        >>> pipe.load_ip_adapter(ip_folder, subfolder="sdxl_models",
        ...                      weight_name="ip-adapter_sdxl.safetensors")
        >>> rec = pipe.set_ip_adapter_nw_processor(mode="observe")
        >>> pipe("a cat", ip_adapter_image=ref, num_inference_steps=30)
        >>> rec.to_csv("rho.csv")
    """

    @functools.wraps(StableDiffusionXLPipeline.__call__)
    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self._nw_call(super().__call__, *args, **kwargs)
