"""The swap consequence: does the exact NW head, put in place of the image branch, keep what it does?

If the IP-Adapter's image-branch attention computes a kernel smoother, replacing its dot-product
softmax with the exact Nadaraya-Watson head (``mode="swap"``) should leave the generation close
to stock. :func:`compare_swap` generates, for every reference image, one stock image and one swap
image per bandwidth rule, all from the same seed and call arguments, and measures per (reference,
rule):

- ``abs_diff``: the mean absolute pixel difference ``mean |x_swap - x_stock|`` over pixels and
  channels, images as floats in ``[0, 1]``; its control ``abs_diff_other_seed`` is the same
  difference between two stock generations of the reference from different seeds (``seed + i`` and
  ``seed + n + i`` for ``n`` references): a swap difference well below it changes less than a new
  seed does;
- ``clip_i_stock`` / ``clip_i_swap``: CLIP-I, the cosine similarity
  ``<e(x), e(ref)> / (|e(x)| |e(ref)|)`` of the generation and the reference in the pipeline's own
  image-encoder space ``e`` (the IP-Adapter paper's image-fidelity metric);
- with a ``judge`` (list of PIL images -> list of labels) and the references' ``labels``: whether
  the stock and the swap generations keep the reference's label.

The unit of every interval is the reference (one reference, one seed, one generation per
arm): means carry a Student t 95% interval over references, agreement counts an exact
Clopper-Pearson 95% interval.

Example:
    >>> result = compare_swap(pipe, [ref0, ref1], rules=("matched", "fitted"))  # doctest: +SKIP
    >>> print(result.table())  # doctest: +SKIP
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from nw_adapter.core.intervals import CONFIDENCE, t_interval
from nw_adapter.integration.config import NWProcessorConfig
from nw_adapter.integration.errors import NWConfigError
from nw_adapter.integration.mixin import active_recorder, nw_processor

__all__ = [
    "DEFAULT_RULES",
    "MEAN_COLUMNS",
    "METHODS",
    "MIN_REFERENCES",
    "RANGES",
    "SUMMARY_COLUMNS",
    "SwapComparison",
    "bounded_interval",
    "compare_swap",
    "conclusion",
    "encode_images",
    "t_interval",
]

DEFAULT_RULES = ("matched", "fitted", "schedule", "median")
MEAN_COLUMNS = ("abs_diff", "abs_diff_other_seed", "clip_i_stock", "clip_i_swap", "clip_i_change")
"""The per-reference measurements ``compare_swap`` stores in every row (``per_reference``)."""

MIN_REFERENCES = 2
"""Fewest references an interval is computed from (a Student t interval needs two); below it the
table says "too few" and the conclusion that nothing follows."""

SEED_EXCESS = "abs_diff_vs_seed"
"""The summary's paired column: per reference ``abs_diff - abs_diff_other_seed`` (swap change minus
seed change); its interval below 0 means the swap moves the image less than a new seed does."""

RANGES: dict[str, tuple[float, float]] = {
    "abs_diff": (0.0, 1.0),
    "abs_diff_other_seed": (0.0, 1.0),
    SEED_EXCESS: (-1.0, 1.0),
    "clip_i_stock": (-1.0, 1.0),
    "clip_i_swap": (-1.0, 1.0),
    "clip_i_change": (-2.0, 2.0),
}
"""The values each summarised quantity can take (its mean and interval stay inside)."""

METHODS = {column: ("t" if column in (SEED_EXCESS, "clip_i_change") else "log") for column in RANGES}
"""The interval of each quantity (:func:`bounded_interval`): Student t for the changes, log scale
(Cox) for the quantities that pile up against one end of their range."""

SUMMARY_COLUMNS = (
    "abs_diff",
    "abs_diff_other_seed",
    SEED_EXCESS,
    "clip_i_stock",
    "clip_i_swap",
    "clip_i_change",
)
"""The means of :meth:`SwapComparison.summary`, in table order."""

HEADERS = {
    "abs_diff": "|swap-stock| (0-1)",
    "abs_diff_other_seed": "|seed-stock| (0-1)",
    SEED_EXCESS: "swap - seed",
    "clip_i_stock": "CLIP-I stock",
    "clip_i_swap": "CLIP-I swap",
    "clip_i_change": "CLIP-I change",
}

LEGEND = (
    "rule: the NW head's bandwidth rule (a number: a fixed bandwidth h); n: references, the unit of "
    "every interval",
    "|swap-stock| (0-1): mean absolute difference of the swap and the stock image over pixels and "
    "channels, intensities on a 0-1 scale (0: identical, 1: black against white)",
    "|seed-stock| (0-1): the same difference between two stock images from different seeds (the control)",
    "swap - seed: |swap-stock| minus |seed-stock|, per reference (below 0: the swap moves the image less "
    "than a new seed does)",
    "CLIP-I stock / swap: cosine (-1 to 1) of the generation and the reference in the pipeline's "
    "image-encoder space; CLIP-I change: swap minus stock, per reference",
)
KEEPS_LEGEND = (
    "stock / swap keeps class: generations the judge gives the reference's class, of n "
    "[Clopper-Pearson interval of the proportion]"
)

_SEED_WORDS = {
    "less": "the swap moves the image less than a new seed does",
    "more": "the swap moves the image more than a new seed does",
    "unclear": "the swap's change cannot be told apart from a new seed's",
}
_CLIP_WORDS = {
    "lower": "CLIP-I lower than stock",
    "higher": "CLIP-I higher than stock",
    "unclear": "no CLIP-I change shown",
}


def _clopper_pearson(successes: int, n: int, confidence: float = CONFIDENCE) -> tuple[float, float]:
    from scipy.stats import binomtest

    interval = binomtest(successes, n).proportion_ci(confidence_level=confidence, method="exact")
    return float(interval.low), float(interval.high)


def _student_t(data: np.ndarray, confidence: float) -> tuple[np.ndarray, np.ndarray]:
    """``mean -+ t_{n-1} s / sqrt(n)`` along the last axis of ``(..., n)`` data, ``n >= 2``."""
    from scipy.stats import t as student_t

    n = data.shape[-1]
    half = student_t.ppf(0.5 + confidence / 2, n - 1) * data.std(axis=-1, ddof=1) / math.sqrt(n)
    mean = data.mean(axis=-1)
    return mean - half, mean + half


def _log_scale(data: np.ndarray, bounds: tuple[float, float], confidence: float) -> tuple[np.ndarray, ...]:
    """Cox's interval of a lognormal mean, for the distance of ``(..., n)`` data from the nearer bound.

    The distance ``d`` (``x - low`` when the mean is nearer ``low``, else ``high - x``) is positive
    and skewed away from the bound; with ``y = log d`` (mean ``m``, variance ``s2``), the mean of
    ``d`` lies in ``exp(m + s2 / 2 -+ t_{n-1} sqrt(s2 / n + s2^2 / (2 (n - 1))))``. Where a distance
    is 0 (a value on the bound) the Student t interval is used instead.
    """
    from scipy.stats import t as student_t

    low, high = bounds
    n = data.shape[-1]
    mean = data.mean(axis=-1)
    near_low = (mean - low <= high - mean)[..., None]
    distance = np.where(near_low, data - low, high - data)
    usable = (distance > 0).all(axis=-1)
    with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
        logs = np.log(np.where(distance > 0, distance, 1.0))
        spread = logs.var(axis=-1, ddof=1)
        centre = logs.mean(axis=-1) + spread / 2
        half = student_t.ppf(0.5 + confidence / 2, n - 1) * np.sqrt(spread / n + spread**2 / (2 * (n - 1)))
        near, far = np.exp(centre - half), np.exp(centre + half)
    near_low = near_low[..., 0]
    log_low = np.where(near_low, low + near, high - far)
    log_high = np.where(near_low, low + far, high - near)
    t_low, t_high = _student_t(data, confidence)
    return np.where(usable, log_low, t_low), np.where(usable, log_high, t_high)


def bounded_interval(
    values: Sequence[float] | np.ndarray,
    bounds: tuple[float, float],
    method: str = "t",
    confidence: float = CONFIDENCE,
) -> tuple[Any, Any, Any]:
    """Mean of independent values and an interval that stays in the values' range.

    ``method="t"``: the Student t interval, for changes (differences of two arms, roughly
    symmetric). ``method="log"``: for a quantity that piles up against one end of its range (a mean
    absolute difference near 0, a CLIP-I cosine near 1), Cox's log-scale interval of the mean
    distance from that end (:func:`_log_scale`), which follows the skew. Either is then cut to
    ``bounds`` (the mean of values in the range is in the range, so only impossible values go; the
    coverage is unchanged) and widened to hold the sample mean (coverage can only grow).
    tests/analysis/test_consequence.py measures the coverage by simulation at 2, 3 and 10
    references.

    Args:
        values: ``(..., n)`` one value per reference along the last axis.
        bounds: ``(low, high)``, the range a single value can take.
        method: ``"t"`` or ``"log"``.
        confidence: Two-sided coverage.

    Returns:
        ``(mean, low, high)``, floats for 1-D ``values``, else arrays of the leading shape; ``low``
        and ``high`` are NaN below :data:`MIN_REFERENCES` values or where a value is not finite.
    """
    data = np.asarray(values, dtype=np.float64)
    mean = data.mean(axis=-1)
    if data.shape[-1] < MIN_REFERENCES:
        nan = np.full_like(mean, math.nan)
        low, high = nan, nan
    else:
        low, high = _log_scale(data, bounds, confidence) if method == "log" else _student_t(data, confidence)
        finite = np.isfinite(data).all(axis=-1)
        low = np.where(finite, np.clip(np.minimum(low, mean), *bounds), math.nan)
        high = np.where(finite, np.clip(np.maximum(high, mean), *bounds), math.nan)
    if data.ndim == 1:
        return float(mean), float(low), float(high)
    return mean, low, high


def _direction(row: dict[str, Any], column: str, below: str, above: str) -> str:
    """Which side of 0 the interval of ``column`` lies on: ``below``, ``above`` or ``"unclear"``."""
    if row["n"] < MIN_REFERENCES:
        return "too few"
    low, high = row[f"{column}_low"], row[f"{column}_high"]
    if high < 0:
        return below
    if low > 0:
        return above
    return "unclear"  # straddles 0, or NaN (a value that could not be computed)


def _rules_text(rules: list[Any], every: bool) -> str:
    return "under every rule" if every else "under " + ", ".join(str(rule) for rule in rules)


def conclusion(summary: Sequence[dict[str, Any]]) -> str:
    """The one line that follows from the intervals of :meth:`SwapComparison.summary`.

    Per rule: the swap moves the image less (more) than a new seed when the ``swap - seed``
    interval lies below (above) 0, and CLIP-I is lower (higher) than stock when the CLIP-I change
    interval does; an interval that contains 0 concludes nothing.
    """
    if not summary or any(row["n"] < MIN_REFERENCES for row in summary):
        return (
            f"conclusion: too few references for intervals (fewer than {MIN_REFERENCES}); nothing follows "
            "from this table"
        )
    clauses = []
    for key, words in (("change_vs_seed", _SEED_WORDS), ("clip_i_effect", _CLIP_WORDS)):
        groups: dict[str, list[Any]] = {}
        for row in summary:
            groups.setdefault(row[key], []).append(row["rule"])
        clauses.append(
            ", ".join(
                f"{words[kind]} {_rules_text(rules, len(groups) == 1)}" for kind, rules in groups.items()
            )
        )
    return f"conclusion ({CONFIDENCE:.0%} intervals over {summary[0]['n']} references): " + "; ".join(clauses)


@dataclass(frozen=True)
class SwapComparison:
    """What :func:`compare_swap` measured.

    Attributes:
        rules: The bandwidth rules compared with stock, in order (names or floats).
        per_reference: One dict per (reference, rule): ``reference`` (index), ``rule``, ``abs_diff``,
            ``abs_diff_other_seed`` (stock vs stock from another seed: the control),
            ``clip_i_stock``, ``clip_i_swap``, ``clip_i_change`` (swap minus stock), and with a judge
            ``label``, ``stock_label``, ``swap_label``, ``stock_keeps``, ``swap_keeps``.
        embedding: Which image-encoder output CLIP-I used: ``"image_embeds"``, ``"pooler_output"``
            or ``"last_hidden_state mean"``.
        settings: The generation settings (prompt, steps, guidance, seed, extra call arguments).
        stock_images: ``(H, W, 3)`` float32 stock generations in ``[0, 1]``, one per reference
            (empty when ``keep_images=False``; at most ``kept_size`` pixels a side when given).
        swap_images: rule -> list of ``(H, W, 3)`` float32 swap generations, one per reference.
        seed_images: the stock generations from the other seed (the control), one per reference.
    """

    rules: tuple
    per_reference: list[dict[str, Any]]
    embedding: str
    settings: dict[str, Any]
    stock_images: list[np.ndarray] = field(default_factory=list, repr=False)
    swap_images: dict[Any, list[np.ndarray]] = field(default_factory=dict, repr=False)
    seed_images: list[np.ndarray] = field(default_factory=list, repr=False)

    @property
    def judged(self) -> bool:
        """Whether class agreement was measured (a judge and labels were given)."""
        return bool(self.per_reference) and "swap_keeps" in self.per_reference[0]

    def summary(self) -> list[dict[str, Any]]:
        """One row per rule, over references (the unit).

        Returns:
            Dicts with ``rule``, ``n``; for every column of :data:`SUMMARY_COLUMNS` ``<column>``,
            ``<column>_low``, ``<column>_high`` (mean and Student t 95% interval cut to the column's
            :data:`RANGES`; NaN below :data:`MIN_REFERENCES`); ``change_vs_seed`` (``"less"``,
            ``"more"``, ``"unclear"`` or ``"too few"``: where the ``abs_diff_vs_seed`` interval lies)
            and ``clip_i_effect`` (``"lower"``, ``"higher"``, ``"unclear"``, ``"too few"``: the
            ``clip_i_change`` interval); with a judge also ``stock_kept`` / ``swap_kept`` (counts) with
            their Clopper-Pearson 95% intervals of the proportion (``*_low``, ``*_high``).
        """
        rows = []
        for rule in self.rules:
            mine = [row for row in self.per_reference if row["rule"] == rule]
            values = {column: [row[column] for row in mine] for column in MEAN_COLUMNS}
            values[SEED_EXCESS] = [row["abs_diff"] - row["abs_diff_other_seed"] for row in mine]
            summary: dict[str, Any] = {"rule": rule, "n": len(mine)}
            for column in SUMMARY_COLUMNS:
                mean, low, high = bounded_interval(values[column], RANGES[column], METHODS[column])
                summary.update({column: mean, f"{column}_low": low, f"{column}_high": high})
            summary["change_vs_seed"] = _direction(summary, SEED_EXCESS, "less", "more")
            summary["clip_i_effect"] = _direction(summary, "clip_i_change", "lower", "higher")
            if self.judged:
                for arm in ("stock", "swap"):
                    kept = sum(bool(row[f"{arm}_keeps"]) for row in mine)
                    low, high = _clopper_pearson(kept, len(mine))
                    summary.update({f"{arm}_kept": kept, f"{arm}_kept_low": low, f"{arm}_kept_high": high})
            rows.append(summary)
        return rows

    def conclusion(self) -> str:
        """The one-line conclusion of the intervals (:func:`conclusion` of :meth:`summary`)."""
        return conclusion(self.summary())

    def table(self, *, legend: bool = True) -> str:
        """The summary as fixed-width text, its conclusion, a legend of every column and the methods
        (``legend=False``: the summary and its conclusion only, as ``correlate.py --compare-swap``
        prints them without ``-v``).

        Means are printed ``mean [low, high]`` (Student t 95% interval over references, cut to the
        range the quantity can take; ``[too few]`` below :data:`MIN_REFERENCES`); kept counts
        ``k/n [Clopper-Pearson 95%]``.
        """

        def mean_cell(row: dict, column: str) -> str:
            if row["n"] < MIN_REFERENCES:
                return f"{row[column]:.3f} [too few]"
            return f"{row[column]:.3f} [{row[column + '_low']:.3f}, {row[column + '_high']:.3f}]"

        def count_cell(row: dict, arm: str) -> str:
            return (
                f"{row[arm + '_kept']}/{row['n']} "
                f"[{row[arm + '_kept_low']:.0%}, {row[arm + '_kept_high']:.0%}]"
            )

        summary = self.summary()
        header = ["rule", "n", *(HEADERS[column] for column in SUMMARY_COLUMNS)]
        if self.judged:
            header += ["stock keeps class", "swap keeps class"]
        lines = [header]
        for row in summary:
            cells = [str(row["rule"]), str(row["n"]), *(mean_cell(row, c) for c in SUMMARY_COLUMNS)]
            if self.judged:
                cells += [count_cell(row, "stock"), count_cell(row, "swap")]
            lines.append(cells)
        widths = [max(len(line[i]) for line in lines) for i in range(len(header))]
        text = [
            "  ".join(cell.ljust(width) for cell, width in zip(line, widths, strict=True)).rstrip()
            for line in lines
        ]
        if not legend:
            return "\n".join([*text, conclusion(summary) + "."])
        words = [*LEGEND, KEEPS_LEGEND] if self.judged else list(LEGEND)
        methods = (
            f"mean [{CONFIDENCE:.0%} interval over references, inside the range the quantity can take: "
            "Student t for swap - seed and CLIP-I change, log scale (Cox) of the distance from the nearer "
            f"end of the range for the others; too few: under {MIN_REFERENCES} references]"
        )
        if self.judged:
            methods += f"; class agreement with Clopper-Pearson {CONFIDENCE:.0%} intervals"
        methods += f"; CLIP-I from the image encoder's {self.embedding}."
        return "\n".join(
            [*text, conclusion(summary) + ".", "columns:", *(f"  {line}" for line in words), methods]
        )

    def to_dataframe(self):
        """``per_reference`` as a ``pandas.DataFrame`` (one row per reference and rule)."""
        import pandas as pd

        return pd.DataFrame(self.per_reference)


def _rule_name(rule: Any) -> Any:
    """Validate one rule through the processor config; returns it as the config stores it."""
    try:
        return NWProcessorConfig(mode="swap", bandwidth=rule, statistics=False).bandwidth
    except NWConfigError as error:
        raise ValueError(f"compare_swap: unknown rule {rule!r} ({error})") from None


_OWN_CALL_ARGUMENTS = {
    "generator": "compare_swap seeds every generation itself (reference i: seed + i, its control "
    "seed + n + i); drop generator= and pass seed=",
    "latents": "fixed latents would make the other-seed control the same image; drop latents= and pass seed=",
    "ip_adapter_image": "the references are the IP-Adapter images; pass them as references",
    "ip_adapter_image_embeds": "compare_swap embeds the references itself; pass them as references",
    "output_type": "compare_swap reads every generation as an array (output_type='np'); drop output_type=",
}
"""Pipeline call arguments ``compare_swap`` sets itself, and why each is refused in ``**call_kwargs``."""


def _validate_call(num_inference_steps: Any, seed: Any, call_kwargs: dict[str, Any]) -> None:
    """Refuse generation settings that would fail deep in the pipeline or defeat the comparison."""
    for name, value in (("num_inference_steps", num_inference_steps), ("seed", seed)):
        if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
            raise ValueError(f"compare_swap: {name} must be an integer, got {value!r}")
    if num_inference_steps < 1:
        raise ValueError(
            f"compare_swap: num_inference_steps must be 1 or more, got {num_inference_steps}; pass the "
            "number of denoising steps (e.g. 25)"
        )
    for name in call_kwargs:
        if name in _OWN_CALL_ARGUMENTS:
            raise ValueError(f"compare_swap: {name}= is not accepted: {_OWN_CALL_ARGUMENTS[name]}")


def _judged(judge: Callable[[list[Any]], Sequence[Any]], images: list[Any]) -> list[Any]:
    """The judge's labels of ``images``, checked to be one per image."""
    answer = judge(images)
    if isinstance(answer, (str, bytes)) or not hasattr(answer, "__len__") or not hasattr(answer, "__iter__"):
        raise ValueError(
            f"compare_swap: judge= returned a value of type {type(answer).__name__}, not a list of labels; "
            "it must map a list of PIL images to a list with one label per image"
        )
    predicted = list(answer)
    if len(predicted) != len(images):
        raise ValueError(
            f"compare_swap: judge= returned {len(predicted)} label(s) for {len(images)} images; it must "
            "return one label per image it is given"
        )
    return predicted


