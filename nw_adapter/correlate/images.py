"""Validated loading of reference images for the command line.

Every reference image goes through :func:`load_reference_image` before any model is built,
so a bad file is reported at once, in one line that names the file, the problem and the fix,
and nothing is written. What a diffusion pipeline cannot take is an error; what it can take
after a well-defined conversion is converted to 8-bit RGB with a note:

==========================  ===========================================================
input                       outcome
==========================  ===========================================================
missing path, directory     error (a dangling link or a link loop is named as such)
zero-byte file              error
not an image / unreadable   error (Pillow cannot identify it)
truncated PNG / JPEG        error (decoding fails; truncated images are never padded)
animated GIF / APNG / WebP  error (more than one frame; export the frame you mean)
decompression bomb          error (more pixels than ``PIL.Image.MAX_IMAGE_PIXELS``, at
                            Pillow's warning level already; the one limit is stated)
extreme aspect ratio        error (over 64:1: the encoder's resize to a 224-pixel short
                            side would make more than 224 * 224 * 64 pixels)
float (mode ``F``)          error (no well-defined 8-bit scale)
32-bit integer (mode ``I``)  values in 0..255 kept; in 0..65535 treated as 16-bit; negative
                            or larger values: error (no well-defined 8-bit scale)
16-bit grayscale            converted: ``round(v / 257)`` to 8 bits, then gray -> RGB
16-bit RGB PNG              converted by Pillow on load (high byte), note
CMYK                        converted with Pillow's CMYK -> RGB (no ICC profile), note
palette (``P``)             converted to RGB (over white if it has transparency), note
RGBA / LA / PA              alpha composited over a white background, note
grayscale / bilevel         replicated to RGB, note
EXIF orientation 2-8        applied (the image is shown upright), note
EXIF orientation invalid    ignored, with a note saying so
==========================  ===========================================================
"""

from __future__ import annotations

import errno
import hashlib
import os
import re
import warnings
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path

from PIL import Image, ImageFile, ImageOps, UnidentifiedImageError

from nw_adapter.integration.rgb import to_rgb

IMAGE_SUFFIXES: tuple[str, ...] = (".png", ".jpg", ".jpeg", ".webp", ".bmp", ".gif", ".tif", ".tiff")
"""File name endings (case-insensitive) that ``--image-dir`` picks up."""

ENCODER_SHORTEST_EDGE = 224
"""Shorter side, in pixels, after the CLIP image processor's resize (IP-Adapter's encoders)."""

MAX_ASPECT_RATIO = 64
"""Longest accepted side / shortest side: the encoder's resize makes 224 x (224 * ratio) pixels."""

MAX_ENCODER_PIXELS = ENCODER_SHORTEST_EDGE * ENCODER_SHORTEST_EDGE * MAX_ASPECT_RATIO
"""Pixels the encoder's resize may produce (about 3.2 million: 38 MB as float32 RGB)."""


class ImageInputError(ValueError):
    """A reference image that cannot be used; the message is one line with the fix."""


class NoImagesError(ImageInputError):
    """A folder holding no image file (``--support-dir`` skips such a subfolder: it is no set)."""


@dataclass(frozen=True)
class ReferenceImage:
    """A validated reference image.

    Attributes:
        path: The file, as given (resolved to an absolute path).
        key: Stable identifier ``<stem>-<first 10 hex of sha256>``, used for per-image
            output folders and for resuming a sweep.
        sha256: SHA-256 of the file's bytes.
        mode: Pillow mode of the file before conversion (``"RGB"``, ``"I;16"``, ...).
        size: ``(width, height)`` in pixels.
        notes: One line per conversion applied (empty for a plain 8-bit RGB file), and one per
            file of the same content merged into this one (:attr:`duplicates`).
        duplicates: Further files given with the same content, in input order: the same
            reference under other names or in another file format, counted once
            (:func:`validate_images`).
        pixels: SHA-256 of the 8-bit RGB pixels the pipeline receives
            (:func:`nw_adapter.correlate.digit_sets.pixel_digest`): equal for a PNG and a BMP of
            the same picture. Not recorded (:meth:`to_dict`).
    """

    path: Path
    key: str
    sha256: str
    mode: str
    size: tuple[int, int]
    notes: tuple[str, ...] = field(default_factory=tuple)
    duplicates: tuple[Path, ...] = field(default_factory=tuple)
    pixels: str = ""

    def to_dict(self) -> dict:
        """JSON-ready description (used in ``rho.json``'s ``images`` list); ``duplicates`` (the
        number of files of the same content merged into this one) only when there are some."""
        entry = {
            "key": self.key,
            "path": str(self.path),
            "sha256": self.sha256,
            "mode": self.mode,
            "width": self.size[0],
            "height": self.size[1],
            "notes": list(self.notes),
        }
        if self.duplicates:
            entry["duplicates"] = len(self.duplicates)
        return entry


