"""The dashboard in a real headless Chromium (Debian's `chromium` + `chromium-driver`; nothing
downloads a browser): it loads without console errors, shows a lease submitted through the API
within 2 s, and a tenant's view never shows another tenant's leases."""

from __future__ import annotations

import os
import shutil
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.gateway_stack import Stack, gateway_stack

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
DRIVER = shutil.which("chromedriver")
pytestmark = pytest.mark.skipif(
    not (CHROMIUM and DRIVER),
    reason="needs Debian's chromium and chromium-driver (apt-get install chromium "
    "chromium-driver; .ci/runtimes installs them)")

APPEAR_WITHIN_SECONDS = 2.0


def _body(cpu: int, memory: int) -> dict[str, Any]:
    return {"pool_id": "p1", "shape": {"cpu_millis": cpu, "memory_mib": memory},
            "maximum_runtime_seconds": 3600}


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory, database_url: str) -> Iterator[Stack]:
    from projections.views import drop_schema

    schema = "views_gwui_" + uuid.uuid4().hex[:8]
    home: Path = tmp_path_factory.mktemp("gwui")
    try:
        with gateway_stack(home, database_url, schema) as s:
            yield s
    finally:
        drop_schema(database_url, schema)


@pytest.fixture()
def browser() -> Iterator[Any]:
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = str(CHROMIUM)
    for arg in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage",
                "--window-size=1440,1000", "--disable-gpu"):
        options.add_argument(arg)
    options.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    driver = webdriver.Chrome(service=Service(str(DRIVER)), options=options)
    driver.set_page_load_timeout(30)
    try:
        yield driver
    finally:
        driver.quit()


def _sign_in(driver: Any, stack: Stack, who: str) -> None:
    from selenium.webdriver.common.by import By

    driver.delete_all_cookies()
    driver.get(stack.url + "/")
    driver.find_element(By.ID, "token").send_keys(stack.tokens[who])
    driver.find_element(By.ID, "signin").click()
    _wait(driver, lambda: driver.find_elements(By.CSS_SELECTOR, "#fleet .card"), 15)


def _wait(driver: Any, predicate: Any, timeout: float) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        got = predicate()
        if got:
            return got
        time.sleep(0.05)
    return predicate()


def _errors(driver: Any) -> list[str]:
    return [e["message"] for e in driver.get_log("browser") if e.get("level") == "SEVERE"]


def _shown(driver: Any, lease_id: str) -> bool:
    from selenium.webdriver.common.by import By

    return bool(driver.find_elements(By.CSS_SELECTOR, f'a.lease-link[data-lease="{lease_id}"]'))


def test_the_dashboard_shows_a_new_lease_live_and_each_tenant_only_its_own(
    stack: Stack, browser: Any
) -> None:
    from selenium.webdriver.common.by import By

    with stack.client("alpha") as alpha, stack.client("beta") as beta:
        for cpu, mem in ((2000, 4096), (1000, 2048), (4000, 8192)):
            assert alpha.post("/v1/compute-leases", json=_body(cpu, mem)).status_code == 201
        theirs = beta.post("/v1/compute-leases", json=_body(500, 1024)).json()["lease_id"]

        _sign_in(browser, stack, "admin")
        assert _wait(browser, lambda: _shown(browser, theirs), 10), "the fleet page is not live"
        assert "n1" in browser.find_element(By.ID, "nodes").get_attribute("textContent")
        started = time.monotonic()
        lid = alpha.post("/v1/compute-leases", json=_body(1500, 3072)).json()["lease_id"]
        assert _wait(browser, lambda: _shown(browser, lid), APPEAR_WITHIN_SECONDS + 3)
        took = time.monotonic() - started
        assert took <= APPEAR_WITHIN_SECONDS, f"the lease took {took:.2f} s to appear"
        # one that cannot fit now: it waits in the queue with its reason
        time.sleep(1.1)  # event times are kept per second: a time clear of both
        before_big = time.time()
        time.sleep(1.1)
        big = alpha.post("/v1/compute-leases", json=_body(7500, 4096)).json()["lease_id"]
        assert _wait(browser, lambda: _shown(browser, big), 10)
        _the_slider_shows_the_fleet_and_queue_as_they_were(browser, before_big, lid, big)
        time.sleep(1.5)  # the reason and a little share history, for the picture
        shot = os.environ.get("POOL_DASHBOARD_SCREENSHOT")
        if shot:
            browser.save_screenshot(shot)
        assert _errors(browser) == []

        _sign_in(browser, stack, "beta")
        assert _wait(browser, lambda: _shown(browser, theirs), 10)
        page = browser.page_source
        assert lid not in page and "alpha" not in browser.find_element(
            By.ID, "leases").get_attribute("textContent")
        # a tenant sees the fleet's aggregate capacity, not its nodes
        assert "n1" not in browser.find_element(By.ID, "nodes").get_attribute("textContent")
        assert _errors(browser) == []

        browser.get(f"{stack.url}/leases/{theirs}")
        recorder = _wait(browser, lambda: "requested 0.5 CPU" in browser.find_element(
            By.ID, "history").get_attribute("textContent"), 10)
        assert recorder, "the lease page shows no flight recorder"
        assert _errors(browser) == []
        for lease in [lid, big]:
            alpha.post(f"/v1/compute-leases/{lease}/cancel", json={})
        beta.post(f"/v1/compute-leases/{theirs}/cancel", json={})


