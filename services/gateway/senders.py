"""Which workers may send one request's token chunks: those it was placed on or handed to.

Every worker may publish token chunks, each on a subject that names it
(``ty.tokens.<gateway>.<request>.<worker>``, and NATS lets only that worker's user publish
there: tokenyard.bus.auth). The subject names the request too, yet any worker may publish
under any request id; so the gateway takes a request's chunks only from the workers that
request belongs to, and grows that set only on the word of someone who may move it:

    placed on P (prefill) and D (decode)       -> {P, D}
    the gateway resumed it on T                -> + T
    a worker of the set handed it to T         -> + T  (a chunk with handed_to=T)
    the router moved P's job to T (JobMoved)   -> + T, only when this gateway's own fleet
                                                  view says P is dead and T alive

A chunk from any other worker waits here (a few, bounded): the notice that adds its sender
travels on another path and can arrive after the new worker's first chunks. Chunks of a
sender never added are dropped with the request.

    senders = RequestSenders(placement, fleet)
    for chunk in senders.admit(sender, chunk, now): ...   # the chunks to stream now
"""

from __future__ import annotations

import logging

from tokenyard.fleet import FleetView
from tokenyard.v1 import serving_pb2 as pb

log = logging.getLogger(__name__)

MAX_HELD_CHUNKS = 256  # chunks of not-yet-named senders kept per request
MAX_PENDING_MOVES = 8  # moves waiting for this gateway's fleet view to agree, per request


class RequestSenders:
    def __init__(
        self, request_id: str, placement: pb.Placement, fleet: FleetView, *, max_held: int = 0
    ) -> None:
        self.request_id = request_id
        self.fleet = fleet
        self.allowed = {placement.prefill_worker_id, placement.decode_worker_id} - {""}
        self.held: dict[str, list[pb.TokenChunk]] = {}
        self.max_held = max_held or MAX_HELD_CHUNKS
        self._num_held = 0
        self._dropping = False  # warned that the held chunks are at their bound
        self.moves: list[pb.JobMoved] = []  # waiting for the fleet view to agree
        # from worker -> to worker, of every move believed: the request's owner follows
        # its job (the gateway's grace for a lost worker does not run while it waits there)
        self.moved: dict[str, str] = {}

    def admit(self, sender: str | None, chunk: pb.TokenChunk) -> list[pb.TokenChunk]:
        """The chunks to stream now, given one that `sender` published."""
        if not sender:
            return []
        if sender not in self.allowed:
            self._hold(sender, chunk)
            return []
        chunk.worker_id = sender  # the subject, not the payload, says who sent it
        if chunk.handed_to:  # a notice, no tokens: the request goes on there
            log.info("%s: %s handed it to %s", self.request_id, sender, chunk.handed_to)
            return self.allow(chunk.handed_to)
        return [chunk]

    def allow(self, worker_id: str) -> list[pb.TokenChunk]:
        """Take `worker_id`'s chunks from now on; returns those it sent already."""
        self.allowed.add(worker_id)
        held = self.held.pop(worker_id, [])
        self._num_held -= len(held)
        return [c for h in held for c in self.admit(worker_id, h)]

    def on_moved(self, moved: pb.JobMoved, now: float) -> list[pb.TokenChunk]:
        """The router says it moved this request's job; believed only when this gateway's
        fleet view agrees: the job was on a worker of the request, now dead, and goes to a
        live one. A move from a worker this gateway still sees alive (its view may lag the
        router's by a heartbeat) waits for `recheck`."""
        if moved.request_id != self.request_id or moved.from_worker_id not in self.allowed:
            log.warning(
                "%s: ignoring a move of its job from %s, not one of its workers",
                self.request_id,
                moved.from_worker_id,
            )
            return []
        if not self._move_agrees(moved, now):
            if len(self.moves) < MAX_PENDING_MOVES:
                self.moves.append(moved)
            return []
        return self._moved(moved)

    def recheck(self, now: float) -> list[pb.TokenChunk]:
        """Moves that waited for this gateway's fleet view to agree, and now do."""
        agreed = [m for m in self.moves if self._move_agrees(m, now)]
        self.moves = [m for m in self.moves if m not in agreed]
        return [c for m in agreed for c in self._moved(m)]

    def _move_agrees(self, moved: pb.JobMoved, now: float) -> bool:
        decode = moved.decode_worker_id
        return (
            not self.fleet.alive(moved.from_worker_id, now)
            and self.fleet.alive(moved.to_worker_id, now)
            and (not decode or decode in self.allowed or self.fleet.alive(decode, now))
        )

    def _moved(self, moved: pb.JobMoved) -> list[pb.TokenChunk]:
        log.info(
            "%s: its job moved from %s to %s",
            self.request_id,
            moved.from_worker_id,
            moved.to_worker_id,
        )
        self.moved[moved.from_worker_id] = moved.to_worker_id
        released = self.allow(moved.to_worker_id)
        if moved.decode_worker_id:
            released += self.allow(moved.decode_worker_id)
        return released

    def _hold(self, sender: str, chunk: pb.TokenChunk) -> None:
        if self._num_held >= self.max_held:
            if not self._dropping:
                self._dropping = True
                log.warning(
                    "%s: dropping chunks from workers it was not placed on (%s, ...)",
                    self.request_id,
                    sender,
                )
            return
        self.held.setdefault(sender, []).append(chunk)
        self._num_held += 1
