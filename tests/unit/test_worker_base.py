"""The worker's request plumbing over the fake engine and a recording bus (no NATS)."""

from __future__ import annotations

import asyncio
import time
from types import SimpleNamespace

import pytest

from tokenyard.bus import subjects
from tokenyard.engine.sampling_params import SamplingParams
from tokenyard.services.worker.base import WorkerBase
from tokenyard.services.worker.convert import engine_params
from tokenyard.services.worker.fake_engine import FakeEngine, next_token
from tokenyard.services.worker.handoff import JOINED
from tokenyard.services.worker.prefill import PrefillHandler
from tokenyard.services.worker.presence import DUMP_OVERHEAD_BYTES
from tokenyard.services.worker.settings import WorkerSettings
from tokenyard.v1 import serving_pb2 as pb
from tokenyard.v1.facilities_pb2 import RackState, RackStateKind

PROMPT = [5, 6, 7, 8]
GW = "gw-test"  # the gateway the requests came from


class RecordingBus:
    def __init__(self) -> None:
        self.sent: list[tuple[str, object]] = []
        self.nc = SimpleNamespace(is_connected=True, max_payload=1 << 20)

    async def publish(self, subject, message, headers=None) -> None:
        self.sent.append((subject, message))

    def chunks(self, rid: str) -> list[pb.TokenChunk]:
        return [m for s, m in self.sent if s == subjects.tokens(GW, rid, "w1")]


@pytest.fixture
async def worker():
    settings = WorkerSettings(worker_id="w1", role="both", engine="fake", kv_transfer=False)
    engine = FakeEngine(num_blocks=64, step_s=0.0)
    w = WorkerBase(settings, RecordingBus(), engine, SamplingParams)
    task = asyncio.create_task(w.loop.run())
    yield w
    task.cancel()
    w.loop.shutdown()


def tokens_after(last: int, n: int) -> list[int]:
    out = []
    for _ in range(n):
        last = next_token(last)
        out.append(last)
    return out


async def test_generate_streams_one_chunk_per_step_with_indices(worker):
    stream = await worker.generate("r1", GW, PROMPT, pb.SamplingParams(max_tokens=4))
    chunks = worker.bus.chunks("r1")
    assert [c.index for c in chunks] == [0, 1, 2, 3]
    assert [t for c in chunks for t in c.token_ids] == tokens_after(PROMPT[-1], 4)
    assert [c.finished for c in chunks] == [False, False, False, True]
    assert chunks[-1].finish_reason == "length" and chunks[-1].num_output_tokens == 4
    assert all(c.worker_id == "w1" for c in chunks)
    assert await stream.done == "length"
    assert worker.engine.stats().num_free_blocks == 64


async def test_prompt_computed_hook_runs_once_with_the_first_output(worker):
    """The prefill worker writes a prompt's blocks through to the KV-cache service from this
    hook: it must run while the request still decodes (its blocks held), not when it ends."""
    seen: list[int] = []  # chunks published when the hook ran
    stream = await worker.generate(
        "r1",
        GW,
        PROMPT,
        pb.SamplingParams(max_tokens=4),
        on_prompt_computed=lambda: seen.append(len(worker.bus.chunks("r1"))),
    )
    assert await stream.done == "length"
    assert seen == [0] and len(worker.bus.chunks("r1")) == 4


async def test_prompt_computed_hook_is_not_run_for_a_request_that_fails(worker):
    seen: list[str] = []
    stream = await worker.generate(
        "r1", GW, [], pb.SamplingParams(max_tokens=4), on_prompt_computed=lambda: seen.append("x")
    )
    assert await stream.done == "error"
    assert seen == []


async def test_prefill_only_first_token_is_not_an_end(worker):
    stream = await worker.generate(
        "r1", GW, PROMPT, pb.SamplingParams(max_tokens=8), prefill_only=True
    )
    (chunk,) = worker.bus.chunks("r1")
    assert await stream.done == "prefilled"
    assert chunk.index == 0 and not chunk.finished and chunk.finish_reason == ""
    assert worker.engine.stats().num_free_blocks < 64  # held for the hand-off


