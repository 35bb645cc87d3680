"""The OpenAPI document, made true where FastAPI's default is not.

FastAPI documents JSON bodies only: the SSE events of `stream: true` get their schema here,
and its default 422 body (HTTPValidationError) is replaced by OpenAI's error shape, which
is what the gateway really sends.
"""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi
from pydantic import BaseModel

from tokenyard.services.gateway.responses_api.schemas import ResponseStreamEvent
from tokenyard.services.gateway.schemas import ChatCompletionChunk, CompletionResponse

_REF = "#/components/schemas/{model}"
# The schema of each streaming route's events.
STREAM_EVENTS: dict[str, type[BaseModel]] = {
    "/v1/chat/completions": ChatCompletionChunk,
    "/v1/completions": CompletionResponse,
    "/v1/responses": ResponseStreamEvent,
}
# How each streaming route frames its events.
STREAM_FRAMING = {
    "/v1/responses": "`event: <type>` and `data: <event JSON>` per event; the last is "
    "response.completed, response.incomplete or response.failed",
}
_DATA_THEN_DONE = "`data: <event JSON>` lines, then `data: [DONE]`"


def _add_schema(schemas: dict[str, Any], model: type[BaseModel]) -> dict[str, str]:
    schema = model.model_json_schema(ref_template=_REF, mode="serialization")
    for name, sub in schema.pop("$defs", {}).items():
        schemas.setdefault(name, sub)
    schemas.setdefault(model.__name__, schema)
    return {"$ref": _REF.format(model=model.__name__)}


def build_openapi(app: FastAPI) -> dict[str, Any]:
    doc = get_openapi(
        title=app.title, version=app.version, description=app.description, routes=app.routes
    )
    schemas = doc.setdefault("components", {}).setdefault("schemas", {})
    error_ref = {"$ref": _REF.format(model="ErrorResponse")}
    for path, item in doc["paths"].items():
        for operation in item.values():
            responses = operation.get("responses", {})
            if "422" in responses:
                responses["422"]["content"] = {"application/json": {"schema": error_ref}}
                responses["422"]["description"] = "The body is not valid JSON"
            stream = responses.get("200", {}).get("content", {}).get("text/event-stream")
            if stream is not None and path in STREAM_EVENTS:
                stream["schema"] = _add_schema(schemas, STREAM_EVENTS[path])
                stream["description"] = STREAM_FRAMING.get(path, _DATA_THEN_DONE)
    for unused in ("HTTPValidationError", "ValidationError"):
        schemas.pop(unused, None)
    return doc


def install_openapi(app: FastAPI) -> None:
    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            app.openapi_schema = build_openapi(app)
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]
