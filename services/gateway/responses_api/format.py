"""Token chunks -> a Response object and the Responses API's typed SSE events. Pure.

A stream opens with `response.created` and `response.in_progress`; each output item is
announced (`response.output_item.added`), filled (`response.output_text.delta` inside a
content part, or `response.function_call_arguments.delta`) and closed (`...done`); the
last event is `response.completed`, `response.incomplete` (max_output_tokens reached) or
`response.failed`, carrying the whole Response. Every event has a `sequence_number`.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field

from pydantic import BaseModel

from tokenyard.services.gateway import tools
from tokenyard.services.gateway.reasoning import ReasoningStream, ReasoningSyntax, split
from tokenyard.services.gateway.responses import Accumulator, usage
from tokenyard.services.gateway.responses_api.schemas import (
    ArgumentsDeltaEvent,
    ArgumentsDoneEvent,
    ContentPartEvent,
    FunctionCallItem,
    IncompleteDetails,
    InputTokensDetails,
    ItemStatus,
    LifecycleEvent,
    OutputItemEvent,
    OutputMessage,
    OutputText,
    OutputTokensDetails,
    Response,
    ResponseError,
    ResponsesRequest,
    ResponseStatus,
    ResponseUsage,
    TextConfig,
    TextDeltaEvent,
    TextDoneEvent,
)
from tokenyard.services.gateway.tool_parsers import DEFAULT, PARSERS, ToolParser, ToolStream
from tokenyard.v1 import serving_pb2 as pb

OutputItem = OutputMessage | FunctionCallItem


def new_response_id() -> str:
    # NOTE: "_" not ".": the id is also the request's id, one token of a NATS subject.
    return f"resp_{uuid.uuid4().hex}"


def _item_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def status_of(accs: list[Accumulator]) -> ResponseStatus:
    reason = accs[0].finish_reason if accs else None
    if reason == "length":
        return "incomplete"
    if reason in ("abort", "error"):
        return "failed"
    return "completed"


def response_usage(accs: list[Accumulator], num_prompt_tokens: int) -> ResponseUsage:
    u = usage(accs, num_prompt_tokens)
    cached = u.prompt_tokens_details.cached_tokens if u.prompt_tokens_details else 0
    return ResponseUsage(
        input_tokens=u.prompt_tokens,
        input_tokens_details=InputTokensDetails(cached_tokens=cached),
        output_tokens=u.completion_tokens,
        output_tokens_details=OutputTokensDetails(),
        total_tokens=u.total_tokens,
        energy_joules=u.energy_joules,
        energy_source=u.energy_source,
        energy_joules_modelled=u.energy_joules_modelled,
    )


def whole_output(
    text: str,
    tool_names: frozenset[str],
    status: ItemStatus,
    tool_parser: ToolParser = PARSERS[DEFAULT],
    reasoning: ReasoningSyntax | None = None,
) -> list[OutputItem]:
    """The output items of a whole answer: its text (if any) as a message, then its calls
    (read in the served model's format, `tool_parser`). With a `reasoning` syntax the
    thinking is split off first and left out (no reasoning items yet)."""
    content: str | None = text
    if reasoning is not None:
        _, content = split(reasoning, text)
        text = content or ""
    calls: list[tools.ToolCall] = []
    if tool_names:
        content, calls = tool_parser.parse(text, set(tool_names))
    items: list[OutputItem] = []
    if content or not calls:
        items.append(
            OutputMessage(
                id=_item_id("msg"), status=status, content=[OutputText(text=content or "")]
            )
        )
    for call in calls:
        items.append(
            FunctionCallItem(
                id=_item_id("fc"),
                call_id=call.id,
                name=call.name,
                arguments=call.arguments,
                status=status,
            )
        )
    return items


@dataclass
class ResponsesFormat:
    """Builds one response, whole (`complete`) or streamed (`start`, `events`, `end`)."""

    rid: str
    request: ResponsesRequest
    created: int
    tool_names: frozenset[str] = frozenset()
    tool_parser: ToolParser = PARSERS[DEFAULT]  # the served model's tool-call format
    reasoning: ReasoningSyntax | None = None  # the served model's thinking, left out
    _seq: int = 0
    _items: list[OutputItem] = field(default_factory=list)  # streamed so far
    _open: int | None = None  # output index of the item being streamed
    _calls: dict[int, int] = field(default_factory=dict)  # parser's call index -> output index
    _held: str = ""  # whitespace not yet sent: it opens no message by itself
    _parser: ToolStream | None = None
    _thinking: ReasoningStream | None = None
    _final: Response | None = None
    _closing: list[str] = field(default_factory=list)  # the stream's last item events

    def __post_init__(self) -> None:
        if self.tool_names:
            self._parser = self.tool_parser.stream(set(self.tool_names))
        if self.reasoning is not None:
            self._thinking = ReasoningStream(self.reasoning)

    # --- the Response object --------------------------------------------------------------

    def response(
        self,
        status: ResponseStatus,
        output: list[OutputItem],
        usage: ResponseUsage | None = None,
    ) -> Response:
        r = self.request
        return Response(
            id=self.rid,
            created_at=self.created,
            status=status,
            model=r.model,
            output=output,
            instructions=r.instructions,
            previous_response_id=r.previous_response_id,
            max_output_tokens=r.max_output_tokens,
            temperature=r.temperature,
            top_p=r.top_p,
            tools=r.tools or [],
            tool_choice=r.tool_choice or "auto",
            parallel_tool_calls=True if r.parallel_tool_calls is None else r.parallel_tool_calls,
            text=r.text or TextConfig(),
            store=r.store,
            metadata=r.metadata or {},
            user=r.user,
            usage=usage,
            error=(
                ResponseError(
                    code="server_error", message="the generation was stopped on the worker"
                )
                if status == "failed"
                else None
            ),
            incomplete_details=(
                IncompleteDetails(reason="max_output_tokens") if status == "incomplete" else None
            ),
        )

    def complete(self, accs: list[Accumulator], num_prompt_tokens: int) -> Response:
        """The final Response: of the streamed items when streaming, else of the whole text.
        Once built, it stays (the stream's last event and the stored copy are one object)."""
        if self._final is None:
            status = status_of(accs)
            item_status: ItemStatus = "incomplete" if status == "incomplete" else "completed"
            if self.request.stream:
                self._closing = list(self._close_streamed(item_status))
                output = self._items
            else:
                output = whole_output(
                    "".join(accs[0].text),
                    self.tool_names,
                    item_status,
                    self.tool_parser,
                    self.reasoning,
                )
            self._final = self.response(status, output, response_usage(accs, num_prompt_tokens))
        return self._final

    # --- streaming ------------------------------------------------------------------------

    def _event(self, event: BaseModel) -> str:
        data = event.model_dump(mode="json")
        data["sequence_number"] = self._seq
        self._seq += 1
        payload = json.dumps(data, separators=(",", ":"), ensure_ascii=False)
        return f"event: {data['type']}\ndata: {payload}\n\n"

    def _lifecycle(self, kind: str, response: Response) -> str:
        return self._event(LifecycleEvent(type=kind, sequence_number=0, response=response))  # type: ignore[arg-type]

    def start(self) -> Iterator[str]:
        opening = self.response("in_progress", [])
        yield self._lifecycle("response.created", opening)
        yield self._lifecycle("response.in_progress", opening)

    def events(self, chunk: pb.TokenChunk, index: int = 0) -> Iterator[str]:
        text, calls = chunk.text, list[tools.CallDelta]()
        if self._thinking is not None:  # the answer part only
            _, text = self._thinking.feed(text)
            if chunk.finished:
                text += self._thinking.flush()[1]
        if self._parser is not None:
            text, calls = self._parser.feed(text)
            if chunk.finished:
                text += self._parser.flush()
        yield from self._text(text)
        for call in calls:
            yield from self._call(call)

    def end(self, accs: list[Accumulator], num_prompt_tokens: int) -> Iterator[str]:
        final = self.complete(accs, num_prompt_tokens)
        yield from self._closing
        kind = {"completed": "response.completed", "incomplete": "response.incomplete"}
        yield self._lifecycle(kind.get(final.status, "response.failed"), final)

    def _text(self, text: str) -> Iterator[str]:
        if not text:
            return
        current = self._items[self._open] if self._open is not None else None
        if not isinstance(current, OutputMessage):
            if not text.strip():
                self._held += text
                return
            text, self._held = self._held + text, ""
            yield from self._close("completed")
            yield from self._open_item(
                OutputMessage(id=_item_id("msg"), status="in_progress", content=[])
            )
            yield from self._part("response.content_part.added", "")
        at = self._open
        assert at is not None
        message = self._items[at]
        assert isinstance(message, OutputMessage)
        message.content[0].text += text
        yield self._event(
            TextDeltaEvent(
                type="response.output_text.delta",
                sequence_number=0,
                item_id=message.id,
                output_index=at,
                content_index=0,
                delta=text,
            )
        )

    def _call(self, delta: tools.CallDelta) -> Iterator[str]:
        if delta.id is not None:  # a new call: its first delta names it
            yield from self._close("completed")
            item = FunctionCallItem(
                id=_item_id("fc"),
                call_id=delta.id,
                name=delta.name or "",
                arguments="",
                status="in_progress",
            )
            yield from self._open_item(item)
            assert self._open is not None
            self._calls[delta.index] = self._open
        if not delta.arguments:
            return
        at = self._calls[delta.index]
        call = self._items[at]
        assert isinstance(call, FunctionCallItem)
        call.arguments += delta.arguments
        yield self._event(
            ArgumentsDeltaEvent(
                type="response.function_call_arguments.delta",
                sequence_number=0,
                item_id=call.id,
                output_index=at,
                delta=delta.arguments,
            )
        )

    def _open_item(self, item: OutputItem) -> Iterator[str]:
        if isinstance(item, OutputMessage):
            item.content.append(OutputText(text=""))
        self._items.append(item)
        self._open = len(self._items) - 1
        added = item.model_copy(deep=True)
        if isinstance(added, OutputMessage):
            added.content = []  # its part is announced by content_part.added
        yield self._event(
            OutputItemEvent(
                type="response.output_item.added",
                sequence_number=0,
                output_index=self._open,
                item=added,
            )
        )

    def _part(self, kind: str, text: str) -> Iterator[str]:
        assert self._open is not None
        message = self._items[self._open]
        yield self._event(
            ContentPartEvent(
                type=kind,  # type: ignore[arg-type]
                sequence_number=0,
                item_id=message.id,
                output_index=self._open,
                content_index=0,
                part=OutputText(text=text),
            )
        )

    def _close(self, status: ItemStatus) -> Iterator[str]:
        """Close the item being streamed (its `...done` events)."""
        if self._open is None:
            return
        at, item = self._open, self._items[self._open]
        item.status = status
        if isinstance(item, OutputMessage):
            text = item.content[0].text
            yield self._event(
                TextDoneEvent(
                    type="response.output_text.done",
                    sequence_number=0,
                    item_id=item.id,
                    output_index=at,
                    content_index=0,
                    text=text,
                )
            )
            yield from self._part("response.content_part.done", text)
        else:
            yield self._event(
                ArgumentsDoneEvent(
                    type="response.function_call_arguments.done",
                    sequence_number=0,
                    item_id=item.id,
                    output_index=at,
                    name=item.name,
                    arguments=item.arguments,
                )
            )
        yield self._event(
            OutputItemEvent(
                type="response.output_item.done",
                sequence_number=0,
                output_index=at,
                item=item.model_copy(deep=True),
            )
        )
        self._open = None

    def _close_streamed(self, status: ItemStatus) -> Iterator[str]:
        """The stream's last item events: close the open item; an answer with no output at
        all still gets its (empty) message, as a whole answer does."""
        if not self._items:
            yield from self._open_item(
                OutputMessage(id=_item_id("msg"), status="in_progress", content=[])
            )
            yield from self._part("response.content_part.added", "")
        yield from self._close(status)
