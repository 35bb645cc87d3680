"""All engine calls on one thread; the asyncio loop only waits for them.

The engine is not thread-safe, so every call (add_request, step, abort, import/commit,
export/release, stats) runs on one thread (a single-thread executor): :meth:`EngineLoop.call`
for calls, which go ahead of a step already queued there, and :meth:`EngineLoop.run`, which
steps the engine while it has work and hands each step's outputs to the sink registered for
the request, on the event loop.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from functools import partial
from typing import Any, Protocol, TypeVar

from tokenyard.engine.contract import Engine
from tokenyard.engine.outputs import Energy, RequestOutput
from tokenyard.engine.sampling_params import SamplingParams
from tokenyard.facilities.energy import EnergyLedger
from tokenyard.lifecycle import trim_heap
from tokenyard.services.worker.step_timing import StepTiming

log = logging.getLogger(__name__)

T = TypeVar("T")

# A step that returns nothing this fast did no work (e.g. only an uncommitted import is
# pending): wait a little instead of spinning a core.
IDLE_STEP_S = 0.0005
IDLE_SLEEP_S = 0.002
# Idle this long, the loop hands the heap that steps freed back to the OS (see trim_heap).
TRIM_AFTER_IDLE_S = 1.0


def _first_tokens(out: RequestOutput) -> bool:
    """Whether these are the request's first output tokens (its prompt was just computed)."""
    return bool(out.new_token_ids) and out.num_output_tokens == len(out.new_token_ids)


class Sink(Protocol):
    async def on_output(self, out: RequestOutput) -> None: ...


@dataclass
class StepResult:
    outputs: list[RequestOutput]
    kv_events: list[tuple[str, list[int]]]
    has_unfinished: bool
    seconds: float
    tokens: int  # tokens the step computed
    stats: Any  # the engine's stats right after the step
    batch: dict[str, int]  # tokens computed per request
    joules: tuple[float | None, float | None]  # the energy counter before and after the step


def engine_thread() -> ThreadPoolExecutor:
    """The one thread an engine is built on and every later call of it runs on.

    NOTE: build the engine on this thread, not only step it there. OpenMP (torch's runtime
    and our CPU kernels') gives each thread that opens a parallel region a team of helper
    threads of its own. Loading on one thread and stepping on another leaves two teams, more
    threads than cores, and libgomp then stops spin-waiting between parallel regions: every
    one of a step's hundreds of small matmuls waits for a futex wake-up: a decode step ran
    about 1.5x slower stepped on another thread than the load's (docs/benchmarks.md)."""
    return ThreadPoolExecutor(max_workers=1, thread_name_prefix="engine")


