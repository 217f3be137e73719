"""The reports' content without a browser: self-contained, every interval and legend shown, bounded.

The pages come from :mod:`report_inputs` (the command line's own document builders and writers on
synthetic data, no model); the notebook route from a recorder of the trained tiny model.
"""

from __future__ import annotations

import base64
import html
import io
import json
import math
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from PIL import Image
from subprocess_limits import SUBPROCESS_TIMEOUT_S

import nw_adapter
from nw_adapter.correlate.html_report import REPORT_NAME, Report, write_swap_report
from nw_adapter.correlate.html_report.document import escape

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def pages(tmp_path_factory) -> dict:
    import report_inputs

    base = tmp_path_factory.mktemp("pages")
    out = {"rho": report_inputs.rho_run(base / "rho"), "support": report_inputs.support_run(base / "support")}
    out["calibrated"] = report_inputs.calibrated_run(base / "calibrated")
    out["swap"], out["comparison"] = report_inputs.swap_run(base / "swap")
    out["base"] = base
    return out


def text(path: Path) -> str:
    return path.read_text(encoding="utf-8")


@pytest.mark.parametrize("kind", ["rho", "support", "swap"])
def test_a_report_is_one_self_contained_file(pages, kind) -> None:
    """Nothing the page needs lies outside it: plotly.js inline once, no external script, style
    sheet or image (images are data URIs), no network address the browser would fetch."""
    page = text(pages["base"] / kind / REPORT_NAME)
    assert page.startswith("<!DOCTYPE html>")
    assert page.count("plotly.js v") == 1  # the library's banner: embedded once
    library = re.search(r"<script[^>]*>/\*\*\n\* plotly.js v.*?</script>", page, flags=re.S)
    assert library is not None  # the library, inline (its own strings name web addresses it never fetches)
    rest = page.replace(library.group(0), "")
    assert not re.search(r"<script[^>]+src=", rest) and "<link" not in rest
    assert not re.search(r"""(src|href)=["'](https?:)?//""", rest)
    sources = re.findall(r'<img[^>]+src="([^"]+)"', page)
    assert sources and all(
        s.startswith(("data:image/png;base64,", "data:image/jpeg;base64,")) for s in sources
    )


def test_the_rho_report_shows_every_part_with_its_interval_and_the_consoles_legend(pages) -> None:
    from nw_adapter.analysis.records import COLUMN_LEGEND, shown_columns
    from nw_adapter.correlate.verdict import LEGEND

    document = pages["rho"]
    page = html.unescape(text(pages["base"] / "rho" / REPORT_NAME))
    assert f"verdict: {document['verdict']['conclusion']}" in page
    for clause in document["verdict"]["clauses"].values():
        assert clause["label"] in page
        for part in clause["parts"]:
            if part["low"] is not None:  # the console's numbers: signed, 3 decimals
                cells = f'<td class="num">{part["mean"]:+.3f}</td>'
                cells += f'<td class="num">[{part["low"]:+.3f}, {part["high"]:+.3f}]</td>'
                assert cells in page, part["label"]
                if part["test"] == "equivalence (TOST)":  # its interval is the 90% one (as -v says)
                    assert (
                        f'<td>equivalence (TOST), its interval 90%</td><td class="num">{part["mean"]:+.3f}'
                        in page
                    )
    for key, _, _ in shown_columns(document["steps"]):
        assert COLUMN_LEGEND[key] in page
    assert all(entry in page for entry in LEGEND)
    assert "control: scale-matched untrained keys in every layer" in page
    assert "PNDMScheduler calls the denoiser twice at one timestep (steps 1 and 2 share t=961)" in page


