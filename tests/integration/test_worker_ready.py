"""A worker's /ready tells the truth on a real nats-server: deleting its JetStream consumer
turns it to 503 (naming the consumer), the worker makes the consumer again, /ready is 200
again and jobs reach the worker through the new consumer."""

from __future__ import annotations

import asyncio
import time

import httpx
from test_workers_fake import expected, fake_config
from worker_client import Request, connect, wait_router

from tokenyard.bus import subjects
from tokenyard.services.worker.prefill import CONSUMER_PREFIX
from tokenyard.v1 import serving_pb2 as pb

WORKER = "both-1"
CONSUMER = f"{CONSUMER_PREFIX}{WORKER}"
PROMPT = list(range(1, 40))


async def get_ready(client: httpx.AsyncClient) -> httpx.Response:
    return await client.get("/ready", timeout=10)


async def ready_within(client: httpx.AsyncClient, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if (await get_ready(client)).status_code == 200:
                return True
        except httpx.HTTPError:
            pass
        await asyncio.sleep(0.2)
    return False


async def test_a_deleted_consumer_is_503_until_the_worker_makes_it_again(launch_stack):
    config = fake_config(0, 0)
    config.aggregated = True
    with launch_stack(config) as stack:
        bus = await connect(stack.nats_url)
        try:
            async with httpx.AsyncClient(base_url=stack.ops_urls[WORKER]) as client:
                assert await ready_within(client, 60), stack.describe_failures()
                await wait_router(bus, placeable=True)
                # The worker makes its consumer again within a second, so a delete and the
                # next /ready may race: try a few times to catch the window.
                said: list[str] = []
                for _ in range(5):
                    await bus.js.delete_consumer(subjects.PREFILL_STREAM, CONSUMER)
                    r = await get_ready(client)
                    if r.status_code == 503:
                        said.append(r.json()["reason"])
                        break
                    await asyncio.sleep(2)  # let it make the consumer again, then retry
                assert said == [f"its JetStream consumer {CONSUMER} is missing"]

                assert await ready_within(client, 30), stack.describe_failures()
                info = await bus.js.consumer_info(subjects.PREFILL_STREAM, CONSUMER)
                assert info.config.filter_subject == subjects.prefill_worker_jobs(WORKER)

            # The router places on it again once a heartbeat says it is ready.
            await wait_router(bus, placeable=True)
            req = Request(bus, PROMPT, pb.SamplingParams(max_tokens=6))
            assert (await req.submit()).placement.prefill_worker_id == WORKER
            assert (await req.wait(30)).token_ids == expected(PROMPT, 6)
        finally:
            await bus.close()
