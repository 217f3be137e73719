"""Heat maps of the image branch per image token, from a recorder's maps in memory (DAAM style).

With ``store_maps=True`` the recorder keeps, per (call, step, layer, adapter, image), the
image-branch attention ``A`` and the NW weights ``W``, each ``[batch rows, heads (1 with
head-mean), query positions, image tokens]``, named
``call{c}/step{s}/{layer}/adapter{a}/image{i}/{attn|nw}`` (:meth:`NWRecorder.maps`; the same
names in a ``maps.safetensors`` file). Column ``k`` of a map, laid out on the query grid, shows
where in the generated image image token ``k`` is attended to.

- :func:`heat_maps` gives one :class:`TokenHeatMaps` (``[tokens, grid_h, grid_w]``) of ``A``,
  ``W`` or ``A - W``, averaged over the chosen steps, layers and heads, from a recorder (no file
  written) or from loaded arrays;
- :meth:`TokenHeatMaps.plot_overlay` draws each token's map over an image (the generated image
  or an x0 estimate), on one colour scale for every token with the uniform level ``1 / tokens``
  marked on its labelled colour bar.

Averaging: per selected map, the batch row (default the last: the conditional half under
classifier-free guidance), the mean over the chosen heads, the query rows laid out on their grid
and upsampled (nearest, an exact integer factor) to the finest selected grid; then the mean over
the selected (step, layer) maps.

Example:
    >>> rec = pipe.set_ip_adapter_nw_processor(store_maps=True)  # doctest: +SKIP
    >>> image = pipe("a photograph", ip_adapter_image=ref).images[0]  # doctest: +SKIP
    >>> maps = heat_maps(rec, "attn", steps=[0, 5])  # doctest: +SKIP
    >>> maps.plot_overlay(image, alpha=0.6)  # a matplotlib Figure  # doctest: +SKIP
"""

from __future__ import annotations

import math
import re
from collections.abc import Collection, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

MAP_NAME = re.compile(r"^call(\d+)/step(\d+)/(.+)/adapter(\d+)/image(\d+)/(attn|nw)$")
"""Names of the stored maps (see the module docstring)."""

KINDS: tuple[str, ...] = ("attn", "nw", "diff")
"""``attn``: the attention A; ``nw``: the NW weights W; ``diff``: A - W (drawn as "A - NW")."""


@dataclass(frozen=True)
class MapKey:
    """Where one stored map comes from."""

    call: int
    step: int
    layer: str
    adapter: int
    image: int
    kind: str  # "attn" or "nw"


def parse_map_name(name: str) -> MapKey | None:
    """The :class:`MapKey` of a stored map's name, or None for other names."""
    match = MAP_NAME.match(name)
    if not match:
        return None
    call, step, layer, adapter, image, kind = match.groups()
    return MapKey(int(call), int(step), layer, int(adapter), int(image), kind)


def _as_array(value: object) -> np.ndarray:
    if hasattr(value, "detach"):  # a torch tensor (NWRecorder.maps())
        value = value.detach().float().cpu().numpy()
    return np.asarray(value, dtype=np.float64)


def query_grid(rows: int, image_hw: tuple[int, int]) -> tuple[int, int]:
    """``(grid_h, grid_w)`` with ``grid_h * grid_w == rows`` and the image's aspect ratio.

    Raises:
        ValueError: No integer grid of that aspect ratio has ``rows`` cells.
    """
    grid_h = max(1, round(math.sqrt(rows * image_hw[0] / image_hw[1])))
    grid_w = rows // grid_h
    if grid_h * grid_w != rows:
        raise ValueError(
            f"maps: {rows} query positions do not form a grid of the image's aspect ratio {image_hw}; "
            "pass image_hw=(height, width) of the generated image"
        )
    return grid_h, grid_w


def upsample(array: np.ndarray, shape: tuple[int, int]) -> np.ndarray:
    """Nearest-neighbour upsampling of ``[..., h, w]`` to ``[..., H, W]`` (H, W multiples of h, w)."""
    h, w = array.shape[-2:]
    fy, fx = shape[0] // h, shape[1] // w
    if fy * h != shape[0] or fx * w != shape[1]:
        raise ValueError(f"upsample: {shape} is not an integer multiple of {(h, w)}")
    return np.repeat(np.repeat(array, fy, axis=-2), fx, axis=-1)


