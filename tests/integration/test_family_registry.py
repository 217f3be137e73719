"""The family registry (nw_adapter.integration.families): one table decides every family question.

Checks that the table is data only (imports no processor, no torch, no diffusers), that each row's
names resolve to real classes whose declarations agree with the row (the NW processor subclasses
the stock one it replaces; the CFG layout is the processors' own), that every processor module
has exactly one row (a new family is a row plus its module), and that the installer, the step
hook's timestep units, the untrained control and the command line read the row.
"""

from __future__ import annotations

import ast
import importlib
import json
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
REPO = Path(families.__file__).resolve().parents[2]
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


def _family_decisions(path: Path) -> list[str]:
    """The places (``file:line``) in ``path`` that decide a family on their own: a comparison with a
    family's name (``== "sd3"``, ``in ("flux", ...)``; ``"unet"`` only on a line with the word
    ``family``, it is also the pipeline attribute) or with a class name of a row, a ``startswith``
    of a row's class-name prefix, and any use of the registry's constants ``UNET``, ``SD3``, ``FLUX``."""
    names = {family.name for family in FAMILIES}
    classes = {name for row in FAMILIES for name in (*row.pipelines, *row.denoisers, *row.processors)}
    constants = {"UNET", "SD3", "FLUX"}
    source = path.read_text(encoding="utf-8")
    found: list[str] = []

    def strings(node: ast.AST) -> list[str]:
        nodes = node.elts if isinstance(node, (ast.Tuple, ast.List, ast.Set)) else [node]
        return [n.value for n in nodes if isinstance(n, ast.Constant) and isinstance(n.value, str)]

    lines = source.splitlines()
    for node in ast.walk(ast.parse(source)):
        where = f"{path.name}:{getattr(node, 'lineno', 0)}"
        if isinstance(node, ast.ImportFrom) and any(alias.name in constants for alias in node.names):
            found.append(where)
        elif (
            isinstance(node, ast.Name | ast.Attribute)
            and (getattr(node, "id", None) or node.attr) in constants
        ):
            found.append(where)
        elif isinstance(node, ast.Compare):
            values = [value for operand in (node.left, *node.comparators) for value in strings(operand)]
            beside = "family" in lines[node.lineno - 1]
            if any(v in classes or v in names - {"unet"} or (v == "unet" and beside) for v in values):
                found.append(where)
        elif isinstance(node, ast.Call) and getattr(node.func, "attr", None) == "startswith":
            prefixes = [value for argument in node.args for value in strings(argument)]
            if any(name.startswith(prefix) for name in classes for prefix in prefixes if len(prefix) > 3):
                found.append(where)
    return found


def test_no_module_outside_the_registry_decides_a_family():
    """Which family a pipeline is, and what follows from it, is read from the registry's rows only:
    no other module of the package, its scripts, companion pipelines or benchmarks compares with a
    family's or a row's class name (issue 45; at b4d97d1 this finds 19 places in 4 files:
    correlate/families.py, loading.py, option_table.py, run_model.py)."""
    registry = Path(families.__file__).resolve()
    files = [
        path
        for folder in ("nw_adapter", "scripts", "pipelines", "benchmarks")
        for path in sorted((REPO / folder).rglob("*.py"))
        if path.resolve() != registry
    ]
    assert len(files) > 100
    found = [place for path in files for place in _family_decisions(path)]
    assert found == []


def test_the_decision_finder_finds_each_kind_of_decision(tmp_path):
    """The finder above on a module written with each kind of family decision (and one without)."""
    module = tmp_path / "decides.py"
    module.write_text(
        "from nw_adapter.integration.families import SD3\n"
        "def a(family):\n    return family == 'unet'\n"
        "def b(name):\n    return name in ('flux', 'x')\n"
        "def c(pipe):\n    return type(pipe).__name__.startswith('StableDiffusion3')\n"
        "def d(pipe):\n    return getattr(pipe, 'unet', None) if 'unet' in dir(pipe) else None\n"
    )
    found = _family_decisions(module)
    assert [place.split(":")[1] for place in found] == ["1", "3", "5", "7"]


