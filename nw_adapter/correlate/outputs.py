"""The output folder of ``correlate.py``: checks, lock, report files, figures, redrawing.

- :func:`check_output_dir` probes, before any work, that ``--out`` and the folders that will be
  written there can be written (a dangling link, a file in the way, a read-only ``images/``), that
  no entry the run reads, writes or removes inside ``--out`` is a symbolic link or a folder where a
  file goes (:func:`check_entry`, :func:`check_image_folder`: nothing outside ``--out`` is ever
  read as this tool's, written or deleted), and that the folder holds no files of the other kind of
  run (a rho run and a ``--compare-swap`` run never share a folder, :func:`check_run_kind`);
- :class:`OutputLock` keeps two runs off one ``--out``;
- :func:`write_outputs` writes ``rho.json``, ``rho.csv``, ``rho.png``, ``bandwidth.png`` and ``report.html``
  of a report;
- :func:`draw_image_maps` draws one image's ``attention_maps.png`` from its saved files;
- :func:`replot` redraws everything of a finished run without loading a model;
- :func:`remove_interrupted_writes` removes what a killed run's atomic writes left behind (every run
  kind's).

Every problem is an :class:`OutputError` whose message is one line naming the fix.
"""

from __future__ import annotations

import errno
import os
import re
import tempfile
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

from nw_adapter.atomic import remove_regular_file
from nw_adapter.correlate.out_paths import OutputError as OutputError  # re-exported
from nw_adapter.correlate.out_paths import check_entry as check_entry  # re-exported
from nw_adapter.correlate.report import PAPER_TIMESTEPS
from nw_adapter.correlate.spec import SHIPPED_WEIGHTS
from nw_adapter.correlate.sweep import MANIFEST_NAME, check_image_folder, image_dir

PROBE_PREFIX = ".nw-adapter-write-check-"


def _probe_write(folder: Path, out: Path) -> None:
    """Create and remove a temporary file in ``folder``; OutputError naming it if that fails."""
    try:
        handle, name = tempfile.mkstemp(prefix=PROBE_PREFIX, dir=folder)
        os.close(handle)
        os.unlink(name)
    except OSError as exc:
        reason = exc.strerror or type(exc).__name__
        raise OutputError(
            f"--out '{out}': cannot write in '{folder}' ({reason}); pass a writable folder"
        ) from None


RHO_RUN = "rho"
SWAP_RUN = "compare-swap"
SUPPORT_RUN = "support-sets"

_KINDS = {RHO_RUN: ("a rho run's", "a rho run"), SWAP_RUN: ("a --compare-swap run's", "--compare-swap"),
          SUPPORT_RUN: ("a support-set run's", "a support-set run")}  # fmt: skip


def _swap_files() -> tuple[str, ...]:
    from nw_adapter.correlate.swap_files import SWAP_FILES

    return SWAP_FILES


def _support_files() -> tuple[str, ...]:
    from nw_adapter.correlate.support_report import SUPPORT_FILES

    return SUPPORT_FILES


def run_files(out: Path, run: str) -> list[str]:
    """The entries of a ``run`` (:data:`RHO_RUN`, :data:`SWAP_RUN`, :data:`SUPPORT_RUN`) present in ``out``.

    A rho run's are :data:`REPORT_FILES` and ``images/``; a ``--compare-swap`` run's
    ``compare_swap.json`` and ``compare_swap.csv``; a support-set run's ``support.json``,
    ``support.csv``, ``support_mass.png`` and ``sets/``.
    """
    names = {
        RHO_RUN: [*REPORT_FILES, "images"],
        SWAP_RUN: list(_swap_files()),
        SUPPORT_RUN: list(_support_files()),
    }
    folders = ("images", "sets")
    return [
        f"{name}/" if name in folders else name for name in names[run] if os.path.lexists(Path(out) / name)
    ]


