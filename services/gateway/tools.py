"""Tool calls: tools into the prompt, `tool_choice` into a grammar, the model's output back
into OpenAI's `tool_calls`. Pure: no network, no app state.

The model writes a call as `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` (the
Hermes format that Qwen, SmolLM3 and many fine-tunes use). A chat template that knows tools
renders them itself; for one that does not (SmolLM2's), the tools and this format are
described in a system message, and assistant calls in the history are written back in it.

`required` and a named `tool_choice` are a Lark grammar whose calls are JSON constrained by
each function's parameter schema, so even a small model produces a valid call. With `auto`
the output is free and parsed afterwards: only calls whose JSON parses become `tool_calls`.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass
from typing import Any

from tokenyard.engine.sampling_params import GuidedSpec
from tokenyard.services.gateway.errors import invalid

OPEN, CLOSE = "<tool_call>", "</tool_call>"
_CALL = re.compile(re.escape(OPEN) + r"\s*(.*?)\s*" + re.escape(CLOSE), re.DOTALL)
_SYSTEM = (
    "You may call functions to help with the user's request. The functions, as JSON "
    "schemas, are:\n<tools>\n{tools}\n</tools>\nTo call a function, answer with one line per "
    "call, each exactly of the form\n"
    '<tool_call>\n{{"name": <function name>, "arguments": <arguments as a JSON object>}}\n'
    "</tool_call>"
)


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: str  # JSON text
    id: str

    def openai(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "type": "function",
            "function": {"name": self.name, "arguments": self.arguments},
        }


def functions(tools: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """name -> function definition; a malformed tool is a 400 naming `tools`."""
    out: dict[str, dict[str, Any]] = {}
    for tool in tools:
        fn = tool.get("function") if tool.get("type") == "function" else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or not fn["name"]:
            raise invalid(
                "each tool must be {'type': 'function', 'function': {'name': ...}}", "tools"
            )
        params = fn.get("parameters", {"type": "object", "properties": {}})
        if not isinstance(params, dict):
            raise invalid(f"the parameters of tool {fn['name']!r} must be a JSON schema", "tools")
        out[fn["name"]] = {**fn, "parameters": params}
    return out


def chosen(tool_choice: str | dict[str, Any] | None, names: list[str]) -> list[str] | None:
    """The functions the grammar must call: None when the output is free (none, auto)."""
    if tool_choice is None or tool_choice in ("none", "auto"):
        return None
    if tool_choice == "required":
        return names
    if isinstance(tool_choice, dict) and tool_choice.get("type") == "function":
        name = (tool_choice.get("function") or {}).get("name")
        if name not in names:
            raise invalid(
                f"tool_choice names {name!r}, which is not among the tools", "tool_choice"
            )
        return [name]
    raise invalid(
        "tool_choice must be none, auto, required or {'type': 'function', 'function': {...}}",
        "tool_choice",
    )


def call_grammar(fns: dict[str, dict[str, Any]], names: list[str], parallel: bool) -> GuidedSpec:
    """Lark: one call (or several, when parallel) to the named functions, JSON per schema."""
    schema = {
        "anyOf": [
            {
                "type": "object",
                "properties": {"name": {"const": n}, "arguments": fns[n]["parameters"]},
                "required": ["name", "arguments"],
                "additionalProperties": False,
            }
            for n in names
        ]
    }
    calls = 'call ("\\n" call)*' if parallel else "call"
    lark = (
        f'start: {calls}\ncall: "{OPEN}\\n" body "\\n{CLOSE}"\nbody: %json {json.dumps(schema)}\n'
    )
    return GuidedSpec("grammar", lark)


def template_knows_tools(chat_template: str | None) -> bool:
    return bool(chat_template) and "tools" in (chat_template or "")


def system_prompt(fns: dict[str, dict[str, Any]]) -> str:
    described = "\n".join(json.dumps({"type": "function", "function": f}) for f in fns.values())
    return _SYSTEM.format(tools=described)


def written_calls(tool_calls: list[dict[str, Any]]) -> str:
    """An assistant message's earlier calls, as the model writes them."""
    out = []
    for call in tool_calls:
        fn = call.get("function") or {}
        try:
            args = json.loads(fn.get("arguments") or "{}")
        except ValueError:
            args = fn.get("arguments")
        out.append(f"{OPEN}\n{json.dumps({'name': fn.get('name'), 'arguments': args})}\n{CLOSE}")
    return "\n".join(out)


def parse(text: str, names: set[str]) -> tuple[str | None, list[ToolCall]]:
    """The model's text -> (content, calls). Calls to unknown functions or with JSON that
    does not parse stay in the content."""
    calls: list[ToolCall] = []
    kept: list[str] = []
    last = 0
    for match in _CALL.finditer(text):
        call = _one_call(match.group(1), names)
        if call is None:
            continue
        kept.append(text[last : match.start()])
        last = match.end()
        calls.append(call)
    kept.append(text[last:])
    content = "".join(kept).strip() if calls else text
    return (content or None), calls


def _one_call(body: str, names: set[str]) -> ToolCall | None:
    try:
        data = json.loads(body)
    except ValueError:
        return None
    if not isinstance(data, dict) or data.get("name") not in names:
        return None
    args = data.get("arguments", data.get("parameters", {}))
    if isinstance(args, str):
        try:
            args = json.loads(args)
        except ValueError:
            return None
    if not isinstance(args, dict):
        return None
    return ToolCall(data["name"], json.dumps(args, ensure_ascii=False), new_call_id())


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


class ToolStreamParser:
    """Splits streamed text into content deltas and whole tool calls as they complete.

    Text that could be the start of a `<tool_call>` is held back until it is clearly not;
    a call is released when its closing tag arrives (its arguments in one delta, which
    OpenAI's clients accumulate as they do split ones).
    """

    def __init__(self, names: set[str]) -> None:
        self.names = names
        self._buffer = ""
        self.num_calls = 0

    def feed(self, text: str) -> tuple[str, list[ToolCall]]:
        self._buffer += text
        content, calls = [], []
        while True:
            start = self._buffer.find(OPEN)
            if start < 0:
                keep = _partial_tag_len(self._buffer)
                content.append(self._buffer[: len(self._buffer) - keep])
                self._buffer = self._buffer[len(self._buffer) - keep :]
                break
            content.append(self._buffer[:start])
            end = self._buffer.find(CLOSE, start)
            if end < 0:
                self._buffer = self._buffer[start:]
                break
            block = self._buffer[start : end + len(CLOSE)]
            self._buffer = self._buffer[end + len(CLOSE) :]
            _, parsed = parse(block, self.names)
            if parsed:
                calls.extend(parsed)
            else:
                content.append(block)
        self.num_calls += len(calls)
        return _strip_between_calls("".join(content), self.num_calls), calls

    def flush(self) -> str:
        rest, self._buffer = self._buffer, ""
        return rest


def _partial_tag_len(text: str) -> int:
    """How many trailing characters could begin `<tool_call>`."""
    for n in range(min(len(OPEN) - 1, len(text)), 0, -1):
        if OPEN.startswith(text[-n:]):
            return n
    return 0


def _strip_between_calls(content: str, num_calls: int) -> str:
    # The newlines between consecutive calls are the format's, not content.
    return content if not num_calls or content.strip() else ""
