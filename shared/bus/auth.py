"""Who may say what on NATS: one user per service, each with the subjects it needs.

`tokenyard up` writes these into its nats-server's configuration, so an anonymous
connection is refused and a service that is compromised or buggy can only publish where
its role does:

    users = [router(), gateway("gw-1"), worker("decode", "decode-2"), facilities()]
    text = server_config(users, port=4222, store_dir="/var/lib/nats")

A new service gets its permissions by adding one function here (see `telemetry`).
Replies to requests go to the requester's inbox and are allowed by `allow_responses`.

A deployment (compose, Kubernetes) cannot know its workers' ids in advance, so it has one
user per pool instead (`pool("decode")`), and its passwords are not in the file: the
server reads each from an environment variable (`deployment_config()`, written by
`tokenyard nats-config`).
"""

from __future__ import annotations

import json
import re
import secrets
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
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
    """Asks the router, queues prefill jobs, resumes decodes; reads the rack states and the
    tokens and cancels the requests of this gateway only (its own prefix: one gateway never sees another's)."""
    return NatsUser(
        f"gateway-{gateway_id}",
        publish=[
            subjects.ROUTER_ROUTE,
            subjects.PREFILL_JOBS,
            f"{subjects.PREFILL_JOBS}.>",
            DECODE_JOBS_ANY,
            subjects.cancel(gateway_id, "*"),
            subjects.replay(gateway_id, "*"),
            subjects.telemetry_spans("gateway"),
            *PREFILL_JS_API,
        ],
        # Rack states: its /ready says when every rack is drained (facilities).
        subscribe=[
            subjects.tokens(gateway_id, "*"),
            subjects.HEARTBEATS_ALL,
            subjects.FACILITIES_STATE_ALL,
            INBOX,
        ],
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
            subjects.REPLAY_ALL,
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


def pool(role: str) -> NatsUser:
    """Every worker of one role under one user (named after the role): what any of them
    may do, for a deployment that scales a pool without naming its workers first."""
    return replace(worker(role, "*"), name=role)


def gateway_pool() -> NatsUser:
    """Every gateway replica under one user `gateway`: each names itself at start
    (TOKENYARD_GATEWAY_INSTANCE_ID, random when unset), so the user reads any gateway's
    tokens; a deployment that needs gateways kept apart gives each its own `gateway(id)`."""
    return replace(gateway("*"), name="gateway")


def operator() -> NatsUser:
    """Everything: for the person running the stack (and tests that play a service)."""
    return NatsUser("operator", publish=[">"], subscribe=[">"], replies=True)


def deployment_users() -> list[NatsUser]:
    """The users of a compose or Kubernetes deployment: one per service, one per pool."""
    return [
        operator(),
        router(),
        gateway_pool(),
        pool("prefill"),
        pool("decode"),
        facilities(),
        telemetry(),
    ]


# nats-server parses an environment variable's value as it would a literal in its file: a
# leading digit makes a number, `true` a boolean. A letter first and no punctuation but
# `-` and `_` keeps a password a string (and needs no quoting in a URL).
PASSWORD = re.compile(r"[A-Za-z][A-Za-z0-9_-]{15,}")


def new_password() -> str:
    return "p" + secrets.token_hex(24)


def password_variable(name: str) -> str:
    """The environment variable a deployment keeps user `name`'s password in."""
    return f"TOKENYARD_NATS_{name.upper().replace('-', '_')}_PASSWORD"


def check_password(name: str, password: str) -> str:
    if not PASSWORD.fullmatch(password):
        raise ValueError(
            f"{name}: a NATS password must be 16 or more letters, digits, - or _, "
            "starting with a letter (nats-server reads anything else as another type)"
        )
    return password


def _user_block(user: NatsUser, password: str | None = None) -> dict:
    permissions: dict = {
        "publish": {"allow": user.publish or ["_NOTHING_"]},
        "subscribe": {"allow": user.subscribe or ["_NOTHING_"]},
    }
    if user.replies:
        permissions["allow_responses"] = True
    password = user.password if password is None else password
    return {"user": user.name, "password": password, "permissions": permissions}


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


def deployment_config(users: list[NatsUser]) -> str:
    """The `authorization` part of a nats-server configuration for these users, each
    password a reference to its environment variable (`password_variable`): the file holds
    no secret, and compose or Kubernetes set the variables from theirs."""
    marker = "@@password@@"
    blocks = [_user_block(u, f"{marker}{password_variable(u.name)}") for u in users]
    text = "authorization: " + json.dumps({"users": blocks}, indent=1)
    return re.sub(rf'"{marker}(\w+)"', r"$\1", text) + "\n"


def credentials_from_env(server_url: str, name: str, env: Mapping[str, str]) -> str:
    """The URL a service of a deployment connects with: the URL's own credentials when it
    has some, else user `name` with its password from `env` when set, else the URL as is."""
    if urlsplit(server_url).username is not None:
        return server_url
    variable = password_variable(name)
    password = env.get(variable)
    if not password:
        return server_url
    return NatsUser(name, [], [], password=check_password(variable, password)).url(server_url)


def redact(url: str) -> str:
    """The URL without its password, for logs and messages."""
    parts = urlsplit(url)
    if parts.password is None:
        return url
    host = parts.netloc.rsplit("@", 1)[1]
    return urlunsplit(parts._replace(netloc=f"{parts.username}:***@{host}"))
