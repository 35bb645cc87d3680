"""Malformed and forged messages on every subject the services listen on: each handler
refuses them and keeps running, and the stack still answers a real request afterwards."""

from __future__ import annotations

import contextlib
import random

import httpx
import pytest
from nats.errors import TimeoutError as NatsTimeoutError

from tokenyard.bus import subjects
from tokenyard.bus.embedded import free_port
from tokenyard.bus.nats import Bus
from tokenyard.services.launch.stack import LocalStack, StackConfig
from tokenyard.v1 import serving_pb2 as pb

pytestmark = pytest.mark.slow

ROUNDS = 40


def garbage(rng: random.Random) -> bytes:
    kind = rng.randrange(4)
    if kind == 0:
        return b""
    if kind == 1:
        return rng.randbytes(rng.randrange(1, 300))
    if kind == 2:  # a valid message of the wrong type
        return pb.WorkerHeartbeat(
            worker_id="x" * rng.randrange(200), num_blocks=2**31
        ).SerializeToString()
    # a field tag that no message has, then junk
    return b"\xf8\xff\xff\xff\x0f" + rng.randbytes(8)


def forged() -> list[tuple[str, bytes]]:
    """Well-formed messages with values no honest sender produces."""
    huge = pb.SamplingParams(max_tokens=2**32 - 1, top_k=2**31 - 1, stop_token_ids=[2**32 - 1])
    job = pb.PrefillJob(
        request_id="forged-1", model="fake-model", prompt_token_ids=[2**32 - 1] * 3, params=huge
    )
    handoff = pb.DecodeHandoff(
        request_id="forged-2",
        model="fake-model",
        params=huge,
        prompt_token_ids=[],
        output_token_ids=[7] * 5,
        src_block_ids=[2**31] * 4,
        kv_endpoint="127.0.0.1:1",
    )
    return [
        (subjects.decode_jobs("decode-2"), handoff.SerializeToString()),
        (subjects.prefill_worker_jobs("prefill-1"), job.SerializeToString()),
        (
            subjects.heartbeat("decode", "decode-2"),
            pb.WorkerHeartbeat(
                worker_id="decode-2", role="nonsense", num_blocks=-1 & 0xFFFFFFFF
            ).SerializeToString(),
        ),
        (
            subjects.kv_events("decode-2"),
            pb.KVEvent(worker_id="decode-2", block_hashes=[1, 2, 3]).SerializeToString(),
        ),
    ]


@pytest.fixture(scope="module")
def stack(launch_stack):
    config = StackConfig(port=free_port(), engine="fake", kvcache=False, facilities=False)
    with launch_stack(config) as s:
        s.wait_ready(timeout=120)
        yield s


def chat(stack: LocalStack) -> int:
    body = {"model": "fake-model", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
    return httpx.post(f"{stack.gateway_url}/v1/chat/completions", json=body, timeout=30).status_code


async def test_garbage_on_every_subject_leaves_every_service_running(stack: LocalStack):
    assert chat(stack) == 200
    rng = random.Random(18)
    targets = [
        subjects.ROUTER_ROUTE,
        subjects.heartbeat("decode", "decode-2"),
        subjects.kv_events("prefill-1"),
        subjects.decode_jobs("decode-2"),
        subjects.cancel("nobody", "nobody"),
        subjects.facilities_state("rack-a"),
        subjects.tokens("nobody", "nobody", "nobody"),
    ]
    bus = await Bus.connect(stack.nats_url, name="fuzzer")
    try:
        for _ in range(ROUNDS):
            for subject in targets:
                await bus.nc.publish(subject, garbage(rng))
            # No answer to garbage is a fine answer; an error reply is too.
            with contextlib.suppress(NatsTimeoutError):
                await bus.nc.request(subjects.ROUTER_ROUTE, garbage(rng), timeout=0.5)
            await bus.js.publish(subjects.prefill_worker_jobs("prefill-1"), garbage(rng))
        for subject, data in forged():
            if subject.startswith(subjects.PREFILL_JOBS):
                await bus.js.publish(subject, data)
            else:
                await bus.nc.publish(subject, data)
        await bus.sync()
    finally:
        await bus.close()
    stack.check_alive()
    assert chat(stack) == 200
    stack.check_alive()
