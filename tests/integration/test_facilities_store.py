"""Facilities persistence on SQLite and PostgreSQL: migrations, inventory, readings, events."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest
from sqlalchemy import create_engine, text

from tokenyard.db import make_engine, make_sessionmaker, migrate
from tokenyard.facilities import policy
from tokenyard.facilities.inventory import load_inventory
from tokenyard.services.facilities.store import FacilitiesStore


@pytest.fixture(params=["sqlite", "postgresql"])
def db_url(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[str]:
    if request.param == "sqlite":
        yield f"sqlite:///{tmp_path / 'facilities.db'}"
        return
    pg_url = request.getfixturevalue("postgres_url")
    # A schema of its own per test: parallel and earlier runs never collide.
    schema = f"t_{uuid.uuid4().hex[:12]}"
    admin = create_engine(pg_url, isolation_level="AUTOCOMMIT")
    with admin.connect() as conn:
        conn.execute(text(f'CREATE SCHEMA "{schema}"'))
    try:
        yield f"{pg_url}?options=-csearch_path%3D{schema}"
    finally:
        with admin.connect() as conn:
            conn.execute(text(f'DROP SCHEMA "{schema}" CASCADE'))
        admin.dispose()


@pytest.fixture
def store(db_url: str, example_inventory: Path) -> Iterator[FacilitiesStore]:
    migrate(db_url)
    engine = make_engine(db_url)
    store = FacilitiesStore(make_sessionmaker(engine))
    store.sync_inventory(load_inventory(example_inventory))
    yield store
    engine.dispose()


def test_migrate_is_idempotent_and_inventory_resyncs(
    db_url: str, store: FacilitiesStore, example_inventory: Path
) -> None:
    migrate(db_url)
    ids = dict(store.rack_ids)
    assert set(ids) == {"rack-a", "rack-b"}
    # Re-syncing keeps rack ids, so history stays attached to its rack.
    assert store.sync_inventory(load_inventory(example_inventory)) == ids


def test_readings_and_events_round_trip_over_a_time_range(store: FacilitiesStore) -> None:
    t0 = datetime(2026, 1, 1, tzinfo=UTC).timestamp()
    ids = [
        store.add_reading(
            policy.Reading(
                "rack-a", t0 + i, power_kw=2.0 + i, supply_c=25.0, return_c=28.0, flow_lpm=30.0
            )
        )
        for i in range(5)
    ]
    store.add_reading(policy.Reading("rack-b", t0, power_kw=1.0))
    event_id = store.add_event(
        "rack-a", t0 + 3, policy.State.NORMAL, policy.State.DRAIN, "drain: coolant flow", 0, ids[3]
    )
    assert event_id > 0

    start = datetime.fromtimestamp(t0 + 1, UTC)
    got = store.readings("rack-a", start, start + timedelta(seconds=2), limit=100)
    assert [r.power_kw for r in got] == [3.0, 4.0, 5.0]
    assert got[0].ts == start and got[0].ts.tzinfo is not None
    assert [
        r.power_kw for r in store.readings("rack-a", start, start + timedelta(days=1), limit=2)
    ] == [5.0, 6.0]
    air = store.readings("rack-b", start - timedelta(seconds=1), start, limit=10)
    assert air[0].supply_c is None and air[0].power_kw == 1.0

    events = store.events(None, start, start + timedelta(seconds=10), limit=10)
    assert len(events) == 1
    assert (events[0].rack.name, events[0].from_state, events[0].to_state) == (
        "rack-a",
        "normal",
        "drain",
    )
    assert events[0].reading is not None and events[0].reading.power_kw == 5.0
    assert store.events("rack-b", start, start + timedelta(seconds=10), limit=10) == []


def test_last_states_resume_each_rack(store: FacilitiesStore) -> None:
    t0 = 1_700_000_000.0
    store.add_event(
        "rack-a", t0, policy.State.NORMAL, policy.State.DERATE, "derate: power", 4, None
    )
    store.add_event(
        "rack-a", t0 + 5, policy.State.DERATE, policy.State.DRAIN, "drain: flow", 0, None
    )
    store.add_event(
        "rack-b", t0 + 1, policy.State.NORMAL, policy.State.DERATE, "derate: stale", 4, None
    )
    last = store.last_states()
    assert last["rack-a"].state is policy.State.DRAIN and last["rack-a"].since == t0 + 5
    assert last["rack-b"].state is policy.State.DERATE


def test_prune_keeps_readings_behind_events(store: FacilitiesStore) -> None:
    t0 = 1_700_000_000.0
    ids = [store.add_reading(policy.Reading("rack-a", t0 + i, power_kw=1.0)) for i in range(4)]
    store.add_event(
        "rack-a", t0 + 1, policy.State.NORMAL, policy.State.DERATE, "derate: power", 4, ids[1]
    )
    assert store.prune_readings(datetime.fromtimestamp(t0 + 3, UTC)) == 2  # ids 0 and 2
    left = store.readings(
        "rack-a", datetime.fromtimestamp(t0, UTC), datetime.fromtimestamp(t0 + 10, UTC), 10
    )
    assert [r.id for r in left] == [ids[1], ids[3]]
