"""LoRA adapters loaded and unloaded at run time: the gateway's admin API asks each worker
over NATS (ty.lora.<worker>; only the gateway's, the router's and the operator's NATS
users may publish there: the gateway after it checked the admin token, the router to load a
busy adapter on a worker with room, from the path the adapter's holders name).

Each outcome carries the HTTP status the gateway answers with: 400 a malformed adapter,
404 an unknown one, 409 a limit of the adapter itself (max_lora_rank, a name in use), 507
the host memory's (max_cpu_loras). An unload while requests run on the adapter answers at
once: new requests are refused from then on, and those running finish first
(engine/lora.py)."""

from __future__ import annotations

import logging

from tokenyard.engine.outputs import UnknownAdapter
from tokenyard.models.errors import AdapterLimit
from tokenyard.services.worker.base import WorkerBase
from tokenyard.v1 import serving_pb2 as pb

log = logging.getLogger(__name__)

Action = pb.LoRAAdapterRequest


async def handle(worker: WorkerBase, req: pb.LoRAAdapterRequest) -> pb.LoRAAdapterReply:
    """Load or unload on this worker's engine; the reply says how it went."""
    engine = worker.engine
    try:
        if req.action == Action.LOAD:
            info = await worker.loop.call(engine.add_lora, req.lora_name, req.lora_path)
            message = f"loaded LoRA adapter {info.name!r} (rank {info.rank})"
        elif req.action == Action.UNLOAD:
            now = await worker.loop.call(engine.remove_lora, req.lora_name)
            message = f"unloaded LoRA adapter {req.lora_name!r}" + (
                "" if now else " once the requests running on it finish"
            )
        else:
            return pb.LoRAAdapterReply(status=400, message="action must be LOAD or UNLOAD")
    except AdapterLimit as exc:
        return pb.LoRAAdapterReply(
            status=507 if exc.limit == "max_cpu_loras" else 409, message=str(exc)
        )
    except UnknownAdapter as exc:
        return pb.LoRAAdapterReply(status=404, message=str(exc))
    except ValueError as exc:  # InvalidAdapter, or LoRA not enabled here
        return pb.LoRAAdapterReply(status=400, message=str(exc))
    log.info("worker %s: %s", worker.worker_id, message)
    await worker.presence.beat_now()  # the router places on the adapter from its next beat
    return pb.LoRAAdapterReply(ok=True, status=200, message=message)
