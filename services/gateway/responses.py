"""TokenChunks from the bus -> OpenAI's JSON answers and SSE events. Pure: no network.

The workers send one TokenChunk per engine step, each naming the output position of its
first token; chunks may arrive twice (a redelivered job) or out of order (a hand-off from
prefill to decode worker), so :class:`ChunkOrderer` puts them back in line first.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass, field

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
    PromptTokensDetails,
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
class Accumulator:
    """Everything the client gets at the end: text, logprobs, finish reason, usage."""

    text: list[str] = field(default_factory=list)
    logprobs: list[pb.TokenLogprob] = field(default_factory=list)
    finish_reason: str | None = None
    num_prompt_tokens: int = 0
    num_output_tokens: int = 0
    num_cached_tokens: int = 0

    def add(self, chunk: pb.TokenChunk) -> None:
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
        prompt = self.num_prompt_tokens or num_prompt_tokens
        return Usage(
            prompt_tokens=prompt,
            completion_tokens=self.num_output_tokens,
            total_tokens=prompt + self.num_output_tokens,
            prompt_tokens_details=PromptTokensDetails(cached_tokens=self.num_cached_tokens),
        )


def finish_reason(reason: str) -> str:
    # "prefilled" is the prefill worker's internal hand-off; a client must never see it.
    return reason if reason in ("stop", "length", "abort", "error") else "stop"


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
    """The legacy shape: parallel lists, `text_offset` counted in characters from `offset`."""
    out = CompletionLogprobs(tokens=[], token_logprobs=[], top_logprobs=[], text_offset=[])
    for lp in lps:
        text = token_text(tokenizer, lp.token_id, lp.token)
        out.tokens.append(text)
        out.token_logprobs.append(lp.logprob)
        out.top_logprobs.append(
            {token_text(tokenizer, t.token_id, t.token): t.logprob for t in lp.top}
        )
        out.text_offset.append(offset)
        offset += len(text)
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
        return sse(json.dumps(data, separators=(",", ":"), ensure_ascii=False))

    def start(self) -> Iterator[str]:
        yield self._chunk(
            ChatChunkChoice(index=0, delta=DeltaMessage(role="assistant", content=""))
        )

    def events(self, chunk: pb.TokenChunk) -> Iterator[str]:
        if chunk.text or chunk.logprobs:
            lps = chat_logprobs(list(chunk.logprobs), self.tokenizer) if self.logprobs else None
            delta = DeltaMessage(content=chunk.text)
            yield self._chunk(ChatChunkChoice(index=0, delta=delta, logprobs=lps))
        if chunk.finished:
            reason = finish_reason(chunk.finish_reason)
            yield self._chunk(ChatChunkChoice(index=0, delta=DeltaMessage(), finish_reason=reason))

    def end(self, acc: Accumulator, num_prompt_tokens: int) -> Iterator[str]:
        if self.include_usage:
            yield self._chunk(None, acc.usage(num_prompt_tokens))
        yield DONE_EVENT

    def complete(self, acc: Accumulator, num_prompt_tokens: int) -> ChatCompletionResponse:
        lps = chat_logprobs(acc.logprobs, self.tokenizer) if self.logprobs else None
        choice = ChatChoice(
            index=0,
            message=AssistantMessage(content="".join(acc.text)),
            logprobs=lps,
            finish_reason=acc.finish_reason,
        )
        return ChatCompletionResponse(
            id=self.rid,
            created=self.created,
            model=self.model,
            choices=[choice],
            usage=acc.usage(num_prompt_tokens),
        )


# --- completions --------------------------------------------------------------------------


@dataclass
class CompletionFormat:
    rid: str
    model: str
    created: int
    tokenizer: Tokenizer
    logprobs: bool
    include_usage: bool
    _offset: int = 0

    def _event(self, choices: list[CompletionChoice], usage: Usage | None = None) -> str:
        body = CompletionResponse(
            id=self.rid, created=self.created, model=self.model, choices=choices, usage=usage
        )
        return sse(body.model_dump_json(exclude=None if self.include_usage else {"usage"}))

    def start(self) -> Iterator[str]:
        return iter(())

    def events(self, chunk: pb.TokenChunk) -> Iterator[str]:
        if not (chunk.text or chunk.logprobs or chunk.finished):
            return
        lps = None
        if self.logprobs:
            lps = completion_logprobs(list(chunk.logprobs), self.tokenizer, self._offset)
        self._offset += len(chunk.text)
        reason = finish_reason(chunk.finish_reason) if chunk.finished else None
        yield self._event(
            [CompletionChoice(index=0, text=chunk.text, logprobs=lps, finish_reason=reason)]
        )

    def end(self, acc: Accumulator, num_prompt_tokens: int) -> Iterator[str]:
        if self.include_usage:
            yield self._event([], acc.usage(num_prompt_tokens))
        yield DONE_EVENT

    def complete(self, acc: Accumulator, num_prompt_tokens: int) -> CompletionResponse:
        lps = completion_logprobs(acc.logprobs, self.tokenizer) if self.logprobs else None
        choice = CompletionChoice(
            index=0, text="".join(acc.text), logprobs=lps, finish_reason=acc.finish_reason
        )
        return CompletionResponse(
            id=self.rid,
            created=self.created,
            model=self.model,
            choices=[choice],
            usage=acc.usage(num_prompt_tokens),
        )


ResponseFormat = ChatFormat | CompletionFormat
