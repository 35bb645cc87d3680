"""Child processes that cannot outlive their parent.

Each child runs in its own process group (so stopping it also stops anything it started)
and asks the kernel to SIGTERM it when its parent dies (PR_SET_PDEATHSIG), so even a
`kill -9` of `tokenyard up` or of a test run leaves no orphans behind.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import subprocess
import sys
import time
from collections.abc import Mapping
from pathlib import Path

PR_SET_PDEATHSIG = 1


def _in_child(parent_pid: int, nice: int) -> None:
    """Runs in the child between fork and exec: die with the parent, lower the priority."""
    with contextlib.suppress(OSError, AttributeError):
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
    if os.getppid() != parent_pid:  # the parent died before prctl took effect
        os._exit(1)
    if nice:
        os.nice(nice)


class ChildProcess:
    """One service process: started with its env, logs to a file, stopped with its group."""

    def __init__(
        self,
        name: str,
        argv: list[str],
        *,
        env: Mapping[str, str],
        log_path: Path | None,
        inherit_env: bool = True,  # False: the child sees `env` and nothing else
    ) -> None:
        self.name = name
        self.argv = argv
        self.env = dict(env)
        self.inherit_env = inherit_env
        self.log_path = log_path
        self.proc: subprocess.Popen[bytes] | None = None
        self.nice = 0  # added to the child's niceness (a restart keeps it)

    @classmethod
    def python_module(
        cls, name: str, module: str, *args: str, env: Mapping[str, str], log_path: Path | None
    ) -> ChildProcess:
        return cls(name, [sys.executable, "-m", module, *args], env=env, log_path=log_path)

    def start(self) -> ChildProcess:
        out = open(self.log_path, "ab") if self.log_path else None  # noqa: SIM115 - the child owns it
        parent, nice = os.getpid(), self.nice
        try:
            self.proc = subprocess.Popen(
                self.argv,
                env={**os.environ, **self.env} if self.inherit_env else self.env,
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=subprocess.STDOUT if out else None,
                start_new_session=True,
                preexec_fn=lambda: _in_child(parent, nice),  # noqa: PLW1509 - no threads start children
            )
        finally:
            if out:
                out.close()
        return self

    @property
    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def signal(self, sig: int) -> None:
        if self.alive():
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.pid, sig)

    def stop(self, timeout: float = 10.0) -> int | None:
        """SIGTERM the group, wait, then SIGKILL it; returns the exit code."""
        if self.proc is None:
            return None
        self.signal(signal.SIGTERM)
        try:
            self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.kill()
        # The leader is gone; anything left in its group goes too.
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.pid, signal.SIGKILL)
        return self.proc.returncode

    def kill(self) -> None:
        """SIGKILL, no grace (tests use this to play a crash)."""
        if self.proc is None:
            return
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.pid, signal.SIGKILL)
        self.proc.wait()

    def log_tail(self, n: int = 40) -> str:
        if not self.log_path or not self.log_path.exists():
            return ""
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-n:])


def wait_until(predicate, timeout: float, interval: float = 0.1) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(interval)
    return bool(predicate())
