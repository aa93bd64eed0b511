"""The operator dashboard in a real headless Chromium (Debian's chromium + chromedriver, driven by Selenium)
against a live cluster (mixed precision: fp32 KV on prefill, int8 on decode): the page loads without console errors,
shows the live workers and their KV dtypes and tokens held, its charts receive data, a scaling action made on the page
changes the pool, and the speculative decoding chart shows only while a worker reports speculation. Screenshots go to
build/screenshots/."""
from __future__ import annotations

import asyncio
import itertools
import shutil
from pathlib import Path

import pytest

from router.routing.policy import Role
from tests.cluster.test_disagg_cluster import wait_for
from tests.cluster.test_operating import Load

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parents[2]
SHOTS = ROOT / "build" / "screenshots"
CHROMIUM, CHROMEDRIVER = shutil.which("chromium") or "/usr/bin/chromium", shutil.which("chromedriver") or "/usr/bin/chromedriver"


def serve_app(loop_thread, app):
    import uvicorn

    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning", lifespan="off"))
    task = asyncio.run_coroutine_threadsafe(server.serve(), loop_thread.loop)
    assert wait_for(lambda: server.started, timeout_s=20)
    return server, task, f"http://127.0.0.1:{server.servers[0].sockets[0].getsockname()[1]}"


@pytest.fixture(scope="module")
def cluster(cluster_factory, tiny_model):
    from engine.config import EngineConfig
    from engine.engine import Engine

    probe = Engine(EngineConfig(model=str(tiny_model()), num_blocks=2))
    host_bytes = 512 * probe.runner.bytes_per_block  # a host KV tier twice the device tier (256 blocks)
    probe.close()
    return cluster_factory(**{"router.local_prefill_max_tokens": 0, "autoscaler.max_decode": 2,
                              "engine.kv_host_bytes": host_bytes,
                              "decode.kv_cache_dtype": "int8"})  # mixed precision: the KV panel names both dtypes


@pytest.fixture(scope="module")
def browser():
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for flag in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update", "--disable-sync",
                 "--window-size=1600,1150"):
        options.add_argument(flag)
    options.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    driver = webdriver.Chrome(service=Service(CHROMEDRIVER), options=options)
    SHOTS.mkdir(parents=True, exist_ok=True)
    yield driver
    driver.quit()


def dom(driver, css):
    from selenium.webdriver.common.by import By

    return driver.find_elements(By.CSS_SELECTOR, css)


def enabled(driver, css) -> bool:
    """Whether the (freshly found) element is enabled; the page re-renders every 1.5 s, so retry on staleness."""
    from selenium.common.exceptions import StaleElementReferenceException

    for _ in range(5):
        try:
            return dom(driver, css)[0].is_enabled()
        except (StaleElementReferenceException, IndexError):
            continue
    raise AssertionError(f"{css} kept going stale")


def severe(driver) -> list[str]:
    return [e["message"] for e in driver.get_log("browser") if e["level"] == "SEVERE"]


def leave(driver) -> list[str]:
    """The page's severe console errors, read while its server still runs; then the page is closed, so its
    polling cannot fail against the server being stopped (nor leave such errors for the next test)."""
    errors = severe(driver)
    driver.get("about:blank")
    return errors


def points(driver, chart: str) -> int:
    found = dom(driver, f"#{chart} svg")
    return int(found[0].get_attribute("data-points") or 0) if found else 0


