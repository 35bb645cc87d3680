"""Internal gRPC (KV transfer, the KV-cache service) closed to strangers: a per-stack token
in every call's metadata, and TLS when certificates are configured.

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
    # PEM files. Server: cert + key; client: ca (the authority that signed the servers).
    tls_cert: str = ""
    tls_key: str = ""
    tls_ca: str = ""


def _bearer(token: str) -> str:
    return f"Bearer {token}"


class RequireToken(grpc.aio.ServerInterceptor):
    """Refuses (UNAUTHENTICATED) any call whose metadata lacks the stack's token."""

    def __init__(self, token: str) -> None:
        self._expected = _bearer(token)

    async def intercept_service(
        self, continuation: Callable[..., Any], details: grpc.HandlerCallDetails
    ) -> Any:
        given = dict(details.invocation_metadata or ()).get(METADATA_KEY, "")
        if isinstance(given, str) and hmac.compare_digest(given, self._expected):
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


def server_interceptors(security: GrpcSecurity | None = None) -> list[grpc.aio.ServerInterceptor]:
    security = security or GrpcSecurity()
    return [RequireToken(security.token)] if security.token else []


def add_port(server: grpc.aio.Server, address: str, security: GrpcSecurity | None = None) -> int:
    """Bind `address`, with TLS when a certificate and key are configured."""
    security = security or GrpcSecurity()
    if security.tls_cert and security.tls_key:
        pair = (Path(security.tls_key).read_bytes(), Path(security.tls_cert).read_bytes())
        return server.add_secure_port(address, grpc.ssl_server_credentials([pair]))
    return server.add_insecure_port(address)


def open_channel(
    endpoint: str, options: list[tuple[str, Any]], security: GrpcSecurity | None = None
) -> grpc.aio.Channel:
    """A channel to `endpoint` that carries the stack's token (and TLS when a CA is set)."""
    security = security or GrpcSecurity()
    interceptors = client_interceptors(security.token) if security.token else None
    if security.tls_ca:
        credentials = grpc.ssl_channel_credentials(Path(security.tls_ca).read_bytes())
        return grpc.aio.secure_channel(
            endpoint, credentials, options=options, interceptors=interceptors
        )
    return grpc.aio.insecure_channel(endpoint, options=options, interceptors=interceptors)
