"""``custom_pipeline=`` file for :class:`~nw_adapter.pipelines.StableDiffusionNWFieldPipeline`.

Load it with ``DiffusionPipeline.from_pretrained(folder,
custom_pipeline="pipelines/pipeline_stable_diffusion_nw_field.py",
trust_remote_code=True)``, then give it its references (``pipe.set_references([...])``).
diffusers takes the one pipeline class this file holds; the class itself lives in the installed
package (``from nw_adapter.pipelines import StableDiffusionNWFieldPipeline``), so this file is no copy.
"""

from nw_adapter.pipelines.nw_field import StableDiffusionNWFieldPipeline

__all__ = ["StableDiffusionNWFieldPipeline"]
