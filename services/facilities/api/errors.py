"""The facilities API's errors: the one ApiError (tokenyard.api_errors), with this API's own
`type` names, and invalid bodies as a 422 naming the field."""

from __future__ import annotations

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException

from tokenyard.api_errors import ApiError, install_error_handler

TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    422: "invalid_request_error",
}


def type_of(status: int) -> str:
    return TYPES.get(status, "api_error")


def install(app: FastAPI) -> None:
    install_error_handler(app, type_of)

    @app.exception_handler(HTTPException)
    async def on_http(_request: Request, exc: HTTPException) -> JSONResponse:
        return ApiError(exc.status_code, str(exc.detail)).response(type_of)

    @app.exception_handler(RequestValidationError)
    async def on_invalid(_request: Request, exc: RequestValidationError) -> JSONResponse:
        first = exc.errors()[0] if exc.errors() else {"msg": "invalid request", "loc": ()}
        param = ".".join(str(p) for p in first.get("loc", ()) if p != "body") or None
        error = ApiError(422, str(first.get("msg")), code="invalid_value", param=param)
        return error.response(type_of)
