"""The value parsers of ``correlate.py``'s options: one function per kind of value.

Each parser takes the option's text and returns its value, or raises
:class:`argparse.ArgumentTypeError` with one line that names the option first and says what it
takes (``--steps must be between 1 and 1000, got 0``). The option table
(:mod:`nw_adapter.correlate.options`) names one parser per row. Standard library only: parsing
answers before torch is imported.
"""

from __future__ import annotations

import argparse
import math
import re
from collections.abc import Callable
from pathlib import Path

from nw_adapter.integration.config import BANDWIDTH_RANGE, BANDWIDTH_RULES

__all__ = [
    "ASCII_NUMBER",
    "DEVICES",
    "MAX_SET_REFERENCES",
    "bandwidth",
    "device",
    "labels",
    "layers",
    "model_name",
    "nonneg_float",
    "nonempty_path",
    "positive_int",
    "seed",
    "size",
    "support_set",
    "swap_rules",
]

Parser = Callable[[str], object]

UNET_BLOCKS: dict[str, str] = {"down": "down_blocks", "mid": "mid_block", "up": "up_blocks"}
"""``--layers`` short names of UNet blocks -> the attention-processor name prefix."""

MAX_SET_REFERENCES = 16
"""The most reference images one support set may hold."""

DEVICES = re.compile(r"auto|cpu|mps|cuda(:[0-9]+)?", re.ASCII)
"""``--device`` values: torch devices this tool runs on (``meta`` and ``xla`` hold no data / are
not part of a CPU or CUDA build of torch)."""

_ASCII_INTEGER = re.compile(r"[0-9]+", re.ASCII)
ASCII_NUMBER = re.compile(r"[+-]?([0-9]+\.?[0-9]*|\.[0-9]+)([eE][+-]?[0-9]+)?", re.ASCII)
"""What ``--labels`` / ``--swap-rules`` read as numbers: ASCII decimals only (Python's ``int`` and
``float`` also take other scripts' digits and underscores, ``"\uff11"`` or ``"1_0"``)."""


def _whole(name: str, text: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{name} must be a whole number, got '{text}'") from None


def positive_int(name: str, *, maximum: int | None = None) -> Parser:
    """A whole number in ``1 .. maximum``."""

    def parse(text: str) -> int:
        value = _whole(name, text)
        if value < 1 or (maximum is not None and value > maximum):
            bound = f"between 1 and {maximum}" if maximum else ">= 1"
            raise argparse.ArgumentTypeError(f"{name} must be {bound}, got {value}")
        return value

    return parse


def nonneg_float(name: str, *, maximum: float | None = None) -> Parser:
    """A finite number >= 0 (and <= ``maximum``)."""

    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{name} must be a number, got '{text}'") from None
        if not math.isfinite(value) or value < 0:
            raise argparse.ArgumentTypeError(f"{name} must be a finite number >= 0, got '{text}'")
        if maximum is not None and value > maximum:
            raise argparse.ArgumentTypeError(f"{name} must be between 0 and {maximum:g}, got '{text}'")
        return value

    return parse


def positive_float(name: str) -> Parser:
    """A finite number > 0."""

    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{name} must be a number, got '{text}'") from None
        if not (math.isfinite(value) and value > 0):
            raise argparse.ArgumentTypeError(f"{name} must be a finite number > 0, got '{text}'")
        return value

    return parse


def seed(name: str, *, room: int = 0) -> Parser:
    """A seed in ``0 .. 2**63 - 1 - room`` (``room``: further seeds ``s + k`` the option implies)."""
    shown = "2**63 - 1" if not room else f"2**63 - {room + 1}"

    def parse(text: str) -> int:
        value = _whole(name, text)
        if not 0 <= value < 2**63 - room:
            raise argparse.ArgumentTypeError(f"{name} must be between 0 and {shown}, got {value}")
        return value

    return parse


def size(name: str) -> Parser:
    """Pixels: a multiple of 8 in ``8 .. 8192``."""

    def parse(text: str) -> int:
        value = positive_int(name, maximum=8192)(text)
        if value % 8:
            raise argparse.ArgumentTypeError(f"{name} must be a multiple of 8, got {value}")
        return value

    return parse


def bandwidth(text: str) -> str | float:
    """``--bandwidth``: a rule name or a number h in :data:`BANDWIDTH_RANGE`."""
    if text in BANDWIDTH_RULES:
        return text
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"--bandwidth must be one of {', '.join(BANDWIDTH_RULES)} or a positive number, got '{text}'"
        ) from None
    low, high = BANDWIDTH_RANGE
    if not math.isfinite(value) or not low <= value <= high:
        raise argparse.ArgumentTypeError(
            f"--bandwidth must be a number h in the usable range [{low:g}, {high:g}] "
            f"(or a rule name), got '{text}'"
        )
    return value


