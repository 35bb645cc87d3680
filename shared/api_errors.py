"""The one HTTP error of every Tokenyard API (gateway, facilities, telemetry), in OpenAI's
shape: {"error": {message, type, param, code}}.

    install_error_handler(app, type_of)  # once, in create_app: type_of(404) -> "not_found_error"
    raise ApiError(404, "no rack named 'x'", code="rack_not_found", param="rack")

An API names an error's `type` from its status with its own table (`TypeOf`): each keeps the
names its clients already read. How it reports invalid bodies and unknown routes stays with
the service (its own handlers build an `ApiError` and render it here).
"""

from __future__ import annotations

import json
from collections.abc import Callable

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from pydantic import BaseModel

# An API's `type` for a status.
TypeOf = Callable[[int], str]

# OpenAI's `type` for each status the gateway answers with.
OPENAI_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    405: "invalid_request_error",
    413: "invalid_request_error",
    422: "invalid_request_error",
    429: "rate_limit_error",
    500: "internal_server_error",
    503: "service_unavailable",
    504: "timeout_error",
}


def openai_type(status: int) -> str:
    return OPENAI_TYPES.get(status, "invalid_request_error")


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(BaseModel):
    error: ErrorDetail


class ApiError(Exception):
    """Raised anywhere in a request; the app's handler turns it into the JSON error body."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        param: str | None = None,
        code: str | None = None,
        retry_after_s: int | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.retry_after_s = retry_after_s
        self.headers = dict(headers or {})
        if retry_after_s:
            self.headers["Retry-After"] = str(retry_after_s)

    @property
    def type(self) -> str:
        """The `type` under OpenAI's names (the gateway's); other APIs render their own."""
        return openai_type(self.status)

    def body(self, type_of: TypeOf = openai_type) -> ErrorResponse:
        detail = ErrorDetail(
            message=self.message, type=type_of(self.status), param=self.param, code=self.code
        )
        return ErrorResponse(error=detail)

    def response(self, type_of: TypeOf = openai_type) -> JSONResponse:
        return JSONResponse(
            self.body(type_of).model_dump(), status_code=self.status, headers=self.headers or None
        )

    def sse(self, type_of: TypeOf = openai_type) -> str:
        """The error as a final server-sent event (the stream's status line is already sent)."""
        return f"data: {json.dumps(self.body(type_of).model_dump())}\n\n"


def install_error_handler(app: FastAPI, type_of: TypeOf = openai_type) -> None:
    """Answer every `ApiError` raised in `app` with its body, `type` named by `type_of`."""

    @app.exception_handler(ApiError)
    async def _api_error(_: Request, exc: ApiError) -> JSONResponse:
        return exc.response(type_of)