async def test_decode_here_continues_at_the_next_index(worker):
    first = await worker.generate(
        "r1", GW, PROMPT, pb.SamplingParams(max_tokens=5), prefill_only=True
    )
    exported = await worker.loop.call(worker.engine.export_sequence, "r1")
    await worker.loop.call(worker.engine.release, "r1")
    handoff = pb.DecodeHandoff(
        gateway_id=GW,
        request_id="r1",
        prompt_token_ids=exported.prompt_token_ids,
        output_token_ids=exported.output_token_ids,
        params=pb.SamplingParams(max_tokens=5),
        num_cached_tokens=3,
    )
    stream = await worker.handoffs.decode_here(handoff)
    chunks = worker.bus.chunks("r1")
    assert [c.index for c in chunks] == [0, 1, 2, 3, 4]
    assert stream.output_token_ids == tokens_after(PROMPT[-1], 5)
    assert chunks[-1].finished and chunks[-1].num_cached_tokens == 3
    assert first.output_token_ids == stream.output_token_ids[:1]
    assert worker.engine.stats().num_free_blocks == 64


async def test_cancel_aborts_and_frees_blocks(worker):
    worker.engine.step_s = 0.01
    task = asyncio.create_task(
        worker.generate("r1", GW, PROMPT, pb.SamplingParams(max_tokens=1000))
    )
    while not worker.bus.chunks("r1"):
        await asyncio.sleep(0.005)
    await worker.streams.on_cancel(pb.Cancel(request_id="r1"), None)
    stream = await asyncio.wait_for(task, 5)
    assert await stream.done == "abort"
    last = worker.bus.chunks("r1")[-1]
    assert last.finished and last.finish_reason == "abort"
    assert worker.engine.stats().num_free_blocks == 64
    assert worker.streams.is_cancelled("r1")


async def test_bad_prompt_is_an_error_chunk(worker):
    await worker.generate("r1", GW, [], pb.SamplingParams(max_tokens=4))
    (chunk,) = worker.bus.chunks("r1")
    assert chunk.finished and chunk.finish_reason == "error"
    assert chunk.error.code == pb.Error.INVALID_REQUEST and "empty" in chunk.error.message


def test_wire_zeros_mean_defaults():
    p = engine_params(pb.SamplingParams(), SamplingParams)
    assert (p.max_tokens, p.top_p, p.top_k, p.repetition_penalty, p.seed, p.logprobs) == (
        16,
        1.0,
        -1,
        1.0,
        None,
        None,
    )
    p = engine_params(pb.SamplingParams(seed=0, logprobs=0, top_k=5, stop=["x"]), SamplingParams)
    assert (p.seed, p.logprobs, p.top_k, p.stop) == (0, 0, 5, ["x"])


def test_worker_id_must_be_subject_safe():
    with pytest.raises(ValueError, match="worker_id"):
        WorkerSettings(worker_id="a.b")


# --- the facilities cap, enforced by the worker ---------------------------------------


def rack_state(state: int, cap: int = 0) -> RackState:
    return RackState(
        rack="rack-a",
        state=state,
        max_seqs_per_worker=cap,
        worker_ids=["w1"],
        sent_unix_s=time.time(),
        heartbeat_s=5,
    )


async def run_many(worker, n: int, max_tokens: int) -> tuple[list, int]:
    """Start n requests at once; returns their streams and the most that ran together."""
    peak = 0
    tasks = [
        asyncio.create_task(
            worker.generate(f"r{i}", GW, PROMPT, pb.SamplingParams(max_tokens=max_tokens))
        )
        for i in range(n)
    ]
    while not all(t.done() for t in tasks):
        peak = max(
            peak,
            worker.streams.gate.admitted,
            (await worker.loop.call(worker.engine.stats)).num_running,
        )
        await asyncio.sleep(0.002)
    return [t.result() for t in tasks], peak


