"""The family registry (nw_adapter.integration.families): one table decides every family question.

Checks that the table is data only (imports no processor, no torch, no diffusers), that each row's
names resolve to real classes whose declarations agree with the row (the NW processor subclasses
the stock one it replaces; the CFG layout is the processors' own), that every processor module
has exactly one row (a new family is a row plus its module), and that the installer, the step
hook's timestep units, the untrained control and the command line read the row.
"""

from __future__ import annotations

import importlib
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from diffusers import FluxTransformer2DModel, SD3Transformer2DModel, UNet2DConditionModel, UNetMotionModel
from diffusers.models.attention_processor import (
    IPAdapterAttnProcessor,
    IPAdapterAttnProcessor2_0,
    SD3IPAdapterJointAttnProcessor2_0,
)
from diffusers.models.transformers.transformer_flux import FluxIPAdapterAttnProcessor

from nw_adapter.integration import families
from nw_adapter.integration.families import FAMILIES, PASSES, TINY_MODELS
from nw_adapter.integration.mixin import _timestep_scale
from nw_adapter.integration.processors import is_ip_processor, nw_processor_for
from nw_adapter.integration.processors.base import NWProcessorBase
from nw_adapter.integration.recorder import NWRecorder

PROCESSORS = Path(families.__file__).parent / "processors"
SHARED_MODULES = {"__init__", "base", "selection", "deferred"}  # every family's, no family's own


def _bare(cls):
    """An instance of ``cls`` without running ``__init__`` (the registry reads the class only)."""
    return object.__new__(cls)


def test_the_registry_is_data_that_imports_no_processor_torch_or_diffusers():
    prefixes = ("torch", "diffusers", "nw_adapter.integration.processors")
    code = (
        "import sys, nw_adapter.integration.families; "
        f"print([m for m in sys.modules if m.startswith({prefixes!r})])"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


@pytest.mark.parametrize("family", FAMILIES, ids=lambda f: f.name)
def test_each_row_names_nw_processors_that_subclass_the_stock_ones(family):
    module = importlib.import_module(family.processor_module)
    for stock, nw in family.processors.items():
        nw_class = getattr(module, nw)
        assert issubclass(nw_class, NWProcessorBase)
        assert stock in [cls.__name__ for cls in nw_class.__mro__]
        # the row's CFG layout is the processors' own declaration
        assert nw_class.spec.halves_by_pass == (family.cfg == PASSES)


def test_every_processor_module_has_exactly_one_row():
    modules = {path.stem for path in PROCESSORS.glob("*.py")} - SHARED_MODULES
    named = [family.processor_module.rpartition(".")[2] for family in FAMILIES]
    assert sorted(named) == sorted(modules)


@pytest.mark.parametrize(
    ("class_name", "name"),
    [
        ("StableDiffusion3Pipeline", "sd3"),
        ("StableDiffusion3NWPipeline", "sd3"),
        ("FluxPipeline", "flux"),
        ("FluxNWPipeline", "flux"),
        ("StableDiffusionXLPipeline", "unet"),
        ("StableDiffusionPipeline", "unet"),
        (None, "unet"),
    ],
)
def test_family_of_pipeline_class(class_name, name):
    assert families.family_of_pipeline_class(class_name).name == name


@pytest.mark.parametrize(
    ("denoiser", "name", "scale"),
    [
        (UNet2DConditionModel, "unet", 1.0),
        (UNetMotionModel, "unet", 1.0),  # AnimateDiff's: loads IP-Adapters the UNet way
        (SD3Transformer2DModel, "sd3", 1.0),
        (FluxTransformer2DModel, "flux", 1000.0),
    ],
)
def test_denoisers_and_their_subclasses_have_their_family(denoiser, name, scale):
    subclass = type(f"My{denoiser.__name__}", (denoiser,), {})
    for module in (_bare(denoiser), _bare(subclass)):
        assert families.family_of_denoiser(module).name == name
        assert _timestep_scale(module) == scale  # the step hook reads the row
    assert families.family_of_denoiser(torch.nn.Linear(2, 2)) is None
    assert _timestep_scale(torch.nn.Linear(2, 2)) == 1.0


@pytest.mark.parametrize(
    ("stock", "name"),
    [
        (IPAdapterAttnProcessor, "unet"),
        (IPAdapterAttnProcessor2_0, "unet"),
        (SD3IPAdapterJointAttnProcessor2_0, "sd3"),
        (FluxIPAdapterAttnProcessor, "flux"),
    ],
)
def test_stock_processors_have_their_family(stock, name):
    assert families.family_of_processor(_bare(stock)).name == name
    module, nw = families.nw_processor_class_name(_bare(stock))
    assert module == families.family_named(name).processor_module and nw.startswith("NW")
    assert is_ip_processor(_bare(stock))


def test_the_installer_builds_the_rows_class_and_refuses_other_processors(tiny_sd15_dir):
    from diffusers import StableDiffusionPipeline

    unet = StableDiffusionPipeline.from_pretrained(tiny_sd15_dir).unet
    stock = IPAdapterAttnProcessor2_0(hidden_size=unet.config.block_out_channels[-1], cross_attention_dim=32)
    rec = NWRecorder()
    nw = nw_processor_for(stock, layer_name="l", config=rec.config, recorder=rec)
    assert type(nw).__name__ == "NWIPAdapterAttnProcessor2_0"
    assert families.family_of_processor(nw).name == "unet" and is_ip_processor(nw)
    with pytest.raises(ValueError, match="not an IP-Adapter processor"):
        nw_processor_for(torch.nn.Identity(), layer_name="x", config=rec.config, recorder=rec)
    assert not is_ip_processor(torch.nn.Identity())


def test_unknown_family_names_list_the_known_ones():
    with pytest.raises(KeyError, match="known: unet, sd3, flux"):
        families.family_named("sana")


@pytest.mark.parametrize("model", TINY_MODELS, ids=lambda m: m.name)
def test_each_tiny_model_names_what_provides_it(model):
    module = importlib.import_module(model.module)
    families.family_named(model.family)
    if model.shipped:
        assert Path(module.SHIPPED_DIR, "model_index.json").is_file()
    else:
        save_model, save_adapter, encoder_folder = (getattr(module, name) for name in model.builders)
        assert callable(save_model) and callable(save_adapter) and isinstance(encoder_folder, str)


def test_tiny_model_lists():
    assert families.tiny_models(trained=True) == ("tiny", "tiny-flux-digits")
    assert families.tiny_models(trained=False) == ("tiny-sd3", "tiny-flux")
    assert families.tiny_models(family="flux") == ("tiny-flux", "tiny-flux-digits")
    assert families.tiny_model("tiny-flux-digits").label == "Flux, trained on digits"
    assert families.tiny_model("tiny-sd15") is None


def test_the_command_line_reads_the_registry():
    from nw_adapter.correlate import families as cli_families
    from nw_adapter.correlate.report import RANDOM_WEIGHT_MODELS
    from nw_adapter.correlate.spec import DIGIT_MODELS

    assert set(cli_families.FAMILIES) == {f.name for f in FAMILIES if f.ip_adapter}
    assert all(cli_families.FAMILIES[name] is families.family_named(name) for name in cli_families.FAMILIES)
    assert cli_families.family_of_model("tiny-flux-digits") == "flux"
    assert cli_families.family_of_model("tiny") == "unet"
    assert RANDOM_WEIGHT_MODELS == families.tiny_models(trained=False)
    assert DIGIT_MODELS == families.tiny_models(trained=True)
