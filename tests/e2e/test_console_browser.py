"""The ops console in a real browser (Playwright with Debian's chromium) against a running
stack: every worker is shown, the numbers and charts (uPlot: time axis, units, hover values)
move after requests, simulated rack readings say so, a request's trace opens as a waterfall
down to the engine's steps, a pump fault that would stop the fleet asks first and then
turns its rack to drain, and a request that then fails shows its error code and message.
A LoRA adapter loaded through the gateway's admin API shows on every worker that holds it,
and goes once unloaded.

Saves a screenshot: into $TOKENYARD_TEST_ARTIFACTS when set, else the test's tmp_path."""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

import httpx
import pytest
import torch
from playwright.sync_api import Page, expect, sync_playwright
from safetensors.torch import save_file

from tokenyard.models.lora_adapter import module_shape

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


def send(stack, n: int, prompt: str = "Tell me about ships") -> None:
    for i in range(n):
        body = {"model": stack.model_id, "prompt": f"{prompt}, {i}:", "max_tokens": 6}
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
    # The example inventory's racks are modelled by the facilities simulator: labelled so.
    expect(rack(page, "rack-a").get_by_test_id("rack-source")).to_have_text("simulated")

    rows_before = page.get_by_test_id("request-row").count()
    send(telemetry_stack, 3)
    # The numbers move by themselves (server-sent events), no reload.
    expect(page.get_by_test_id("request-row")).to_have_count(rows_before + 3, timeout=15_000)
    expect(page.get_by_test_id("fig-requests-per-s")).not_to_have_text("0.00", timeout=15_000)
    expect(page.get_by_test_id("fig-ttft-p50")).not_to_have_text("– s")
    # Energy per output token, from each request's usage.energy_joules (modelled here).
    expect(page.get_by_test_id("fig-joules-per-token")).not_to_have_text("–")
    # Averaged over a window: still up a second after the burst, not back to 0.
    expect(page.get_by_test_id("fig-tokens-per-s")).not_to_have_text("0.0", timeout=15_000)
    page.wait_for_timeout(1500)
    expect(page.get_by_test_id("fig-tokens-per-s")).not_to_have_text("0.0")

    check_kv_tiers(page, telemetry_stack)
    check_chart(page)
    check_trace(page)
    inject_fault_after_confirming(page, telemetry_stack)
    check_failed_request(page, telemetry_stack)
    page.get_by_test_id("request-row").nth(1).click()  # a served request's trace, for the picture
    expect(page.locator('[data-span="engine.prefill"]')).to_be_visible(timeout=10_000)
    page.screenshot(path=str(artifacts(tmp_path) / "console.png"), full_page=True)

    rack(page, "rack-a").get_by_role("button", name="clear faults").click()
    expect(page.get_by_test_id("message")).to_contain_text("done")
    expect(rack(page, "rack-a")).to_have_attribute("data-state", "normal", timeout=30_000)


def check_kv_tiers(page: Page, stack) -> None:
    """Hit rates by tier, and the KV bytes sent to the shared tier once a prompt of several
    full blocks was computed (the short prompts above fill none)."""
    expect(page.get_by_test_id("fig-kv-tier-hits")).to_have_text(re.compile(r"^\d+% / \d+%$"))
    send(stack, 1, "Tell me about ships and harbours and the sea " * 8)
    moved = page.get_by_test_id("fig-kv-moved")
    expect(moved).to_have_text(re.compile(r"^[\d.]+ MiB / [\d.]+ MiB$"))
    expect(moved).not_to_have_text(re.compile(r"^0\.0 MiB /"), timeout=15_000)


def check_chart(page: Page) -> None:
    """The throughput chart: a time axis, its unit, and the value under the mouse."""
    chart = page.get_by_test_id("chart-tokens")
    expect(chart.locator(".u-title")).to_have_text("throughput")
    # uPlot draws the axes on its canvas: ask the chart for the x scale and the value axis.
    axes = page.evaluate(
        "() => [charts['c-tokens'].scales.x.time, charts['c-tokens'].axes[1].label]"
    )
    assert axes == [True, "tok/s"], axes
    latest = chart.locator(".u-legend .u-series").nth(1).locator(".u-value")
    expect(latest).to_contain_text("tok/s")  # the latest value, before any hover
    box = chart.locator(".u-over").bounding_box()
    assert box is not None
    page.mouse.move(box["x"] + box["width"] - 3, box["y"] + box["height"] / 2)
    time, generated = (
        chart.locator(".u-legend .u-series").nth(0),
        chart.locator(".u-legend .u-series").nth(1),
    )
    expect(time.locator(".u-value")).to_contain_text(":")  # the clock time under the mouse
    expect(generated.locator(".u-label")).to_have_text("generated")
    expect(generated.locator(".u-value")).to_contain_text("tok/s")


