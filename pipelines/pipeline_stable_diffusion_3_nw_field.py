"""``custom_pipeline=`` file for :class:`~nw_adapter.pipelines.StableDiffusion3NWFieldPipeline`.

Load it with ``DiffusionPipeline.from_pretrained(folder,
custom_pipeline="pipelines/pipeline_stable_diffusion_3_nw_field.py",
trust_remote_code=True)``, then give it its references (``pipe.set_references([...])``).
diffusers takes the one pipeline class this file holds; the class itself lives in the installed
package (``from nw_adapter.pipelines import StableDiffusion3NWFieldPipeline``), so this file is no copy.
"""

from nw_adapter.pipelines.nw_field import StableDiffusion3NWFieldPipeline

__all__ = ["StableDiffusion3NWFieldPipeline"]
