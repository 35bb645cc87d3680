"""Refuse a request body over the limit (413) before it is read into memory.

A declared Content-Length over the limit is refused at once; a chunked body is counted as
it arrives and refused at the first byte past the limit. Plain ASGI, like CountRequests,
so handlers still see their client disconnect.

NOTE: FastAPI answers any exception raised while it reads a body with its own 400 ("error
parsing the body"), so the app's answer to a body cut off here is dropped and replaced by
the 413, rather than relying on BodyTooLarge reaching this middleware.
"""

from __future__ import annotations

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from tokenyard.api_errors import ApiError


class BodyTooLarge(Exception):
    pass


def too_large(limit: int) -> ApiError:
    return ApiError(413, f"the request body is larger than {limit} bytes", code="request_too_large")


def declared_length(scope: Scope) -> int | None:
    for name, value in scope.get("headers", ()):
        if name == b"content-length":
            try:
                return int(value)
            except ValueError:
                return None
    return None


class LimitBody:
    def __init__(self, app: ASGIApp, max_bytes: int) -> None:
        self.app, self.max_bytes = app, max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        declared = declared_length(scope)
        if declared is not None and declared > self.max_bytes:
            return await self._refuse(scope, receive, send)
        seen = 0
        started = exceeded = False

        async def counted() -> Message:
            nonlocal seen, exceeded
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > self.max_bytes:
                    exceeded = True
                    raise BodyTooLarge()
            return message

        async def watch_start(message: Message) -> None:
            nonlocal started
            if exceeded and not started:
                return  # the app's answer to a body it could not read: the 413 replaces it
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, counted, watch_start)
        except Exception:
            if started or not exceeded:
                raise
        if exceeded and not started:
            await self._refuse(scope, receive, send)

    async def _refuse(self, scope: Scope, receive: Receive, send: Send) -> None:
        # NOTE: the connection is closed after this answer (h11 does so for an unread body).
        await too_large(self.max_bytes).response()(scope, receive, send)