def layers(text: str) -> list[str]:
    """``--layers``: comma-separated block short names (:data:`UNET_BLOCKS`) or processor-name prefixes."""
    parts = [p.strip() for p in text.split(",")]
    if not all(parts):
        raise argparse.ArgumentTypeError(
            f"--layers must be comma-separated names without empty entries, got '{text}' "
            "(e.g. up or down,mid or up_blocks.1)"
        )
    return [UNET_BLOCKS.get(p, p) for p in parts]


def device(text: str) -> str:
    """``--device``: auto, cpu, mps, cuda or cuda:N (checked against this machine when the run starts)."""
    if not DEVICES.fullmatch(text):
        raise argparse.ArgumentTypeError(
            f"--device must be auto, cpu, mps, cuda or cuda:N, got '{text}' (this tool computes on a CPU, "
            "a CUDA GPU or Apple's MPS)"
        )
    return text


def nonempty_path(name: str, fix: str) -> Parser:
    """A path that is not empty or blank (``Path('')`` would be the current folder)."""

    def parse(text: str) -> Path:
        if not text.strip():
            raise argparse.ArgumentTypeError(f"{name} is empty; {fix}")
        return Path(text)

    return parse


def model_name(name: str, fix: str) -> Parser:
    """``--model`` / ``--ip-adapter``: not empty, and a folder, a Hub id or an offline model
    (:func:`nw_adapter.correlate.loading.check_model_name`, which reads only the file system)."""

    def parse(text: str) -> str:
        from nw_adapter.correlate.loading import check_model_name
        from nw_adapter.correlate.spec import ModelLoadError

        if not text.strip():
            raise argparse.ArgumentTypeError(f"{name} is empty; {fix}")
        try:
            check_model_name(text, name)
        except ModelLoadError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None
        return text

    return parse


def swap_rules(text: str) -> tuple[str | float, ...]:
    """``--swap-rules``: comma-separated rule names or bandwidths h in :data:`BANDWIDTH_RANGE`."""
    low, high = BANDWIDTH_RANGE
    rules: list[str | float] = []
    for part in (p.strip() for p in text.split(",")):
        if part in BANDWIDTH_RULES:
            rules.append(part)
            continue
        if not ASCII_NUMBER.fullmatch(part):
            raise argparse.ArgumentTypeError(
                f"--swap-rules: '{part}' is not a rule; use {', '.join(BANDWIDTH_RULES)} or a number h in "
                f"[{low:g}, {high:g}], comma-separated"
            )
        value = float(part)
        if not math.isfinite(value) or not low <= value <= high:
            raise argparse.ArgumentTypeError(
                f"--swap-rules: bandwidth '{part}' is outside the usable range [{low:g}, {high:g}]"
            )
        rules.append(value)
    if len(set(rules)) != len(rules):
        raise argparse.ArgumentTypeError(f"--swap-rules: '{text}' repeats a rule; name each rule once")
    return tuple(rules)


def labels(text: str) -> list[int]:
    """``--labels``: comma-separated digit classes 0-9 (ASCII), one per reference."""
    parts = [part.strip() for part in text.split(",")]
    if not all(_ASCII_INTEGER.fullmatch(part) for part in parts):
        raise argparse.ArgumentTypeError(
            f"--labels must be comma-separated ASCII digits 0-9 (one per reference, e.g. 3,7), got '{text}'"
        )
    values = [int(part) for part in parts]
    if not all(0 <= label <= 9 for label in values):
        raise argparse.ArgumentTypeError(f"--labels: digit classes are 0-9, got '{text}'")
    return values


def support_set(text: str) -> tuple[str, ...]:
    """``--support-set``: comma-separated image files, at most :data:`MAX_SET_REFERENCES`."""
    parts = tuple(p.strip() for p in text.split(","))
    if not all(parts):
        raise argparse.ArgumentTypeError(
            f"--support-set '{text}' has an empty entry; pass comma-separated image files, e.g. a.png,b.png"
        )
    if len(parts) > MAX_SET_REFERENCES:
        raise argparse.ArgumentTypeError(
            f"--support-set holds {len(parts)} images; a set takes at most {MAX_SET_REFERENCES}, split it"
        )
    return parts
