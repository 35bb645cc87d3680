"""The engine loop trims the heap once it has been idle a while after work, and only then."""

from __future__ import annotations

import asyncio

from tokenyard.engine.sampling_params import SamplingParams
from tokenyard.services.worker import engine_loop
from tokenyard.services.worker.engine_loop import EngineLoop
from tokenyard.services.worker.fake_engine import FakeEngine


class Collect:
    def __init__(self) -> None:
        self.done = asyncio.Event()

    async def on_output(self, out) -> None:
        if out.finished:
            self.done.set()


async def test_the_heap_is_trimmed_after_work_once_idle(monkeypatch):
    trims: list[int] = []
    monkeypatch.setattr(engine_loop, "TRIM_AFTER_IDLE_S", 0.05)
    monkeypatch.setattr(engine_loop, "trim_heap", lambda: trims.append(1))
    loop = EngineLoop(FakeEngine(step_s=0.0))
    runner = asyncio.create_task(loop.run())
    try:
        await asyncio.sleep(0.2)
        assert trims == []  # no work yet: nothing to give back
        sink = Collect()
        await loop.add("r", [1, 2, 3], SamplingParams(max_tokens=4), sink)
        await asyncio.wait_for(sink.done.wait(), 30)
        for _ in range(300):
            if trims:
                break
            await asyncio.sleep(0.05)
        await asyncio.sleep(0.2)
        assert trims == [1]  # once per idle spell, not on every wake-up timeout
    finally:
        runner.cancel()
        loop.shutdown()