def _one_line(text: object) -> str:
    """Collapse an exception text to a single line."""
    return " ".join(str(text).split())


def _check_file(path: Path, label: str) -> None:
    try:
        os.stat(path)
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise ImageInputError(
                f"{label} '{path}': symbolic link loop (the link points back to itself); fix the link"
            ) from None
        if path.is_symlink():
            raise ImageInputError(
                f"{label} '{path}': dangling symbolic link (its target '{os.readlink(path)}' does not "
                "exist); fix the link or pass the file itself"
            ) from None
        raise ImageInputError(f"{label} '{path}': file not found; check the path") from None
    if path.is_dir():
        raise ImageInputError(
            f"{label} '{path}': is a directory, not an image; pass folders with --image-dir"
        )
    if not path.is_file():
        raise ImageInputError(f"{label} '{path}': is not a regular file; pass a PNG or JPEG file")
    if path.stat().st_size == 0:
        raise ImageInputError(f"{label} '{path}': file is empty (0 bytes); pass a real PNG or JPEG file")


def _png_bit_depth(path: Path) -> int | None:
    """Bit depth byte of a PNG's IHDR chunk, or None for other files."""
    with path.open("rb") as handle:
        head = handle.read(26)
    if len(head) == 26 and head[:8] == b"\x89PNG\r\n\x1a\n" and head[12:16] == b"IHDR":
        return head[24]
    return None


def _decode(path: Path, label: str) -> tuple[Image.Image, str, tuple[int, int], list[str]]:
    """Open and fully decode one file; map every Pillow failure to :class:`ImageInputError`."""
    if ImageFile.LOAD_TRUNCATED_IMAGES:
        raise ImageInputError(
            "PIL.ImageFile.LOAD_TRUNCATED_IMAGES is True in this process; set it back to False so "
            "truncated images are reported instead of padded"
        )
    limit = Image.MAX_IMAGE_PIXELS
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error", Image.DecompressionBombWarning)
            with Image.open(path) as img:
                frames = int(getattr(img, "n_frames", 1) or 1)
                if frames > 1:
                    raise ImageInputError(
                        f"{label} '{path}': animated image with {frames} frames; "
                        "export the one frame you mean as a PNG"
                    )
                img.load()
                mode = img.mode
                size = img.size
                notes: list[str] = []
                orientation = _orientation(img)
                if orientation in range(2, 9):
                    decoded = ImageOps.exif_transpose(img)
                    notes.append(f"EXIF orientation {orientation} applied (the image is shown upright)")
                else:
                    decoded = img.copy()
                    if orientation not in (None, 1):
                        notes.append(f"EXIF orientation {orientation!r} is not a valid value (1-8); ignored")
    except ImageInputError:
        raise
    except (Image.DecompressionBombError, Image.DecompressionBombWarning) as exc:
        raise ImageInputError(
            f"{label} '{path}': refused as a possible decompression bomb ({_bomb_size(exc)}more than the "
            f"limit of {limit} pixels, PIL.Image.MAX_IMAGE_PIXELS); downscale it below that limit"
        ) from None
    except UnidentifiedImageError:
        raise ImageInputError(
            f"{label} '{path}': not an image Pillow can read; pass a PNG or JPEG file"
        ) from None
    except PermissionError:
        raise ImageInputError(f"{label} '{path}': permission denied; make the file readable") from None
    except (OSError, SyntaxError, ValueError, EOFError) as exc:
        raise ImageInputError(
            f"{label} '{path}': truncated or corrupt image ({_one_line(exc)}); re-export or re-download it"
        ) from None
    _check_encoder_size(path, label, decoded.size)
    if mode == "RGB" and _png_bit_depth(path) == 16:
        notes.append("16-bit RGB reduced to 8 bits per channel")
    return decoded, mode, size, notes


