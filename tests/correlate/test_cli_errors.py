"""Bad input to correlate.py: exit status 2, one line naming the problem and the fix, no files."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from subprocess_limits import SUBPROCESS_TIMEOUT_S
from test_images import BAD_KINDS, EXPECTED_WORDS, make_bad_file, photo

from nw_adapter.correlate.cli import main

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "scripts" / "correlate.py"


def run_main(argv: list[str], capsys) -> tuple[int, str, str]:
    code = main([str(a) for a in argv])
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def assert_one_line_error(code: int, err: str, *words: str) -> str:
    lines = [line for line in err.splitlines() if line.strip()]
    assert code == 2, err
    assert len(lines) == 1, err
    assert lines[0].startswith("correlate.py: error: ")
    assert "Traceback" not in err
    for word in words:
        assert word in lines[0], lines[0]
    return lines[0]


@pytest.fixture
def good_image(tmp_path: Path) -> Path:
    path = tmp_path / "china.png"
    photo(size=48).save(path)
    return path


@pytest.mark.parametrize("kind", BAD_KINDS)
def test_bad_image_files(kind: str, tmp_path: Path, capsys) -> None:
    bad = make_bad_file(kind, tmp_path / "in")
    out = tmp_path / "out"
    code, stdout, err = run_main(["--image", bad, "--model", "tiny", "--out", out], capsys)
    assert_one_line_error(code, err, str(bad), EXPECTED_WORDS[kind])
    assert stdout == "" and not out.exists()


def test_one_bad_file_in_a_folder_stops_before_any_work(tmp_path: Path, good_image: Path, capsys) -> None:
    folder = tmp_path / "refs"
    folder.mkdir()
    photo(size=48).save(folder / "a.png")
    make_bad_file("truncated_jpeg", folder)
    out = tmp_path / "out"
    code, _, err = run_main(["--image-dir", folder, "--model", "tiny", "--out", out], capsys)
    assert_one_line_error(code, err, "truncated.jpg", "truncated or corrupt")
    assert not out.exists()


def test_empty_image_directory(tmp_path: Path, capsys) -> None:
    folder = tmp_path / "refs"
    folder.mkdir()
    (folder / "readme.txt").write_text("no pictures")
    code, _, err = run_main(["--image-dir", folder, "--model", "tiny", "--out", tmp_path / "out"], capsys)
    assert_one_line_error(code, err, "contains no images", "--image")
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize(
    ("options", "words"),
    [
        (["--steps", "0"], "--steps must be between 1 and 1000"),
        (["--steps", "many"], "--steps must be a whole number"),
        (["--steps", "2.5"], "--steps must be a whole number"),
        (["--bandwidth", "wide"], "--bandwidth must be one of matched, fitted, schedule, median"),
        (["--bandwidth", "-1"], "--bandwidth must be a number h in the usable range [0.0001, 10000]"),
        (["--bandwidth", "inf"], "--bandwidth must be a number h in the usable range"),
        (["--bandwidth", "1e-30", "--mode", "swap"], "usable range [0.0001, 10000]"),
        (["--bandwidth", "1e-200"], "usable range [0.0001, 10000]"),
        (["--bandwidth", "1e300"], "usable range [0.0001, 10000]"),
        (["--guidance-scale", "nan"], "--guidance-scale must be a finite number >= 0"),
        (["--ip-scale", "-0.5"], "--ip-scale must be a finite number >= 0"),
        (["--seed", "-3"], "--seed must be between 0 and 2**63 - 1"),
        (["--ip-scale", "-inf"], "--ip-scale must be a finite number >= 0, got '-inf'"),  # not "expected one
        (["--ip-scale", "-1e3"], "--ip-scale must be a finite number >= 0, got '-1e3'"),  # argument"
        (["--guidance-scale", "-NaN"], "--guidance-scale must be a finite number >= 0, got '-NaN'"),
        (["--seed", "-1e3"], "--seed must be a whole number, got '-1e3'"),
        (["--height", "30"], "multiple of 8"),
        (["--mode", "replace"], "invalid choice: 'replace'"),
        (["--scheduler", "fast"], "invalid choice: 'fast'"),
        (["--dtype", "int8"], "invalid choice: 'int8'"),
        (["--layers", "up,,mid"], "--layers must be comma-separated names without empty entries"),
        (["--model", " "], "--model is empty"),
        (["--out", ""], "--out is empty"),
        (["--image-dir", ""], "--image-dir is empty"),
        (["--image", ""], "--image is empty"),
        (["--frobnicate"], "unrecognized arguments: --frobnicate"),
    ],
)
def test_nonsense_option_values(
    options: list[str], words: str, tmp_path: Path, good_image: Path, capsys
) -> None:
    out = tmp_path / "out"
    code, _, err = run_main(["--image", good_image, "--model", "tiny", "--out", out, *options], capsys)
    line = assert_one_line_error(code, err, words)
    assert "(see --help)" in line or "pass" in line
    assert not out.exists()


def test_empty_prompt_is_accepted() -> None:
    from nw_adapter.correlate.cli import parse_args

    assert parse_args(["--image", "ref.png", "--prompt", ""]).prompt == ""


def test_no_image_at_all(capsys) -> None:
    code, _, err = run_main(["--model", "tiny"], capsys)
    assert_one_line_error(code, err, "no reference image given", "--image FILE")


def test_output_path_is_a_file(tmp_path: Path, good_image: Path, capsys) -> None:
    blocker = tmp_path / "taken"
    blocker.write_text("a file")
    for out in (blocker, blocker / "sub"):
        code, _, err = run_main(["--image", good_image, "--model", "tiny", "--out", out], capsys)
        assert_one_line_error(code, err, "--out", "pass")
    assert blocker.read_text() == "a file"


def test_unwritable_output_folder(tmp_path: Path, good_image: Path, capsys) -> None:
    if os.geteuid() == 0:
        out = Path("/sys/nw-adapter-correlate-out")  # sysfs refuses new files even for root
        if out.exists() or not Path("/sys").is_dir():
            pytest.skip("no sysfs to stand in for a read-only folder")
    else:
        locked = tmp_path / "locked"
        locked.mkdir()
        locked.chmod(0o500)
        out = locked / "out"
    code, _, err = run_main(["--image", good_image, "--model", "tiny", "--out", out], capsys)
    assert_one_line_error(code, err, "--out", "cannot write", "pass a writable folder")
    assert not out.exists()


def test_model_folder_without_ip_adapter_weights(
    tmp_path: Path, good_image: Path, tiny_sd15_dir, capsys
) -> None:
    out = tmp_path / "out"
    argv = ["--image", good_image, "--model", tiny_sd15_dir, "--ip-adapter", tiny_sd15_dir, "--out", out]
    code, _, err = run_main(argv, capsys)
    assert_one_line_error(
        code, err, "no IP-Adapter weights", "models/ip-adapter_sd15.safetensors", "--ip-adapter"
    )
    assert not out.exists()


def test_folder_that_is_not_a_pipeline(tmp_path: Path, good_image: Path, tiny_ip_adapter_dir, capsys) -> None:
    argv = ["--image", good_image, "--model", tiny_ip_adapter_dir, "--out", tmp_path / "out"]
    code, _, err = run_main(argv, capsys)
    assert_one_line_error(code, err, "no model_index.json", "--model tiny")


def test_wrong_adapter_subfolder(
    tmp_path: Path, good_image: Path, tiny_sd15_dir, tiny_ip_adapter_dir, capsys
):
    argv = [
        "--image",
        good_image,
        "--model",
        tiny_sd15_dir,
        "--ip-adapter",
        tiny_ip_adapter_dir,
        "--subfolder",
        "sdxl_models",
        "--out",
        tmp_path / "out",
    ]
    code, _, err = run_main(argv, capsys)
    assert_one_line_error(code, err, "sdxl_models/ip-adapter_sd15.safetensors", "--subfolder")


def test_no_network_with_the_real_defaults(tmp_path: Path, good_image: Path, monkeypatch, capsys) -> None:
    import huggingface_hub.constants

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setenv("HF_HOME", str(tmp_path / "empty-hf-home"))
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path / "empty-hf-home" / "hub"))
    out = tmp_path / "out"
    code, _, err = run_main(["--image", good_image, "--out", out], capsys)
    line = assert_one_line_error(code, err, "stable-diffusion-v1-5/stable-diffusion-v1-5", "--model tiny")
    assert "local folder" in line and "Hugging Face cache" in line
    assert not out.exists()


def test_layers_that_match_no_adapter_layer(
    tmp_path: Path, good_image: Path, tiny_sd15_dir, tiny_ip_adapter_dir, capsys
) -> None:
    out = tmp_path / "out"
    argv = [
        "--image",
        good_image,
        "--model",
        tiny_sd15_dir,
        "--ip-adapter",
        tiny_ip_adapter_dir,
        "--layers",
        "down_blocks.7",
        "--out",
        out,
        "--quiet",
    ]
    code, _, err = run_main(argv, capsys)
    line = assert_one_line_error(code, err, "--layers", "down_blocks.7", "matches no IP-Adapter layer")
    blocks = line.split("use the blocks ", 1)[1].split(" or ", 1)[0].split(", ")
    assert blocks and set(blocks) <= {"down", "mid", "up"}  # the UNet's blocks, each named once
    assert "processor-name prefix such as 'down_blocks." in line
    assert not out.exists()


@pytest.mark.parametrize("fresh_cache", [False, True], ids=["cached", "first-run"])
@pytest.mark.parametrize("model", ["tiny-sd3", "tiny-flux"])
def test_layers_error_names_the_transformer_blocks(
    tmp_path: Path, good_image: Path, model: str, fresh_cache: bool, capsys, monkeypatch, request
) -> None:
    """A UNet block name on SD3 / Flux: the message names the transformer's blocks, not UNet ones;
    also on a first run, when the offline model is written to an empty cache (transformers'
    "Writing model shards" bars stay off stderr)."""
    if fresh_cache:
        monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
        # as in a process that imported transformers before the command line ran (its bars are on)
        from transformers.utils import logging as transformers_logging

        if not transformers_logging.is_progress_bar_enabled():
            transformers_logging.enable_progress_bar()
            request.addfinalizer(transformers_logging.disable_progress_bar)
    out = tmp_path / "out"
    argv = ["--image", good_image, "--model", model, "--height", "32", "--width", "32", "--layers", "up"]
    code, _, err = run_main([*argv, "--out", out, "--quiet"], capsys)
    line = assert_one_line_error(code, err, "--layers", "'up' (up_blocks)", "matches no IP-Adapter layer")
    example = "a processor-name prefix such as 'transformer_blocks.0."
    assert f"use the block transformer_blocks or {example}" in line
    assert "down" not in line and "mid" not in line
    assert not out.exists()


def test_unavailable_device(tmp_path: Path, good_image: Path, capsys) -> None:
    import torch

    if torch.cuda.is_available():
        pytest.skip("CUDA is available here")
    code, _, err = run_main(
        ["--image", good_image, "--model", "tiny", "--device", "cuda", "--out", tmp_path / "o"], capsys
    )
    assert_one_line_error(code, err, "--device cuda", "CUDA is not available", "--device cpu")
    code, _, err = run_main(
        ["--image", good_image, "--model", "tiny", "--device", "gpu0", "--out", tmp_path / "o"], capsys
    )
    assert_one_line_error(code, err, "--device must be auto, cpu, mps, cuda or cuda:N, got 'gpu0'")
    assert not (tmp_path / "o").exists()


@pytest.mark.parametrize(
    ("kind", "extra", "words"),
    [
        ("truncated_png", [], "truncated or corrupt"),
        (None, ["--steps", "abc"], "--steps must be a whole number"),
    ],
)
def test_real_process_exit_status_and_stderr(kind, extra, words, tmp_path: Path, good_image: Path) -> None:
    image = make_bad_file(kind, tmp_path / "in") if kind else good_image
    out = tmp_path / "out"
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), "--image", str(image), "--model", "tiny", "--out", str(out), *extra],
        capture_output=True,
        text=True,
        env=env,
        timeout=SUBPROCESS_TIMEOUT_S,
        cwd=tmp_path,
    )
    assert proc.returncode == 2
    assert proc.stdout == ""
    assert_one_line_error(proc.returncode, proc.stderr, words)
    assert not out.exists()


def test_help_exits_zero(capsys) -> None:
    with pytest.raises(SystemExit) as info:
        main(["--help"])
    assert info.value.code == 0
    assert "--bandwidth" in capsys.readouterr().out


def test_dangling_symlink_as_out(tmp_path: Path, good_image: Path, capsys) -> None:
    out = tmp_path / "link"
    out.symlink_to(tmp_path / "missing-target")
    code, _, err = run_main(["--image", good_image, "--model", "tiny", "--out", out], capsys)
    assert_one_line_error(code, err, "dangling symbolic link", "missing-target")
    assert not (tmp_path / "missing-target").exists()


def test_read_only_images_subfolder_is_found_before_any_work(
    tmp_path: Path, good_image: Path, monkeypatch, capsys
) -> None:
    """A read-only ``images/`` (simulated: root may write anywhere) is refused before the model loads."""
    import errno
    import tempfile

    import nw_adapter.correlate.loading as loading

    def no_model(*args, **kwargs):
        raise AssertionError("the model must not be loaded before the output folder is checked")

    real_mkstemp = tempfile.mkstemp

    def mkstemp(*args, dir=None, **kwargs):
        if dir is not None and Path(dir).name == "images":
            raise PermissionError(errno.EACCES, os.strerror(errno.EACCES))
        return real_mkstemp(*args, dir=dir, **kwargs)

    monkeypatch.setattr(loading, "build_pipeline", no_model)
    monkeypatch.setattr(tempfile, "mkstemp", mkstemp)
    (tmp_path / "out" / "images").mkdir(parents=True)
    code, _, err = run_main(["--image", good_image, "--model", "tiny", "--out", tmp_path / "out"], capsys)
    assert_one_line_error(code, err, "cannot write in", "images", "Permission denied", "writable folder")


def test_tiny_cache_write_failure_from_safetensors_is_one_line(
    tmp_path: Path, good_image: Path, monkeypatch, capsys
) -> None:
    from safetensors import SafetensorError

    import nw_adapter.models.tiny_flow as tiny_flow

    def full_disk(path, **kwargs):
        raise SafetensorError("Error while serializing: IoError(Os { code: 28, kind: StorageFull })")

    # --model tiny is shipped in the package; the tiny SD 3.5 model is the one written to the cache
    monkeypatch.setattr(tiny_flow, "save_tiny_sd3", full_disk)
    monkeypatch.setenv("NW_ADAPTER_CACHE", str(tmp_path / "cache"))
    code, _, err = run_main(["--image", good_image, "--model", "tiny-sd3", "--out", tmp_path / "out"], capsys)
    assert_one_line_error(code, err, "cannot write the tiny model", "StorageFull", "NW_ADAPTER_CACHE")


def test_write_failure_mid_run_exits_2_and_keeps_finished_images(
    tmp_path: Path, tiny_sd15_dir, tiny_ip_adapter_dir, monkeypatch, capsys
) -> None:
    import errno

    from PIL import Image

    from nw_adapter.correlate.sweep import result_path

    refs = []
    for i, size in enumerate((40, 48)):
        refs += ["--image", tmp_path / f"ref{i}.png"]
        photo(size=size).save(refs[-1])
    out = tmp_path / "out"
    argv = [
        *refs,
        "--model",
        tiny_sd15_dir,
        "--ip-adapter",
        tiny_ip_adapter_dir,
        "--steps",
        "1",
        "--out",
        out,
    ]
    real_save = Image.Image.save
    saved: list[str] = []

    def save(self, fp, *args, **kwargs):
        if "generated" in str(fp):
            saved.append(str(fp))
            if len(saved) == 2:
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return real_save(self, fp, *args, **kwargs)

    assert run_main([*argv, "--seed", "7"], capsys)[0] == 0  # a finished run of other options first
    assert (out / "rho.json").is_file()
    monkeypatch.setattr(Image.Image, "save", save)
    code, stdout, err = run_main(argv, capsys)
    progress, err = err.splitlines()[:-1], err.splitlines()[-1] + "\n"  # the finished reference's line first
    assert [line.split(" done in ")[0] for line in progress] == ["progress: reference 1 of 2"]
    line = assert_one_line_error(code, err, "cannot write", "generated", "No space left on device")
    assert "finished images are kept" in line and stdout == ""
    finished = [p for p in (out / "images").glob("*/result.json")]
    assert len(finished) == 1
    assert not (out / "rho.json").exists()  # the seed-7 report no longer describes these folders
    monkeypatch.setattr(Image.Image, "save", real_save)
    code, _, err = run_main(argv, capsys)
    assert code == 0 and "resumed: 1 finished image(s) reused" in err
    assert all(result_path(out, p.parent.name).is_file() for p in finished)
    assert json.loads((out / "rho.json").read_text())["config"]["seed"] == 0


def test_two_runs_on_one_out_are_refused(tmp_path: Path, good_image: Path, tiny_sd15_dir, tiny_ip_adapter_dir,
                                          capsys) -> None:  # fmt: skip
    from nw_adapter.correlate.outputs import OutputLock

    out = tmp_path / "out"
    argv = [
        "--image",
        good_image,
        "--model",
        tiny_sd15_dir,
        "--ip-adapter",
        tiny_ip_adapter_dir,
        "--out",
        out,
    ]
    with OutputLock(out):
        code, _, err = run_main([*argv, "--steps", "1"], capsys)
    assert_one_line_error(code, err, "another correlate.py run is writing there", "pass another --out")
    assert not (out / "images").exists()


def test_offline_default_adapter_with_a_local_model_is_named_offline(
    tmp_path: Path, good_image: Path, tiny_sd15_dir, monkeypatch, capsys
) -> None:
    """No network, HF_HUB_OFFLINE unset: diffusers says "no file named ..."; the cause is the network."""
    import diffusers.loaders.ip_adapter as ip_adapter
    import huggingface_hub.constants
    from huggingface_hub.errors import LocalEntryNotFoundError

    def unreachable_hub(*args, **kwargs):
        try:
            raise LocalEntryNotFoundError("An error happened while trying to locate the file on the Hub")
        except LocalEntryNotFoundError:
            raise OSError("h94/IP-Adapter does not appear to have a file named ip-adapter_sd15.safetensors.")  # noqa: B904 - as diffusers raises it (context, not cause)

    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(ip_adapter, "_get_model_file", unreachable_hub)
    out = tmp_path / "out"
    code, _, err = run_main(["--image", good_image, "--model", tiny_sd15_dir, "--out", out], capsys)
    line = assert_one_line_error(
        code, err, "--ip-adapter 'h94/IP-Adapter'", "Hub cannot be reached (offline)"
    )
    assert "--weight-name" not in line
    expected = (
        "hf download h94/IP-Adapter models/ip-adapter_sd15.safetensors models/image_encoder/config.json "
        "models/image_encoder/model.safetensors"
    )
    assert expected in line
    assert not out.exists()


def test_download_hint_for_the_default_model_names_its_files_only() -> None:
    from nw_adapter.correlate.loading import DEFAULT_MODEL, SD15_FILES, download_command

    command = download_command(DEFAULT_MODEL, "--model")
    assert command.split()[3:] == list(SD15_FILES)
    assert "unet/diffusion_pytorch_model.safetensors" in command and "*" not in command
    assert "--exclude '*fp16*'" in download_command("someone/other-model", "--model")


def test_download_hints_fetch_diffusers_folders_only_and_say_what_is_gated() -> None:
    """SD 3.5's repository also holds a single-file checkpoint at its root and non-diffusers text
    encoders (tens of GB): the hint fetches the component folders only, says the model is gated,
    and offers the matching tiny stand-in."""
    from nw_adapter.correlate.loading import ModelSpec, _offline_hint, download_command

    sd35 = "stabilityai/stable-diffusion-3.5-large"
    command = download_command(sd35, "--model")
    assert "--include '*/*.safetensors'" in command and "--include '*.safetensors'" not in command
    assert "--exclude 'text_encoders/*'" in command and "--include 'model_index.json'" in command
    hint = _offline_hint(sd35, "--model")
    assert "gated: accept its licence on the Hub, then hf auth login" in hint
    assert (
        "--model tiny-sd3 (Stable Diffusion 3 / 3.5, random weights" in hint and "--model tiny " not in hint
    )
    flux = _offline_hint("black-forest-labs/FLUX.1-dev", "--model")
    assert flux.endswith("--model tiny-flux-digits (Flux, trained on digits)")  # the family's trained one
    assert "gated" not in _offline_hint("stable-diffusion-v1-5/stable-diffusion-v1-5", "--model")
    encoder = "google/siglip-so400m-patch14-384"
    spec = ModelSpec(sd35, "InstantX/SD3.5-Large-IP-Adapter", "", "ip-adapter.bin", image_encoder=encoder)
    adapter = _offline_hint(spec.ip_adapter, "--ip-adapter", spec)
    assert "hf download InstantX/SD3.5-Large-IP-Adapter ip-adapter.bin && hf download " in adapter
    assert f"{encoder} config.json model.safetensors preprocessor_config.json" in adapter
    assert "/image_encoder/" not in adapter and "--model tiny-sd3" in adapter


def test_file_size_limit_while_writing_the_tiny_model_is_one_line(tmp_path: Path, good_image: Path) -> None:
    """A real write failure (RLIMIT_FSIZE, SIGXFSZ ignored), not a monkeypatch: EFBIG in safetensors."""
    code = (
        "import resource, signal, sys\n"
        "signal.signal(signal.SIGXFSZ, signal.SIG_IGN)\n"
        "resource.setrlimit(resource.RLIMIT_FSIZE, (100_000, 100_000))\n"
        "from nw_adapter.correlate.cli import main\n"
        f"sys.exit(main(['--image', {str(good_image)!r}, '--model', 'tiny-sd3', '--steps', '1', "
        f"'--out', {str(tmp_path / 'out')!r}]))\n"
    )
    env = {**os.environ, "PYTHONPATH": str(REPO), "NW_ADAPTER_CACHE": str(tmp_path / "cache")}
    proc = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=SUBPROCESS_TIMEOUT_S
    )
    assert proc.stdout == ""
    assert_one_line_error(proc.returncode, proc.stderr, "cannot write the tiny model", "File too large")
    leftovers = [p for p in (tmp_path / "cache").rglob("*") if p.is_file()]
    assert leftovers == []  # nothing half-written is left to be loaded later
