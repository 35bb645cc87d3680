"""Pure placement helpers over a snapshot of live workers: no bus, no clock.

The router's per-request placement is its own policy (tokenyard.routing.policy);
these are the questions every other service asks of the same fleet.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from tokenyard.fleet.view import WorkerView


def missing_role(live: Sequence[WorkerView]) -> str | None:
    """The first part of a request no live worker can do, or None when all can be served."""
    if not any(w.prefills for w in live):
        return "prefill"
    if not any(w.decodes for w in live):
        return "decode"
    return None


def resume_candidates(live: Iterable[WorkerView], *, exclude: str) -> list[str]:
    """Which live workers can continue a decode that ``exclude`` (dead, or stopping) was
    running, best first: decode-capable workers (decode, both), then prefill workers, which
    decode a resumed request as well as any (same engine) and save it when no decode worker
    is live or each refuses. Within each group the least busy, then the most free KV blocks,
    since the taker recomputes the sequence from its tokens and the least busy starts that
    soonest."""
    takers = [w for w in live if not w.draining and w.worker_id != exclude]
    takers.sort(key=lambda w: (not w.decodes, w.load, -w.num_free_blocks, w.worker_id))
    return [w.worker_id for w in takers]
