"""Every error leaves the gateway in OpenAI's shape: {"error": {message, type, param, code}}."""

from __future__ import annotations

import json
import logging

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from tokenyard.api_errors import ErrorDetail, ErrorResponse

log = logging.getLogger(__name__)

# OpenAI's `type` for each status the gateway answers with.
ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "not_found_error",
    405: "invalid_request_error",
    413: "invalid_request_error",
    422: "invalid_request_error",
    429: "rate_limit_error",
    500: "internal_server_error",
    503: "service_unavailable",
    504: "timeout_error",
}


class OpenAIError(Exception):
    """Raised anywhere in a request; the handler turns it into the JSON error body."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        param: str | None = None,
        code: str | None = None,
        retry_after_s: int | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.retry_after_s = retry_after_s

    @property
    def type(self) -> str:
        return ERROR_TYPES.get(self.status, "invalid_request_error")

    def body(self) -> ErrorResponse:
        detail = ErrorDetail(message=self.message, type=self.type, param=self.param, code=self.code)
        return ErrorResponse(error=detail)

    def response(self) -> JSONResponse:
        headers = {"Retry-After": str(self.retry_after_s)} if self.retry_after_s else None
        return JSONResponse(self.body().model_dump(), status_code=self.status, headers=headers)

    def sse(self) -> str:
        """The error as a final server-sent event (the stream's status line is already sent)."""
        return f"data: {json.dumps(self.body().model_dump())}\n\n"


def invalid(message: str, param: str | None = None, code: str | None = None) -> OpenAIError:
    return OpenAIError(400, message, param=param, code=code)


def from_validation(exc: RequestValidationError) -> OpenAIError:
    """FastAPI's validation errors, first one first, named by the field's dotted path."""
    errors = exc.errors()
    first = errors[0] if errors else {"loc": (), "msg": "invalid request", "type": ""}
    loc = [str(part) for part in first.get("loc", ()) if _is_field(part)]
    if first.get("type") == "json_invalid":
        # NOTE: 422 for a body that is not JSON at all; schema errors are 400 as OpenAI's.
        return OpenAIError(
            422, f"could not parse the JSON body: {first.get('msg')}", code="json_invalid"
        )
    param = ".".join(loc) or None
    where = f"'{param}': " if param else ""
    more = f" (and {len(errors) - 1} more)" if len(errors) > 1 else ""
    return OpenAIError(400, f"{where}{first.get('msg')}{more}", param=param, code="invalid_value")


# Pydantic names the member of a union it tried ("str", "list[str]", ...) in `loc`; not a field.
_UNION_TAGS = {"str", "int", "float", "bool", "dict", "list", "none"}


def _is_field(part: object) -> bool:
    if isinstance(part, int):
        return True
    text = str(part)
    return text != "body" and text.isidentifier() and text not in _UNION_TAGS


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(OpenAIError)
    async def _openai(_: Request, exc: OpenAIError) -> JSONResponse:
        return exc.response()

    @app.exception_handler(RequestValidationError)
    async def _validation(_: Request, exc: RequestValidationError) -> JSONResponse:
        return from_validation(exc).response()

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        message = exc.detail if exc.status_code != 404 else f"unknown route {request.url.path}"
        return OpenAIError(exc.status_code, str(message)).response()

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception) -> JSONResponse:
        log.exception("unexpected error on %s %s", request.method, request.url.path)
        return OpenAIError(500, f"internal error: {type(exc).__name__}").response()