async def test_derated_rack_caps_concurrent_sequences_and_queues_the_rest(worker):
    worker.engine.step_s = 0.002
    await worker.on_rack_state(rack_state(RackStateKind.RACK_STATE_DERATE, cap=2), None)
    assert (await worker.presence.heartbeat()).seq_cap == 2
    streams, peak = await asyncio.wait_for(run_many(worker, 6, 10), 10)
    assert peak == 2  # never more, and the cap was used
    assert [await s.done for s in streams] == ["length"] * 6  # none refused
    assert worker.engine.stats().num_free_blocks == 64


async def test_drained_rack_still_finishes_queued_work_one_at_a_time(worker):
    worker.engine.step_s = 0.002
    await worker.on_rack_state(rack_state(RackStateKind.RACK_STATE_DRAIN), None)
    assert (await worker.presence.heartbeat()).seq_cap == 1
    streams, peak = await asyncio.wait_for(run_many(worker, 3, 5), 10)
    assert peak == 1
    assert [await s.done for s in streams] == ["length"] * 3


async def test_cap_lifted_wakes_waiting_requests(worker):
    worker.engine.step_s = 0.01
    await worker.on_rack_state(rack_state(RackStateKind.RACK_STATE_DERATE, cap=1), None)
    tasks = [
        asyncio.create_task(worker.generate(f"r{i}", GW, PROMPT, pb.SamplingParams(max_tokens=50)))
        for i in range(3)
    ]
    await asyncio.sleep(0.05)
    assert worker.streams.gate.admitted == 1 and worker.streams.gate.waiting == 2
    await worker.on_rack_state(rack_state(RackStateKind.RACK_STATE_NORMAL), None)
    await asyncio.sleep(0.05)
    assert worker.streams.gate.admitted == 3 and worker.streams.gate.waiting == 0
    assert (await worker.presence.heartbeat()).seq_cap == 0
    await asyncio.wait_for(asyncio.gather(*tasks), 10)


async def test_cancel_while_waiting_for_the_cap_never_reaches_the_engine(worker):
    worker.engine.step_s = 0.01
    await worker.on_rack_state(rack_state(RackStateKind.RACK_STATE_DERATE, cap=1), None)
    first = asyncio.create_task(worker.generate("r1", GW, PROMPT, pb.SamplingParams(max_tokens=30)))
    queued = asyncio.create_task(
        worker.generate("r2", GW, PROMPT, pb.SamplingParams(max_tokens=30))
    )
    await asyncio.sleep(0.03)
    await worker.streams.on_cancel(pb.Cancel(request_id="r2"), None)
    assert await (await asyncio.wait_for(queued, 5)).done == "abort"
    assert await (await asyncio.wait_for(first, 5)).done == "length"
    assert worker.streams.gate.admitted == 0
    assert worker.engine.stats().num_free_blocks == 64


async def test_other_racks_state_does_not_cap_this_worker(worker):
    other = rack_state(RackStateKind.RACK_STATE_DRAIN)
    other.rack, other.worker_ids[:] = "rack-b", ["w2"]
    await worker.on_rack_state(other, None)
    assert worker.cap.seq_cap() == 0


# --- redelivered jobs and refused hand-offs -------------------------------------------


async def test_decode_here_while_the_prefill_still_holds_the_sequence(worker):
    # A refused hand-off: the KV server frees the hold in a task of its own, which may run
    # after decode_here's import. That used to fail with "request id ... already in use".
    await worker.generate("r1", GW, PROMPT, pb.SamplingParams(max_tokens=5), prefill_only=True)
    exported = await worker.loop.call(worker.engine.export_sequence, "r1")
    handoff = pb.DecodeHandoff(
        gateway_id=GW,
        request_id="r1",
        prompt_token_ids=exported.prompt_token_ids,
        output_token_ids=exported.output_token_ids,
        params=pb.SamplingParams(max_tokens=5),
    )
    stream = await asyncio.wait_for(worker.handoffs.decode_here(handoff), 5)
    assert await stream.done == "length"
    assert not any(c.error.message for c in worker.bus.chunks("r1"))
    assert worker.engine.stats().num_free_blocks == 64


