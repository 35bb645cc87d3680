"""TokenChunks from the bus -> OpenAI's JSON answers and SSE events. Pure: no network.

The workers send one TokenChunk per engine step, each naming the output position of its
first token; chunks may arrive twice (a redelivered job) or out of order (a hand-off from
prefill to decode worker), so :class:`ChunkOrderer` puts them back in line first.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any, Protocol

from pydantic import BaseModel

from tokenyard.services.gateway import tool_parsers, tools
from tokenyard.services.gateway.parsers import Parsers
from tokenyard.services.gateway.reasoning import ReasoningStream, split
from tokenyard.services.gateway.schemas import (
    AssistantMessage,
    ChatChoice,
    ChatChunkChoice,
    ChatCompletionChunk,
    ChatCompletionResponse,
    ChatTokenLogprob,
    ChoiceLogprobs,
    CompletionChoice,
    CompletionLogprobs,
    CompletionResponse,
    DeltaMessage,
    FinishReason,
    FunctionCall,
    FunctionCallDelta,
    PromptTokensDetails,
    ToolCall,
    ToolCallDelta,
    TopLogprob,
    Usage,
)
from tokenyard.services.gateway.translate import Tokenizer
from tokenyard.v1 import serving_pb2 as pb

DONE_EVENT = "data: [DONE]\n\n"


def sse(payload: str) -> str:
    return f"data: {payload}\n\n"


class ChunkOrderer:
    """Releases chunks in output order; drops what it has already released."""

    def __init__(self) -> None:
        self.next_index = 0
        self._pending: dict[int, pb.TokenChunk] = {}
        self.finished = False

    def waiting(self) -> bool:
        """Holds chunks past a gap: one before them is missing (or late)."""
        return bool(self._pending)

    def push(self, chunk: pb.TokenChunk) -> list[pb.TokenChunk]:
        if self.finished or chunk.index < self.next_index:
            return []
        if chunk.index in self._pending and not chunk.finished:
            return []
        self._pending[chunk.index] = chunk
        ready = []
        while self.next_index in self._pending and not self.finished:
            head = self._pending.pop(self.next_index)
            ready.append(head)
            self.finished = head.finished
            if not head.token_ids:
                break  # an empty chunk at this index can only be the last one
            self.next_index += len(head.token_ids)
        return ready


@dataclass
class EnergySum:
    """A request's joules over its chunks (every worker that computed it sends its share)."""

    modelled: float = 0.0
    measured: float = 0.0
    chunks: int = 0  # chunks that carried energy
    measured_chunks: int = 0
    sources: set[str] = field(default_factory=set)

    def add(self, chunk: pb.TokenChunk) -> None:
        if not chunk.energy_source:
            return
        self.chunks += 1
        self.modelled += chunk.energy_joules
        self.sources.add(chunk.energy_source)
        if chunk.HasField("energy_joules_measured"):
            self.measured_chunks += 1
            self.measured += chunk.energy_joules_measured

    def merge(self, other: EnergySum) -> None:
        self.modelled += other.modelled
        self.measured += other.measured
        self.chunks += other.chunks
        self.measured_chunks += other.measured_chunks
        self.sources |= other.sources

    def reported(self) -> tuple[float, str] | None:
        """(joules, source): measured only where every share was measured by one kind of
        counter; the model's figure otherwise. None where no worker reported energy."""
        if not self.chunks:
            return None
        if self.measured_chunks == self.chunks and len(self.sources) == 1:
            return round(self.measured, 6), next(iter(self.sources))
        return round(self.modelled, 6), "modelled"

    def usage_fields(self) -> dict[str, Any]:
        """usage's energy fields (none where no worker reported energy)."""
        found = self.reported()
        if found is None:
            return {}
        joules, source = found
        fields: dict[str, Any] = {"energy_joules": joules, "energy_source": source}
        if source != "modelled":
            fields["energy_joules_modelled"] = round(self.modelled, 6)
        return fields


def energy_of(accs: list[Accumulator]) -> EnergySum:
    total = EnergySum()
    for a in accs:
        total.merge(a.energy)
    return total


