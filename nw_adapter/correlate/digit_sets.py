"""Support sets of held-out digits for ``correlate.py --support-dir`` (the support-set sweep).

Writes, from the 100 held-out ``reference`` images of :func:`nw_adapter.models.digits_data.load_digit_splits`
(never seen in training, 10 per class), one subfolder per set:

- ``m<m>-same-<k>``: m distinct images of one class (class ``k mod 10``);
- ``m<m>-mixed-<k>``: m images of m distinct classes (m >= 2),

``per_group`` sets per (m, kind), drawn with ``numpy.random.default_rng(seed)``; the files are
``<r>-digit<class>.png`` in reference order r.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import numpy as np

__all__ = ["known_digit_labels", "pixel_digest", "write_digit_support_sets"]


def pixel_digest(image) -> str:
    """SHA-256 of an image's RGB pixels (shape and bytes): the same for any lossless file of it."""
    import hashlib

    pixels = np.asarray(image.convert("RGB"), dtype=np.uint8)
    return hashlib.sha256(repr(pixels.shape).encode() + pixels.tobytes()).hexdigest()


def known_digit_labels() -> dict[str, int]:
    """``{pixel_digest: class}`` of the 100 held-out reference digits (the sweep's and the bundled
    examples' source): a reference whose pixels are one of them has a known class."""
    from PIL import Image

    from nw_adapter.models.digits_data import load_digit_splits

    split = load_digit_splits()["reference"]
    return {
        pixel_digest(Image.fromarray(im)): int(c) for im, c in zip(split.images, split.labels, strict=True)
    }


def write_digit_support_sets(
    folder: str | Path, sizes: Sequence[int] = (1, 2, 4), per_group: int = 10, seed: int = 0
) -> list[Path]:
    """Write the sets into ``folder`` (created); returns the set folders in name order.

    Raises:
        ValueError: a size outside 1..10 or ``per_group`` < 1.
    """
    from PIL import Image

    from nw_adapter.models.digits_data import load_digit_splits

    if per_group < 1 or any(not 1 <= m <= 10 for m in sizes):
        raise ValueError(f"sizes must lie in 1..10 and per_group be >= 1, got {list(sizes)}, {per_group}")
    split = load_digit_splits()["reference"]
    by_class = {c: np.flatnonzero(split.labels == c) for c in range(10)}
    rng = np.random.default_rng(seed)
    root = Path(folder)
    written = []
    for m in sizes:
        kinds = ("same",) if m == 1 else ("same", "mixed")
        for kind in kinds:
            for k in range(per_group):
                if kind == "same":
                    rows = rng.choice(by_class[k % 10], size=m, replace=False)
                else:
                    classes = rng.choice(10, size=m, replace=False)
                    rows = np.array([rng.choice(by_class[int(c)]) for c in classes])
                target = root / f"m{m}-{kind}-{k:02d}"
                target.mkdir(parents=True, exist_ok=True)
                for r, row in enumerate(rows):
                    label = int(split.labels[row])
                    Image.fromarray(split.images[row]).save(target / f"{r}-digit{label}.png")
                written.append(target)
    return sorted(written)