def _bomb_size(error: BaseException) -> str:
    """``"<n> pixels, "`` from Pillow's decompression-bomb text, or ``""`` when it names no size.

    Pillow's text also quotes its own limit, which is twice ``MAX_IMAGE_PIXELS`` at its error
    level: only the image's size is taken from it, so the message states one limit.
    """
    found = re.search(r"\((\d+) pixels\)", str(error))
    return f"{found.group(1)} pixels, " if found else ""


def encoder_resized_size(
    size: tuple[int, int], shortest_edge: int = ENCODER_SHORTEST_EDGE
) -> tuple[int, int]:
    """``(width, height)`` after the image encoder's resize (shortest side to ``shortest_edge``).

    CLIP's image processor (IP-Adapter's encoder) scales the shorter side to 224 pixels and keeps
    the aspect ratio before its centre crop, so a long thin image becomes very large there.
    """
    width, height = size
    short = max(1, min(width, height))
    scale = shortest_edge / short
    return max(1, round(width * scale)), max(1, round(height * scale))


def _check_encoder_size(path: Path, label: str, size: tuple[int, int]) -> None:
    """Refuse images whose encoder-resized size exceeds :data:`MAX_ENCODER_PIXELS`."""
    width, height = encoder_resized_size(size)
    if width * height > MAX_ENCODER_PIXELS:
        ratio = max(size) / max(1, min(size))
        raise ImageInputError(
            f"{label} '{path}': aspect ratio {ratio:.0f}:1 ({size[0]} x {size[1]}) would be resized to "
            f"{width} x {height} pixels by the image encoder (limit {MAX_ENCODER_PIXELS} pixels, i.e. "
            f"aspect ratio <= {MAX_ASPECT_RATIO}:1); crop it closer to square"
        )


def _orientation(img: Image.Image) -> int | None:
    try:
        return img.getexif().get(0x0112)
    except Exception:  # noqa: BLE001 - a broken EXIF block just means "no orientation"
        return None


def image_key(path: Path, sha256: str) -> str:
    """Stable per-image identifier: file stem (safe characters only) + 10 hex of the hash."""
    stem = re.sub(r"[^A-Za-z0-9_.-]+", "_", path.stem).strip("._") or "image"
    return f"{stem[:60]}-{sha256[:10]}"


def load_reference_image(path: str | Path, *, label: str = "--image") -> tuple[Image.Image, ReferenceImage]:
    """Open, validate and convert one reference image.

    Args:
        path: Image file.
        label: Name of the option the path came from, used in error messages.

    Returns:
        ``(rgb_image, info)``: an 8-bit RGB :class:`PIL.Image.Image` and its description
        (with one note per conversion).

    Raises:
        ImageInputError: For every input the module docstring lists as an error; the
            message is one line naming the file, the problem and the fix.
    """
    path = Path(path).expanduser()
    _check_file(path, label)
    try:
        data = path.read_bytes()
    except PermissionError:
        raise ImageInputError(f"{label} '{path}': permission denied; make the file readable") from None
    decoded, mode, size, notes = _decode(path, label)
    try:
        rgb, more = to_rgb(decoded)
    except ValueError as exc:  # no defined 8-bit scale, or a mode Pillow cannot convert
        raise ImageInputError(f"{label} '{path}': {exc}") from None
    from nw_adapter.correlate.digit_sets import pixel_digest

    digest = hashlib.sha256(data).hexdigest()
    info = ReferenceImage(
        path=path.resolve(),
        key=image_key(path, digest),
        sha256=digest,
        mode=mode,
        size=size,
        notes=tuple(notes + more),
        pixels=pixel_digest(rgb),
    )
    return rgb, info


