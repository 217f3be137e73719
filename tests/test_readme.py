"""The README walks a newcomer from a fresh clone to a result: its commands agree with the code."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

from nw_adapter.correlate.cli import main, parse_args
from nw_adapter.correlate.loading import ModelSpec, resolve_spec

REPO = Path(__file__).resolve().parents[1]
README = (REPO / "README.md").read_text()


def shell_commands(text: str) -> list[str]:
    """Every command of the ```bash blocks (continuation lines joined, comments dropped)."""
    commands = []
    for block in re.findall(r"```bash\n(.*?)```", text, flags=re.S):
        joined = block.replace("\\\n", " ")
        for line in joined.splitlines():
            line = line.split(" #")[0].strip()
            if line and not line.startswith("#"):
                commands.append(" ".join(line.split()))
    return commands


def setup_commands() -> list[str]:
    section = README.split("## Set-up: two commands from a fresh clone", 1)[1]
    return shell_commands(section.split("\n## ", 1)[0])


def correlate_argv(command: str) -> list[str]:
    """The arguments of the ``python scripts/correlate.py`` part of a command line."""
    for part in command.split("&&"):
        words = shlex.split(part)
        if words[:2] == ["python", "scripts/correlate.py"]:
            return words[2:]
    raise AssertionError(f"no correlate.py call in {command!r}")


CPU_TORCH = "pip install torch --index-url https://download.pytorch.org/whl/cpu"


def torch_requirement() -> str:
    """The torch requirement of pyproject.toml's dependencies, e.g. ``torch>=2.4,<3``."""
    (requirement,) = re.findall(r'^\s*"(torch[<>=!~][^"]*)",', (REPO / "pyproject.toml").read_text(), re.M)
    return requirement


def test_setup_is_two_commands_cpu_torch_or_fallback_then_main_job_then_tests() -> None:
    install_and_run, install_and_test = setup_commands()
    steps = [s.strip() for s in install_and_run.split("&&")]
    cpu_index, fallback = (s.strip() for s in steps[0].split("||"))
    assert cpu_index == CPU_TORCH
    assert shlex.split(fallback) == ["pip", "install", torch_requirement()]  # pip's own index
    assert steps[1] == "pip install -e ."
    argv = correlate_argv(install_and_run)
    args = parse_args(argv)
    assert args.model == "tiny" and all((REPO / image).is_file() for image in args.image)
    assert install_and_test == 'pip install -e ".[test]" && python -m pytest -n 2 -q'


def _run_setup_with_fake_tools(tmp_path: Path, index_reachable: bool) -> list[str]:
    """The README's first set-up command run by bash, with ``pip`` and ``python`` replaced by
    shell functions that log their arguments; ``pip`` fails whenever it is given the PyTorch
    index and that index is not reachable (as on a machine with only a package mirror)."""
    import subprocess

    from subprocess_limits import SUBPROCESS_TIMEOUT_S

    log = tmp_path / "calls.log"
    fail = "" if index_reachable else '[[ "$*" == *download.pytorch.org* ]] && return 1; '
    script = (
        f'pip() {{ echo "pip $*" >> {shlex.quote(str(log))}; {fail}return 0; }}\n'
        f'python() {{ echo "python $1" >> {shlex.quote(str(log))}; }}\n'
        f"{setup_commands()[0]}\n"
    )
    proc = subprocess.run(
        ["bash", "-c", script], capture_output=True, text=True, timeout=SUBPROCESS_TIMEOUT_S
    )
    assert proc.returncode == 0, proc.stderr
    return log.read_text().splitlines()


def test_setup_falls_back_to_pips_own_index_when_the_pytorch_index_is_unreachable(tmp_path: Path) -> None:
    calls = _run_setup_with_fake_tools(tmp_path, index_reachable=False)
    fallback = f"pip install {torch_requirement()}"
    assert calls == [CPU_TORCH, fallback, "pip install -e .", "python scripts/correlate.py"]


def test_setup_uses_the_cpu_index_alone_when_it_is_reachable(tmp_path: Path) -> None:
    calls = _run_setup_with_fake_tools(tmp_path, index_reachable=True)
    assert calls == [CPU_TORCH, "pip install -e .", "python scripts/correlate.py"]


def test_ci_runs_exactly_the_readme_test_command() -> None:
    test_command = setup_commands()[1].split("&&")[-1].strip()
    ci_lines = [line.strip() for line in (REPO / ".ci" / "run").read_text().splitlines()]
    assert test_command in ci_lines
    assert "python -m pytest -n 2 -q" == test_command
    assert "```bash\npython -m pytest -n 2 -q\n```" in README


def test_the_readme_main_job_runs_on_the_embedded_model(tmp_path: Path, monkeypatch, capsys) -> None:
    monkeypatch.chdir(REPO)
    monkeypatch.setenv("NW_ADAPTER_CACHE", str(tmp_path / "cache"))
    argv = correlate_argv(setup_commands()[0])
    out = argv.index("--out") + 1
    argv[out] = str(tmp_path / argv[out])
    assert main([*argv, "--steps", "2"]) == 0
    printed = capsys.readouterr().out.splitlines()
    assert printed[0].startswith("attention vs NW weights")
    assert any(line.startswith("verdict: ") for line in printed) and printed[-1].startswith("  ")
    assert (Path(argv[out]) / "rho.json").is_file()


def test_the_defaults_written_out_are_the_defaults() -> None:
    commands = [
        c for c in shell_commands(README) if c.startswith("python scripts/correlate.py --image ref.png")
    ]
    short = next(c for c in commands if c.endswith("--out out_sd15"))
    written = next(c for c in commands if "--weight-name" in c)
    a, b = parse_args(correlate_argv(short)), parse_args(correlate_argv(written))
    spec = lambda args: resolve_spec(ModelSpec(args.model, args.ip_adapter, args.subfolder, args.weight_name))  # noqa: E731
    assert spec(a) == spec(b)
    skip = {"ip_adapter", "subfolder", "weight_name", "given"}  # given: which options were typed
    differing = {k for k in vars(a) if k not in skip and getattr(a, k) != getattr(b, k)}
    assert differing == set(), differing
    assert b.scheduler is None and b.store_maps is False  # the model's own scheduler; maps off


def _out_folders() -> set[str]:
    """The top-level folder of every relative ``--out`` (and ``--replot``) of the README and docs/."""
    texts = [README, *(path.read_text() for path in (REPO / "docs").glob("*.md"))]
    folders = set()
    for text in texts:
        for command in shell_commands(text):
            words = command.split()
            for flag in ("--out", "--replot"):
                if flag in words and words.index(flag) + 1 < len(words):
                    target = words[words.index(flag) + 1]
                    if not target.startswith("/"):  # an absolute path lies outside the checkout
                        folders.add(target.split("/")[0])
    return folders


def test_gitignore_covers_every_output_folder_the_docs_write() -> None:
    folders = _out_folders()
    assert {"out_tiny", "out_digits", "out_sd15", "sweep", "runs"} <= folders  # the parser sees them
    ignored = set((REPO / ".gitignore").read_text().split())
    assert {f for f in folders if f"/{f}/" not in ignored} == set()


def python_blocks(text: str) -> list[str]:
    return re.findall(r"```python\n(.*?)```", text, flags=re.S)


def test_the_readme_python_blocks_run_offline_as_written(tmp_path: Path, monkeypatch) -> None:
    """Every Python block of the README, in order, in one namespace: every name is defined there
    and nothing needs the network (the blocks use the shipped tiny model)."""
    import matplotlib.figure
    import torch

    torch.set_num_threads(1)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    blocks = python_blocks(README)
    assert len(blocks) >= 3
    namespace: dict = {}
    for block in blocks:
        exec(compile(block, "README.md", "exec"), namespace)  # noqa: S102 - the README's own code
    assert isinstance(namespace["fig"], matplotlib.figure.Figure)
    assert isinstance(namespace["overlay"], matplotlib.figure.Figure)
    assert namespace["maps"].steps == (24,)
    assert namespace["records"] and set(namespace["readings"]) >= {"rho", "nw_gain", "r2_key", "h_eff"}
    assert namespace["pipe"].nw_recorder is None  # the README's last call restores the processors


def test_the_stated_size_of_the_shipped_model_is_its_size_on_disk() -> None:
    from nw_adapter.models.tiny_digits import SHIPPED_DIR

    files = [path for path in SHIPPED_DIR.rglob("*") if path.is_file()]
    stated = f"{sum(path.stat().st_size for path in files) / 1e6:.1f} MB of files"
    assert stated in README and stated in (REPO / "docs" / "cli.md").read_text(), stated
