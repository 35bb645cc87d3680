"""Keeps the router's block index in step with each worker's numbered KV events.

A worker numbers its KVEvents 1, 2, 3, ... within an epoch (one per worker process). The
index takes them in order; whatever it cannot take in order makes it ask that worker for
a dump of its cached blocks (``ty.kv.resync.<worker>``) and rebuild that worker's part:

    event, same epoch, seq == last + 1      -> apply
    event, seq <= last                      -> old news: drop
    event after a gap, or of a new epoch    -> keep it aside, resync
      (a new epoch's seq 1 is a worker's first event: its stream starts there)
    heartbeat of an epoch we do not follow  -> resync (this router or that worker restarted)
    a heartbeat's seq still missing at the next -> resync (the last events were lost)
    dump (epoch, seq, hashes)               -> replace the worker's blocks, then apply the
                                               events kept aside with seq after the dump's

Pure state: the handler (handler.py) does the asking; tests script events and dumps.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from tokenyard.kv.hashing import HASH_SPEC_VERSION
from tokenyard.services.router.state import BlockIndex
from tokenyard.v1 import serving_pb2 as pb

# Events kept aside while a dump is on its way; past this the oldest are dropped (the
# replay then finds a gap and asks again).
MAX_BUFFERED = 4096


@dataclass
class WorkerStream:
    epoch: str = ""
    seq: int = 0  # the last event applied
    resyncing: bool = False  # a dump was asked for and has not come
    buffered: list[pb.KVEvent] = field(default_factory=list)
    announced: int = 0  # the seq the worker's last heartbeat announced


class KVSync:
    def __init__(self, index: BlockIndex) -> None:
        self.index = index
        self.streams: dict[str, WorkerStream] = {}

    def on_event(self, event: pb.KVEvent) -> bool:
        """Apply the event or keep it aside; True = ask its worker for a dump now."""
        s = self.streams.setdefault(event.worker_id, WorkerStream())
        if s.resyncing:
            self._buffer(s, event)
            return False
        if event.epoch != s.epoch:
            if event.seq != 1:
                return self._start_resync(s, event)
            self.index.forget(event.worker_id)  # the old process's blocks went with it
            s.epoch, s.seq = event.epoch, 0
        if event.seq <= s.seq:
            return False
        if event.seq > s.seq + 1:
            return self._start_resync(s, event)
        self.index.on_event(event)
        s.seq = event.seq
        return False

    def on_heartbeat(self, hb: pb.WorkerHeartbeat) -> bool:
        """True = ask this worker for a dump now."""
        if not hb.kv_epoch:
            return False  # it publishes no numbered events
        s = self.streams.setdefault(hb.worker_id, WorkerStream())
        if s.resyncing:
            return False
        if hb.kv_epoch != s.epoch:
            return self._start_resync(s)
        # NOTE: a busy worker's heartbeat is always a little ahead (its latest events are on
        # their way on another subscription); what the previous heartbeat announced, one
        # interval ago, must have arrived by now, or it was lost.
        lost = s.announced > s.seq
        s.announced = hb.kv_seq
        return self._start_resync(s) if lost else False

    def on_dump(self, dump: pb.KVDump) -> bool:
        """Rebuild the worker's blocks from its dump; True = the events kept aside have a
        gap after it, so ask again."""
        s = self.streams.setdefault(dump.worker_id, WorkerStream())
        if dump.hash_version in ("", HASH_SPEC_VERSION):
            self.index.replace(dump.worker_id, list(dump.block_hashes))
        else:
            self.index.forget(dump.worker_id)  # hashes of another scheme mean nothing here
        s.epoch, s.seq, s.resyncing, s.announced = dump.epoch, dump.seq, False, 0
        later = [e for e in s.buffered if e.epoch == dump.epoch and e.seq > dump.seq]
        s.buffered = []
        later.sort(key=lambda e: e.seq)
        for i, event in enumerate(later):
            if self.on_event(event):
                s.buffered.extend(later[i + 1 :])
                return True
        return False

    def resync_failed(self, worker_id: str) -> None:
        """No dump came: the next event or heartbeat of the worker asks again."""
        s = self.streams.get(worker_id)
        if s is not None:
            s.resyncing, s.epoch, s.seq = False, "", 0
            s.buffered.clear()

    def forget(self, worker_id: str) -> None:
        self.streams.pop(worker_id, None)
        self.index.forget(worker_id)

    def _start_resync(self, s: WorkerStream, event: pb.KVEvent | None = None) -> bool:
        s.resyncing = True
        if event is not None:
            self._buffer(s, event)
        return True

    def _buffer(self, s: WorkerStream, event: pb.KVEvent) -> None:
        if len(s.buffered) >= MAX_BUFFERED:
            del s.buffered[0]
        s.buffered.append(event)