def test_the_verdict_renders_fields_of_later_versions_and_anchors_side_by_side() -> None:
    """The verdict dict is read generically: a part's nested results (the adapter, the control and
    the exact head) become columns side by side; a clause's further lists and the verdict's unknown
    fields are shown, not dropped."""
    from nw_adapter.correlate.html_report.verdict_html import verdict_html

    anchors = {
        "adapter": {"mean": 0.41, "low": 0.3, "high": 0.52, "n": 5},
        "control": {"mean": 0.05, "low": -0.01, "high": 0.11, "n": 5},
        "exact_head": {"mean": 1.97, "low": 1.9, "high": 2.04, "n": 5},
    }
    part = {
        "key": "p",
        "label": "exponent",
        "test": "two-level",
        "mean": 0.36,
        "low": 0.2,
        "high": 0.5,
        "p": 0.001,
        "n": 5,
        "measured": True,
        "significant": True,
        "anchors": anchors,
        "calibrated": 0.93,
    }
    result = {
        "conclusion": "evidence",
        "images": 5,
        "unit": "reference image",
        "alpha": 0.05,
        "clauses": {
            "bandwidth": {
                "label": "bandwidth clause",
                "holds": True,
                "reason": None,
                "parts": [part],
                "exact_head": [
                    {"label": "exact head's exponent", "mean": 1.97, "low": 1.9, "high": 2.04, "n": 5}
                ],
            }
        },
        "calibration": {"false_positive_rate": 0.04, "runs": 200},
    }
    page = html.unescape(verdict_html(result))
    for name in ("adapter", "control", "exact head"):
        assert f"{name}: mean [95% interval]" in page  # one column per anchor, side by side
    assert "+1.970 [+1.900, +2.040]" in page and "+0.410 [+0.300, +0.520]" in page
    assert "calibrated" in page and "0.930" in page  # a part's field of a later version
    assert "exact head" in page and "exact head's exponent" in page  # a clause's further list
    assert "calibration" in page and "false_positive_rate" in page  # the verdict's field of a later version


def test_a_parts_caveat_is_a_line_under_its_table_not_a_column() -> None:
    """A caveat is a sentence (one control draw: ...): written under the clause's table with its
    part's label, where a column of it squeezed the sentence to a word a line and pushed the table
    past the page's width."""
    from nw_adapter.correlate.html_report.verdict_html import verdict_html

    caveat = "one control draw: the variance between draws is not estimated; record several draws"
    part = {"key": "p", "label": "exponent - control's exponent", "test": "one-sample t (one draw)"}
    part |= {"mean": -0.05, "low": -0.07, "high": -0.03, "p": 0.99, "n": 4, "draws": 1, "caveat": caveat}
    plain = dict(part, label="the other part", caveat=None)
    clause = {"label": "bandwidth clause", "holds": False, "reason": None, "parts": [part, plain]}
    page = verdict_html({"conclusion": "no evidence", "images": 4, "clauses": {"bandwidth": clause}})
    assert "<th>caveat</th>" not in page and f"<td>{html.escape(caveat)}</td>" not in page
    assert f'<p class="note">exponent - control&#x27;s exponent: caveat: {html.escape(caveat)}</p>' in page
    assert page.count("caveat:") == 1  # only the part that has one


_BOUNDS = {
    "r2_nw": (0.0, 1.0),
    "rho": (-1.0, 1.0),
    "rho_minus_spread_null": (-2.0, 2.0),
    "kl": (0.0, math.inf),
}


def _reading(value: dict | None, key: str) -> str:
    """A reading's cell as the console's calibrated table prints it: the interval cut to the
    reading's range, no negative zero."""
    if value is None:
        return "-"
    low, high = _BOUNDS.get(key, (-math.inf, math.inf))
    x = [f"{min(max(value[k], low), high):.3f}" for k in ("mean", "low", "high")]
    x = ["0.000" if v == "-0.000" else v for v in x]
    return f"{x[0]} [{x[1]}, {x[2]}]"


