"""The fleet simulator: its arithmetic on one worker, and its policies on small fleets."""

from __future__ import annotations

import json
import statistics

import pytest

from tokenyard.cli import main
from tokenyard.planner import catalog
from tokenyard.planner.roofline import Deployment
from tokenyard.sim.fleet import FleetSpec, build_fleet
from tokenyard.sim.simulator import SimConfig, Simulation
from tokenyard.sim.workload import SimRequest, WorkloadSpec, from_bench, generate

H100 = catalog.HARDWARE["h100"]
M8B = catalog.model("llama-3.1-8b")


def fleet(prefill: int, decode: int, both: int = 0, tp: int = 1, **kw):
    dep = Deployment(M8B, H100, tp=tp)
    return dep, build_fleet(dep, FleetSpec(prefill, decode, both, **kw), M8B.name)


def test_one_request_on_one_worker_takes_the_roofline_time():
    dep, (workers, inventory) = fleet(0, 0, 1)
    req = SimRequest(0, 0.0, 100, 11)
    result = Simulation(workers, inventory, [req], SimConfig(policy="kv-aware")).run()
    prefill = dep.prefill_s(100)
    decode = sum(dep.decode_step_s(1, 100 + k) for k in range(10))
    assert result.completed == 1 and result.rejected == 0
    assert result.ttft_p50_ms == pytest.approx(prefill * 1e3, abs=0.01)
    assert result.duration_s == pytest.approx(prefill + decode, rel=1e-3)
    assert result.itl_p50_ms == pytest.approx(decode / 10 * 1e3, abs=0.01)


def test_the_request_path_adds_to_ttft_only():
    dep, (workers, inventory) = fleet(0, 0, 1)
    req = SimRequest(0, 0.0, 100, 11)
    config = SimConfig(policy="kv-aware", request_path_s=0.025)
    result = Simulation(workers, inventory, [req], config).run()
    decode = sum(dep.decode_step_s(1, 100 + k) for k in range(10))
    assert result.ttft_p50_ms == pytest.approx((dep.prefill_s(100) + 0.025) * 1e3, abs=0.01)
    assert result.itl_p50_ms == pytest.approx(decode / 10 * 1e3, abs=0.01)


def test_every_request_completes_and_tokens_add_up():
    _, (workers, inventory) = fleet(2, 4)
    reqs = generate(WorkloadSpec(kind="poisson", requests=400, rate=40, prompt_len=512,
                                 output_len=64))  # fmt: skip
    result = Simulation(workers, inventory, reqs, SimConfig(policy="kv-aware")).run()
    assert result.completed == 400 and result.rejected == 0
    tokens = sum(r.output_len for r in reqs)
    assert result.throughput_tok_s == pytest.approx(tokens / result.duration_s, rel=1e-3)
    assert result.goodput_req_s <= 400 / result.duration_s * (1 + 1e-3)


def test_kv_aware_routing_finds_more_cached_prefixes_than_round_robin():
    reqs = generate(WorkloadSpec(kind="shared-prefix", requests=600, rate=30, groups=16,
                                 prompt_len=1024, prefix_len=768, output_len=32))  # fmt: skip
    rates = {}
    for policy in ("round-robin", "kv-aware"):
        _, (workers, inventory) = fleet(4, 4)
        rates[policy] = Simulation(workers, inventory, reqs, SimConfig(policy=policy)).run()
    assert rates["kv-aware"].prefix_hit_rate > rates["round-robin"].prefix_hit_rate + 0.05
    assert rates["kv-aware"].ttft_p50_ms < rates["round-robin"].ttft_p50_ms


def _low_cap_fleet(rate: float, policy: str):
    """Four racks of four 8-GPU replicas; rack caps spread 60% apart."""
    reqs = generate(WorkloadSpec(kind="poisson", requests=3000, rate=rate, prompt_len=2048,
                                 output_len=64))  # fmt: skip
    _, (workers, inventory) = fleet(8, 8, tp=8, max_num_seqs=64, rack_cap_spread=0.6)
    result = Simulation(workers, inventory, reqs, SimConfig(policy=policy)).run()
    lowest = min(inventory.racks, key=lambda r: r.power_cap_kw).name
    return result, result.rack_tokens.get(lowest, 0) / sum(result.rack_tokens.values())


def test_blind_placement_overloads_a_low_capped_rack_into_power_capping():
    blind, _ = _low_cap_fleet(160, "kv-aware")
    assert blind.throttle_events > 0 and blind.rack_peak_fraction_of_cap > 1.0
    assert blind.completed == 3000


