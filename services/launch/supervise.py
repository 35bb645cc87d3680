"""Restart a crashed service with backoff; give up loudly when it keeps failing fast.

The policy is a pure function over one service's record, so tests script it with a clock:

    record = Record()
    decide(POLICY, record, now)  -> "wait" | "restart" | "give_up"

A run that lasted at least ``stable_after_s`` resets the count: a service that crashes
once a day is restarted every time, one that dies at start is given up after
``max_fast_failures`` tries (its log says why, and nothing would change by trying again).
A service that exits with CONFIG_EXIT (sysexits' EX_CONFIG: it cannot run as configured,
e.g. its model is missing) is given up at once: a restart would fail the same way.

Giving up on an essential service (NATS, the router, the gateway, a worker, Redis) stops
the stack: it cannot serve as asked. An optional one (the KV-cache service, telemetry,
facilities: the stack serves without them, only slower or less watched) is left down
instead and named in ``Supervisor.down``; the rest keeps serving.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Literal

from tokenyard.lifecycle import CONFIG_EXIT
from tokenyard.services.launch.procs import ChildProcess

log = logging.getLogger(__name__)

Action = Literal["wait", "restart", "give_up"]


@dataclass(frozen=True)
class RestartPolicy:
    first_backoff_s: float = 0.5
    max_backoff_s: float = 10.0
    stable_after_s: float = 30.0
    max_fast_failures: int = 5

    def backoff(self, fast_failures: int) -> float:
        return min(self.max_backoff_s, self.first_backoff_s * 2 ** max(0, fast_failures - 1))


@dataclass
class Record:
    """What the supervisor knows of one service between polls."""

    started_at: float = 0.0
    died_at: float | None = None  # set when a poll first sees it dead
    fast_failures: int = 0
    restarts: int = 0
    exit_code: int | None = None  # of the last death


def note_death(policy: RestartPolicy, record: Record, now: float) -> None:
    record.died_at = now
    ran_for = now - record.started_at
    record.fast_failures = 1 if ran_for >= policy.stable_after_s else record.fast_failures + 1


def decide(policy: RestartPolicy, record: Record, now: float) -> Action:
    assert record.died_at is not None, "decide() is for a dead service"
    if record.exit_code == CONFIG_EXIT or record.fast_failures > policy.max_fast_failures:
        return "give_up"
    if now - record.died_at < policy.backoff(record.fast_failures):
        return "wait"
    return "restart"


class GaveUp(RuntimeError):
    """A service failed fast too many times in a row, or could not run as configured; the
    message is one line: the service, the last line of its log (the reason) and the log."""

    def __init__(self, message: str, *, config: bool = False) -> None:
        super().__init__(message)
        self.config = config  # it exited with CONFIG_EXIT


class Supervisor:
    """Polled from the launcher's main thread (children are only ever started there: a
    child's PR_SET_PDEATHSIG follows the thread that started it)."""

    def __init__(
        self,
        policy: RestartPolicy | None = None,
        clock=time.monotonic,
        *,
        optional: frozenset[str] = frozenset(),
    ) -> None:
        self.policy = policy or RestartPolicy()
        self.clock = clock
        self.records: dict[str, Record] = {}
        self.optional = optional  # names given up on are left down, not raised
        self.down: dict[str, str] = {}  # optional services given up on: name -> why

    def watch(self, proc: ChildProcess) -> None:
        self.records[proc.name] = Record(started_at=self.clock())

    def poll(self, procs: list[ChildProcess]) -> list[str]:
        """Restart what is due; returns the names restarted. Raises GaveUp."""
        restarted = []
        for proc in procs:
            if proc.name in self.down:
                continue
            if not proc.alive() and self._handle_dead(proc):
                restarted.append(proc.name)
        return restarted

    def _handle_dead(self, proc: ChildProcess) -> bool:
        now = self.clock()
        record = self.records.setdefault(proc.name, Record(started_at=now))
        if record.died_at is None:
            note_death(self.policy, record, now)
            record.exit_code = proc.proc.returncode if proc.proc else None
            log.warning(
                "%s exited (code %s); restart %d", proc.name, record.exit_code, record.fast_failures
            )
        action = decide(self.policy, record, now)
        if action == "give_up":
            line = self._give_up_line(proc, record)
            if proc.name in self.optional:
                self.down[proc.name] = line
                log.error("%s; left down, the rest of the stack serves without it", line)
                return False
            raise GaveUp(line, config=record.exit_code == CONFIG_EXIT)
        if action == "wait":
            return False
        proc.start()
        record.started_at, record.died_at = now, None
        record.restarts += 1
        log.warning("%s restarted (pid %d)", proc.name, proc.pid)
        return True

    def _give_up_line(self, proc: ChildProcess, record: Record) -> str:
        reason = last_line(proc.log_tail(30)) or f"exit code {record.exit_code}"
        if record.exit_code == CONFIG_EXIT:
            return f"{proc.name} cannot start: {reason} (log: {proc.log_path})"
        return (
            f"{proc.name} failed {record.fast_failures} times in a row, each within "
            f"{self.policy.stable_after_s:.0f} s of starting; giving up: {reason} "
            f"(log: {proc.log_path})"
        )


def last_line(text: str) -> str:
    """The last non-empty line: a Python traceback's last line is the exception."""
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    return lines[-1] if lines else ""