async def test_redelivered_job_waits_for_the_running_one_and_shares_its_outcome(worker):
    runs = 0

    async def job() -> bool:
        nonlocal runs
        runs += 1
        stream = await worker.generate("r1", GW, PROMPT, pb.SamplingParams(max_tokens=20))
        return await stream.done == "length"

    worker.engine.step_s = 0.005
    first = asyncio.create_task(worker.streams.run_once("r1", job))
    await asyncio.sleep(0.02)
    again = asyncio.create_task(worker.streams.run_once("r1", job))  # the redelivery
    assert await asyncio.wait_for(asyncio.gather(first, again), 5) == [True, True]
    assert runs == 1
    chunks = worker.bus.chunks("r1")
    assert not any(c.error.message for c in chunks)
    assert [c.index for c in chunks] == list(range(20))
    assert worker.streams.jobs == {}


async def test_redelivery_of_a_failed_job_runs_it_again(worker):
    calls = []

    async def job() -> bool:
        calls.append(len(calls))
        await asyncio.sleep(0.02)
        if len(calls) == 1:
            raise RuntimeError("first attempt fails")
        return True

    first = asyncio.create_task(worker.streams.run_once("r1", job))
    await asyncio.sleep(0.005)
    again = asyncio.create_task(worker.streams.run_once("r1", job))
    with pytest.raises(RuntimeError):
        await first
    assert await again is True and len(calls) == 2


# --- one request, many starts: redelivery, resume and hand-off join ----------------------


def resume_of(rid: str, streamed: list[int], max_tokens: int) -> pb.DecodeHandoff:
    """What a gateway sends to resume ``rid`` after ``streamed`` tokens."""
    return pb.DecodeHandoff(
        gateway_id=GW,
        request_id=rid,
        prompt_token_ids=PROMPT,
        output_token_ids=streamed,
        params=pb.SamplingParams(max_tokens=max_tokens),
    )


class Replies:
    def __init__(self) -> None:
        self.acks: list[pb.HandoffAck] = []

    async def __call__(self, ack: pb.HandoffAck) -> None:
        self.acks.append(ack)


def assert_one_clean_run(worker, rid: str, n: int) -> None:
    """Every output index sent once (a second run would send them again), no error."""
    chunks = worker.bus.chunks(rid)
    assert not any(c.error.code for c in chunks), [c.error.message for c in chunks]
    assert sorted(c.index for c in chunks) == list(range(n))
    assert [t for c in sorted(chunks, key=lambda c: c.index) for t in c.token_ids] == (
        tokens_after(PROMPT[-1], n)
    )


async def test_a_resume_of_a_request_whose_redelivered_job_runs_here_joins_it(worker):
    worker.engine.step_s = 0.005
    job = asyncio.create_task(worker.generate("r1", GW, PROMPT, pb.SamplingParams(max_tokens=20)))
    await asyncio.sleep(0.03)
    replies = Replies()
    await worker.handoffs.take(resume_of("r1", tokens_after(PROMPT[-1], 2), 20), replies)
    (ack,) = replies.acks
    assert ack.accepted and ack.message == JOINED
    assert await (await asyncio.wait_for(job, 5)).done == "length"
    assert_one_clean_run(worker, "r1", 20)
    assert worker.engine.stats().num_free_blocks == 64


