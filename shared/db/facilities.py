"""Facilities tables: sites, coolant loops, racks, nodes, workers, readings and state events.

Site 1-* CoolantLoop 1-* Rack 1-* Node 1-* Worker
                         Rack 1-* Reading
                         Rack 1-* StateEvent *-1 Reading (the one that caused it)
"""

from __future__ import annotations

from datetime import datetime

from sqlalchemy import ForeignKey, Index, String, Text
from sqlalchemy.orm import Mapped, mapped_column, relationship

from tokenyard.db.base import Base, UTCDateTime


class Site(Base):
    __tablename__ = "fac_sites"

    id: Mapped[int] = mapped_column(primary_key=True)
    name: Mapped[str] = mapped_column(String(128), unique=True)

    loops: Mapped[list[CoolantLoop]] = relationship(back_populates="site")
    racks: Mapped[list[Rack]] = relationship(back_populates="site")


class CoolantLoop(Base):
    __tablename__ = "fac_coolant_loops"

    id: Mapped[int] = mapped_column(primary_key=True)
    site_id: Mapped[int] = mapped_column(ForeignKey("fac_sites.id", ondelete="CASCADE"))
    name: Mapped[str] = mapped_column(String(128), unique=True)
    supply_limit_c: Mapped[float]
    return_limit_c: Mapped[float]
    min_flow_lpm: Mapped[float]

    site: Mapped[Site] = relationship(back_populates="loops")
    racks: Mapped[list[Rack]] = relationship(back_populates="loop")


class Rack(Base):
    __tablename__ = "fac_racks"

    id: Mapped[int] = mapped_column(primary_key=True)
    site_id: Mapped[int] = mapped_column(ForeignKey("fac_sites.id", ondelete="CASCADE"))
    loop_id: Mapped[int | None] = mapped_column(
        ForeignKey("fac_coolant_loops.id", ondelete="SET NULL")
    )
    name: Mapped[str] = mapped_column(String(128), unique=True)
    power_cap_kw: Mapped[float]
    cooling_type: Mapped[str] = mapped_column(String(32))  # liquid | air | hybrid

    site: Mapped[Site] = relationship(back_populates="racks")
    loop: Mapped[CoolantLoop | None] = relationship(back_populates="racks")
    nodes: Mapped[list[Node]] = relationship(back_populates="rack", cascade="all, delete-orphan")


class Node(Base):
    __tablename__ = "fac_nodes"

    id: Mapped[int] = mapped_column(primary_key=True)
    rack_id: Mapped[int] = mapped_column(ForeignKey("fac_racks.id", ondelete="CASCADE"))
    name: Mapped[str] = mapped_column(String(128), unique=True)
    gpu_count: Mapped[int]
    gpu_tdp_w: Mapped[float]

    rack: Mapped[Rack] = relationship(back_populates="nodes")
    workers: Mapped[list[Worker]] = relationship(
        back_populates="node", cascade="all, delete-orphan"
    )


class Worker(Base):
    """A serving worker id (as in its heartbeats) and the node it runs on."""

    __tablename__ = "fac_workers"

    worker_id: Mapped[str] = mapped_column(String(128), primary_key=True)
    node_id: Mapped[int] = mapped_column(ForeignKey("fac_nodes.id", ondelete="CASCADE"))

    node: Mapped[Node] = relationship(back_populates="workers")


class Reading(Base):
    """One rack's telemetry at one time. Coolant and air fields are absent where not measured."""

    __tablename__ = "fac_readings"
    __table_args__ = (Index("ix_fac_readings_rack_ts", "rack_id", "ts"),)

    id: Mapped[int] = mapped_column(primary_key=True)
    rack_id: Mapped[int] = mapped_column(ForeignKey("fac_racks.id", ondelete="CASCADE"))
    ts: Mapped[datetime] = mapped_column(UTCDateTime())
    power_kw: Mapped[float]
    supply_c: Mapped[float | None]
    return_c: Mapped[float | None]
    flow_lpm: Mapped[float | None]
    inlet_air_c: Mapped[float | None]
    source: Mapped[str] = mapped_column(String(64))

    rack: Mapped[Rack] = relationship()


class StateEvent(Base):
    """A rack's state changed (normal / derate / drain), why, and the reading behind it."""

    __tablename__ = "fac_state_events"
    __table_args__ = (Index("ix_fac_state_events_rack_ts", "rack_id", "ts"),)

    id: Mapped[int] = mapped_column(primary_key=True)
    rack_id: Mapped[int] = mapped_column(ForeignKey("fac_racks.id", ondelete="CASCADE"))
    ts: Mapped[datetime] = mapped_column(UTCDateTime())
    from_state: Mapped[str] = mapped_column(String(16))
    to_state: Mapped[str] = mapped_column(String(16))
    reason: Mapped[str] = mapped_column(Text)
    max_seqs_per_worker: Mapped[int]
    reading_id: Mapped[int | None] = mapped_column(
        ForeignKey("fac_readings.id", ondelete="SET NULL")
    )

    rack: Mapped[Rack] = relationship()
    reading: Mapped[Reading | None] = relationship()
