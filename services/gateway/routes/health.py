"""/health (the process is up), /ready (it can serve), /metrics (Prometheus: the gateway's
own series and the live workers' `tokenyard:*` series, labelled by worker)."""

from __future__ import annotations

import time

from fastapi import APIRouter, Response
from fastapi.responses import JSONResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from tokenyard.services.gateway.deps import State
from tokenyard.services.gateway.fleet_metrics import ops_targets
from tokenyard.services.gateway.readiness import placement_problem
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
    """Ready exactly when a request sent now would be served (readiness.py says how)."""
    now = time.monotonic()
    fleet = state.backend.fleet
    connected = state.backend.connected()
    reason = await state.backend.not_ready()  # NATS, and the prefill job stream
    reason = reason or placement_problem(
        fleet,
        now,
        disaggregation=state.settings.router_disaggregation,
        missed_heartbeats=state.settings.missed_heartbeats,
    )
    reason = reason or await state.limiter.problem() or await state.minute_limits.problem()
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
        optional_services=await state.optional_services.status(),
    )
    return JSONResponse(body.model_dump(), status_code=200 if body.ready else 503)


@router.get("/metrics", response_class=Response, responses={200: {"content": {"text/plain": {}}}})
async def metrics(state: State) -> Response:
    await state.metrics.fleet.refresh(ops_targets(state.backend.fleet, time.monotonic()))
    return Response(generate_latest(state.metrics.registry), media_type=CONTENT_TYPE_LATEST)
