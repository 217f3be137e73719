"""The offline training data of the trained tiny model: scikit-learn's bundled handwritten digits.

``sklearn.datasets.load_digits`` ships 1,797 grey 8 x 8 images (values 0..16) of the digits
0-9 with the package, so nothing is downloaded. They are brought to 32 x 32 RGB (bilinear
upsampling, the grey value copied to the three channels) and split once, deterministically and
stratified by class, into three disjoint parts:

- ``train`` (1,297 images): every training stage (VAE, image encoder, UNet, adapter);
- ``judge`` (400 images): the scikit-learn classifier that labels generated images;
- ``reference`` (100 images, 10 per class): the references whose class the generations must keep.

The images are returned as uint8 arrays ``(N, 32, 32, 3)``; :func:`to_model_range` maps them
to the ``[-1, 1]`` float tensors diffusers' VAE takes.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

__all__ = [
    "DIGIT_NAMES",
    "IMAGE_SIZE",
    "DigitSplit",
    "class_captions",
    "digit_features",
    "load_digit_splits",
    "to_model_range",
]

IMAGE_SIZE = 32
"""Height and width, in pixels, of the images the trained tiny model generates."""

DIGIT_NAMES = ("zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine")

_JUDGE_SIZE = 400
_REFERENCES_PER_CLASS = 10
_SPLIT_SEED = 0


@dataclass(frozen=True)
class DigitSplit:
    """One part of the digits data.

    Attributes:
        images: ``(N, 32, 32, 3)`` uint8 RGB images (grey: the three channels are equal).
        labels: ``(N,)`` int64 digit classes 0-9.
        indices: ``(N,)`` row numbers in ``load_digits()``, to trace every image to the source.
    """

    images: np.ndarray
    labels: np.ndarray
    indices: np.ndarray

    def __len__(self) -> int:
        return len(self.labels)


def _upsample(grey_8x8: np.ndarray) -> np.ndarray:
    """``(N, 8, 8)`` values 0..16 -> ``(N, 32, 32, 3)`` uint8 (bilinear, ``align_corners=False``)."""
    grey = torch.from_numpy(grey_8x8.astype(np.float32) / 16.0)[:, None]
    big = torch.nn.functional.interpolate(
        grey, size=(IMAGE_SIZE, IMAGE_SIZE), mode="bilinear", align_corners=False
    )
    pixels = (big.clamp(0.0, 1.0) * 255.0).round().to(torch.uint8)[:, 0]
    return pixels[..., None].expand(-1, -1, -1, 3).contiguous().numpy()


def load_digit_splits() -> dict[str, DigitSplit]:
    """The three deterministic, stratified, disjoint parts of the digits data.

    Returns:
        ``{"train": ..., "judge": ..., "reference": ...}`` (1,297, 400 and 100 images).
    """
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    digits = load_digits()
    labels = digits.target.astype(np.int64)
    rows = np.arange(len(labels))
    held_out_size = _JUDGE_SIZE + _REFERENCES_PER_CLASS * 10
    train_rows, held_rows = train_test_split(
        rows, test_size=held_out_size, stratify=labels, random_state=_SPLIT_SEED
    )
    judge_rows, reference_rows = train_test_split(
        held_rows, test_size=_REFERENCES_PER_CLASS * 10, stratify=labels[held_rows], random_state=_SPLIT_SEED
    )
    images = _upsample(digits.images)
    parts = {}
    for name, part in (("train", train_rows), ("judge", judge_rows), ("reference", reference_rows)):
        part = np.sort(part)
        parts[name] = DigitSplit(images=images[part], labels=labels[part], indices=part)
    return parts


def to_model_range(images: np.ndarray) -> torch.Tensor:
    """uint8 ``(N, H, W, 3)`` -> float32 ``(N, 3, H, W)`` in ``[-1, 1]`` (``x / 127.5 - 1``)."""
    return torch.from_numpy(images).permute(0, 3, 1, 2).float() / 127.5 - 1.0


def digit_features(images: np.ndarray) -> np.ndarray:
    """Features the judge classifier reads: the grey image averaged down to 8 x 8, scaled 0..16.

    Args:
        images: ``(N, 32, 32, 3)`` uint8 RGB images (real or generated).

    Returns:
        ``(N, 64)`` float32, the layout of ``load_digits().data``.
    """
    grey = torch.from_numpy(np.asarray(images, dtype=np.float32)).mean(dim=-1)[:, None]
    small = torch.nn.functional.avg_pool2d(grey, kernel_size=IMAGE_SIZE // 8)
    return (small.reshape(len(images), 64) * (16.0 / 255.0)).numpy()


def class_captions(digit: int) -> tuple[str, ...]:
    """The captions that describe an image of ``digit`` in stage 1 (three wordings).

    Example:
        >>> class_captions(3)
        ('a handwritten digit 3', 'the number three', 'a drawing of a 3')
    """
    return (f"a handwritten digit {digit}", f"the number {DIGIT_NAMES[digit]}", f"a drawing of a {digit}")