def check_run_kind(out: Path, run: str) -> None:
    """Refuse a ``--out`` that holds files of another kind of run (rho, ``--compare-swap``, support sets).

    The runs write different files but share the lock and the folder's cleaning; kept in separate
    folders, none leaves files beside another's nor removes them.

    Raises:
        OutputError: One line naming the other run's files and the fix.
    """
    for other in _KINDS:
        found = run_files(out, other) if other != run else []
        if found:
            raise OutputError(
                f"--out '{out}' holds {_KINDS[other][0]} files ({', '.join(found)}); {_KINDS[run][1]} does "
                "not share a folder with it: pass another --out (or remove those files)"
            )


def _is_link_loop(path: Path) -> bool:
    """Whether resolving ``path`` runs into a symbolic link loop."""
    try:
        os.stat(path)
    except OSError as exc:
        return exc.errno == errno.ELOOP
    return False


def check_output_dir(out: Path, keys: Sequence[str] = (), *, run: str = RHO_RUN) -> Path:
    """Check, without leaving anything behind, that ``out`` and what goes in it can be written.

    Probes ``out`` (or its first existing parent) and, where they already exist, ``out/images``
    and the folders ``out/images/<key>`` of the given image keys; checks every entry the run
    touches with :func:`check_entry` / :func:`check_image_folder` and the run kind with
    :func:`check_run_kind`.

    Args:
        out: The ``--out`` folder.
        keys: The reference images' keys (a rho run) or the support sets' (a support-set run).
        run: :data:`RHO_RUN`, :data:`SWAP_RUN` or :data:`SUPPORT_RUN`.

    Raises:
        OutputError: ``out`` is a file, a dangling symbolic link, sits under a file; an entry
            inside it is a link or a folder where a file goes; it holds the other run kind's files;
            or a folder that will be written is not writable.
    """
    out = out.expanduser()
    if out.is_symlink() and _is_link_loop(out):
        raise OutputError(
            f"--out '{out}': a symbolic link loop (it leads back to itself through '{os.readlink(out)}'); "
            "pass a folder path"
        )
    if out.is_symlink() and not out.exists():
        raise OutputError(
            f"--out '{out}': dangling symbolic link (its target '{os.readlink(out)}' does not exist); "
            "create the target folder or pass another path"
        )
    if out.exists() and not out.is_dir():
        raise OutputError(f"--out '{out}': exists and is not a folder; pass a folder path")
    probe = out
    while not probe.exists():
        if probe.parent == probe:
            break
        probe = probe.parent
    if not probe.is_dir():
        raise OutputError(
            f"--out '{out}': '{probe}' is a file, so the folder cannot be created; pass another path"
        )
    _probe_write(probe, out)
    if not out.is_dir():
        return out
    for name in (
        *REPORT_FILES,
        *_swap_files(),
        *(name for name in _support_files() if name != "sets"),
        REPORT_HTML,
        LOCK_NAME,
    ):
        check_entry(out, name)
    check_run_kind(out, run)
    if run == SUPPORT_RUN:
        sets = check_entry(out, "sets", folder=True)
        folders = [check_entry(out, Path("sets") / key, folder=True) for key in keys]
        for key in keys:
            for name in SET_FILES:
                check_entry(out, Path("sets") / key / name)
    else:
        sets = check_entry(out, "images", folder=True)
        folders = (
            [check_image_folder(out, key, is_own=is_image_output) for key in keys] if run == RHO_RUN else []
        )
    for folder in (sets, *folders):
        if folder.is_dir():
            _probe_write(folder, out)
    return out


SET_FILES: tuple[str, ...] = ("generated.png", "mass.png")
"""The files a support-set run writes in ``sets/<key>/``."""


def _relation(out: str, folder: str) -> str | None:
    """How the real path ``out`` lies to the real path ``folder``: ``is``, ``is inside``, ``contains``."""
    if out == folder:
        return "is"
    if out.startswith(folder.rstrip(os.sep) + os.sep):
        return "is inside"
    if folder.startswith(out.rstrip(os.sep) + os.sep):
        return "contains"
    return None


