"""``custom_pipeline=`` file for :class:`~nw_adapter.pipelines.FluxNWPipeline`.

Load it with ``DiffusionPipeline.from_pretrained(folder,
custom_pipeline="pipelines/pipeline_flux_nw.py", trust_remote_code=True)``.
diffusers takes the one pipeline class this file holds; the class itself lives in the
installed package (``from nw_adapter.pipelines import FluxNWPipeline``), so this file is no copy.
"""

from nw_adapter.pipelines.pipeline_flux_nw import FluxNWPipeline

__all__ = ["FluxNWPipeline"]
