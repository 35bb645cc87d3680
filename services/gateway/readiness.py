"""What /ready asks: could a request be served now, and what around it is down.

Ready means a request sent now would be placed: the gateway asks the router's own rule
(``tokenyard.routing.policy.choose``) over its own view of the fleet and of the racks, with
a probe request, so /ready and the router cannot disagree (a decode worker that runs whole
requests, a prefill worker that decodes its own, every rack drained by facilities). A
fleet that is only busy is ready: the request waits in a queue or gets 503 overloaded, and
pulling the gateway out of a load balancer for that would make it worse.

Besides the workers, two more things are asked:

- the store behind per-key limits (Redis), when one is configured: down, a limited key
  cannot be served, so the gateway is not ready;
- the optional services of the stack (KV cache, telemetry, facilities): down, the stack
  still serves, so they are reported (``optional_services``) but never make it unready.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Mapping
from typing import Literal

import httpx

from tokenyard.facilities.tracker import WorkerThrottle
from tokenyard.fleet import FleetView
from tokenyard.routing.policy import PolicyConfig, RouteInput, choose
from tokenyard.v1 import serving_pb2 as pb

PROBE = RouteInput(request_id="ready-probe", model="", num_prompt_tokens=1)
PROBE_TIMEOUT_S = 0.5
# A load balancer asks every few seconds; answers are reused this long.
OPTIONAL_CACHE_S = 1.0


def placement_problem(
    fleet: FleetView,
    now: float,
    *,
    disaggregation: Literal["auto", "always", "never"],
    missed_heartbeats: int,
) -> str | None:
    """Why the router would refuse a request now (None: it would place one)."""
    config = PolicyConfig(disaggregation=disaggregation, missed_heartbeats=missed_heartbeats)
    facilities = fleet.racks.by_worker(time.time())  # racks keep wall-clock times
    result = choose(fleet.workers, PROBE, now, facilities=facilities, config=config)
    if isinstance(result, pb.Placement) or result.code == pb.RouteError.OVERLOADED:
        return None
    return f"no worker can take a request: {result.message}{_why(fleet, now, facilities)}"


def _why(fleet: FleetView, now: float, facilities: Mapping[str, WorkerThrottle]) -> str:
    """What the live workers that take nothing say about themselves, and drained racks."""
    said = [f"{w.worker_id}: {w.heartbeat.not_ready}" for w in fleet.live(now) if not w.ready]
    said += [f"{w.worker_id}: drained by an operator" for w in fleet.live(now) if w.draining]
    racks = {t.rack: t.reason for t in facilities.values() if t.state == "drain" and t.rack}
    said += [f"rack {rack} drained: {reason}" for rack, reason in sorted(racks.items())]
    return f" ({'; '.join(said)})" if said else ""


class OptionalServices:
    """The /health of each optional service (name -> URL), asked at most once a second."""

    def __init__(self, urls: dict[str, str]) -> None:
        self.urls = urls
        self._checked_at = float("-inf")
        self._status: dict[str, str] = {}
        self._lock = asyncio.Lock()

    async def status(self) -> dict[str, str]:
        """Name -> "up", or "down: why"."""
        if not self.urls:
            return {}
        async with self._lock:
            if time.monotonic() - self._checked_at >= OPTIONAL_CACHE_S:
                self._status = await self._ask_all()
                self._checked_at = time.monotonic()
        return dict(self._status)

    async def _ask_all(self) -> dict[str, str]:
        async with httpx.AsyncClient(timeout=PROBE_TIMEOUT_S, trust_env=False) as client:
            names = list(self.urls)
            answers = await asyncio.gather(*(self._ask(client, self.urls[n]) for n in names))
        return dict(zip(names, answers, strict=True))

    @staticmethod
    async def _ask(client: httpx.AsyncClient, url: str) -> str:
        try:
            r = await client.get(url)
        except httpx.HTTPError as exc:
            return f"down: {url} does not answer ({type(exc).__name__})"
        return "up" if r.status_code == 200 else f"down: {url} answers {r.status_code}"
