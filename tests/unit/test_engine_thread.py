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
        queued = loop._call_step()
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


class AddWaitsForTheStep(FakeEngine):
    """An add that holds the engine thread until the loop has queued a step behind it."""

    def __init__(self, thread) -> None:
        super().__init__(step_s=0.0)
        self.thread = thread
        self.step_queued_during_add: bool | None = None

    def add_request(self, *args, **kwargs) -> None:
        super().add_request(*args, **kwargs)
        queued = threading.Event()
        for _ in range(500):  # up to 5 s for the loop to queue the step
            if self.thread._work_queue.qsize():
                queued.set()
                break
            queued.wait(0.01)
        self.step_queued_during_add = queued.is_set()


async def test_an_idle_engine_gets_the_add_and_the_first_step_back_to_back():
    # The step is queued on the engine thread while the add still runs there, not after the
    # add's result has gone back to the event loop.
    thread = engine_thread()
    engine = AddWaitsForTheStep(thread)
    loop = EngineLoop(engine, thread=thread)
    runner = asyncio.create_task(loop.run())
    try:
        done = Done()
        await loop.add("r", [1, 2, 3], SamplingParams(max_tokens=3), done)
        await asyncio.wait_for(done.event.wait(), 30)
        assert engine.step_queued_during_add is True
    finally:
        runner.cancel()
        loop.shutdown()


class SlowPublisher:
    """A sink whose publish yields to the loop a while (as a NATS publish can), logging into
    the engine's log when a request's first token has gone out."""

    def __init__(self, log: list[str], rid: str) -> None:
        self.log, self.rid = log, rid
        self.event = asyncio.Event()

    async def on_output(self, out) -> None:
        await asyncio.sleep(0.03)
        if out.num_output_tokens == 1:
            self.log.append(f"sent {self.rid}")
        if out.finished:
            self.event.set()


class FirstTokenRecordingEngine(OrderRecordingEngine):
    def step(self):
        outputs = super().step()
        self.log.extend(f"computed {o.request_id}" for o in outputs if o.num_output_tokens == 1)
        return outputs


async def test_first_tokens_go_out_before_the_next_step_starts():
    thread = engine_thread()
    engine = await asyncio.get_running_loop().run_in_executor(thread, FirstTokenRecordingEngine)
    loop = EngineLoop(engine, thread=thread)
    runner = asyncio.create_task(loop.run())
    try:
        running = SlowPublisher(engine.log, "a")
        await loop.add("a", [1, 2, 3], SamplingParams(max_tokens=60), running)
        while engine.log.count("step") < 3:
            await asyncio.sleep(0.005)
        late = SlowPublisher(engine.log, "b")
        await loop.add("b", [4, 5, 6], SamplingParams(max_tokens=3), late)
        await asyncio.wait_for(late.event.wait(), 30)
        # No step began between the one that computed b's first token and its publish,
        # though a's tokens of that step (a slow publish each) went out later.
        between = engine.log[engine.log.index("computed b") : engine.log.index("sent b")]
        assert "step" not in between, engine.log
        await asyncio.wait_for(running.event.wait(), 30)
        assert engine.log.count("computed a") == 1 and "sent a" in engine.log
    finally:
        runner.cancel()
        loop.shutdown()
