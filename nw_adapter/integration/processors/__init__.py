"""Attention processors that observe or swap the image branch of IP-Adapter layers.

- :mod:`~nw_adapter.integration.processors.side`: the side computation shared by every model
  family (A and NW weights of one softmax, the statistics, the bandwidth rules, map pooling);
  imports torch and the math layer only.
- :mod:`~nw_adapter.integration.processors.unet`: the processors of UNet pipelines (SD 1.5,
  SDXL), subclasses of diffusers' ``IPAdapterAttnProcessor`` / ``IPAdapterAttnProcessor2_0``.

One small module per further family (SD3, Flux transformers) sits beside ``unet``.
"""

from nw_adapter.integration.processors.unet import (
    NWIPAdapterAttnProcessor,
    NWIPAdapterAttnProcessor2_0,
    is_nw_processor,
    nw_processor_for,
)

__all__ = ["NWIPAdapterAttnProcessor", "NWIPAdapterAttnProcessor2_0", "is_nw_processor", "nw_processor_for"]
