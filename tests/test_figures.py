"""Every figure of the README, the docs and both command lines, drawn from small synthetic data and
checked as a paper would print it: at a column's or a page's width, no text past the canvas,
one colour scale shared where panels are to be compared (with a labelled colour bar), an
interval over the independent units where there are several, a legend that names what is drawn.
"""

from __future__ import annotations

import math

import matplotlib
import numpy as np
import pytest
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.collections import PolyCollection
from matplotlib.colors import to_rgba
from matplotlib.container import ErrorbarContainer
from matplotlib.lines import Line2D
from PIL import Image

from nw_adapter.analysis.records import Records

PAGE_INCHES = 7.0
LAYERS = ("down_blocks.0.a", "mid_block.a", "up_blocks.1.a")
SD3_WARNING = (
    "tiny-sd3, 3 steps, bandwidth matched, 1 reference; WARNING: random weights (an untrained "
    "model built in-process): every number here is a property of the architecture, not of a trained "
    "model; pass a real model for a reading of the paper's claim"
)


def drawn_texts(fig) -> list[tuple[str, object]]:
    """``(text, window extent)`` of every text artist the canvas draws (not ticks out of view)."""
    canvas = fig.canvas if hasattr(fig.canvas, "get_renderer") else FigureCanvasAgg(fig)
    canvas.draw()
    renderer = canvas.get_renderer()
    undrawn = set()
    for ax in fig.axes:
        for axis in (ax.xaxis, ax.yaxis):
            drawn = set(axis._update_ticks())
            for tick in (*axis.majorTicks, *axis.minorTicks):
                if tick not in drawn:
                    undrawn.update((tick.label1, tick.label2))
    out = []
    for text in fig.findobj(matplotlib.text.Text):
        if text in undrawn or not text.get_visible() or not text.get_text().strip():
            continue
        if text.axes is not None and not text.axes.get_visible():
            continue
        out.append((text.get_text(), text.get_window_extent(renderer)))
    return out


def overflowing_texts(fig) -> list[str]:
    """The drawn text artists whose window extent leaves the canvas (a pixel of slack)."""
    width, height = fig.bbox.width, fig.bbox.height
    return [
        text for text, box in drawn_texts(fig)
        if box.x0 < -1 or box.y0 < -1 or box.x1 > width + 1 or box.y1 > height + 1
    ]  # fmt: skip


def overlapping_texts(fig) -> list[tuple[str, str]]:
    """Pairs of drawn texts that cover each other (more than 2 pixels each way)."""
    texts = drawn_texts(fig)
    pairs = []
    for i, (a, box_a) in enumerate(texts):
        for b, box_b in texts[i + 1 :]:
            dx = min(box_a.x1, box_b.x1) - max(box_a.x0, box_b.x0)
            dy = min(box_a.y1, box_b.y1) - max(box_a.y0, box_b.y0)
            if dx > 2 and dy > 2:
                pairs.append((a, b))
    return pairs


def assert_printable(fig, max_width: float = PAGE_INCHES) -> None:
    """At most a page wide, every text inside the canvas and clear of the others, no font under 5.5 pt."""
    assert fig.get_figwidth() <= max_width + 1e-9
    assert overflowing_texts(fig) == []
    assert overlapping_texts(fig) == []
    sizes = [t.get_fontsize() for t in fig.findobj(matplotlib.text.Text) if t.get_text().strip()]
    assert min(sizes) >= 5.5


