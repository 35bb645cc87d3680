"""Energy per request: the step's joules shared by tokens, the counters, and the engine loop,
gateway usage, bench and telemetry figures built on them."""

from __future__ import annotations

import asyncio

import pytest

from tokenyard.bench import metrics
from tokenyard.bench.records import RequestRecord
from tokenyard.engine.sampling_params import SamplingParams
from tokenyard.facilities import energy
from tokenyard.facilities.energy import EnergyLedger, PowerModel, RaplCounter, open_counter
from tokenyard.services.gateway.responses import Accumulator, usage
from tokenyard.services.gateway.responses_api.format import response_usage
from tokenyard.services.telemetry.stats import Finished, Window
from tokenyard.services.worker.engine_loop import EngineLoop
from tokenyard.services.worker.fake_engine import FakeEngine
from tokenyard.v1 import serving_pb2 as pb


class StepCounter:
    """A counter that rises 2 J per read: every step measures 2 J."""

    source = "test"

    def __init__(self) -> None:
        self.value = 0.0

    def joules(self) -> float:
        self.value += 1.0
        return self.value


def test_a_steps_joules_are_shared_by_the_tokens_each_request_computed():
    model = PowerModel(accelerators=2, tdp_w=100.0, max_num_seqs=4)
    ledger = EnergyLedger(model, None)
    # Two of four slots busy for 0.5 s: 2 x 100 W x 0.5 x 0.5 s = 50 J, split 3:1.
    ledger.charge({"a": 300, "b": 100}, 0.5)
    a, b = ledger.take("a"), ledger.take("b")
    assert a.modelled == pytest.approx(37.5) and b.modelled == pytest.approx(12.5)
    assert a.measured is None and ledger.source == "modelled"
    assert ledger.take("a").modelled == 0.0  # handed out once
    ledger.charge({}, 1.0)  # a step that computed nothing costs nobody anything
    assert ledger.total_modelled == pytest.approx(50.0)


def test_measured_joules_come_from_the_counter_readings_around_the_step():
    ledger = EnergyLedger(PowerModel(1, 65.0, 1), StepCounter())
    before, after = ledger.read(), ledger.read()
    ledger.charge({"a": 1, "b": 3}, 0.1, before + 1.0, after + 4.0)  # 4 J measured
    assert ledger.take("b").measured == pytest.approx(3.0)
    assert ledger.source == "measured:test"


def test_the_power_model_defaults_follow_the_device():
    assert PowerModel.for_device("cuda:0", 4, 8, None).tdp_w == energy.GPU_TDP_W
    cpu = PowerModel.for_device("cpu", 1, 8, None)
    assert (cpu.tdp_w, cpu.accelerators) == (energy.CPU_TDP_W, 1)
    assert cpu.step_joules(2.0, 8) == pytest.approx(2 * energy.CPU_TDP_W)
    assert cpu.step_joules(2.0, 80) == pytest.approx(2 * energy.CPU_TDP_W)  # capped at full


def test_rapl_counters_sum_packages_and_undo_a_wrap(tmp_path):
    zones = []
    for i, uj in enumerate((1_000_000, 5_000_000)):
        z = tmp_path / f"intel-rapl:{i}"
        z.mkdir()
        (z / "energy_uj").write_text(str(uj))
        (z / "max_energy_range_uj").write_text("10000000")
        zones.append(z)
    counter = RaplCounter(zones)
    (zones[0] / "energy_uj").write_text("3000000")  # +2 J
    (zones[1] / "energy_uj").write_text("1000000")  # wrapped: +6 J
    assert counter.joules() == pytest.approx(8.0)


def test_a_counter_asked_for_by_name_must_be_readable(monkeypatch, tmp_path):
    monkeypatch.setattr(energy, "RAPL_GLOB", str(tmp_path / "intel-rapl:[0-9]*"))
    assert open_counter("auto", "cpu") is None  # auto settles for the model
    assert open_counter("none", "cpu") is None
    with pytest.raises(RuntimeError, match="rapl"):
        open_counter("rapl", "cpu")


def test_nvml_numbers_the_hosts_gpus_not_the_visible_ones(monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "2,3")
    assert energy.nvml_index("cuda:1") == 3 and energy.nvml_index("cuda") == 2
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES")
    assert energy.nvml_index("cuda:1") == 1


