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