def make_records(
    references: int = 3,
    steps: int = 6,
    seed: int = 0,
    timesteps=None,
    spread: float = 0.05,
    control: bool = True,
) -> list[dict]:
    """Command-line records (``reference`` key) of ``references`` images over ``steps`` steps
    (``timesteps``: one per step, e.g. PNDM's repeated one; ``spread``: of rho across references)."""
    rng = np.random.default_rng(seed)
    timesteps = timesteps or [981.0 - 980.0 * step / (steps - 1) for step in range(steps)]
    records = []
    for ref in range(references):
        level = rng.normal(0, spread)
        for step, timestep in enumerate(timesteps):
            for layer in LAYERS:
                for head in range(2):
                    for half in ("uncond", "cond"):
                        h = 10.0 * 0.5**step
                        record = {
                            "reference": f"digit_{ref}-{ref:08x}", "call": 0, "step": step,
                            "timestep": float(timestep), "alpha": 0.5, "sigma": 0.5, "model": "tiny",
                            "h_schedule": h, "layer": layer, "block": layer.split("_")[0], "head": head,
                            "half": half, "adapter": 0, "image": 0, "scale": 1.0, "num_keys": 4,
                            "rho": min(1.0, 0.7 + level + rng.normal(0, 0.03)), "kl": 0.1,
                            "rho_perm_null": rng.normal(0, 0.05), "rho_norm_matched_null": 0.6 + level,
                            "rho_spread_null": 0.7 + level, "nw_gain": 0.01,
                            "h_eff": 3.0 * math.exp(rng.normal(0, 0.1)),
                            "logit_scale": 0.5 / h**2 * math.exp(rng.normal(0, 0.1)),
                        }  # fmt: skip
                        if control:
                            record.update({
                                "rho_control_0": 0.8 + level, "rho_control_1": 0.78 + level,
                                "key_scale_0": 1.2, "key_scale_1": 1.3,
                                "h_eff_control_0": 2.0 * math.exp(rng.normal(0, 0.1)),
                                "h_eff_control_1": 2.1 * math.exp(rng.normal(0, 0.1)),
                                "logit_scale_control_0": 2.0 * math.exp(rng.normal(0, 0.1)),
                                "logit_scale_control_1": 2.1 * math.exp(rng.normal(0, 0.1)),
                            })  # fmt: skip
                        records.append(record)
    return records


PNDM_TIMESTEPS = (981.0, 961.0, 961.0, 941.0, 500.0, 1.0)
"""PNDM's warm-up: its second timestep is evaluated twice (steps 1 and 2)."""


def cli_report(references: int = 3):
    from nw_adapter.correlate.report import build_report

    return build_report(make_records(references), config={"steps": 6}, images=[], versions={}, targets=())


def bands(ax) -> list[PolyCollection]:
    return [c for c in ax.collections if isinstance(c, PolyCollection)]


# rho.png, the README's headline figure, and rec.plot()


def test_rho_figure_has_a_band_over_references_one_rho_colour_and_fits_a_page() -> None:
    from nw_adapter.correlate.plotting import rho_figure

    report = cli_report(3)
    fig = rho_figure(report["blocks"], title="tiny, 6 steps, 3 references", units=report["records"],
                     half=report["half"])  # fmt: skip
    assert_printable(fig)
    panels = [ax for ax in fig.axes if ax.get_title()]
    assert [ax.get_title() for ax in panels] == ["down block", "mid block", "up block"]
    assert all(len(bands(ax)) == 1 for ax in panels)  # the t interval over the 3 references
    texts, handles = fig.legends[0].get_texts(), fig.legends[0].legend_handles
    legend = {t.get_text(): h for t, h in zip(texts, handles, strict=True)}
    assert "rho: 95% t interval over 3 references" in legend
    rho_colour = to_rgba(legend["rho (attention vs NW)"].get_color())
    for ax in panels:  # the legend's one rho colour is the colour of rho in every panel
        (rho,) = [line for line in ax.get_lines() if line.get_label() == "rho (attention vs NW)"]
        assert to_rgba(rho.get_color()) == rho_colour


def test_rho_figure_of_one_reference_has_no_band() -> None:
    from nw_adapter.correlate.plotting import rho_figure

    report = cli_report(1)
    fig = rho_figure(report["blocks"], units=report["records"], half=report["half"])
    assert not any(bands(ax) for ax in fig.axes)


