"""The top-level package: light import, lazy diffusers-side exports."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from subprocess_limits import SUBPROCESS_TIMEOUT_S

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
    out = tmp_path_factory.mktemp("wheel")
    root = Path(__file__).resolve().parents[1]
    # A copy of what the build reads: setuptools writes build/ and *.egg-info into the source
    # folder, so two pytest workers building from the checkout itself would race there.
    source = tmp_path_factory.mktemp("source")
    for name in ("pyproject.toml", "README.md", "LICENSE"):
        shutil.copy2(root / name, source / name)
    shutil.copytree(root / "nw_adapter", source / "nw_adapter", ignore=shutil.ignore_patterns("__pycache__"))
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "-w", str(out)]
        + [str(source)],
        check=True,
        capture_output=True,
        timeout=SUBPROCESS_TIMEOUT_S,
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
        FluxNWPipeline,
        StableDiffusion3NWPipeline,
        StableDiffusionNWPipeline,
        StableDiffusionXLNWPipeline,
    )
    for cls in companions:
        assert issubclass(cls, NWIPAdapterMixin)


@pytest.fixture(scope="module")
def installed(wheel, tmp_path_factory):
    """The wheel installed into a fresh virtual environment outside the checkout.

    ``pip install --no-deps --no-index`` of the wheel alone; the test interpreter's site-packages
    are appended to the new environment's path (a ``.pth`` file, after its own site-packages), so
    the dependencies are found but this checkout is not (an editable install's finder is not
    activated from there), and ``nw_adapter`` comes from the wheel.
    """
    import site
    import venv

    root = tmp_path_factory.mktemp("venv")
    env_dir, work = root / "env", root / "elsewhere"
    work.mkdir()
    venv.EnvBuilder(with_pip=False).create(env_dir)
    python = env_dir / "bin" / "python"
    # outside the checkout, without PYTHONPATH: else pip finds this checkout's metadata "already installed"
    subprocess.run(
        [sys.executable, "-m", "pip", "--python", str(python), "install", "-q", "--no-deps", "--no-index",
         str(wheel)],
        check=True, capture_output=True, timeout=SUBPROCESS_TIMEOUT_S, cwd=work, env=_clean_environment(),
    )  # fmt: skip
    purelib = subprocess.run(
        [str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        check=True, capture_output=True, text=True,
    ).stdout.strip()  # fmt: skip
    assert (Path(purelib) / "nw_adapter" / "__main__.py").is_file()
    outer = [*site.getsitepackages(), site.getusersitepackages()]
    (Path(purelib) / "_test_dependencies.pth").write_text("\n".join(outer) + "\n")
    return {"python": python, "bin": env_dir / "bin", "purelib": Path(purelib), "cwd": work}


def _clean_environment(path_first: Path | None = None) -> dict[str, str]:
    """``os.environ`` without this checkout (PYTHONPATH) and its virtual environment."""
    import os

    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    if path_first is not None:
        env["PATH"] = f"{path_first}{os.pathsep}{env.get('PATH', '')}"
    return env


def _run_installed(installed, command: list[str]) -> subprocess.CompletedProcess:
    env = _clean_environment(installed["bin"])
    return subprocess.run(
        command, capture_output=True, text=True, cwd=installed["cwd"], env=env, timeout=SUBPROCESS_TIMEOUT_S
    )


@pytest.mark.parametrize(
    ("command", "usage"),
    [
        (["nw-correlate", "--help"], "usage: nw-correlate "),
        (["nw-experiments", "--help"], "usage: nw-experiments "),
        (["python", "-m", "nw_adapter", "--help"], "usage: python -m nw_adapter COMMAND"),
        (["python", "-m", "nw_adapter", "correlate", "--help"], "usage: python -m nw_adapter correlate "),
        (["python", "-m", "nw_adapter", "experiments", "--help"], "usage: python -m nw_adapter experiments "),
        (["python", "-m", "nw_adapter.correlate", "--help"], "usage: python -m nw_adapter.correlate "),
        (
            ["python", "-m", "nw_adapter.experiments.cli", "--help"],
            "usage: python -m nw_adapter.experiments.cli ",
        ),
    ],
)
def test_every_entry_point_of_the_installed_wheel_answers_with_its_own_name(installed, command, usage):
    proc = _run_installed(installed, command)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith(usage), proc.stdout[:200]


def test_the_installed_wheel_is_the_one_running_and_errors_name_the_command(installed):
    proc = _run_installed(installed, ["nw-correlate", "--image", "ref.png", "--stpes", "3"])
    assert proc.returncode == 2
    assert proc.stderr.startswith(
        "nw-correlate: error: unrecognized arguments: --stpes 3; did you mean --steps?"
    )
    where = _run_installed(installed, ["python", "-c", "import nw_adapter; print(nw_adapter.__file__)"])
    assert Path(where.stdout.strip()).is_relative_to(installed["purelib"]), where.stdout


def test_the_installed_wheel_shows_where_its_example_digits_are(installed):
    proc = _run_installed(installed, ["nw-correlate", "--example-dir"])
    assert proc.returncode == 0, proc.stderr
    folder = Path(proc.stdout.strip())
    assert folder.is_relative_to(installed["purelib"])
    assert sorted(p.name for p in folder.glob("digit_*.png")) == [f"digit_{d}.png" for d in range(10)]


def test_example_dir_is_where_the_tiny_model_keeps_its_examples():
    from nw_adapter.correlate.spec import EXAMPLE_DIR, TINY_DIGITS_DIR
    from nw_adapter.models.tiny_digits import SHIPPED_DIR, example_image_path

    assert TINY_DIGITS_DIR == SHIPPED_DIR and EXAMPLE_DIR == example_image_path(3).parent
