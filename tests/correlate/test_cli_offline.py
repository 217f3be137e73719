"""Without network the command line decides "offline" first: one line at once, or a load from the cache.

The Hub is made unreachable deterministically: ``HF_ENDPOINT`` points at a closed local port (a
refused connection, as on a machine without network), in a fresh interpreter, with an empty or a
hand-made Hugging Face cache. huggingface_hub would otherwise retry each request five times with
back-off (a minute and a dozen "Retrying in 8s" lines before the one-line error).
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest
from subprocess_limits import SUBPROCESS_TIMEOUT_S

from nw_adapter.correlate import loading, spec
from nw_adapter.correlate.cli import main
from nw_adapter.correlate.spec import ModelLoadError

REPO = Path(__file__).resolve().parents[2]

_RUNNER = r"""
import json, sys
from nw_adapter.correlate.cli import main
code = main(sys.argv[1:])
print(json.dumps({"code": code, "torch": "torch" in sys.modules}))
"""


def closed_port() -> int:
    """A local TCP port nothing listens on (bound, then released)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def run_offline(argv: list[str], hf_home: Path, cwd: Path, **env: str) -> tuple[dict, str]:
    environment = {k: v for k, v in os.environ.items() if k != "HF_HUB_OFFLINE"}
    environment.update(
        PYTHONPATH=str(REPO),
        HF_HOME=str(hf_home),
        HF_ENDPOINT=f"http://127.0.0.1:{closed_port()}",
        NW_ADAPTER_CACHE=str(cwd / "nw-cache"),
        **env,
    )
    proc = subprocess.run(
        [sys.executable, "-c", _RUNNER, *argv], capture_output=True, text=True, env=environment, cwd=cwd,
        timeout=SUBPROCESS_TIMEOUT_S,
    )  # fmt: skip
    assert proc.stdout.strip(), proc.stderr
    return json.loads(proc.stdout.strip().splitlines()[-1]), proc.stderr


@pytest.fixture
def reference(tmp_path: Path) -> Path:
    from PIL import Image

    path = tmp_path / "ref.png"
    Image.new("RGB", (48, 48), (30, 160, 90)).save(path)
    return path


@pytest.mark.parametrize(
    ("extra", "option", "name"),
    [
        ([], "--model", "stable-diffusion-v1-5/stable-diffusion-v1-5"),
        (["--model", "tiny", "--ip-adapter", "h94/IP-Adapter"], "--ip-adapter", "h94/IP-Adapter"),
        (["--model", "black-forest-labs/FLUX.1-dev"], "--model", "black-forest-labs/FLUX.1-dev"),
    ],
)
def test_no_network_and_nothing_cached_is_one_line_at_once(
    extra: list[str], option: str, name: str, tmp_path: Path, reference: Path
) -> None:
    result, stderr = run_offline(
        ["--image", str(reference), "--out", str(tmp_path / "out"), *extra], tmp_path / "hf", tmp_path
    )
    lines = [line for line in stderr.splitlines() if line.strip()]
    assert result["code"] == 2 and len(lines) == 1, stderr
    assert lines[0].startswith(f"correlate.py: error: {option} '{name}': not in the Hugging Face cache")
    assert "the Hub cannot be reached (offline)" in lines[0] and "hf download" in lines[0]
    assert not result["torch"], "decided before torch was imported"
    assert not (tmp_path / "out").exists()


def _fake_hub_cache(hf_home: Path, repo_id: str, folder: Path) -> None:
    """``folder`` as the cached snapshot of the Hub repository ``repo_id`` (huggingface_hub's layout)."""
    revision = "0" * 40
    repo = hf_home / "hub" / f"models--{repo_id.replace('/', '--')}"
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(revision)
    shutil.copytree(folder, repo / "snapshots" / revision, ignore=shutil.ignore_patterns("examples", "*.md"))