def test_a_long_warning_title_of_a_one_panel_figure_is_wrapped_inside_the_canvas() -> None:
    """The tiny-sd3 / tiny-flux rho.png: one panel ("all IP layers") under a two-sentence warning."""
    from nw_adapter.correlate.plotting import rho_figure

    report = cli_report(1)
    rows = [{**r, "block": "other"} for r in report["blocks"]]
    fig = rho_figure(rows, title=SD3_WARNING, note="steps 1 and 2 share t=334 (PNDM: two calls)")
    assert fig.get_figwidth() <= 3.5
    assert_printable(fig)


def test_rec_plot_is_the_command_lines_rho_figure() -> None:
    records = Records(make_records(3))
    fig = records.plot()
    assert_printable(fig)
    panels = [ax for ax in fig.axes if ax.get_title()]
    assert [ax.get_title() for ax in panels] == ["down block", "mid block", "up block"]
    assert all(len(bands(ax)) == 1 for ax in panels)


def test_summary_prints_the_command_lines_columns_notes_and_legend() -> None:
    from nw_adapter.correlate.report import format_legend, format_table

    summary = Records(make_records(2, steps=25)).summary()
    assert len(summary) == 50  # every (call, step, half) row is kept
    text = repr(summary)
    lines = text.splitlines()
    assert lines[0].startswith("cond half: mean over layers, heads, adapters and images per step")
    assert lines[1] == "control: untrained-adapter draws (kind not recorded), 2 draws"
    cond = [row for row in summary if row["half"] == "cond"]
    assert format_table(cond) in text and format_legend(cond) in text  # the command line's, to the character
    assert lines[2].split()[:3] == ["step", "timestep", "rho"] and "rho-ctrl" in lines[2]
    assert len(lines) == 2 + 1 + 25 + 1 + len(lines[2].split())  # notes, header, steps, legend of each column
    assert summary[0]["key_scale"] == pytest.approx(math.sqrt(1.2 * 1.3))  # geometric mean over draws
    assert summary.table(half="uncond").startswith("uncond half")


def test_summary_without_a_control_neither_prints_nor_defines_its_columns() -> None:
    text = repr(Records(make_records(2, control=False)).summary())
    assert "rho-ctrl" not in text and "gain-ctrl" not in text
    assert "control: none recorded" in text


def test_summary_and_rec_plot_carry_the_pndm_note_the_command_line_prints() -> None:
    from nw_adapter.correlate.report import build_report, repeated_timestep_note

    records = Records(make_records(2, timesteps=PNDM_TIMESTEPS))
    records.context = {"scheduler": "PNDMScheduler", "bandwidth": "matched", "control": "per-layer"}
    config = {"steps": 5, "scheduler_class": "PNDMScheduler"}
    cli = repeated_timestep_note(build_report(list(records), config=config, images=[], versions={}))
    note = "PNDMScheduler calls the denoiser twice at one timestep (steps 1 and 2 share t=961)"
    assert cli.startswith(note)
    assert f"note: {note}" in repr(records.summary())
    assert note in " ".join(records.plot()._suptitle.get_text().split())


def test_rho_figure_under_pndm_neither_pools_the_shared_timestep_nor_doubles_the_references() -> None:
    """Two references, PNDM's two calls at one timestep: the band is over 2 references (not 4), and
    every line runs over the steps, the two calls side by side (no vertical jump at one x)."""
    from matplotlib.collections import PolyCollection

    records = Records(make_records(2, timesteps=PNDM_TIMESTEPS))
    fig = records.plot()
    assert_printable(fig)
    legend = [t.get_text() for t in fig.legends[0].get_texts()]
    assert "rho: 95% t interval over 2 references" in legend
    for ax in (ax for ax in fig.axes if ax.get_title()):
        (rho,) = [line for line in ax.get_lines() if line.get_label() == "rho (attention vs NW)"]
        x = rho.get_xdata()
        assert list(x) == list(range(len(PNDM_TIMESTEPS)))  # one point per denoiser call
        (band,) = [c for c in ax.collections if isinstance(c, PolyCollection)]
        assert len({round(v[0], 6) for v in band.get_paths()[0].vertices}) == len(PNDM_TIMESTEPS)
        labels = [t.get_text() for t in ax.get_xticklabels()]
        assert labels[0] == "0\nt=981" and labels[-1] == "5\nt=1"  # each tick names its timestep


