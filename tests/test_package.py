"""The top-level package: light import, lazy diffusers-side exports."""

from __future__ import annotations

import subprocess
import sys

import pytest

import nw_adapter


def test_import_does_not_load_diffusers():
    code = (
        "import sys, nw_adapter, nw_adapter.core.kernels, nw_adapter.core.paths; "
        "print('diffusers' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


@pytest.mark.parametrize("name", sorted(nw_adapter._LAZY))
def test_lazy_exports_resolve_to_their_modules(name):
    import importlib

    value = getattr(nw_adapter, name)
    assert value is getattr(importlib.import_module(nw_adapter._LAZY[name]), name)


def test_unknown_attribute_raises():
    with pytest.raises(AttributeError, match="no attribute 'nope'"):
        nw_adapter.nope  # noqa: B018


@pytest.fixture(scope="module")
def wheel(tmp_path_factory):
    """The project's wheel, built from this checkout (no network: the installed setuptools)."""
    from pathlib import Path

    out = tmp_path_factory.mktemp("wheel")
    root = Path(__file__).resolve().parents[1]
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "-w", str(out)]
        + [str(root)],
        check=True,
        capture_output=True,
    )
    (path,) = out.glob("nw_adapter-*.whl")
    return path


def test_the_wheel_carries_the_licence_and_no_generic_top_level_package(wheel):
    import zipfile

    names = zipfile.ZipFile(wheel).namelist()
    tops = {name.split("/")[0] for name in names}
    assert tops == {"nw_adapter", f"nw_adapter-{nw_adapter.__version__}.dist-info"}  # no "pipelines"
    assert any(name.endswith(".dist-info/licenses/LICENSE") for name in names)
    assert "nw_adapter/pipelines/__init__.py" in names


def test_companion_pipelines_import_from_the_package():
    from nw_adapter.integration.mixin import NWIPAdapterMixin
    from nw_adapter.pipelines import (
        FluxNWPipeline,
        StableDiffusion3NWPipeline,
        StableDiffusionNWPipeline,
        StableDiffusionXLNWPipeline,
    )

    companions = (
        FluxNWPipeline, StableDiffusion3NWPipeline, StableDiffusionNWPipeline, StableDiffusionXLNWPipeline
    )
    for cls in companions:
        assert issubclass(cls, NWIPAdapterMixin)
