"""The one resume loop: continue a request on another live worker, best first.

Two callers lose a request's worker mid-decode: the gateway, when the worker stops
sending heartbeats, and a stopping decode worker, for the sequences it still runs. Both
send the same DecodeHandoff (the tokens streamed so far as output tokens, no KV to pull:
the taker recomputes them) down the same list of candidates, here.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable

from tokenyard.bus import subjects
from tokenyard.bus.nats import Bus
from tokenyard.fleet.placement import resume_candidates
from tokenyard.fleet.view import WorkerView
from tokenyard.v1 import serving_pb2 as pb

log = logging.getLogger(__name__)


async def resume_on_live_worker(
    bus: Bus,
    live: Iterable[WorkerView],
    resume: pb.DecodeHandoff,
    *,
    exclude: str,
    timeout_s: float,
) -> str | None:
    """Offer ``resume`` to each of :func:`resume_candidates` in turn (``exclude``: the worker
    that lost it); returns the worker that took it, or None when none did.

    ``timeout_s`` bounds one worker's answer: a live one answers a hand-off at once."""
    rid = resume.request_id
    for worker_id in resume_candidates(live, exclude=exclude):
        try:
            ack = await bus.request(
                subjects.decode_jobs(worker_id), resume, pb.HandoffAck, timeout=timeout_s
            )
        except Exception as exc:  # gone too, or busy: try the next one
            log.info("resume of %s on %s failed: %s", rid, worker_id, type(exc).__name__)
            continue
        if ack.accepted:
            log.info(
                "resumed %s on %s (%d tokens in)", rid, worker_id, len(resume.output_token_ids)
            )
            return worker_id
        log.info("worker %s refused to resume %s: %s", worker_id, rid, ack.message)
    return None
