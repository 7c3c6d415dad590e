"""The dashboard in a real headless Chromium (Debian's chromium + chromium-driver, driven by
selenium): load `/`, send from the playground, and watch the numbers on the page change."""

from __future__ import annotations

import re
import shutil
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.support.server import LiveServer

CHROMIUM = "/usr/bin/chromium"
CHROMEDRIVER = "/usr/bin/chromedriver"
WAIT_S = 120.0
INSTALL_HINT = "install it with `bash .ci/install-browser.sh` (Debian chromium, chromium-driver, selenium)"
COUNT = re.compile(r"\d+")  # page texts have their thousands separators removed
MEAN = re.compile(r"\d+\.\d")
PERCENT = re.compile(r"\d+\.\d%")
ENGINE_COUNTS = ("running", "waiting", "steps", "preemptions", "kv-used", "kv-free", "kv-cached", "kv-total")


@pytest.fixture
def browser(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Any]:
    for path in (CHROMIUM, CHROMEDRIVER):
        if shutil.which(path) is None:
            pytest.fail(f"{path} is missing: {INSTALL_HINT}")
    try:
        from selenium import webdriver
        from selenium.webdriver.chrome.service import Service
    except ImportError:
        pytest.fail(f"selenium is missing: {INSTALL_HINT}")
    monkeypatch.setenv("SE_OFFLINE", "true")  # never let Selenium Manager look for downloads
    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for arg in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--disable-gpu",
                "--window-size=1280,2000", f"--user-data-dir={tmp_path / 'profile'}"):
        options.add_argument(arg)
    driver = webdriver.Chrome(service=Service(CHROMEDRIVER), options=options)
    try:
        yield driver
    finally:
        driver.save_screenshot(str(tmp_path / "dashboard.png"))  # left for a person to look at
        driver.quit()


def test_playground_request_changes_the_numbers_on_the_page(
        browser: Any, start_gateway: Callable[..., LiveServer]) -> None:
    server = start_gateway()
    browser.get(server.base_url + "/")
    page = Page(browser)
    page.wait_for(lambda: page.attr("status", "data-status") == "ok" and page.text("requests-total") == "0")
    assert page.text("hit-rate") == "—"
    assert page.displayed("groups-empty")
    page.wait_for(lambda: page.engine()["running"] == "0")
    assert all(COUNT.fullmatch(page.engine()[name]) for name in ENGINE_COUNTS), page.engine()

    page.set_value("play-max-tokens", "4")
    page.send()
    page.wait_for(lambda: page.text("requests-total") == "2")
    assert page.text("hit-rate") == "0.0%"  # the first use of a tool group is a miss
    assert page.badge("run-cache") == "miss"
    assert page.run_field("run-cache", "cached") == "0"  # a miss computes its prefix
    assert page.run_field("run-bypass", "cached") == "0"
    assert page.run_field("run-cache", "ttft").endswith(("ms", " s"))

    page.send()
    assert page.badge("run-cache") == "hit"
    assert int(page.run_field("run-cache", "cached")) > 0
    page.wait_for(lambda: page.text("hit-rate") == "50.0%" and page.text("requests-total") == "4")
    page.wait_for(lambda: int(page.attr("ttft-chart", "data-points")) >= 1)
    row = page.group_row("get_weather")
    assert row["hits"] == "1" and row["tier"] == "ram" and int(row["tokens"]) > 0
    assert not page.displayed("groups-empty")

    # the Engine panel: numbers, and nothing running or waiting once both runs are done
    page.wait_for(lambda: page.engine()["running"] == "0" and page.engine()["waiting"] == "0")
    engine = page.engine()
    assert all(COUNT.fullmatch(engine[name]) for name in ENGINE_COUNTS), engine
    assert int(engine["kv-used"]) >= int(engine["kv-cached"])
    for name in ("batch-last", "tokens-last"):  # a dash only while the engine has reported no step
        assert COUNT.fullmatch(engine[name]) or engine[name] == "—" == engine["tokens-last"], engine
    for name in ("batch-mean", "tokens-mean"):
        assert MEAN.fullmatch(engine[name]) or engine[name] == "—" == engine["tokens-last"], engine
    assert PERCENT.fullmatch(engine["prefix-rate"]) or engine["prefix-rate"] == "—", engine


