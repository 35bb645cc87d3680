"""Internal gRPC (KV transfer, the KV-cache service, the control APIs) closed to strangers:
a per-stack token in every call's metadata, and TLS (mutual, with a CA) when certificates
are configured.

    server = grpc.aio.server(options=..., interceptors=server_interceptors())
    port = add_port(server, "127.0.0.1:0")
    channel = open_channel("127.0.0.1:50070", options=...)

Settings come from TOKENYARD_GRPC_* (`tokenyard up` makes a fresh token per stack and gives
it to the workers and the KV-cache service only). No token configured = open, as before.
"""

from __future__ import annotations

import hmac
from collections.abc import Callable
from pathlib import Path
from typing import Any

import grpc
from pydantic_settings import BaseSettings, SettingsConfigDict

METADATA_KEY = "authorization"
# The internal services' largest message: KV blocks travel in chunks of up to half of it.
MAX_MESSAGE_BYTES = 64 << 20
GRPC_OPTIONS = [
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
]


class GrpcSecurity(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="TOKENYARD_GRPC_")

    token: str = ""
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

    @property
    def tls(self) -> bool:
        return bool(self.tls_cert and self.tls_key)


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


class RequireToken(grpc.aio.ServerInterceptor):
    """Refuses (UNAUTHENTICATED) any call whose metadata lacks the stack's token."""

    def __init__(self, token: str) -> None:
        self._expected = _bearer(token)

    async def intercept_service(
        self, continuation: Callable[..., Any], details: grpc.HandlerCallDetails
    ) -> Any:
        given = dict(details.invocation_metadata or ()).get(METADATA_KEY, "")
        if isinstance(given, str) and hmac.compare_digest(given.encode(), self._expected.encode()):
            return await continuation(details)
        handler = await continuation(details)
        return _refusal(handler) if handler is not None else None


def _refusal(handler: grpc.RpcMethodHandler) -> grpc.RpcMethodHandler:
    async def refuse(_request: object, context: grpc.aio.ServicerContext) -> None:
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, "missing or wrong stack token")

    if handler.request_streaming and handler.response_streaming:
        return grpc.stream_stream_rpc_method_handler(refuse)
    if handler.request_streaming:
        return grpc.stream_unary_rpc_method_handler(refuse)
    if handler.response_streaming:
        return grpc.unary_stream_rpc_method_handler(refuse)
    return grpc.unary_unary_rpc_method_handler(refuse)


class _AddToken:
    """Puts the stack's token into every call's metadata."""

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
    """The token check (when a token is configured), then the refusal of undecodable
    requests: every internal gRPC server takes these."""
    security = security or GrpcSecurity()
    token = [RequireToken(security.token)] if security.token else []
    return [*token, RejectUndecodable()]


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
    """A channel to `endpoint` that carries the stack's token (and TLS when a CA is set)."""
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