def stored_keys(maps: Mapping[str, object]) -> list[MapKey]:
    """The :class:`MapKey` of every stored map (other names are ignored)."""
    return [key for key in map(parse_map_name, maps) if key is not None]


def select_maps(
    maps: Mapping[str, object],
    kind: str = "attn",
    *,
    steps: Collection[int] | None = None,
    layers: Collection[str] | None = None,
    adapter: int = 0,
    image: int = 0,
) -> dict[MapKey, np.ndarray]:
    """The stored maps of one kind (``attn`` or ``nw``), filtered by step and layer-name prefix.

    Raises:
        ValueError: an unknown kind, or ``steps`` / ``layers`` that are not collections of step
            indices / layer-name prefixes (:func:`check_filters`).
    """
    if kind not in ("attn", "nw"):
        raise ValueError(f"kind must be 'attn' or 'nw', got {kind!r}")
    check_filters(steps=steps, layers=layers, adapter=adapter, image=image)
    chosen = {}
    for name, value in maps.items():
        key = parse_map_name(name)
        if key is None or key.kind != kind or key.adapter != adapter or key.image != image:
            continue
        if steps is not None and key.step not in steps:
            continue
        if layers is not None and not any(key.layer.startswith(prefix) for prefix in layers):
            continue
        chosen[key] = _as_array(value)
    return chosen


def _is_index(value: object) -> bool:
    return not isinstance(value, bool) and isinstance(value, int | np.integer)


def check_filters(
    *,
    steps: object = None,
    layers: object = None,
    heads: object = None,
    batch_row: object = -1,
    adapter: object = 0,
    image: object = 0,
) -> None:
    """Refuse, in one line naming the parameter, a selection of the wrong type: ``steps`` and
    ``heads`` must be None or collections of whole numbers (``steps=0`` is ``steps=[0]`` spelled
    wrong; every step index is >= 0), ``layers`` None or a collection of name prefixes (a bare
    string would be read letter by letter), ``batch_row``, ``adapter`` and ``image`` whole numbers.

    Raises:
        ValueError: the first parameter of the wrong type or value.
    """
    for name, value, example in (("steps", steps, "[0, 5]"), ("heads", heads, "[0]")):
        if value is None:
            continue
        if isinstance(value, str | bytes) or not isinstance(value, Collection):
            raise ValueError(
                f"{name} must be a list of whole numbers (e.g. {name}={example}) or None, got {value!r}"
            )
        wrong = [v for v in value if not _is_index(v) or (name == "steps" and v < 0)]
        if wrong:
            raise ValueError(
                f"{name}={list(value)}: {wrong[0]!r} is not a {name[:-1]} index (a whole number >= 0)"
            )
    if layers is not None and (
        isinstance(layers, str | bytes)
        or not isinstance(layers, Collection)
        or not all(isinstance(v, str) for v in layers)
    ):
        raise ValueError(
            f"layers must be a list of layer-name prefixes (e.g. layers=['up_blocks']) or None, "
            f"got {layers!r}"
        )
    for name, value in (("batch_row", batch_row), ("adapter", adapter), ("image", image)):
        if not _is_index(value) or (name != "batch_row" and value < 0):
            raise ValueError(
                f"{name} must be a whole number{'' if name == 'batch_row' else ' >= 0'}, got {value!r}"
            )


def _no_match(
    maps: Mapping[str, object], kind: str, steps: Any, layers: Any, adapter: int, image: int
) -> str:
    keys = stored_keys(maps)
    if not keys:
        return (
            "no maps are stored; pass store_maps=True to set_ip_adapter_nw_processor (--store-maps on "
            "the command line) and run the pipeline"
        )
    stored_steps = ", ".join(map(str, sorted({k.step for k in keys})))
    stored_layers = ", ".join(sorted({k.layer for k in keys}))
    pairs = ", ".join(f"{a}/{i}" for a, i in sorted({(k.adapter, k.image) for k in keys}))
    return (
        f"no stored {kind} maps match steps={None if steps is None else sorted(steps)}, "
        f"layers={None if layers is None else list(layers)}, adapter={adapter}, image={image}; "
        f"stored steps: {stored_steps}; stored layers: {stored_layers}; adapter/image: {pairs}"
    )


