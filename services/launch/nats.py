"""A local stack's NATS: an embedded nats-server with a user per service (tokenyard.bus.auth),
or an external one, and the URL each service connects with."""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from tokenyard.bus import auth, subjects
from tokenyard.bus.embedded import free_port, nats_server_binary
from tokenyard.bus.nats import Bus, BusError
from tokenyard.services.launch.config import GATEWAY_ID, StackConfig, StackError
from tokenyard.services.launch.procs import ChildProcess

START_TIMEOUT_S = 10.0


class StackNats:
    def __init__(self, config: StackConfig, tmp: Path, log_dir: Path) -> None:
        self.config = config
        self._tmp = tmp
        self._log_dir = log_dir
        # For the operator and tests: every permission. Services get their own users.
        self.url = config.nats_url or ""
        self.users: list[auth.NatsUser] = []
        self._server_url = config.nats_url or ""
        self._conf: tuple[Path, int, str] = (Path(), 0, "")
        self._server: ChildProcess | None = None

    def launch(self, nice: int) -> ChildProcess:
        """Start the embedded server (wait for it with :meth:`wait_listening`)."""
        port = free_port()
        store = self._tmp / "jetstream"
        store.mkdir()
        argv = [nats_server_binary(), "-a", "127.0.0.1", "-p", str(port), "-js", "-sd", str(store)]
        if self.config.nats_auth:
            argv = [nats_server_binary(), "-c", str(self._write_config(port, store))]
        proc = ChildProcess("nats", argv, env={}, log_path=self._log_dir / "nats.log")
        proc.nice = nice
        proc.start()
        self._server = proc
        self._server_url = f"nats://127.0.0.1:{port}"
        return proc

    def wait_listening(self) -> None:
        assert self._server is not None
        port = int(self._server_url.rsplit(":", 1)[1])
        deadline = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < deadline:
            try:
                with socket.create_connection(("127.0.0.1", port), timeout=0.2):
                    return
            except OSError:
                if not self._server.alive():
                    break
                time.sleep(0.05)
        raise StackError(f"nats-server did not start:\n{self._server.log_tail()}")

    def make_prefill_stream(self) -> None:
        """Make the prefill job stream on the embedded server before any worker starts: a
        worker may not make it (tokenyard.bus.auth), and a stack without a gateway, its
        owner, would have none. On an external NATS the gateway makes it."""
        if self.config.nats_url:
            return
        # NOTE: in a thread of its own: start() may run inside a caller's event loop.
        with ThreadPoolExecutor(1) as pool:
            pool.submit(asyncio.run, _make_prefill_stream(self.url)).result()

    def _write_config(self, port: int, store: Path) -> Path:
        """The server's users, in a file a restarted nats-server reads again."""
        self.users = [
            auth.operator(),
            auth.router(),
            auth.gateway(GATEWAY_ID),
            auth.facilities(),
            auth.telemetry(),
        ]
        self._conf = (self._tmp / "nats.conf", port, str(store))
        self._rewrite_config()
        return self._conf[0]

    def _rewrite_config(self) -> None:
        path, port, store = self._conf
        text = auth.server_config(self.users, host="127.0.0.1", port=port, store_dir=store)
        path.touch(mode=0o600)
        path.write_text(text)

    def url_for(self, user: auth.NatsUser, pool: str | None = None) -> str:
        """The URL a service connects with: its user's credentials on the embedded server.
        A user the server does not know yet (a worker added later) is added, and the
        server reloads its configuration (SIGHUP) before the service starts.

        On an external NATS: the URL's own credentials when it has some, else the
        service's deployment user (a worker's is its `pool`) when its password is in the
        environment (`TOKENYARD_NATS_<USER>_PASSWORD`, `tokenyard nats-config`)."""
        if self.config.nats_url:
            try:
                return auth.credentials_from_env(
                    self.config.nats_url, pool or user.name, os.environ
                )
            except ValueError as exc:
                raise StackError(str(exc)) from exc
        if not self.config.nats_auth:
            return self._server_url
        known = {u.name: u for u in self.users}
        if user.name not in known:
            self.users.append(user)
            self._rewrite_config()
            assert self._server is not None
            self._server.signal(signal.SIGHUP)
            known[user.name] = user
        return known[user.name].url(self._server_url)


async def _make_prefill_stream(url: str) -> None:
    try:
        bus = await Bus.connect(url, name="tokenyard-up", first_connect_timeout=START_TIMEOUT_S)
    except BusError as exc:
        raise StackError(str(exc)) from exc
    try:
        await bus.ensure_work_queue(subjects.PREFILL_STREAM, subjects.PREFILL_SUBJECTS)
    except Exception as exc:  # nats raises several unrelated types here
        raise StackError(f"cannot make the prefill job stream: {exc}") from exc
    finally:
        await bus.close()
