"""A minimal stand-in for the gateway in worker tests: route, enqueue, collect TokenChunks."""

from __future__ import annotations

import asyncio
import time
import uuid
from dataclasses import dataclass, field

from tokenyard.bus import subjects
from tokenyard.bus.nats import Bus
from tokenyard.v1 import serving_pb2 as pb

GATEWAY_ID = "test-gw"  # the prefix this stand-in reads its requests' tokens under


@dataclass
class Result:
    tokens: dict[int, int] = field(default_factory=dict)  # output index -> token id
    chunks: list[pb.TokenChunk] = field(default_factory=list)
    placement: pb.Placement | None = None

    @property
    def token_ids(self) -> list[int]:
        return [self.tokens[i] for i in sorted(self.tokens)]

    @property
    def last(self) -> pb.TokenChunk:
        return self.chunks[-1]


class Request:
    """One request in flight: chunks land in ``result`` as they come."""

    def __init__(
        self, bus: Bus, prompt: list[int], params: pb.SamplingParams, model: str = ""
    ) -> None:
        self.bus = bus
        self.rid = f"t-{uuid.uuid4().hex[:12]}"
        self.prompt = prompt
        self.params = params
        self.model = model
        self.result = Result()
        self.finished = asyncio.Event()
        self.first_chunk = asyncio.Event()

    async def _on_chunk(self, chunk: pb.TokenChunk, _msg: object) -> None:
        self.result.chunks.append(chunk)
        for i, t in enumerate(chunk.token_ids):
            self.result.tokens.setdefault(chunk.index + i, t)
        self.first_chunk.set()
        if chunk.finished:
            self.finished.set()

    async def route(self) -> pb.RouteReply:
        req = pb.RouteRequest(
            request_id=self.rid, model=self.model, num_prompt_tokens=len(self.prompt)
        )
        return await self.bus.request(subjects.ROUTER_ROUTE, req, pb.RouteReply, timeout=5)

    async def submit(self) -> pb.RouteReply:
        self._sub = await self.bus.subscribe(
            subjects.request_tokens(GATEWAY_ID, self.rid), pb.TokenChunk, self._on_chunk
        )
        reply = await self.route()
        if reply.WhichOneof("result") != "placement":
            return reply
        self.result.placement = reply.placement
        job = pb.PrefillJob(
            request_id=self.rid,
            model=self.model,
            prompt_token_ids=self.prompt,
            params=self.params,
            decode_worker_id=reply.placement.decode_worker_id,
            arrival_unix_ns=time.time_ns(),
            gateway_id=GATEWAY_ID,
        )
        await self.bus.js_publish(
            subjects.prefill_worker_jobs(reply.placement.prefill_worker_id), job, msg_id=self.rid
        )
        return reply

    async def wait(self, timeout: float) -> Result:
        await asyncio.wait_for(self.finished.wait(), timeout)
        await self._sub.unsubscribe()
        return self.result

    async def cancel(self) -> None:
        await self.bus.publish(
            subjects.cancel(GATEWAY_ID, self.rid), pb.Cancel(request_id=self.rid, reason="test")
        )


async def connect(url: str) -> Bus:
    bus = await Bus.connect(url, name="worker-test")
    await bus.ensure_work_queue(
        subjects.PREFILL_STREAM, [subjects.PREFILL_JOBS, f"{subjects.PREFILL_JOBS}.>"]
    )
    return bus


class Heartbeats:
    """The latest heartbeat of every worker."""

    def __init__(self) -> None:
        self.latest: dict[str, pb.WorkerHeartbeat] = {}

    async def start(self, bus: Bus) -> Heartbeats:
        await bus.subscribe(subjects.HEARTBEATS_ALL, pb.WorkerHeartbeat, self._on)
        return self

    async def _on(self, hb: pb.WorkerHeartbeat, _msg: object) -> None:
        self.latest[hb.worker_id] = hb

    async def wait_for(self, predicate, timeout: float) -> bool:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if predicate(self.latest):
                return True
            await asyncio.sleep(0.1)
        return bool(predicate(self.latest))


async def wait_disaggregated(bus: Bus, prompt: list[int], timeout: float = 60) -> None:
    """Until the router places this prompt on two workers (it has heard from both pools)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            reply = await Request(bus, prompt, pb.SamplingParams()).route()
        except Exception:  # the router process may not be subscribed yet
            reply = pb.RouteReply()
        if reply.WhichOneof("result") == "placement" and reply.placement.disaggregated:
            return
        await asyncio.sleep(0.2)
    raise TimeoutError("the router never disaggregated the prompt")


async def wait_router(bus: Bus, *, placeable: bool, timeout: float = 30) -> None:
    """Until the router answers (its process starts at its own pace) and, if ``placeable``,
    has heard a worker's heartbeat, so the next route gets a placement."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            reply = await Request(bus, [1], pb.SamplingParams()).route()
            if not placeable or reply.WhichOneof("result") == "placement":
                return
        except Exception:
            pass
        if time.monotonic() > deadline:
            raise TimeoutError("the router did not come up")
        await asyncio.sleep(0.2)
