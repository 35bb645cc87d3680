"""What every generating route documents: its error answers in OpenAI's shape."""

from __future__ import annotations

from typing import Any

from tokenyard.api_errors import ErrorResponse

_ERRORS = {
    400: "Invalid request (bad value, empty or too long prompt, unsupported option)",
    401: "Missing or invalid API key",
    404: "Unknown model",
    422: "The body is not valid JSON",
    429: "Rate limit reached (see Retry-After)",
    503: "No worker can take the request now (see Retry-After)",
    504: "The request got no tokens in time",
    403: "Wrong admin token, or the admin API is disabled",
    409: "A limit of the adapter reached (max_lora_rank) or its name in use",
    507: "The workers hold as many LoRA adapters as they may (max_cpu_loras)",
}


def error_responses(*statuses: int) -> dict[int | str, dict[str, Any]]:
    return {s: {"model": ErrorResponse, "description": _ERRORS[s]} for s in statuses}


GENERATION_ERRORS = error_responses(400, 401, 404, 422, 429, 503, 504)


def sse_response(description: str) -> dict[int | str, dict[str, Any]]:
    """A 200 that is JSON, or with `stream: true` a text/event-stream of events."""
    return {
        200: {
            "description": description,
            "content": {
                # NOTE: openapi.build_openapi puts the event schema here
                "text/event-stream": {"schema": {"type": "string"}}
            },
        }
    }
