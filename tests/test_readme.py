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
    """The arguments of the ``python scripts/correlate.py`` part of a command line (after any
    ``NAME=value`` the command sets in its environment)."""
    for part in command.split("&&"):
        words = shlex.split(part)
        while words and re.fullmatch(r"[A-Z_]+=\S*", words[0]):
            words = words[1:]
        if words[:2] == ["python", "scripts/correlate.py"]:
            return words[2:]
    raise AssertionError(f"no correlate.py call in {command!r}")


CPU_TORCH = "pip install --retries 0 --timeout 5 torch --index-url https://download.pytorch.org/whl/cpu"
"""The set-up line's CPU torch: pip gives up on an unreachable index at once (its default, 5 retries
with back-off for each project page, took 92 s there: docs/measurements.md)."""


def torch_requirement() -> str:
    """The torch requirement of pyproject.toml's dependencies, e.g. ``torch>=2.4,<3``."""
    (requirement,) = re.findall(r'^\s*"(torch[<>=!~][^"]*)",', (REPO / "pyproject.toml").read_text(), re.M)
    return requirement


def test_setup_is_two_commands_cpu_torch_or_fallback_then_main_job_then_tests() -> None:
    install_and_run, install_and_test = setup_commands()
    steps = [s.strip() for s in install_and_run.split("&&")]
    cpu_index, fallback = (s.strip() for s in steps[0].split("||"))
    assert cpu_index == CPU_TORCH
    words = shlex.split(cpu_index)  # fail fast where the index cannot be reached
    assert words[words.index("--retries") + 1] == "0" and float(words[words.index("--timeout") + 1]) <= 10
    assert shlex.split(fallback) == ["pip", "install", torch_requirement()]  # pip's own index
    assert steps[1] == "pip install -e ."
    assert steps[2].startswith("OMP_NUM_THREADS=1 python scripts/correlate.py ")  # one torch thread
    argv = correlate_argv(install_and_run)
    args = parse_args(argv)
    assert args.model == "tiny" and all((REPO / image).is_file() for image in args.image)
    assert install_and_test == 'pip install -e ".[test]" && python -m pytest -n 2 -q'


def test_the_first_command_gives_a_decided_calibrated_verdict_without_running() -> None:
    """Checked from its arguments: a rho run of the trained tiny model over the ten bundled digits
    (several references: the verdict is decided, "undecided" is its answer for one), calibrated (the
    exact head's anchor), with the step count its measured minute was taken at."""
    from nw_adapter.correlate.images import collect_image_paths, validate_images
    from nw_adapter.models.tiny_digits import example_image_path

    args = parse_args(correlate_argv(setup_commands()[0]))
    assert args.run.name == "rho" and args.model == "tiny" and args.calibrate and args.steps == 25
    assert args.untrained_control and args.control_draws >= 2  # the control: the other anchor
    references = validate_images(collect_image_paths(args.image, [REPO / d for d in args.image_dir]))
    assert len(references) == 10 and {Path(r.path).parent for r in references} == {
        example_image_path(0).parent
    }
    assert args.out == Path("out_tiny") and "out_tiny/report.html" in README  # the page the README shows


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
        f'python() {{ echo "python $1 OMP_NUM_THREADS=$OMP_NUM_THREADS" >> {shlex.quote(str(log))}; }}\n'
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
    assert calls == [CPU_TORCH, fallback, "pip install -e .", FIRST_RUN]


def test_setup_uses_the_cpu_index_alone_when_it_is_reachable(tmp_path: Path) -> None:
    calls = _run_setup_with_fake_tools(tmp_path, index_reachable=True)
    assert calls == [CPU_TORCH, "pip install -e .", FIRST_RUN]


FIRST_RUN = "python scripts/correlate.py OMP_NUM_THREADS=1"
"""The first run as the stand-in ``python`` logs it: with one torch thread per process."""


def test_ci_runs_exactly_the_readme_test_command() -> None:
    test_command = setup_commands()[1].split("&&")[-1].strip()
    ci_lines = [line.strip() for line in (REPO / ".ci" / "run").read_text().splitlines()]
    assert test_command in ci_lines
    assert "python -m pytest -n 2 -q" == test_command
    assert "```bash\npython -m pytest -n 2 -q\n```" in README


