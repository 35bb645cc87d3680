"""Typed NATS: protobuf in, protobuf out, trace context in the headers.

    bus = await Bus.connect(url, name="router")
    await bus.publish(subjects.cancel(rid), Cancel(request_id=rid))
    reply = await bus.request(subjects.ROUTER_ROUTE, req, RouteReply, timeout=2.0)
    await bus.subscribe(subjects.HEARTBEATS_ALL, WorkerHeartbeat, on_heartbeat)

Handlers receive ``(message, msg)``; ``msg`` is the raw nats Msg (reply, headers, ack).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from typing import TypeVar
from urllib.parse import unquote, urlsplit

import nats
from google.protobuf.message import DecodeError, Message
from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription
from nats.js import JetStreamContext
from nats.js.api import RetentionPolicy, StreamConfig
from nats.js.errors import BadRequestError, NotFoundError

from tokenyard.bus.auth import DEFAULT_INBOX_PREFIX, inbox_prefix, redact
from tokenyard.tracing import extract_context, inject_headers

log = logging.getLogger(__name__)

M = TypeVar("M", bound=Message)
Handler = Callable[[M, Msg], Awaitable[None]]


class BusError(Exception):
    pass


class Bus:
    def __init__(self, nc: Client) -> None:
        self.nc = nc
        self.js: JetStreamContext = nc.jetstream()

    @classmethod
    async def connect(
        cls,
        url: str,
        *,
        name: str,
        connect_timeout: float = 5.0,
        first_connect_timeout: float = 15.0,
    ) -> Bus:
        """Connect, reconnecting forever once up; a first connect that cannot succeed within
        `first_connect_timeout` raises BusError (nats-py would otherwise retry it forever and a
        service pointed at a wrong URL would hang at start).

        Replies (and JetStream's deliveries to a puller) come to the inbox of the URL's user,
        ``_INBOX.<user>``: the only inbox its permissions let it read (tokenyard.bus.auth)."""
        try:
            prefix = connection_inbox_prefix(url)
        except ValueError as exc:
            raise BusError(f"cannot connect to NATS at {redact(url)}: {exc}") from None
        try:
            nc = await asyncio.wait_for(
                nats.connect(
                    url,
                    name=name,
                    connect_timeout=connect_timeout,
                    max_reconnect_attempts=-1,
                    reconnect_time_wait=0.5,
                    inbox_prefix=prefix,
                ),
                first_connect_timeout,
            )
        except TimeoutError:
            raise BusError(
                f"cannot connect to NATS at {redact(url)} within {first_connect_timeout:.0f} s"
            ) from None
        except Exception as exc:  # nats raises several unrelated types here
            raise BusError(f"cannot connect to NATS at {redact(url)}: {exc}") from exc
        return cls(nc)

    async def close(self) -> None:
        if not self.nc.is_closed:
            await self.nc.drain()

    async def sync(self, timeout: float = 10.0) -> None:
        """Return once the server has processed everything this connection sent so far (a
        subscription made before is then live for every other client's publish).

        nats-py's flush() alone does not promise that: it writes its PING straight to the
        socket, ahead of commands still in the client's pending buffer (nats-py 2.16), so
        under load the PONG could come back before a SUB just made had left the process,
        and a publish from another connection then reached nobody (one loss in fifteen
        with two cores busy). Wait for the buffer to go out first."""
        deadline = time.monotonic() + timeout
        while self.nc.pending_data_size and self.nc.is_connected and time.monotonic() < deadline:
            await asyncio.sleep(0.001)
        await self.nc.flush(timeout=max(1, int(deadline - time.monotonic())))

    async def publish(
        self, subject: str, message: Message, headers: dict[str, str] | None = None
    ) -> None:
        await self.nc.publish(subject, message.SerializeToString(), headers=inject_headers(headers))

    async def request(
        self,
        subject: str,
        message: Message,
        reply_type: type[M],
        *,
        timeout: float,
        headers: dict[str, str] | None = None,
    ) -> M:
        msg = await self.nc.request(
            subject, message.SerializeToString(), timeout=timeout, headers=inject_headers(headers)
        )
        return parse(reply_type, msg.data)

    async def reply(self, msg: Msg, message: Message) -> None:
        if msg.reply:
            await self.nc.publish(msg.reply, message.SerializeToString(), headers=inject_headers())

    async def subscribe(
        self, subject: str, message_type: type[M], handler: Handler[M], *, queue: str = ""
    ) -> Subscription:
        async def on_msg(msg: Msg) -> None:
            try:
                message = parse(message_type, msg.data)
            except BusError:
                log.warning("dropping undecodable %s on %s", message_type.__name__, msg.subject)
                return
            try:
                from opentelemetry import context

                token = context.attach(extract_context(msg.headers))
                try:
                    await handler(message, msg)
                finally:
                    context.detach(token)
            except Exception:
                # NOTE: one bad message must not kill the subscription; the handler owns replies.
                log.exception("handler for %s failed", msg.subject)

        return await self.nc.subscribe(subject, queue=queue, cb=on_msg)

    # --- JetStream: work that must not be lost ---------------------------------------------

    async def ensure_work_queue(
        self, stream: str, subjects: list[str], *, max_age_s: float = 600, replicas: int = 1
    ) -> None:
        """Create (or update) a work-queue stream: each message is delivered to one consumer.

        ``replicas``: copies kept on as many NATS cluster nodes (3 survives losing one);
        every process that ensures the stream must ask for the same number."""
        config = StreamConfig(
            name=stream,
            subjects=subjects,
            retention=RetentionPolicy.WORK_QUEUE,
            max_age=max_age_s,
            num_replicas=replicas,
        )
        try:
            await self.js.add_stream(config)
        except BadRequestError:
            await self.js.update_stream(config)

    async def stream_exists(self, stream: str) -> bool:
        """Whether JetStream has `stream` now (raises when JetStream does not answer)."""
        try:
            await self.js.stream_info(stream)
        except NotFoundError:
            return False
        return True

    async def js_publish(
        self, subject: str, message: Message, *, msg_id: str | None = None
    ) -> None:
        headers = inject_headers({"Nats-Msg-Id": msg_id} if msg_id else None)
        await self.js.publish(subject, message.SerializeToString(), headers=headers)


def connection_inbox_prefix(url: str) -> str:
    """The inbox prefix for a connection to `url` (several servers: comma-separated): its
    user's own, or nats-py's default for a connection without a user."""
    for server in url.split(","):
        user = urlsplit(server.strip()).username
        if user:
            return inbox_prefix(unquote(user))
    return DEFAULT_INBOX_PREFIX


def parse(message_type: type[M], data: bytes) -> M:
    message = message_type()
    try:
        message.ParseFromString(data)
    except DecodeError as exc:
        raise BusError(f"undecodable {message_type.__name__}: {exc}") from exc
    return message
