"""Sweeps over many reference images: sharding across processes, resuming, merging.

Every reference image has its own result file ``<out>/images/<key>/result.json``, written
atomically when the image is finished, and tagged with a fingerprint of every option that
changes the numbers (model included) and with the SHA-256 of every other file in the image's
folder, and with the SHA-256 of its own content (``digest``). A rerun of the same command skips
an image only when its result file is a JSON object whose content still has its digest, with the
same fingerprint, the same reference-image hash, records that pass the caller's check, and files
whose hashes match the record, so an interrupted sweep resumes where it stopped and never mixes
two runs, and a hand-edited or bit-rotted result file is recomputed, not reused (the reason is
returned in :attr:`SweepOutcome.rejected`).

A changed option set on an existing ``--out`` recomputes every image cleanly: before the first
image changes, the merged report of the previous run is removed (``before_changes``); before an
image is computed, its old result file is removed first (so it no longer counts as finished)
and then every other file in its folder (e.g. maps of an earlier ``--store-maps`` run).

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
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from nw_adapter.atomic import fsync_folder
from nw_adapter.correlate.report import json_ready, write_json

RESULT_SCHEMA = "nw-adapter/rho-image"
RESULT_NAME = "result.json"


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


def folder_hashes(folder: Path) -> dict[str, str]:
    """``{name: sha256}`` of the regular files in ``folder`` except the result file and hidden files."""
    if not folder.is_dir():
        return {}
    return {
        p.name: file_sha256(p)
        for p in sorted(folder.iterdir())
        if p.is_file() and p.name != RESULT_NAME and not p.name.startswith(".")
    }


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

    The SHA-256 of every other file in the image's folder is recorded under ``files``, and the
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
    """Invalidate an image before it is (re)computed: remove its result file, then its other files.

    The result file goes first, so an interruption in between leaves an unfinished image, never
    a finished-looking one beside files of another run. Sub-folders are left alone.
    """
    folder = image_dir(out_dir, key)
    result_path(out_dir, key).unlink(missing_ok=True)
    if folder.is_dir():
        fsync_folder(folder)
        for path in folder.iterdir():
            if path.is_file() or path.is_symlink():
                path.unlink(missing_ok=True)


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
            other outputs, e.g. the generated image, itself).
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
    """
    state = state or SingleProcessState()
    out_dir = Path(out_dir)
    hashes = image_hashes or {}
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