def token_maps(
    maps: Mapping[str, object],
    kind: str = "attn",
    *,
    image_hw: tuple[int, int],
    steps: Collection[int] | None = None,
    layers: Collection[str] | None = None,
    heads: Collection[int] | None = None,
    batch_row: int = -1,
    adapter: int = 0,
    image: int = 0,
) -> np.ndarray:
    """Per-token maps ``[tokens, grid_h, grid_w]`` of A (``attn``) or W (``nw``), averaged over
    the selected steps, layers and heads (see the module docstring).

    ``out[k, y, x]`` is the weight query position ``(y, x)`` gives image token ``k``.

    Args:
        maps: :meth:`NWRecorder.maps` or the arrays of a ``maps.safetensors`` file.
        kind: ``"attn"`` or ``"nw"``.
        image_hw: ``(height, width)`` of the generated image (for the grid's aspect ratio).
        steps: step indices to average (default: all stored).
        layers: layer-name prefixes to average (default: all stored).
        heads: head positions within the stored head axis (default: all).
        batch_row: batch row (default -1, the conditional row under CFG).
        adapter, image: IP-Adapter and adapter-image index.

    Raises:
        ValueError: a selection of the wrong type (:func:`check_filters`), or nothing matches the
            selection (the message lists what is stored).
    """
    check_filters(steps=steps, layers=layers, heads=heads, batch_row=batch_row, adapter=adapter, image=image)
    chosen = select_maps(maps, kind, steps=steps, layers=layers, adapter=adapter, image=image)
    if not chosen:
        raise ValueError(f"token_maps: {_no_match(maps, kind, steps, layers, adapter, image)}")
    grids = []
    for array in chosen.values():
        _check_selection(array.shape, heads=heads, batch_row=batch_row)
        head_axis = array[batch_row]  # [H, rows, tokens]
        if heads is not None:
            head_axis = head_axis[sorted(set(heads))]
        mean = head_axis.mean(axis=0)  # [rows, tokens]
        gh, gw = query_grid(mean.shape[0], image_hw)
        grids.append(mean.T.reshape(mean.shape[1], gh, gw))
    finest = max((g.shape[1:] for g in grids), key=lambda s: s[0] * s[1])
    return np.stack([upsample(g, finest) for g in grids]).mean(axis=0)


def _check_selection(shape: tuple[int, ...], *, heads: Collection[int] | None, batch_row: int) -> None:
    """Refuse, in one line naming the parameter and its valid range, a head or batch row that a
    stored map ``[batch rows, heads, query positions, image tokens]`` of ``shape`` does not have.

    Heads are positions 0..H-1 within the stored head axis (no negative positions: ``heads=[-1]``
    would silently be the last head); ``batch_row`` counts from the end when negative, as in numpy.
    """
    rows, stored = shape[0], shape[1]
    if not -rows <= batch_row < rows:
        raise ValueError(
            f"batch_row={batch_row} is out of range: the stored maps have {rows} batch row(s) "
            f"(0..{rows - 1}, or -{rows}..-1 from the end; under CFG the last is the conditional one)"
        )
    if heads is None:
        return
    chosen = list(heads)
    if not chosen:
        raise ValueError(f"heads=[] selects no head; pass positions in 0..{stored - 1}, or None for all")
    bad = [
        h for h in chosen
        if isinstance(h, bool) or not isinstance(h, (int, np.integer)) or not 0 <= h < stored
    ]  # fmt: skip
    if bad:
        hint = " (maps stored with map_head_mean=True keep one, the mean)" if stored == 1 else ""
        raise ValueError(
            f"heads={chosen}: {bad[0]!r} is not a stored head; the stored maps have {stored} head(s), "
            f"positions 0..{stored - 1}{hint}"
        )


