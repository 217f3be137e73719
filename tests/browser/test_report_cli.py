"""Every kind of command-line run writes ``report.html`` into its ``--out`` (the trained tiny model).

A rho run with maps (and its ``--replot``), the end-to-end control, support sets and
``--compare-swap`` (and its resumed rerun); each report holds what the run printed (the verdict or
conclusion line) and is the run's own; a rho run in a log prints a plain progress line per reference.
"""

from __future__ import annotations

import html
import re
from pathlib import Path

from nw_adapter.correlate.cli import main
from nw_adapter.models.tiny_digits import example_image_path

TINY = ["--model", "tiny", "--seed", "0"]


def digits(*values: int) -> list[str]:
    return [str(example_image_path(v)) for v in values]


def page(out: Path) -> str:
    return html.unescape((out / "report.html").read_text(encoding="utf-8"))


def test_a_rho_run_writes_its_report_and_replot_rewrites_it(tmp_path, capsys) -> None:
    out = tmp_path / "rho"
    argv = [*TINY, "--steps", "3", "--store-maps", "--out", str(out)]
    for image in digits(3, 7):
        argv += ["--image", image]
    assert main(argv) == 0
    printed = capsys.readouterr()
    verdict = next(line for line in printed.out.splitlines() if line.startswith("verdict: "))
    report = page(out)
    assert f'id="verdict-line">{verdict}</p>' in report
    assert "control: scale-matched untrained keys in every layer" in report
    assert 'id="maps-0"' in report and 'id="maps-1"' in report  # the stored maps of both references
    progress = [line for line in printed.err.splitlines() if line.startswith("progress: ")]
    assert [line.split(" done in ")[0] for line in progress] == [
        "progress: reference 1 of 2",
        "progress: reference 2 of 2",
    ]  # stderr is no terminal here (a log): a plain line per reference, no bar
    (out / "report.html").unlink()
    assert main(["--replot", str(out)]) == 0
    assert f'id="verdict-line">{verdict}</p>' in page(out)


def test_the_end_to_end_controls_report_says_which_control_ran(tmp_path, capsys) -> None:
    out = tmp_path / "e2e"
    argv = [*TINY, "--steps", "2", "--end-to-end-control", "--out", str(out)]
    for image in digits(1, 4):
        argv += ["--image", image]
    assert main(argv) == 0
    printed = capsys.readouterr().out
    assert "control: end-to-end, a second generation with the untrained adapter in every layer" in printed
    report = page(out)
    assert (
        "control: end-to-end, a second generation" in report and "rho, end-to-end control (1 draw)" in report
    )


def test_a_support_set_run_writes_its_report(tmp_path, capsys) -> None:
    out = tmp_path / "support"
    argv = [*TINY, "--steps", "3", "--support-set", ",".join(digits(3, 7)), "--out", str(out)]
    assert main([*argv, "--support-set", ",".join(digits(1, 4))]) == 0
    progress = [line for line in capsys.readouterr().err.splitlines() if line.startswith("progress: ")]
    assert [line.split(" done in ")[0] for line in progress] == [
        "progress: set 1 of 2",
        "progress: set 2 of 2",
    ]
    assert progress[0].endswith(": set00")  # stderr is no terminal here (a log): a plain line per set
    report = page(out)
    assert 'data-report-kind="support-sets"' in report and 'id="support-masses"' in report
    assert (
        "0: digit_3.png, attention mass" in report and "1: digit_7.png, latent posterior (theory)" in report
    )
    assert 'id="support-x0"' in report and "NW at the schedule" not in report


def test_compare_swap_writes_its_images_and_a_resumed_run_keeps_them(tmp_path, capsys) -> None:
    out = tmp_path / "swap"
    argv = [*TINY, "--compare-swap", "--steps", "2", "--swap-rules", "matched", "--out", str(out)]
    for image in digits(2, 5):
        argv += ["--image", image]
    assert main(argv) == 0
    conclusion = next(line for line in capsys.readouterr().out.splitlines() if line.startswith("conclusion"))
    report = page(out)
    assert f'id="verdict-line">{conclusion}</p>' in report
    images = re.findall(r'<img alt="([^"]+)" src="data:image/png;base64,', report)
    assert images == ["reference", "stock", "swap, rule matched", "new seed"] * 2
    before = (out / "report.html").read_bytes()
    assert main(argv) == 0  # resumed: compare_swap.json reused, nothing generated
    assert "resumed:" in capsys.readouterr().err
    assert (out / "report.html").read_bytes() == before  # the report with its images is kept
