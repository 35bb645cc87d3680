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

from tokenyard.engine.grammar import bounded
from tokenyard.engine.sampling_params import GuidedSpec
from tokenyard.services.gateway.errors import invalid

OPEN, CLOSE = "<tool_call>", "</tool_call>"
_CALL = re.compile(re.escape(OPEN) + r"\s*(.*?)\s*" + re.escape(CLOSE), re.DOTALL)
# A call's start as models write it: the name first, then the arguments object.
_HEAD = re.compile(r'\s*\{\s*"name"\s*:\s*"([^"\\]+)"\s*,\s*"arguments"\s*:\s*(?=\{)')
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
    lark = f'start: {calls}\ncall: "{OPEN}\\n" body "\\n{CLOSE}"\nbody: %json {json.dumps(bounded(schema))}\n'
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
    streamed = _streamable(body, names)
    if streamed is not None:
        name, args_at = streamed
        end = object_end(body, args_at)
        if end is not None and _is_object(body[args_at:end]):
            # The arguments exactly as written, as a stream sends them.
            return ToolCall(name, body[args_at:end], new_call_id())
    return _normalized_call(body, names)


def _normalized_call(body: str, names: set[str]) -> ToolCall | None:
    """A call written otherwise (arguments first, `parameters`, arguments as a string)."""
    try:
        data = json.loads(body)
    except ValueError:
        return None
    return call_from(data, names)


def call_from(
    data: Any, names: set[str], keys: tuple[str, ...] = ("arguments", "parameters")
) -> ToolCall | None:
    """A parsed call object naming one of `names`, its arguments under the first of `keys`
    it has (an object, or a string holding one), as a ToolCall; None for anything else."""
    if not isinstance(data, dict) or data.get("name") not in names:
        return None
    args: Any = next((data[k] for k in keys if k in data), {})
    if isinstance(args, str):
        try:
            args = json.loads(args)
        except ValueError:
            return None
    if not isinstance(args, dict):
        return None
    return ToolCall(data["name"], json.dumps(args, ensure_ascii=False), new_call_id())


def _streamable(body: str, names: set[str]) -> tuple[str, int] | None:
    """(name, where the arguments object starts) when the call is written name first with
    its arguments as an object: then its arguments can be streamed as they are written."""
    head = _HEAD.match(body)
    if head is None or head.group(1) not in names:
        return None
    return head.group(1), head.end()


def object_end(text: str, start: int) -> int | None:
    """Index just past the JSON object that opens at `text[start]`; None while it is open."""
    depth, in_string, escaped = 0, False, False
    for i in range(start, len(text)):
        ch = text[i]
        if in_string:
            if escaped:
                escaped = False
            elif ch == "\\":
                escaped = True
            elif ch == '"':
                in_string = False
        elif ch == '"':
            in_string = True
        elif ch in "{[":
            depth += 1
        elif ch in "}]":
            depth -= 1
            if depth == 0:
                return i + 1
    return None


def _is_object(text: str) -> bool:
    try:
        return isinstance(json.loads(text), dict)
    except ValueError:
        return False


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


@dataclass(frozen=True)
class CallDelta:
    """One streamed piece of a tool call, as OpenAI sends it: the first of a call carries
    its id and name, the next ones fragments of its arguments."""

    index: int  # the call's place among this choice's calls
    arguments: str
    id: str | None = None
    name: str | None = None


class ToolStreamParser:
    """Splits streamed text into content deltas and tool-call deltas as tokens arrive.

    Text that could be the start of a `<tool_call>` is held back until it is clearly not.
    Inside a call, once `{"name": "<known tool>", "arguments": ` has arrived, the call is
    announced (index, id, name) and its arguments are streamed as they are written, up to the
    end of their JSON object; their concatenation is what the whole answer's `parse` returns.
    A call written otherwise is sent in one delta when its closing tag arrives.
    """

    def __init__(self, names: set[str]) -> None:
        self.names = names
        self._buffer = ""  # text not yet sent: content held back, or the open call's body
        self._in_call = False
        self._open: CallDelta | None = None  # the call being streamed, once announced
        self._args_at = 0  # where its arguments start in the buffer
        self._sent = 0  # up to where they have been sent
        self.num_calls = 0

    def feed(self, text: str) -> tuple[str, list[CallDelta]]:
        self._buffer += text
        content: list[str] = []
        deltas: list[CallDelta] = []
        while True:
            if not self._in_call:
                start = self._buffer.find(OPEN)
                if start < 0:
                    keep = _partial_tag_len(self._buffer)
                    content.append(self._buffer[: len(self._buffer) - keep])
                    self._buffer = self._buffer[len(self._buffer) - keep :]
                    break
                content.append(self._buffer[:start])
                self._buffer = self._buffer[start + len(OPEN) :]
                self._in_call = True
            end = self._buffer.find(CLOSE)
            if end < 0:
                deltas.extend(self._stream_open_call())
                break
            body = self._buffer[:end]
            self._buffer = self._buffer[end + len(CLOSE) :]
            self._in_call = False
            closed, text_back = self._close_call(body)
            deltas.extend(closed)
            content.append(text_back)
        return _strip_between_calls("".join(content), self.num_calls), deltas

    def flush(self) -> str:
        """What is left when the output ends: held-back text, or an unannounced open call."""
        rest = "" if self._open else (OPEN if self._in_call else "") + self._buffer
        self._buffer, self._in_call, self._open = "", False, None
        return rest

    def _stream_open_call(self) -> list[CallDelta]:
        deltas = []
        if self._open is None:
            head = _streamable(self._buffer, self.names)
            if head is None:
                return []
            self._open = CallDelta(self.num_calls, "", new_call_id(), head[0])
            self.num_calls += 1
            self._args_at = self._sent = head[1]
            deltas.append(self._open)
        # Up to the end of the arguments object; while it is open, all but what could be
        # the start of the closing tag.
        end = object_end(self._buffer, self._args_at)
        stop = end if end is not None else len(self._buffer) - _partial_len(self._buffer, CLOSE)
        return deltas + self._send_arguments(self._buffer, stop)

    def _send_arguments(self, body: str, stop: int) -> list[CallDelta]:
        assert self._open is not None
        if stop <= self._sent:
            return []
        delta = CallDelta(self._open.index, body[self._sent : stop])
        self._sent = stop
        return [delta]

    def _close_call(self, body: str) -> tuple[list[CallDelta], str]:
        """The closing tag arrived: (the call's last deltas, text that goes back to content)."""
        if self._open is None:
            call = _one_call(body, self.names)
            if call is None:
                return [], OPEN + body + CLOSE
            self.num_calls += 1
            return [CallDelta(self.num_calls - 1, call.arguments, call.id, call.name)], ""
        # NOTE: announced calls stay calls: arguments that turn out not to be a JSON object
        # cannot be taken back from the client (the whole answer keeps such text as content).
        end = object_end(body, self._args_at)
        deltas = self._send_arguments(body, end if end is not None else len(body))
        self._open = None
        return deltas, ""


def _partial_tag_len(text: str) -> int:
    """How many trailing characters could begin `<tool_call>`."""
    return _partial_len(text, OPEN)


def _partial_len(text: str, tag: str) -> int:
    """How many trailing characters could begin `tag`."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if tag.startswith(text[-n:]):
            return n
    return 0


def _strip_between_calls(content: str, num_calls: int) -> str:
    # The newlines between consecutive calls are the format's, not content.
    return content if not num_calls or content.strip() else ""
