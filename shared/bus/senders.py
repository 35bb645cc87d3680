"""What workers say about themselves, from the worker the subject names.

A heartbeat or a KV event names its worker twice: in its subject, which NATS lets only that
worker's user publish on (tokenyard.bus.auth), and in its payload, which anyone who may
publish anywhere could fill in. Readers subscribe through these functions, so a message
whose payload speaks for another worker than its subject is dropped before any handler
sees it, and every handler may trust ``worker_id`` (and a heartbeat's ``role``):

    await subscribe_heartbeats(bus, handler.on_heartbeat)
    await subscribe_kv_events(bus, handler.on_kv_event)
"""

from __future__ import annotations

import logging

from nats.aio.msg import Msg
from nats.aio.subscription import Subscription

from tokenyard.bus import subjects
from tokenyard.bus.nats import Bus, Handler
from tokenyard.v1 import serving_pb2 as pb

log = logging.getLogger(__name__)


async def subscribe_heartbeats(bus: Bus, handler: Handler[pb.WorkerHeartbeat]) -> Subscription:
    async def checked(hb: pb.WorkerHeartbeat, msg: Msg) -> None:
        sender = subjects.heartbeat_sender(msg.subject)
        if sender != (hb.role, hb.worker_id):
            log.warning(
                "dropping a heartbeat of %s (%s) sent on %s", hb.worker_id, hb.role, msg.subject
            )
            return
        await handler(hb, msg)

    return await bus.subscribe(subjects.HEARTBEATS_ALL, pb.WorkerHeartbeat, checked)


async def subscribe_kv_events(bus: Bus, handler: Handler[pb.KVEvent]) -> Subscription:
    async def checked(event: pb.KVEvent, msg: Msg) -> None:
        if subjects.kv_events_sender(msg.subject) != event.worker_id:
            log.warning("dropping a KV event of %s sent on %s", event.worker_id, msg.subject)
            return
        await handler(event, msg)

    return await bus.subscribe(subjects.KV_EVENTS_ALL, pb.KVEvent, checked)
