"""The one liveness rule of the fleet.

A worker is alive while its last heartbeat is at most ``missed`` of its own announced
intervals old. Every service (router, gateway, workers, facilities) asks this rule; none
keeps a timeout of its own.
"""

from __future__ import annotations

from tokenyard.v1 import serving_pb2 as pb

DEFAULT_INTERVAL_S = 1.0  # for a heartbeat that announces no interval
DEFAULT_MISSED_HEARTBEATS = 3


def announced_interval_s(hb: pb.WorkerHeartbeat) -> float:
    ms = hb.heartbeat_interval_ms
    return ms / 1000 if ms else DEFAULT_INTERVAL_S


def silence_limit_s(interval_s: float, missed: int) -> float:
    """How long a worker beating every ``interval_s`` may stay silent and still be alive."""
    return missed * interval_s


def is_alive(age_s: float, interval_s: float, missed: int = DEFAULT_MISSED_HEARTBEATS) -> bool:
    return age_s <= silence_limit_s(interval_s, missed)