def _table(page: str, table_id: str) -> tuple[list[str], list[list[str]]]:
    """The header and body cells of the table ``id=table_id`` (tags stripped)."""
    match = re.search(rf'<table id="{table_id}">(.*?)</table>', page, flags=re.S)
    assert match is not None, table_id

    def cells(row: str, tag: str) -> list[str]:
        return [re.sub("<[^>]+>", "", c) for c in re.findall(rf"<{tag}[^>]*>(.*?)</{tag}>", row)]

    rows = re.findall(r"<tr>(.*?)</tr>", match.group(1), flags=re.S)
    return cells(rows[0], "th"), [cells(row, "td") for row in rows[1:]]


def test_a_calibrated_report_shows_the_adapter_beside_the_exact_head_and_the_control(pages) -> None:
    """A ``--calibrate`` run of the command line (the trained tiny model, 3 digits, 4 steps): the
    calibrated table (one row per reading, the adapter, the exact NW head and the control side by
    side, the console's numbers), the anchors, the adapter's place between them, the exact head's own
    verdict (the positive conclusion, its parts), and the run's header line."""
    document = pages["calibrated"]
    result = document["verdict"]
    page = html.unescape(text(pages["base"] / "calibrated" / REPORT_NAME))
    header, body = _table(page, "readings")
    assert header == ["reading", "adapter", "exact NW head", "control"]
    assert len(body) == len(result["readings"]) == 8
    for row, reading in zip(body, result["readings"], strict=True):
        assert row == [
            reading["label"],
            *(_reading(reading[arm], reading["key"]) for arm in ("adapter", "exact", "control")),
        ]
    exact, control = result["anchors"]["exact"], result["anchors"]["control"]
    assert exact["source"] == "measured" and exact["verdict"]["evidence"] is True
    assert (
        f"anchors: control: exponent {control['exponent']:+.3f}, r2_nw {control['r2_nw']:.3f}; exact NW head "
        f"(measured with --calibrate): exponent {exact['exponent']:+.3f}, r2_nw {exact['r2_nw']:.3f}"
    ) in page
    position = result["position"]
    assert (
        f"path {position['path']:+.2f}, form {position['form']:+.2f}: nearer the {position['nearer']}" in page
    )
    line = f"calibration, the exact head in this pipeline: {exact['verdict']['conclusion']}"
    assert f'id="exact-verdict-line">{line}<' in page
    for clause in exact["verdict"]["clauses"].values():  # the exact head's parts, as the adapter's
        for part in clause["parts"]:
            assert f'<td class="num">[{part["low"]:+.3f}, {part["high"]:+.3f}]</td>' in page, part["label"]
    assert "calibrated: the exact NW head at the schedule's h = 1 sigma_t / alpha_t" in page
    assert page.index('id="anchors"') < page.index('data-clause="bandwidth"')  # the anchors first


def test_the_bandwidth_figure_draws_the_exact_heads_measured_line_and_the_verdicts_exponents(pages) -> None:
    """The report's bandwidth path and ``bandwidth.png`` draw the same lines: the adapter, the control
    and the exact head measured in the same pipeline, each labelled by the verdict's exponent (theory
    2); the exact head's points are its per-step geometric means over the references."""
    from nw_adapter.correlate.html_report.rho_figures import bandwidth_figure
    from nw_adapter.correlate.plotting import bandwidth_figure as png_figure

    document = pages["calibrated"]
    result, records, half = document["verdict"], document["records"], document["half"]
    figure = bandwidth_figure(records, half, control="per-layer")
    traces = {trace.name.split(":")[0]: trace for trace in figure.data}
    assert list(traces) == [
        "adapter",
        "scale-matched control (3 draws)",
        "exact NW head (measured)",
        "exponent 2",
    ]
    reported = {e["key"]: e["mean"] for e in result["clauses"]["bandwidth"]["reported"]}
    for name, exponent in (
        ("adapter", reported["exponent"]),
        ("scale-matched control (3 draws)", reported["exponent_control"]),
        ("exact NW head (measured)", result["anchors"]["exact"]["exponent"]),
    ):
        assert traces[name].name.endswith(f"3 units, exponent {exponent:+.3f}"), traces[name].name
    exact = traces["exact NW head (measured)"]
    for step, y in zip(exact.customdata, exact.y, strict=True):
        logs = [
            np.mean([math.log(r["logit_scale_exact"]) for r in records
                     if r["half"] == half and r["step"] == step and r["reference"] == reference])
            for reference in sorted({r["reference"] for r in records})
        ]  # fmt: skip
        assert y == pytest.approx(math.exp(np.mean(logs)), rel=1e-5)
    labels = png_figure(records, half).axes[0].get_legend_handles_labels()[1]
    exponent = result["anchors"]["exact"]["exponent"]
    assert f"exact NW head (measured): 3 images, exponent {exponent:+.2f}" in labels