def check_trace(page: Page) -> None:
    """A split request's waterfall: the prefill under the prefill worker's span, then each
    decode step under the decode worker's."""
    page.get_by_test_id("request-row").first.click()
    expect(page.get_by_test_id("span").first).to_be_visible(timeout=10_000)
    assert page.get_by_test_id("span").count() >= 5
    prefill = page.locator('[data-testid="span"][data-span="engine.prefill"]')
    expect(prefill).to_have_count(1, timeout=10_000)
    steps = page.locator('[data-testid="span"][data-span="engine.decode_step"]')
    assert steps.count() >= 3, steps.count()
    for engine_span, parent in ((prefill, "prefill"), (steps.first, "decode")):
        parent_row = page.locator(f'[data-testid="span"][data-span="{parent}"]').first
        assert int(engine_span.get_attribute("data-depth") or 0) == 1 + int(
            parent_row.get_attribute("data-depth") or 0
        )


def inject_fault_after_confirming(page: Page, stack) -> None:
    """rack-a holds the only prefill worker: the console names it and asks first; a "no"
    leaves the rack alone, a "yes" drains it."""
    page.get_by_test_id("admin-token").fill(stack.console_admin_token)
    asked: list[str] = []

    def answer(accept: bool):
        def on_dialog(dialog) -> None:
            asked.append(dialog.message)
            dialog.accept() if accept else dialog.dismiss()

        return on_dialog

    page.once("dialog", answer(False))
    rack(page, "rack-a").get_by_role("button", name="inject pump fault").click()
    expect(page.get_by_test_id("message")).to_contain_text("cancelled")
    assert len(asked) == 1 and "prefill-1" in asked[0] and "stops serving" in asked[0], asked
    expect(rack(page, "rack-a")).to_have_attribute("data-state", "normal")

    page.once("dialog", answer(True))
    rack(page, "rack-a").get_by_role("button", name="inject pump fault").click()
    expect(rack(page, "rack-a")).to_have_attribute("data-state", "drain", timeout=15_000)
    assert len(asked) == 2
    expect(page.locator('[data-worker="prefill-1"]')).to_have_attribute("data-state", "drain")
    expect(rack(page, "rack-b")).to_have_attribute("data-state", "normal")


def check_failed_request(page: Page, stack) -> None:
    """With no prefill worker left, a request fails; its row says how, as the client saw it."""
    body = {"model": stack.model_id, "prompt": "Tell me about ships:", "max_tokens": 4}
    resp = httpx.post(f"{stack.gateway_url}/v1/completions", json=body, timeout=120)
    assert resp.status_code >= 400, resp.text
    error = resp.json()["error"]
    shown = page.get_by_test_id("request-error").first
    expect(shown).to_contain_text(error["code"] or str(resp.status_code), timeout=15_000)
    expect(shown).to_contain_text(error["message"][:40])


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


def write_adapter(folder: Path, config) -> str:
    """A tiny random PEFT-format adapter for the default model (rank 2, q_proj of each layer)."""
    folder.mkdir(parents=True)
    settings = {"peft_type": "LORA", "r": 2, "lora_alpha": 2, "target_modules": ["q_proj"]}
    (folder / "adapter_config.json").write_text(json.dumps(settings))
    i, o = module_shape(config, "q_proj")
    tensors = {}
    for layer in range(config.num_hidden_layers):
        key = f"base_model.model.model.layers.{layer}.self_attn.q_proj"
        tensors[f"{key}.lora_A.weight"] = torch.randn(2, i) / i**0.5
        tensors[f"{key}.lora_B.weight"] = torch.randn(o, 2) * 0.01
    save_file(tensors, str(folder / "adapter_model.safetensors"))
    return str(folder)


def test_console_shows_which_worker_holds_which_adapter(
    page: Page, telemetry_stack, loaded_model, tmp_path
):
    expect(page.get_by_test_id("connection")).to_have_text("live", timeout=15_000)
    path = write_adapter(tmp_path / "sql", loaded_model.config)
    admin = {"Authorization": f"Bearer {telemetry_stack.gateway_admin_token}"}
    url = telemetry_stack.gateway_url
    body = {"lora_name": "sql", "lora_path": path}
    resp = httpx.post(f"{url}/v1/load_lora_adapter", json=body, headers=admin, timeout=120)
    assert resp.status_code == 200, resp.text
    # The gateway loads it on every live worker of the model: both show it, from their beats.
    for worker_id in ("prefill-1", "decode-2"):
        held = page.locator(f'[data-worker="{worker_id}"] [data-testid="worker-lora"]')
        expect(held).to_have_count(1, timeout=15_000)
        expect(held).to_have_attribute("data-lora", "sql")
    page.screenshot(path=str(artifacts(tmp_path) / "console_lora.png"), full_page=True)

    body = {"lora_name": "sql"}
    resp = httpx.post(f"{url}/v1/unload_lora_adapter", json=body, headers=admin, timeout=120)
    assert resp.status_code == 200, resp.text
    expect(page.get_by_test_id("worker-lora")).to_have_count(0, timeout=15_000)
