"""Internal gRPC (KV transfer, the KV-cache service, the control APIs) closed to strangers:
each service presents a token of its own in every call's metadata, each server takes only
the identities that may call it (CALLERS), and TLS (mutual, with a CA) runs when
certificates are configured.

    server = grpc.aio.server(options=..., interceptors=server_interceptors())
    port = add_port(server, "127.0.0.1:0")
    channel = open_channel("127.0.0.1:50070", options=...)
    caller()   # inside a handler: the identity that called ("decode", "operator", ...)

Settings come from TOKENYARD_GRPC_*: ``token`` is what this process presents, ``peers`` the
identities its servers know, as SHA-256 digests of their tokens (so no server holds a
token it could call others with). `tokenyard up` makes a token per identity; `tokenyard
grpc-config` makes them for compose and Kubernetes. No peers and no token = open, as
before; a token without peers is refused at a server's start (it would be open).
"""

from __future__ import annotations

import contextvars
import hashlib
import hmac
import re
import secrets
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import grpc
from pydantic import field_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from tokenyard.fleet.roles import DECODE_ROLES, ROLES

METADATA_KEY = "authorization"
# The internal services' largest message: KV blocks travel in chunks of up to half of it.
MAX_MESSAGE_BYTES = 64 << 20
GRPC_OPTIONS = [
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
]

# Who calls internal gRPC: each worker pool as its role ("prefill", "decode", "both"), and
# the person running the stack (`tokenyard ctl`).
OPERATOR = "operator"
# The router asks the shared KV cache what it holds of a prompt (Contains) as it places it.
ROUTER = "router"
IDENTITIES: tuple[str, ...] = (*ROLES, ROUTER, OPERATOR)

# Which identities may call each internal service (full name); any other service is closed.
# KV moves from a prefill worker to a worker that decodes; every worker reads and writes the
# shared KV cache (decode workers prefill their own requests too), which the router asks
# what it holds; only the operator drains
# workers, clears the cache or touches racks.
CALLERS: dict[str, frozenset[str]] = {
    "tokenyard.v1.KVTransfer": DECODE_ROLES,
    "tokenyard.v1.KVCache": frozenset({*ROLES, ROUTER}),
    "tokenyard.v1.KVCacheAdmin": frozenset({OPERATOR}),
    "tokenyard.v1.WorkerControl": frozenset({OPERATOR}),
    "tokenyard.v1.FacilitiesControl": frozenset({OPERATOR}),
}
# Identities held to some methods of a service CALLERS opens to them: the router only asks.
ONLY_METHODS: dict[tuple[str, str], frozenset[str]] = {
    (ROUTER, "tokenyard.v1.KVCache"): frozenset({"Contains"}),
}


def allowed(identity: str | None, method: str) -> bool:
    """Whether `identity` may call `method` (``/tokenyard.v1.KVCache/Put`` or a service's
    full name, which asks about the service as a whole)."""
    service, _, name = method.lstrip("/").partition("/")
    if identity not in CALLERS.get(service, frozenset()):
        return False
    only = ONLY_METHODS.get((identity, service))
    return only is None or name in only


_PEER = re.compile(r"^([a-z][a-z0-9_-]{0,31}):([0-9a-f]{64})$")


def token_digest(token: str) -> str:
    """What a server keeps of a peer's token (tokens are random, so one SHA-256 is enough)."""
    return hashlib.sha256(token.encode()).hexdigest()


def parse_peers(text: str) -> dict[str, str]:
    """``name:sha256hex,name:sha256hex`` -> {name: digest}; ValueError names the bad entry."""
    peers: dict[str, str] = {}
    for entry in filter(None, (e.strip() for e in text.split(","))):
        match = _PEER.match(entry)
        if match is None:
            raise ValueError(f"{entry[:40]!r} is not <identity>:<64 hex digits of SHA-256>")
        name, digest = match.groups()
        if name in peers or digest in peers.values():
            raise ValueError(f"identity {name!r} or its token appears twice")
        peers[name] = digest
    return peers


def fresh_tokens(identities: tuple[str, ...] = IDENTITIES) -> dict[str, str]:
    """A new random token per identity."""
    return {name: secrets.token_urlsafe(24) for name in identities}