def test_the_controls_path_in_the_report_is_the_verdicts_matched_once_per_run() -> None:
    """The control's line divides out the per-step scale matching (matched once per run, as the
    verdict reads it): a control whose matched logit scale follows only its per-step key scale (1/h)
    has exponent 0 in the verdict and in the figure (main at 7b2f1f0 drew the per-step matched
    values: exponent +1)."""
    import report_inputs

    from nw_adapter.correlate.html_report.rho_figures import bandwidth_figure
    from nw_adapter.correlate.verdict import verdict

    records = report_inputs.records(["a", "b", "c"])
    for record in records:
        for k in range(2):
            record[f"key_scale_{k}"] = 1.0 / record["h_schedule"]
            record[f"logit_scale_control_{k}"] = (1.5 + k) / record["h_schedule"]
    reported = {e["key"]: e for e in verdict(records)["clauses"]["bandwidth"]["reported"]}
    assert reported["exponent_control"]["mean"] == pytest.approx(0.0, abs=1e-9)
    (control,) = [t for t in bandwidth_figure(records, "cond").data if "control" in t.name]
    assert control.name.endswith("exponent +0.000") or control.name.endswith("exponent -0.000")


def test_an_uncalibrated_report_shows_the_readings_beside_the_control_and_the_theorys_anchor(pages) -> None:
    result = pages["rho"]["verdict"]
    page = html.unescape(text(pages["base"] / "rho" / REPORT_NAME))
    header, body = _table(page, "readings")
    measured = [r for r in result["readings"] if r["adapter"] or r["control"]]  # the rows with a value
    assert header == ["reading", "adapter", "control"] and len(body) == len(measured) == 6
    assert "exact NW head (the theory's values: not measured, run with --calibrate): exponent +2.000" in page
    assert "exact-verdict-line" not in page and "calibrated:" not in page


