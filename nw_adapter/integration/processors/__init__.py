"""Attention processors that observe or swap the image branch of IP-Adapter layers.

- :mod:`~nw_adapter.integration.processors.base`: what every family shares (adoption of the
  stock processor and its ``scale``, step / head / CFG-half selection, the bandwidth, recording
  one softmax through :mod:`nw_adapter.integration.stats`, safe recording).
- :mod:`~nw_adapter.integration.processors.unet`: the processors of UNet pipelines (SD 1.5,
  SDXL), subclasses of diffusers' ``IPAdapterAttnProcessor`` / ``IPAdapterAttnProcessor2_0``.
- :mod:`~nw_adapter.integration.processors.sd3`: SD 3 / 3.5 transformers
  (``SD3IPAdapterJointAttnProcessor2_0``); :mod:`~nw_adapter.integration.processors.flux`: Flux
  (``FluxIPAdapterAttnProcessor``).

:func:`nw_processor_for` replaces a stock processor by the NW processor its family's row names
(:mod:`nw_adapter.integration.families`, the one table of the families); :func:`is_ip_processor`
and :func:`is_nw_processor` recognise every family.
"""

from __future__ import annotations

import importlib
from typing import Any

import torch

from nw_adapter.integration.config import NWProcessorConfig
from nw_adapter.integration.families import family_of_processor, nw_processor_class_name
from nw_adapter.integration.processors.base import NWProcessorBase, is_nw_processor
from nw_adapter.integration.processors.flux import NWFluxIPAdapterAttnProcessor
from nw_adapter.integration.processors.sd3 import NWSD3IPAdapterJointAttnProcessor2_0
from nw_adapter.integration.processors.unet import NWIPAdapterAttnProcessor, NWIPAdapterAttnProcessor2_0
from nw_adapter.integration.recorder import NWRecorder


def is_ip_processor(processor: Any) -> bool:
    """Whether ``processor`` is an IP-Adapter processor of diffusers (stock or NW) of any family
    (:func:`~nw_adapter.integration.families.family_of_processor`)."""
    return family_of_processor(processor) is not None


def nw_processor_for(
    original: torch.nn.Module, *, layer_name: str, config: NWProcessorConfig, recorder: NWRecorder
) -> torch.nn.Module:
    """The NW processor that replaces ``original`` (an IP-Adapter processor of any family): the class
    the family's row names (:data:`~nw_adapter.integration.families.FAMILIES`), from its module.

    Raises:
        ValueError: if ``original`` is already an NW processor or not an IP-Adapter processor.
    """
    if is_nw_processor(original):
        raise ValueError(f"layer {layer_name!r} already has an NW processor; unset it first")
    found = nw_processor_class_name(original)
    if found is None:
        raise ValueError(
            f"layer {layer_name!r} has {type(original).__name__}, not an IP-Adapter processor; "
            "call pipe.load_ip_adapter(...) first"
        )
    module, name = found
    processor_class = getattr(importlib.import_module(module), name)
    return processor_class(original, layer_name=layer_name, config=config, recorder=recorder)


__all__ = [
    "NWFluxIPAdapterAttnProcessor",
    "NWIPAdapterAttnProcessor",
    "NWIPAdapterAttnProcessor2_0",
    "NWProcessorBase",
    "NWSD3IPAdapterJointAttnProcessor2_0",
    "is_ip_processor",
    "is_nw_processor",
    "nw_processor_for",
]