def test_the_facilities_state_moves_work_off_a_derated_rack():
    blind, blind_share = _low_cap_fleet(120, "kv-aware")
    aware, aware_share = _low_cap_fleet(120, "kv-aware+facilities")
    assert aware.derate_events > 0
    assert aware_share < blind_share
    assert aware.completed == blind.completed == 3000


@pytest.mark.parametrize("policy", ["kv-aware", "kv-aware+facilities"])
def test_the_candidate_index_places_exactly_as_choose_over_every_worker(policy):
    """Shared prefixes (holders and non-holders compete), low caps (derate, drain, pressure
    penalties) and overload (route errors): the same result either way."""
    reqs = generate(WorkloadSpec(kind="shared-prefix", requests=1500, rate=150, groups=12,
                                 prompt_len=2048, prefix_len=1536, output_len=48))  # fmt: skip
    results = []
    for indexed in (True, False):
        _, (workers, inventory) = fleet(6, 10, tp=8, max_num_seqs=32, rack_cap_spread=0.6)
        config = SimConfig(policy=policy, candidate_index=indexed)
        results.append(Simulation(workers, inventory, reqs, config).run().to_json())
    assert results[0] == results[1]
    assert results[0]["completed"] == 1500


def test_bursts_keep_the_mean_rate_and_multi_turn_chains_its_history():
    bursts = generate(WorkloadSpec(kind="bursts", requests=20000, rate=50.0, burst_factor=4))
    assert 20000 / bursts[-1].arrival_s == pytest.approx(50.0, rel=0.05)
    gaps = [b.arrival_s - a.arrival_s for a, b in zip(bursts, bursts[1:], strict=False)]
    assert statistics.pstdev(gaps) > statistics.mean(gaps)  # burstier than Poisson
    turns = generate(WorkloadSpec(kind="multi-turn", requests=40, turns=4))
    by_key = {r.cache_key: r for r in turns}
    for r in turns:
        if r.prefix_key:
            prev = by_key[r.prefix_key]
            assert r.prefix_len == prev.cache_len == prev.prompt_len + prev.output_len
            assert r.arrival_s > prev.arrival_s and r.prompt_len > r.prefix_len


def test_bench_results_replay(tmp_path):
    records = [
        {"warmup": True, "ok": True, "start_s": 0.0, "prompt_tokens": 5, "output_tokens": 5},
        {"warmup": False, "ok": True, "start_s": 1.0, "scheduled_s": 0.9, "prompt_tokens": 128,
         "output_tokens": 32},
        {"warmup": False, "ok": True, "start_s": 2.5, "prompt_tokens": 64, "output_tokens": 16},
    ]  # fmt: skip
    path = tmp_path / "bench.json"
    path.write_text(json.dumps({"runs": [{"records": records}]}))
    reqs = from_bench(path)
    assert [(r.arrival_s, r.prompt_len, r.output_len) for r in reqs] == [
        (0.0, 128, 32),
        (1.6, 64, 16),
    ]
    jsonl = tmp_path / "records.jsonl"
    jsonl.write_text("\n".join(json.dumps(r) for r in records))
    assert from_bench(jsonl) == reqs
    path.write_text(json.dumps({"runs": [{"records": records[:1]}]}))
    with pytest.raises(ValueError, match="no measured requests"):
        from_bench(path)


def test_cli_json_and_png(tmp_path, capsys):
    png = tmp_path / "sim.png"
    argv = ["simulate", "--model", "llama-3.1-8b", "--gpu", "h100", "--gpus", "16",
            "--requests", "300", "--workload", "shared-prefix", "--pd-ratios", "1:3,1:1",
            "--json", "--png", str(png)]  # fmt: skip
    assert main(argv) == 0
    printed = capsys.readouterr()
    out = json.loads(printed.out)
    for key in ("goodput_req_s", "ttft_p50_ms", "ttft_p99_ms", "itl_p50_ms", "throttle_events",
                "rack_peak_kw"):  # fmt: skip
        assert key in out
    assert [r["pd_ratio"] for r in out["runs"]] == ["4:12"] * 3 + ["8:8"] * 3
    assert {r["policy"] for r in out["runs"]} == {"round-robin", "kv-aware", "kv-aware+facilities"}
    assert all(r["completed"] == 300 for r in out["runs"])
    assert png.stat().st_size > 10_000
    assert f"chart written to {png.resolve()}" in printed.err
    assert main(["simulate", "--gpus", "4", "--pd-ratios", "x"]) == 2
