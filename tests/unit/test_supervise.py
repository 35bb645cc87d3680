"""The launcher's restart policy: backoff, a stable run resets it, fast failures give up."""

from __future__ import annotations

import sys
import time
from pathlib import Path

import pytest

from tokenyard.services.launch.procs import ChildProcess, wait_until
from tokenyard.services.launch.supervise import (
    CONFIG_EXIT,
    GaveUp,
    Record,
    RestartPolicy,
    Supervisor,
    decide,
    note_death,
)

POLICY = RestartPolicy(first_backoff_s=1.0, max_backoff_s=4.0, stable_after_s=30.0)


def test_backoff_doubles_up_to_the_cap():
    assert [POLICY.backoff(n) for n in (1, 2, 3, 4, 5)] == [1.0, 2.0, 4.0, 4.0, 4.0]


def test_a_dead_service_waits_out_its_backoff_then_restarts():
    record = Record(started_at=0.0)
    note_death(POLICY, record, now=5.0)
    assert record.fast_failures == 1
    assert decide(POLICY, record, now=5.5) == "wait"
    assert decide(POLICY, record, now=6.0) == "restart"


def test_repeated_fast_failures_give_up_and_a_stable_run_resets_the_count():
    record = Record(started_at=0.0)
    now = 0.0
    for _ in range(POLICY.max_fast_failures):
        now += 1.0
        note_death(POLICY, record, now)
        assert decide(POLICY, record, now + 10) == "restart"
        record.started_at, record.died_at = now + 10, None
        now += 10
    note_death(POLICY, record, now + 1)
    assert decide(POLICY, record, now + 100) == "give_up"

    stable = Record(started_at=0.0, fast_failures=POLICY.max_fast_failures)
    note_death(POLICY, stable, now=POLICY.stable_after_s + 1)
    assert stable.fast_failures == 1


def _proc(tmp_path: Path, name: str, code: str) -> ChildProcess:
    return ChildProcess(
        name, [sys.executable, "-c", code], env={}, log_path=tmp_path / f"{name}.log"
    ).start()


def test_a_killed_process_is_restarted_with_a_new_pid(tmp_path: Path):
    proc = _proc(tmp_path, "sleeper", "import time; time.sleep(60)")
    supervisor = Supervisor(RestartPolicy(first_backoff_s=0.0))
    supervisor.watch(proc)
    first = proc.pid
    try:
        proc.kill()
        assert supervisor.poll([proc]) == ["sleeper"]
        assert proc.alive() and proc.pid != first
        assert supervisor.records["sleeper"].restarts == 1
    finally:
        proc.stop()


def test_a_process_that_dies_at_start_is_given_up_with_its_log(tmp_path: Path):
    proc = _proc(tmp_path, "broken", "import sys; print('bad config: port'); sys.exit(3)")
    supervisor = Supervisor(RestartPolicy(first_backoff_s=0.0, max_fast_failures=2))
    supervisor.watch(proc)
    with pytest.raises(GaveUp, match="broken failed 3 times") as info:
        for _ in range(50):
            wait_until(lambda: not proc.alive(), timeout=10)
            supervisor.poll([proc])
            time.sleep(0.01)
    assert "bad config: port" in str(info.value)


def test_a_configuration_error_is_given_up_at_once_in_one_line(tmp_path: Path):
    code = f"import sys; print('Traceback ...'); print('ModelLoadError: no model'); sys.exit({CONFIG_EXIT})"
    proc = _proc(tmp_path, "worker", code)
    supervisor = Supervisor(RestartPolicy(first_backoff_s=0.0))
    supervisor.watch(proc)
    assert wait_until(lambda: not proc.alive(), timeout=10)
    with pytest.raises(GaveUp) as info:
        supervisor.poll([proc])
    assert info.value.config and supervisor.records["worker"].restarts == 0
    message = str(info.value)
    assert message == f"worker cannot start: ModelLoadError: no model (log: {proc.log_path})"


def test_only_a_configuration_exit_is_given_up_on_its_first_death():
    assert (
        decide(POLICY, Record(started_at=0.0, died_at=1.0, exit_code=CONFIG_EXIT), 1.0) == "give_up"
    )
    assert decide(POLICY, Record(started_at=0.0, died_at=1.0, exit_code=1), 100.0) == "restart"


def test_an_optional_service_that_keeps_failing_is_left_down_not_raised(tmp_path: Path):
    proc = _proc(tmp_path, "kvcache", "import sys; print('port taken'); sys.exit(1)")
    supervisor = Supervisor(
        RestartPolicy(first_backoff_s=0.0, max_fast_failures=1), optional=frozenset({"kvcache"})
    )
    supervisor.watch(proc)
    for _ in range(50):
        wait_until(lambda: not proc.alive(), timeout=10)
        supervisor.poll([proc])
        if "kvcache" in supervisor.down:
            break
    assert supervisor.down["kvcache"].startswith("kvcache failed 2 times in a row")
    assert "port taken" in supervisor.down["kvcache"]
    restarts = supervisor.records["kvcache"].restarts
    assert supervisor.poll([proc]) == [] and supervisor.records["kvcache"].restarts == restarts
    assert not proc.alive()


def test_an_essential_service_beside_an_optional_one_still_stops_the_stack(tmp_path: Path):
    proc = _proc(tmp_path, "router", f"import sys; sys.exit({CONFIG_EXIT})")
    supervisor = Supervisor(RestartPolicy(first_backoff_s=0.0), optional=frozenset({"kvcache"}))
    supervisor.watch(proc)
    assert wait_until(lambda: not proc.alive(), timeout=10)
    with pytest.raises(GaveUp):
        supervisor.poll([proc])
    assert supervisor.down == {}