def test_engine_panel_shows_steps_kv_blocks_and_prefix_hits(
        browser: Any, start_gateway: Callable[..., LiveServer]) -> None:
    """Needs the continuous-batching engine: it reports its steps, its KV block pool and its
    prefix cache in tokens (the engine before it reported zeros)."""
    server = start_gateway()
    browser.get(server.base_url + "/")
    page = Page(browser)
    page.wait_for(lambda: page.attr("status", "data-status") == "ok")
    page.set_value("play-max-tokens", "4")
    page.send()  # a miss: the tool group's blocks are computed and kept
    page.send()  # a hit on them
    page.wait_for(lambda: page.text("requests-total") == "4" and page.engine()["running"] == "0")
    engine = page.engine()
    assert int(engine["steps"]) > 0, engine
    assert int(engine["batch-last"]) >= 1 and int(engine["tokens-last"]) >= 1, engine
    assert float(engine["batch-mean"]) >= 1 and float(engine["tokens-mean"]) >= 1, engine
    assert PERCENT.fullmatch(engine["prefix-rate"]) and float(engine["prefix-rate"][:-1]) > 0, engine
    assert int(engine["kv-total"]) == int(engine["kv-used"]) + int(engine["kv-free"]) > 0, engine
    assert int(engine["kv-cached"]) > 0, engine  # the cached tool group holds blocks
    assert re.fullmatch(r"<0\.1%|\d+\.\d%", engine["kv-usage"]), engine  # a large pool holds few blocks
    bar = page.element("engine-kv-bar")
    cached_px = page.element("engine-kv-bar-cached").size["width"]
    assert 2 <= cached_px < bar.size["width"], (cached_px, bar.size)  # visible, however small its share
    assert float(page.attr("engine-kv-bar", "data-usage")) == pytest.approx(
        int(engine["kv-used"]) / int(engine["kv-total"]))


# Run before the page's own script: records every CSP violation, and hands the page stats whose
# latest windows hold a slow miss above the axis (what a CPU server's first request after start
# gives), so the TTFT card shows a long value and the chart draws its outlier marker.
SLOW_MISS_STATS = """
window.cspViolations = [];
document.addEventListener("securitypolicyviolation",
  (e) => window.cspViolations.push(`${e.violatedDirective}: ${e.sourceFile}:${e.lineNumber}`));
const realFetch = window.fetch;
window.fetch = async (input, init) => {
  const response = await realFetch(input, init);
  if (!String(input).includes("/v1/dashboard/stats") || !response.ok) return response;
  const stats = await response.json();
  const t = Math.floor(Date.now() / 10000) * 10;
  const miss = (ms) => ({count: 1, mean_ms: ms, p50_ms: ms, p95_ms: ms});
  stats.ttft_windows = [{t: t - 30, hit: {count: 3, mean_ms: 12.3, p50_ms: 12.3, p95_ms: 14.1}, miss: miss(16420)},
                        {t: t - 20, miss: miss(15100)}, {t: t - 10, miss: miss(338200)}];
  stats.ttft_ceiling_ms = 16420;
  return new Response(JSON.stringify(stats), {status: 200, headers: {"Content-Type": "application/json"}});
};
"""
# The miss value's box and its card's content box, as the page lays them out.
MISS_AND_CARD = """
const miss = document.getElementById("ttft-miss"), card = miss.closest(".card");
const m = miss.getBoundingClientRect(), c = card.getBoundingClientRect(), style = getComputedStyle(card);
return {text: miss.textContent, viewport: window.innerWidth, miss: [m.left, m.right],
        card: [c.left + parseFloat(style.paddingLeft), c.right - parseFloat(style.paddingRight)]};
"""


def test_a_slow_miss_fits_its_card_and_its_marker_draws_under_the_pages_csp(
        browser: Any, start_gateway: Callable[..., LiveServer]) -> None:
    """At 1,100 and 1,400 px the miss value ran out of its card; the outlier marker's inline style
    was refused by the page's own CSP (style-src 'self'), a console error on every repaint."""
    server = start_gateway()
    browser.execute_cdp_cmd("Page.addScriptToEvaluateOnNewDocument", {"source": SLOW_MISS_STATS})
    browser.get(server.base_url + "/")
    page = Page(browser)
    for width in (1100, 1400, 800):
        browser.set_window_size(width, 1200)
        page.wait_for(lambda: page.text("ttft-miss").endswith(" s")
                      and page.attr("ttft-chart", "data-clipped") not in ("None", "0"))  # the chart drawn
        box = browser.execute_script(MISS_AND_CARD)
        assert box["card"][0] <= box["miss"][0] and box["miss"][1] <= box["card"][1], box  # whole, in its card
    # Read in one script: the chart repaints on every stats poll, and an element found in one
    # command can be replaced before the next reads it (a stale element, under a loaded CI machine).
    colours = browser.execute_script(
        "const marker = document.querySelector('#ttft-chart polygon.clipped.miss');"
        "return [marker && getComputedStyle(marker).fill,"
        " getComputedStyle(document.getElementById('ttft-miss')).color];")
    assert colours[0] == colours[1], colours  # not black: its class colours it
    assert browser.execute_script("return window.cspViolations") == []
    assert page.text("ttft-miss") == "338 s"  # seconds to three figures