async def test_a_redelivered_job_of_a_request_resumed_here_joins_the_resume(worker):
    worker.engine.step_s = 0.005
    replies = Replies()
    await worker.handoffs.take(resume_of("r1", tokens_after(PROMPT[-1], 3), 20), replies)
    assert replies.acks[0].accepted and replies.acks[0].message == ""
    stream = await asyncio.wait_for(
        worker.generate("r1", GW, PROMPT, pb.SamplingParams(max_tokens=20)), 5
    )
    assert await stream.done == "length"
    chunks = worker.bus.chunks("r1")
    assert not any(c.error.code for c in chunks)
    assert [c.index for c in chunks] == list(range(3, 20))  # the resume's, sent once
    assert worker.engine.stats().num_free_blocks == 64


async def test_a_resume_and_a_redelivery_arriving_together_run_the_request_once(worker):
    worker.engine.step_s = 0.002
    replies = Replies()
    both = await asyncio.wait_for(
        asyncio.gather(
            worker.handoffs.take(resume_of("r1", tokens_after(PROMPT[-1], 1), 12), replies),
            worker.generate("r1", GW, PROMPT, pb.SamplingParams(max_tokens=12)),
            worker.handoffs.take(resume_of("r1", tokens_after(PROMPT[-1], 1), 12), replies),
        ),
        5,
    )
    assert await both[1].done == "length"
    assert [a.accepted for a in replies.acks] == [True, True]
    assert sorted(a.message for a in replies.acks) == ["", JOINED]
    chunks = worker.bus.chunks("r1")
    assert not any(c.error.code for c in chunks)
    assert [c.index for c in chunks] == list(range(1, 12))
    assert worker.engine.stats().num_free_blocks == 64


async def test_a_resume_of_a_request_held_for_its_hand_off_joins_the_hand_off(worker):
    await worker.generate("r1", GW, PROMPT, pb.SamplingParams(max_tokens=5), prefill_only=True)
    replies = Replies()
    await worker.handoffs.take(resume_of("r1", tokens_after(PROMPT[-1], 1), 5), replies)
    (ack,) = replies.acks
    assert ack.accepted and ack.message == JOINED
    assert "r1" not in worker.streams.running  # the hand-off still owns it
    assert not any(c.error.code for c in worker.bus.chunks("r1"))
    await worker.loop.call(worker.engine.release, "r1")
    assert worker.engine.stats().num_free_blocks == 64


async def test_a_second_start_the_engine_refuses_is_a_server_error(worker):
    """Held for a hand-off with no stream (it cannot join it): a server fault, never
    invalid_request, which would blame the client."""
    await worker.generate("r1", GW, PROMPT, pb.SamplingParams(max_tokens=5), prefill_only=True)
    stream = await worker.generate("r1", GW, PROMPT, pb.SamplingParams(max_tokens=5))
    assert await stream.done == "error"
    error = worker.bus.chunks("r1")[-1].error
    assert error.code == pb.Error.INTERNAL and "already in use" in error.message


async def test_a_late_redelivery_of_a_job_that_finished_here_does_not_run_it_again(worker):
    first = await worker.generate("r1", GW, PROMPT, pb.SamplingParams(max_tokens=4))
    assert await first.done == "length"
    assert worker.streams.finished_here("r1")
    job = pb.PrefillJob(request_id="r1", gateway_id=GW, prompt_token_ids=PROMPT)
    job.params.max_tokens = 4
    handler = SimpleNamespace(w=worker)
    assert await PrefillHandler.run_job(handler, job) is True  # type: ignore[arg-type]
    assert len(worker.bus.chunks("r1")) == 4


# --- peers ---------------------------------------------------------------------------


async def test_peer_liveness_follows_the_peers_own_heartbeat_interval(worker):
    beat = pb.WorkerHeartbeat(worker_id="w2", role="decode", heartbeat_interval_ms=20)
    await worker.presence.on_peer_heartbeat(beat, None)
    assert worker.presence.peer_alive("w2") and not worker.presence.peer_alive("never-seen")
    await asyncio.sleep(0.1)  # three missed beats of 20 ms
    assert not worker.presence.peer_alive("w2")
    await worker.presence.on_peer_heartbeat(beat, None)
    assert worker.presence.peer_alive("w2")


