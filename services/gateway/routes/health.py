"""/health (the process is up), /ready (it can serve), /metrics (Prometheus)."""

from __future__ import annotations

import time

from fastapi import APIRouter, Response
from fastapi.responses import JSONResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from tokenyard.fleet import FleetView, missing_role
from tokenyard.services.gateway.deps import State
from tokenyard.services.gateway.schemas import Health, Readiness, WorkerInfo

router = APIRouter(tags=["operations"])


@router.get("/health", response_model=Health)
async def health() -> Health:
    return Health()


@router.get(
    "/ready",
    response_model=Readiness,
    responses={503: {"model": Readiness, "description": "Not ready"}},
)
async def ready(state: State) -> JSONResponse:
    now = time.monotonic()
    fleet = state.backend.fleet
    connected = state.backend.connected()
    # A worker counts once it says it can take work, not merely while it beats.
    missing = missing_role(fleet.ready(now))
    reason = await state.backend.not_ready()
    reason = reason or (f"no live worker can {missing}{_why_not(fleet, now)}" if missing else None)
    workers = [
        WorkerInfo(
            worker_id=w.worker_id,
            role=w.role,
            model=w.model,
            num_running=w.heartbeat.num_running,
            num_waiting=w.heartbeat.num_waiting,
            num_free_blocks=w.heartbeat.num_free_blocks,
            num_blocks=w.heartbeat.num_blocks,
            age_s=round(w.age(now), 3),
        )
        for w in fleet.live(now)
    ]
    body = Readiness(
        ready=reason is None,
        nats_connected=connected,
        roles=fleet.roles(now),
        workers=workers,
        reason=reason,
    )
    return JSONResponse(body.model_dump(), status_code=200 if body.ready else 503)


def _why_not(fleet: FleetView, now: float) -> str:
    """What the live workers that are not ready say about themselves."""
    said = [f"{w.worker_id}: {w.heartbeat.not_ready}" for w in fleet.live(now) if not w.ready]
    return f" ({'; '.join(said)})" if said else ""


@router.get("/metrics", response_class=Response, responses={200: {"content": {"text/plain": {}}}})
async def metrics(state: State) -> Response:
    return Response(generate_latest(state.metrics.registry), media_type=CONTENT_TYPE_LATEST)