def peers_text(tokens: Mapping[str, str]) -> str:
    """The ``peers`` setting that lets servers recognise these tokens."""
    return ",".join(f"{name}:{token_digest(token)}" for name, token in tokens.items())


class GrpcConfigError(ValueError):
    """The gRPC settings cannot be served safely as they are."""


class GrpcSecurity(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="TOKENYARD_GRPC_")

    # What this process presents on every call it makes ("" = nothing).
    token: str = ""
    # The identities this process's servers recognise (parse_peers); "" = open servers.
    peers: str = ""
    # PEM files; empty = plaintext (the local default). One identity per process: a server
    # presents cert + key, and so does a client when it has them (mutual TLS).
    tls_cert: str = ""
    tls_key: str = ""
    # The authority that signed the stack's certificates. A client checks servers against
    # it; a server with it requires every client to show a certificate it signed (mTLS),
    # unless tls_client_auth is off.
    tls_ca: str = ""
    tls_client_auth: bool = True
    # The name a client expects in the server's certificate, when it is not the host it
    # dials (certificates naming a service rather than each pod's address).
    tls_server_name: str = ""

    @field_validator("peers")
    @classmethod
    def _valid_peers(cls, value: str) -> str:
        parse_peers(value)
        return value

    @property
    def tls(self) -> bool:
        return bool(self.tls_cert and self.tls_key)

    def peer_digests(self) -> dict[str, str]:
        return parse_peers(self.peers)

    def identify(self, token: str) -> str | None:
        """The identity whose token this is, or None."""
        return identify(self.peer_digests(), token)

    def may_call(self, token: str, service: str) -> bool:
        """Whether the holder of `token` may call `service` (a full name in CALLERS) as this
        process's servers judge it: open servers (no peers) let anyone."""
        peers = self.peer_digests()
        return not peers or allowed(identify(peers, token), service)


def identify(peers: Mapping[str, str], token: str) -> str | None:
    """The identity in ``peers`` (name -> token digest) that ``token`` belongs to, or None."""
    if not token:
        return None
    digest = token_digest(token)
    found = None
    for name, expected in peers.items():  # every entry compared: no early exit to time
        if hmac.compare_digest(digest, expected):
            found = name
    return found


def _bearer(token: str) -> str:
    return f"Bearer {token}"


def presented_token(metadata: object) -> str:
    """The bearer token in a call's metadata, or ""."""
    given = dict(metadata or ()).get(METADATA_KEY, "")  # type: ignore[call-overload]
    if not isinstance(given, str) or not given.startswith("Bearer "):
        return ""
    return given[len("Bearer ") :]


def token_matches(given: str, expected: str) -> bool:
    """Constant-time comparison; an empty expected token matches nothing."""
    return bool(expected) and hmac.compare_digest(given.encode(), expected.encode())


_caller: contextvars.ContextVar[str] = contextvars.ContextVar("tokenyard_grpc_caller", default="")


def caller() -> str:
    """Inside a gRPC handler: the identity that made the call ("" on an open server)."""
    return _caller.get()


def _method_name(method: str | bytes) -> str:
    return method.decode() if isinstance(method, bytes) else method


class RequireIdentity(grpc.aio.ServerInterceptor):
    """Refuses a call without a known token (UNAUTHENTICATED) and one whose identity may not
    call the service (PERMISSION_DENIED, CALLERS); a served call's handler sees caller()."""

    def __init__(self, peers: Mapping[str, str]) -> None:
        self._peers = dict(peers)

    async def intercept_service(
        self, continuation: Callable[..., Any], details: grpc.HandlerCallDetails
    ) -> Any:
        handler = await continuation(details)
        if handler is None:
            return None
        identity = identify(self._peers, presented_token(details.invocation_metadata))
        if identity is None:
            return _refusal(handler, grpc.StatusCode.UNAUTHENTICATED, "missing or unknown token")
        method = _method_name(details.method)
        if not allowed(identity, method):
            service = method.lstrip("/").split("/", 1)[0]
            # The service when it is closed to the identity, else the method it may not call.
            what = service if identity not in CALLERS.get(service, frozenset()) else method
            why = f"{identity!r} may not call {what}"
            return _refusal(handler, grpc.StatusCode.PERMISSION_DENIED, why)
        return _as_caller(handler, identity)