def check_apart(
    out: Path,
    *,
    files: Iterable[str | Path] = (),
    folders: Iterable[str | Path] = (),
    option: str = "--image",
) -> None:
    """Refuse an ``--out`` that is, lies inside or contains an input folder, or contains an input file.

    A run never reads its own outputs as inputs: with ``--image-dir D --out D`` a second run would
    take the first one's figures as references (and remove them as another run's report); with
    ``--out`` inside a ``--support-dir`` set folder, the run's figures would join that set. Paths
    are compared after resolving links (``os.path.realpath``), before anything is read or written.

    Args:
        out: The ``--out`` folder.
        files: The input files (``--image``, the ``--support-set`` files).
        folders: The input folders (``--image-dir``, ``--support-dir``).
        option: The option of the files; the folders' is ``option`` with ``-dir`` (``--image-dir``),
            or ``--support-dir`` for ``--support-set``.

    Raises:
        OutputError: One line naming the input and the fix.
    """
    where = os.path.realpath(Path(out).expanduser())
    folder_option = "--support-dir" if option == "--support-set" else f"{option}-dir"
    for folder in folders:
        relation = _relation(where, os.path.realpath(Path(folder).expanduser()))
        if relation is not None:
            raise OutputError(
                f"--out '{out}' {relation} the {folder_option} folder '{folder}'; a run never reads its own "
                "outputs as inputs: pass an --out apart from the inputs"
            )
    for file in files:
        if _relation(os.path.realpath(Path(file).expanduser()), where) == "is inside":
            raise OutputError(
                f"--out '{out}' contains the {option} file '{file}'; a run never reads its own outputs as "
                "inputs: pass an --out apart from the inputs (or move the file out of it)"
            )


def check_apart_from_models(out: Path, args: Any) -> None:
    """Refuse an ``--out`` that is or lies inside a model's folder: a local ``--model``,
    ``--ip-adapter`` or ``--image-encoder`` folder, or the package's shipped weights.

    A run's report, figures and ``images/`` would be written among the model's files (with
    ``--model tiny --out nw_adapter/models/weights/tiny_digits``, into the installed package).

    Raises:
        OutputError: One line naming the folder and the fix.
    """
    where = os.path.realpath(Path(out).expanduser())
    folders: list[tuple[str, Path]] = [("the package's shipped model weights", SHIPPED_WEIGHTS)]
    for option in ("--model", "--ip-adapter", "--image-encoder"):
        value = getattr(args, option[2:].replace("-", "_"), None)
        if value and Path(value).expanduser().is_dir():
            folders.append((f"the {option} folder", Path(value).expanduser()))
    for what, folder in folders:
        relation = _relation(where, os.path.realpath(folder))
        if relation in ("is", "is inside"):
            raise OutputError(
                f"--out '{out}' {relation} {what} '{folder}'; a run never writes among a model's files: pass "
                "an --out outside it"
            )


LOCK_NAME = ".nw-adapter.lock"


class OutputLock:
    """An exclusive lock on ``--out`` (``<out>/.nw-adapter.lock``), so two runs never interleave.

    Uses ``fcntl.flock`` (released by the system when the process ends, also on SIGKILL); the
    lock file itself is left in place, unless the block fails and the lock created it (then it
    and the folders created for it are removed, when empty). Where ``fcntl`` does not exist
    (Windows) it does nothing.
    """

    def __init__(self, out: Path, *, option: str = "--out") -> None:
        self.path = Path(out) / LOCK_NAME
        self.option = option
        self._handle: Any = None
        self._created: list[Path] = []  # what taking the lock created: removed again after a failure

    def __enter__(self) -> OutputLock:
        try:
            import fcntl
        except ImportError:
            return self
        check_entry(self.path.parent, LOCK_NAME, option=self.option)  # never a link's target
        missing = [folder for folder in (self.path.parent, *self.path.parent.parents) if not folder.exists()]
        created = [*([] if os.path.lexists(self.path) else [self.path]), *missing]
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            flags = os.O_RDWR | os.O_CREAT | getattr(os, "O_NOFOLLOW", 0)
            handle = os.fdopen(os.open(self.path, flags, 0o666), "r+")
        except OSError as exc:
            raise OutputError(
                f"--out '{self.path.parent}': cannot create the lock file ({exc.strerror or exc}); "
                "pass a writable folder"
            ) from None
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            handle.close()
            raise OutputError(
                f"--out '{self.path.parent}': another correlate.py run is writing there (lock {self.path}); "
                "wait for it to finish or pass another --out"
            ) from None
        except OSError:  # a file system without locks (e.g. some network mounts): run unlocked
            handle.close()
            return self
        self._handle = handle
        self._created = created
        return self

    def __exit__(self, kind: type[BaseException] | None, *_: object) -> None:
        """Release the lock; after a failure, also remove the lock file and the folders it created,
        so bad input found after the lock (a model that does not load) leaves nothing behind."""
        if self._handle is None:
            return
        if kind is not None:
            for path in self._created:  # the lock file first, then the folders, innermost first
                try:
                    path.rmdir() if path != self.path else path.unlink()
                except OSError:
                    break  # a folder that holds something now: kept, and the ones above it
        self._handle.close()
        self._handle = None