def test_dashboard_shows_the_live_cluster_and_scales_a_pool(cluster, loop_thread, browser):
    from cluster.dashboard import mount_dashboard
    from router.http.app import create_app

    app = create_app(cluster.backend, served_model_names=[cluster.config.model_name], operator=cluster.pools,
                     metrics=cluster.metrics)
    mount_dashboard(app)
    server, task, url = serve_app(loop_thread, app)
    load = Load(cluster.backend, clients=6, prompt_len=120, max_tokens=40, seed=9)
    loop_thread.run(load.start())
    try:
        browser.get(url + "/dashboard")
        assert wait_for(lambda: dom(browser, '[data-worker="prefill-0"][data-state="ready"]')
                        and dom(browser, '[data-worker="decode-0"][data-state="ready"]'), timeout_s=20)
        assert browser.find_element("id", "model").text == cluster.config.model_name
        # the Weights table: what /v1/models says the engines hold (format, bytes, kernel per layer kind)
        weights = lambda: dict(browser.execute_script(  # noqa: E731 - read in one go (the page re-renders)
            "return [...document.querySelectorAll('#weights tr[data-kind]')].map(r => [r.dataset.kind, r.innerText])"))
        assert wait_for(weights, timeout_s=10)
        card = cluster.backend.card.weights
        assert list(weights()) == [g.kind for g in card.groups]
        assert all(g.format in weights()[g.kind] and g.kernel in weights()[g.kind] for g in card.groups)
        size, unit, rest = browser.find_element("id", "weights-total").text.split(" ", 2)
        assert unit == "KiB" and abs(float(size) - card.weight_bytes / 1024) <= 0.05 and rest.startswith("resident")
        assert browser.find_element("id", "ratio").text == "1 : 1"
        charts = ("chart-ttft", "chart-itl", "chart-traffic", "chart-pools", "chart-kv", "chart-xfer")
        assert wait_for(lambda: all(points(browser, c) >= 5 for c in charts), timeout_s=40, interval_s=0.5), \
            {c: points(browser, c) for c in charts}
        assert browser.find_element("id", "kpi-tok").text not in ("–", "0")
        assert dom(browser, "#chart-spec.hidden")  # no worker speculates: today's eight charts
        # each worker's host KV tier: a bar and "used / total" blocks, the total what the worker reported
        tier_text = lambda: [e.text for e in dom(browser, '[data-worker="prefill-0"] .tier[data-tier="host"]')]  # noqa: E731
        assert wait_for(lambda: tier_text() and tier_text()[0].endswith("/ 512"), timeout_s=10), tier_text()
        assert dom(browser, '[data-worker="decode-0"] .tier[data-tier="host"]')
        assert not dom(browser, '[data-worker="prefill-0"] .tier[data-tier="disk"]')  # it has no disk tier
        # the KV cache: each worker's KV dtype and the tokens its blocks in use hold (blocks x 16), and per role
        # under the KV chart; the prefill pool keeps fp32 KV (auto), the decode pool int8
        kv = lambda css: browser.execute_script(  # noqa: E731 - read in one go (the page re-renders)
            f"return [...document.querySelectorAll('{css}')].map(e => [e.dataset.dtype, e.innerText, e.title])")
        assert wait_for(lambda: [d for d, *_ in kv("#chart-kv .kv-held span")] == ["float32", "int8"], timeout_s=10)
        (p_dtype, p_text, _), = kv('[data-worker="prefill-0"] .kv')
        (d_dtype, d_text, d_blocks), = kv('[data-worker="decode-0"] .kv')
        assert (p_dtype, d_dtype) == ("float32", "int8") and p_text.startswith("KV float32 · ")
        assert d_text.startswith("KV int8 · ") and d_text.endswith(" / 4.1k tokens") and d_blocks.endswith(" / 256 blocks")
        held = kv("#chart-kv .kv-held span")[1][1]
        assert held.startswith("decode KV int8 · ") and held.endswith(" / 4.1k tokens held")
        browser.save_screenshot(str(SHOTS / "dashboard-live.png"))

        assert enabled(browser, '#pool-decode button[data-action="plus"]')
        dom(browser, '#pool-decode button[data-action="plus"]')[0].click()  # a real click: POST /admin/pools/decode
        assert wait_for(lambda: cluster.pools.targets[Role.DECODE] == 2, timeout_s=10)
        assert wait_for(lambda: dom(browser, '[data-worker="decode-1"][data-state="ready"]'), timeout_s=90)
        assert wait_for(lambda: browser.find_element("id", "ratio").text == "1 : 2", timeout_s=10)
        assert len(cluster.registry.ready(Role.DECODE)) == 2
        assert wait_for(lambda: points(browser, "chart-pools") >= 20, timeout_s=30)
        browser.save_screenshot(str(SHOTS / "dashboard-scaled.png"))
        assert not enabled(browser, '#pool-decode button[data-action="plus"]')  # at its maximum of 2
        browser.execute_script("document.getElementById('weights-panel').scrollIntoView()")
        browser.save_screenshot(str(SHOTS / "dashboard-weights.png"))
    finally:
        loop_thread.run(load.stop())
        errors = leave(browser)
        server.should_exit = True
        task.result(15)
    assert load.failed == 0 and load.done > 0, load.errors[:3]
    assert errors == []