@dataclass
class Accumulator:
    """Everything the client gets at the end: text, logprobs, finish reason, usage."""

    text: list[str] = field(default_factory=list)
    logprobs: list[pb.TokenLogprob] = field(default_factory=list)
    finish_reason: FinishReason | None = None
    num_prompt_tokens: int = 0
    num_output_tokens: int = 0
    num_cached_tokens: int = 0
    energy: EnergySum = field(default_factory=lambda: EnergySum())

    def add(self, chunk: pb.TokenChunk) -> None:
        self.energy.add(chunk)
        self.text.append(chunk.text)
        self.logprobs.extend(chunk.logprobs)
        self.num_output_tokens += len(chunk.token_ids)
        self.num_prompt_tokens = chunk.num_prompt_tokens or self.num_prompt_tokens
        self.num_cached_tokens = max(self.num_cached_tokens, chunk.num_cached_tokens)
        if chunk.num_output_tokens:
            self.num_output_tokens = max(self.num_output_tokens, chunk.num_output_tokens)
        if chunk.finished:
            self.finish_reason = finish_reason(chunk.finish_reason)

    def usage(self, num_prompt_tokens: int) -> Usage:
        return usage([self], num_prompt_tokens)

    @property
    def cumulative_logprob(self) -> float:
        return sum(lp.logprob for lp in self.logprobs)


def usage(accs: list[Accumulator], num_prompt_tokens: int) -> Usage:
    """The prompt counts once (its KV is shared by every choice); completions add up."""
    prompt = max((a.num_prompt_tokens for a in accs), default=0) or num_prompt_tokens
    completion = sum(a.num_output_tokens for a in accs)
    cached = max((a.num_cached_tokens for a in accs), default=0)
    return Usage(
        prompt_tokens=prompt,
        completion_tokens=completion,
        total_tokens=prompt + completion,
        prompt_tokens_details=PromptTokensDetails(cached_tokens=cached),
        **energy_of(accs).usage_fields(),
    )


def best(accs: list[Accumulator], n: int) -> list[Accumulator]:
    """best_of: the n sequences with the highest cumulative logprob, in that order."""
    if len(accs) == n:
        return accs
    return sorted(accs, key=lambda a: a.cumulative_logprob, reverse=True)[:n]


# "prefilled" is the prefill worker's internal hand-off; a client must never see it.
_CLIENT_REASONS: dict[str, FinishReason] = {
    "stop": "stop",
    "length": "length",
    "abort": "abort",
    "error": "error",
}


def finish_reason(reason: str) -> FinishReason:
    return _CLIENT_REASONS.get(reason, "stop")


# --- logprobs -----------------------------------------------------------------------------


def token_text(tokenizer: Tokenizer, token_id: int, text: str) -> str:
    return text or tokenizer.token_text(token_id)


def chat_logprobs(lps: list[pb.TokenLogprob], tokenizer: Tokenizer) -> ChoiceLogprobs:
    content = []
    for lp in lps:
        text = token_text(tokenizer, lp.token_id, lp.token)
        top = [_top(tokenizer, t.token_id, t.token, t.logprob) for t in lp.top]
        content.append(
            ChatTokenLogprob(
                token=text, logprob=lp.logprob, bytes=list(text.encode()), top_logprobs=top
            )
        )
    return ChoiceLogprobs(content=content)


def _top(tokenizer: Tokenizer, token_id: int, text: str, logprob: float) -> TopLogprob:
    text = token_text(tokenizer, token_id, text)
    return TopLogprob(token=text, logprob=logprob, bytes=list(text.encode()))


def completion_logprobs(
    lps: list[pb.TokenLogprob], tokenizer: Tokenizer, offset: int = 0
) -> CompletionLogprobs:
    """The legacy shape: parallel lists, `text_offset` counted in characters of the returned
    text from `offset`."""
    out = CompletionLogprobs(tokens=[], token_logprobs=[], top_logprobs=[], text_offset=[])
    for lp in lps:
        text = token_text(tokenizer, lp.token_id, lp.token)
        out.tokens.append(text)
        out.token_logprobs.append(lp.logprob)
        out.top_logprobs.append(
            {token_text(tokenizer, t.token_id, t.token): t.logprob for t in lp.top}
        )
        out.text_offset.append(offset)
        # A special token (an end of turn generated under ignore_eos) is listed, but the
        # text skips special tokens: it takes no characters there.
        offset += len(text) if tokenizer.decode([lp.token_id]) else 0
    return out


# --- chat ---------------------------------------------------------------------------------