def _validate(references: Any, rules: Any, judge: Any, labels: Any) -> tuple[list, tuple]:
    from PIL import Image

    if isinstance(rules, (str, int, float)):
        rules = (rules,)
    references = list(references) if references is not None else []
    if not references:
        raise ValueError("compare_swap: no references; pass a list of one or more PIL images")
    for index, reference in enumerate(references):
        if not isinstance(reference, Image.Image):
            raise ValueError(
                f"compare_swap: reference {index} is a {type(reference).__name__}, not a PIL image; "
                "pass PIL images (e.g. PIL.Image.open(path).convert('RGB'))"
            )
    _refuse_repeated_references(references)
    if not rules:
        raise ValueError(f"compare_swap: no rules; pass one or more of {DEFAULT_RULES} or a float bandwidth")
    names = tuple(_rule_name(rule) for rule in rules)
    if len(set(names)) != len(names):
        raise ValueError(f"compare_swap: repeated rule in {rules!r}; pass each rule once")
    if labels is not None and judge is None:
        raise ValueError("compare_swap: labels without a judge; pass judge= (list of PIL images -> labels)")
    if judge is not None and labels is None:
        raise ValueError("compare_swap: a judge without labels; pass labels= (one per reference)")
    if labels is not None and len(labels) != len(references):
        raise ValueError(
            f"compare_swap: {len(labels)} labels for {len(references)} references; "
            "pass one label per reference"
        )
    return references, names