def test_no_network_with_the_model_in_the_cache_loads_it_without_retrying(tmp_path: Path, reference: Path):
    repo_id = "nw-test/tiny-digits"
    _fake_hub_cache(tmp_path / "hf", repo_id, REPO / "nw_adapter" / "models" / "weights" / "tiny_digits")
    argv = ["--image", str(reference), "--out", str(tmp_path / "out"), "--model", repo_id, "--ip-adapter",
            repo_id, "--steps", "1", "--no-untrained-control", "--device", "cpu", "-q"]  # fmt: skip
    result, stderr = run_offline(argv, tmp_path / "hf", tmp_path, HF_HUB_VERBOSITY="warning")
    assert result["code"] == 0, stderr
    assert "Retrying" not in stderr and "Couldn't connect" not in stderr, stderr
    report = json.loads((tmp_path / "out" / "rho.json").read_text())
    assert report["config"]["model"]["model"] == repo_id and report["records"]


def test_hf_hub_offline_is_read_before_any_connection(monkeypatch) -> None:
    import huggingface_hub.constants

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(spec, "_no_connection", lambda *a: pytest.fail("no connection may be tried"))
    assert loading.hub_offline_reason() == "HF_HUB_OFFLINE is set"


def test_an_unreachable_endpoint_is_named(monkeypatch) -> None:
    import huggingface_hub.constants

    port = closed_port()
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(huggingface_hub.constants, "ENDPOINT", f"http://127.0.0.1:{port}")
    monkeypatch.delenv("http_proxy", raising=False)
    monkeypatch.delenv("HTTP_PROXY", raising=False)
    assert loading.hub_offline_reason() == f"no connection to 127.0.0.1:{port} (Connection refused)"


@pytest.mark.parametrize(
    ("name", "guess"),
    [("tiny-sd15", "did you mean tiny-sd3 or tiny?"), ("tiny_flux", "did you mean tiny-flux"), ("sd15", "")],
)
def test_a_model_name_that_names_nothing_suggests_the_offline_models(
    name: str, guess: str, tmp_path: Path, reference: Path, capsys
) -> None:
    code = main(["--image", str(reference), "--model", name, "--out", str(tmp_path / "out")])
    err = capsys.readouterr().err
    assert code == 2 and len(err.strip().splitlines()) == 1, err
    assert f"--model '{name}': not a local folder, a Hub id (owner/name) or an offline model" in err
    assert guess in err
    for offline in ("tiny (SD 1.5, trained on digits)", "tiny-sd3 (", "tiny-flux (Flux, random weights)"):
        assert offline in err
    assert not (tmp_path / "out").exists()


def test_a_local_folder_with_a_bare_name_is_still_a_model(tmp_path: Path, monkeypatch) -> None:
    (tmp_path / "mymodel").mkdir()
    monkeypatch.chdir(tmp_path)
    loading.check_model_name("mymodel")  # no error: a folder
    loading.check_model_name("owner/name")  # no error: a Hub id
    with pytest.raises(ModelLoadError, match="--ip-adapter 'tiny-sd3'.*did you mean tiny\\?"):
        loading.check_model_name("tiny-sd3", "--ip-adapter")


@pytest.mark.parametrize(
    ("repo_id", "stand_in"),
    [
        ("stabilityai/stable-diffusion-3.5-large", "tiny-sd3"),  # SD 3's only embedded model (random)
        ("black-forest-labs/FLUX.1-dev", "tiny-flux-digits"),  # Flux's trained one before its random one
        ("stable-diffusion-v1-5/stable-diffusion-v1-5", "tiny"),
        ("someone/a-model", "tiny"),  # no row's hub_names: the UNet default
    ],
)
def test_the_offline_stand_in_is_an_embedded_model_of_the_registrys_family(
    repo_id: str, stand_in: str, monkeypatch
) -> None:
    """Offline, the line names an embedded model of the family the registry's rows give the id
    (its hub_names; the cached model_index.json where there is one), with what it is."""
    from nw_adapter.integration.families import tiny_model

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    assert loading.tiny_stand_in(repo_id) == stand_in
    hint = loading._offline_hint(repo_id, "--model")
    assert hint.endswith(f"run offline with --model {stand_in} ({tiny_model(stand_in).label}" + (
        ")" if tiny_model(stand_in).trained else ": it tests the code only)"
    ))  # fmt: skip