def test_the_support_report_shows_the_attention_beside_the_latent_posterior_in_the_consoles_words(
    pages,
) -> None:
    """Per set each reference's attention mass beside the theory's posterior over the references'
    latents (the values of ``support.json``), the entropy shares, the winners and the nearest
    reference of the generated latent; the console's tables, labels and legend; x0 against the
    plug-in field over h; no head-space NW column."""
    from nw_adapter.correlate import support_report as console
    from nw_adapter.correlate.html_report.support_report import support_legend

    document = pages["support"]
    raw = text(pages["base"] / "support" / REPORT_NAME)
    page = html.unescape(raw)
    assert support_legend() == console.LEGEND and console.LEGEND in page and console.HEADER in page
    assert console.format_document(document).splitlines()[-1] == console.LEGEND  # the console's own line
    for _, columns in console.TABLES:
        assert all(f"<th>{label}</th>" in page for _, label in columns)
    assert all(f"<th>{label}</th>" in page for label in console.COUNT_LABELS)
    assert all(f"<dt>{term}</dt><dd>{words}</dd>" in page for term, words in console.READINGS.items())
    call = r'document.getElementById\("([\w-]+)"\)\)\s*\{\s*Plotly.newPlot\(\s*"[\w-]+",\s*(\[.*?\]),\s*\{'
    figures = {div: json.loads(spec) for div, spec in re.findall(call, raw, re.S)}
    assert set(figures) == {"support-groups", "support-x0", "support-masses"}
    traces = {trace["name"]: trace for trace in figures["support-masses"]}
    for entry in document["sets"]:
        for r, reference in enumerate(entry["references"]):
            name = Path(reference["file"]).name
            for arm, key in (("attention mass", "mass"), ("latent posterior (theory)", "posterior")):
                drawn = traces[f"{r}: {name}, {arm}"]["y"]
                assert drawn == pytest.approx([s[key][r] for s in entry["steps"]], abs=1e-5)
        assert f"winner A {entry['winner']} from step {entry['decided_step']}" in page
        assert f"posterior {entry['posterior_winner']} from step {entry['posterior_decided_step']}" in page
        assert f"generated latent nearest {entry['final_nearest']}" in page
    first = {t["name"]: t["y"] for t in figures["support-masses"] if t["visible"]}  # the menu's first set
    shares = first["entropy / log m, latent posterior (theory)"]
    assert shares == pytest.approx(
        [s["posterior_entropy_share"] for s in document["sets"][0]["steps"]], abs=1e-5
    )
    assert "mass_nw" not in raw and "NW at the schedule" not in page  # the head-space NW is gone
    x0 = [t for t in figures["support-x0"] if t.get("showlegend") is not False]
    assert [t["name"] for t in x0][:2] == ["m=2, mixed (1 set)", "m=3, mixed (1 set)"]
    assert x0[0]["y"] == pytest.approx([s["x0_nw_ratio"] for s in document["sets"][0]["steps"]], abs=1e-5)


def test_the_swap_report_holds_every_image_with_its_numbers_and_the_conclusion(pages) -> None:
    from nw_adapter.analysis.consequence import LEGEND
    from nw_adapter.correlate.swap_files import comparison_of

    document, comparison = pages["swap"], pages["comparison"]
    page = html.unescape(text(pages["base"] / "swap" / REPORT_NAME))
    assert comparison_of(document).conclusion() in page and all(entry in page for entry in LEGEND)
    assert len(re.findall(r"<img ", page)) == 3 * (1 + 1 + 2 + 1)
    for row in document["per_reference"]:
        assert f"|x - stock| {row['abs_diff']:.3f}" in page
    stock = Image.fromarray((comparison.stock_images[0] * 255).round().astype(np.uint8))
    assert stock.size == (32, 32)


def test_a_resumed_comparison_keeps_its_report_and_a_new_one_replaces_it(pages) -> None:
    out = pages["base"] / "swap"
    before = (out / REPORT_NAME).read_bytes()
    assert write_swap_report(out, pages["swap"]) is None  # the same document: its report (with images) kept
    assert (out / REPORT_NAME).read_bytes() == before
    other = {**pages["swap"], "digest": "0" * 64}
    assert write_swap_report(out, other) == out / REPORT_NAME  # another document: rewritten, numbers only
    assert "images not kept" in text(out / REPORT_NAME)
    write_swap_report(out, pages["swap"], pages["comparison"])


def test_the_report_is_never_written_through_a_link(tmp_path) -> None:
    from nw_adapter.correlate.out_paths import OutputError

    target = tmp_path / "elsewhere.html"
    target.write_text("not ours")
    out = tmp_path / "out"
    out.mkdir()
    (out / REPORT_NAME).symlink_to(target)
    with pytest.raises(OutputError, match="symbolic link"):
        write_swap_report(out, {"digest": "x", "per_reference": [], "rules": [], "images": []})
    assert target.read_text() == "not ours"


