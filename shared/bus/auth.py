"""Who may say what on NATS: one user per service, each with the subjects it needs.

`tokenyard up` writes these into its nats-server's configuration, so an anonymous
connection is refused and a service that is compromised or buggy can only publish where
its role does:

    users = [router(), gateway("gw-1"), worker("decode", "decode-2"), facilities()]
    text = server_config(users, port=4222, store_dir="/var/lib/nats")

A new service gets its permissions by adding one function here (see `telemetry`).
Replies to requests go to the requester's inbox and are allowed by `allow_responses`.
Each user's inbox is its own, ``_INBOX.<user>.>`` (`inbox_prefix`; `Bus.connect` takes it
from the URL's user name): requests' answers and the prefill jobs JetStream hands a puller
travel there, and no other service user may read them.

Who may speak for a worker is bound to the subject: worker `w` may publish only
``heartbeat(role, w)`` and ``kv_events(w)``, and every reader takes the id from the subject
and drops a message whose payload names another (`subjects.heartbeat_sender`). JetStream
administration is split by owner: the gateway creates the prefill stream (and cannot
delete it); a worker creates, fetches from and deletes only its own consumer, whose filter
(the subject its jobs are pinned to) is part of the API subject it is allowed
(`$JS.API.CONSUMER.CREATE.<stream>.<name>.<filter>`); the router, which places jobs, places
a departed worker's jobs again (tokenyard.bus.orphans).

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
from dataclasses import dataclass, field
from urllib.parse import quote, urlsplit, urlunsplit

from tokenyard.bus import subjects

DEFAULT_INBOX_PREFIX = "_INBOX"  # nats-py's, for a connection without a user name
_JS = "$JS.API"
_STREAM = subjects.PREFILL_STREAM
# The prefill stream's owner (the gateway): make it, and again after it is lost; not delete
# or purge it (a deleted stream failed every chat while the gateway said it was ready).
PREFILL_STREAM_OWNER_API = [
    f"{_JS}.INFO",
    f"{_JS}.STREAM.CREATE.{_STREAM}",
    f"{_JS}.STREAM.UPDATE.{_STREAM}",
    f"{_JS}.STREAM.INFO.{_STREAM}",
]
DECODE_JOBS_ANY = subjects.decode_jobs("*")
PREFILL_CONSUMER_PREFIX = "prefill-"  # a prefill worker's durable consumer: prefill-<worker id>


def prefill_consumer(worker_id: str) -> str:
    return f"{PREFILL_CONSUMER_PREFIX}{worker_id}"


def inbox_prefix(user: str) -> str:
    """The inbox prefix a connection as `user` uses: ``_INBOX.<user>``."""
    if not user or any(c in user for c in ".*> \t"):
        raise ValueError(f"{user!r} cannot name a NATS inbox (one subject token, no wildcard)")
    return f"{DEFAULT_INBOX_PREFIX}.{user}"


def own_inbox(user: str) -> str:
    return f"{inbox_prefix(user)}.>"


def worker_prefill_api(worker_id: str) -> list[str]:
    """A prefill worker's JetStream API: wait for the stream, and make, read, fetch from,
    ack on and delete its own consumer only, filtered on its own jobs' subject."""
    # A pool (worker_id "*") may do so for a consumer of any name, on any worker's jobs.
    own = "*" if worker_id == "*" else prefill_consumer(worker_id)
    return [
        f"{_JS}.INFO",
        f"{_JS}.STREAM.INFO.{_STREAM}",
        f"{_JS}.CONSUMER.CREATE.{_STREAM}.{own}.{subjects.prefill_worker_jobs(worker_id)}",
        f"{_JS}.CONSUMER.INFO.{_STREAM}.{own}",
        f"{_JS}.CONSUMER.DELETE.{_STREAM}.{own}",
        f"{_JS}.CONSUMER.MSG.NEXT.{_STREAM}.{own}",
        f"$JS.ACK.{_STREAM}.{own}.>",
    ]


# The router places a departed worker's jobs again (tokenyard.bus.orphans): it reads, drains
# and deletes any worker's consumer, and publishes the jobs pinned to another worker.
ROUTER_PREFILL_API = [
    f"{_JS}.INFO",
    f"{_JS}.CONSUMER.LIST.{_STREAM}",
    f"{_JS}.CONSUMER.INFO.{_STREAM}.*",
    f"{_JS}.CONSUMER.MSG.NEXT.{_STREAM}.*",
    f"{_JS}.CONSUMER.DELETE.{_STREAM}.*",
    f"$JS.ACK.{_STREAM}.>",
    subjects.prefill_worker_jobs("*"),
    # It tells the request's gateway where it moved a job, which believes it only when its
    # own fleet view agrees (tokenyard.services.gateway.senders).
    subjects.moved("*", "*"),
]


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


def _service(
    name: str, publish: list[str], subscribe: list[str], *, replies: bool = False
) -> NatsUser:
    """A service's user: what it may publish and read, and its own inbox besides."""
    return NatsUser(name, publish, [*subscribe, own_inbox(name)], replies=replies)


