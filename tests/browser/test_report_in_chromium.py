"""Every kind of ``report.html`` opened from disk in headless Chromium with the network off.

One browser session for the four kinds of run (a rho run with stored maps, the end-to-end control,
support sets, ``--compare-swap``; :mod:`report_inputs` writes their folders with the command line's
own writers) and a calibrated rho run (``--calibrate``: the calibrated table's three columns, the
exact head's verdict and its measured series in the bandwidth figure). Per page the test reads the
rendered DOM: the verdict (or conclusion) line is the document's, every figure is drawn and its
legend names exactly the expected series, the page asked for no resource (everything is inline),
the console holds no error; on the maps, moving the step slider changes the heat map shown and its
title, and the menu changes the choice; on the support sets, the menu changes the set drawn and the
title its winners. A screenshot of each page is saved under
``$NW_ADAPTER_SCREENSHOTS`` (default: ``report-screenshots`` in pytest's temporary folder).

Needs Debian's ``chromium`` and ``chromium-driver`` (``.ci/run`` installs them) and selenium; without
them the test is skipped, saying so, unless ``NW_ADAPTER_REQUIRE_BROWSER=1`` (set by ``.ci/run``),
which makes their absence a failure.
"""

from __future__ import annotations

import os
import shutil
import time
from pathlib import Path

import pytest

BROWSERS = ("chromium", "chromium-browser", "google-chrome")


def _browser() -> tuple[str, str] | None:
    binary = next((path for name in BROWSERS if (path := shutil.which(name))), None)
    driver = shutil.which("chromedriver")
    return (binary, driver) if binary and driver else None


@pytest.fixture(scope="module")
def browser():
    found = _browser()
    try:
        import selenium  # noqa: F401
    except ImportError:
        found = None
    if found is None:
        reason = (
            "headless Chromium not available: install Debian's chromium and chromium-driver "
            "(apt-get install chromium chromium-driver) and selenium (pip install -e '.[test]'); .ci/run does"
        )
        if os.environ.get("NW_ADAPTER_REQUIRE_BROWSER") == "1":
            pytest.fail(reason)
        pytest.skip(reason)
    from selenium import webdriver
    from selenium.webdriver.chrome.options import Options
    from selenium.webdriver.chrome.service import Service

    options = Options()
    options.binary_location = found[0]
    for argument in (
        "--headless=new",
        "--no-sandbox",
        "--disable-gpu",
        "--disable-dev-shm-usage",
        "--window-size=1300,1000",
        "--no-proxy-server",
    ):
        options.add_argument(argument)
    options.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    driver = webdriver.Chrome(service=Service(found[1]), options=options)
    driver.execute_cdp_cmd("Network.enable", {})
    offline = {"offline": True, "latency": 0, "downloadThroughput": -1, "uploadThroughput": -1}
    driver.execute_cdp_cmd("Network.emulateNetworkConditions", offline)
    yield driver
    driver.quit()


@pytest.fixture(scope="module")
def screenshots(tmp_path_factory) -> Path:
    folder = Path(
        os.environ.get("NW_ADAPTER_SCREENSHOTS") or tmp_path_factory.getbasetemp() / "report-screenshots"
    )
    folder.mkdir(parents=True, exist_ok=True)
    return folder


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict:
    import report_inputs

    base = tmp_path_factory.mktemp("report-runs")
    return {
        "rho": (base / "rho", report_inputs.rho_run(base / "rho")),
        "end-to-end": (base / "e2e", report_inputs.end_to_end_run(base / "e2e")),
        "support": (base / "support", report_inputs.support_run(base / "support")),
        "swap": (base / "swap", report_inputs.swap_run(base / "swap")[0]),
        "calibrated": (base / "calibrated", report_inputs.calibrated_run(base / "calibrated")),
    }


def _open(driver, path: Path) -> None:
    driver.get_log("browser")  # drop what an earlier page logged
    driver.get(path.resolve().as_uri())
    for _ in range(100):  # every figure drawn (plotly adds its svg when Plotly.newPlot has run)
        drawn = driver.execute_script(
            "const divs = document.querySelectorAll('.plotly-graph-div');"
            "return divs.length > 0 && Array.from(divs).every(d => d.querySelector('.main-svg'));"
        )
        if drawn:
            return
        time.sleep(0.1)
    raise AssertionError(f"{path}: the figures were not drawn")