def _refuse_repeated_references(references: Sequence[Any]) -> None:
    """Refuse two references of the same content: the reference is the unit of every interval.

    Content is the SHA-256 of the image's size and RGB pixels, so one picture passed twice (or
    loaded twice, or as RGB and as RGBA of the same pixels) is found, as the command line finds one
    file under two names by its bytes.

    Raises:
        ValueError: references ``i`` and ``j`` have the same content; one line naming them.
    """
    first_of: dict[str, int] = {}
    for index, reference in enumerate(references):
        rgb = reference.convert("RGB")
        digest = hashlib.sha256(repr(rgb.size).encode() + rgb.tobytes()).hexdigest()
        if digest in first_of:
            raise ValueError(
                f"compare_swap: references {first_of[digest]} and {index} are the same image (identical "
                "RGB pixels), which would count one reference twice in every interval; pass each "
                "reference once"
            )
        first_of[digest] = index


@torch.no_grad()
def encode_images(pipe: Any, images: Sequence[Any]) -> tuple[torch.Tensor, str]:
    """Embed images with the pipeline's own feature extractor and image encoder.

    Args:
        pipe: A pipeline with ``feature_extractor`` and ``image_encoder`` (loaded with the IP-Adapter).
        images: PIL images.

    Returns:
        ``((N, D) float32 embeddings on the CPU, which output was used)``: ``image_embeds`` when the
        encoder has a projection, else ``pooler_output``, else the mean of ``last_hidden_state``
        over tokens.
    """
    extractor = getattr(pipe, "feature_extractor", None)
    encoder = getattr(pipe, "image_encoder", None)
    if extractor is None or encoder is None:
        raise ValueError(
            "compare_swap: the pipeline has no feature_extractor / image_encoder; load an IP-Adapter "
            "with its image encoder (pipe.load_ip_adapter(...)) first"
        )
    pixels = extractor(images=list(images), return_tensors="pt").pixel_values
    output = encoder(pixels.to(device=encoder.device, dtype=encoder.dtype))
    for name in ("image_embeds", "pooler_output"):
        value = getattr(output, name, None)
        if value is not None:
            return value.float().cpu(), name
    return output.last_hidden_state.float().mean(dim=1).cpu(), "last_hidden_state mean"