@dataclass
class ChatFormat:
    rid: str
    model: str
    created: int
    tokenizer: Tokenizer
    logprobs: bool
    include_usage: bool
    n: int = 1
    tool_names: frozenset[str] = frozenset()
    parsers: Parsers = field(default_factory=Parsers)
    include_reasoning: bool = True  # False: the thinking is split off and dropped
    _tool_streams: dict[int, tool_parsers.ToolStream] = field(default_factory=dict)
    _thinking: dict[int, ReasoningStream] = field(default_factory=dict)
    _called: set[int] = field(default_factory=set)

    def _chunk(self, choice: ChatChunkChoice | None, usage: Usage | None = None) -> str:
        body = ChatCompletionChunk(
            id=self.rid,
            created=self.created,
            model=self.model,
            choices=[choice] if choice else [],
            usage=usage,
        )
        data = body.model_dump(exclude=None if self.include_usage else {"usage"})
        for c in data["choices"]:  # OpenAI sends only the delta's present fields
            c["delta"] = {k: v for k, v in c["delta"].items() if v is not None}
            for call in c["delta"].get("tool_calls", []):
                call["function"] = {k: v for k, v in call["function"].items() if v is not None}
        return sse(json.dumps(data, separators=(",", ":"), ensure_ascii=False))

    def start(self) -> Iterator[str]:
        for i in range(self.n):
            yield self._chunk(
                ChatChunkChoice(index=i, delta=DeltaMessage(role="assistant", content=""))
            )

    def events(self, chunk: pb.TokenChunk, index: int = 0) -> Iterator[str]:
        thought, text = self._split_reasoning(chunk, index)
        calls: list[tools.CallDelta] = []
        if self.tool_names:
            parser = self._tool_streams.get(index)
            if parser is None:
                parser = self._tool_streams[index] = self.parsers.tool.stream(set(self.tool_names))
            text, calls = parser.feed(text)
            if chunk.finished:
                text += parser.flush()
        if text or thought or chunk.logprobs:
            lps = chat_logprobs(list(chunk.logprobs), self.tokenizer) if self.logprobs else None
            delta = DeltaMessage(
                content=text if text or not thought else None, reasoning_content=thought or None
            )
            yield self._chunk(ChatChunkChoice(index=index, delta=delta, logprobs=lps))
        if calls:
            yield self._chunk(ChatChunkChoice(index=index, delta=self._call_delta(index, calls)))
        if chunk.finished:
            reason = self._reason(finish_reason(chunk.finish_reason), index in self._called)
            delta = DeltaMessage()
            yield self._chunk(ChatChunkChoice(index=index, delta=delta, finish_reason=reason))

    def _split_reasoning(self, chunk: pb.TokenChunk, index: int) -> tuple[str, str]:
        """(reasoning, answer) of a chunk's text: all answer without a reasoning parser."""
        if self.parsers.reasoning is None:
            return "", chunk.text
        stream = self._thinking.setdefault(index, ReasoningStream(self.parsers.reasoning))
        thought, text = stream.feed(chunk.text)
        if chunk.finished:
            more_thought, more_text = stream.flush()
            thought, text = thought + more_thought, text + more_text
        return (thought if self.include_reasoning else ""), text

    def _call_delta(self, index: int, calls: list[tools.CallDelta]) -> DeltaMessage:
        self._called.add(index)
        return DeltaMessage(
            tool_calls=[
                ToolCallDelta(
                    index=c.index,
                    id=c.id,
                    type="function" if c.id else None,
                    function=FunctionCallDelta(name=c.name, arguments=c.arguments),
                )
                for c in calls
            ]
        )

    @staticmethod
    def _reason(reason: FinishReason | None, called: bool) -> FinishReason | None:
        return "tool_calls" if called and reason == "stop" else reason

    def end(self, accs: list[Accumulator], num_prompt_tokens: int) -> Iterator[str]:
        if self.include_usage:
            yield self._chunk(None, usage(accs, num_prompt_tokens))
        yield DONE_EVENT

    def complete(self, accs: list[Accumulator], num_prompt_tokens: int) -> ChatCompletionResponse:
        return ChatCompletionResponse(
            id=self.rid,
            created=self.created,
            model=self.model,
            choices=[self._choice(i, acc) for i, acc in enumerate(accs)],
            usage=usage(accs, num_prompt_tokens),
        )

    def _choice(self, index: int, acc: Accumulator) -> ChatChoice:
        lps = chat_logprobs(acc.logprobs, self.tokenizer) if self.logprobs else None
        content: str | None = "".join(acc.text)
        reasoning = None
        if self.parsers.reasoning is not None:
            reasoning, content = split(self.parsers.reasoning, content or "")
            reasoning = reasoning if self.include_reasoning else None
        calls: list[tools.ToolCall] = []
        if self.tool_names:
            content, calls = self.parsers.tool.parse(content or "", set(self.tool_names))
        message = AssistantMessage(
            content=content,
            reasoning_content=reasoning,
            tool_calls=[
                ToolCall(id=c.id, function=FunctionCall(name=c.name, arguments=c.arguments))
                for c in calls
            ]
            or None,
        )
        return ChatChoice(
            index=index,
            message=message,
            logprobs=lps,
            finish_reason=self._reason(acc.finish_reason, bool(calls)),
        )


