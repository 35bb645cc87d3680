"""The capacity planner against published reference points and its own formulas."""

from __future__ import annotations

import json
import math
from dataclasses import replace

import pytest

from tokenyard.cli import main
from tokenyard.planner import calibrate, catalog
from tokenyard.planner.plan import (
    PlanError,
    PlanSettings,
    Workload,
    coolant_flow_lpm,
    layouts,
    make_plan,
)
from tokenyard.planner.roofline import Deployment

H100, H200 = catalog.HARDWARE["h100"], catalog.HARDWARE["h200"]


def plan(model: str, gpu: str = "h100", **kw):
    return make_plan(catalog.model(model), catalog.hardware(gpu), Workload(**kw))


def test_70b_in_bf16_needs_more_than_one_80gb_gpu_for_its_weights():
    m = catalog.model("llama-3.1-70b")
    assert Deployment(m, H100).weight_bytes / 1e9 > 80
    p = plan("llama-3.1-70b")
    assert p.tp >= 2 and p.pp == 1
    assert p.memory_per_gpu_gb["weights"] == pytest.approx(70.6e9 * 2 / p.tp / 1e9, rel=1e-3)
    assert sum(p.memory_per_gpu_gb.values()) <= 80 * 0.9 + 0.01


def test_8b_fits_one_h100():
    assert plan("llama-3.1-8b").tp == 1


def test_405b_needs_two_h100_nodes_but_one_h200_node():
    on_h100, on_h200 = plan("llama-3.1-405b", "h100"), plan("llama-3.1-405b", "h200")
    assert on_h100.gpus_per_replica >= 16 and on_h100.pp >= 2
    assert (on_h200.tp, on_h200.pp) == (8, 1)


def test_the_layouts_the_planner_tries_fill_the_domain_then_add_stages():
    assert layouts(H100, PlanSettings(max_pp=3)) == [(1, 1), (2, 1), (4, 1), (8, 1), (8, 2), (8, 3)]


def test_tokenyard_up_reads_the_sizes_a_plan_prints():
    """The plan's `tokenyard up` flags parse back to its tp and pp, per the up command."""
    import argparse

    from tokenyard.cli import up

    p = plan("llama-3.1-405b", "h100")
    parser = argparse.ArgumentParser()
    up.add_arguments(parser)
    config = up.config_from(parser.parse_args(p.up_args()))
    assert (config.tensor_parallel_size, config.pipeline_parallel_size) == (p.tp, p.pp)
    assert p.pp >= 2 and "--expert-parallel-size" not in p.up_args()
    # A MoE model's experts spread over the ranks of one stage; in stages, sliced by tp.
    staged = plan("deepseek-v3", "h200")
    assert staged.pp == 2 and "--expert-parallel-size" not in staged.up_args()
    one_stage = make_plan(catalog.model("deepseek-v3"), H200, Workload(), weights_dtype="fp8")
    assert one_stage.pp == 1 and one_stage.ep == one_stage.tp > 1
    assert "--expert-parallel-size" in one_stage.up_args()


def test_deepseek_v3_in_fp8_fits_eight_h200_not_eight_h100():
    m, w = catalog.model("deepseek-v3"), Workload()
    assert make_plan(m, H200, w, weights_dtype="fp8").gpus_per_replica == 8
    assert make_plan(m, H100, w, weights_dtype="fp8").gpus_per_replica > 8


def test_mla_keeps_a_small_kv_cache_per_token():
    v3 = Deployment(catalog.model("deepseek-v3"), H200)
    assert v3.kv_bytes_per_token == 61 * 576 * 2  # latent 512 + RoPE key 64, bf16


def test_batch_one_decode_is_bandwidth_bound_on_the_roofline():
    m = catalog.model("llama-3.1-70b")
    dep = Deployment(m, H100, tp=4)
    read = m.total_params * 2 + 100 * dep.kv_bytes_per_token
    expected = 2e-3 + read / 4 / (3350e9 * 0.7) + dep._allreduce_s(1)
    assert dep.decode_step_s(1, 100) == pytest.approx(expected, rel=1e-9)


def test_moe_decode_reads_its_active_experts_at_batch_one_and_all_of_them_at_scale():
    m = catalog.model("mixtral-8x7b")
    assert m.params_touched(1) == pytest.approx(m.active_params, rel=1e-9)
    assert m.params_touched(512) == pytest.approx(m.total_params, rel=1e-3)
    dense = catalog.custom_model(m, name="dense", active_params=m.total_params, experts=0,
                                 experts_per_token=0)  # fmt: skip
    assert Deployment(m, H100, tp=2).decode_step_s(1, 512) < Deployment(
        dense, H100, tp=2
    ).decode_step_s(1, 512)


