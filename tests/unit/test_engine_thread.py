"""Every engine call runs on the thread the engine was built on (see engine_thread's note:
OpenMP teams are per thread, and a second team made a two-thread decode step 1.5x slower)."""

from __future__ import annotations

import asyncio
import threading

from tokenyard.engine.sampling_params import SamplingParams
from tokenyard.services.worker.engine_loop import EngineLoop, engine_thread
from tokenyard.services.worker.fake_engine import FakeEngine


class ThreadRecordingEngine(FakeEngine):
    def __init__(self) -> None:
        super().__init__(step_s=0.0)
        self.built_on = threading.get_ident()
        self.stepped_on: set[int] = set()

    def step(self):
        self.stepped_on.add(threading.get_ident())
        return super().step()


class Done:
    def __init__(self) -> None:
        self.event = asyncio.Event()

    async def on_output(self, out) -> None:
        if out.finished:
            self.event.set()


async def test_steps_run_on_the_thread_that_built_the_engine():
    thread = engine_thread()
    engine = await asyncio.get_running_loop().run_in_executor(thread, ThreadRecordingEngine)
    assert engine.built_on != threading.get_ident()
    loop = EngineLoop(engine, thread=thread)
    runner = asyncio.create_task(loop.run())
    try:
        done = Done()
        await loop.add("r", [1, 2, 3], SamplingParams(max_tokens=5), done)
        await asyncio.wait_for(done.event.wait(), 30)
        assert engine.stepped_on == {engine.built_on}
    finally:
        runner.cancel()
        loop.shutdown()
