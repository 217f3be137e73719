"""The package's layers import only the layers below them (see ``nw_adapter/__init__.py``).

Layers, bottom to top: core, integration, analysis, correlate (models, experiments and pipelines
beside them, with their own rules below). Two checks per layer: a static one over every
``import`` statement of every module (also the imports inside functions, which a plain
``import`` of the module would not execute), and a dynamic one that imports every module of the
layer in a fresh interpreter and lists what ``sys.modules`` then holds.

One upward edge is part of the design, the recorder facade (:data:`FACADE`): ``NWRecorder``'s
report methods (``summary``, ``plot``, ``to_json``, ...) import their analysis function inside the
method, so that a user's recorder reports, while importing the integration loads no reporting.
Everywhere else, and at module level there too, the rules of :data:`FORBIDDEN` hold.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path
from typing import NamedTuple

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "nw_adapter"

# layer -> top-level modules (outside the project) and project sub-packages it must not import
FORBIDDEN = {
    "core": (
        {"diffusers", "transformers", "PIL", "matplotlib", "accelerate"},
        {"integration", "analysis", "correlate", "models", "experiments", "pipelines"},
    ),
    "integration": ({"matplotlib"}, {"analysis", "correlate", "experiments", "models", "pipelines"}),
    "analysis": (set(), {"correlate", "experiments", "models", "pipelines"}),
    "pipelines": (set(), {"analysis", "correlate", "experiments", "models"}),
    "models": (set(), {"integration", "analysis", "correlate", "experiments", "pipelines"}),
    "experiments": (
        {"diffusers", "transformers", "PIL", "accelerate"},
        {"integration", "analysis", "correlate", "models", "pipelines"},
    ),
    "correlate": (set(), {"experiments", "pipelines"}),
}

# The recorder facade: this module of the layer (RecorderReports, the base class that holds
# NWRecorder's user-facing report methods) may import this sub-package of the layer above, inside a
# function only; never at module level.
FACADE = ("integration/reports.py", "analysis")


class _Import(NamedTuple):
    name: str
    deferred: bool  # inside a function body: runs when the function is called, not on import


def _modules(layer: str) -> list[Path]:
    return sorted((PACKAGE / layer).rglob("*.py"))


def _dotted(path: Path) -> str:
    rel = path.relative_to(PACKAGE.parent).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _located_imports(path: Path) -> set[_Import]:
    """Every module imported anywhere in ``path`` (relative names resolved), with whether the
    import sits inside a function body."""
    tree = ast.parse(path.read_text(), filename=str(path))
    deferred_nodes = {
        id(inner)
        for node in ast.walk(tree)
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))
        for inner in ast.walk(node)
    }
    found: set[_Import] = set()
    for node in ast.walk(tree):
        names: list[str] = []
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                package = _dotted(path) if path.name == "__init__.py" else _dotted(path).rpartition(".")[0]
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                module = ".".join(base + ([node.module] if node.module else []))
            else:
                module = node.module or ""
            names = [module, *(f"{module}.{alias.name}" for alias in node.names)]
        found.update(_Import(name, id(node) in deferred_nodes) for name in names)
    return found


def _imports(path: Path) -> set[str]:
    """Absolute names of every module imported anywhere in ``path`` (relative ones resolved)."""
    return {found.name for found in _located_imports(path)}


def _violations(layer: str, paths: list[Path] | None = None) -> list[str]:
    external, internal = FORBIDDEN[layer]
    found = set()
    for path in _modules(layer) if paths is None else paths:
        where = path.relative_to(PACKAGE.parent) if path.is_relative_to(PACKAGE.parent) else path
        facade = where.as_posix() == f"nw_adapter/{FACADE[0]}"
        for name, deferred in _located_imports(path):
            top, _, rest = name.partition(".")
            sub = rest.partition(".")[0]
            if facade and deferred and top == "nw_adapter" and sub == FACADE[1]:
                continue
            if top in external or (top == "nw_adapter" and sub in internal):
                found.add(f"{where} imports {name}")
    return sorted(found)


@pytest.mark.parametrize("layer", sorted(FORBIDDEN))
def test_static_imports_respect_the_layers(layer):
    assert _modules(layer), f"layer {layer} has no modules"
    assert _violations(layer) == []


def test_the_checker_sees_a_violation(tmp_path):
    bad = tmp_path / "bad.py"
    bad.write_text("def f():\n    from diffusers import UNet2DConditionModel\n    import PIL.Image\n")
    assert {"diffusers", "diffusers.UNet2DConditionModel", "PIL.Image"} <= _imports(bad)


def test_the_facade_reaches_the_analysis_layer_only_inside_a_function(tmp_path):
    """The facade's deferred import passes; the same import at module level, or deferred in any
    other integration module, or of matplotlib, is a violation."""
    deferred = "def summary():\n    from nw_adapter.analysis.records import recorder_summary\n"
    facade = PACKAGE / FACADE[0]
    assert any(i.deferred and i.name.startswith("nw_adapter.analysis.") for i in _located_imports(facade))
    assert _violations("integration", [facade]) == []
    top_level = tmp_path / "top_level.py"
    top_level.write_text("from nw_adapter.analysis.records import Records\n" + deferred)
    other = tmp_path / "other.py"
    other.write_text(deferred + "def draw():\n    import matplotlib.pyplot\n")
    assert _violations("integration", [top_level]) == [
        f"{top_level} imports nw_adapter.analysis.records",
        f"{top_level} imports nw_adapter.analysis.records.Records",
        f"{top_level} imports nw_adapter.analysis.records.recorder_summary",
    ]
    assert _violations("integration", [other]) == [
        f"{other} imports matplotlib.pyplot",
        f"{other} imports nw_adapter.analysis.records",
        f"{other} imports nw_adapter.analysis.records.recorder_summary",
    ]


@pytest.mark.parametrize(
    ("layer", "absent"),
    [
        ("core", ["diffusers", "transformers", "PIL", "matplotlib", "nw_adapter.integration"]),
        (
            "integration",
            [
                "nw_adapter.analysis",
                "nw_adapter.correlate",
                "nw_adapter.experiments",
                "matplotlib",
            ],
        ),
        ("analysis", ["nw_adapter.correlate", "nw_adapter.experiments", "matplotlib"]),
        ("experiments", ["diffusers", "transformers", "nw_adapter.integration", "nw_adapter.correlate"]),
    ],
)
def test_importing_a_layer_loads_nothing_above_it(layer, absent):
    modules = [_dotted(p) for p in _modules(layer)]
    code = (
        "import importlib, sys\n"
        f"for m in {modules!r}: importlib.import_module(m)\n"
        f"print(','.join(sorted(n for n in {absent!r} if n in sys.modules)))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == ""


def _loaded_modules_that_import(roots: list[str], target: str) -> tuple[bool, list[str]]:
    """Import ``roots`` in a fresh interpreter: whether ``target`` is then in ``sys.modules``, and
    the loaded project modules whose code imports ``target`` anywhere (inside functions too:
    a call would load it)."""
    code = (
        "import importlib, sys\n"
        f"for m in {roots!r}: importlib.import_module(m)\n"
        f"print({target!r} in sys.modules)\n"
        "for n, m in sorted(sys.modules.items()):\n"
        "    if n.startswith('nw_adapter') and getattr(m, '__file__', None): print(m.__file__)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    loaded, *files = out.stdout.split("\n")
    importers = [
        f for f in files if f and any(n == target or n.startswith(target + ".") for n in _imports(Path(f)))
    ]
    return loaded == "True", sorted(importers)


INTEGRATION_ENTRY_POINTS = [
    "nw_adapter.integration",
    "nw_adapter.integration.processors",
    "nw_adapter.integration.recorder",
    "nw_adapter.integration.mixin",
]


def test_the_integration_and_its_processors_import_no_matplotlib_even_indirectly():
    """Importing the integration and its processors neither loads matplotlib nor loads any module
    that would load it on a call (the reporting lives in nw_adapter.analysis)."""
    assert _loaded_modules_that_import(INTEGRATION_ENTRY_POINTS, "matplotlib") == (False, [])


def test_the_indirect_matplotlib_check_sees_a_module_that_imports_it_on_call():
    """The analysis layer's records module draws with matplotlib inside a function: importing it
    loads no matplotlib, and the check still names it."""
    loaded, importers = _loaded_modules_that_import(["nw_adapter.analysis.records"], "matplotlib")
    assert not loaded
    assert [Path(f).relative_to(PACKAGE.parent).as_posix() for f in importers] == [
        "nw_adapter/analysis/records.py"
    ]


def _calls_print_or_exit(path: Path) -> list[str]:
    tree = ast.parse(path.read_text(), filename=str(path))
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Call):
            func = node.func
            name = getattr(func, "id", None) or getattr(func, "attr", "")
            if name in {"print", "exit"}:
                found.append(f"{path.name}:{node.lineno} {name}()")
    return found


def test_integration_prints_nothing_and_never_exits():
    assert [hit for p in _modules("integration") for hit in _calls_print_or_exit(p)] == []


# The statistics (nw_adapter/integration/stats) are pure math on torch: they import torch, the
# standard library, nw_adapter.core, their own folder and the pure-Python names table, nothing of
# the recorder, the processors, the config or diffusers (imports inside functions included).
STATS_ALLOWED_PROJECT = ("nw_adapter.core", "nw_adapter.integration.stats", "nw_adapter.integration.schema")


def _stats_violations(paths: list[Path]) -> list[str]:
    found = []
    for path in paths:
        for name in _imports(path):
            top = name.partition(".")[0]
            if top == "nw_adapter":
                allowed = any(name == p or name.startswith(p + ".") for p in STATS_ALLOWED_PROJECT)
            else:
                allowed = top in ("torch", "__future__") or top in sys.stdlib_module_names
            if not allowed:
                found.append(f"{path.name} imports {name}")
    return found


def test_the_statistics_import_only_torch_core_and_the_names_table():
    paths = sorted((PACKAGE / "integration" / "stats").rglob("*.py"))
    assert len(paths) >= 5
    assert _stats_violations(paths) == []


def test_the_statistics_checker_sees_a_lazy_import(tmp_path):
    bad = tmp_path / "bad.py"
    bad.write_text(
        "import torch\nfrom nw_adapter.core import metrics\n"
        "def f():\n    from nw_adapter.integration.recorder import NWRecorder\n    import diffusers\n"
    )
    assert sorted(_stats_violations([bad])) == [
        "bad.py imports diffusers",
        "bad.py imports nw_adapter.integration.recorder",
        "bad.py imports nw_adapter.integration.recorder.NWRecorder",
    ]