_HANDLER_KINDS = {
    (False, False): (grpc.unary_unary_rpc_method_handler, "unary_unary"),
    (False, True): (grpc.unary_stream_rpc_method_handler, "unary_stream"),
    (True, False): (grpc.stream_unary_rpc_method_handler, "stream_unary"),
    (True, True): (grpc.stream_stream_rpc_method_handler, "stream_stream"),
}


def _refusal(
    handler: grpc.RpcMethodHandler, code: grpc.StatusCode, message: str
) -> grpc.RpcMethodHandler:
    async def refuse(_request: object, context: grpc.aio.ServicerContext) -> None:
        await context.abort(code, message)

    make, _ = _HANDLER_KINDS[(handler.request_streaming, handler.response_streaming)]
    return make(refuse)


def _as_caller(handler: grpc.RpcMethodHandler, identity: str) -> grpc.RpcMethodHandler:
    """The same handler, run with caller() set to ``identity``."""
    make, attribute = _HANDLER_KINDS[(handler.request_streaming, handler.response_streaming)]
    inner = getattr(handler, attribute)
    if handler.response_streaming:

        async def streaming(request: Any, context: grpc.aio.ServicerContext) -> Any:
            _caller.set(identity)
            async for reply in inner(request, context):
                yield reply

        behaviour: Callable[..., Any] = streaming
    else:

        async def unary(request: Any, context: grpc.aio.ServicerContext) -> Any:
            _caller.set(identity)
            return await inner(request, context)

        behaviour = unary
    return make(behaviour, handler.request_deserializer, handler.response_serializer)


class _AddToken:
    """Puts this process's token into every call's metadata."""

    def __init__(self, token: str) -> None:
        self._pair = (METADATA_KEY, _bearer(token))

    def _details(self, details: grpc.aio.ClientCallDetails) -> grpc.aio.ClientCallDetails:
        metadata = grpc.aio.Metadata(*(details.metadata or ()), self._pair)
        return grpc.aio.ClientCallDetails(
            details.method, details.timeout, metadata, details.credentials, details.wait_for_ready
        )


# NOTE: one class per call kind: a channel files each interceptor under the first kind it
# matches, so one object implementing all four would only see unary-unary calls.
class _UnaryUnary(_AddToken, grpc.aio.UnaryUnaryClientInterceptor):
    async def intercept_unary_unary(self, continuation, details, request):  # type: ignore[no-untyped-def]
        return await continuation(self._details(details), request)


class _UnaryStream(_AddToken, grpc.aio.UnaryStreamClientInterceptor):
    async def intercept_unary_stream(self, continuation, details, request):  # type: ignore[no-untyped-def]
        return await continuation(self._details(details), request)


class _StreamUnary(_AddToken, grpc.aio.StreamUnaryClientInterceptor):
    async def intercept_stream_unary(self, continuation, details, request_iterator):  # type: ignore[no-untyped-def]
        return await continuation(self._details(details), request_iterator)


class _StreamStream(_AddToken, grpc.aio.StreamStreamClientInterceptor):
    async def intercept_stream_stream(self, continuation, details, request_iterator):  # type: ignore[no-untyped-def]
        return await continuation(self._details(details), request_iterator)


def client_interceptors(token: str) -> list[grpc.aio.ClientInterceptor]:
    kinds = (_UnaryUnary, _UnaryStream, _StreamUnary, _StreamStream)
    return [kind(token) for kind in kinds]


class _Undecodable:
    """What a request that is not the method's message decodes to (see RejectUndecodable)."""

    def __init__(self, error: Exception) -> None:
        self.error = error

    async def abort(self, context: grpc.aio.ServicerContext) -> None:
        await context.abort(
            grpc.StatusCode.INVALID_ARGUMENT, f"the request is not a valid message: {self.error}"
        )


def _lenient(deserializer: Callable[[bytes], Any] | None) -> Callable[[bytes], Any] | None:
    if deserializer is None:
        return None

    def decode(data: bytes) -> Any:
        try:
            return deserializer(data)
        except Exception as exc:  # protobuf's DecodeError, and whatever a custom one raises
            return _Undecodable(exc)

    return decode


