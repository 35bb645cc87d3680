"""The telemetry HTTP API and console: one router per resource over the collector and store.

GET  /                                  the console (static assets shipped in the package)
GET  /api/fleet                         racks -> nodes -> workers, and the fleet's figures
GET  /api/requests                      recent requests (TTFT, tokens, worker path)
GET  /api/requests/{request_id}/trace   the request's spans
GET  /api/history                       fleet and rack samples (the charts' history)
GET  /api/live                          server-sent events: a snapshot every push_every_s
GET  /api/plan/options, POST /api/plan   the capacity planner (`tokenyard plan`) for the console
POST/DELETE /api/admin/racks/{rack}/faults, POST /api/admin/workers/{worker_id}/drain
GET  /health, /ready, /metrics
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from datetime import timedelta
from importlib.resources import files
from typing import Annotated, Any

import httpx
from fastapi import APIRouter, Depends, FastAPI, Query, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import FileResponse, JSONResponse, StreamingResponse
from fastapi.staticfiles import StaticFiles
from prometheus_client import CollectorRegistry, ProcessCollector
from pydantic import BaseModel, Field

from tokenyard.api_deps import Admin
from tokenyard.api_errors import ApiError, install_error_handler
from tokenyard.bus import subjects
from tokenyard.bus.auth import control_headers
from tokenyard.bus.nats import Bus
from tokenyard.db.telemetry import RequestRecord, SpanRecord
from tokenyard.facilities.faults import FaultIn
from tokenyard.grpc_security import GrpcSecurity
from tokenyard.http_server import ops_router
from tokenyard.planner import catalog
from tokenyard.planner.plan import PlanError, Workload, make_plan
from tokenyard.services.telemetry.collector import Collector
from tokenyard.services.telemetry.metrics import FleetCollector
from tokenyard.services.telemetry.settings import TelemetrySettings
from tokenyard.services.telemetry.store import TelemetryStore, now_utc
from tokenyard.v1 import serving_pb2 as pb

STATIC = files("tokenyard.services.telemetry.console")
RECENT_IN_SNAPSHOT = 20


def type_of(status: int) -> str:
    """This API's error `type`: the caller's fault or the server's."""
    return "invalid_request_error" if status < 500 else "server_error"


# --- dependencies ----------------------------------------------------------------------------


def _collector(request: Request) -> Collector:
    return request.app.state.collector  # type: ignore[no-any-return]


def _store(request: Request) -> TelemetryStore:
    return request.app.state.store  # type: ignore[no-any-return]


CollectorDep = Annotated[Collector, Depends(_collector)]
StoreDep = Annotated[TelemetryStore, Depends(_store)]

# --- fleet and live ----------------------------------------------------------------------------

fleet = APIRouter(prefix="/api", tags=["fleet"])


@fleet.get("/fleet")
async def get_fleet(collector: CollectorDep) -> dict[str, Any]:
    return {"racks": collector.racks(), "figures": collector.figures()}


@fleet.get("/history")
async def get_history(
    store: StoreDep, minutes: Annotated[float, Query(gt=0, le=24 * 60)] = 15
) -> dict[str, Any]:
    since = now_utc() - timedelta(minutes=minutes)
    samples = await asyncio.to_thread(store.fleet_history, since)
    racks: dict[str, list[dict[str, Any]]] = {}
    for r in await asyncio.to_thread(store.rack_history, since):
        racks.setdefault(r.rack, []).append(
            {
                "ts": r.ts.timestamp(),
                "state": r.state,
                "power_kw": r.power_kw,
                "supply_c": r.supply_c,
                "return_c": r.return_c,
                "flow_lpm": r.flow_lpm,
            }
        )
    fleet_rows = [
        {c: getattr(s, c) for c in FLEET_COLUMNS} | {"ts": s.ts.timestamp()} for s in samples
    ]
    return {"fleet": fleet_rows, "racks": racks}


FLEET_COLUMNS = (
    "live_workers",
    "tokens_per_s",
    "requests_per_s",
    "num_running",
    "num_waiting",
    "kv_usage",
    "prefix_hit_rate",
    "ttft_p50_s",
    "ttft_p99_s",
    "itl_p50_s",
    "itl_p99_s",
    "joules_per_token",
)