def test_a_band_reaching_past_rhos_range_is_cut_marked_and_inside_the_axes() -> None:
    records = make_records(2, spread=0.0)
    for record in records:  # references 0.2 apart: the t interval over 2 reaches past 1 (and far below)
        record["rho"] = 0.75 if record["reference"].startswith("digit_0") else 0.95
    fig = Records(records).plot()
    legend = [t.get_text() for t in fig.legends[0].get_texts()]
    assert "interval cut at rho's range [-1, 1]" in legend
    for ax in (ax for ax in fig.axes if ax.get_title()):
        low, high = ax.get_ylim()
        for band in bands(ax):
            ys = band.get_paths()[0].vertices[:, 1]
            assert low <= ys.min() and ys.max() <= high  # the axes hold the whole band


def test_rec_plot_has_the_command_lines_title_and_names_its_control() -> None:
    from nw_adapter.correlate.plotting import report_rho_figure
    from nw_adapter.correlate.report import build_report

    records = Records(make_records(3))
    records.context = {"bandwidth": "matched", "control": "per-layer"}
    config = {"steps": 6, "bandwidth": "matched", "model": {"model": "tiny"}}
    report = build_report(list(records), config=config, images=[{}] * 3, versions={}, targets=(),
                          control={"kind": "per-layer", "draws": 2})  # fmt: skip
    ours, cli = records.plot()._suptitle.get_text(), report_rho_figure(report)._suptitle.get_text()
    assert ours == cli
    assert ours.splitlines()[0] == "tiny, 6 steps, bandwidth matched, 3 references"
    assert "control: scale-matched untrained keys in every layer" in " ".join(ours.split())
    end_to_end = {**report, "control": {"kind": "end-to-end", "draws": 2}}
    fig = report_rho_figure(end_to_end)
    assert "rho, end-to-end control (2 draws)" in [t.get_text() for t in fig.legends[0].get_texts()]
    assert "control: end-to-end" in " ".join(fig._suptitle.get_text().split())
    bare = Records(make_records(2, control=False)).plot()
    assert "control: none recorded" in " ".join(bare._suptitle.get_text().split())


def test_bandwidth_figure_fits_a_column_with_intervals_over_images() -> None:
    from matplotlib.container import ErrorbarContainer

    from nw_adapter.correlate.plotting import bandwidth_figure

    title = "tiny: bandwidth path (logit_scale vs schedule h), cond half"
    fig = bandwidth_figure(make_records(3), "cond", title=title)
    assert_printable(fig, max_width=3.5)
    bars = [c for c in fig.axes[0].containers if isinstance(c, ErrorbarContainer)]
    assert len(bars) == 2 and all(c.has_yerr for c in bars)  # trained and the control, t intervals over 3
    labels = fig.axes[0].get_legend_handles_labels()[1]
    assert any(label.startswith("scale-matched control (2 draws)") for label in labels)


# attention_maps.png and plot_overlay


def make_panels(steps=(0, 11, 49), tokens=(0, 1)):
    from nw_adapter.correlate.plotting import MapPanel

    rng = np.random.default_rng(0)
    panels = []
    for i, step in enumerate(steps):
        for token in tokens:
            scale = 0.05 * (1 + i + 3 * token)  # tokens and steps of very different ranges
            attn = 0.25 + scale * rng.standard_normal((8, 8))
            nw = 0.25 + 0.5 * scale * rng.standard_normal((8, 8))
            panels.append(MapPanel(step, 981.0 - 20 * step, token, attn, nw, ("up_blocks.1.a",), 0.25))
    return panels


