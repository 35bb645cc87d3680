"""POST /v1/load_lora_adapter and /v1/unload_lora_adapter: LoRA adapters at run time, in
vLLM's shape, behind the admin token (tokenyard.api_deps.Admin).

The gateway asks every live worker of its model (services/worker/lora.py over NATS) and
answers with the worst outcome, naming the worker: 400 a malformed adapter, 404 an
unknown one, 409 a limit of the adapter (max_lora_rank) or a name in use, 507 the workers'
host memory (max_cpu_loras), 504 a worker that did not answer. A load that fails on one
worker is undone on the others, so the fleet never holds an adapter only in part. An
unload answers once every worker refuses new requests on the adapter; what runs on it
finishes first.
"""

from __future__ import annotations

import asyncio
import time

from fastapi import APIRouter
from pydantic import BaseModel, Field

from tokenyard.api_deps import Admin
from tokenyard.api_errors import ApiError
from tokenyard.services.gateway.deps import State
from tokenyard.services.gateway.routes.common import error_responses
from tokenyard.services.gateway.state import GatewayState
from tokenyard.v1 import serving_pb2 as pb

router = APIRouter(prefix="/v1", tags=["lora"], dependencies=[Admin])

AdapterName = Field(min_length=1, max_length=128, pattern=r"^[A-Za-z0-9][A-Za-z0-9._:/-]*$")
_CODES = {
    400: "invalid_lora_adapter",
    404: "lora_adapter_not_found",
    409: "lora_limit_reached",
    507: "lora_limit_reached",
    504: "worker_silent",
}
ERRORS = error_responses(400, 401, 403, 404, 409, 503, 504, 507)


class LoadLoRAAdapterRequest(BaseModel):
    lora_name: str = AdapterName
    lora_path: str = Field(min_length=1, max_length=4096)  # a PEFT folder on the workers' hosts


class UnloadLoRAAdapterRequest(BaseModel):
    lora_name: str = AdapterName


class LoRAAdapterResult(BaseModel):
    object: str = "lora_adapter"
    lora_name: str
    parent: str  # the base model
    workers: list[str]
    message: str


@router.post("/load_lora_adapter", response_model=LoRAAdapterResult, responses=ERRORS)
async def load_lora_adapter(body: LoadLoRAAdapterRequest, state: State) -> LoRAAdapterResult:
    if body.lora_name in state.base_models():
        raise ApiError(409, f"{body.lora_name!r} names a base model", code=_CODES[409])
    request = pb.LoRAAdapterRequest(
        action=pb.LoRAAdapterRequest.LOAD, lora_name=body.lora_name, lora_path=body.lora_path
    )
    replies = await _ask_workers(state, request)
    failed = _failures(replies)
    if failed:
        loaded = [w for w, r in replies.items() if r is not None and r.ok]
        undo = pb.LoRAAdapterRequest(action=pb.LoRAAdapterRequest.UNLOAD, lora_name=body.lora_name)
        await asyncio.gather(*(state.backend.lora_call(w, undo) for w in loaded))
        raise _error(failed)
    return _result(state, body.lora_name, replies, held=True)


@router.post("/unload_lora_adapter", response_model=LoRAAdapterResult, responses=ERRORS)
async def unload_lora_adapter(body: UnloadLoRAAdapterRequest, state: State) -> LoRAAdapterResult:
    request = pb.LoRAAdapterRequest(action=pb.LoRAAdapterRequest.UNLOAD, lora_name=body.lora_name)
    replies = await _ask_workers(state, request)
    failed = _failures(replies)
    # A worker that never held it (started after the load) is no failure, unless none did.
    held = {w: r for w, r in replies.items() if r is None or r.status != 404}
    if not held or any(w in held for w, _ in failed):
        raise _error(failed)
    return _result(state, body.lora_name, held, held=False)


async def _ask_workers(
    state: GatewayState, request: pb.LoRAAdapterRequest
) -> dict[str, pb.LoRAAdapterReply | None]:
    workers = [
        w.worker_id for w in state.backend.fleet.live(time.monotonic()) if w.model == state.model_id
    ]
    if not workers:
        raise ApiError(503, f"no live worker serves {state.model_id}", code="no_workers")
    replies = await asyncio.gather(*(state.backend.lora_call(w, request) for w in workers))
    return dict(zip(workers, replies, strict=True))


def _failures(
    replies: dict[str, pb.LoRAAdapterReply | None],
) -> list[tuple[str, pb.LoRAAdapterReply | None]]:
    return [(w, r) for w, r in replies.items() if r is None or not r.ok]


def _error(failed: list[tuple[str, pb.LoRAAdapterReply | None]]) -> ApiError:
    """The first worker's refusal (a silent worker's 504 last: another's reason says more)."""
    failed.sort(key=lambda f: f[1] is None)
    worker, reply = failed[0]
    if reply is None:
        return ApiError(504, f"worker {worker} did not answer", code=_CODES[504])
    status = reply.status if reply.status in _CODES else 400
    return ApiError(status, f"worker {worker}: {reply.message}", code=_CODES[status])


def _result(
    state: GatewayState,
    name: str,
    replies: dict[str, pb.LoRAAdapterReply | None],
    *,
    held: bool,
) -> LoRAAdapterResult:
    for worker in replies:
        state.backend.fleet.note_adapter(worker, name, held=held)
    messages = {r.message for r in replies.values() if r is not None}
    return LoRAAdapterResult(
        lora_name=name,
        parent=state.model_id,
        workers=sorted(replies),
        message="; ".join(sorted(messages)),
    )