class EngineLoop:
    def __init__(
        self,
        engine: Engine,
        on_kv_events: Callable[[list[tuple[str, list[int]]]], Any] | None = None,
        *,
        thread: ThreadPoolExecutor | None = None,
        energy: EnergyLedger | None = None,
    ) -> None:
        """``thread``: the :func:`engine_thread` the engine was built on (a new one if None);
        ``energy``: charges each step's joules to its requests, handed out with outputs."""
        self.engine = engine
        self.energy = energy
        self.sinks: dict[str, Sink] = {}
        self._pool = thread or engine_thread()
        self._wake = asyncio.Event()
        self._on_kv_events = on_kv_events
        self.tokens_generated = 0
        self.timing = StepTiming()
        self._stepping = False
        self._last_stats: Any = None
        self._busy_since: float | None = None  # when the engine call running now began
        self._heap_trimmed = True  # nothing stepped since the last trim
        self._calls: deque[tuple[Callable[[], Any], Future[Any]]] = deque()

    async def call(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        """Run ``fn`` on the engine thread, before any step not yet begun.

        NOTE: the loop queues the next step as soon as a step ends (see :meth:`run`), so a
        call that simply queued behind it waited for the step running and the next one, and
        a new request's add_request or a prefix fetch paid for both. Calls wait in a queue of
        their own, which the next step empties before it starts, and a job per call empties
        it when no step comes. A call whose caller was cancelled before it began never runs."""
        return await asyncio.wrap_future(self._queue_call(fn, *args, **kwargs))

    def queue(self, fn: Callable[..., T], *args: Any) -> asyncio.Future[T]:
        """Queue ``fn`` on the engine thread now, as :meth:`call` does, and return its
        future: calls queued one after the other with no await between run at the same
        step boundary, in order (a KV-cache prefix's landing, then its request's add)."""
        return asyncio.wrap_future(self._queue_call(fn, *args))

    def _queue_call(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> Future[T]:
        future: Future[T] = Future()
        self._calls.append((partial(self._timed, fn, *args, **kwargs), future))
        self._pool.submit(self._run_calls)
        return future

    def _run_calls(self) -> None:
        # On the engine thread.
        while self._calls:
            fn, future = self._calls.popleft()
            if not future.set_running_or_notify_cancel():
                continue
            try:
                result = fn()
            except BaseException as exc:  # the caller gets it, as from an executor
                future.set_exception(exc)
            else:
                future.set_result(result)

    def _call_step(self) -> asyncio.Future[StepResult]:
        """Queue a step on the engine thread now (not when the caller next yields: publishing
        a step's outputs never yields, so a step queued by a task waited for all of it)."""
        loop = asyncio.get_running_loop()
        return loop.run_in_executor(self._pool, self._timed, self._calls_then_step)

    def _calls_then_step(self) -> StepResult:
        self._run_calls()
        return self._step()

    def _timed(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        # On the engine thread. Calls run inside a step's call too: the outer one counts.
        before = self._busy_since
        if before is None:
            self._busy_since = time.monotonic()
        try:
            return fn(*args, **kwargs)
        finally:
            self._busy_since = before

    def busy_for(self, now: float) -> float:
        """How long the engine call running now has run (0 when the thread is idle): a stuck
        engine shows here, since every step and the heartbeats' stats read are calls."""
        since = self._busy_since
        return 0.0 if since is None else max(0.0, now - since)

    def wake(self) -> None:
        self._wake.set()

    async def add(
        self,
        request_id: str,
        prompt: list[int],
        params: SamplingParams,
        sink: Sink,
        *,
        prefill_only: bool = False,
    ) -> None:
        """Queue a request; its outputs go to ``sink`` (raises the engine's ValueError).

        The loop is woken before the add is awaited, so that an idle engine thread runs the
        add and the first step back to back rather than after a hand-over through the event
        loop. Should the add fail, that step finds nothing new and the loop sleeps again."""
        self.sinks[request_id] = sink
        added = self._queue_call(
            self.engine.add_request, request_id, prompt, params, prefill_only=prefill_only
        )
        self.wake()
        try:
            await asyncio.wrap_future(added)
        except BaseException:
            self.sinks.pop(request_id, None)
            raise

    async def abort(self, request_id: str) -> bool:
        self.sinks.pop(request_id, None)
        if self.energy is not None:
            self.energy.take(request_id)
        return bool(await self.call(self.engine.abort, request_id))

    async def abort_if_waiting(self, request_id: str) -> bool:
        """Abort a request the engine has queued and not begun (nothing computed, nothing
        sent): True when it was. Between two steps, so no output of it is on its way. An
        engine without ``abort_if_waiting`` begins every request it takes: False."""
        abort = getattr(self.engine, "abort_if_waiting", None)
        if abort is None or not await self.call(abort, request_id):
            return False
        self.sinks.pop(request_id, None)
        if self.energy is not None:
            self.energy.take(request_id)
        return True

    async def stats(self) -> Any:
        """The engine's stats without queueing behind a step: while one runs (or any engine
        call), the snapshot taken after the previous step; a fresh read otherwise.

        NOTE: heartbeats come from here. Waiting for the engine thread made a worker busy
        with a long step (a big prefill, a batch of resumed sequences) miss its heartbeats
        and be declared dead while it was working."""
        busy = self._stepping or self._busy_since is not None
        if busy and self._last_stats is not None:
            return self._last_stats
        self._last_stats = await self.call(self.engine.stats)
        return self._last_stats

    def _step(self) -> StepResult:
        before = self.energy.read() if self.energy is not None else None
        started = time.perf_counter()
        outputs = self.engine.step()
        events = self.engine.drain_kv_events()
        seconds = time.perf_counter() - started
        after = self.energy.read() if self.energy is not None else None
        tokens = self.engine.last_step_tokens
        batch = dict(self.engine.last_step_batch)
        stats = self.engine.stats()
        return StepResult(
            outputs, events, self.engine.has_unfinished(), seconds, tokens, stats, batch,
            (before, after),
        )  # fmt: skip

    async def run(self) -> None:
        """Step while there is work; sleep on the wake event otherwise. Runs until cancelled.

        The next step starts on the engine thread before this step's outputs are dispatched
        on the loop, so publishing tokens overlaps computing the next ones instead of
        leaving the engine idle (every engine call is still serialized on the one thread).
        """
        while True:
            await self._wait_for_work()
            self._wake.clear()
            self._stepping = True
            self._heap_trimmed = False
            try:
                await self._step_until_idle()
            finally:
                self._stepping = False

    async def _wait_for_work(self) -> None:
        """Sleep until woken; after TRIM_AFTER_IDLE_S without work, trim the heap first.

        Waiting before trimming keeps back-to-back requests from trimming between them and
        faulting the same pages in again."""
        if not self._heap_trimmed:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._wake.wait(), TRIM_AFTER_IDLE_S)
            if not self._wake.is_set():
                await self.call(trim_heap)
                self._heap_trimmed = True
        await self._wake.wait()

    async def _step_until_idle(self) -> None:
        result = await self._call_step()
        while True:
            self._charge_energy(result)
            idle = not result.outputs and result.seconds < IDLE_STEP_S
            dispatched = time.perf_counter()
            # First tokens go out before the next step starts: on a small host the publish,
            # the NATS server and the gateway otherwise wait for cores that step holds.
            first = [out for out in result.outputs if _first_tokens(out)]
            rest = [out for out in result.outputs if not _first_tokens(out)]
            if first:
                await self._dispatch_outputs(first)
                await asyncio.sleep(0)  # the NATS client writes them out
            ahead = None
            if result.has_unfinished and not idle:
                ahead = self._call_step()
            self._last_stats = result.stats
            await self._dispatch_outputs(rest)
            if result.kv_events and self._on_kv_events is not None:
                await self._on_kv_events(result.kv_events)
            self.timing.record(
                result.tokens,
                len(result.outputs),
                result.seconds,
                time.perf_counter() - dispatched,
            )
            if not result.has_unfinished:
                break
            if ahead is None:
                await asyncio.sleep(IDLE_SLEEP_S)
                ahead = self._call_step()
            result = await ahead

    def _charge_energy(self, result: StepResult) -> None:
        """The step's joules onto its requests, and each output's share onto the output."""
        if self.energy is None:
            return
        self.energy.charge(result.batch, result.seconds, *result.joules)
        for out in result.outputs:
            owed = self.energy.take(out.request_id)
            out.energy = Energy(owed.modelled, owed.measured, self.energy.source)

    async def _dispatch_outputs(self, outputs: list[RequestOutput]) -> None:
        for out in outputs:
            self.tokens_generated += len(out.new_token_ids)
            sink = self.sinks.get(out.request_id)
            if out.finished:
                self.sinks.pop(out.request_id, None)
            if sink is None:
                continue
            try:
                await sink.on_output(out)
            except Exception:
                log.exception("sink of %s failed", out.request_id)

    def shutdown(self) -> None:
        self._pool.shutdown(wait=True, cancel_futures=True)
        while self._calls:  # never begun: their callers must not wait forever
            self._calls.popleft()[1].cancel()
