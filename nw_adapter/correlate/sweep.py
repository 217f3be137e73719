"""Sweeps over many reference images: sharding across processes, resuming, merging.

Every reference image has its own result file ``<out>/images/<key>/result.json``, written
atomically when the image is finished, and tagged with a fingerprint of every option that
changes the numbers (model included) and with the SHA-256 of every other file the tool wrote in
the image's folder, and with the SHA-256 of its own content (``digest``). A rerun of the same command skips
an image only when its result file is a JSON object whose content still has its digest, with the
same fingerprint, the same reference-image hash, records that pass the caller's check, and files
whose hashes match the record, so an interrupted sweep resumes where it stopped and never mixes
two runs, and a hand-edited or bit-rotted result file is recomputed, not reused (the reason is
returned in :attr:`SweepOutcome.rejected`).

A changed option set on an existing ``--out`` recomputes every image cleanly: before the first
image changes, the merged report of the previous run is removed (``before_changes``); before an
image is computed, its old result file is removed first (so it no longer counts as finished)
and then every other file the tool wrote in its folder (e.g. maps of an earlier ``--store-maps``
run), and only those: each image folder has a manifest, :data:`MANIFEST_NAME`, naming every file
written there, recorded (atomically) before the file is written (:func:`nw_adapter.atomic.journal_writes`),
so it is complete even after a killed run; a file of the user's own in the folder is never removed,
hashed or read. Nothing is read, written or removed through a symbolic link inside ``out_dir``:
a link (or a folder where a file goes) at the ``images`` folder, an image folder, its result file,
its manifest or a recorded file stops the sweep with
:class:`~nw_adapter.correlate.out_paths.OutputError`, before anything is read.

Sharding uses :class:`accelerate.PartialState` when the script runs under
``accelerate launch`` (or ``torchrun``): the images still to do are split into contiguous
shards with ``split_between_processes``; each process writes its images' result files; after
a barrier the main process reads every result file, in input order, and writes the one
merged report. Because the merged report is always built from the files on disk, it is the
same whether the images were computed by one process, by several, or across an interruption.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import stat
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from nw_adapter.atomic import fsync_folder, journal_writes, remove_regular_file
from nw_adapter.correlate.out_paths import OutputError, check_entry
from nw_adapter.correlate.report import json_ready, write_json

RESULT_SCHEMA = "nw-adapter/rho-image"
RESULT_NAME = "result.json"
MANIFEST_NAME = ".nw-adapter-files.json"
"""The manifest of an image folder: the files the tool wrote there (``{"schema", "files": [names]}``)."""
MANIFEST_SCHEMA = "nw-adapter/written-files"


class SingleProcessState:
    """Stand-in for :class:`accelerate.PartialState` when not launched distributed."""

    process_index = 0
    num_processes = 1
    is_main_process = True

    @contextlib.contextmanager
    def split_between_processes(self, inputs: list) -> Iterator[list]:
        """Yield all inputs (one process does everything)."""
        yield inputs

    def wait_for_everyone(self) -> None:
        """Nothing to wait for."""


def is_distributed_launch() -> bool:
    """Whether ``accelerate launch`` / ``torchrun`` started more than one process."""
    return int(os.environ.get("WORLD_SIZE", "1")) > 1


def process_state(*, cpu: bool) -> Any:
    """``accelerate.PartialState`` under a multi-process launch, else :class:`SingleProcessState`.

    Args:
        cpu: Run on the CPU; with ``accelerate launch --multi_gpu`` or ``torchrun`` on a
            machine without GPUs this selects the gloo backend.
    """
    if not is_distributed_launch():
        return SingleProcessState()
    from accelerate import PartialState

    return PartialState(cpu=cpu)


def is_main_launch_process() -> bool:
    """Whether this is the main process of a launch (rank 0), or no launch at all (before joining)."""
    return int(os.environ.get("RANK", "0")) == 0


def gather(items: list, state: Any) -> list:
    """Every process's ``items``, concatenated in process order (one process: ``items``)."""
    if state.num_processes == 1:
        return list(items)
    from accelerate.utils import gather_object

    return list(gather_object(list(items)))


def fingerprint(options: dict) -> str:
    """SHA-256 (hex) of the options that change results, as canonical JSON."""
    return hashlib.sha256(json.dumps(options, sort_keys=True, default=str).encode()).hexdigest()


def image_dir(out_dir: Path, key: str) -> Path:
    """Folder of one reference image's outputs."""
    return Path(out_dir) / "images" / key


def result_path(out_dir: Path, key: str) -> Path:
    """The result file of one reference image."""
    return image_dir(out_dir, key) / RESULT_NAME