def _to_pil(image: np.ndarray) -> Any:
    from PIL import Image

    return Image.fromarray((image * 255.0).round().astype(np.uint8))


def _generate(pipe: Any, reference: Any, seed: int, arguments: dict[str, Any]) -> np.ndarray:
    """One generation as an ``(H, W, 3)`` float32 array in ``[0, 1]``."""
    generator = torch.Generator(pipe.device).manual_seed(seed)
    output = pipe(ip_adapter_image=reference, generator=generator, **arguments).images[0]
    if not isinstance(output, np.ndarray):  # a pipeline that ignored output_type="np"
        output = np.asarray(output.convert("RGB"), dtype=np.float32) / 255.0
    return np.clip(np.asarray(output, dtype=np.float32), 0.0, 1.0)


def _kept(image: np.ndarray, size: int | None) -> np.ndarray:
    """``image`` ``(H, W, 3)`` in [0, 1] as kept: unchanged, or resized (Lanczos) so its longer side
    is at most ``size`` pixels (float32 in [0, 1] either way)."""
    if size is None or max(image.shape[:2]) <= size:
        return image
    from PIL import Image

    height, width = image.shape[:2]
    scale = size / max(height, width)
    pixels = Image.fromarray((np.clip(image, 0.0, 1.0) * 255.0).round().astype(np.uint8))
    size_kept = (max(1, round(width * scale)), max(1, round(height * scale)))
    small = pixels.resize(size_kept, Image.Resampling.LANCZOS)
    return np.asarray(small, dtype=np.float32) / 255.0


