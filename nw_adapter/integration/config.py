"""Configuration of the NW attention processor, validated once on construction.

Every option a user can pass to :func:`nw_adapter.integration.mixin.apply_nw_processor` (or
``set_ip_adapter_nw_processor``) lives in :class:`NWProcessorConfig`. Bad values raise a
``ValueError`` naming the option, the problem and the fix, in the style of diffusers'
``hooks/layer_skip.py``.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from nw_adapter.integration.errors import NWConfigError

MODES = ("observe", "swap")
BANDWIDTH_RULES = ("matched", "fitted", "schedule", "median")
MAP_DTYPES = ("float16", "float32")
BANDWIDTH_RANGE = (1e-4, 1e4)
"""Usable fixed bandwidths h: 1 / 2h^2 times squared distances must stay finite in float32."""
SEED_LIMIT = 2**63
"""Seeds must lie in [0, 2**63), the range of ``torch.Generator.manual_seed``."""
MAX_CONTROL_DRAWS = 64
"""The most untrained-adapter control draws a run may ask for (``untrained_draws``)."""


def _err(option: str, problem: str, fix: str) -> NWConfigError:
    return NWConfigError(f"NWProcessorConfig: `{option}` {problem}; {fix}.")


def _int_tuple(option: str, value: Any, *, minimum: int = 0) -> tuple[int, ...] | None:
    if value is None:
        return None
    if isinstance(value, int) and not isinstance(value, bool):
        value = (value,)
    if isinstance(value, (str, bytes)) or not isinstance(value, Sequence):
        raise _err(option, f"must be None or a list of ints, got {value!r}", "pass e.g. [0, 1]")
    out = []
    for v in value:
        if isinstance(v, bool) or not isinstance(v, int):
            raise _err(option, f"must contain ints, got {v!r}", "pass e.g. [0, 1]")
        if v < minimum:
            raise _err(option, f"must contain ints >= {minimum}, got {v}", "drop the negative entries")
        out.append(v)
    if not out:
        raise _err(option, "is an empty list, which would select nothing", "pass None to select all")
    return tuple(sorted(set(out)))


def _str_tuple(option: str, value: Any) -> tuple[str, ...] | None:
    if value is None:
        return None
    if isinstance(value, str):
        value = (value,)
    if not isinstance(value, Sequence) or not all(isinstance(v, str) and v for v in value):
        raise _err(
            option,
            f"must be None, a string or a list of non-empty strings, got {value!r}",
            'pass layer-name prefixes such as ["down_blocks.1", "up_blocks.0.attentions.1"]',
        )
    if not value:
        raise _err(option, "is an empty list, which would select nothing", "pass None to select all")
    return tuple(value)


def step_count_problem(call: Mapping[str, Any]) -> str | None:
    """Why a pipeline call's ``num_inference_steps`` cannot run (None: absent, or a whole number >= 1);
    below 1 the scheduler divides by zero inside the call."""
    steps = call.get("num_inference_steps")
    if steps is not None and (isinstance(steps, bool) or not isinstance(steps, int) or steps < 1):
        return f"num_inference_steps must be a whole number >= 1, got {steps!r}"
    return None


@dataclass
class NWProcessorConfig:
    """Options of the NW attention processor (observe or swap IP-Adapter's image branch).

    Args:
        mode: ``"observe"`` keeps the layer output bit-identical to diffusers and records
            statistics comparing A = softmax(q k^T / sqrt(d_k)) with the NW weights;
            ``"swap"`` replaces the image branch by the exact Gaussian-kernel (NW) head
            softmax_i(-||q - k_i||^2 / 2h^2) v_i.
        bandwidth: rule for h per (batch row, head): ``"matched"`` (h^2 = sqrt(d_k), i.e.
            1 / attention scale), ``"fitted"`` (beta = 1/h^2 minimising CE(A || NW)),
            ``"schedule"`` (h = schedule_c * sigma_t / alpha_t of the current step),
            ``"median"`` (h^2 = median ||q - k||^2 / 2) or a positive float (fixed h).
        schedule_c: the constant c of the ``"schedule"`` rule (refused with another rule, which
            would ignore it).
        layers: attention-processor name prefixes to act on (e.g. ``"up_blocks.1"`` or a
            full ``"...attn2.processor"`` name); None = every IP-Adapter layer. Layers not
            selected keep the stock processor.
        heads: head indices to compute statistics for (and to store maps of); None = all.
        steps: denoising step indices (0-based, per call) to record, or in swap mode to
            swap; None = all.
        statistics: record statistics; None means True for observe and False for swap.
        nulls: compute the three nulls of rho: permutation (NW scores shuffled across keys),
            norm-matched (queries of the same norms in random directions) and q.k-spread
            (each row's q.k kept, its pairing with the key norms shuffled).
        null_rows: number of random query rows (per layer and step) the nulls are
            estimated on; None = all rows. The nulls are controls, a mean of per-row values,
            so a subsample keeps them cheap at a small variance cost.
        seed: seed of the generator of the nulls (reseeded at the start of every call).
        cfg: whether the batch is [uncond; cond]. None = ask the pipeline's
            ``do_classifier_free_guidance`` at every UNet call (False without a pipeline).
        store_maps: keep raw attention maps A and NW weights for :meth:`NWRecorder.save_maps`.
        map_layers: name prefixes of layers whose maps are kept (None = all recorded layers).
        map_steps: step indices whose maps are kept (None = all recorded steps).
        map_heads: head indices whose maps are kept (None = all recorded heads).
        map_head_mean: average maps over the kept heads.
        map_downsample: integer factor of spatial average pooling of the query grid.
        map_dtype: ``"float16"`` or ``"float32"`` storage of the maps.
        map_max_mb: cap on stored map memory; maps beyond it are dropped with a warning.
        chunk_size: query chunk of the Gaussian-kernel attention in swap mode (None = one).
        compile: run the statistics as one ``torch.compile``'d function per shape (each deferred
            group's call, or each layer's on the per-layer path); on CUDA with
            ``mode="reduce-overhead"`` (CUDA graphs: one replay per group instead of ~100
            launches). Equal to eager within float32 tolerance. The first call of each shape
            compiles (minutes on a CPU; logged); where compilation is not available a one-line
            warning says so and the eager code runs. Off by default: on a CPU it does not pay
            (the host-cost proxy's largest group: 102 ms compiled against 86 ms eager per call,
            after a 159 s compile, 2026-12-02 at load 7; benchmarks/README.md), and on a GPU it
            is not measured yet.
        untrained_control: also record, per softmax, the statistics of the same queries against
            the keys of *untrained* adapters (the IP-Adapter training recipe's initialisation,
            THEORY.md section 4, docs/controls.md; :mod:`nw_adapter.integration.untrained`), built
            once at install, one per draw. Draw k's keys ``k0`` are rescaled per (batch row, head)
            to the trained keys' RMS norm, ``k0m = k0 key_rms(k) / key_rms(k0)`` (the
            scale-matched control: same algebra, same scale, no learning); their statistics
            (without nulls) are the ``{X}_control_{k}`` columns and the change of scale
            ``key_rms(k) / key_rms(k0)`` the ``key_scale_{k}`` column
            (:func:`~nw_adapter.integration.schema.control_columns`). Every reading minus its
            control value is what adapter training changed in shape. Costs one more statistics
            pass per softmax and draw (benchmarks/README.md).
        untrained_draws: the number K of control draws (1 to :data:`MAX_CONTROL_DRAWS`; default
            3): the verdict's intervals include the variance between draws.
        untrained_seed: seed s of the untrained adapters' default initialisations: draw k uses
            seed s + k.
        readings: record the readings that split the attention into a query-blind key prior and
            an NW smoother of the query (``r2_key``, ``r2_nw``, ``kl_key_prior``, ``kl_nw_fit``,
            ``nw_gain``, ``h_eff`` with ``h_eff_se`` and ``fit_rows``; THEORY.md section 4); False =
            those columns are NaN and the side computation costs what it did before them.
        fit_rows: number of evenly spaced query rows the readings' bandwidth ``h_eff`` is fitted
            on (a fixed number of Newton steps, each a softmax over these rows); None = all rows.
            ``h_eff_se`` is the standard error this subsample adds (0 with all rows).
        deferred_mb: observed layers only capture their queries and keys; the statistics of the
            captured softmaxes are computed together, grouped by shape, when the captures exceed
            this many MiB, when a new pipeline call begins, or when the records are read
            (:mod:`~nw_adapter.integration.processors.deferred`). The captures hold diffusers'
            float32 query tensors until then (at most this bound plus one layer's). 0 = each
            layer computes its statistics in the call (the per-layer path; so do layers whose maps
            are stored). The records are the same either way; the nulls'
            random numbers are drawn per group, not per layer.

    Example:
        >>> from nw_adapter.integration.config import NWProcessorConfig
        >>> cfg = NWProcessorConfig(mode="observe", bandwidth="matched", layers=["up_blocks.1"])
        >>> cfg.record_statistics
        True
    """

    mode: str = "observe"
    bandwidth: str | float = "matched"
    schedule_c: float = 1.0
    layers: Sequence[str] | str | None = None
    heads: Sequence[int] | int | None = None
    steps: Sequence[int] | int | None = None
    statistics: bool | None = None
    nulls: bool = True
    null_rows: int | None = 256
    seed: int = 0
    cfg: bool | None = None
    store_maps: bool = False
    map_layers: Sequence[str] | str | None = None
    map_steps: Sequence[int] | int | None = None
    map_heads: Sequence[int] | int | None = None
    map_head_mean: bool = False
    map_downsample: int = 1
    map_dtype: str = "float16"
    map_max_mb: float = 256.0
    chunk_size: int | None = None
    compile: bool = False
    untrained_control: bool = False
    untrained_draws: int = 3
    untrained_seed: int = 0
    readings: bool = True
    fit_rows: int | None = 256
    deferred_mb: float = 512.0
    extra: dict = field(default_factory=dict, repr=False)

    def __post_init__(self) -> None:
        if self.extra:
            raise _err(next(iter(self.extra)), "is not an option", f"use one of {sorted(self.field_names())}")
        if self.mode not in MODES:
            raise _err("mode", f"must be one of {MODES}, got {self.mode!r}", 'pass mode="observe" or "swap"')
        bw = self.bandwidth
        if isinstance(bw, bool) or not isinstance(bw, (str, int, float)):
            raise _err(
                "bandwidth",
                f"must be a rule name or a positive float, got {bw!r}",
                f"pass one of {BANDWIDTH_RULES} or e.g. 2.0",
            )
        if isinstance(bw, str) and bw not in BANDWIDTH_RULES:
            raise _err("bandwidth", f"got unknown rule {bw!r}", f"pass one of {BANDWIDTH_RULES} or a float")
        if isinstance(bw, (int, float)):
            if not math.isfinite(bw) or bw <= 0:
                raise _err("bandwidth", f"must be a positive finite float, got {bw!r}", "pass e.g. 2.0")
            if not BANDWIDTH_RANGE[0] <= bw <= BANDWIDTH_RANGE[1]:
                raise _err(
                    "bandwidth",
                    f"= {bw!r} is outside the usable range [{BANDWIDTH_RANGE[0]:g}, {BANDWIDTH_RANGE[1]:g}]",
                    "pass a bandwidth inside it, e.g. 2.0",
                )
            self.bandwidth = float(bw)
        c = self.schedule_c
        if isinstance(c, bool) or not isinstance(c, (int, float)) or not math.isfinite(c) or c <= 0:
            raise _err("schedule_c", f"must be a positive finite float, got {c!r}", "pass e.g. 1.0")
        self.schedule_c = float(c)
        if self.schedule_c != 1.0 and self.bandwidth != "schedule":
            raise _err(
                "schedule_c",
                f"is read by bandwidth='schedule' only, and bandwidth is {self.bandwidth!r}",
                "drop schedule_c or pass bandwidth='schedule'",
            )
        self.layers = _str_tuple("layers", self.layers)
        self.map_layers = _str_tuple("map_layers", self.map_layers)
        self.heads = _int_tuple("heads", self.heads)
        self.steps = _int_tuple("steps", self.steps)
        self.map_heads = _int_tuple("map_heads", self.map_heads)
        self.map_steps = _int_tuple("map_steps", self.map_steps)
        for name in ("statistics", "cfg"):
            v = getattr(self, name)
            if v is not None and not isinstance(v, bool):
                raise _err(name, f"must be None, True or False, got {v!r}", f"pass {name}=True or False")
        for name in ("nulls", "store_maps", "map_head_mean", "compile", "untrained_control", "readings"):
            if not isinstance(getattr(self, name), bool):
                raise _err(name, f"must be True or False, got {getattr(self, name)!r}", f"pass {name}=True")
        if isinstance(self.seed, bool) or not isinstance(self.seed, int):
            raise _err("seed", f"must be an int, got {self.seed!r}", "pass e.g. seed=0")
        if not 0 <= self.seed < SEED_LIMIT:
            raise _err("seed", f"must be between 0 and 2**63 - 1, got {self.seed}", "pass e.g. seed=0")
        us = self.untrained_seed
        if isinstance(us, bool) or not isinstance(us, int) or not 0 <= us < SEED_LIMIT:
            raise _err(
                "untrained_seed", f"must be an int in [0, 2**63), got {us!r}", "pass e.g. untrained_seed=0"
            )
        draws = self.untrained_draws
        if isinstance(draws, bool) or not isinstance(draws, int) or not 1 <= draws <= MAX_CONTROL_DRAWS:
            raise _err(
                "untrained_draws",
                f"must be an int in [1, {MAX_CONTROL_DRAWS}], got {draws!r}",
                "pass e.g. untrained_draws=3",
            )
        if us + draws > SEED_LIMIT:
            raise _err(
                "untrained_seed",
                f"+ untrained_draws must stay below 2**63 (draw k uses seed untrained_seed + k), got {us!r}",
                "pass a smaller untrained_seed, e.g. 0",
            )
        if self.untrained_control and not self.record_statistics:
            raise _err(
                "untrained_control",
                "needs statistics to be recorded",
                "pass statistics=True (the default in observe mode)",
            )
        ds = self.map_downsample
        if isinstance(ds, bool) or not isinstance(ds, int) or ds < 1:
            raise _err("map_downsample", f"must be an int >= 1, got {ds!r}", "pass 1 (none), 2, 4 ...")
        if self.map_dtype not in MAP_DTYPES:
            raise _err(
                "map_dtype",
                f"must be one of {MAP_DTYPES}, got {self.map_dtype!r}",
                'pass map_dtype="float16"',
            )
        mb = self.map_max_mb
        if isinstance(mb, bool) or not isinstance(mb, (int, float)) or not mb > 0:
            raise _err("map_max_mb", f"must be a positive number, got {mb!r}", "pass e.g. 256")
        dm = self.deferred_mb
        if isinstance(dm, bool) or not isinstance(dm, (int, float)) or not (math.isfinite(dm) and dm >= 0):
            raise _err("deferred_mb", f"must be a number >= 0, got {dm!r}", "pass e.g. 512 (0 = per layer)")
        nr = self.null_rows
        if nr is not None and (isinstance(nr, bool) or not isinstance(nr, int) or nr < 1):
            raise _err(
                "null_rows", f"must be None or an int >= 1, got {nr!r}", "pass e.g. 256 (None = all rows)"
            )
        fr = self.fit_rows
        if fr is not None and (isinstance(fr, bool) or not isinstance(fr, int) or fr < 2):
            raise _err(
                "fit_rows", f"must be None or an int >= 2, got {fr!r}", "pass e.g. 256 (None = all rows)"
            )
        cs = self.chunk_size
        if cs is not None and (isinstance(cs, bool) or not isinstance(cs, int) or cs < 1):
            raise _err("chunk_size", f"must be None or an int >= 1, got {cs!r}", "pass e.g. 1024")
        if self.store_maps and not self.record_statistics:
            raise _err(
                "store_maps",
                "needs statistics to be recorded",
                "pass statistics=True (the default in observe mode)",
            )
        if not self.store_maps:
            for name in ("map_layers", "map_steps", "map_heads"):
                if getattr(self, name) is not None:
                    raise _err(name, "has no effect without store_maps=True", "pass store_maps=True")
        if self.heads is not None and self.map_heads is not None:
            missing = sorted(set(self.map_heads) - set(self.heads))
            if missing:
                raise _err(
                    "map_heads",
                    f"selects heads {missing} that `heads` excludes",
                    "keep map_heads a subset of heads",
                )

    @classmethod
    def field_names(cls) -> set[str]:
        """Names of the user options (excluding the internal ``extra``)."""
        return {f for f in cls.__dataclass_fields__ if f != "extra"}

    @classmethod
    def from_kwargs(cls, **kwargs: Any) -> NWProcessorConfig:
        """Build a config, reporting an unknown keyword as a ``ValueError`` naming it."""
        known = cls.field_names()
        unknown = {k: v for k, v in kwargs.items() if k not in known}
        return cls(**{k: v for k, v in kwargs.items() if k in known}, extra=unknown)

    @property
    def record_statistics(self) -> bool:
        """Whether statistics are recorded (``statistics`` resolved against ``mode``)."""
        return self.mode == "observe" if self.statistics is None else self.statistics

    def to_dict(self) -> dict[str, Any]:
        """JSON-friendly dict of the options (tuples become lists)."""
        d = asdict(self)
        d.pop("extra")
        return {k: list(v) if isinstance(v, tuple) else v for k, v in d.items()}