def file_sha256(path: Path) -> str:
    """SHA-256 (hex) of a file's bytes, read in 1 MiB blocks."""
    digest = hashlib.sha256()
    with Path(path).open("rb") as handle:
        for block in iter(lambda: handle.read(2**20), b""):
            digest.update(block)
    return digest.hexdigest()


def is_plain_name(name: object) -> bool:
    """Whether ``name`` is a file name inside one folder (text, no separator, not ``.`` / ``..``)."""
    return (
        isinstance(name, str)
        and name not in ("", ".", "..")
        and not any(sep in name for sep in ("/", "\\", "\0"))
    )


def is_regular_file(path: Path) -> bool:
    """Whether ``path`` is a regular file itself (``lstat``: a symbolic link is not)."""
    try:
        return stat.S_ISREG(os.lstat(path).st_mode)
    except OSError:
        return False


def recorded_files(folder: Path) -> list[str]:
    """The names the tool recorded writing in ``folder`` (its manifest, :data:`MANIFEST_NAME`).

    Empty when there is no manifest, or it is not a regular file of this tool's schema (a damaged
    manifest forgets files, so they are left in place rather than removed by mistake).
    """
    path = Path(folder) / MANIFEST_NAME
    if not is_regular_file(path):
        return []
    try:
        document = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return []
    if not isinstance(document, dict) or document.get("schema") != MANIFEST_SCHEMA:
        return []
    files = document.get("files")
    if not isinstance(files, list):
        return []
    return [name for name in dict.fromkeys(files) if is_plain_name(name) and name != MANIFEST_NAME]


def _write_manifest(folder: Path, names: Sequence[str]) -> None:
    """Write the manifest of ``folder`` atomically (remove it when ``names`` is empty)."""
    if names:
        write_json(Path(folder) / MANIFEST_NAME, {"schema": MANIFEST_SCHEMA, "files": list(names)})
    else:
        remove_regular_file(Path(folder) / MANIFEST_NAME)


def record_written(folder: Path, name: str) -> None:
    """Add ``name`` to the manifest of ``folder`` (before that file is written)."""
    names = recorded_files(folder)
    if name not in names and name != MANIFEST_NAME:
        _write_manifest(folder, [*names, name])


def folder_hashes(folder: Path) -> dict[str, str]:
    """``{name: sha256}`` of the files the tool recorded writing in ``folder`` (not the result file).

    Only regular files the manifest names (:func:`recorded_files`) that exist: a file of the user's
    own in the folder is neither hashed nor read.
    """
    folder = Path(folder)
    return {
        name: file_sha256(folder / name)
        for name in sorted(recorded_files(folder))
        if name != RESULT_NAME and is_regular_file(folder / name)
    }


def check_image_folder(
    out: Path, key: str, *, option: str = "--out", is_own: Callable[[str], bool] | None = None
) -> Path:
    """Check ``out/images/<key>`` and the entries the tool reads, writes or removes there.

    With :func:`~nw_adapter.correlate.out_paths.check_entry`: ``images``, ``images/<key>``, its
    ``result.json`` and manifest, every name the manifest records (:func:`recorded_files`) and,
    with ``is_own``, every existing entry whose name it accepts (the command line:
    :data:`nw_adapter.correlate.outputs.IMAGE_OUTPUT`).

    Returns:
        The image folder.

    Raises:
        OutputError: One line naming the entry and the fix.
    """
    relative = Path("images") / key
    check_entry(out, "images", folder=True, option=option)
    folder = check_entry(out, relative, folder=True, option=option)
    if not folder.is_dir():
        return folder
    check_entry(out, relative / MANIFEST_NAME, option=option)
    names = {RESULT_NAME, *recorded_files(folder)}
    if is_own is not None:
        try:
            names.update(name for name in os.listdir(folder) if is_own(name))
        except OSError as exc:
            raise OutputError(
                f"{option} '{out}': cannot list '{folder}' ({exc.strerror or type(exc).__name__}); fix its "
                f"permissions or pass another {option}"
            ) from None
    for name in sorted(names):
        check_entry(out, relative / name, option=option)
    return folder


DIGEST_FIELD = "digest"
"""Field of a result file holding the SHA-256 of the rest of its content (see :func:`content_digest`)."""


def content_digest(document: dict) -> str:
    """SHA-256 (hex) of ``document`` without its :data:`DIGEST_FIELD`, as canonical JSON.

    Canonical: keys sorted, no spaces, ASCII, NaN and infinities as null (as the file is written),
    so the digest of the parsed file equals the digest computed before writing it; any change of a
    value, key or record changes it.
    """
    body = {k: v for k, v in document.items() if k != DIGEST_FIELD}
    text = json.dumps(
        json_ready(body), sort_keys=True, separators=(",", ":"), ensure_ascii=True, allow_nan=False
    )
    return hashlib.sha256(text.encode()).hexdigest()