def test_the_readme_main_job_runs_on_the_embedded_model(tmp_path: Path, monkeypatch, capsys) -> None:
    """The first command with 3 steps instead of 25: one screen, a decided verdict, the exact head's
    outcome, and where the report is."""
    monkeypatch.chdir(REPO)
    monkeypatch.setenv("NW_ADAPTER_CACHE", str(tmp_path / "cache"))
    argv = correlate_argv(setup_commands()[0])
    out = argv.index("--out") + 1
    argv[out] = str(tmp_path / argv[out])
    argv[argv.index("--steps") + 1] = "3"  # an option is given once (twice is refused)
    assert main([*argv, "-q"]) == 0
    printed = capsys.readouterr().out.splitlines()
    assert len(printed) <= 25  # one screen
    assert printed[0].startswith("attention vs NW weights, tiny: 10 reference image(s), 3 steps")
    assert "; calibrated: each reference run again with the exact NW head" in printed[1]
    (conclusion,) = [line for line in printed if line.startswith("verdict: ")]
    assert "undecided" not in conclusion and "(10 reference images)" in conclusion
    assert any(line.startswith("  calibration: the exact NW head in this pipeline: ") for line in printed)
    assert printed[-1].startswith("details: -v prints") and f"{argv[out]}/report.html" in printed[-1]
    assert (Path(argv[out]) / "rho.json").is_file() and (Path(argv[out]) / "report.html").is_file()


def test_the_defaults_written_out_are_the_defaults() -> None:
    """docs/cli.md's SD 1.5 command written out with every default (the README's is the short one)."""
    cli_md = (REPO / "docs" / "cli.md").read_text()
    assert "python scripts/correlate.py --image ref.png --out out_sd15" in shell_commands(README)
    commands = [
        c for c in shell_commands(cli_md) if c.startswith("python scripts/correlate.py --image ref.png")
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


def test_the_readme_python_blocks_run_offline_as_written(tmp_path: Path, monkeypatch, capsys) -> None:
    """Every Python block of the README, in order, in one namespace: every name is defined there
    and nothing needs the network (the blocks use the shipped tiny model). The notebook route ends
    in the interactive report and the calibrated verdict the command line prints."""
    import matplotlib.figure
    import torch

    from nw_adapter.correlate.html_report.document import Report

    torch.set_num_threads(1)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    blocks = python_blocks(README)
    assert len(blocks) >= 2
    namespace: dict = {}
    for block in blocks:
        exec(compile(block, "README.md", "exec"), namespace)  # noqa: S102 - the README's own code
    assert isinstance(namespace["fig"], matplotlib.figure.Figure)
    assert isinstance(namespace["page"], Report) and (tmp_path / "report.html").stat().st_size > 1e6
    assert len(namespace["images"]) == 4 and namespace["pipe"].nw_recorder is None  # restored
    result = namespace["result"]
    assert result["images"] == 4 and result["evidence"] is False  # the trained adapter: no evidence
    exact = result["anchors"]["exact"]
    assert exact["source"] == "measured" and exact["verdict"]["evidence"] is True  # the exact head: evidence
    printed = capsys.readouterr().out.splitlines()  # format_verdict(result, detail=False)
    assert printed[0] == f"verdict: {result['conclusion']}" and len(printed) < 20
    met = "evidence (bandwidth clause and NW-form clause met)"
    assert printed[-1] == f"  calibration: the exact NW head in this pipeline: {met}"


def test_the_stated_size_of_the_shipped_model_is_its_size_on_disk() -> None:
    from nw_adapter.models.tiny_digits import SHIPPED_DIR

    files = [path for path in SHIPPED_DIR.rglob("*") if path.is_file()]
    stated = f"{sum(path.stat().st_size for path in files) / 1e6:.1f} MB of files"
    assert stated in README and stated in (REPO / "docs" / "cli.md").read_text(), stated
