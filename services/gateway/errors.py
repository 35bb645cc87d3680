"""Every error leaves the gateway in OpenAI's shape (tokenyard.api_errors): invalid bodies
named by their field, unknown routes, and anything unexpected as a 500."""

from __future__ import annotations

import logging

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from tokenyard.api_errors import ApiError, install_error_handler

log = logging.getLogger(__name__)


def invalid(message: str, param: str | None = None, code: str | None = None) -> ApiError:
    return ApiError(400, message, param=param, code=code)


def from_validation(exc: RequestValidationError) -> ApiError:
    """FastAPI's validation errors, first one first, named by the field's dotted path."""
    errors = exc.errors()
    first = errors[0] if errors else {"loc": (), "msg": "invalid request", "type": ""}
    loc = [str(part) for part in first.get("loc", ()) if _is_field(part)]
    if first.get("type") == "json_invalid":
        # NOTE: 422 for a body that is not JSON at all; schema errors are 400 as OpenAI's.
        return ApiError(
            422, f"could not parse the JSON body: {first.get('msg')}", code="json_invalid"
        )
    param = ".".join(loc) or None
    where = f"'{param}': " if param else ""
    more = f" (and {len(errors) - 1} more)" if len(errors) > 1 else ""
    if first.get("type") == "extra_forbidden":  # a body that refuses what it cannot honour
        return ApiError(
            400, f"{where}not supported by this server{more}", param=param, code="unsupported_field"
        )
    return ApiError(400, f"{where}{first.get('msg')}{more}", param=param, code="invalid_value")


# Pydantic names the member of a union it tried ("str", "list[str]", ...) in `loc`; not a field.
_UNION_TAGS = {"str", "int", "float", "bool", "dict", "list", "none"}


def _is_field(part: object) -> bool:
    if isinstance(part, int):
        return True
    text = str(part)
    return text != "body" and text.isidentifier() and text not in _UNION_TAGS


def install_error_handlers(app: FastAPI) -> None:
    install_error_handler(app)

    @app.exception_handler(RequestValidationError)
    async def _validation(_: Request, exc: RequestValidationError) -> JSONResponse:
        return from_validation(exc).response()

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        message = exc.detail if exc.status_code != 404 else f"unknown route {request.url.path}"
        return ApiError(exc.status_code, str(message)).response()

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception) -> JSONResponse:
        log.exception("unexpected error on %s %s", request.method, request.url.path)
        return ApiError(500, f"internal error: {type(exc).__name__}").response()
