"""Worker roles: what a worker announces in its heartbeats, and which part of a request each can do.

A "both" worker runs the prefill and the decode handler over one engine (aggregated mode).
"""

from __future__ import annotations

from typing import Literal, get_args

Role = Literal["prefill", "decode", "both"]
ROLES: tuple[Role, ...] = get_args(Role)

PREFILL_ROLES = frozenset({"prefill", "both"})
DECODE_ROLES = frozenset({"decode", "both"})


def can_prefill(role: str) -> bool:
    return role in PREFILL_ROLES


def can_decode(role: str) -> bool:
    return role in DECODE_ROLES