def result_problem(
    out_dir: Path,
    key: str,
    expected_fingerprint: str,
    image_sha256: str | None = None,
    validate: Callable[[dict, str, str], None] | None = None,
) -> tuple[dict | None, str | None]:
    """``(result, None)`` for a finished image, else ``(None, why it must be (re)computed)``.

    The reason is None when there is no result file at all (nothing to report), else one phrase:
    unreadable, not a JSON object, another schema or fingerprint, another reference image
    (``image_sha256``), content changed since it was written (its :data:`DIGEST_FIELD` differs),
    malformed (``validate(result, key, source)`` raised ``ValueError``), or a file it lists is missing
    or has changed since (its SHA-256 differs).
    """
    path = result_path(out_dir, key)
    source = f"{Path('images') / key / RESULT_NAME}"
    linked = next((p for p in (path.parent.parent, path.parent, path) if os.path.islink(p)), None)
    if linked is not None:
        return None, f"{source} is not a file of this tool ('{linked}' is a symbolic link)"
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        return None, None
    except OSError as exc:
        return None, f"{source} is unreadable ({exc.strerror or type(exc).__name__})"
    try:
        result = json.loads(text)
    except ValueError:
        return None, f"{source} is not valid JSON (an interrupted or damaged file)"
    if not isinstance(result, dict):
        return None, f"{source} is not a JSON object"
    if result.get("schema") != RESULT_SCHEMA:
        return None, f"{source} is of another schema ({result.get('schema')!r})"
    if DIGEST_FIELD not in result:
        return None, f"{source} has no content digest (written by an older version)"
    if result.get(DIGEST_FIELD) != content_digest(result):
        return None, f"{source} was changed after it was written (its content digest does not match)"
    if result.get("fingerprint") != expected_fingerprint:
        return None, f"{source} was made with other options or another model"
    image = result.get("image")
    if image_sha256 is not None and (not isinstance(image, dict) or image.get("sha256") != image_sha256):
        return None, f"{source} belongs to another reference file"
    files = result.get("files")
    if not isinstance(files, dict) or not all(isinstance(d, str) for d in files.values()):
        return None, f"{source} has no valid 'files' digests"
    if validate is not None:
        try:
            validate(result, key, source)
        except ValueError as exc:
            return None, " ".join(str(exc).split())
    folder = image_dir(out_dir, key)
    outside = sorted(name for name in files if not is_plain_name(name))
    if outside:
        return None, f"{source} lists a file outside its folder ({outside[0]})"
    if not all(is_regular_file(folder / name) for name in files):
        return None, f"{source} lists a file that is missing (or is not a regular file)"
    try:
        changed = [name for name, digest in files.items() if file_sha256(folder / name) != digest]
    except OSError:
        return None, f"{source} lists a file that is missing"
    if changed:
        return None, f"{source} lists files changed since ({', '.join(sorted(changed)[:3])})"
    return result, None


def load_result(
    out_dir: Path,
    key: str,
    expected_fingerprint: str,
    image_sha256: str | None = None,
    validate: Callable[[dict, str, str], None] | None = None,
) -> dict | None:
    """The finished result of ``key``, or None when it must be (re)computed (see :func:`result_problem`)."""
    return result_problem(out_dir, key, expected_fingerprint, image_sha256, validate)[0]


def save_result(out_dir: Path, key: str, expected_fingerprint: str, image: dict, records: list[dict]) -> Path:
    """Write one image's result file atomically (the marker that the image is finished).

    The SHA-256 of every other file the tool wrote in the image's folder (its manifest, see
    :func:`folder_hashes`) is recorded under ``files``, and the
    SHA-256 of the result's own content under :data:`DIGEST_FIELD` (:func:`content_digest`), so
    an edited or bit-rotted result file is recomputed rather than reused.
    """
    document = {
        "schema": RESULT_SCHEMA,
        "fingerprint": expected_fingerprint,
        "image": image,
        "files": folder_hashes(image_dir(out_dir, key)),
        "records": records,
    }
    document[DIGEST_FIELD] = content_digest(document)
    return write_json(result_path(out_dir, key), document)