_NEW_FAMILY = r"""
import json, sys
from pathlib import Path
from nw_adapter.integration import families as registry

row = registry.Family(
    name="dit", label="DiT", pipelines=("DiT",), denoisers=("DiTLoadersMixin",),
    processors={"DiTIPAdapterAttnProcessor": "NWDiTIPAdapterAttnProcessor"},
    processor_module="nw_adapter.integration.processors.dit", flow=True,
    encoder_argument="image_encoder_folder", ip_adapter="someone/dit-ip-adapter",
    weight_name="ip.safetensors", image_encoder="someone/dit-encoder", example_pipeline="someone/dit-xl",
    hub_names=("dit",),
    end_to_end="its image keys are built another way",
)
registry.FAMILIES = (*registry.FAMILIES, row)  # one row added, as a new family would be
registry._BY_NAME[row.name] = row
registry._BY_DENOISER.update(dict.fromkeys(row.denoisers, row))
registry._BY_PROCESSOR.update(dict.fromkeys(row.processors, row))

from nw_adapter.correlate import families, loading
from nw_adapter.correlate.option_table import OPTION_BY_DEST
from nw_adapter.correlate.options import family_problem, parse_args
from nw_adapter.correlate.spec import ModelSpec

def problem(*argv):
    return family_problem(parse_args([*argv, "--out", "o"]), "dit")

folder = Path(sys.argv[1])
(folder / "model_index.json").write_text(json.dumps({"_class_name": "DiTPipeline"}))
spec = families.resolve_flow_spec(ModelSpec(str(folder)), folder / "cache")
print(json.dumps({
    "family": families.family_of_model(str(folder)),
    "spec": [spec.ip_adapter, spec.weight_name, spec.image_encoder],
    "end_to_end": problem("--image", "a.png", "--end-to-end-control"),
    "support_sets": problem("--support-set", "a.png,b.png"),
    "scheduler": problem("--image", "a.png", "--scheduler", "ddim"),
    "image_encoder": problem("--image", "a.png", "--image-encoder", "x/y"),
    "true_cfg": problem("--image", "a.png", "--true-cfg-scale", "2", "--negative-prompt", ""),
    "guidance_rescale": problem("--image", "a.png", "--guidance-rescale", "0.5"),
    "help": [OPTION_BY_DEST[name].help for name in ("model", "ip_adapter", "weight_name", "image_encoder")],
    "stand_in": loading.tiny_stand_in("someone/dit-xl"),
}))
"""


def test_a_new_row_reaches_the_command_line(tmp_path):
    """What a new family's row alone gives the command line (no other file changed): its pipelines are
    recognised, its adapter defaults resolved and shown in --help, the runs and options it cannot
    take refused in one line from the row's fields (run in a fresh interpreter: the option table
    derives from the rows at import)."""
    out = subprocess.run(
        [sys.executable, "-c", _NEW_FAMILY, str(tmp_path)], capture_output=True, text=True, check=True
    ).stdout
    found = json.loads(out.strip().splitlines()[-1])
    assert found["family"] == "dit"
    assert found["spec"] == ["someone/dit-ip-adapter", "ip.safetensors", "someone/dit-encoder"]
    assert found["end_to_end"] == (
        "the end-to-end control run (--end-to-end-control) cannot run on DiT: its image keys are built "
        "another way; drop --end-to-end-control and use the per-layer control"
    )
    assert found["support_sets"] is None and found["image_encoder"] is None
    assert found["scheduler"].startswith("--scheduler is not read by DiT pipelines; a flow-matching model")
    assert found["true_cfg"].startswith("--true-cfg-scale is not read by DiT pipelines; only Flux pipelines")
    assert found["guidance_rescale"].startswith("--guidance-rescale is not read by DiT pipelines")
    model, adapter, weight, encoder = found["help"]
    assert "DiT (e.g. someone/dit-xl)" in model and "someone/dit-ip-adapter for DiT" in adapter
    assert "ip.safetensors for DiT" in weight and "someone/dit-encoder for DiT" in encoder
    assert found["stand_in"] == "tiny"  # no embedded model of the family: the UNet one
