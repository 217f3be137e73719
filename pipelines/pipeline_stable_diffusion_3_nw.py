"""``custom_pipeline=`` file for :class:`~nw_adapter.pipelines.StableDiffusion3NWPipeline`.

Load it with ``DiffusionPipeline.from_pretrained(folder,
custom_pipeline="pipelines/pipeline_stable_diffusion_3_nw.py", trust_remote_code=True)``.
diffusers takes the one pipeline class this file holds; the class itself lives in the
installed package (``from nw_adapter.pipelines import StableDiffusion3NWPipeline``), so this file is no copy.
"""

from nw_adapter.pipelines.pipeline_stable_diffusion_3_nw import StableDiffusion3NWPipeline

__all__ = ["StableDiffusion3NWPipeline"]
