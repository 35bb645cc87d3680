"""Every engine call runs on the thread the engine was built on (see engine_thread's note:
OpenMP teams are per thread, and a second team made a two-thread decode step 1.5x slower)."""

from __future__ import annotations

import asyncio
import contextlib
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


class OrderRecordingEngine(FakeEngine):
    """Steps that take a while, each recorded with what ran on the engine thread."""

    def __init__(self) -> None:
        super().__init__(step_s=0.02)
        self.log: list[str] = []

    def step(self):
        self.log.append("step")
        return super().step()

    def marker(self, name: str) -> str:
        self.log.append(name)
        return name


async def test_a_call_goes_ahead_of_a_step_queued_before_it():
    thread = engine_thread()
    engine = await asyncio.get_running_loop().run_in_executor(thread, OrderRecordingEngine)
    loop = EngineLoop(engine, thread=thread)
    runner = asyncio.create_task(loop.run())
    try:
        done = Done()
        await loop.add("r", [1, 2, 3], SamplingParams(max_tokens=40), done)
        while engine.log.count("step") < 3:
            await asyncio.sleep(0.005)
        entered, gate = threading.Event(), threading.Event()

        def hold() -> None:  # keeps the engine thread busy while the test queues work
            engine.log.append("hold")
            entered.set()
            gate.wait(10)

        async def held() -> None:
            while not entered.is_set():
                await asyncio.sleep(0.001)

        # a step queued on the engine thread (as run() queues the next), then a call: the
        # call runs first, straight after what the thread was doing
        blocker = asyncio.ensure_future(loop.call(hold))
        await held()
        queued = asyncio.ensure_future(loop._call_step())
        await asyncio.sleep(0.01)
        call = asyncio.ensure_future(loop.call(engine.marker, "call"))
        await asyncio.sleep(0.01)
        gate.set()
        assert await call == "call"
        await asyncio.gather(blocker, queued)
        assert engine.log[engine.log.index("hold") + 1] == "call", engine.log
        # a call whose caller gave up before it began never runs
        entered.clear()
        gate.clear()
        blocker = asyncio.ensure_future(loop.call(hold))
        await held()
        gone = asyncio.ensure_future(loop.call(engine.marker, "cancelled"))
        await asyncio.sleep(0)
        gone.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await gone  # its cancellation reaches the engine thread's future before this
        gate.set()
        await blocker
        await asyncio.wait_for(done.event.wait(), 30)
        assert "cancelled" not in engine.log
    finally:
        runner.cancel()
        loop.shutdown()
