"""The fleet simulator against `tokenyard bench` on this machine's single stack.

1. Calibrate the planner's `cpu` entry on our engine, here and now (the short form of
   benchmarks/planner_cpu.py), before the stack starts so it has the cores to itself.
2. Start the stack with one aggregated worker (the simulator's replicas do not share cores;
   one worker keeps that true) and run `tokenyard bench serve` against it: a fixed
   workload, open loop, Poisson arrivals.
3. Replay the same requests at the same send times in the simulator, on a one-replica
   fleet whose step times come from that calibration and whose engine limits are the
   worker's (max_num_seqs, the per-step token budget).
4. Output throughput and TTFT p50 must agree within 30%.
"""

from __future__ import annotations

import dataclasses
import json
import statistics
import subprocess
import sys
import time

import httpx
import pytest

from tokenyard import platforms
from tokenyard.bus.embedded import free_port
from tokenyard.planner import calibrate, cpu
from tokenyard.planner.roofline import Deployment
from tokenyard.services.launch.stack import StackConfig
from tokenyard.services.worker.settings import WorkerSettings
from tokenyard.sim.fleet import FleetSpec, build_fleet
from tokenyard.sim.simulator import SimConfig, Simulation
from tokenyard.sim.workload import from_bench

# NOTE: TTFT p50 once came out 33% low (simulated 229 ms, measured 342 ms): the worker
# stepped its engine on another thread than the one that loaded it, and OpenMP's second
# team made every step about 1.5x slower than the calibration's (services/worker/
# engine_loop.engine_thread). Since the fix: -11%, -17% and -26% on an idle 2-core machine.
pytestmark = [pytest.mark.slow, pytest.mark.calibration, pytest.mark.timeout(900)]
# NOTE: on a 2-core Xeon with AMX (7 December 2026) TTFT p50 came out -47% and -43% at the
# head of that day, and -54% at the commit before it (simulated 51-58 ms, measured 96-123 ms;
# throughput within 1%): the engine's own 512-token prefill was predicted within 7%, so the
# ~45 ms missing is in the stack's path under load, which the idle round trip does not
# capture on that kind. Open (docs/planning.md): there the TTFT check xfails, with its figure,
# where it misses; throughput is still asserted.
TTFT_MISSED_ON_AMX = platforms.cpu().amx

TOLERANCE = 0.30
# A short, fixed workload: 24 completions of 128 prompt tokens and 32 output tokens, at
# about one request a second (a few in flight at once: queueing and batching both count).
BENCH_ARGS = ["--endpoint", "completions", "--workload", "chat", "--num-prompts", "24",
              "--warmup", "2", "--input-len", "128", "--output-len", "32", "--len-sigma", "0",
              "--ignore-eos", "--request-rate", "1.0", "--seed", "3", "--no-progress"]  # fmt: skip
ENGINE_STEP_TOKENS = 512  # the engine's default per-step token budget (the worker sets none)


@pytest.fixture(scope="module")
def calibration() -> dict:
    bw, tflops = cpu.memory_read_gbs(), cpu.matmul_tflops()
    # One run per measurement, as when its margins above were taken: the best of several
    # (the planner test's) makes the engine look faster than a stack's first requests find it.
    lengths = dataclasses.replace(calibrate.SHORT, runs=1)
    return calibrate.calibrate_and_check(calibrate.make_engine(), bw, tflops, lengths)


def bench(gateway_url: str, out) -> dict:
    cmd = [sys.executable, "-m", "tokenyard.cli", "bench", "serve", "--url", gateway_url,
           *BENCH_ARGS, "--out", str(out)]  # fmt: skip
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout + done.stderr
    return json.loads(out.read_text())


def idle_round_trip(gateway_url: str, model_id: str) -> tuple[float, int]:
    """Median seconds of a 1-token completion of a tiny prompt on the idle stack, and the
    prompt's tokens: what a request spends outside the engine, plus one small prefill."""
    body = {"model": model_id, "prompt": "Hi", "max_tokens": 1, "temperature": 0}
    times, tokens = [], 0
    with httpx.Client(timeout=60) as client:
        for _ in range(7):
            t0 = time.perf_counter()
            resp = client.post(f"{gateway_url}/v1/completions", json=body)
            times.append(time.perf_counter() - t0)
            assert resp.status_code == 200, resp.text
            tokens = resp.json()["usage"]["prompt_tokens"]
    return statistics.median(times[2:]), tokens  # the first ones warm the path


def simulate(calibration: dict, bench_file, round_trip: tuple[float, int]) -> dict:
    model = calibrate.default_model()
    hw = cpu.cpu_hardware(calibration["calibration"], remeasure=False)
    dep = Deployment(model, hw, weights_dtype="int4")
    # The simulator models the engines; the stack's own path is measured, not modelled.
    seconds, tokens = round_trip
    path_s = max(0.0, seconds - dep.prefill_s(tokens))
    spec = FleetSpec(0, 0, both_replicas=1, max_num_seqs=WorkerSettings().max_num_seqs)
    workers, inventory = build_fleet(dep, spec, model.name)
    for w in workers:
        w.chunk_tokens = ENGINE_STEP_TOKENS
    requests = from_bench(bench_file)
    config = SimConfig(policy="kv-aware", ttft_slo_s=1e9, itl_slo_s=1e9, request_path_s=path_s)
    return Simulation(workers, inventory, requests, config).run().to_json()


def test_simulator_predicts_the_single_stack_within_30_percent(calibration, launch_stack, tmp_path):
    # the worker runs the precision the calibration measured (tokenyard up's own)
    shipped = {f"TOKENYARD_WORKER_{k.upper()}": v for k, v in calibrate.SHIPPED.items()}
    config = StackConfig(port=free_port(), aggregated=True, kvcache=False, facilities=False,
                         telemetry=False, worker_env=shipped)  # fmt: skip
    with launch_stack(config) as stack:
        stack.wait_ready(timeout=300)
        report = bench(stack.gateway_url, tmp_path / "bench.json")
        round_trip = idle_round_trip(stack.gateway_url, stack.model_id)
    records = [r for r in report["runs"][-1]["records"] if not r["warmup"]]
    assert len(records) == 24 and all(r["ok"] for r in records)
    summary = report["runs"][-1]["summary"]
    measured = {
        "throughput_tok_s": summary["output_token_throughput"],
        "ttft_p50_ms": summary["ttft_ms"]["p50"],
    }
    sim = simulate(calibration, tmp_path / "bench.json", round_trip)
    assert sim["completed"] == 24
    print(json.dumps({"measured": measured, "simulated": {k: sim[k] for k in measured},
                      "idle_round_trip_ms": round(1e3 * round_trip[0], 1)}))  # fmt: skip
    for key, value in measured.items():
        error = sim[key] / value - 1
        if key == "ttft_p50_ms" and TTFT_MISSED_ON_AMX and abs(error) > TOLERANCE:
            pytest.xfail(f"AMX kind, known miss (NOTE above): {key} {error:+.0%}")
        assert abs(error) <= TOLERANCE, (
            f"{key}: simulated {sim[key]:.1f}, measured {value:.1f} ({error:+.0%}); "
            f"calibration {calibration['calibration']}"
        )
