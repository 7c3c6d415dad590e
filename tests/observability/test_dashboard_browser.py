"""The dashboard in a real headless Chromium (Debian's chromium + chromium-driver, driven by
selenium): load `/`, send from the playground, and watch the numbers on the page change."""

from __future__ import annotations

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

    def run_field(self, run: str, name: str) -> str:
        node = self.element(run).find_element(self.by.CSS_SELECTOR, f'[data-field="{name}"]')
        return str(node.text).strip().replace(",", "")

    def badge(self, run: str) -> str:
        node = self.element(run).find_element(self.by.CSS_SELECTOR, '[data-field="result"]')
        return str(node.get_attribute("data-result"))

    def group_row(self, tool_name: str) -> dict[str, str]:
        for row in self.element("groups").find_elements(self.by.CSS_SELECTOR, "tbody tr"):
            cells = [str(c.text).strip().replace(",", "") for c in row.find_elements(self.by.TAG_NAME, "td")]
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
