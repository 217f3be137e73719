"""Companion diffusers pipelines: stock pipelines plus
:class:`~nw_adapter.integration.mixin.NWIPAdapterMixin` (``pipe.set_ip_adapter_nw_processor()``), and
the ``*NWFieldPipeline`` classes that generate with the plug-in NW field over reference images'
latents in place of the denoiser (:mod:`nw_adapter.pipelines.nw_field`).

Each class composes like any diffusers pipeline: ``from_pretrained``, ``from_pipe`` both ways,
and, through the thin files of the repository's top-level ``pipelines/`` folder,
``custom_pipeline=``.

Example:
    >>> from nw_adapter.pipelines import StableDiffusionNWPipeline
    >>> pipe = StableDiffusionNWPipeline.from_pipe(stock_pipe)  # doctest: +SKIP
    >>> field = StableDiffusionNWFieldPipeline.from_pipe(stock_pipe, references=[a, b])  # doctest: +SKIP
"""

from nw_adapter.library_output import library_output

# diffusers' pipeline modules import transformers' image processors, which log a note on import
# (the torchvision fallback); quiet here as in the loaders and the command line (``-v`` / verbose=True
# there shows the libraries' own output)
with library_output():
    from nw_adapter.pipelines.nw_field import (
        FluxNWFieldPipeline,
        StableDiffusion3NWFieldPipeline,
        StableDiffusionNWFieldPipeline,
        StableDiffusionXLNWFieldPipeline,
    )
    from nw_adapter.pipelines.pipeline_flux_nw import FluxNWPipeline
    from nw_adapter.pipelines.pipeline_stable_diffusion_3_nw import StableDiffusion3NWPipeline
    from nw_adapter.pipelines.pipeline_stable_diffusion_nw import StableDiffusionNWPipeline
    from nw_adapter.pipelines.pipeline_stable_diffusion_xl_nw import StableDiffusionXLNWPipeline

__all__ = [
    "FluxNWFieldPipeline",
    "FluxNWPipeline",
    "StableDiffusion3NWFieldPipeline",
    "StableDiffusion3NWPipeline",
    "StableDiffusionNWFieldPipeline",
    "StableDiffusionNWPipeline",
    "StableDiffusionXLNWFieldPipeline",
    "StableDiffusionXLNWPipeline",
]