@fleet.get("/live", response_class=StreamingResponse)
async def live(request: Request, collector: CollectorDep, store: StoreDep) -> StreamingResponse:
    period = request.app.state.settings.push_every_s

    async def events() -> AsyncIterator[str]:
        while not await request.is_disconnected():
            recent = await asyncio.to_thread(store.recent_requests, RECENT_IN_SNAPSHOT)
            snapshot = {
                "ts": now_utc().timestamp(),
                "racks": collector.racks(),
                "figures": collector.figures(),
                "window_s": request.app.state.settings.window_s,  # of the rates and percentiles
                "requests": [request_json(r) for r in recent],
            }
            yield f"data: {json.dumps(snapshot)}\n\n"
            await asyncio.sleep(period)

    return StreamingResponse(events(), media_type="text/event-stream")


# --- requests and traces -----------------------------------------------------------------------

requests = APIRouter(prefix="/api/requests", tags=["requests"])


def request_json(r: RequestRecord) -> dict[str, Any]:
    return {
        "request_id": r.request_id,
        "trace_id": r.trace_id,
        "started_at": r.started_at.timestamp(),
        "operation": r.operation,
        "model": r.model,
        "status": r.status,
        "finish_reason": r.finish_reason,
        "prompt_tokens": r.prompt_tokens,
        "output_tokens": r.output_tokens,
        "cached_tokens": r.cached_tokens,
        "ttft_s": r.ttft_s,
        "duration_s": r.duration_s,
        "worker_path": [w for w in (r.prefill_worker, r.decode_worker) if w],
        "error_code": r.error_code,
        "error_message": r.error_message,
    }


def span_json(s: SpanRecord, t0: int) -> dict[str, Any]:
    return {
        "span_id": s.span_id,
        "parent_span_id": s.parent_span_id,
        "service": s.service,
        "name": s.name,
        "start_unix_ns": s.start_unix_ns,
        "start_offset_s": (s.start_unix_ns - t0) / 1e9,
        "duration_s": (s.end_unix_ns - s.start_unix_ns) / 1e9,
        "status": s.status,
        "attributes": json.loads(s.attributes),
    }


@requests.get("")
async def list_requests(
    store: StoreDep, limit: Annotated[int, Query(ge=1, le=1000)] = 50
) -> dict[str, Any]:
    recent = await asyncio.to_thread(store.recent_requests, limit)
    return {"requests": [request_json(r) for r in recent]}


@requests.get("/{request_id}/trace")
async def get_trace(request_id: str, store: StoreDep) -> dict[str, Any]:
    spans = await asyncio.to_thread(store.trace, request_id)
    if not spans:
        raise ApiError(404, f"no trace for request {request_id!r} (yet)", code="trace_not_found")
    t0 = min(s.start_unix_ns for s in spans)
    return {
        "request_id": request_id,
        "trace_id": spans[0].trace_id,
        "spans": [span_json(s, t0) for s in spans],
    }


# --- admin: faults (through the facilities service) and draining a worker ---------------------

admin = APIRouter(prefix="/api/admin", tags=["admin"], dependencies=[Admin])


async def facilities_call(request: Request, method: str, path: str, body: Any = None) -> Any:
    settings: TelemetrySettings = request.app.state.settings
    if not settings.facilities_url:
        raise ApiError(409, "no facilities service is configured", code="no_facilities")
    headers = {"Authorization": f"Bearer {settings.facilities_admin_token or ''}"}
    async with httpx.AsyncClient(base_url=settings.facilities_url, timeout=10) as client:
        try:
            resp = await client.request(method, path, json=body, headers=headers)
        except httpx.HTTPError as exc:
            raise ApiError(
                502, f"the facilities service did not answer: {exc}", code="facilities_down"
            ) from exc
    if resp.status_code >= 400:
        message = resp.json().get("error", {}).get("message", resp.text) if resp.content else ""
        raise ApiError(resp.status_code, f"facilities: {message}", code="facilities_error")
    return resp.json()


@admin.post("/racks/{rack}/faults")
async def inject_fault(rack: str, body: FaultIn, request: Request) -> Any:
    return await facilities_call(
        request, "POST", f"/v1/admin/racks/{rack}/faults", body.model_dump(exclude_none=True)
    )


@admin.delete("/racks/{rack}/faults")
async def clear_faults(rack: str, request: Request) -> Any:
    return await facilities_call(request, "DELETE", f"/v1/admin/racks/{rack}/faults")


