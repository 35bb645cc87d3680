"""A Responses request (and the stored conversation it continues) -> one chat request ->
`Prepared`, through the chat path's own checks. Pure: no network, no app state.

Items are kept as plain dicts in the Responses shape: the same dicts are stored, sent back
by clients as input, and read here.
"""

from __future__ import annotations

from typing import Any

from pydantic import ValidationError

from tokenyard.api_errors import ApiError
from tokenyard.services.gateway.errors import invalid
from tokenyard.services.gateway.parsers import Parsers
from tokenyard.services.gateway.responses_api.schemas import (
    FormatJsonObject,
    FormatJsonSchema,
    FunctionChoice,
    ResponsesRequest,
)
from tokenyard.services.gateway.schemas import ChatCompletionRequest
from tokenyard.services.gateway.translate import Prepared, Tokenizer, prepare_chat

# The chat request's fields, as this API names them (for error messages).
_FIELDS = {
    "messages": "input",
    "max_completion_tokens": "max_output_tokens",
    "max_tokens": "max_output_tokens",
    "response_format": "text.format",
}


def input_items(request: ResponsesRequest) -> list[dict[str, Any]]:
    """The request's new input as items (a string is one user message)."""
    if request.input is None:
        return []
    if isinstance(request.input, str):
        return [{"type": "message", "role": "user", "content": request.input}]
    return [item.model_dump(exclude_none=True) for item in request.input]


def item_text(content: str | list[dict[str, Any]]) -> str:
    if isinstance(content, str):
        return content
    return "".join(part.get("text", "") for part in content)


def chat_messages(items: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Items -> chat messages: a function call joins the assistant message before it (or
    starts one); its output is a `tool` message answering its call id."""
    messages: list[dict[str, Any]] = []
    called: set[str] = set()
    for i, item in enumerate(items):
        kind = item.get("type", "message")
        if kind == "message":
            messages.append({"role": item["role"], "content": item_text(item["content"])})
        elif kind == "function_call":
            called.add(item["call_id"])
            call = {
                "id": item["call_id"],
                "type": "function",
                "function": {"name": item["name"], "arguments": item["arguments"]},
            }
            last = messages[-1] if messages else None
            if last is not None and last["role"] == "assistant":
                last.setdefault("tool_calls", []).append(call)
            else:
                messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind == "function_call_output":
            if item["call_id"] not in called:
                raise invalid(
                    f"no function call with call_id {item['call_id']!r} comes before this "
                    "output (in this input or the previous response)",
                    f"input.{i}.call_id",
                )
            messages.append(
                {
                    "role": "tool",
                    "tool_call_id": item["call_id"],
                    "content": item_text(item["output"]),
                }
            )
        else:  # only stored items reach here unchecked; the schema refuses other kinds
            raise invalid(f"input items of type {kind!r} are not supported", f"input.{i}.type")
    return messages


def _tools(request: ResponsesRequest) -> list[dict[str, Any]] | None:
    if not request.tools:
        return None
    out = []
    for tool in request.tools:
        fn: dict[str, Any] = {"name": tool.name}
        if tool.description is not None:
            fn["description"] = tool.description
        if tool.parameters is not None:
            fn["parameters"] = tool.parameters
        out.append({"type": "function", "function": fn})
    return out


def _tool_choice(request: ResponsesRequest) -> str | dict[str, Any] | None:
    choice = request.tool_choice
    if isinstance(choice, FunctionChoice):
        return {"type": "function", "function": {"name": choice.name}}
    return choice


def _response_format(request: ResponsesRequest) -> dict[str, Any] | None:
    fmt = request.text.format if request.text else None
    if isinstance(fmt, FormatJsonObject):
        return {"type": "json_object"}
    if isinstance(fmt, FormatJsonSchema):
        return {
            "type": "json_schema",
            "json_schema": {"name": fmt.name, "schema": fmt.schema_, "strict": fmt.strict},
        }
    return None  # text


def chat_request(request: ResponsesRequest, items: list[dict[str, Any]]) -> ChatCompletionRequest:
    """The chat request that answers `items` (history, then the new input) under this
    request's instructions, tools, format and sampling."""
    messages = chat_messages(items)
    if not messages:
        raise invalid("'input' is required: give a message, or items to answer", "input")
    if request.instructions:
        messages.insert(0, {"role": "system", "content": request.instructions})
    body: dict[str, Any] = {
        "model": request.model,
        "messages": messages,
        "stream": request.stream,
        "max_completion_tokens": request.max_output_tokens,
        "temperature": request.temperature,
        "top_p": request.top_p,
        "tools": _tools(request),
        "tool_choice": _tool_choice(request),
        "response_format": _response_format(request),
        "user": request.user,
    }
    if request.parallel_tool_calls is not None:
        body["parallel_tool_calls"] = request.parallel_tool_calls
    try:
        return ChatCompletionRequest.model_validate(body)
    except ValidationError as exc:  # e.g. a conversation past the message limit
        first = exc.errors()[0]
        field = str(first["loc"][0]) if first["loc"] else "input"
        raise invalid(f"{first['msg']}", _FIELDS.get(field, field)) from None


def prepare_response(
    request: ResponsesRequest,
    history: list[dict[str, Any]],
    tokenizer: Tokenizer,
    max_model_len: int,
    default_cap: int | None = None,
    parsers: Parsers = Parsers(),
) -> tuple[Prepared, list[dict[str, Any]]]:
    """(the prepared chat request, the conversation it answers: history + new input).
    `parsers`: the served model's, as on the chat path (its tool-call format)."""
    items = [*history, *input_items(request)]
    chat = chat_request(request, items)
    try:
        return prepare_chat(chat, tokenizer, max_model_len, default_cap, parsers), items
    except ApiError as exc:
        raise renamed(exc) from None


def renamed(exc: ApiError) -> ApiError:
    """The chat path's error, naming this API's fields."""
    message = exc.message
    for chat_name, name in _FIELDS.items():
        message = message.replace(f"'{chat_name}'", f"'{name}'")
        message = message.replace(f" {chat_name}", f" {name}")
    param = _FIELDS.get(exc.param, exc.param) if exc.param else exc.param
    return ApiError(
        exc.status,
        message,
        param=param,
        code=exc.code,
        retry_after_s=exc.retry_after_s,
        headers=exc.headers,
    )