def draw_image_maps(folder: Path, records: Sequence[dict]) -> Path:
    """Draw ``attention_maps.png`` of one image folder from its saved files (no recomputation).

    Reads ``maps.safetensors``, ``generated.png`` and the ``x0_step<s>.png`` previews; the
    timesteps and whether the batch was ``[uncond; cond]`` come from the image's records.
    """
    from PIL import Image

    from nw_adapter.correlate.maps import load_maps
    from nw_adapter.correlate.plotting import panels_from_maps, plot_attention_maps

    with Image.open(folder / "generated.png") as handle:
        generated = handle.convert("RGB")
    previews = {}
    for path in folder.glob("x0_step*.png"):
        with Image.open(path) as handle:
            previews[int(path.stem.removeprefix("x0_step"))] = handle.convert("RGB")
    panels = panels_from_maps(
        load_maps(folder / "maps.safetensors"),
        timesteps={r["step"]: r["timestep"] for r in records},
        image_hw=(generated.height, generated.width),
        cfg=any(r.get("half") in ("cond", "uncond") for r in records),
    )
    reference = next((r["reference"] for r in records if r.get("reference")), folder.name)
    return plot_attention_maps(
        generated, panels, folder / "attention_maps.png", previews=previews, reference=reference
    )


def check_image_result_file(result: dict, key: str, source: str) -> None:
    """Every record and the image entry of a sweep's ``result.json`` (``run_sweep``'s ``validate``).

    Raises:
        ValueError: One line naming the file, the record and the field
            (:func:`nw_adapter.analysis.validation.check_image_result`).
    """
    from nw_adapter.analysis.validation import check_image_result
    from nw_adapter.correlate.sweep import RESULT_SCHEMA

    check_image_result(result, source=source, schema=RESULT_SCHEMA, key=key)


def skipped_note(recorder: Any, mode: str, name: str) -> str | None:
    """One line on the (step, layer) pairs whose statistics were not recorded, or None.

    Says what those layers returned: diffusers' own output in observe mode; in swap mode the NW
    head's (at ``bandwidth="schedule"``'s s = 1, its limit h = inf: the mean of the values).
    """
    skipped = recorder.skipped()
    if not skipped["count"]:
        return None
    reasons = "; ".join(f"{reason} ({count}x)" for reason, count in skipped["by_reason"].items())
    output = "kept diffusers' output" if mode == "observe" else "still returned the NW head's output (swap)"
    return (
        f"{name}: statistics of {skipped['count']} (step, layer) pair(s) were not recorded: {reasons}; "
        f"those layers {output}"
    )


REPORT_FILES: tuple[str, ...] = ("rho.json", "rho.csv", "rho.png", "bandwidth.png")
"""The merged report's files in ``--out``."""

REPORT_HTML = "report.html"
"""The interactive report every run kind writes in ``--out`` (:mod:`nw_adapter.correlate.html_report`)."""


IMAGE_OUTPUT = re.compile(
    r"^(result\.json|generated\.png|maps\.safetensors|attention_maps\.png|rho_joint\.csv|x0_step\d+\.png)$"
)
"""Names of the files the command line writes in ``images/<key>/``."""


def is_image_output(name: str) -> bool:
    """Whether ``name`` is one of :data:`IMAGE_OUTPUT`'s."""
    return bool(IMAGE_OUTPUT.match(name))