def overlay_limits(fig) -> list[tuple[float, float]]:
    """``clim`` of every heat map drawn above a grey image."""
    return [ax.get_images()[1].get_clim() for ax in fig.axes if len(ax.get_images()) == 2]


def test_attention_maps_share_one_scale_per_kind_with_labelled_bars_and_name_the_reference() -> None:
    from nw_adapter.correlate.plotting import attention_maps_figure

    generated = Image.fromarray(np.full((32, 32, 3), 128, dtype=np.uint8))
    previews = {0: generated, 11: generated}
    fig = attention_maps_figure(generated, make_panels(), previews=previews, reference="digit_3-0a1b2c3d")
    assert_printable(fig)
    assert "digit_3-0a1b2c3d" in fig._suptitle.get_text()
    assert "the 2 most-attended of 4 image tokens" in " ".join(fig._suptitle.get_text().split())
    weights = [ax for ax in fig.axes if ax.get_title().startswith(("A\n", "NW\n"))]
    assert weights  # column titles on the first row
    limits = overlay_limits(fig)
    assert len(limits) == 3 * 2 * 3  # 3 steps x 2 tokens x (A, NW, A - NW)
    assert len(set(limits)) == 2  # one scale for every A and W panel, one for every A - NW panel
    bars = [ax for ax in fig.axes if hasattr(ax, "_colorbar")]
    assert len(bars) == 2 and all(ax._colorbar.ax.get_xlabel() or ax._colorbar.ax.get_ylabel() for ax in bars)
    assert not any("A - W" in t.get_text() for t in fig.findobj(matplotlib.text.Text))


@pytest.mark.parametrize("kind", ["attn", "diff"])
def test_overlay_shares_one_labelled_scale_across_tokens(kind: str) -> None:
    from nw_adapter.analysis.heatmaps import TokenHeatMaps

    rng = np.random.default_rng(1)
    values = 0.25 + rng.standard_normal((4, 8, 8)) * np.array([0.01, 0.05, 0.1, 0.2])[:, None, None]
    maps = TokenHeatMaps(kind, values if kind == "attn" else values - 0.25, (0, 2), ("up_blocks.1.a",),
                         0.25 if kind == "attn" else 0.0)  # fmt: skip
    fig = maps.plot_overlay(Image.fromarray(np.full((32, 32), 90, dtype=np.uint8)), reference="digit_3")
    assert_printable(fig)
    assert len(set(overlay_limits(fig))) == 1 and len(overlay_limits(fig)) == 4
    (bar,) = [ax for ax in fig.axes if hasattr(ax, "_colorbar")]
    assert bar.get_xlabel() or bar.get_ylabel()
    title = fig._suptitle.get_text()
    assert "digit_3" in title and ("A - NW" in title if kind == "diff" else "attention A" in title)


# the experiments' figures


def dims_rows() -> list[dict]:
    return [
        {"d": 2, "neff": 7.5, "neff_ci": [7.0, 8.1], "benefit": 0.52, "benefit_ci": [0.4, 0.6],
         "benefit_fixed": 0.5, "seeds": 3},
        {"d": 16, "neff": 2.1, "neff_ci": [1.8, 2.4], "benefit": -0.97, "benefit_ci": [-1.3, -0.6],
         "benefit_fixed": -0.56, "seeds": 3},
    ]  # fmt: skip


