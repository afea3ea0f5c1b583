"""The operator console in a real browser (Debian's headless Chromium through chromium-driver)
against a demo-like deployment: real broker, PostgreSQL, two real workers, a real router, the
admin API (with its audit consumer) served over HTTP. Every page is asserted on its content, with
no console error, a Content-Security-Policy that blocks inline scripts, keyboard use, the viewer
refused where an operator is needed, and screenshots saved in ``.test-artifacts/console/``."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import threading
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
import uvicorn
from selenium.webdriver.common.by import By
from selenium.webdriver.common.keys import Keys

from control_plane.admin.app import create_app
from control_plane.admin.console.browser import Browser
from control_plane.admin.console.routes import CSP
from control_plane.admin.services import SYSTEM, create_token
from control_plane.admin.settings import AdminSettings
from control_plane.admin.shapes import TokenCreate
from control_plane.admin.wiring import build_admin, migrate
from control_plane.router import RouterConfig
from control_plane.router.decision import RoutingRequest, WorkerLoad, WorkerOverlap
from control_plane.router.inputs import DecisionInputs, execute, routed_event
from common.hashing import HashAlgo, HashConfig, hash_blocks
from common.log.admin import apply_topics
from common.log.kafka import EventProducer
from common.net import free_port
from common.settings import BusSettings, repo_root
from schemas.events import RequestAdmitted, RequestCompleted
from tests.integration.test_router import Procs, _wait_http
from tests.integration.workerproc import WorkerProc, start_all
from tests.support.db import postgres_database
from tests.support.waits import wait_for

pytestmark = [pytest.mark.kafka, pytest.mark.postgres, pytest.mark.slow]

ARTIFACTS = repo_root() / ".test-artifacts" / "console"
BS = 64
DOC = list(range(7000, 7000 + BS * 6))


@dataclass
class Deployment:
    bus: BusSettings
    base: str
    router: str
    tokens: dict[str, str]
    ctx: object
    procs: Procs
    log_dir: Path
    synthetic_id: str
    real_id: str


def _synthetic_decision(bus: BusSettings) -> str:
    """A decision the router's own code makes and records (``execute`` + ``routed_event``): w1
    holds 6 blocks of the prompt and has a short queue, w2 is idle, so the default config picks
    w1 and a device tier weight of 0 picks w2."""
    rid = f"synthetic-{uuid.uuid4().hex[:6]}"
    cfg = HashConfig(HashAlgo.SHA256, BS)
    hashes = hash_blocks(DOC + list(range(2 * BS)), cfg)
    req = RoutingRequest(request_id=rid, prompt_tokens=len(DOC) + 2 * BS, block_size=BS, block_hashes=tuple(hashes),
                         expected_output_tokens=16)
    inputs = DecisionInputs(request=req, workers=[WorkerLoad(worker_id="w1", queued_prefill_tokens=128,
                                                              kv_capacity_blocks=1000),
                                                   WorkerLoad(worker_id="w2", kv_capacity_blocks=1000)],
                            overlaps={"w1": WorkerOverlap.from_tiers({"device": 6})}, inflight={}, rng_seed=7)
    config = RouterConfig()
    d = execute(inputs, config)
    assert d.worker_id == "w1"
    r = EventProducer(bus, "router-console")
    r.publish(RequestAdmitted(request_id=rid, model="m", prompt_tokens=req.prompt_tokens, max_tokens=16,
                              block_hashes=hashes, block_size=BS, hash_algo="sha256",
                              client_request_id="my-synthetic"), correlation_id=rid)
    r.publish(routed_event(d, inputs, config, router_id="router-console"), correlation_id=rid)
    r.publish(RequestCompleted(request_id=rid, worker_id="w1", prompt_tokens=req.prompt_tokens, output_tokens=16,
                               cached_tokens=6 * BS, ttft_ms=20, e2e_ms=60), correlation_id=rid)
    assert r.flush(10) == 0
    return rid


@pytest.fixture(scope="module")
def deployment(kafka_bootstrap: str, tmp_path_factory):
    log_dir = tmp_path_factory.mktemp("console")
    bus = BusSettings(bootstrap=kafka_bootstrap, topic_prefix=f"t{uuid.uuid4().hex[:10]}")
    apply_topics(bus)
    procs = Procs(bus, log_dir)
    workers = [WorkerProc(bus, w, log_dir / w, log_dir) for w in ("w1", "w2")]
    server = thread = None
    with postgres_database() as url:
        migrate(url)
        ctx = build_admin(AdminSettings(db_url=url, view_max_age_s=0.2, block_size=BS), bus)
        tokens = {}
        with ctx.sessions() as s:
            for role in ("viewer", "operator"):
                _, tokens[role] = create_token(s, ctx, SYSTEM, TokenCreate(name=f"{role}-1", role=role))
        try:
            start_all(*workers, timeout=60)
            rport = free_port()
            procs.router(rport, rid="r-console")
            router = f"http://127.0.0.1:{rport}"
            _wait_http(f"{router}/health", lambda r: r.status_code == 200 and r.json()["workers"] == 2)
            with httpx.Client(base_url=router, timeout=30) as c:
                for i in range(4):
                    r = c.post("/v1/completions", json={"prompt": DOC + [i], "max_tokens": 4,
                                                        "request_id": f"console-{i}"})
                    assert r.status_code == 200, r.text
            real_id = r.headers.get("x-request-id") or r.json()["id"]
            synthetic = _synthetic_decision(bus)
            port = free_port()
            server = uvicorn.Server(uvicorn.Config(create_app(ctx), host="127.0.0.1", port=port, log_level="warning"))
            thread = threading.Thread(target=server.run, daemon=True)
            thread.start()
            base = f"http://127.0.0.1:{port}"
            _wait_http(f"{base}/health")
            h = {"Authorization": f"Bearer {tokens['viewer']}"}
            # The audit consumer has folded the traffic: both requests' traces are complete.
            for rid in ("console-3", synthetic):
                wait_for(lambda rid=rid: httpx.get(f"{base}/requests/{rid}/trace", headers=h).status_code == 200
                         and httpx.get(f"{base}/requests/{rid}/trace", headers=h).json()["outcome"] == "completed",
                         timeout=60, what=f"trace of {rid}")
            yield Deployment(bus, base, router, tokens, ctx, procs, log_dir, synthetic, "console-3")
        finally:
            if server is not None:
                server.should_exit = True
                thread.join(15)
            procs.close()
            for w in workers:
                w.stop()


@pytest.fixture(scope="module")
def browser():
    b = Browser.start()
    yield b
    b.close()


def _shot(browser: Browser, name: str) -> None:
    browser.screenshot(ARTIFACTS / f"{name}.png")


def _text(browser: Browser) -> str:
    return browser.driver.find_element(By.TAG_NAME, "main").text


def _find(browser: Browser, css: str, timeout: float = 15):
    """The element, once the page that has it has loaded (a form post navigates)."""
    from selenium.common.exceptions import NoSuchElementException

    def present():
        try:
            return browser.driver.find_element(By.CSS_SELECTOR, css)
        except NoSuchElementException:
            return None

    return wait_for(present, timeout=timeout, what=css)


def _as(browser: Browser, d: Deployment, role: str) -> None:
    browser.driver.delete_all_cookies()
    browser.login(d.base, d.tokens[role])
    wait_for(lambda: "/console/fleet" in browser.driver.current_url, timeout=10, what="login")


def test_login_is_required_and_wrong_tokens_are_refused(deployment: Deployment, browser: Browser) -> None:
    browser.driver.delete_all_cookies()
    browser.get(f"{deployment.base}/console/fleet")
    assert browser.driver.current_url.endswith("/console/login")
    browser.login(deployment.base, "sy_nope_nope")
    assert "malformed token" in _text(browser)
    errs = browser.new_errors()
    assert errs and all("status of 401" in e for e in errs), errs  # the refused login, nothing else


def test_fleet_page_live_from_the_log(deployment: Deployment, browser: Browser) -> None:
    _as(browser, deployment, "viewer")
    # (read in one script: the live stream may replace the rows between two driver calls)
    assert set(browser.driver.execute_script(
        "return Array.from(document.querySelectorAll('#fleet-rows tr[data-worker]'), r => r.dataset.worker)")) == {
        "w1", "w2"}
    text = _text(browser)
    assert "pool default · aggregated · 2 workers" in text and "ready" in text and "device" in text
    # The server-sent event stream connected and replaced the rows.
    wait_for(lambda: "Live updates: on" in browser.driver.find_element(By.ID, "live").text, timeout=15,
             what="fleet event stream")
    _shot(browser, "fleet")
    assert browser.new_errors() == []


def test_request_page_chosen_worker_rows_add_up_and_verify(deployment: Deployment, browser: Browser) -> None:
    _as(browser, deployment, "operator")
    browser.get(f"{deployment.base}/console/requests/{deployment.real_id}")
    drv = browser.driver
    chosen = drv.find_element(By.CSS_SELECTOR, "#decision-0 .chosen-worker").text
    assert chosen in ("w1", "w2")
    rows = drv.find_elements(By.CSS_SELECTOR, "#scores-0 tbody tr")
    assert len(rows) == 2
    for row in rows:
        num = {c: float(row.find_element(By.CLASS_NAME, c).text) for c in ("scale", "prefill", "decode", "cost")}
        assert abs(num["scale"] * num["prefill"] + num["decode"] - num["cost"]) < 1e-3, num
        assert row.find_element(By.CLASS_NAME, "check").text == "yes"
    assert drv.find_element(By.CSS_SELECTOR, "#scores-0 tr.chosen").get_attribute("data-worker") == chosen
    # The 4th request of a shared document: the index predicted its cached prefix.
    assert re.match(r"\d+ blocks = [\d,]+ tokens of [\d,]+", drv.find_element(By.ID, "predicted").text)
    assert drv.find_element(By.ID, "engine-cached").text.endswith("tokens")
    timeline = drv.find_element(By.ID, "timeline").text
    assert "RequestAdmitted" in timeline and "RequestRouted" in timeline and "RequestCompleted" in timeline
    _shot(browser, "request")
    drv.find_element(By.CSS_SELECTOR, "#decision-0 form[action$='/verify'] button").click()
    verdict = _find(browser, "#verdict").text
    assert "Verdict match" in verdict and f"recorded {chosen}, re-executed {chosen}" in verdict
    assert browser.new_errors() == []


def test_whatif_with_a_changed_weight_changes_the_choice(deployment: Deployment, browser: Browser) -> None:
    _as(browser, deployment, "operator")
    # Found by its client id, from the search form.
    browser.get(f"{deployment.base}/console/requests")
    drv = browser.driver
    box = drv.find_element(By.ID, "q")
    box.send_keys("my-synthetic", Keys.ENTER)
    wait_for(lambda: deployment.synthetic_id in drv.current_url, timeout=10, what="search by client id")
    assert drv.find_element(By.CSS_SELECTOR, "#decision-0 .chosen-worker").text == "w1"
    area = drv.find_element(By.ID, "config-0")
    area.clear()
    area.send_keys('{"tier_weights": {"device": 0, "host": 0, "disk": 0, "object": 0}}')
    drv.find_element(By.CSS_SELECTOR, "#decision-0 form.whatif button").click()
    assert _find(browser, "#whatif-old").text == "w1"
    assert drv.find_element(By.ID, "whatif-new").text == "w2"
    assert "changed" in drv.find_element(By.ID, "whatif").text
    _shot(browser, "whatif")
    assert browser.new_errors() == []


def test_viewer_cannot_run_a_whatif_or_pin(deployment: Deployment, browser: Browser) -> None:
    _as(browser, deployment, "viewer")
    browser.get(f"{deployment.base}/console/requests/{deployment.synthetic_id}")
    browser.driver.find_element(By.CSS_SELECTOR, "#decision-0 form.whatif button").click()
    assert "viewer-1 is viewer; this needs operator" in _find(browser, "#page-error").text
    # The refusal is a 403 the browser logs as a failed load; nothing else.
    errs = browser.new_errors()
    assert all("403" in e for e in errs), errs
    cookies = {"sy_console": deployment.tokens["viewer"]}
    r = httpx.post(f"{deployment.base}/console/planner/pin", data={"pool": "default", "replicas": "1"},
                   cookies=cookies)
    assert r.status_code == 403


def test_pages_carry_a_csp_that_blocks_inline_scripts(deployment: Deployment, browser: Browser) -> None:
    cookies = {"sy_console": deployment.tokens["viewer"]}
    for path in ("/console/fleet", "/console/requests", f"/console/requests/{deployment.real_id}",
                 "/console/planner", "/console/doctor", "/console/dashboards", "/console/login"):
        r = httpx.get(deployment.base + path, cookies=cookies, timeout=30)
        assert r.status_code == 200, (path, r.text[:300])
        assert r.headers["content-security-policy"] == CSP
        assert "'unsafe-inline'" not in CSP and "script-src 'self'" in CSP
        assert "<script>" not in r.text and " on" not in re.sub(r"<[^>]*>", "", "")  # no inline handlers
        assert not re.search(r"<[^>]+\son[a-z]+=", r.text), path
    # A time range lists the requests admitted in it, with their client ids.
    r = httpx.get(f"{deployment.base}/console/requests", params={"since": "2000-01-01T00:00:00Z",
                                                                 "until": str(int(time.time() * 1000) + 60_000)},
                  cookies=cookies, timeout=30)
    assert r.status_code == 200 and "console-3" in r.text and "my-synthetic" in r.text
    r = httpx.get(f"{deployment.base}/console/requests", params={"since": "yesterday"}, cookies=cookies, timeout=30)
    assert r.status_code == 422 and "not a time" in r.text
    _as(browser, deployment, "viewer")
    browser.driver.execute_script(
        "var s = document.createElement('script'); s.textContent = 'window.inlineRan = 1';"
        "document.body.appendChild(s);")
    assert browser.driver.execute_script("return window.inlineRan === undefined")
    errs = browser.new_errors()
    assert any("Content Security Policy" in e for e in errs), errs


def test_keyboard_only_navigation(deployment: Deployment, browser: Browser) -> None:
    _as(browser, deployment, "viewer")
    drv = browser.driver
    body = drv.find_element(By.TAG_NAME, "body")

    def tab_to(pred, limit: int = 40):
        for _ in range(limit):
            drv.switch_to.active_element.send_keys(Keys.TAB) if drv.switch_to.active_element else body.send_keys(Keys.TAB)
            if pred(drv.switch_to.active_element):
                return drv.switch_to.active_element
        raise AssertionError("focus never reached the element")

    link = tab_to(lambda e: e.tag_name == "a" and e.text == "Requests")
    assert link.get_attribute("href").endswith("/console/requests")
    link.send_keys(Keys.ENTER)
    wait_for(lambda: drv.current_url.endswith("/console/requests"), timeout=10, what="requests page")
    box = tab_to(lambda e: e.get_attribute("id") == "q")
    box.send_keys(deployment.real_id, Keys.ENTER)
    # The client's own id finds the request; the page is under the router's id.
    wait_for(lambda: "/console/requests/cmpl-" in drv.current_url, timeout=10,
             what=lambda: f"request page, at {drv.current_url}: {_text(browser)[:500]}")
    assert "client id console-3" in _text(browser)
    assert browser.new_errors() == []


def test_planner_and_dashboards_pages(deployment: Deployment, browser: Browser) -> None:
    _as(browser, deployment, "operator")
    browser.get(f"{deployment.base}/console/planner")
    text = _text(browser)
    assert "Scaling decisions" in text and "load against capacity" in text
    _shot(browser, "planner")
    browser.get(f"{deployment.base}/console/dashboards?d=router-and-cache")
    panels = browser.driver.find_elements(By.CSS_SELECTOR, ".panel h2")
    from control_plane.admin.console.dashboards import dashboards, panels as panel_list

    assert [p.text for p in panels] == [p["title"] for p in panel_list(dashboards()["router-and-cache"])]
    _shot(browser, "dashboards")
    assert browser.new_errors() == []


def _cli(d: Deployment, *args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "SWITCHYARD_ADMIN_TOKEN": d.tokens["viewer"], "SWITCHYARD_ADMIN_URL": d.base}
    return subprocess.run([sys.executable, "-m", "switchyard.cli", *args], env=env, capture_output=True, text=True,
                          timeout=180)


def test_console_check_cli(deployment: Deployment) -> None:
    r = _cli(deployment, "console-check", "--repeat", "2", "--requests", "2")
    assert r.returncode == 0, r.stdout + r.stderr
    last = r.stdout.strip().splitlines()[-1]
    assert re.fullmatch(r"RESULT pages=\d+ loads=\d+ p95_ms=\d+ console_errors=0 doctor_mismatches=0 "
                        r"requests_in_log=\d+ non_200=0", last), last


def test_doctor_zero_on_the_deployment_then_flags_another_block_size(deployment: Deployment, browser: Browser) -> None:
    _as(browser, deployment, "viewer")
    h = {"Authorization": f"Bearer {deployment.tokens['viewer']}"}
    report = httpx.get(f"{deployment.base}/doctor", headers=h, timeout=30).json()
    assert report["ok"], report["mismatches"]
    assert {a["worker_id"] for a in report["agreement"]} == {"w1", "w2"}
    browser.get(f"{deployment.base}/console/doctor")
    assert browser.driver.find_element(By.ID, "doctor-summary").text.startswith("0 mismatches")
    r = _cli(deployment, "doctor")
    assert r.returncode == 0 and "doctor: 0 mismatches, 2 workers compared" in r.stdout, r.stdout + r.stderr
    odd = WorkerProc(deployment.bus, "w-odd", deployment.log_dir / "w-odd", deployment.log_dir,
                     args=("--block-size", "32")).start(60)
    try:
        def flagged():
            r = httpx.get(f"{deployment.base}/doctor", headers=h, timeout=30).json()
            return [m for m in r["mismatches"] if m["worker_id"] == "w-odd" and m["check"] == "block_size"]

        m = wait_for(flagged, timeout=60, what="the doctor flags w-odd")
        r = _cli(deployment, "doctor")
        assert r.returncode == 1 and "MISMATCH w-odd block_size: found 32, expected 64" in r.stdout, r.stdout + r.stderr
        assert m[0]["found"] == "32" and m[0]["expected"] == str(BS) and "--block-size 64" in m[0]["fix"]
        browser.get(f"{deployment.base}/console/doctor")
        row = browser.driver.find_element(By.CSS_SELECTOR, "#mismatches tr[data-worker='w-odd'][data-check='block_size']")
        assert "32" in row.text
        _shot(browser, "doctor")
        assert browser.new_errors() == []
    finally:
        odd.stop()
