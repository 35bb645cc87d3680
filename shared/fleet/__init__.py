"""The fleet: worker roles, the one liveness rule, a view fed by heartbeats, placement helpers.

    fleet = FleetView(missed_heartbeats=3)
    fleet.on_heartbeat(hb, now)                          # every pb.WorkerHeartbeat heard
    fleet.live(now)                                      # -> [WorkerView, ...]
    resume_candidates(fleet.live(now), exclude=dead_id)  # -> worker ids, best first

Every service asks this package who is alive and who can take what; the router's
per-request choice stays its own policy (tokenyard.routing.policy).
"""

from tokenyard.fleet.liveness import DEFAULT_MISSED_HEARTBEATS, is_alive
from tokenyard.fleet.placement import missing_role, resume_candidates
from tokenyard.fleet.roles import DECODE_ROLES, PREFILL_ROLES, ROLES, Role, can_decode, can_prefill
from tokenyard.fleet.view import FleetView, WorkerView

__all__ = [
    "DECODE_ROLES",
    "DEFAULT_MISSED_HEARTBEATS",
    "PREFILL_ROLES",
    "ROLES",
    "FleetView",
    "Role",
    "WorkerView",
    "can_decode",
    "can_prefill",
    "is_alive",
    "missing_role",
    "resume_candidates",
]