def _cosine(a: torch.Tensor, b: torch.Tensor) -> float:
    return float(torch.nn.functional.cosine_similarity(a[None], b[None]).clamp(-1.0, 1.0))


def compare_swap(
    pipe: Any,
    references: Sequence[Any],
    *,
    rules: Sequence[str | float] = DEFAULT_RULES,
    prompt: str = "a photograph",
    num_inference_steps: int = 25,
    guidance_scale: float = 7.5,
    seed: int = 0,
    judge: Callable[[list[Any]], Sequence[Any]] | None = None,
    labels: Sequence[Any] | None = None,
    keep_images: bool = True,
    kept_size: int | None = None,
    on_reference_done: Callable[[int, int], None] | None = None,
    **call_kwargs: Any,
) -> SwapComparison:
    """Generate stock and swap images from every reference and measure how far the swap moves them.

    Reference ``i`` is generated with ``torch.Generator(pipe.device).manual_seed(seed + i)`` once
    stock and once per rule inside ``nw_processor(pipe, mode="swap", bandwidth=rule,
    statistics=False)``, and once more stock with seed ``seed + n + i`` (the seed control); every
    call gets the same arguments. See the module docstring for the metrics.

    Args:
        pipe: A diffusers pipeline with an IP-Adapter loaded (``ip_adapter_image=`` in its call).
        references: PIL reference images, each content once (the unit of every interval).
        rules: Bandwidth rules (``"matched"``, ``"fitted"``, ``"schedule"``, ``"median"``) or
            positive float bandwidths h.
        prompt: Text prompt of every call.
        num_inference_steps: Denoising steps.
        guidance_scale: Classifier-free guidance.
        seed: Seed of reference 0; reference ``i`` uses ``seed + i``.
        judge: Optional classifier: list of PIL images -> list of labels.
        labels: The references' true labels (needs ``judge``).
        keep_images: Keep the generations in the result (``stock_images``, ``swap_images``,
            ``seed_images``), measured at full size either way.
        kept_size: Keep them at most this many pixels on the longer side (None: as generated); the
            command line keeps what its report embeds.
        on_reference_done: Called with ``(index, number of references)`` after each reference's
            generations and measurements (the command line's progress line in a log).
        **call_kwargs: Further pipeline call arguments (e.g. ``height``, ``negative_prompt``); not
            ``generator``, ``latents`` (the seeds are ``seed``), ``ip_adapter_image``,
            ``ip_adapter_image_embeds`` (the references) or ``output_type``, which it sets itself.

    Returns:
        The :class:`SwapComparison`.

    Raises:
        ValueError: No references, a reference that is not a PIL image, two references of the same
            content (RGB pixels; the reference is the unit), an unknown or repeated rule,
            labels without a judge (or the reverse), or as many labels as references not given;
            ``num_inference_steps`` below 1 or not an integer, a ``seed`` that is not an integer, a
            call argument it sets itself (``generator=`` ...); a judge that does not return one label
            per image; NW processors already installed on ``pipe``.
    """
    references, names = _validate(references, rules, judge, labels)
    _validate_call(num_inference_steps, seed, call_kwargs)
    if active_recorder(pipe) is not None:
        raise ValueError(
            "compare_swap: NW processors are installed on this pipeline (its stock images would not be "
            "stock); call pipe.unset_ip_adapter_nw_processor() or remove_nw_processor(pipe) first"
        )
    arguments = {
        "prompt": prompt,
        "num_inference_steps": num_inference_steps,
        "guidance_scale": guidance_scale,
        "output_type": "np",
        **call_kwargs,
    }
    reference_embeds, embedding = encode_images(pipe, references)
    rows: list[dict[str, Any]] = []
    stock_images: list[np.ndarray] = []
    swap_images: dict[Any, list[np.ndarray]] = {name: [] for name in names}
    seed_images: list[np.ndarray] = []
    for index, reference in enumerate(references):
        stock = _generate(pipe, reference, seed + index, arguments)
        other_seed = _generate(pipe, reference, seed + len(references) + index, arguments)
        seed_difference = float(np.abs(other_seed - stock).mean())
        swaps = {}
        for name in names:
            with nw_processor(pipe, mode="swap", bandwidth=name, statistics=False):
                swaps[name] = _generate(pipe, reference, seed + index, arguments)
        generated = [_to_pil(stock), *(_to_pil(swaps[name]) for name in names)]
        embeds, _ = encode_images(pipe, generated)
        similarity = [_cosine(embed, reference_embeds[index]) for embed in embeds]
        predicted = _judged(judge, generated) if judge is not None else None
        for position, name in enumerate(names, start=1):
            row: dict[str, Any] = {
                "reference": index,
                "rule": name,
                "abs_diff": float(np.abs(swaps[name] - stock).mean()),
                "abs_diff_other_seed": seed_difference,
                "clip_i_stock": similarity[0],
                "clip_i_swap": similarity[position],
                "clip_i_change": similarity[position] - similarity[0],
            }
            if predicted is not None:
                row.update(
                    label=labels[index],
                    stock_label=predicted[0],
                    swap_label=predicted[position],
                    stock_keeps=bool(predicted[0] == labels[index]),
                    swap_keeps=bool(predicted[position] == labels[index]),
                )
            rows.append(row)
        if keep_images:
            stock_images.append(_kept(stock, kept_size))
            seed_images.append(_kept(other_seed, kept_size))
            for name in names:
                swap_images[name].append(_kept(swaps[name], kept_size))
        if on_reference_done is not None:
            on_reference_done(index, len(references))
    settings = {
        "prompt": prompt,
        "num_inference_steps": num_inference_steps,
        "guidance_scale": guidance_scale,
        "seed": seed,
        "call_kwargs": {key: repr(value) for key, value in call_kwargs.items()},
    }
    return SwapComparison(
        rules=names,
        per_reference=rows,
        embedding=embedding,
        settings=settings,
        stock_images=stock_images,
        swap_images=swap_images,
        seed_images=seed_images,
    )
