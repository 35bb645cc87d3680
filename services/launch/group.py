"""A local stack's processes: started, watched, restarted when they die (supervise.py's
policy), described when something failed, and stopped in order."""

from __future__ import annotations

import importlib.util
from pathlib import Path

from tokenyard.services.launch.config import ConfigError, StackError
from tokenyard.services.launch.procs import ChildProcess
from tokenyard.services.launch.supervise import GaveUp, RestartPolicy, Supervisor


def require_module(module: str) -> None:
    """Raise StackError unless `python -m module` can run in this environment."""
    try:
        found = importlib.util.find_spec(f"{module}.__main__") is not None
    except ModuleNotFoundError:
        found = False
    if not found:
        raise StackError(f"{module} is not installed here: reinstall tokenyard (make setup)")


class ServiceGroup:
    def __init__(
        self, policy: RestartPolicy, log_dir: Path, *, optional: frozenset[str] = frozenset()
    ) -> None:
        self.log_dir = log_dir
        self.procs: list[ChildProcess] = []
        self.supervisor = Supervisor(policy, optional=optional)
        self.retired: set[str] = set()  # stopping on purpose: not restarted, still stopped

    @property
    def down(self) -> dict[str, str]:
        """Optional services given up on (name -> why): left down while the rest serves."""
        return self.supervisor.down

    def spawn(self, name: str, module: str, env: dict[str, str], *, nice: int) -> ChildProcess:
        """Start ``python -m module`` as service ``name``, logging to ``<log_dir>/<name>.log``."""
        require_module(module)
        proc = ChildProcess.python_module(
            name, module, env=env, log_path=self.log_dir / f"{name}.log"
        )
        proc.nice = nice
        proc.start()
        self.watch(proc)
        return proc

    def watch(self, proc: ChildProcess) -> None:
        """Stop it with the others, restart it when it dies."""
        self.procs.append(proc)
        self.supervisor.watch(proc)

    def retire(self, proc: ChildProcess) -> None:
        """Stop restarting `proc`: it is being stopped on purpose (it is still stopped with
        the others if it outlives its own stop)."""
        self.retired.add(proc.name)

    def check_alive(self) -> None:
        dead = [
            p
            for p in self.procs
            if not p.alive() and p.name not in self.down and p.name not in self.retired
        ]
        if dead:
            raise StackError(
                f"{', '.join(p.name for p in dead)} exited\n{self.describe_failures()}"
            )

    def supervise(self) -> list[str]:
        """Restart any service that died (NATS on its port and JetStream directory, so
        streams and consumers survive); returns the names restarted. A service that keeps
        failing right after its start is a StackError, one that cannot run as configured a
        ConfigError; either names the reason and the log. An optional service is left
        down instead (``down``)."""
        try:
            return self.supervisor.poll([p for p in self.procs if p.name not in self.retired])
        except GaveUp as exc:
            raise (ConfigError if exc.config else StackError)(str(exc)) from None

    def describe_failures(self) -> str:
        parts = []
        for p in self.procs:
            state = "running" if p.alive() else f"exited {p.proc.returncode if p.proc else '?'}"
            parts.append(f"--- {p.name} ({state}), {p.log_path}:\n{p.log_tail(15)}")
        return "\n".join(parts)

    def stop(self) -> None:
        """Services first (they drain to NATS), NATS last."""
        services = [p for p in self.procs if p.name != "nats"]
        for p in services:
            p.signal(15)
        for p in reversed(services):
            p.stop(timeout=20)
        for p in self.procs:
            p.stop()