# --- completions --------------------------------------------------------------------------


@dataclass
class CompletionFormat:
    """With a batch of prompts, the sequences come grouped by prompt (`best_of` each) and
    prompt i's choice j is choice i * n + j; usage adds up over the prompts."""

    rid: str
    model: str
    created: int
    tokenizer: Tokenizer
    logprobs: bool
    include_usage: bool
    n: int = 1
    echo: tuple[str, ...] = ()  # each prompt's text, before its choices' (empty: no echo)
    num_prompts: int = 1
    _offsets: dict[int, int] = field(default_factory=dict)

    def _event(self, choices: list[CompletionChoice], usage: Usage | None = None) -> str:
        body = CompletionResponse(
            id=self.rid, created=self.created, model=self.model, choices=choices, usage=usage
        )
        return sse(body.model_dump_json(exclude=None if self.include_usage else {"usage"}))

    def start(self) -> Iterator[str]:
        for p, text in enumerate(self.echo):
            for i in range(p * self.n, (p + 1) * self.n):
                self._offsets[i] = len(text)
                yield self._event([CompletionChoice(index=i, text=text, finish_reason=None)])

    def events(self, chunk: pb.TokenChunk, index: int = 0) -> Iterator[str]:
        if not (chunk.text or chunk.logprobs or chunk.finished):
            return
        offset = self._offsets.get(index, 0)
        lps = None
        if self.logprobs:
            lps = completion_logprobs(list(chunk.logprobs), self.tokenizer, offset)
        self._offsets[index] = offset + len(chunk.text)
        reason = finish_reason(chunk.finish_reason) if chunk.finished else None
        yield self._event(
            [CompletionChoice(index=index, text=chunk.text, logprobs=lps, finish_reason=reason)]
        )

    def end(self, accs: list[Accumulator], num_prompt_tokens: int) -> Iterator[str]:
        if self.include_usage:
            yield self._event([], self._usage(accs, num_prompt_tokens))
        yield DONE_EVENT

    def complete(self, accs: list[Accumulator], num_prompt_tokens: int) -> CompletionResponse:
        choices = []
        for p, group in enumerate(self._groups(accs)):
            echo = self.echo[p] if self.echo else ""
            for i, acc in enumerate(best(group, self.n)):
                lps = None
                if self.logprobs:
                    lps = completion_logprobs(acc.logprobs, self.tokenizer, len(echo))
                choices.append(
                    CompletionChoice(
                        index=p * self.n + i,
                        text=echo + "".join(acc.text),
                        logprobs=lps,
                        finish_reason=acc.finish_reason,
                    )
                )
        return CompletionResponse(
            id=self.rid,
            created=self.created,
            model=self.model,
            choices=choices,
            usage=self._usage(accs, num_prompt_tokens),
        )

    def _groups(self, accs: list[Accumulator]) -> list[list[Accumulator]]:
        """The sequences of each prompt, in prompt order."""
        size = len(accs) // self.num_prompts
        return [accs[p * size : (p + 1) * size] for p in range(self.num_prompts)]

    def _usage(self, accs: list[Accumulator], num_prompt_tokens: int) -> Usage:
        if self.num_prompts == 1:
            return usage(accs, num_prompt_tokens)
        # Each prompt counts once (its choices share its KV); the workers report its length.
        parts = [usage(group, 0) for group in self._groups(accs)]
        prompt = sum(u.prompt_tokens for u in parts)
        completion = sum(u.completion_tokens for u in parts)
        cached = sum(
            u.prompt_tokens_details.cached_tokens for u in parts if u.prompt_tokens_details
        )
        return Usage(
            prompt_tokens=prompt,
            completion_tokens=completion,
            total_tokens=prompt + completion,
            prompt_tokens_details=PromptTokensDetails(cached_tokens=cached),
            **energy_of(accs).usage_fields(),
        )


class ResponseFormat(Protocol):
    """What `serve.Generation` needs of an endpoint's answer: SSE events as chunks come,
    and the whole answer."""

    rid: str

    def start(self) -> Iterator[str]: ...

    def events(self, chunk: pb.TokenChunk, index: int = 0) -> Iterator[str]: ...

    def end(self, accs: list[Accumulator], num_prompt_tokens: int) -> Iterator[str]: ...

    def complete(self, accs: list[Accumulator], num_prompt_tokens: int) -> BaseModel: ...