class Collect:
    def __init__(self) -> None:
        self.outs: list = []
        self.done = asyncio.Event()

    async def on_output(self, out) -> None:
        self.outs.append(out)
        if out.finished:
            self.done.set()


async def test_the_engine_loop_hands_each_output_its_share():
    model = PowerModel(1, 100.0, 4)
    loop = EngineLoop(FakeEngine(step_s=0.01, max_num_seqs=4), energy=EnergyLedger(model, None))
    runner = asyncio.create_task(loop.run())
    try:
        sinks = {rid: Collect() for rid in ("a", "b")}
        for rid, sink in sinks.items():
            await loop.add(rid, [1, 2, 3], SamplingParams(max_tokens=5), sink)
        await asyncio.wait_for(asyncio.gather(*(s.done.wait() for s in sinks.values())), 30)
    finally:
        runner.cancel()
        loop.shutdown()
    given = [o.energy.modelled for s in sinks.values() for o in s.outs]
    assert all(o.energy.source == "modelled" for s in sinks.values() for o in s.outs)
    assert min(given) > 0
    assert sum(given) == pytest.approx(loop.energy.total_modelled)  # nothing lost or doubled


def chunk(text: str, joules: float, measured: float | None = None, source="modelled"):
    c = pb.TokenChunk(text=text, token_ids=[1], energy_joules=joules, energy_source=source)
    if measured is not None:
        c.energy_joules_measured = measured
    return c


def test_usage_sums_energy_over_chunks_and_says_which():
    acc = Accumulator()
    for c in (chunk("a", 1.5), chunk("b", 0.5)):
        acc.add(c)
    u = usage([acc], 3).model_dump()
    assert (u["energy_joules"], u["energy_source"]) == (2.0, "modelled")
    assert "energy_joules_modelled" not in u
    measured = Accumulator()
    for c in (chunk("a", 1.0, 4.0, "measured:rapl"), chunk("b", 1.0, 2.0, "measured:rapl")):
        measured.add(c)
    u = usage([measured], 3).model_dump()
    assert (u["energy_joules"], u["energy_source"], u["energy_joules_modelled"]) == (
        6.0, "measured:rapl", 2.0,
    )  # fmt: skip
    # One share unmeasured (a worker without a counter): the whole figure is the model's.
    measured.add(chunk("c", 1.0))
    assert usage([measured], 3).energy_source == "modelled"
    assert response_usage([acc], 3).model_dump()["energy_joules"] == 2.0
    assert "energy_joules" not in usage([Accumulator()], 3).model_dump()  # none reported


def record(output_tokens: int, joules: float | None, ttft_ms: float) -> RequestRecord:
    return RequestRecord(
        index=0, session=0, turn=0, warmup=False, start_s=0.0, end_s=1.0, ok=True,
        max_tokens=16, output_tokens=output_tokens, prompt_tokens=4, chunk_ms=[ttft_ms],
        energy_joules=joules, energy_source=None if joules is None else "modelled",
    )  # fmt: skip


def test_bench_summary_reports_output_tokens_per_joule_and_at_the_slo():
    recs = [record(10, 2.0, 100.0), record(30, 3.0, 900.0), record(5, None, 100.0)]
    e = metrics.summarize(recs, metrics.SLOs(ttft_ms=500.0))["energy"]
    assert e["requests"] == 2 and e["joules"] == pytest.approx(5.0)
    assert e["output_tokens_per_joule"] == pytest.approx(40 / 5)
    assert e["output_tokens_per_joule_at_slo"] == pytest.approx(10 / 5)  # the slow one missed
    assert metrics.summarize([record(5, None, 1.0)], metrics.SLOs())["energy"] is None


def test_telemetry_window_gives_joules_per_output_token():
    w = Window(60.0)
    w.add(Finished(at=100.0, ttft_s=0.1, duration_s=1.0, prompt_tokens=4, cached_tokens=0,
                   output_tokens=10, energy_joules=5.0))  # fmt: skip
    w.add(Finished(at=100.0, ttft_s=0.1, duration_s=1.0, prompt_tokens=4, cached_tokens=0,
                   output_tokens=90, energy_joules=None))  # fmt: skip
    assert w.figures(101.0)["joules_per_token"] == pytest.approx(0.5)
    assert Window(60.0).figures(0.0)["joules_per_token"] is None