@dataclass(frozen=True)
class TokenHeatMaps:
    """Heat maps of one kind per image token, averaged over a selection of steps, layers, heads.

    Attributes:
        kind: ``"attn"`` (A), ``"nw"`` (W) or ``"diff"`` (A - W).
        values: ``[tokens, grid_h, grid_w]`` float64.
        steps: the steps averaged. layers: the layers averaged.
        uniform: the value of a query that spreads its weight evenly, ``1 / tokens`` (0 for diff).
            Summed over tokens, every query's A (and W) is 1, so the mean over tokens is exactly
            this level everywhere: the information is in how the tokens share it.
    """

    kind: str
    values: np.ndarray
    steps: tuple[int, ...]
    layers: tuple[str, ...]
    uniform: float

    @property
    def num_tokens(self) -> int:
        return int(self.values.shape[0])

    def token(self, k: int) -> np.ndarray:
        """``[grid_h, grid_w]``: the map of image token ``k``."""
        if not -self.num_tokens <= k < self.num_tokens:
            raise IndexError(f"token {k} out of range: these maps have {self.num_tokens} image tokens")
        return self.values[k]

    def mean(self) -> np.ndarray:
        """``[grid_h, grid_w]``: the mean over tokens (``uniform`` everywhere for A and W, see above)."""
        return self.values.mean(axis=0)

    def dominant(self) -> np.ndarray:
        """``[grid_h, grid_w]`` int: the image token with the largest value at each query position."""
        return self.values.argmax(axis=0)

    def normalized(self) -> np.ndarray:
        """``[tokens, grid_h, grid_w]``: each token's map divided by its largest absolute value."""
        scale = np.abs(self.values).reshape(self.num_tokens, -1).max(axis=1)
        return self.values / np.where(scale > 0, scale, 1.0)[:, None, None]

    def resized(self, hw: tuple[int, int]) -> np.ndarray:
        """``[tokens, H, W]``: the maps bilinearly resized to an image's pixels (for overlays)."""
        return resize_map(self.values, hw)

    def plot_overlay(
        self,
        image: Any,
        *,
        tokens: Collection[int] | None = None,
        alpha: float = 0.6,
        columns: int = 4,
        title: str | None = None,
        reference: str | None = None,
        width_inches: float = 7.0,
    ):
        """Each token's map over ``image``, one panel per token, on one colour scale for all.

        One diverging colour map, centred on the level that means "no preference": for A and W
        the uniform level ``1 / tokens`` (red: the token draws more than an even share of the
        query's weight there, blue: less), for A - NW zero (red: attention above NW). The scale
        is symmetric about that centre, as wide as the largest deviation of any shown token, and
        shared by every panel, so tokens compare; one labelled colour bar under the panels.

        Args:
            image: the generated image or an x0 estimate, drawn in grey beneath the maps: a PIL
                image, or an array / tensor ``[H, W]``, ``[H, W, C]`` or ``[C, H, W]`` (integers
                0-255, floats [0, 1]; the rule: :func:`grey_image`).
            tokens: which tokens (default all).
            alpha: opacity of the heat map (0 = only the image, 1 = only the map).
            columns: panels per row.
            title: the figure's title (default: what is drawn, the reference, steps and layers).
            reference: the reference image's name, for the default title.
            width_inches: the figure's width (7 in: a paper's full width; 3.5 in: a column).

        Returns:
            A :class:`matplotlib.figure.Figure` (no pyplot state touched; ``fig.savefig(path)``).

        Raises:
            ValueError: ``alpha`` outside [0, 1], no tokens, or an image :func:`grey_image` refuses.
            IndexError: a token these maps do not have (the message names ``tokens`` and the range).
        """
        from matplotlib.figure import Figure

        from nw_adapter.analysis.records import wrap_title

        if not 0.0 <= alpha <= 1.0:
            raise ValueError(f"alpha must be in [0, 1], got {alpha}")
        grey = grey_image(image)
        chosen = list(range(self.num_tokens)) if tokens is None else [int(k) for k in tokens]
        if not chosen:
            raise ValueError(f"tokens=[] selects no token; pass indices in 0..{self.num_tokens - 1}, or None")
        for k in chosen:
            if not -self.num_tokens <= k < self.num_tokens:
                raise IndexError(
                    f"tokens: token {k} is out of range; these maps have {self.num_tokens} image tokens "
                    f"(0..{self.num_tokens - 1})"
                )
        heat = self.resized(grey.shape)
        cols = max(1, min(columns, len(chosen)))
        rows = math.ceil(len(chosen) / cols)
        centre = self.uniform
        spread = max(float(np.abs(heat[k] - centre).max()) for k in chosen) or 1e-12
        label = {"attn": "attention A", "nw": "NW weights W", "diff": "A - NW (attention minus NW weights)"}[
            self.kind
        ]
        centre_text = (
            "white = 0, red: A above NW" if centre == 0 else f"white = uniform share 1/{self.num_tokens}"
        )
        heading = title or (
            (f"reference {reference}: " if reference else "")
            + f"{label} per image token ({centre_text}); steps {_span(self.steps)}, "
            f"{len(self.layers)} layer{'' if len(self.layers) == 1 else 's'}; one colour scale for all tokens"
        )
        heading = wrap_title(heading, width_inches - 0.2, 8)
        cell = width_inches / cols
        fig = Figure(
            figsize=(width_inches, cell * rows + 0.35 + 0.13 * heading.count("\n") + 0.65),
            layout="constrained",
        )
        axes = fig.subplots(rows, cols, squeeze=False)
        for ax in axes.flat[len(chosen) :]:
            ax.set_visible(False)
        shown = None
        for ax, k in zip(axes.flat, chosen, strict=False):
            shown = draw_overlay(ax, grey, heat[k], centre=centre, spread=spread, alpha=alpha)
            ax.set_title(f"token {k}", fontsize=8)
        used = [ax for ax in axes.flat if ax.get_visible()]
        bar = fig.colorbar(shown, ax=used, location="bottom", shrink=0.8, aspect=35, pad=0.02)
        bar.set_ticks([centre - spread, centre, centre + spread])
        bar.set_ticklabels(
            [
                f"{centre - spread:.3g}",
                "0" if centre == 0 else f"1/{self.num_tokens}",
                f"{centre + spread:.3g}",
            ]
        )
        bar.ax.tick_params(labelsize=7)
        what = "A - NW" if self.kind == "diff" else "weight on the token"
        bar.set_label(f"{what} ({centre_text})", fontsize=7)
        fig.suptitle(heading, fontsize=8)
        return fig