def test_maps_are_pooled_to_the_cap_and_the_report_to_its_value_budget(tmp_path) -> None:
    from nw_adapter.correlate.html_report.images import data_uri, pool_to_cap
    from nw_adapter.correlate.html_report.maps_figure import ReferenceMaps, plan_maps

    grid = np.arange(64 * 64, dtype=np.float64).reshape(64, 64)
    pooled = pool_to_cap(grid, 32)
    assert pooled.shape == (32, 32) and pooled[0, 0] == grid[:2, :2].mean()
    assert pool_to_cap(np.ones((3, 20, 20)), 32).shape == (3, 20, 20)
    big = Image.fromarray(np.zeros((512, 384, 3), dtype=np.uint8))
    embedded = Image.open(io.BytesIO(base64.b64decode(data_uri(big).split(",")[1])))
    assert embedded.size == (96, 128) and embedded.format == "JPEG"  # 384 wide, 512 high: the longer side 128
    rng = np.random.default_rng(0)
    layers = [f"down_blocks.{i}.a" for i in range(4)] + ["up_blocks.0.a"]
    maps = {
        f"call0/step{s}/{layer}/adapter0/image0/{kind}": rng.uniform(0, 1, (2, 1, 64 * 64, 4)).astype(
            np.float32
        )
        for s in (0, 5)
        for layer in layers
        for kind in ("attn", "nw")
    }
    references = [ReferenceMaps(f"ref{i}", maps, {0: 981.0, 5: 1.0}, (512, 512)) for i in range(3)]
    per_choice = 3 * 2 * 32 * 32  # (A, W, A - W) x 2 steps x the pooled 32 x 32 grid
    notes = plan_maps(references, cap=10 * per_choice)
    assert sum(len(r.choices) for r in references) == 10 and "maps.safetensors" in notes[0]
    assert [len(r.choices) for r in references] == [4, 3, 3]  # every reference's four token means first
    assert all(r.choices[0].layers is None for r in references)


def test_nw_adapter_report_of_a_recorder_its_records_and_a_folder(pages, tmp_path) -> None:
    """The notebook route: ``nw_adapter.report`` of a recorder (its maps under the generated image),
    of its records, of a folder; the object shows inline in Jupyter and saves the same page."""
    import torch

    torch.manual_seed(0)
    pipe = nw_adapter.load_tiny_digits()
    with nw_adapter.nw_processor(pipe, store_maps=True, untrained_control=True, untrained_draws=1) as rec:
        images = [
            pipe(
                "a photograph",
                ip_adapter_image=nw_adapter.tiny_digit_image(d),
                num_inference_steps=3,
                generator=torch.Generator().manual_seed(d),
            ).images[0]
            for d in (3, 7)
        ]
    page = nw_adapter.report(rec, generated=images)
    assert isinstance(page, Report) and page.kind == "rho"
    anchors = [s.anchor for s in page.sections]
    assert (
        anchors[:4] == ["verdict", "rho", "bandwidth", "maps"] and page.figures == 3 + 2
    )  # a map figure per call
    assert rec.records().title() == page.title  # the title of rec.plot() and of the CLI's rho.png
    assert page.title.endswith("3 steps, bandwidth matched, 2 pipeline calls")
    inline = page._repr_html_()
    assert inline.startswith("<iframe srcdoc=") and html.unescape(inline).count("plotly.js v") == 1
    path = page.save(tmp_path / "nb" / "report.html")
    assert path.read_text(encoding="utf-8") == page.to_html()
    assert [p.name for p in path.parent.iterdir()] == ["report.html"]  # written atomically, nothing left
    assert nw_adapter.report(rec.to_records()).kind == "rho"
    assert nw_adapter.report(pages["base"] / "support").kind == "support-sets"
    assert nw_adapter.report(pages["base"] / "swap" / "compare_swap.json").kind == "compare-swap"
    with pytest.raises(ValueError, match="holds no run's file"):
        nw_adapter.report(tmp_path)
    with pytest.raises(ValueError, match="cannot make a report of int"):
        nw_adapter.report(3)


