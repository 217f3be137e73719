"""``custom_pipeline=`` file for :class:`~nw_adapter.pipelines.StableDiffusionXLNWPipeline`.

Load it with ``DiffusionPipeline.from_pretrained(folder,
custom_pipeline="pipelines/pipeline_stable_diffusion_xl_nw.py", trust_remote_code=True)``.
diffusers takes the one pipeline class this file holds; the class itself lives in the
installed package (``from nw_adapter.pipelines import StableDiffusionXLNWPipeline``), so this file is no copy.
"""

from nw_adapter.pipelines.pipeline_stable_diffusion_xl_nw import StableDiffusionXLNWPipeline

__all__ = ["StableDiffusionXLNWPipeline"]