def test_decode_batch_meets_the_itl_target_and_sets_the_replica_count():
    w = Workload(users=5000, tps_per_user=25)
    p = make_plan(catalog.model("llama-3.1-8b"), H100, w)
    dep = Deployment(catalog.model("llama-3.1-8b"), H100, p.tp, p.pp)
    context = w.prompt_len + w.output_len / 2
    assert dep.decode_step_s(p.decode_batch, context) <= 1 / 25
    assert (
        p.decode_batch == p.kv_capacity_seqs
        or dep.decode_step_s(p.decode_batch + 1, context) > 1 / 25
    )
    assert p.decode_replicas == math.ceil(5000 / p.decode_batch)
    assert p.decode_tok_s_per_replica == pytest.approx(
        p.decode_batch / (p.decode_itl_ms / 1e3), rel=1e-2
    )


def test_more_users_need_more_replicas_and_power():
    small, big = plan("llama-3.1-70b", users=100), plan("llama-3.1-70b", users=10000)
    assert big.gpus_total > small.gpus_total
    assert big.it_power_kw > small.it_power_kw
    assert big.facility_power_kw == pytest.approx(big.it_power_kw * H100.pue, rel=1e-3)


def test_coolant_flow_carries_the_heat_at_the_given_rise():
    # 100 kW warming water by 10 K: 100 / (4.186 x 10) kg/s = 2.389 kg/s = 143.3 L/min.
    assert coolant_flow_lpm(100.0, 10.0) == pytest.approx(143.3, abs=0.1)


def test_a_model_beyond_every_layout_is_a_clear_error():
    huge = catalog.custom_model(catalog.model("llama-3.1-405b"), name="huge", total_params=1e14,
                                active_params=1e14)  # fmt: skip
    with pytest.raises(PlanError, match="does not fit"):
        make_plan(huge, H100, Workload(), settings=PlanSettings(max_pp=4))


def test_cli_json_has_the_documented_keys(capsys):
    assert main(["plan", "--model", "llama-3.1-70b", "--gpu", "h200", "--users", "2000",
                 "--json"]) == 0  # fmt: skip
    out = json.loads(capsys.readouterr().out)
    for key in ("gpus_total", "tp", "prefill_replicas", "decode_replicas",
                "decode_tok_s_per_replica", "racks", "it_power_kw", "facility_power_kw",
                "coolant_flow_lpm"):  # fmt: skip
        assert key in out
    assert set(out["memory_per_gpu_gb"]) == {"weights", "kv", "buffers"}
    assert out["gpus_total"] == (out["prefill_replicas"] + out["decode_replicas"]) * out["tp"]