def test_nw_adapter_report_of_calibrated_calls_shows_the_calibrated_verdict() -> None:
    """The notebook route of a calibration: ``nw_adapter.report`` of ``observe_call(...,
    calibrate=True)`` results (one digit each) shows what the command line's report shows: the
    records' own verdict, the calibrated table, the exact head's verdict and its measured line."""
    import torch

    pipe = nw_adapter.load_tiny_digits()
    pipe.set_progress_bar_config(disable=True)
    config = nw_adapter.NWProcessorConfig(untrained_control=True, untrained_draws=2)
    calls = [
        nw_adapter.observe_call(
            pipe,
            {
                "prompt": "a photograph",
                "ip_adapter_image": nw_adapter.tiny_digit_image(d),
                "num_inference_steps": 4,
                "generator": torch.Generator().manual_seed(0),
            },
            config=config,
            calibrate=True,
        )
        for d in (2, 5, 8)
    ]
    page = nw_adapter.report(calls)
    result = nw_adapter.verdict(
        [{"reference": f"call {i}", **r} for i, call in enumerate(calls) for r in call.records]
    )
    shown = html.unescape(page.to_html())
    assert f'id="verdict-line">verdict: {result["conclusion"]}<' in shown
    header, body = _table(shown, "readings")
    assert header == ["reading", "adapter", "exact NW head", "control"] and len(body) == 8
    assert result["anchors"]["exact"]["verdict"]["evidence"] is True
    assert (
        f"calibration, the exact head in this pipeline: {result['anchors']['exact']['verdict']['conclusion']}"
        in shown
    )
    assert "calibrated: the exact NW head at the schedule's h = 1 sigma_t / alpha_t" in shown
    assert "control: scale-matched untrained keys in every layer, the same queries, 2 draws" in shown
    assert (
        f"exact NW head (measured): 3 units, exponent {result['anchors']['exact']['exponent']:+.3f}" in shown
    )
    assert nw_adapter.report(calls[0]).title.endswith("4 steps, bandwidth matched, 1 reference")


def test_importing_the_package_the_report_module_or_asking_for_help_loads_no_plotly() -> None:
    code = (
        "import sys, contextlib, io, nw_adapter\n"
        "import nw_adapter.correlate.html_report, nw_adapter.correlate.outputs\n"
        "from nw_adapter.correlate.cli import main\n"
        "nw_adapter.report\n"
        "with contextlib.redirect_stdout(io.StringIO()), contextlib.suppress(SystemExit):\n"
        "    main(['--help'])\n"
        "print(sorted(m for m in sys.modules if m.split('.')[0] in ('plotly', 'torch', 'selenium')))"
    )
    done = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        cwd=REPO,
        env={"PYTHONPATH": str(REPO), "PATH": "/usr/bin:/bin"},
        timeout=SUBPROCESS_TIMEOUT_S,
    )
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout.strip().replace("'", '"')) == []


def test_escape_keeps_markup_out_of_the_page() -> None:
    assert escape('<script>"x"</script>') == "&lt;script&gt;&quot;x&quot;&lt;/script&gt;"


@pytest.mark.parametrize(("uniform", "spread"), [(0.25, 0.1), (0.25, 0.6), (0.5, 0.7)])
def test_the_weight_colour_scale_is_white_at_the_even_share_inside_a_weights_range(uniform, spread) -> None:
    from nw_adapter.correlate.html_report.maps_figure import weight_scale

    scale = weight_scale(uniform, spread)
    assert 0.0 <= scale["cmin"] < uniform < scale["cmax"] <= 1.0
    (white,) = [x for x, colour in scale["colorscale"] if colour == "#f7f7f7"]
    assert scale["cmin"] + white * (scale["cmax"] - scale["cmin"]) == pytest.approx(uniform, abs=1e-6)