def _span(steps: tuple[int, ...]) -> str:
    if not steps:
        return "-"
    return str(steps[0]) if len(steps) == 1 else f"{steps[0]}-{steps[-1]} ({len(steps)})"


def draw_overlay(ax: Any, grey: np.ndarray, data: np.ndarray, *, centre: float, spread: float, alpha: float):
    """Draw ``data`` ``[H, W]`` (already at the image's pixels) over the grey image ``grey``
    ``[H, W]`` on the matplotlib axes ``ax``: a diverging map ``centre +- spread`` (white = centre)
    at opacity ``alpha``, no ticks. Returns the mappable, for a colour bar."""
    ax.imshow(grey, cmap="gray", vmin=0.0, vmax=1.0, interpolation="nearest")
    shown = ax.imshow(
        data, cmap="RdBu_r", vmin=centre - spread, vmax=centre + spread, alpha=alpha, interpolation="nearest"
    )
    ax.set_xticks([])
    ax.set_yticks([])
    return shown


def resize_map(data: np.ndarray, hw: tuple[int, int]) -> np.ndarray:
    """``[..., h, w]`` -> ``[..., H, W]``: bilinear resizing of maps to an image's pixels."""
    import torch
    import torch.nn.functional as F

    grid = torch.from_numpy(np.ascontiguousarray(data, dtype=np.float64)).reshape(-1, 1, *data.shape[-2:])
    out = F.interpolate(grid, size=hw, mode="bilinear", align_corners=False)
    return out.reshape(*data.shape[:-2], *hw).numpy()


CHANNEL_SIZES = (1, 3, 4)
"""Sizes of a channel axis (grey, RGB, RGBA) :func:`grey_image` recognises."""

FLOAT_TOLERANCE = 0.01
"""How far outside [0, 1] a float image may reach (rounding of a decoder's output) before it is refused."""


def _image_array(image: Any) -> np.ndarray:
    """``[H, W]`` or ``[H, W, C]`` from a PIL image, an array or a tensor (HWC or CHW, see
    :func:`grey_image`)."""
    if hasattr(image, "convert"):
        return np.asarray(image.convert("L"), dtype=np.uint8)
    if hasattr(image, "detach"):  # a torch tensor
        image = image.detach().cpu().numpy()
    array = np.asarray(image)
    if array.ndim == 4 and array.shape[0] == 1:
        array = array[0]
    if array.ndim == 3:
        if array.shape[-1] in CHANNEL_SIZES:
            return array
        if array.shape[0] in CHANNEL_SIZES:
            return np.moveaxis(array, 0, -1)
    if array.ndim == 2:
        return array
    raise ValueError(
        f"image: expected a PIL image or an [H, W], [H, W, C] or [C, H, W] array or tensor with C in "
        f"{CHANNEL_SIZES}, got shape {tuple(array.shape)}"
    )