JOB = {"job": {"image": "busybox@sha256:" + "a" * 64, "command": ["true"]}}
STORY_FIELDS = ("state", "node", "shape", "epoch", "attempts", "requested", "waited", "reserved",
                "started", "ended", "credits", "end reason")


_READ_PAGE = """
const text = (id) => (document.getElementById(id) || {}).textContent || "";
const fields = {};
for (const tr of document.querySelectorAll("#lease tr[data-field]"))
  fields[tr.dataset.field] = tr.querySelectorAll("td")[1].textContent;
return {fields, stages: [...document.querySelectorAll("#timeline .stage b")].map(
  (e) => e.textContent), history: text("history"), why: text("why"),
  live: document.getElementById("live").className};
"""


def _story(driver: Any) -> dict[str, Any]:
    """The lease page as it reads at one moment (it redraws as the live stream moves, so in
    one script): its fields, timeline stages, recorder, why and live dot."""
    page: dict[str, Any] = driver.execute_script(_READ_PAGE)
    return page


def _placed(client: Any, lease_id: str) -> str:
    got = _wait(None, lambda: client.get(f"/v1/compute-leases/{lease_id}").json()["state"]
                not in ("requested", "queued") and
                client.get(f"/v1/compute-leases/{lease_id}").json()["state"], 10)
    return str(got)


def test_the_lease_page_tells_a_queued_and_an_ended_lease_s_story(
        stack: Stack, browser: Any) -> None:
    with stack.client("alpha") as alpha:
        done = alpha.post("/v1/compute-leases", json=_body(1000, 2048)).json()["lease_id"]
        assert _placed(alpha, done) == "reserved"
        assert alpha.post(f"/v1/compute-leases/{done}/commit", json=JOB).status_code == 200
        assert alpha.post(f"/v1/compute-leases/{done}/release",
                          json={"exit_code": 0}).status_code == 200
        # two that fill both nodes, and one that waits behind them
        fill = [alpha.post("/v1/compute-leases", json=_body(7000, 1024)).json()["lease_id"]
                for _ in range(2)]
        waits = alpha.post("/v1/compute-leases", json=_body(7000, 1024)).json()["lease_id"]
        try:
            for who, lease, state in (("alpha", waits, "queued"), ("alpha", done, "released"),
                                      ("admin", waits, "queued")):
                if who != "alpha" or lease == waits:
                    _sign_in(browser, stack, who)
                browser.get(f"{stack.url}/leases/{lease}")
                page = _wait(browser, lambda want=state: (p := _story(browser))["fields"].get(
                    "state") == want and "on" in p["live"].split() and p, 10)
                assert page, f"the page of a {state} lease shows no story, or is not live"
                story, stages = page["fields"], page["stages"]
                for field in STORY_FIELDS:
                    value = story.get(field, "").strip()
                    assert value and not any(w in value for w in ("undefined", "NaN", "null")), \
                        (state, field, value)
                assert "CPU" in story["shape"] and "GiB" in story["shape"], story["shape"]
                assert stages[0].startswith("queued") and "requested" in page["history"]
                if state == "queued":
                    assert "Position" in page["why"] and "nodes" in page["why"], page["why"]
                    assert story["started"] == "not yet"
                else:
                    assert stages == [
                        "queued", "reserved", "running", "released"], stages
                    assert "released: succeeded, exit code 0" in page["history"]
                    assert "not waiting" in page["why"]
                shot = os.environ.get("POOL_LEASE_PAGE_SCREENSHOT")
                if shot:
                    browser.save_screenshot(shot.replace(".png", f"-{who}-{state}.png"))
                assert _errors(browser) == []
        finally:
            for lease in [*fill, waits]:
                alpha.post(f"/v1/compute-leases/{lease}/cancel", json={})


_READ_ATTEMPTS = """
const box = document.getElementById("attempts-box");
return {shown: !box.hidden, rows: [...document.querySelectorAll("#attempts tr")].slice(1).map(
  (tr) => [...tr.querySelectorAll("td")].map((td) => td.textContent))};
"""


