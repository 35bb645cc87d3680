"""Who may say what on NATS: one user per service, each with the subjects it needs.

`tokenyard up` writes these into its nats-server's configuration, so an anonymous
connection is refused and a service that is compromised or buggy can only publish where
its role does:

    users = [router(), gateway("gw-1"), worker("decode", "decode-2"), facilities()]
    text = server_config(users, port=4222, store_dir="/var/lib/nats")

A new service gets its permissions by adding one function here (see `telemetry`).
Replies to requests go to the requester's inbox and are allowed by `allow_responses`.
"""

from __future__ import annotations

import json
import secrets
from dataclasses import dataclass, field
from urllib.parse import quote, urlsplit, urlunsplit

from tokenyard.bus import subjects

INBOX = "_INBOX.>"
# JetStream's API for the prefill work queue only: not other streams, not the account.
PREFILL_JS_API = [
    "$JS.API.INFO",
    f"$JS.API.STREAM.*.{subjects.PREFILL_STREAM}",
    f"$JS.API.CONSUMER.*.{subjects.PREFILL_STREAM}",
    f"$JS.API.CONSUMER.*.{subjects.PREFILL_STREAM}.>",
    f"$JS.API.CONSUMER.DURABLE.CREATE.{subjects.PREFILL_STREAM}.>",
    f"$JS.API.CONSUMER.MSG.NEXT.{subjects.PREFILL_STREAM}.>",
]
PREFILL_JS_ACK = f"$JS.ACK.{subjects.PREFILL_STREAM}.>"
DECODE_JOBS_ANY = subjects.decode_jobs("*")


@dataclass(frozen=True)
class NatsUser:
    name: str
    publish: list[str]
    subscribe: list[str]
    password: str = field(default_factory=lambda: secrets.token_urlsafe(24), repr=False)
    replies: bool = False  # may answer requests sent to it (allow_responses)

    def url(self, server_url: str) -> str:
        """`server_url` with this user's credentials in it (nats-py reads them from there)."""
        parts = urlsplit(server_url)
        netloc = f"{quote(self.name, safe='')}:{quote(self.password, safe='')}@{parts.netloc}"
        return urlunsplit(parts._replace(netloc=netloc))


def router() -> NatsUser:
    return NatsUser(
        "router",
        publish=[subjects.telemetry_spans("router"), subjects.kv_resync("*")],
        subscribe=[
            subjects.HEARTBEATS_ALL,
            subjects.KV_EVENTS_ALL,
            subjects.ROUTER_ROUTE,
            subjects.FACILITIES_STATE_ALL,
            INBOX,
        ],
        replies=True,
    )


def gateway(gateway_id: str) -> NatsUser:
    """Asks the router, queues prefill jobs, resumes decodes; reads the tokens and cancels
    the requests of this gateway only (its own prefix: one gateway never sees another's)."""
    return NatsUser(
        f"gateway-{gateway_id}",
        publish=[
            subjects.ROUTER_ROUTE,
            subjects.PREFILL_JOBS,
            f"{subjects.PREFILL_JOBS}.>",
            DECODE_JOBS_ANY,
            subjects.cancel(gateway_id, "*"),
            subjects.telemetry_spans("gateway"),
            *PREFILL_JS_API,
        ],
        subscribe=[subjects.tokens(gateway_id, "*"), subjects.HEARTBEATS_ALL, INBOX],
    )


def worker(role: str, worker_id: str) -> NatsUser:
    """Publishes its own heartbeats and KV events, tokens of the requests it runs, and
    hand-offs (and resumes) to other workers; reads its own decode jobs, KV resync requests
    and the prefill queue."""
    return NatsUser(
        f"worker-{worker_id}",
        publish=[
            subjects.heartbeat(role, worker_id),
            subjects.kv_events(worker_id),
            subjects.tokens("*", "*"),
            DECODE_JOBS_ANY,
            PREFILL_JS_ACK,
            subjects.telemetry_spans(worker_id),
            *PREFILL_JS_API,
        ],
        subscribe=[
            subjects.decode_jobs(worker_id),
            subjects.kv_resync(worker_id),
            subjects.drain(worker_id),
            subjects.CANCEL_ALL,
            subjects.FACILITIES_STATE_ALL,
            subjects.HEARTBEATS_ALL,
            INBOX,
        ],
        replies=True,
    )


def facilities() -> NatsUser:
    """The only publisher of rack states: a forged drain needs this user's password."""
    return NatsUser(
        "facilities",
        publish=[subjects.FACILITIES_STATE_ALL, subjects.FACILITIES_READINGS_ALL],
        subscribe=[subjects.FACILITIES_READINGS_ALL, subjects.HEARTBEATS_ALL, INBOX],
    )


def telemetry() -> NatsUser:
    """Reads what the fleet says about itself (spans included); publishes only the console's
    drain requests to workers."""
    return NatsUser(
        "telemetry",
        publish=[subjects.drain("*")],
        subscribe=[
            subjects.HEARTBEATS_ALL,
            subjects.KV_EVENTS_ALL,
            subjects.FACILITIES_STATE_ALL,
            subjects.FACILITIES_READINGS_ALL,
            f"{subjects.PREFIX}.telemetry.>",
            INBOX,
        ],
    )


def operator() -> NatsUser:
    """Everything: for the person running the stack (and tests that play a service)."""
    return NatsUser("operator", publish=[">"], subscribe=[">"], replies=True)


def _user_block(user: NatsUser) -> dict:
    permissions: dict = {
        "publish": {"allow": user.publish or ["_NOTHING_"]},
        "subscribe": {"allow": user.subscribe or ["_NOTHING_"]},
    }
    if user.replies:
        permissions["allow_responses"] = True
    return {"user": user.name, "password": user.password, "permissions": permissions}


def server_config(users: list[NatsUser], *, host: str, port: int, store_dir: str) -> str:
    """A nats-server configuration (its format accepts JSON) with these users only."""
    names = [u.name for u in users]
    assert len(names) == len(set(names)), f"duplicate NATS users: {names}"
    config = {
        "listen": f"{host}:{port}",
        "jetstream": {"store_dir": store_dir},
        "authorization": {"users": [_user_block(u) for u in users]},
    }
    return json.dumps(config, indent=1)


def redact(url: str) -> str:
    """The URL without its password, for logs and messages."""
    parts = urlsplit(url)
    if parts.password is None:
        return url
    host = parts.netloc.rsplit("@", 1)[1]
    return urlunsplit(parts._replace(netloc=f"{parts.username}:***@{host}"))
