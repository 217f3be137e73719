"""Stable Diffusion 3 / 3.5 pipeline with the NW IP-Adapter processor (``set_ip_adapter_nw_processor``).

Usable three ways: ``StableDiffusion3NWPipeline.from_pretrained(folder)``,
``StableDiffusion3NWPipeline.from_pipe(stock_pipe)`` (and back with
``StableDiffusion3Pipeline.from_pipe(nw_pipe)``),
or as a community pipeline file: ``DiffusionPipeline.from_pretrained(folder,
custom_pipeline="pipelines/pipeline_stable_diffusion_3_nw.py", trust_remote_code=True)``.
(that thin file of the repository re-exports this class).
"""

from __future__ import annotations

import functools
from typing import Any

from diffusers import StableDiffusion3Pipeline

from nw_adapter.integration.mixin import NWIPAdapterMixin


class StableDiffusion3NWPipeline(NWIPAdapterMixin, StableDiffusion3Pipeline):
    """:class:`~diffusers.StableDiffusion3Pipeline` + :class:`~nw_adapter.integration.mixin.NWIPAdapterMixin`.

    A call that raises or is interrupted keeps the NW processors installed and drops its partial
    records (one warning); ``unset_ip_adapter_nw_processor()`` restores the originals.

    Example:
        >>> pipe = StableDiffusion3NWPipeline.from_pretrained(folder)
        >>> pipe.load_ip_adapter("InstantX/SD3.5-Large-IP-Adapter", weight_name="ip-adapter.bin",
        ...     image_encoder_folder="google/siglip-so400m-patch14-384")
        >>> rec = pipe.set_ip_adapter_nw_processor(mode="observe")
        >>> pipe("a cat", ip_adapter_image=ref, num_inference_steps=28)
        >>> rec.to_csv("rho.csv")
    """

    @functools.wraps(StableDiffusion3Pipeline.__call__)
    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self._nw_call(super().__call__, *args, **kwargs)