def _scan_dir(folder: Path) -> list[Path]:
    if folder.is_symlink() and not folder.exists():
        try:
            os.stat(folder)
        except OSError as exc:
            kind = "symbolic link loop" if exc.errno == errno.ELOOP else "dangling symbolic link"
            raise ImageInputError(f"--image-dir '{folder}': {kind}; fix the link") from None
    if not folder.exists():
        raise ImageInputError(f"--image-dir '{folder}': folder not found; check the path")
    if not folder.is_dir():
        raise ImageInputError(f"--image-dir '{folder}': is a file, not a folder; pass files with --image")
    found = sorted(
        p for p in folder.iterdir() if not p.name.startswith(".") and p.suffix.lower() in IMAGE_SUFFIXES
    )
    for path in found:  # an image's name that is no file is refused, never skipped (it would change n)
        if path.is_symlink() and not path.exists():
            raise ImageInputError(
                f"--image-dir '{folder}': '{path.name}' is a dangling symbolic link (to "
                f"'{os.readlink(path)}'); fix or remove the link"
            )
        if not path.is_file():
            raise ImageInputError(
                f"--image-dir '{folder}': '{path.name}' is a folder or special file, not an image; rename or "
                "move it"
            )
    if not found:
        raise NoImagesError(
            f"--image-dir '{folder}': contains no images ({', '.join(IMAGE_SUFFIXES)}); "
            "add images or pass files with --image"
        )
    return found


def collect_image_paths(
    images: Iterable[str | Path] = (), image_dirs: Iterable[str | Path] = ()
) -> list[tuple[Path, str]]:
    """List the reference files named by ``--image`` and ``--image-dir``, in order.

    Folders are scanned non-recursively for :data:`IMAGE_SUFFIXES`, sorted by name; hidden
    files (``.name``, e.g. macOS ``._photo.jpg``) are skipped.

    Returns:
        ``(path, label)`` pairs, where label is the option the path came from.

    Raises:
        ImageInputError: A folder that does not exist or holds no images, or no input at all.
    """
    collected: list[tuple[Path, str]] = [(Path(p).expanduser(), "--image") for p in images]
    for folder in image_dirs:
        collected.extend((p, "--image-dir") for p in _scan_dir(Path(folder).expanduser()))
    if not collected:
        raise ImageInputError("no reference image given; pass --image FILE or --image-dir FOLDER")
    return collected


def same_content_note(duplicate: Path, kept: Path, *, same_bytes: bool = True) -> str:
    """The note of a file merged into another of the same content (see :func:`validate_images`)."""
    what = "content (SHA-256)" if same_bytes else "pixels (another file of the same picture)"
    return f"{duplicate.name} has the same {what}; counted once, as {kept.name}"


def validate_images(entries: Sequence[tuple[Path, str]]) -> list[ReferenceImage]:
    """Validate every file before any work starts; files of the same content are one reference.

    The unit of the verdict is the reference image, so one content given under two names (or
    twice, or as a PNG and a BMP of the same pixels) is counted once: it is kept under its first
    name, and the others are listed in its :attr:`ReferenceImage.duplicates`, each with a note
    (the command line prints the notes). The same content is the same file bytes (SHA-256) or
    the same 8-bit RGB pixels (:attr:`ReferenceImage.pixels`), which make the same generation.

    Args:
        entries: ``(path, label)`` pairs from :func:`collect_image_paths`.

    Returns:
        One :class:`ReferenceImage` per distinct content, in input order.

    Raises:
        ImageInputError: The first bad file, in input order.
    """
    kept: list[ReferenceImage] = []
    for path, label in entries:
        _, info = load_reference_image(path, label=label)
        index = next(
            (i for i, first in enumerate(kept) if info.sha256 == first.sha256 or info.pixels == first.pixels),
            None,
        )
        if index is None:
            kept.append(info)
            continue
        first = kept[index]
        if info.path != first.path and info.path not in first.duplicates:
            note = same_content_note(info.path, first.path, same_bytes=info.sha256 == first.sha256)
            kept[index] = replace(
                first, duplicates=(*first.duplicates, info.path), notes=(*first.notes, note)
            )
    return kept