def head_sets(seeds: int = 2) -> list[tuple[str, list[dict]]]:
    """Rows as ``aggregate._heads_of`` writes them; with one seed every interval is NaN."""
    ts = [0.05, 0.2, 0.56, 0.99]

    def ci(mean: float) -> list[float]:
        return [mean - 0.05, mean + 0.05] if seeds >= 2 else [math.nan, math.nan]

    rows = []
    for i, label in enumerate(("dims d=2", "dims d=16", "shells d=8", "shells d=32")):
        means = {"rho_head": 0.8, "rho_data": 0.6 + 0.1 * i}
        means |= {"untrained_rho_head": 0.7, "untrained_rho_data": 0.01}
        rows.append(
            (
                label,
                [
                    {"t": t, "seeds": seeds, **means, **{f"{k}_ci": ci(v) for k, v in means.items()}}
                    for t in ts
                ],
            )
        )
    return rows  # fmt: skip


def data_lines(ax) -> list[Line2D]:
    """Lines joining two or more data points (not a horizontal reference line)."""
    return [
        line for line in ax.get_lines()
        if line.get_linestyle() not in ("None", "") and len(set(np.asarray(line.get_ydata(), float))) > 1
    ]  # fmt: skip


def test_dims_figure_draws_points_with_intervals_not_lines() -> None:
    from nw_adapter.experiments.report import dims_figure

    fig = dims_figure(dims_rows())
    assert_printable(fig)
    for ax in fig.axes:
        assert any(isinstance(c, ErrorbarContainer) for c in ax.containers)
        assert data_lines(ax) == []
        assert ax.get_legend() is not None


def test_shells_and_digits_figures_carry_intervals() -> None:
    from nw_adapter.experiments.report import digits_figure, shells_figure

    shells = shells_figure([
        {"d": d, "ratio": r, "ratio_ci": [r - 1, r + 1], "seeds": 3}
        for d, r in ((8, 4.2), (32, 5.8))
    ])  # fmt: skip
    assert_printable(shells, max_width=3.5)
    assert any(isinstance(c, ErrorbarContainer) for c in shells.axes[0].containers)
    digits = digits_figure([
        {"m": m, "mmd2_learned": 0.1 / m, "mmd2_plugin": 0.3 / m, "advantage": 0.2,
         "advantage_ci": [0.1, 0.3],
         "mmd2_learned_per_class": [0.09 / m, 0.1 / m, 0.11 / m],
         "mmd2_plugin_per_class": [0.28 / m, 0.3 / m, 0.33 / m]}
        for m in (1, 2, 5, 10, 25, 50)
    ])  # fmt: skip
    assert_printable(digits)
    assert sum(isinstance(c, ErrorbarContainer) for c in digits.axes[0].containers) == 2
    assert not data_lines(digits.axes[0]) and not data_lines(digits.axes[1])  # points, no lines
    assert all(ax.get_title() for ax in digits.axes)  # every panel titled
    assert any(isinstance(c, ErrorbarContainer) for c in digits.axes[1].containers)


def test_heads_figure_legend_matches_its_lines() -> None:
    from nw_adapter.experiments.report import heads_figure

    fig = heads_figure(head_sets())
    assert_printable(fig)
    drawn = {
        (to_rgba(line.get_color()), line.get_linestyle(), line.get_marker())
        for ax in fig.axes for line in ax.get_lines()
    }  # fmt: skip
    legend = fig.legends[0] if fig.legends else fig.axes[0].get_legend()
    shown = [
        (to_rgba(line.get_color()), line.get_linestyle(), line.get_marker())
        for line in legend.findobj(Line2D) if line.get_marker() not in ("None", "", None)
    ]  # fmt: skip
    assert len(shown) >= 2 * len(head_sets())  # each colour's trained and untrained style
    assert set(shown) <= drawn


def bar_heights(ax) -> list[float]:
    """Lengths of every vertical error bar drawn in ``ax``."""
    heights = []
    for container in ax.containers:
        if isinstance(container, ErrorbarContainer):
            for segments in container[2]:
                heights += [abs(seg[1][1] - seg[0][1]) for seg in segments.get_segments()]
    return heights


