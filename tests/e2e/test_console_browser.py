"""The ops console in a real browser (Playwright with Debian's chromium) against a running
stack: every worker is shown, the numbers move after requests, a pump fault injected from
the console turns its rack to drain, and a request's trace opens as a waterfall.

Saves a screenshot: into $TOKENYARD_TEST_ARTIFACTS when set, else the test's tmp_path."""

from __future__ import annotations

import os
from pathlib import Path

import httpx
import pytest
from playwright.sync_api import Page, expect, sync_playwright

pytestmark = pytest.mark.slow

CHROMIUM = "/usr/bin/chromium"  # Debian's (scripts/system-deps.sh installs it)


@pytest.fixture
def page(telemetry_stack):
    assert Path(CHROMIUM).exists(), "chromium is missing: run scripts/system-deps.sh"
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox"])
        page = browser.new_page(viewport={"width": 1400, "height": 1100})
        page.goto(telemetry_stack.console_url)
        yield page
        browser.close()


def send(stack, n: int) -> None:
    for i in range(n):
        body = {"model": stack.model_id, "prompt": f"Tell me about ships, {i}:", "max_tokens": 6}
        resp = httpx.post(f"{stack.gateway_url}/v1/completions", json=body, timeout=120)
        assert resp.status_code == 200, resp.text


def artifacts(tmp_path: Path) -> Path:
    out = Path(os.environ.get("TOKENYARD_TEST_ARTIFACTS") or tmp_path)
    out.mkdir(parents=True, exist_ok=True)
    return out


def rack(page: Page, name: str):
    return page.locator(f'[data-testid="rack"][data-rack="{name}"]')


def test_console_live_fleet_fault_and_trace(page: Page, telemetry_stack, tmp_path):
    expect(page.get_by_test_id("connection")).to_have_text("live", timeout=15_000)
    for worker_id in ("prefill-1", "decode-2"):
        expect(page.locator(f'[data-worker="{worker_id}"]')).to_be_visible()
    expect(rack(page, "rack-a")).to_have_attribute("data-state", "normal", timeout=15_000)

    rows_before = page.get_by_test_id("request-row").count()
    send(telemetry_stack, 3)
    # The numbers move by themselves (server-sent events), no reload.
    expect(page.get_by_test_id("request-row")).to_have_count(rows_before + 3, timeout=15_000)
    expect(page.get_by_test_id("fig-requests-per-s")).not_to_have_text("0.00", timeout=15_000)
    expect(page.get_by_test_id("fig-ttft-p50")).not_to_have_text("– s")

    page.get_by_test_id("request-row").first.click()
    expect(page.get_by_test_id("span").first).to_be_visible(timeout=10_000)
    assert page.get_by_test_id("span").count() >= 5

    page.get_by_test_id("admin-token").fill(telemetry_stack.console_admin_token)
    rack(page, "rack-a").get_by_role("button", name="inject pump fault").click()
    expect(rack(page, "rack-a")).to_have_attribute("data-state", "drain", timeout=15_000)
    expect(page.locator('[data-worker="prefill-1"]')).to_have_attribute("data-state", "drain")
    expect(rack(page, "rack-b")).to_have_attribute("data-state", "normal")
    page.screenshot(path=str(artifacts(tmp_path) / "console.png"), full_page=True)

    rack(page, "rack-a").get_by_role("button", name="clear faults").click()
    expect(page.get_by_test_id("message")).to_contain_text("done")
    expect(rack(page, "rack-a")).to_have_attribute("data-state", "normal", timeout=30_000)


def test_console_planner_page_plans_from_the_form(page: Page, tmp_path):
    page.get_by_test_id("planner-link").click()
    expect(page.get_by_test_id("plan-form")).to_be_visible()
    expect(page.get_by_test_id("plan-model").locator("option")).not_to_have_count(0)
    page.get_by_test_id("plan-model").select_option("llama-3.1-70b")
    page.get_by_test_id("plan-gpu").select_option("h100")
    page.get_by_test_id("plan-users").fill("1000")
    page.get_by_test_id("plan-tps").fill("20")
    page.get_by_test_id("plan-prompt-len").fill("1024")
    page.get_by_test_id("plan-output-len").fill("256")
    page.get_by_test_id("plan-submit").click()
    # The figures docs/planning.md gives for this plan, from the same make_plan.
    expect(page.get_by_test_id("plan-parallelism")).to_have_text("4 x 1, ep 1", timeout=15_000)
    expect(page.get_by_test_id("plan-gpus")).to_have_text("56")
    expect(page.get_by_test_id("plan-replicas")).to_have_text("10 : 4")
    page.screenshot(path=str(artifacts(tmp_path) / "console_planner.png"), full_page=True)

    page.get_by_test_id("plan-model").select_option("llama-3.1-405b")
    page.get_by_test_id("plan-users").fill("5000")
    page.get_by_test_id("plan-submit").click()
    expect(page.get_by_test_id("plan-message")).to_contain_text("llama-3.1-405b on h100")
    gpus = int(page.get_by_test_id("plan-gpus").inner_text().replace(",", ""))
    assert gpus > 56