def test_cli_explicit_parameters_and_bad_presets(capsys):
    assert main(["plan", "--model", "llama-3.1-8b", "--total-params", "16e9", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["memory_per_gpu_gb"]["weights"] == pytest.approx(32.0 / out["tp"], rel=1e-3)
    assert main(["plan", "--model", "gpt-9"]) == 2
    assert "unknown model 'gpt-9'" in capsys.readouterr().err
    assert main(["plan", "--gpu", "tpu"]) == 2
    assert "unknown hardware 'tpu'" in capsys.readouterr().err


# --- the console's planner endpoint: the same make_plan behind a JSON API --------------------


@pytest.fixture
def telemetry_http():
    from fastapi.testclient import TestClient

    from tokenyard.services.telemetry.api import create_app
    from tokenyard.services.telemetry.collector import Collector
    from tokenyard.services.telemetry.settings import TelemetrySettings

    settings = TelemetrySettings()
    # The planner routes touch neither the store nor the bus.
    app = create_app(Collector(None, settings, None), None, None, settings)  # type: ignore[arg-type]
    with TestClient(app, raise_server_exceptions=False) as client:
        yield client


def test_console_plan_endpoint_returns_the_cli_plan(telemetry_http):
    body = {"model": "llama-3.1-8b", "gpu": "h200", "users": 500, "tps_per_user": 30,
            "prompt_len": 2048, "output_len": 128}  # fmt: skip
    resp = telemetry_http.post("/api/plan", json=body)
    assert resp.status_code == 200, resp.text
    expected = plan("llama-3.1-8b", "h200", users=500, tps_per_user=30, prompt_len=2048,
                    output_len=128)  # fmt: skip
    assert resp.json() == json.loads(json.dumps(expected.to_json()))
    options = telemetry_http.get("/api/plan/options").json()
    assert "llama-3.1-70b" in options["models"] and "cpu" in options["gpus"]
    page = telemetry_http.get("/planner")
    assert page.status_code == 200 and 'data-testid="plan-form"' in page.text


@pytest.mark.parametrize(
    ("body", "status", "code"),
    [
        ({"model": "gpt-5"}, 400, "bad_model"),
        ({"gpu": "tpu"}, 400, "bad_gpu"),
        ({"users": 0}, 400, "invalid_request"),
        ({"prompt_len": "long"}, 400, "invalid_request"),
        ({"model": "llama-3.1-405b", "gpu": "h100", "weights_dtype": "fp32"}, 200, None),
    ],
)
def test_console_plan_endpoint_rejects_bad_input_clearly(telemetry_http, body, status, code):
    resp = telemetry_http.post("/api/plan", json=body)
    assert resp.status_code == status, resp.text
    if code:
        assert resp.json()["error"]["code"] == code


def test_a_cpu_engines_larger_decode_steps_read_the_dense_copy():
    """Above small_batch_rows a CPU engine runs its dense bf16 copy: with a fast matmul
    (AMX) and the flops taken out of the picture, the step is the read of that copy."""
    model = catalog.MODELS["smollm2-135m"]
    fast = dict(decode_bw_eff=1.0, decode_flops_eff=1e6, step_overhead_ms=0.0)
    cpu = catalog.Hardware(
        "cpu", 16, 20.0, 2.0, 0, 0, 1, 0, 1, 0, 1, "air", 1.0,
        small_batch_rows=4, small_batch_flops_eff=1e6, dense_dtype="bf16", **fast,
    )  # fmt: skip
    dep = Deployment(model, cpu, weights_dtype="int4")
    weights = model.params_touched(8)
    kv = 8 * 100 * dep.kv_bytes_per_token
    assert dep.decode_step_s(8, 100) == pytest.approx((weights * 2.0 + kv) / 20e9)
    small = model.params_touched(4) * catalog.DTYPE_BYTES["int4"] + 4 * 100 * dep.kv_bytes_per_token
    assert dep.decode_step_s(4, 100) == pytest.approx(small / 20e9)
    # an entry without a dense copy reads its own weights at every batch
    gpu = Deployment(model, catalog.HARDWARE["h100"], weights_dtype="int4")
    assert gpu.hw.dense_dtype == "" and gpu._read_dtype(small=False) == "int4"


def test_a_widening_kernel_floors_steps_above_the_small_batch_rows():
    """On AMX a decode step of more than small_batch_rows sequences widens every int4 weight
    to bf16, so it takes no less than the weights over widen_gbs however few rows it has;
    smaller steps (linear_i16) and entries without the floor are bound by their read."""
    model = catalog.MODELS["smollm2-135m"]
    fast = dict(decode_bw_eff=1.0, decode_flops_eff=1e6, step_overhead_ms=0.0)
    cpu = catalog.Hardware(
        "cpu", 16, 20.0, 2.0, 0, 0, 1, 0, 1, 0, 1, "air", 1.0,
        small_batch_rows=4, small_batch_flops_eff=1e6, widen_gbs=5.0, **fast,
    )  # fmt: skip
    dep = Deployment(model, cpu, weights_dtype="int4")
    weights = model.params_touched(8) * catalog.DTYPE_BYTES["int4"]
    assert dep.decode_step_s(8, 100) == pytest.approx(weights / 5e9)
    assert dep.decode_step_s(16, 100) == pytest.approx(weights / 5e9)  # rows do not move it
    small = weights + 4 * 100 * dep.kv_bytes_per_token
    assert dep.decode_step_s(4, 100) == pytest.approx(small / 20e9)
    without = Deployment(model, replace(cpu, widen_gbs=0.0), weights_dtype="int4")
    read = weights + 8 * 100 * dep.kv_bytes_per_token
    assert without.decode_step_s(8, 100) == pytest.approx(read / 20e9)
    # the rows' own arithmetic comes on top of the floor, not under it: 8 more rows add
    # their compute whole, though the floor alone is far longer than either step's compute
    slow = Deployment(model, replace(cpu, decode_flops_eff=1.0), weights_dtype="int4")
    added = slow.decode_compute_s(16, 100) - slow.decode_compute_s(8, 100)
    assert added > 0 and slow.decode_compute_s(16, 100) < weights / 5e9
    assert slow.decode_step_s(16, 100) - slow.decode_step_s(8, 100) == pytest.approx(added)
    assert slow.decode_step_s(8, 100) == pytest.approx(
        weights / 5e9 + slow.decode_compute_s(8, 100)
    )


def test_calibration_splits_a_widening_step_into_its_floor_and_its_rows():
    """From a 16-row and a 32-row step of a widening kernel: the rows' rate from their
    difference, the floor from what is left of the 16-row step; the roofline then gives
    back both steps it was calibrated on, and a step in between on the line through them."""
    model = catalog.MODELS["smollm2-135m"]
    figures = calibrate.EngineFigures
    b1 = figures(prompt_len=128, output_len=24, batch=1, ttft_s=0.03, decode_step_s=0.009)
    wide = figures(prompt_len=128, output_len=8, batch=16, ttft_s=0.2, decode_step_s=0.0168)
    b32 = figures(prompt_len=128, output_len=8, batch=32, ttft_s=0.2, decode_step_s=0.0231)
    cal = calibrate.calibrate(b1, b32, 24.0, 1.3, model, wide=wide)
    hw = catalog.Hardware(
        "cpu", 16, 24.0, 1.3, 0, 0, 1, 0, 1, 0, 1, "air", 1.0,
        decode_bw_eff=1.0, prefill_flops_eff=cal["prefill_flops_eff"],
        decode_flops_eff=cal["decode_flops_eff"], step_overhead_ms=cal["step_overhead_ms"],
        widen_gbs=cal["widen_gbs"], small_batch_rows=4, small_batch_flops_eff=1.0,
    )  # fmt: skip
    dep = Deployment(model, hw, weights_dtype="int4")
    assert dep.decode_step_s(16, wide.context) == pytest.approx(0.0168, rel=1e-3)
    assert dep.decode_step_s(32, b32.context) == pytest.approx(0.0231, rel=1e-3)
    assert dep.decode_step_s(24, b32.context) == pytest.approx((0.0168 + 0.0231) / 2, rel=2e-2)


@pytest.mark.parametrize(
    "flags, amx, kind",
    [
        ({"avx2", "avx512f", "avx512_bf16", "amx_bf16"}, True, "amx"),
        ({"avx2", "avx512f", "avx512_bf16"}, False, "avx512_bf16"),
        ({"avx2", "avx512f"}, False, "avx512"),
        ({"avx2"}, False, "avx2"),
        ({"neon"}, False, "other"),
    ],
)
def test_the_cpu_calibration_is_kept_per_kind_of_cpu(
    monkeypatch, tmp_path, caplog, flags, amx, kind
):
    """Each kind of CPU (the kernels our engine runs there) reads its own entry and writes
    its own, keeping the others; a kind with none reads the AVX2 one and says so."""
    from tokenyard import platforms
    from tokenyard.planner import cpu

    machine = platforms.CpuInfo(frozenset(flags))
    assert machine.amx is amx
    monkeypatch.setattr(platforms, "cpu", lambda: machine)
    assert cpu.cpu_kind() == kind
    path = tmp_path / "cal.yaml"
    with pytest.raises(FileNotFoundError, match="planner_cpu.py"):
        cpu.load_calibration(path)
    cpu.save_calibration({"decode_flops_eff": 0.5}, path, kind="avx2")
    assert cpu.load_calibration(path, kind="avx2") == {"decode_flops_eff": 0.5}
    if kind != "avx2":
        with caplog.at_level("WARNING", logger="tokenyard.planner.cpu"):
            assert cpu.load_calibration(path) == {"decode_flops_eff": 0.5}
        assert f"({kind})" in caplog.text
        cpu.save_calibration({"decode_flops_eff": 0.9}, path)
        assert cpu.load_calibration(path) == {"decode_flops_eff": 0.9}
    assert cpu.load_calibration(path, kind="avx2") == {"decode_flops_eff": 0.5}  # kept


def test_the_shipped_calibration_has_an_entry_for_each_measured_kind():
    from tokenyard.planner import cpu

    entries = cpu._read(cpu.CALIBRATION)
    assert cpu.FALLBACK_KIND in entries
    for kind, values in entries.items():
        assert kind in ("amx", "avx512_bf16", "avx512", "avx2", "other"), kind
        assert {"decode_flops_eff", "prefill_flops_eff", "step_overhead_ms"} <= set(values), kind