def test_heads_figure_draws_points_with_intervals_over_seeds() -> None:
    from nw_adapter.experiments.report import heads_figure

    fig = heads_figure(head_sets(seeds=2))
    for ax in fig.axes:
        bars = [c for c in ax.containers if isinstance(c, ErrorbarContainer)]
        assert len(bars) == 2 * len(head_sets()) and all(c.has_yerr for c in bars)  # trained, untrained
        assert min(bar_heights(ax)) == pytest.approx(0.1)  # each row's interval, as given
        assert data_lines(ax) == []  # points, no line between t values
        assert ax.get_title()
    title = fig.legends[0].get_title().get_text()
    assert "95% t interval over 2 training seeds" in title


def test_heads_figure_with_one_seed_draws_no_interval_and_says_so() -> None:
    from nw_adapter.experiments.report import heads_figure

    fig = heads_figure(head_sets(seeds=1))
    assert_printable(fig)
    assert all(h == 0 for ax in fig.axes for h in bar_heights(ax))
    assert "one training seed: no interval" in fig.legends[0].get_title().get_text()


# support sets: sets/<key>/mass.png and support_mass.png
def support_set_entry(m: int, classes: str, seed: int, steps: int = 8) -> dict:
    """A support set's JSON entry (``support_report.set_entry``'s layout) with synthetic masses."""
    rng = np.random.default_rng(seed)
    rows = []
    for step in range(steps):
        sharp = step / (steps - 1)
        nw = np.full(m, 1.0 / m) * (1 - sharp) + np.eye(m)[seed % m] * sharp
        mass = np.full(m, 1.0 / m) + rng.normal(0, 0.01, m)
        mass /= mass.sum()
        entropy = {"ref_row_entropy": 0.98 * math.log(m), "posterior_entropy_share": 1 - sharp}
        rows.append({"step": step, "mass": mass.tolist(), "posterior": nw.tolist(), **entropy})
    references = [{"file": f"refs/{seed}/digit_{r}.png", "clip_cosine": 0.5} for r in range(m)]
    entry = {"key": f"set{seed}", "num_refs": m, "classes": classes, "references": references}
    return {**entry, "steps": rows, "winner": 0}


def test_support_sweep_figure_fits_a_column_with_bands_over_sets() -> None:
    from nw_adapter.correlate.support_report import sweep_figure

    sets = [support_set_entry(2, "mixed", s) for s in range(3)] + [support_set_entry(4, "same", 9)]
    fig = sweep_figure({"sets": sets}, title="support sets, tiny")
    assert_printable(fig, max_width=3.5)
    top, bottom = fig.axes
    assert len(bands(top)) == 2 and len(bands(bottom)) == 2  # attention and posterior of the 3-set group
    labels = top.get_legend_handles_labels()[1]
    groups = ("m=2, mixed (3 sets)", "m=4, same (1 set)")
    assert labels == [f"{group}: {arm}" for group in groups for arm in ("attention", "latent posterior")]
    assert "(max share - 1/m) / (1 - 1/m)" in top.get_ylabel()  # the label says what is plotted
    assert sweep_figure({"sets": [support_set_entry(2, "mixed", 0) | {"num_refs": 1, "steps": []}]}) is None


def test_support_set_figure_names_every_reference_and_fits_a_column() -> None:
    from nw_adapter.correlate.support_report import set_figure

    fig = set_figure(support_set_entry(4, "mixed", 1), title="set1: attention mass and latent posterior")
    assert_printable(fig, max_width=3.5)
    labels = fig.axes[0].get_legend_handles_labels()[1]
    named = [label for label in labels if "attention" in label]
    assert named == [f"{r}: digit_{r}.png, attention" for r in range(4)]
    assert len(labels) == 9 and sum("latent posterior" in label for label in labels) == 4
    assert labels[-1] == "1/m, an even share"  # the dotted line says what it is