def test_the_lease_page_shows_each_attempt_and_how_it_ended(stack: Stack, browser: Any) -> None:
    body = _body(1000, 2048) | {"retries": {"max_attempts": 2, "on": ["failed"]}}
    with stack.client("alpha") as alpha:
        lid = alpha.post("/v1/compute-leases", json=body).json()["lease_id"]
        assert _placed(alpha, lid) == "reserved"
        assert alpha.post(f"/v1/compute-leases/{lid}/commit", json=JOB).status_code == 200
        # the first attempt fails: the lease is placed again and its job restarts on its own
        assert alpha.post(f"/v1/compute-leases/{lid}/release",
                          json={"exit_code": 3}).status_code == 200
        assert _wait(None, lambda: alpha.get(f"/v1/compute-leases/{lid}").json()["state"]
                     == "running", 10)
        _sign_in(browser, stack, "alpha")
        browser.get(f"{stack.url}/leases/{lid}")
        page = _wait(browser, lambda: (p := _story(browser))["fields"].get("attempts") == "2"
                     and p, 10)
        assert page, "the lease page does not show the attempt it is on"
        assert "attempt 1 failed on node" in page["history"], page["history"]
        rows = browser.execute_script(_READ_ATTEMPTS)
        assert rows["shown"] and [(r[0], r[3], r[4]) for r in rows["rows"]] == [
            ("1", "failed", "3"), ("2", "its attempt now (running)", "-")], rows
        # the second succeeds: each attempt's end reason stays on the page
        assert alpha.post(f"/v1/compute-leases/{lid}/release",
                          json={"exit_code": 0}).status_code == 200
        done = _wait(browser, lambda: (r := browser.execute_script(_READ_ATTEMPTS))["rows"][-1][3]
                     == "succeeded" and r, 10)
        assert done and [(r[0], r[3], r[4]) for r in done["rows"]] == [
            ("1", "failed", "3"), ("2", "succeeded", "0")], done
        stages = _story(browser)["stages"]
        assert stages[-4:] == ["queued", "reserved", "running", "released"], stages
        assert _errors(browser) == []


def test_the_lease_page_says_which_lease_a_held_lease_waits_for(
        stack: Stack, browser: Any) -> None:
    with stack.client("alpha") as alpha:
        first = alpha.post("/v1/compute-leases", json=_body(1000, 2048)).json()["lease_id"]
        assert _placed(alpha, first) == "reserved"
        assert alpha.post(f"/v1/compute-leases/{first}/commit", json=JOB).status_code == 200
        then = alpha.post("/v1/compute-leases", json=_body(1000, 2048) | {
            "after": [{"lease_id": first, "condition": "ok"}]}).json()["lease_id"]
        try:
            _sign_in(browser, stack, "alpha")
            browser.get(f"{stack.url}/leases/{then}")
            page = _wait(browser, lambda: (p := _story(browser))["fields"].get("state") == "held"
                         and first in p["why"] and p, 10)
            assert page, "the page of a held lease does not say what it waits for"
            assert page["why"].startswith("Waiting for dependency"), page["why"]
            assert page["stages"] == ["held"], page["stages"]
            # its dependency succeeds: it is queued, then placed
            assert alpha.post(f"/v1/compute-leases/{first}/release",
                              json={"exit_code": 0}).status_code == 200
            page = _wait(browser, lambda: (p := _story(browser))["fields"].get("state")
                         == "reserved" and p, 10)
            assert page and page["stages"] == ["held", "queued", "reserved"], page
            assert _errors(browser) == []
        finally:
            alpha.post(f"/v1/compute-leases/{then}/cancel", json={})


def _slide(driver: Any, back: int) -> None:
    driver.execute_script("const s = document.getElementById('time-slider'); "
                          "s.value = arguments[0]; s.dispatchEvent(new Event('input'));", back)


def _the_slider_shows_the_fleet_and_queue_as_they_were(driver: Any, then: float, lid: str,
                                                       big: str) -> None:
    """Moved back to before `big` was asked for: `lid` holds its node, `big` is nowhere, and
    the live snapshots leave that picture alone; moved to 0, the page is live again."""
    from selenium.webdriver.common.by import By

    label = driver.find_element(By.ID, "time-label")
    _slide(driver, round(then - time.time()))
    assert _wait(driver, lambda: "as it was" in label.text, 10), label.text
    time.sleep(1.2)  # a live snapshot or two arrive meanwhile
    assert _shown(driver, lid) and not _shown(driver, big)
    nodes = driver.find_element(By.ID, "nodes").get_attribute("textContent")
    assert "n1" in nodes and "as it was" in label.text
    _slide(driver, 0)
    assert _wait(driver, lambda: _shown(driver, big), 10), "the page did not go live again"
    assert label.text == "now, live"