def _common_checks(driver, name: str, screenshots: Path) -> None:
    """Nothing requested over the network, no console error, a full-page screenshot saved."""
    assert driver.execute_script("return typeof window.Plotly") == "object"
    assert driver.execute_script("return performance.getEntriesByType('resource').map(e => e.name)") == []
    errors = [entry for entry in driver.get_log("browser") if entry["level"] in ("SEVERE", "ERROR")]
    assert errors == []
    height = driver.execute_script("return document.body.scrollHeight")
    driver.set_window_size(1300, min(height + 40, 12000))
    time.sleep(0.3)
    assert driver.save_screenshot(str(screenshots / f"report-{name}.png"))
    driver.set_window_size(1300, 1000)


def _legend(driver, div: str) -> list[str]:
    return driver.execute_script(
        f"return Array.from(document.querySelectorAll('#{div} .legend .traces .legendtext'))"
        ".map(e => e.textContent)"
    )


def _maps_state(driver, div: str) -> tuple[list[str], str]:
    """The heat maps' pixels (their image data) and the first panel's title."""
    return driver.execute_script(
        f"return [Array.from(document.querySelectorAll('#{div} .hm image')).map(e => e.getAttribute('href')),"
        f" document.querySelector('#{div} .annotation-text').textContent]"
    )


def _click_slider_step(driver, div: str, label: str) -> None:
    from selenium.webdriver.common.action_chains import ActionChains
    from selenium.webdriver.common.by import By

    figure = driver.find_element(By.ID, div)
    driver.execute_script("arguments[0].scrollIntoView()", figure)
    (tick,) = [e for e in figure.find_elements(By.CSS_SELECTOR, ".slider-label") if e.text == label]
    rail = figure.find_element(By.CSS_SELECTOR, ".slider-rail-touch-rect")
    offset = tick.rect["x"] + tick.rect["width"] / 2 - (rail.rect["x"] + rail.rect["width"] / 2)
    ActionChains(driver).move_to_element_with_offset(rail, int(offset), 0).click().perform()
    time.sleep(0.3)


def _choose(driver, div: str, label: str) -> None:
    """Open the figure's menu and click the entry ``label``."""
    from selenium.webdriver.common.action_chains import ActionChains
    from selenium.webdriver.common.by import By

    figure = driver.find_element(By.ID, div)
    driver.execute_script("arguments[0].scrollIntoView()", figure)
    ActionChains(driver).move_to_element(
        figure.find_element(By.CSS_SELECTOR, ".updatemenu-header")
    ).click().perform()
    time.sleep(0.2)
    buttons = figure.find_elements(By.CSS_SELECTOR, ".updatemenu-dropdown-button")
    (button,) = [b for b in buttons if b.text == label]
    ActionChains(driver).move_to_element(button).click().perform()
    time.sleep(0.3)


def _title(driver, div: str) -> str:
    return driver.execute_script(f"return document.querySelector('#{div} .gtitle').textContent")


def _visible_traces(driver, div: str) -> int:
    return driver.execute_script(
        f"return document.getElementById('{div}').data.filter(t => t.visible !== false).length"
    )


