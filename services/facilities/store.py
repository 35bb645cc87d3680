"""The facilities history in SQL: inventory rows, readings and state events.

Synchronous SQLAlchemy; the async service calls these through asyncio.to_thread so a slow
database never blocks the NATS handlers.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import UTC, datetime

from sqlalchemy import delete, func, select
from sqlalchemy.orm import Session, selectinload, sessionmaker

from tokenyard.db.facilities import CoolantLoop, Node, Rack, Reading, Site, StateEvent, Worker
from tokenyard.facilities import policy
from tokenyard.facilities.inventory import Inventory, RackSpec


def to_datetime(ts: float) -> datetime:
    return datetime.fromtimestamp(ts, tz=UTC)


@dataclass(frozen=True)
class StoredState:
    """The last recorded state of a rack, to resume from after a restart."""

    rack: str
    state: policy.State
    since: float
    reason: str


class FacilitiesStore:
    def __init__(self, sessions: sessionmaker[Session]) -> None:
        self.sessions = sessions
        self.rack_ids: dict[str, int] = {}

    def sync_inventory(self, inventory: Inventory) -> dict[str, int]:
        """Make the inventory rows match the YAML (racks are kept, so their history stays)."""
        with self.sessions.begin() as s:
            site = s.scalar(select(Site).where(Site.name == inventory.site)) or Site(
                name=inventory.site
            )
            s.add(site)
            loops = {}
            for spec in inventory.coolant_loops:
                loop = s.scalar(
                    select(CoolantLoop).where(CoolantLoop.name == spec.name)
                ) or CoolantLoop(name=spec.name)
                loop.site, loop.supply_limit_c, loop.return_limit_c = (
                    site,
                    spec.supply_limit_c,
                    spec.return_limit_c,
                )
                loop.min_flow_lpm = spec.min_flow_lpm
                s.add(loop)
                loops[spec.name] = loop
            for rack_spec in inventory.racks:
                rack = s.scalar(
                    select(Rack)
                    .where(Rack.name == rack_spec.name)
                    .options(selectinload(Rack.nodes))
                )
                rack = rack or Rack(name=rack_spec.name)
                rack.site = site
                rack.loop = loops.get(rack_spec.loop) if rack_spec.loop else None
                rack.power_cap_kw, rack.cooling_type = rack_spec.power_cap_kw, rack_spec.cooling
                s.add(rack)
                self._replace_nodes(s, rack, rack_spec)
            s.flush()
            self.rack_ids = {r.name: r.id for r in s.scalars(select(Rack))}
        return dict(self.rack_ids)

    @staticmethod
    def _replace_nodes(s: Session, rack: Rack, spec: RackSpec) -> None:
        # NOTE: workers move between racks when the YAML says so; delete first so the
        # worker_id primary key is free for its new node.
        names = [n.name for n in spec.nodes]
        s.execute(delete(Worker).where(Worker.worker_id.in_(spec.worker_ids)))
        for node in list(rack.nodes):
            s.delete(node)
        s.execute(delete(Node).where(Node.name.in_(names)))
        s.flush()
        for n in spec.nodes:
            node = Node(name=n.name, gpu_count=n.gpus, gpu_tdp_w=n.gpu_tdp_w)
            node.workers = [Worker(worker_id=w) for w in n.workers]
            rack.nodes.append(node)

    def add_reading(self, r: policy.Reading) -> int:
        with self.sessions.begin() as s:
            row = Reading(
                rack_id=self.rack_ids[r.rack],
                ts=to_datetime(r.ts),
                power_kw=r.power_kw,
                supply_c=r.supply_c,
                return_c=r.return_c,
                flow_lpm=r.flow_lpm,
                inlet_air_c=r.inlet_air_c,
                source=r.source,
            )
            s.add(row)
            s.flush()
            return row.id

    def add_event(
        self,
        rack: str,
        ts: float,
        from_state: policy.State,
        to: policy.State,
        reason: str,
        max_seqs_per_worker: int,
        reading_id: int | None,
    ) -> int:
        with self.sessions.begin() as s:
            row = StateEvent(
                rack_id=self.rack_ids[rack],
                ts=to_datetime(ts),
                from_state=from_state.label,
                to_state=to.label,
                reason=reason,
                max_seqs_per_worker=max_seqs_per_worker,
                reading_id=reading_id,
            )
            s.add(row)
            s.flush()
            return row.id

    def readings(self, rack: str, start: datetime, end: datetime, limit: int) -> list[Reading]:
        """The most recent `limit` readings in [start, end], oldest first."""
        with self.sessions() as s:
            q = (
                select(Reading)
                .where(
                    Reading.rack_id == self.rack_ids[rack], Reading.ts >= start, Reading.ts <= end
                )
                .order_by(Reading.ts.desc(), Reading.id.desc())
                .limit(limit)
            )
            return list(reversed(s.scalars(q).all()))

    def events(
        self, rack: str | None, start: datetime, end: datetime, limit: int
    ) -> list[StateEvent]:
        with self.sessions() as s:
            q = select(StateEvent).options(
                selectinload(StateEvent.reading), selectinload(StateEvent.rack)
            )
            if rack is not None:
                q = q.where(StateEvent.rack_id == self.rack_ids[rack])
            q = q.where(StateEvent.ts >= start, StateEvent.ts <= end)
            q = q.order_by(StateEvent.ts.desc(), StateEvent.id.desc()).limit(limit)
            return list(reversed(s.scalars(q).all()))

    def prune_readings(self, before: datetime) -> int:
        """Delete readings older than `before`, except those a state event points at."""
        with self.sessions.begin() as s:
            kept = select(StateEvent.reading_id).where(StateEvent.reading_id.is_not(None))
            result = s.execute(delete(Reading).where(Reading.ts < before, Reading.id.not_in(kept)))
            return int(result.rowcount or 0)  # type: ignore[attr-defined]

    def last_states(self) -> dict[str, StoredState]:
        with self.sessions() as s:
            latest = (
                select(StateEvent.rack_id, func.max(StateEvent.id).label("id"))
                .group_by(StateEvent.rack_id)
                .subquery()
            )
            rows = s.scalars(
                select(StateEvent)
                .join(latest, StateEvent.id == latest.c.id)
                .options(selectinload(StateEvent.rack))
            ).all()
            return {
                e.rack.name: StoredState(
                    e.rack.name, policy.State[e.to_state.upper()], e.ts.timestamp(), e.reason
                )
                for e in rows
            }