_PROBE = re.compile(rf"^{re.escape(PROBE_PREFIX)}[a-z0-9_]{{8}}$")


def remove_interrupted_writes(out_dir: Path, keys: Iterable[str] = (), *, run: str = RHO_RUN) -> list[Path]:
    """Remove the temporary files a killed run of kind ``run`` left in ``out_dir`` and its folders.

    Only the project's own: temporary files of atomic writes (``.rho.<8 characters>.tmp.json``,
    see :func:`nw_adapter.atomic.temporary_target`) whose destination is one of the run's file names
    there, and write-check probes (``.nw-adapter-write-check-<8 characters>``); never in a folder
    reached through a symbolic link. Per run (:data:`RHO_RUN`, :data:`SWAP_RUN`, :data:`SUPPORT_RUN`):

    - a rho run: :data:`REPORT_FILES` and ``report.html`` in ``out_dir``; :data:`IMAGE_OUTPUT` and
      the manifest in ``images/<key>`` of the given ``keys``;
    - ``--compare-swap``: ``compare_swap.json``, ``compare_swap.csv`` and ``report.html``;
    - support sets: ``support.json``, ``support.csv``, ``support_mass.png`` and ``report.html``;
      :data:`SET_FILES` in every folder of ``sets/`` (a run removes every earlier set's files).

    Call it under the output lock, before anything is written.

    Returns:
        The removed files.
    """
    from nw_adapter import atomic

    out_dir = Path(out_dir)
    if run == SUPPORT_RUN:
        names = {*(name for name in _support_files() if name != "sets"), REPORT_HTML}
        container = out_dir / "sets"
        listed = [] if container.is_symlink() or not container.is_dir() else sorted(container.iterdir())
        folders = [folder for folder in listed if folder.is_dir()]
        is_folder_own = SET_FILES.__contains__
    elif run == SWAP_RUN:
        names, container, folders = {*_swap_files(), REPORT_HTML}, None, []
        is_folder_own = None
    else:
        names, container = {*REPORT_FILES, REPORT_HTML}, out_dir / "images"
        folders = [] if container.is_symlink() else [image_dir(out_dir, key) for key in keys]

        def is_folder_own(name: str) -> bool:
            return is_image_output(name) or name == MANIFEST_NAME

    folders = [folder for folder in folders if not folder.is_symlink()]  # never through a link
    removed = atomic.remove_interrupted_writes(out_dir, names.__contains__)
    for folder in folders:
        removed += atomic.remove_interrupted_writes(folder, is_folder_own)
    containers = [] if container is None or container.is_symlink() else [container]
    for folder in (out_dir, *containers, *folders):
        if folder.is_dir():
            for path in folder.iterdir():
                if _PROBE.match(path.name) and path.is_file() and not path.is_symlink():
                    path.unlink(missing_ok=True)
                    removed.append(path)
    return removed


def remove_report(out_dir: Path) -> None:
    """Remove the merged report of a previous run (before any of its images changes)."""
    for name in (*REPORT_FILES, REPORT_HTML):
        remove_regular_file(Path(out_dir) / name)


def write_outputs(report: dict, out_dir: Path, *, detail: bool = True) -> str:
    """Write ``rho.json``, ``rho.csv``, ``rho.png``, ``bandwidth.png`` and ``report.html`` of a report; return
    what to print (:func:`~nw_adapter.correlate.report.format_report`: everything with ``detail``, else
    the one-screen text that ends in where the details are).

    ``bandwidth.png`` needs the fitted bandwidths (``h_eff``) in the records; without them it is not
    drawn (and an older one in ``out_dir`` is removed, so it never describes another run).
    """
    from nw_adapter.correlate.html_report import write_rho_report
    from nw_adapter.correlate.plotting import plot_bandwidth, plot_report_rho
    from nw_adapter.correlate.report import format_report, write_report_files

    config = report.get("config", {})
    model = (config.get("model") or {}).get("model")
    write_report_files(report, out_dir)
    plot_report_rho(report, out_dir / "rho.png")
    write_rho_report(report, out_dir)  # report.html
    drawn = plot_bandwidth(
        report["records"],
        report["half"],
        out_dir / "bandwidth.png",
        title=f"{model}: bandwidth path (logit_scale vs schedule h), {report['half']} half",
    )
    if drawn is None:
        remove_regular_file(out_dir / "bandwidth.png")
    return format_report(report, detail=detail, out_dir=out_dir)


