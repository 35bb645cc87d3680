"""Which transport two KV endpoints use: a pure function of what each side offers."""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass

# Best first.
TRANSPORTS = ("inproc", "shm", "mooncake", "grpc")


@dataclass(frozen=True)
class Peer:
    """What one end of a transfer can do."""

    allowed: frozenset[str]
    host_id: str
    process_id: str
    has_shm: bool = False  # the pool lives in POSIX shared memory
    has_mooncake: bool = False  # a Mooncake transfer engine with the pool registered


def candidates(client: Peer, server: Peer, *, server_in_process: bool) -> list[str]:
    """Every transport both ends allow and can use, best first (gRPC, if allowed, last).

    The client tries them in order: one that fails to set up (e.g. the shared memory name
    is not visible from this container) falls through to the next before any byte moves.
    """
    possible = {
        "inproc": server_in_process and client.process_id == server.process_id,
        "shm": client.host_id == server.host_id and server.has_shm,
        "mooncake": client.has_mooncake and server.has_mooncake,
        "grpc": True,
    }
    both = client.allowed & server.allowed
    return [t for t in TRANSPORTS if t in both and possible[t]]


def ordered(allowed: Collection[str]) -> list[str]:
    return [t for t in TRANSPORTS if t in allowed]
