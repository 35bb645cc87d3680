"""The worker's request plumbing over the fake engine and a recording bus (no NATS)."""

from __future__ import annotations

import asyncio

import pytest
from tokenyard.bus import subjects
from tokenyard.services.worker.base import WorkerBase
from tokenyard.services.worker.convert import engine_params
from tokenyard.services.worker.fake_engine import FakeEngine, FakeSamplingParams, next_token
from tokenyard.services.worker.settings import WorkerSettings
from tokenyard.v1 import serving_pb2 as pb

PROMPT = [5, 6, 7, 8]


class RecordingBus:
    def __init__(self) -> None:
        self.sent: list[tuple[str, object]] = []

    async def publish(self, subject, message, headers=None) -> None:
        self.sent.append((subject, message))

    def chunks(self, rid: str) -> list[pb.TokenChunk]:
        return [m for s, m in self.sent if s == subjects.tokens(rid)]


@pytest.fixture
async def worker():
    settings = WorkerSettings(worker_id="w1", role="both", engine="fake", kv_transfer=False)
    engine = FakeEngine(num_blocks=64, step_s=0.0)
    w = WorkerBase(settings, RecordingBus(), engine, FakeSamplingParams)
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
    stream = await worker.generate("r1", PROMPT, pb.SamplingParams(max_tokens=4))
    chunks = worker.bus.chunks("r1")
    assert [c.index for c in chunks] == [0, 1, 2, 3]
    assert [t for c in chunks for t in c.token_ids] == tokens_after(PROMPT[-1], 4)
    assert [c.finished for c in chunks] == [False, False, False, True]
    assert chunks[-1].finish_reason == "length" and chunks[-1].num_output_tokens == 4
    assert all(c.worker_id == "w1" for c in chunks)
    assert await stream.done == "length"
    assert worker.engine.stats().num_free_blocks == 64


async def test_prefill_only_first_token_is_not_an_end(worker):
    stream = await worker.generate("r1", PROMPT, pb.SamplingParams(max_tokens=8), prefill_only=True)
    (chunk,) = worker.bus.chunks("r1")
    assert await stream.done == "prefilled"
    assert chunk.index == 0 and not chunk.finished and chunk.finish_reason == ""
    assert worker.engine.stats().num_free_blocks < 64  # held for the hand-off


async def test_decode_here_continues_at_the_next_index(worker):
    first = await worker.generate("r1", PROMPT, pb.SamplingParams(max_tokens=5), prefill_only=True)
    exported = await worker.loop.call(worker.engine.export_sequence, "r1")
    await worker.loop.call(worker.engine.release, "r1")
    handoff = pb.DecodeHandoff(
        request_id="r1",
        prompt_token_ids=exported.prompt_token_ids,
        output_token_ids=exported.output_token_ids,
        params=pb.SamplingParams(max_tokens=5),
        num_cached_tokens=3,
    )
    stream = await worker.decode_here(handoff)
    chunks = worker.bus.chunks("r1")
    assert [c.index for c in chunks] == [0, 1, 2, 3, 4]
    assert stream.output_token_ids == tokens_after(PROMPT[-1], 5)
    assert chunks[-1].finished and chunks[-1].num_cached_tokens == 3
    assert first.output_token_ids == stream.output_token_ids[:1]
    assert worker.engine.stats().num_free_blocks == 64


async def test_cancel_aborts_and_frees_blocks(worker):
    worker.engine.step_s = 0.01
    task = asyncio.create_task(worker.generate("r1", PROMPT, pb.SamplingParams(max_tokens=1000)))
    while not worker.bus.chunks("r1"):
        await asyncio.sleep(0.005)
    await worker.on_cancel(pb.Cancel(request_id="r1"), None)
    stream = await asyncio.wait_for(task, 5)
    assert await stream.done == "abort"
    last = worker.bus.chunks("r1")[-1]
    assert last.finished and last.finish_reason == "abort"
    assert worker.engine.stats().num_free_blocks == 64
    assert worker.is_cancelled("r1")


async def test_bad_prompt_is_an_error_chunk(worker):
    await worker.generate("r1", [], pb.SamplingParams(max_tokens=4))
    (chunk,) = worker.bus.chunks("r1")
    assert chunk.finished and chunk.finish_reason == "error"
    assert chunk.error.code == pb.Error.INVALID_REQUEST and "empty" in chunk.error.message


def test_wire_zeros_mean_defaults():
    p = engine_params(pb.SamplingParams(), FakeSamplingParams)
    assert (p.max_tokens, p.top_p, p.top_k, p.repetition_penalty, p.seed, p.logprobs) == (
        16,
        1.0,
        -1,
        1.0,
        None,
        None,
    )
    p = engine_params(
        pb.SamplingParams(seed=0, logprobs=0, top_k=5, stop=["x"]), FakeSamplingParams
    )
    assert (p.seed, p.logprobs, p.top_k, p.stop) == (0, 0, 5, ["x"])


def test_worker_id_must_be_subject_safe():
    with pytest.raises(ValueError, match="worker_id"):
        WorkerSettings(worker_id="a.b")
