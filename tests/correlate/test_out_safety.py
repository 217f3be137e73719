"""Nothing outside ``--out`` is read as ours, moved or deleted; only files the tool wrote are removed.

A symbolic link where the tool reads, writes or removes inside ``--out`` (the ``images`` folder, an
image folder, a result file, a report file, ``compare_swap.json``, a link loop) is refused with one
line (exit status 2 on the command line, :class:`~nw_adapter.correlate.outputs.OutputError` from the
library), its target untouched; a folder where the tool writes a file is refused the same way; a
file of the user's own inside ``images/<key>`` survives every rerun; a rho run and a
``--compare-swap`` run never share a folder; a reordered or changed reference list is named as such.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from cli_errors import one_line_error
from test_images import photo

from nw_adapter.atomic import atomic_write_text
from nw_adapter.correlate.cli import main
from nw_adapter.correlate.outputs import OutputError
from nw_adapter.correlate.sweep import image_dir, result_path, run_sweep

KEYS = ["a-1", "bb-2"]


def write_files(out: Path, label: str, *, maps: bool = False, interrupt: bool = False):
    """Fake per-image work: writes ``generated.png`` (and ``maps.safetensors``) into the image folder."""

    def work(key: str) -> tuple[dict, list[dict]]:
        atomic_write_text(image_dir(out, key) / "generated.png", f"{label}:{key}")
        if maps:
            atomic_write_text(image_dir(out, key) / "maps.safetensors", "maps")
        if interrupt:
            raise KeyboardInterrupt
        return {"key": key, "sha256": f"sha-{key}"}, [{"reference": key, "step": 0, "rho": 0.5}]

    return work


def sweep(out: Path, work, fingerprint: str = "f"):
    return run_sweep(KEYS, work, out_dir=out, expected_fingerprint=fingerprint, progress=False)


def snapshot(folder: Path) -> dict[str, str]:
    """``{name: text}`` of every file in ``folder``."""
    return {p.name: p.read_text() for p in sorted(folder.iterdir())}


@pytest.fixture
def outside(tmp_path: Path) -> Path:
    """A folder of the user's outside ``--out``, holding files with the tool's names and one of theirs."""
    folder = tmp_path / "precious"
    folder.mkdir()
    (folder / "generated.png").write_text("the user's picture")
    (folder / "notes.txt").write_text("the user's notes")
    return folder


# --- the sweep (library) -------------------------------------------------------------------------


def test_a_symlinked_image_folder_is_refused_and_its_target_untouched(tmp_path: Path, outside: Path) -> None:
    out = tmp_path / "out"
    sweep(out, write_files(out, "first"))
    before = snapshot(outside)
    link = image_dir(out, "a-1")
    for path in sorted(link.iterdir()):
        path.unlink()
    link.rmdir()
    link.symlink_to(outside, target_is_directory=True)
    with pytest.raises(OutputError, match=r"images/a-1' is a symbolic link"):
        sweep(out, write_files(out, "second"), fingerprint="other options")
    assert snapshot(outside) == before


def test_a_symlinked_images_folder_is_refused(tmp_path: Path, outside: Path) -> None:
    out = tmp_path / "out"
    out.mkdir()
    (outside / "a-1").mkdir()
    (outside / "a-1" / "generated.png").write_text("the user's picture")
    (out / "images").symlink_to(outside, target_is_directory=True)
    with pytest.raises(OutputError, match=r"images' is a symbolic link"):
        sweep(out, write_files(out, "x"))
    assert (outside / "a-1" / "generated.png").read_text() == "the user's picture"
    assert sorted(p.name for p in outside.iterdir()) == ["a-1", "generated.png", "notes.txt"]


def test_a_symlinked_result_file_is_never_read_as_ours(tmp_path: Path) -> None:
    out, other = tmp_path / "out", tmp_path / "other"
    sweep(other, write_files(other, "x"))  # a finished result elsewhere, that would be reused
    sweep(out, write_files(out, "x"), fingerprint="first")
    result = result_path(out, "a-1")
    result.unlink()
    (image_dir(out, "a-1") / "generated.png").write_text("x:a-1")  # same content as the other run's
    result.symlink_to(result_path(other, "a-1"))
    saved = result_path(other, "a-1").read_text()
    with pytest.raises(OutputError, match=r"result.json' is a symbolic link"):
        sweep(out, write_files(out, "x"))
    assert result_path(other, "a-1").read_text() == saved and result.is_symlink()


def test_a_symlink_loop_is_refused(tmp_path: Path) -> None:
    out = tmp_path / "out"
    out.mkdir()
    (out / "images").symlink_to(out / "images")
    with pytest.raises(OutputError, match=r"images' is a symbolic link"):
        sweep(out, write_files(out, "x"))


def test_a_file_of_the_users_own_in_an_image_folder_is_kept(tmp_path: Path) -> None:
    out = tmp_path / "out"
    sweep(out, write_files(out, "first", maps=True))
    notes = image_dir(out, "a-1") / "notes.txt"
    notes.write_text("mine")
    outcome = sweep(out, write_files(out, "second"), fingerprint="other options")
    assert outcome.computed == KEYS and notes.read_text() == "mine"
    assert not (image_dir(out, "a-1") / "maps.safetensors").exists()  # the tool's own stale file is gone
    assert (image_dir(out, "a-1") / "generated.png").read_text() == "second:a-1"
    notes.write_text("mine, edited")  # not one of the tool's files: the result stays reusable
    assert sweep(out, write_files(out, "third"), fingerprint="other options").reused == KEYS


def test_files_written_before_an_interruption_are_known_as_ours(tmp_path: Path) -> None:
    out = tmp_path / "out"
    with pytest.raises(KeyboardInterrupt):
        run_sweep(
            KEYS[:1], write_files(out, "killed", maps=True, interrupt=True), out_dir=out,
            expected_fingerprint="with maps", progress=False,
        )  # fmt: skip
    (image_dir(out, "a-1") / "notes.txt").write_text("mine")
    sweep(out, write_files(out, "again"))
    names = sorted(p.name for p in image_dir(out, "a-1").iterdir() if not p.name.startswith("."))
    assert names == ["generated.png", "notes.txt", "result.json"]  # the killed run's maps removed


def test_a_result_file_listing_a_path_outside_its_folder_is_not_reused(tmp_path: Path) -> None:
    from nw_adapter.correlate.sweep import content_digest, file_sha256, result_problem

    out = tmp_path / "out"
    sweep(out, write_files(out, "x"))
    (tmp_path / "secret.txt").write_text("outside")
    document = json.loads(result_path(out, "a-1").read_text())
    document["files"]["../../../secret.txt"] = file_sha256(tmp_path / "secret.txt")
    document["digest"] = content_digest(document)
    result_path(out, "a-1").write_text(json.dumps(document))
    found, why = result_problem(out, "a-1", "f")
    assert found is None and "secret.txt" in why


# --- the command line ----------------------------------------------------------------------------


def run_main(argv: list, capsys) -> tuple[int, str, str]:
    code = main([str(a) for a in argv])
    captured = capsys.readouterr()
    return code, captured.out, captured.err


@pytest.fixture
def reference(tmp_path: Path) -> tuple[Path, str]:
    """A reference image and its key (the name of its folder under ``--out/images``)."""
    from nw_adapter.correlate.images import validate_images

    path = tmp_path / "ref.png"
    photo(size=32).save(path)
    return path, validate_images([(path, "--image")])[0].key


RHO = ["--model", "tiny", "--steps", "1", "--no-untrained-control", "-q"]
SWAP = ["--compare-swap", "--model", "tiny", "--steps", "1", "--swap-rules", "matched", "-q"]


def _entry(kind: str, out: Path, key: str) -> str:
    """Make, inside ``out``, the hostile entry ``kind``; return the words the error line must have."""
    images = out / "images"
    if kind == "images loop":
        out.mkdir()
        images.symlink_to(images)
        return "images' is a symbolic link"
    if kind == "images link":
        out.mkdir()
        images.symlink_to(out.parent / "precious", target_is_directory=True)
        return "images' is a symbolic link"
    if kind == "image folder link":
        images.mkdir(parents=True)
        (images / key).symlink_to(out.parent / "precious", target_is_directory=True)
        return f"{key}' is a symbolic link"
    if kind == "result link":
        (images / key).mkdir(parents=True)
        (images / key / "result.json").symlink_to(out.parent / "precious" / "notes.txt")
        return "result.json' is a symbolic link"
    if kind == "compare_swap.json link":
        out.mkdir()
        (out / "compare_swap.json").symlink_to(out.parent / "precious" / "notes.txt")
        return "compare_swap.json' is a symbolic link"
    if kind == "lock link":
        out.mkdir()
        (out / ".nw-adapter.lock").symlink_to(out.parent / "precious" / "notes.txt")
        return ".nw-adapter.lock' is a symbolic link"
    name = kind.removesuffix(" folder")  # a folder where the tool writes a file
    (out / name).mkdir(parents=True)
    return f"{name}' is a folder"


HOSTILE = [
    "images loop",
    "images link",
    "image folder link",
    "result link",
    "lock link",
    "rho.json folder",
    "rho.csv folder",
    "rho.png folder",
    "bandwidth.png folder",
    "images/{key}/result.json folder",
    "images/{key}/generated.png folder",
]


@pytest.mark.parametrize("kind", HOSTILE)
def test_rho_run_refuses_links_and_folders_in_the_way(
    kind: str, tmp_path: Path, outside: Path, reference, capsys
) -> None:
    path, key = reference
    out = tmp_path / "out"
    words = _entry(kind.format(key=key), out, key)
    before = snapshot(outside)
    code, stdout, err = run_main(["--image", path, *RHO, "--out", out], capsys)
    one_line_error(code, err, words, "--out")
    assert stdout == "" and snapshot(outside) == before


@pytest.mark.parametrize(
    "kind", ["compare_swap.json folder", "compare_swap.csv folder", "compare_swap.json link", "lock link"]
)
def test_compare_swap_refuses_links_and_folders_in_the_way(
    kind: str, tmp_path: Path, outside: Path, reference, capsys
) -> None:
    path, key = reference
    out = tmp_path / "out"
    words = _entry(kind, out, key)
    code, stdout, err = run_main(["--image", path, *SWAP, "--out", out], capsys)
    one_line_error(code, err, words, "--out")
    assert stdout == "" and (outside / "notes.txt").read_text() == "the user's notes"


def test_replot_refuses_a_symlinked_image_folder(tmp_path: Path, outside: Path, reference, capsys) -> None:
    path, key = reference
    out = tmp_path / "out"
    code, _, err = run_main(["--image", path, *RHO, "--store-maps", "--out", out], capsys)
    assert code == 0, err
    folder = out / "images" / key
    for entry in folder.iterdir():
        os.replace(entry, outside / entry.name)
    folder.rmdir()
    folder.symlink_to(outside, target_is_directory=True)
    before = {p.name: p.stat().st_mtime_ns for p in outside.iterdir()}
    code, _, err = run_main(["--replot", out], capsys)
    one_line_error(code, err, f"{key}' is a symbolic link", "--replot")
    assert {p.name: p.stat().st_mtime_ns for p in outside.iterdir()} == before


def test_the_command_line_records_its_files_and_keeps_the_users(tmp_path: Path, reference, capsys) -> None:
    from nw_adapter.correlate.sweep import recorded_files

    path, key = reference
    out = tmp_path / "out"
    code, _, err = run_main(["--image", path, *RHO, "--store-maps", "--out", out], capsys)
    assert code == 0, err
    folder = out / "images" / key
    written = {p.name for p in folder.iterdir() if not p.name.startswith(".")} - {"result.json"}
    assert {"generated.png", "maps.safetensors", "attention_maps.png"} <= written
    assert set(recorded_files(folder)) == written  # every file the run wrote, and nothing else
    (folder / "notes.txt").write_text("mine")
    code, _, err = run_main(["--image", path, *RHO, "--seed", "1", "--out", out], capsys)
    assert code == 0, err
    names = {p.name for p in folder.iterdir() if not p.name.startswith(".")}
    assert names == {"generated.png", "result.json", "notes.txt"}  # the maps of the first run are gone
    assert (folder / "notes.txt").read_text() == "mine"


@pytest.mark.parametrize(
    ("present", "options", "named"),
    [
        ("rho.json", SWAP, "rho.json"),
        ("images", SWAP, "images"),
        ("compare_swap.json", RHO, "compare_swap.json"),
    ],
)
def test_a_rho_run_and_a_compare_swap_run_never_share_a_folder(
    present: str, options: list, named: str, tmp_path: Path, reference, capsys
) -> None:
    path, _ = reference
    out = tmp_path / "out"
    out.mkdir()
    if present == "images":
        (out / "images" / "old-0123456789").mkdir(parents=True)
        (out / "images" / "old-0123456789" / "result.json").write_text("{}")
    else:
        (out / present).write_text("{}")
    code, stdout, err = run_main(["--image", path, *options, "--out", out], capsys)
    line = one_line_error(code, err, named, "another --out")
    assert ("--compare-swap run" in line) == (options is RHO) and stdout == ""


# --- resuming --compare-swap: a reordered or changed reference list is named as such ------------


def test_a_reordered_or_changed_reference_list_is_named(tmp_path: Path, capsys) -> None:
    from nw_adapter.models.tiny_digits import example_image_path

    out = tmp_path / "out"
    three, seven = example_image_path(3), example_image_path(7)
    code, _, err = run_main([*SWAP, "--image", three, "--image", seven, "--out", out], capsys)
    assert code == 0, err
    code, _, err = run_main([*SWAP, "--image", seven, "--image", three, "--out", out], capsys)
    assert code == 0 and "the reference list was reordered" in err and "other options" not in err, err
    code, _, err = run_main([*SWAP, "--image", seven, "--out", out], capsys)
    assert code == 0 and "the reference list changed" in err and "other options" not in err, err
    assert f"no longer listed: {three.name}" in err
    code, _, err = run_main([*SWAP, "--image", seven, "--seed", "1", "--out", out], capsys)
    assert code == 0 and "other options" in err and "reference list" not in err, err


def test_out_itself_a_symlink_loop_is_one_line(tmp_path: Path, reference, capsys) -> None:
    path, _ = reference
    out = tmp_path / "out"
    out.symlink_to(out)
    code, _, err = run_main(["--image", path, *RHO, "--out", out], capsys)
    one_line_error(code, err, "symbolic link loop", "--out")


def test_cleaning_up_killed_writes_never_reaches_through_a_link(tmp_path: Path, outside: Path) -> None:
    from nw_adapter.correlate.outputs import remove_interrupted_writes

    out = tmp_path / "out"
    (out / "images").mkdir(parents=True)
    (out / "images" / "a-1").symlink_to(outside, target_is_directory=True)
    leftover = outside / ".generated.abcd1234.tmp.png"
    leftover.write_text("looks like a killed write's, but lies outside --out")
    assert remove_interrupted_writes(out, ["a-1"]) == [] and leftover.exists()
