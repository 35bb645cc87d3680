"""Tool-call parsers per model family: how a family writes its calls, read back into OpenAI's
`tool_calls` (whole and streamed), and the grammar that makes it write one (`tool_choice`
required or named). Pure: no network, no app state.

Chosen per model by `--tool-call-parser` (vLLM's names) or, without one, from the chat
template (:func:`detect`):

- `hermes`: `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` (tools.py). Qwen2.5
  writes its calls this way (vLLM serves it with `hermes`); `qwen` names the same parser.
- `llama3_json`: the answer is `{"name": ..., "parameters": {...}}` (several separated by
  `;`), after an optional `<|python_tag|>`; text first means no call.
- `mistral`: `[TOOL_CALLS][{"name": ..., "arguments": {...}}, ...]` anywhere in the answer, or
  `[TOOL_CALLS]name[ARGS]{...}` per call (tokenizer v11 and later); a bare list of calls
  that opens the answer counts too (the marker is a special token that a detokenizer
  skipping special tokens leaves out).

The JSON families send each call in one delta once its JSON is complete; hermes streams the
arguments as they are written. Either way the whole answer is parsed by the same code that
reads the stream, so the two agree.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from typing import Any, Protocol

from tokenyard.engine.grammar import bounded
from tokenyard.engine.sampling_params import GuidedSpec
from tokenyard.services.gateway import tools
from tokenyard.services.gateway.reasoning import partial_len
from tokenyard.services.gateway.tools import CallDelta, ToolCall

_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_.-]*")


class ToolStream(Protocol):
    def feed(self, text: str) -> tuple[str, list[CallDelta]]: ...

    def flush(self) -> str: ...


class ToolParser(Protocol):
    """One family's format. `names` are the request's tools: calls to others stay text."""

    name: str

    def parse(self, text: str, names: set[str]) -> tuple[str | None, list[ToolCall]]: ...

    def stream(self, names: set[str]) -> ToolStream: ...

    def call_grammar(
        self, fns: dict[str, dict[str, Any]], names: list[str], parallel: bool
    ) -> GuidedSpec: ...

    def system_prompt(self, fns: dict[str, dict[str, Any]]) -> str: ...

    def written_calls(self, tool_calls: list[dict[str, Any]]) -> str: ...


# --- hermes (tools.py) --------------------------------------------------------------------


class HermesParser:
    def __init__(self, name: str = "hermes") -> None:
        self.name = name

    def parse(self, text: str, names: set[str]) -> tuple[str | None, list[ToolCall]]:
        return tools.parse(text, names)

    def stream(self, names: set[str]) -> ToolStream:
        return tools.ToolStreamParser(names)

    def call_grammar(
        self, fns: dict[str, dict[str, Any]], names: list[str], parallel: bool
    ) -> GuidedSpec:
        return tools.call_grammar(fns, names, parallel)

    def system_prompt(self, fns: dict[str, dict[str, Any]]) -> str:
        return tools.system_prompt(fns)

    def written_calls(self, tool_calls: list[dict[str, Any]]) -> str:
        return tools.written_calls(tool_calls)


# --- the JSON families --------------------------------------------------------------------


class _Scanner:
    """Reads calls and content left to right as text arrives; a family's `_step` decides
    one piece at a time and returns None while it must wait for more text (with `final`,
    the text has ended and it must decide). What it cannot read as calls is content."""

    def __init__(self, names: set[str]) -> None:
        self.names = names
        self.text = ""
        self.pos = 0  # everything before has been decided
        self.mode = "start"
        self.region_at = 0  # where the calls being read began (given back as text if bad)
        self.num_calls = 0

    def feed(self, text: str, final: bool = False) -> tuple[str, list[ToolCall]]:
        self.text += text
        content: list[str] = []
        calls: list[ToolCall] = []
        while (step := self._step(final)) is not None:
            content.append(step[0])
            calls.extend(step[1])
            self.num_calls += len(step[1])
        return "".join(content), calls

    def _step(self, final: bool) -> tuple[str, list[ToolCall]] | None:
        raise NotImplementedError

    def _content(self) -> tuple[str, list[ToolCall]] | None:
        if self.pos >= len(self.text):
            return None
        text, self.pos = self.text[self.pos :], len(self.text)
        return text, []

    def _give_back(self, until: int | None = None) -> tuple[str, list[ToolCall]]:
        """What was taken for calls (from `region_at`) is text after all."""
        stop = len(self.text) if until is None else until
        self.mode, self.pos = "content", stop
        return self.text[self.region_at : stop], []

    def _skip(self, chars: str) -> int:
        at = self.pos
        while at < len(self.text) and self.text[at] in chars:
            at += 1
        return at


class _Llama3Scanner(_Scanner):
    TAG = "<|python_tag|>"

    def _step(self, final: bool) -> tuple[str, list[ToolCall]] | None:
        if self.mode == "content":
            return self._content()
        if self.mode == "start":
            return self._start(final)
        at = self._skip(" \t\r\n;")
        # Nothing was sent before the first call: with none, the answer stays as written.
        self.region_at = at if self.num_calls else 0
        if at == len(self.text):
            return self._give_back() if final else None
        if self.text[at] != "{":
            return self._give_back()
        end = tools.object_end(self.text, at)
        if end is None:
            return self._give_back() if final else None
        call = _json_call(self.text[at:end], self.names, ("parameters", "arguments"))
        if call is None:
            return self._give_back()
        self.pos = end
        return "", [call]

    def _start(self, final: bool) -> tuple[str, list[ToolCall]] | None:
        at = self._skip(" \t\r\n")
        rest = self.text[at:]
        if rest.startswith(self.TAG):
            self.mode, self.pos = "calls", at + len(self.TAG)
        elif not final and (not rest or self.TAG.startswith(rest)):
            return None
        else:
            self.mode = "calls" if rest.startswith("{") else "content"
        return "", []


class _MistralScanner(_Scanner):
    TAG = "[TOOL_CALLS]"
    ARGS = "[ARGS]"

    def _step(self, final: bool) -> tuple[str, list[ToolCall]] | None:
        if self.mode == "start":
            return self._start(final)
        if self.mode == "content":
            return self._until_tag(final)
        at = self._skip(" \t\r\n")
        if at == len(self.text):
            return self._give_back() if final else None
        if self.text[at] != "[":
            return self._named_call(at, final)
        end = tools.object_end(self.text, at)
        if end is None:
            return self._give_back() if final else None
        calls = _json_call_list(self.text[at:end], self.names)
        if not calls:
            return self._give_back(end)
        self.mode, self.pos = "content", end
        return "", calls

    def _named_call(self, at: int, final: bool) -> tuple[str, list[ToolCall]] | None:
        """Tokenizer v11 and later write one call as `name[ARGS]{...}` after the marker."""
        name = _NAME.match(self.text, at)
        if name is None:
            return self._give_back()
        args_at = name.end()
        rest = self.text[args_at:]
        if not final and (not rest or (self.ARGS.startswith(rest) and rest != self.ARGS)):
            return None  # the name or the [ARGS] marker may go on
        if rest.startswith(self.ARGS):
            args_at += len(self.ARGS)
        if args_at == len(self.text):
            return self._give_back() if final else None
        if self.text[args_at] != "{":
            return self._give_back()
        end = tools.object_end(self.text, args_at)
        if end is None:
            return self._give_back() if final else None
        try:
            args = json.loads(self.text[args_at:end])
        except ValueError:
            args = None
        call = tools.call_from(
            {"name": name.group(), "arguments": args}, self.names, ("arguments",)
        )
        if call is None:
            return self._give_back(end)
        self.mode, self.pos = "content", end
        return "", [call]

    def _start(self, final: bool) -> tuple[str, list[ToolCall]] | None:
        """A bare list of calls may open the answer (the marker skipped as special)."""
        at = self._skip(" \t\r\n")
        rest = self.text[at:]
        after = rest[1:].lstrip()
        if not final and (not rest or (rest.startswith("[") and not after)):
            return None
        if rest.startswith("[") and after.startswith("{"):
            self.mode, self.region_at = "calls", 0
        else:
            self.mode = "content"
        return "", []

    def _until_tag(self, final: bool) -> tuple[str, list[ToolCall]] | None:
        at = self.text.find(self.TAG, self.pos)
        if at >= 0:
            text = self.text[self.pos : at]
            self.mode, self.region_at, self.pos = "calls", at, at + len(self.TAG)
            return text, []
        keep = 0 if final else partial_len(self.text[self.pos :], self.TAG)
        stop = len(self.text) - keep
        if stop <= self.pos:
            return None
        text, self.pos = self.text[self.pos : stop], stop
        return text, []


def _json_call(body: str, names: set[str], keys: tuple[str, ...]) -> ToolCall | None:
    try:
        data = json.loads(body)
    except ValueError:
        return None
    return tools.call_from(data, names, keys)


def _json_call_list(body: str, names: set[str]) -> list[ToolCall]:
    """A JSON list of calls, all valid, or none."""
    try:
        data = json.loads(body)
    except ValueError:
        return []
    if not isinstance(data, list) or not data:
        return []
    calls = [tools.call_from(item, names, ("arguments", "parameters")) for item in data]
    return [c for c in calls if c is not None] if all(calls) else []


class _ScanStream:
    """A scanner as a ToolStream: each call is one delta (id, name and all its arguments)."""

    def __init__(self, scanner: _Scanner) -> None:
        self.scanner = scanner
        self.num_calls = 0

    def feed(self, text: str) -> tuple[str, list[CallDelta]]:
        content, calls = self.scanner.feed(text)
        return content, list(self._deltas(calls))

    def flush(self) -> str:
        content, calls = self.scanner.feed("", final=True)
        assert not calls  # a call is decided as soon as its JSON is complete
        return content

    def _deltas(self, calls: list[ToolCall]) -> Iterator[CallDelta]:
        for call in calls:
            yield CallDelta(self.num_calls, call.arguments, call.id, call.name)
            self.num_calls += 1


def _scan_whole(scanner: _Scanner, text: str) -> tuple[str | None, list[ToolCall]]:
    content, calls = scanner.feed(text, final=True)
    if not calls:
        return text, []
    return (content.strip() or None), calls


def _call_schema(fns: dict[str, dict[str, Any]], names: list[str], args_key: str) -> dict[str, Any]:
    return bounded(
        {
            "anyOf": [
                {
                    "type": "object",
                    "properties": {"name": {"const": n}, args_key: fns[n]["parameters"]},
                    "required": ["name", args_key],
                    "additionalProperties": False,
                }
                for n in names
            ]
        }
    )


def _described(fns: dict[str, dict[str, Any]]) -> str:
    return "\n".join(json.dumps({"type": "function", "function": f}) for f in fns.values())


def _arguments(call: dict[str, Any]) -> tuple[str | None, Any]:
    fn = call.get("function") or {}
    try:
        return fn.get("name"), json.loads(fn.get("arguments") or "{}")
    except ValueError:
        return fn.get("name"), fn.get("arguments")


class Llama3JsonParser:
    name = "llama3_json"

    def parse(self, text: str, names: set[str]) -> tuple[str | None, list[ToolCall]]:
        return _scan_whole(_Llama3Scanner(names), text)

    def stream(self, names: set[str]) -> ToolStream:
        return _ScanStream(_Llama3Scanner(names))

    def call_grammar(
        self, fns: dict[str, dict[str, Any]], names: list[str], parallel: bool
    ) -> GuidedSpec:
        calls = 'call ("; " call)*' if parallel else "call"
        schema = json.dumps(_call_schema(fns, names, "parameters"))
        return GuidedSpec("grammar", f"start: {calls}\ncall: %json {schema}\n")

    def system_prompt(self, fns: dict[str, dict[str, Any]]) -> str:
        return (
            "You may call functions to help with the user's request. The functions, as JSON "
            f"schemas, are:\n{_described(fns)}\nTo call a function, answer with only a JSON "
            'object of the form {"name": <function name>, "parameters": <arguments as a JSON '
            "object>}; separate several calls with '; '."
        )

    def written_calls(self, tool_calls: list[dict[str, Any]]) -> str:
        written = []
        for call in tool_calls:
            name, args = _arguments(call)
            written.append(json.dumps({"name": name, "parameters": args}, ensure_ascii=False))
        return "; ".join(written)


class MistralParser:
    name = "mistral"

    def parse(self, text: str, names: set[str]) -> tuple[str | None, list[ToolCall]]:
        return _scan_whole(_MistralScanner(names), text)

    def stream(self, names: set[str]) -> ToolStream:
        return _ScanStream(_MistralScanner(names))

    def call_grammar(
        self, fns: dict[str, dict[str, Any]], names: list[str], parallel: bool
    ) -> GuidedSpec:
        calls = 'call (", " call)*' if parallel else "call"
        schema = json.dumps(_call_schema(fns, names, "arguments"))
        tag = json.dumps(_MistralScanner.TAG + "[")
        return GuidedSpec("grammar", f'start: {tag} {calls} "]"\ncall: %json {schema}\n')

    def system_prompt(self, fns: dict[str, dict[str, Any]]) -> str:
        return (
            "You may call functions to help with the user's request. The functions, as JSON "
            f"schemas, are:\n{_described(fns)}\nTo call functions, answer with "
            '[TOOL_CALLS] followed by a JSON list of calls, each {"name": <function name>, '
            '"arguments": <arguments as a JSON object>}.'
        )

    def written_calls(self, tool_calls: list[dict[str, Any]]) -> str:
        calls = [dict(zip(("name", "arguments"), _arguments(c), strict=True)) for c in tool_calls]
        return _MistralScanner.TAG + json.dumps(calls, ensure_ascii=False)


# --- the registry -------------------------------------------------------------------------

PARSERS: dict[str, ToolParser] = {
    p.name: p for p in (HermesParser(), HermesParser("qwen"), Llama3JsonParser(), MistralParser())
}
DEFAULT = "hermes"


def parser_named(name: str) -> ToolParser:
    """The parser of a `--tool-call-parser` name; ValueError (one line) when unknown."""
    if name not in PARSERS:
        raise ValueError(f"unknown tool-call parser {name!r}; known: {', '.join(PARSERS)}")
    return PARSERS[name]


def detect(chat_template: str | None) -> ToolParser:
    """The family whose format the chat template writes; hermes when it names none."""
    template = chat_template or ""
    if _MistralScanner.TAG in template:
        return PARSERS["mistral"]
    if _Llama3Scanner.TAG in template or ("ipython" in template and "parameters" in template):
        return PARSERS["llama3_json"]
    return PARSERS[DEFAULT]