class Page:
    """The dashboard as a person sees it: element texts by id, and the playground's controls."""

    def __init__(self, driver: Any) -> None:
        from selenium.webdriver.common.by import By

        self.driver = driver
        self.by = By

    def wait_for(self, condition: Callable[[], bool]) -> None:
        from selenium.webdriver.support.ui import WebDriverWait

        WebDriverWait(self.driver, WAIT_S).until(lambda _: condition())

    def element(self, element_id: str) -> Any:
        return self.driver.find_element(self.by.ID, element_id)

    def text(self, element_id: str) -> str:
        return str(self.element(element_id).text).strip()

    def attr(self, element_id: str, name: str) -> str:
        return str(self.element(element_id).get_attribute(name))

    def displayed(self, element_id: str) -> bool:
        return bool(self.element(element_id).is_displayed())

    def set_value(self, element_id: str, value: str) -> None:
        field = self.element(element_id)
        field.clear()
        field.send_keys(value)

    def send(self) -> None:
        """Click Send and wait for both panels; a panel in error fails with its message."""
        self.element("play-send").click()
        for run in ("run-cache", "run-bypass"):
            self.wait_for(lambda: self.attr(run, "data-state") in ("done", "error"))  # noqa: B023
            assert self.attr(run, "data-state") == "done", self.run_field(run, "answer")
        self.wait_for(lambda: self.element("play-send").is_enabled())

    def engine(self) -> dict[str, str]:
        """The Engine panel's texts by element id (without `engine-`), thousands separators removed."""
        nodes = self.driver.find_elements(self.by.CSS_SELECTOR, "#engine [id^='engine-']")
        return {str(n.get_attribute("id")).removeprefix("engine-"): str(n.text).strip().replace(",", "")
                for n in nodes}

    def run_field(self, run: str, name: str) -> str:
        node = self.element(run).find_element(self.by.CSS_SELECTOR, f'[data-field="{name}"]')
        return str(node.text).strip().replace(",", "")

    def badge(self, run: str) -> str:
        node = self.element(run).find_element(self.by.CSS_SELECTOR, '[data-field="result"]')
        return str(node.get_attribute("data-result"))

    def table_rows(self, element_id: str) -> list[list[str]]:
        """The cells' text of a table's body rows, read in one call: the page replaces its tables
        at every poll, and a row read cell by cell may be gone before its last cell is."""
        rows = self.driver.execute_script(
            "return Array.from(document.querySelectorAll('#' + arguments[0] + ' tbody tr'),"
            " row => Array.from(row.querySelectorAll('td'), cell => cell.innerText.trim()))", element_id)
        return [[str(cell) for cell in row] for row in rows]

    def group_row(self, tool_name: str) -> dict[str, str]:
        for row in self.table_rows("groups"):
            cells = [cell.replace(",", "") for cell in row]
            if tool_name in cells[1]:
                return dict(zip(("group", "tools", "tokens", "size", "hits", "tier", "last_used"), cells, strict=True))
        raise AssertionError(f"no tool-group row lists {tool_name}")


def test_page_asks_for_the_admin_key_when_the_gateway_has_keys(
        browser: Any, start_gateway: Callable[..., LiveServer]) -> None:
    server = start_gateway(api_keys=("user-key",), admin_key="admin-key")
    browser.get(server.base_url + "/")
    page = Page(browser)
    page.wait_for(lambda: page.attr("status", "data-status") == "locked")
    assert page.text("requests-total") == "0"
    page.set_value("api-key", "admin-key\n")  # Enter commits the field, as a person would
    page.wait_for(lambda: page.attr("status", "data-status") == "ok")
    page.set_value("play-max-tokens", "4")
    page.send()
    page.wait_for(lambda: page.text("requests-total") == "2")