async def test_a_heartbeat_does_not_wait_for_a_long_engine_step(worker):
    """Liveness never queues behind the step: a step that cannot end until released must
    not hold the heartbeat (it would be declared dead while working)."""
    import threading

    await worker.presence.heartbeat()  # a first snapshot, taken while idle
    release, entered = threading.Event(), threading.Event()
    real_step = worker.engine.step

    def long_step():
        entered.set()
        release.wait(30)
        return real_step()

    worker.engine.step = long_step
    task = asyncio.create_task(
        worker.generate("r-long", GW, PROMPT, pb.SamplingParams(max_tokens=2))
    )
    assert await asyncio.to_thread(entered.wait, 10)
    try:
        beat = await asyncio.wait_for(worker.presence.heartbeat(), 5)
        assert beat.worker_id == "w1" and not release.is_set()
    finally:
        release.set()
    await task


async def test_a_stuck_engine_makes_the_worker_say_it_cannot_take_work(worker):
    """/ready and the heartbeat tell the truth: the process still beats, the engine does not
    answer, so the worker is not ready (and says why) until the engine call returns."""
    import threading

    worker.settings.engine_stall_s = 0.2
    await worker.presence.heartbeat()  # a first snapshot, taken while idle
    assert worker.presence.not_ready() is None
    release = threading.Event()
    stuck = asyncio.create_task(worker.loop.call(release.wait, 30))
    try:
        await asyncio.sleep(0.5)
        assert "the engine has not answered" in (worker.presence.not_ready() or "")
        beat = await asyncio.wait_for(
            worker.presence.heartbeat(), 5
        )  # still beats, from the snapshot
        assert beat.not_ready.startswith("the engine has not answered")
        worker.bus.nc.is_connected = False
        assert worker.presence.not_ready() == "not connected to NATS"
        worker.bus.nc.is_connected = True
    finally:
        release.set()
    await stuck
    assert worker.presence.not_ready() is None
    assert (await worker.presence.heartbeat()).not_ready == ""


async def test_kv_events_are_numbered_in_one_epoch_and_a_resync_dumps_the_cache(worker):
    await worker.presence.publish_kv_events([("cleared", []), ("stored", [1, 2]), ("removed", [1])])
    events = [m for s, m in worker.bus.sent if s == subjects.kv_events("w1")]
    assert [e.seq for e in events] == [1, 2, 3]
    assert {e.epoch for e in events} == {worker.presence.kv_epoch} and worker.presence.kv_epoch
    beat = await worker.presence.heartbeat()
    assert (beat.kv_epoch, beat.kv_seq) == (worker.presence.kv_epoch, 3)

    class Replies(RecordingBus):
        async def reply(self, msg, message) -> None:
            self.sent.append(("reply", message))

    worker.presence.bus = Replies()
    worker.engine.cached_block_hashes = lambda: [7, 8]  # the fake engine caches nothing
    await worker.presence.on_kv_resync(pb.KVResyncRequest(worker_id="w1"), None)
    ((_, dump),) = worker.presence.bus.sent
    assert (dump.worker_id, dump.epoch, dump.seq) == ("w1", worker.presence.kv_epoch, 3)
    assert list(dump.block_hashes) == [7, 8] and not dump.truncated

    # More blocks than one message holds: the most recently cached ones, said so.
    worker.presence.bus = Replies()
    worker.presence.bus.nc.max_payload = DUMP_OVERHEAD_BYTES + 2 * 8
    worker.engine.cached_block_hashes = lambda: [5, 6, 7, 8]  # oldest first
    await worker.presence.on_kv_resync(pb.KVResyncRequest(worker_id="w1"), None)
    ((_, dump),) = worker.presence.bus.sent
    assert list(dump.block_hashes) == [7, 8] and dump.truncated