def router() -> NatsUser:
    return _service(
        "router",
        publish=[
            subjects.telemetry_spans("router"),
            subjects.kv_resync("*"),
            subjects.lora("*"),  # a busy adapter loaded on a worker with room (lora_loads.py)
            *ROUTER_PREFILL_API,
        ],
        subscribe=[
            subjects.HEARTBEATS_ALL,
            subjects.KV_EVENTS_ALL,
            subjects.ROUTER_ROUTE,
            subjects.FACILITIES_STATE_ALL,
        ],
        replies=True,
    )


def gateway(gateway_id: str, *, name: str | None = None) -> NatsUser:
    """Asks the router, queues prefill jobs (and owns their stream), resumes decodes; reads
    the rack states and the tokens and cancels the requests of this gateway only (its own
    prefix: one gateway never sees another's)."""
    return _service(
        name or f"gateway-{gateway_id}",
        publish=[
            subjects.ROUTER_ROUTE,
            subjects.PREFILL_JOBS,
            f"{subjects.PREFILL_JOBS}.>",
            DECODE_JOBS_ANY,
            subjects.cancel(gateway_id, "*"),
            subjects.replay(gateway_id, "*"),
            subjects.lora("*"),  # its admin API's LoRA loads (services/worker/lora.py)
            subjects.telemetry_spans("gateway"),
            *PREFILL_STREAM_OWNER_API,
        ],
        # Rack states: its /ready says when every rack is drained (facilities).
        subscribe=[
            subjects.tokens(gateway_id, "*", "*"),
            subjects.moved(gateway_id, "*"),
            subjects.HEARTBEATS_ALL,
            subjects.FACILITIES_STATE_ALL,
        ],
    )


def worker(role: str, worker_id: str, *, name: str | None = None) -> NatsUser:
    """Publishes its own heartbeats and KV events, token chunks in its own name (the gateway
    takes them only for the requests it placed or handed to this worker), and hand-offs (and
    resumes) to other workers; reads its own decode jobs, KV resync requests
    and drains, and its own prefill consumer."""
    return _service(
        name or f"worker-{worker_id}",
        publish=[
            subjects.heartbeat(role, worker_id),
            subjects.kv_events(worker_id),
            subjects.tokens("*", "*", worker_id),
            DECODE_JOBS_ANY,
            subjects.telemetry_spans(worker_id),
            *worker_prefill_api(worker_id),
        ],
        subscribe=[
            subjects.decode_jobs(worker_id),
            subjects.kv_resync(worker_id),
            subjects.drain(worker_id),
            subjects.lora(worker_id),
            subjects.CANCEL_ALL,
            subjects.REPLAY_ALL,
            subjects.FACILITIES_STATE_ALL,
            subjects.HEARTBEATS_ALL,
        ],
        replies=True,
    )


def facilities() -> NatsUser:
    """The only publisher of rack states: a forged drain needs this user's password."""
    return _service(
        "facilities",
        publish=[subjects.FACILITIES_STATE_ALL, subjects.FACILITIES_READINGS_ALL],
        subscribe=[subjects.FACILITIES_READINGS_ALL, subjects.HEARTBEATS_ALL],
    )


def telemetry() -> NatsUser:
    """Reads what the fleet says about itself (spans included); publishes only the console's
    drain requests to workers (which carry the stack's control token: a worker refuses a
    drain without it)."""
    return _service(
        "telemetry",
        publish=[subjects.drain("*")],
        subscribe=[
            subjects.HEARTBEATS_ALL,
            subjects.KV_EVENTS_ALL,
            subjects.FACILITIES_STATE_ALL,
            subjects.FACILITIES_READINGS_ALL,
            f"{subjects.PREFIX}.telemetry.>",
        ],
    )


def pool(role: str) -> NatsUser:
    """Every worker of one role under one user (named after the role): what any of them
    may do, for a deployment that scales a pool without naming its workers first.

    NOTE: what is bound to one worker in `worker` is bound to the pool here: any member may
    send any member's heartbeats and KV events (of its role only), read any member's decode
    jobs, drains and inbox (``_INBOX.<role>.>``), and make a consumer for any member's
    prefill jobs. Other roles and services stay out of reach."""
    return worker(role, "*", name=role)


def gateway_pool() -> NatsUser:
    """Every gateway replica under one user `gateway`: each names itself at start
    (TOKENYARD_GATEWAY_INSTANCE_ID, random when unset), so the user reads any gateway's
    tokens and inbox; a deployment that needs gateways kept apart gives each its own
    `gateway(id)`."""
    return gateway("*", name="gateway")


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


# A worker's drain over NATS (subjects.drain) carries the token its WorkerControl gRPC API
# asks for (the operator's), as a NATS header.
CONTROL_TOKEN_HEADER = "Authorization"


def control_headers(token: str) -> dict[str, str]:
    return {CONTROL_TOKEN_HEADER: f"Bearer {token}"}


def control_token(headers: Mapping[str, str] | None) -> str:
    """The bearer token a control request over NATS shows, or ""."""
    given = (headers or {}).get(CONTROL_TOKEN_HEADER, "")
    return given[len("Bearer ") :] if given.startswith("Bearer ") else ""


def redact(url: str) -> str:
    """The URL without its password, for logs and messages."""
    parts = urlsplit(url)
    if parts.password is None:
        return url
    host = parts.netloc.rsplit("@", 1)[1]
    return urlunsplit(parts._replace(netloc=f"{parts.username}:***@{host}"))