@admin.post("/workers/{worker_id}/drain")
async def drain_worker(worker_id: str, request: Request, collector: CollectorDep) -> Any:
    if worker_id not in collector.fleet:
        raise ApiError(404, f"no worker {worker_id!r} has sent a heartbeat", code="unknown_worker")
    bus: Bus = request.app.state.bus
    try:
        reply = await bus.request(
            subjects.drain(worker_id),
            pb.DrainRequest(worker_id=worker_id, reason="drained from the ops console"),
            pb.DrainReply,
            timeout=5.0,
            # The worker asks for the operator's token, as its gRPC control API does.
            headers=control_headers(GrpcSecurity().token),
        )
    except Exception as exc:
        raise ApiError(
            504, f"worker {worker_id} did not answer: {exc}", code="worker_silent"
        ) from exc
    return {"worker_id": worker_id, "accepted": reply.accepted, "message": reply.message}


# --- the capacity planner: the same `make_plan` as `tokenyard plan` ----------------------------

planner = APIRouter(prefix="/api/plan", tags=["planner"])


class PlanIn(BaseModel):
    model: str = "llama-3.1-70b"
    gpu: str = "h100"
    weights_dtype: str = "bf16"
    kv_dtype: str = "bf16"
    users: int = Field(1000, ge=1, le=10_000_000)
    tps_per_user: float = Field(20.0, gt=0, le=10_000)
    prompt_len: int = Field(1024, ge=1, le=10_000_000)
    output_len: int = Field(256, ge=1, le=10_000_000)
    ttft_slo_ms: float = Field(2000.0, gt=0)


@planner.get("/options")
async def plan_options() -> dict[str, Any]:
    return {
        "models": sorted(catalog.MODELS),
        "gpus": [*sorted(catalog.HARDWARE), "cpu"],
        "dtypes": sorted(catalog.DTYPE_BYTES),
    }


@planner.post("")
async def post_plan(body: PlanIn) -> dict[str, Any]:
    for name, value, known in (
        ("model", body.model, catalog.MODELS),
        ("gpu", body.gpu, [*catalog.HARDWARE, "cpu"]),
        ("weights_dtype", body.weights_dtype, catalog.DTYPE_BYTES),
        ("kv_dtype", body.kv_dtype, catalog.DTYPE_BYTES),
    ):
        if value not in known:
            raise ApiError(
                400, f"{name}: unknown {value!r} (known: {', '.join(known)})", code="bad_" + name
            )
    workload = Workload(
        users=body.users,
        tps_per_user=body.tps_per_user,
        prompt_len=body.prompt_len,
        output_len=body.output_len,
        ttft_slo_ms=body.ttft_slo_ms,
    )
    # NOTE: in a thread: the `cpu` entry measures this machine's memory and matmul rates.
    try:
        plan = await asyncio.to_thread(
            lambda: make_plan(
                catalog.model(body.model),
                catalog.hardware(body.gpu),
                workload,
                weights_dtype=body.weights_dtype,
                kv_dtype=body.kv_dtype,
            )
        )
    except (PlanError, ValueError, FileNotFoundError) as exc:
        raise ApiError(422, str(exc), code="no_plan") from exc
    return plan.to_json()


# --- the app -------------------------------------------------------------------------------------


def create_app(
    collector: Collector, store: TelemetryStore, bus: Bus, settings: TelemetrySettings
) -> FastAPI:
    app = FastAPI(title="Tokenyard telemetry", version="1")
    app.state.collector, app.state.store, app.state.bus = collector, store, bus
    app.state.settings = settings

    install_error_handler(app, type_of)

    @app.exception_handler(RequestValidationError)
    async def on_invalid(_request: Request, exc: RequestValidationError) -> JSONResponse:
        first = exc.errors()[0] if exc.errors() else {}
        where = ".".join(str(p) for p in first.get("loc", ()))
        message = f"{where}: {first.get('msg', 'invalid request')}"
        return ApiError(400, message, code="invalid_request").response(type_of)

    for router in (fleet, requests, admin, planner):
        app.include_router(router)
    registry = CollectorRegistry()
    registry.register(FleetCollector(collector))
    ProcessCollector(registry=registry)
    ready = lambda: None if bus.nc.is_connected else "not connected to NATS"  # noqa: E731
    app.include_router(ops_router(ready, registry))

    @app.get("/", include_in_schema=False)
    async def console() -> FileResponse:
        return FileResponse(str(STATIC / "index.html"))

    @app.get("/planner", include_in_schema=False)
    async def planner_page() -> FileResponse:
        return FileResponse(str(STATIC / "planner.html"))

    app.mount("/static", StaticFiles(directory=str(STATIC)), name="static")
    return app