def test_dashboard_is_read_only_until_the_admin_key_is_entered(cluster, loop_thread, browser):
    from cluster.dashboard import mount_dashboard
    from router.http.app import create_app

    app = create_app(cluster.backend, served_model_names=[cluster.config.model_name], operator=cluster.pools,
                     metrics=cluster.metrics, admin_key="s3cret", bind_host="0.0.0.0")
    mount_dashboard(app)
    server, task, url = serve_app(loop_thread, app)
    try:
        browser.get(url + "/dashboard")
        assert wait_for(lambda: dom(browser, '[data-worker="decode-0"]'), timeout_s=20)
        assert not enabled(browser, '#pool-decode button[data-action="minus"]')
        assert "admin key" in browser.execute_script(
            'return document.querySelector(\'#pool-decode button[data-action="minus"]\').title')
        browser.save_screenshot(str(SHOTS / "dashboard-read-only.png"))
        browser.find_element("id", "key").send_keys("s3cret")
        browser.find_element("css selector", "#key-form button").click()
        assert wait_for(lambda: enabled(browser, '#pool-decode button[data-action="minus"]'), timeout_s=10)
    finally:
        errors = leave(browser)
        server.should_exit = True
        task.result(15)
    assert errors == []


def test_dashboard_shows_speculative_decoding_while_a_worker_speculates(cluster, loop_thread, browser):
    """decode-0's stats (as the pools poll them each second) carry speculative decoding's counters, advancing
    with each poll: the chart appears, with its acceptance rate and mean acceptance length; when they stop
    carrying them, it goes away again."""
    from cluster.dashboard import mount_dashboard
    from router.http.app import create_app

    registry = cluster.registry
    real_update, polls = registry.update_stats, itertools.count(1)
    accepted = itertools.accumulate(itertools.cycle((70, 78, 84, 74, 66, 80, 90, 72)))

    def with_spec(worker_id, stats, now_s):
        if worker_id == "decode-0":
            n = next(polls)
            acc = next(accepted)
            stats = dict(stats, spec_decode={"method": "ngram", "num_drafts": 40 * n, "num_draft_tokens": 120 * n,
                                             "num_accepted_tokens": acc, "num_accepted_tokens_per_pos": [acc]})
        real_update(worker_id, stats, now_s)

    app = create_app(cluster.backend, served_model_names=[cluster.config.model_name], operator=cluster.pools,
                     metrics=cluster.metrics)
    mount_dashboard(app)
    server, task, url = serve_app(loop_thread, app)
    visible = lambda: dom(browser, "#chart-spec") and not dom(browser, "#chart-spec.hidden")  # noqa: E731
    try:
        browser.get(url + "/dashboard")
        assert wait_for(lambda: dom(browser, '[data-worker="decode-0"]'), timeout_s=20)
        assert wait_for(lambda: points(browser, "chart-kv") >= 1, timeout_s=10)
        assert not visible()
        registry.update_stats = with_spec
        assert wait_for(visible, timeout_s=15)
        assert wait_for(lambda: points(browser, "chart-spec") >= 15, timeout_s=40, interval_s=0.5)
        legend = browser.find_element("css selector", "#chart-spec .legend").text
        assert "accepted" in legend and "mean length" in legend and "tok/s" in legend, legend
        axis = [e.get_attribute("textContent") for e in dom(browser, "#chart-spec .axis-label")]
        assert "100%" in axis and "0.0%" in axis, axis  # the rate's axis, not the draft tokens' (legend only)
        browser.save_screenshot(str(SHOTS / "dashboard-spec.png"))
        del registry.update_stats  # the next poll's stats carry no spec_decode
        assert wait_for(lambda: not visible(), timeout_s=15)
    finally:
        registry.__dict__.pop("update_stats", None)
        errors = leave(browser)
        server.should_exit = True
        task.result(15)
    assert errors == []