class RejectUndecodable(grpc.aio.ServerInterceptor):
    """A request that does not parse as its method's message is refused with
    INVALID_ARGUMENT; without this, gRPC answers INTERNAL, as for a bug of ours."""

    async def intercept_service(
        self, continuation: Callable[..., Any], details: grpc.HandlerCallDetails
    ) -> Any:
        handler = await continuation(details)
        return None if handler is None else _checked(handler)


def _checked(handler: grpc.RpcMethodHandler) -> grpc.RpcMethodHandler:
    decode = _lenient(handler.request_deserializer)
    encode = handler.response_serializer
    if handler.request_streaming:

        async def requests(iterator: Any, context: grpc.aio.ServicerContext) -> Any:
            async for request in iterator:
                if isinstance(request, _Undecodable):
                    await request.abort(context)
                yield request

        if handler.response_streaming:
            inner_ss = handler.stream_stream

            async def stream_stream(iterator: Any, context: grpc.aio.ServicerContext) -> Any:
                async for reply in inner_ss(requests(iterator, context), context):
                    yield reply

            return grpc.stream_stream_rpc_method_handler(stream_stream, decode, encode)
        inner_su = handler.stream_unary

        async def stream_unary(iterator: Any, context: grpc.aio.ServicerContext) -> Any:
            return await inner_su(requests(iterator, context), context)

        return grpc.stream_unary_rpc_method_handler(stream_unary, decode, encode)
    if handler.response_streaming:
        inner_us = handler.unary_stream

        async def unary_stream(request: Any, context: grpc.aio.ServicerContext) -> Any:
            if isinstance(request, _Undecodable):
                await request.abort(context)
            async for reply in inner_us(request, context):
                yield reply

        return grpc.unary_stream_rpc_method_handler(unary_stream, decode, encode)
    inner_uu = handler.unary_unary

    async def unary_unary(request: Any, context: grpc.aio.ServicerContext) -> Any:
        if isinstance(request, _Undecodable):
            await request.abort(context)
        return await inner_uu(request, context)

    return grpc.unary_unary_rpc_method_handler(unary_unary, decode, encode)


def server_interceptors(security: GrpcSecurity | None = None) -> list[grpc.aio.ServerInterceptor]:
    """The identity check (when peers are configured), then the refusal of undecodable
    requests: every internal gRPC server takes these."""
    security = security or GrpcSecurity()
    peers = security.peer_digests()
    if security.token and not peers:
        raise GrpcConfigError(
            "TOKENYARD_GRPC_TOKEN is set but TOKENYARD_GRPC_PEERS is empty, so this server "
            "would take calls from anyone: set the peers (`tokenyard grpc-config`)"
        )
    identity = [RequireIdentity(peers)] if peers else []
    return [*identity, RejectUndecodable()]


def add_port(server: grpc.aio.Server, address: str, security: GrpcSecurity | None = None) -> int:
    """Bind `address`, with TLS when a certificate and key are configured (mutual TLS when
    a CA is configured too)."""
    security = security or GrpcSecurity()
    if not security.tls:
        return server.add_insecure_port(address)
    pair = (Path(security.tls_key).read_bytes(), Path(security.tls_cert).read_bytes())
    mutual = bool(security.tls_ca) and security.tls_client_auth
    credentials = grpc.ssl_server_credentials(
        [pair],
        root_certificates=Path(security.tls_ca).read_bytes() if mutual else None,
        require_client_auth=mutual,
    )
    return server.add_secure_port(address, credentials)


def open_channel(
    endpoint: str, options: list[tuple[str, Any]], security: GrpcSecurity | None = None
) -> grpc.aio.Channel:
    """A channel to `endpoint` whose calls carry this process's token (and TLS when a CA is
    set)."""
    security = security or GrpcSecurity()
    interceptors = client_interceptors(security.token) if security.token else None
    if not security.tls_ca:
        return grpc.aio.insecure_channel(endpoint, options=options, interceptors=interceptors)
    credentials = grpc.ssl_channel_credentials(
        root_certificates=Path(security.tls_ca).read_bytes(),
        private_key=Path(security.tls_key).read_bytes() if security.tls else None,
        certificate_chain=Path(security.tls_cert).read_bytes() if security.tls else None,
    )
    if security.tls_server_name:
        options = [*options, ("grpc.ssl_target_name_override", security.tls_server_name)]
    return grpc.aio.secure_channel(
        endpoint, credentials, options=options, interceptors=interceptors
    )