def replot(out: Path, *, all_steps: bool = False, detail: bool = True) -> str:
    """Redraw ``rho.json``/``rho.csv``/``rho.png`` and every ``attention_maps.png`` of a finished run.

    Nothing is recomputed: the report is rebuilt from the saved records (table rows chosen
    again, so ``--all-steps`` may differ from the original run), the figures from the saved
    maps, images and x0 previews.

    Returns:
        The text the run printed (context line, table, verdict; with ``detail``, as ``-v`` printed it).

    Raises:
        OutputError: No readable ``rho.json`` of this tool in ``out``, or a malformed one (the
            message names the record and field; see :func:`nw_adapter.analysis.validation.check_report`).
    """
    import json

    from nw_adapter.analysis.validation import RecordError, check_report
    from nw_adapter.correlate.report import build_report

    out = out.expanduser()
    for name in (*REPORT_FILES, REPORT_HTML, LOCK_NAME):  # read and rewritten: none may be a link or a folder
        check_entry(out, name, option="--replot")
    path = out / "rho.json"
    try:
        saved = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise OutputError(
            f"--replot '{out}': no rho.json there; pass the --out folder of a finished run"
        ) from None
    except (OSError, ValueError) as exc:
        reason = getattr(exc, "strerror", None) or " ".join(str(exc).split())
        raise OutputError(
            f"--replot '{out}': cannot read rho.json ({reason}); rerun the original command"
        ) from None
    try:  # every record and image entry, before anything is drawn
        check_report(saved, source=f"--replot '{out}': rho.json", fix="rerun the original command")
    except RecordError as exc:
        raise OutputError(str(exc)) from None
    _check_one_run(saved["records"], out)
    report = build_report(
        saved["records"],
        config=saved.get("config", {}),
        images=saved.get("images", []),
        targets=() if all_steps else PAPER_TIMESTEPS,
        versions=saved.get("versions"),
        control=saved.get("control"),  # the saved meta (an end-to-end control's included)
    )
    keys = [image["key"] for image in report["images"]]
    for key in keys:
        check_image_folder(out, key, option="--replot", is_own=is_image_output)
    with OutputLock(out, option="--replot"):
        remove_interrupted_writes(out, keys)
        text = write_outputs(report, out, detail=detail)
        for image in report["images"]:
            if image.get("maps"):
                records = [r for r in report["records"] if r.get("reference") == image["key"]]
                folder = check_entry(out, Path(image["maps"]).parent, folder=True, option="--replot")
                try:
                    draw_image_maps(folder, records)
                except (OSError, ValueError) as exc:
                    reason = getattr(exc, "strerror", None) or " ".join(str(exc).split())
                    raise OutputError(
                        f"--replot '{out}': cannot redraw {folder / 'attention_maps.png'} ({reason}); "
                        "rerun the original command to recompute that image"
                    ) from None
    return text


def _check_one_run(records: Sequence[dict], out: Path) -> None:
    """Refuse records of several models or runs in one ``rho.json`` (a report is of one run).

    Each record names its ``model`` (the resolved pipeline) and its ``run`` (the first 12 hex
    digits of the run's fingerprint): one run writes one of each.

    Raises:
        OutputError: One line naming the two values and the fix.
    """
    for field, what in (("model", "models"), ("run", "runs")):
        seen = list(dict.fromkeys(str(r[field]) for r in records if r.get(field) is not None))
        if len(seen) > 1:
            raise OutputError(
                f"--replot '{out}': rho.json mixes the records of {len(seen)} {what} ({field} '{seen[0]}' "
                f"and '{seen[1]}'); a report is of one run: rerun the original commands into separate --out "
                "folders"
            )


def run(args: Any) -> int:
    """``--replot OUT``: redraw a finished run and print its report (the run table's replot row)."""
    print(replot(Path(args.replot), all_steps=args.all_steps, detail=args.verbose))
    return 0