def clear_image_outputs(out_dir: Path, key: str) -> None:
    """Invalidate an image before it is (re)computed: remove its result file, then the files the tool wrote.

    The result file goes first, so an interruption in between leaves an unfinished image, never
    a finished-looking one beside files of another run; then every regular file the manifest
    records (:func:`recorded_files`), then the manifest. Nothing else in the folder (a file of the
    user's own, a sub-folder) is touched, and nothing is removed through a symbolic link (checked
    first: :func:`check_image_folder`).

    Raises:
        OutputError: The image folder, or an entry the tool would remove, is a link.
    """
    folder = check_image_folder(out_dir, key)
    if not folder.is_dir():
        return
    remove_regular_file(folder / RESULT_NAME)
    fsync_folder(folder)
    for name in recorded_files(folder):
        remove_regular_file(folder / name)
    fsync_folder(folder)
    _write_manifest(folder, [])


@dataclass
class SweepOutcome:
    """What :func:`run_sweep` did.

    Attributes:
        results: Every image's result in input order (main process only; empty elsewhere).
        computed: Keys this process computed.
        reused: Keys found finished on disk (same for every process).
        rejected: ``{key: why}`` for the result files found on disk but not reused (see
            :func:`result_problem`); those images were computed again.
    """

    results: list[dict]
    computed: list[str]
    reused: list[str]
    rejected: dict[str, str] = field(default_factory=dict)


def run_sweep(
    keys: Sequence[str],
    work: Callable[[str], tuple[dict, list[dict]]],
    *,
    out_dir: Path,
    expected_fingerprint: str,
    state: Any | None = None,
    progress: bool = True,
    image_hashes: dict[str, str] | None = None,
    before_changes: Callable[[], None] | None = None,
    validate: Callable[[dict, str, str], None] | None = None,
) -> SweepOutcome:
    """Compute every unfinished image, sharded across processes, and collect all results.

    Args:
        keys: Image keys in input order (unique).
        work: ``work(key) -> (image_info, records)`` computes one image (and writes its
            other outputs, e.g. the generated image, itself, with :func:`nw_adapter.atomic.atomic_write`
            into :func:`image_dir`, so that they are recorded in the folder's manifest).
        out_dir: Output folder.
        expected_fingerprint: Fingerprint of the options (see :func:`fingerprint`).
        state: ``PartialState`` or :class:`SingleProcessState` (default: single process).
        progress: Show a progress bar over this process's images.
        image_hashes: ``{key: sha256}`` of the reference images; a result of another file
            under the same key is not reused.
        before_changes: Called once on the main process before any image is (re)computed
            (not at all when every image is reused): the command line removes the merged
            report of the previous run there, so it never describes files of another run.
        validate: ``validate(result, key, source)`` raises ``ValueError`` for a malformed result
            file (the command line checks every record); such an image is computed again.

    Returns:
        A :class:`SweepOutcome`; ``results`` is filled on the main process only.

    Raises:
        OutputError: A symbolic link (or a folder where a file goes) where the sweep reads, writes
            or removes (:func:`check_image_folder`), before anything is read.
    """
    state = state or SingleProcessState()
    out_dir = Path(out_dir)
    hashes = image_hashes or {}
    for key in keys:  # nothing is read through a link
        check_image_folder(out_dir, key)
    reused: list[str] = []
    rejected: dict[str, str] = {}
    for key in keys:
        found, why = result_problem(out_dir, key, expected_fingerprint, hashes.get(key), validate)
        if found is not None:
            reused.append(key)
        elif why is not None:
            rejected[key] = why
    todo = [k for k in keys if k not in set(reused)]
    if todo and before_changes is not None and state.is_main_process:
        before_changes()
    # Every process must see the same "todo" list before anyone writes a result file.
    state.wait_for_everyone()
    computed: list[str] = []
    with state.split_between_processes(todo) as mine:
        bar = None
        if progress and len(todo) > 1:
            from tqdm.auto import tqdm

            bar = tqdm(
                total=len(mine), desc=f"images (process {state.process_index})", unit="image", disable=None
            )
        for key in mine:
            clear_image_outputs(out_dir, key)
            folder = image_dir(out_dir, key)
            with journal_writes(folder, lambda name, folder=folder: record_written(folder, name)):
                image, records = work(key)
            save_result(out_dir, key, expected_fingerprint, image, records)
            computed.append(key)
            if bar is not None:
                bar.update(1)
        if bar is not None:
            bar.close()
    state.wait_for_everyone()
    results: list[dict] = []
    if state.is_main_process:
        for key in keys:
            result, why = result_problem(out_dir, key, expected_fingerprint, hashes.get(key), validate)
            if result is None:
                raise RuntimeError(
                    f"sweep: result of image {key} is not usable after all processes finished ({why})"
                )
            results.append(result)
    return SweepOutcome(results=results, computed=computed, reused=reused, rejected=rejected)
