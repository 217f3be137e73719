"""The package's layers import only the layers below them (see ``nw_adapter/__init__.py``).

Two checks per layer: a static one over every ``import`` statement of every module (also the
imports inside functions, which a plain ``import`` of the module would not execute), and a
dynamic one that imports every module of the layer in a fresh interpreter and lists what
``sys.modules`` then holds.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "nw_adapter"

# layer -> top-level modules (outside the project) and project sub-packages it must not import
FORBIDDEN = {
    "core": (
        {"diffusers", "transformers", "PIL", "matplotlib", "accelerate"},
        {"integration", "correlate", "models", "experiments", "pipelines"},
    ),
    "integration": (set(), {"correlate", "experiments", "models", "pipelines"}),
    "pipelines": (set(), {"correlate", "experiments", "models"}),
    "models": (set(), {"integration", "correlate", "experiments", "pipelines"}),
    "experiments": (
        {"diffusers", "transformers", "PIL", "accelerate"},
        {"integration", "correlate", "models", "pipelines"},
    ),
    "correlate": (set(), {"experiments", "pipelines"}),
}


def _modules(layer: str) -> list[Path]:
    return sorted((PACKAGE / layer).rglob("*.py"))


def _dotted(path: Path) -> str:
    rel = path.relative_to(PACKAGE.parent).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _imports(path: Path) -> set[str]:
    """Absolute names of every module imported anywhere in ``path`` (relative ones resolved)."""
    tree = ast.parse(path.read_text(), filename=str(path))
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                package = _dotted(path) if path.name == "__init__.py" else _dotted(path).rpartition(".")[0]
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                module = ".".join(base + ([node.module] if node.module else []))
            else:
                module = node.module or ""
            names.add(module)
            names.update(f"{module}.{alias.name}" for alias in node.names)
    return names


def _violations(layer: str) -> list[str]:
    external, internal = FORBIDDEN[layer]
    found = []
    for path in _modules(layer):
        for name in _imports(path):
            top, _, rest = name.partition(".")
            sub = rest.partition(".")[0]
            if top in external or (top == "nw_adapter" and sub in internal):
                found.append(f"{path.relative_to(PACKAGE.parent)} imports {name}")
    return found


@pytest.mark.parametrize("layer", sorted(FORBIDDEN))
def test_static_imports_respect_the_layers(layer):
    assert _modules(layer), f"layer {layer} has no modules"
    assert _violations(layer) == []


def test_the_checker_sees_a_violation(tmp_path):
    bad = tmp_path / "bad.py"
    bad.write_text("def f():\n    from diffusers import UNet2DConditionModel\n    import PIL.Image\n")
    assert {"diffusers", "diffusers.UNet2DConditionModel", "PIL.Image"} <= _imports(bad)


@pytest.mark.parametrize(
    ("layer", "absent"),
    [
        ("core", ["diffusers", "transformers", "PIL", "matplotlib", "nw_adapter.integration"]),
        ("integration", ["nw_adapter.correlate", "nw_adapter.experiments", "matplotlib"]),
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