def grey_image(image: Any) -> np.ndarray:
    """``[H, W]`` float64 in [0, 1]: the image in grey, to draw maps over.

    The rule, by type:

    - a PIL image: its luminance (``convert("L")``), 0-255;
    - an array or tensor ``[H, W]``, ``[H, W, C]`` or ``[C, H, W]`` (C in 1, 3, 4; a leading batch
      axis of 1 is dropped): the channel axis is the last if its size is 1, 3 or 4, else the first
      (so torch's CHW images work); colour is the mean of the first three channels;
    - integer values are 0-255 (refused outside it); float values are [0, 1]: within
      :data:`FLOAT_TOLERANCE` outside it they are clipped with a warning, further out they are
      refused (a float image in 0-255: divide it by 255 or pass uint8). The range is never guessed
      from the maximum.

    Raises:
        ValueError: another shape, an image without pixels, a non-finite value, or values outside
            the type's range.
    """
    import warnings

    array = _image_array(image)
    if array.shape[0] == 0 or array.shape[1] == 0:
        raise ValueError(f"image: has no pixels (shape {tuple(array.shape)}); pass the generated image")
    if array.dtype == bool:
        array = array.astype(np.float64)
    if not (np.issubdtype(array.dtype, np.integer) or np.issubdtype(array.dtype, np.floating)):
        raise ValueError(f"image: expected numbers, got dtype {array.dtype}")
    values = array.astype(np.float64)
    if values.ndim == 3:
        values = values[..., :3].mean(axis=-1)
    if not np.isfinite(values).all():
        raise ValueError("image: has NaN or infinite values; pass a finite image")
    low, high = float(values.min()), float(values.max())
    if np.issubdtype(array.dtype, np.integer):
        if low < 0 or high > 255:
            raise ValueError(f"image: integer values are read as 0-255, got {low:g}..{high:g}")
        return values / 255.0
    if low < -FLOAT_TOLERANCE or high > 1 + FLOAT_TOLERANCE:
        raise ValueError(
            f"image: float values are read as [0, 1], got {low:.4g}..{high:.4g}; divide a 0-255 image "
            "by 255 (or pass uint8), map a [-1, 1] image with (x + 1) / 2"
        )
    if low < 0 or high > 1:
        warnings.warn(
            f"image: float values {low:.4g}..{high:.4g} slightly outside [0, 1] were clipped", stacklevel=3
        )
    return np.clip(values, 0.0, 1.0)


def heat_maps(
    source: Any,
    kind: str = "attn",
    *,
    steps: Collection[int] | None = None,
    layers: Collection[str] | None = None,
    heads: Collection[int] | None = None,
    batch_row: int = -1,
    adapter: int = 0,
    image: int = 0,
    image_hw: tuple[int, int] | None = None,
) -> TokenHeatMaps:
    """Heat maps per image token of A, W or A - W from a recorder (in memory) or loaded maps.

    Args:
        source: an :class:`~nw_adapter.integration.recorder.NWRecorder` that ran with
            ``store_maps=True``, or ``{name: array}`` (``load_maps`` of a ``maps.safetensors``).
        kind: ``"attn"``, ``"nw"`` or ``"diff"`` (A - W).
        steps, layers, heads, batch_row, adapter, image: the selection (see :func:`token_maps`).
        image_hw: the generated image's ``(height, width)``; default: the recorder's latent grid
            (square for loaded maps).

    Raises:
        ValueError: an unknown kind, or nothing matches (the message lists the stored steps,
            layers, adapters and images).
    """
    if kind not in KINDS:
        raise ValueError(f"kind must be one of {', '.join(KINDS)}, got {kind!r}")
    check_filters(steps=steps, layers=layers, heads=heads, batch_row=batch_row, adapter=adapter, image=image)
    maps = source.maps() if hasattr(source, "maps") and callable(source.maps) else source
    if image_hw is None:
        latent = getattr(getattr(source, "state", None), "latent_hw", None)
        image_hw = tuple(latent) if latent else (1, 1)
    selection = dict(steps=steps, layers=layers, heads=heads, batch_row=batch_row)
    selection.update(adapter=adapter, image=image)
    parts = ("attn", "nw") if kind == "diff" else (kind,)
    values = [token_maps(maps, part, image_hw=image_hw, **selection) for part in parts]
    chosen = select_maps(maps, parts[0], steps=steps, layers=layers, adapter=adapter, image=image)
    tokens = values[0].shape[0]
    return TokenHeatMaps(
        kind=kind,
        values=values[0] - values[1] if kind == "diff" else values[0],
        steps=tuple(sorted({k.step for k in chosen})),
        layers=tuple(sorted({k.layer for k in chosen})),
        uniform=0.0 if kind == "diff" else 1.0 / tokens,
    )
