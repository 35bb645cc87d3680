"""Errors in OpenAI's shape, {"error": {message, type, param, code}}, as the gateway answers."""

from __future__ import annotations

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException

from tokenyard.api_errors import ErrorDetail, ErrorResponse

ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    422: "invalid_request_error",
}


class ApiError(HTTPException):
    def __init__(
        self, status: int, message: str, *, code: str | None = None, param: str | None = None
    ) -> None:
        super().__init__(status, message)
        self.code = code
        self.param = param


def _response(
    status: int, message: str, code: str | None = None, param: str | None = None
) -> JSONResponse:
    detail = ErrorDetail(
        message=message, type=ERROR_TYPES.get(status, "api_error"), param=param, code=code
    )
    headers = {"WWW-Authenticate": "Bearer"} if status == 401 else None
    return JSONResponse(
        ErrorResponse(error=detail).model_dump(), status_code=status, headers=headers
    )


def install(app: FastAPI) -> None:
    @app.exception_handler(HTTPException)
    async def on_http(_request: Request, exc: HTTPException) -> JSONResponse:
        code = getattr(exc, "code", None)
        param = getattr(exc, "param", None)
        return _response(exc.status_code, str(exc.detail), code, param)

    @app.exception_handler(RequestValidationError)
    async def on_invalid(_request: Request, exc: RequestValidationError) -> JSONResponse:
        first = exc.errors()[0] if exc.errors() else {"msg": "invalid request", "loc": ()}
        param = ".".join(str(p) for p in first.get("loc", ()) if p != "body") or None
        return _response(422, str(first.get("msg")), "invalid_value", param)