def test_every_kind_of_report_renders_offline_in_chromium(browser, runs, screenshots) -> None:
    from nw_adapter.analysis.records import CUT_LABEL, unit_intervals
    from nw_adapter.correlate.swap_files import comparison_of

    nulls = [
        "permutation null (keys shuffled)",
        "norm-matched null (random query directions)",
        "q.k-spread null (key norms shuffled)",
    ]
    for name, control in (("rho", "scale-matched control"), ("end-to-end", "end-to-end control")):
        folder, document = runs[name]
        _open(browser, folder / "report.html")
        line = browser.execute_script("return document.getElementById('verdict-line').textContent")
        assert line == f"verdict: {document['verdict']['conclusion']}"
        header = browser.execute_script("return document.querySelector('header').textContent")
        assert f"control: {'end-to-end' if name == 'end-to-end' else 'scale-matched'}" in header
        legend = _legend(browser, "rho-blocks")
        expected = [
            "rho (attention vs NW)",
            "rho: 95% t interval over 2 references",
            f"rho, {control} (2 draws)",
        ]
        bands = unit_intervals(document["records"], "block", half=document["half"])
        if any(cut_low or cut_high for *_, cut_low, cut_high in bands.values()):
            expected.append(CUT_LABEL)  # the mark where the interval is cut at rho's range
        assert sorted(legend) == sorted(expected + nulls)  # one entry per series, in every panel at once
        panels = browser.execute_script(
            "return document.querySelectorAll('#rho-blocks .cartesianlayer .subplot').length"
        )
        assert panels == 3  # down, mid, up
        assert browser.execute_script(
            "return document.querySelectorAll('#rho-layers .scatterlayer .trace').length"
        )
        assert _legend(browser, "bandwidth-path")[-1] == "exponent 2: an exact NW head (c / h^2)"
        if name == "rho":
            before = _maps_state(browser, "maps-0")
            assert before[1] == "x0 estimate, step 0 (t=981)" and len(before[0]) == 3  # A, W, A - W
            _click_slider_step(browser, "maps-0", "5")
            after = _maps_state(browser, "maps-0")
            assert after[1] == "x0 estimate, step 5 (t=1)"
            assert all(a != b for a, b in zip(before[0], after[0], strict=True))  # every map changed
            choices = browser.execute_script(
                "return document.getElementById('maps-0').layout.updatemenus[0].buttons.map(b => b.label)"
            )
            _choose(browser, "maps-0", choices[1])
            chosen = _maps_state(browser, "maps-0")
            assert chosen[1] == "x0 estimate, step 0 (t=981)" and chosen[0] != after[0]
        else:
            assert not browser.execute_script("return document.getElementById('maps-0')")
        _common_checks(browser, name, screenshots)

    folder, document = runs["support"]
    _open(browser, folder / "report.html")
    rows = browser.execute_script("return document.querySelectorAll('#summary table tbody tr').length")
    assert rows == 3 * len(document["summary"])  # the console's three tables: last step, decided, counts
    first, second = document["sets"]
    # per reference the attention mass and the latent posterior, 1/m, and the two entropy shares
    assert _visible_traces(browser, "support-masses") == 2 * 2 + 1 + 2
    assert _title(browser, "support-masses").startswith(f"{first['key']} (m=2, mixed): winner A ")
    _choose(browser, "support-masses", f"{second['key']} (m={second['num_refs']})")
    assert _visible_traces(browser, "support-masses") == 3 * 2 + 1 + 2
    title = _title(browser, "support-masses")
    assert title.startswith(f"{second['key']} (m=3, mixed): ")
    assert f"generated latent nearest {second['final_nearest']}" in title
    assert _legend(browser, "support-x0")[-2:] == [
        "0: the plug-in field (the posterior's NW mean)",
        "1: the references' mean (where the posterior is even)",
    ]
    assert browser.execute_script("return document.querySelectorAll('#images img').length") == 2 + 1 + 3 + 1
    _common_checks(browser, "support", screenshots)

    folder, document = runs["swap"]
    _open(browser, folder / "report.html")
    line = browser.execute_script("return document.getElementById('verdict-line').textContent")
    assert line == comparison_of(document).conclusion() + "."
    assert sorted(_legend(browser, "swap-figure")) == sorted(
        ["rule matched", "rule schedule", "swap moves it as much as a new seed"]
    )
    images = browser.execute_script(
        "return Array.from(document.querySelectorAll('#images img')).map(i => [i.complete, i.naturalWidth])"
    )
    assert len(images) == 3 * (1 + 1 + 2 + 1)  # per reference: itself, stock, two swaps, a new seed
    assert all(complete and width > 0 for complete, width in images)  # every data URI decoded
    _common_checks(browser, "swap", screenshots)

    folder, document = runs["calibrated"]
    result = document["verdict"]
    _open(browser, folder / "report.html")
    line = browser.execute_script("return document.getElementById('verdict-line').textContent")
    assert line == f"verdict: {result['conclusion']}"
    columns = browser.execute_script(
        "return Array.from(document.querySelectorAll('#readings thead th')).map(e => e.textContent)"
    )
    assert columns == ["reading", "adapter", "exact NW head", "control"]  # the three side by side
    cells = browser.execute_script(
        "return Array.from(document.querySelectorAll('#readings tbody tr'))"
        ".map(r => Array.from(r.querySelectorAll('td')).map(c => c.textContent))"
    )
    exponent = next(r for r in result["readings"] if r["key"] == "exponent")
    assert len(cells) == len(result["readings"]) and cells[0][0] == exponent["label"]
    assert all(cell != "-" for cell in cells[0])  # each anchor's exponent is measured
    exact = result["anchors"]["exact"]
    line = browser.execute_script("return document.getElementById('exact-verdict-line').textContent")
    assert line == f"calibration, the exact head in this pipeline: {exact['verdict']['conclusion']}"
    legend = _legend(browser, "bandwidth-path")
    assert legend[2] == f"exact NW head (measured): 3 units, exponent {exact['exponent']:+.3f}"
    assert legend[0].startswith("adapter: 3 units") and legend[1].startswith(
        "scale-matched control (3 draws)"
    )
    drawn = browser.execute_script(  # the exact head's series: one marker per step, each drawn
        "return document.querySelectorAll('#bandwidth-path .scatterlayer .trace')[2]"
        ".querySelectorAll('.points path').length"
    )
    assert drawn == len({r["step"] for r in document["records"]})
    _common_checks(browser, "calibrated", screenshots)
