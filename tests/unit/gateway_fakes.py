"""Fakes for the gateway's unit tests: a character tokenizer and a scripted backend (no network)."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

from tokenyard.api_errors import ApiError
from tokenyard.fleet import FleetView
from tokenyard.services.gateway.metrics import GatewayMetrics
from tokenyard.services.gateway.ratelimit import NoLimit, RateLimiter
from tokenyard.services.gateway.settings import GatewaySettings
from tokenyard.services.gateway.state import GatewayState
from tokenyard.v1 import serving_pb2 as pb

MODEL = "tiny-test-model"
BOS = 1


class CharTokenizer:
    """One token per character (id = code point + 10); BOS = 1 when special tokens are added."""

    vocab_size = 0x11000

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return ([BOS] if add_special_tokens else []) + [ord(c) + 10 for c in text]

    def token_text(self, token_id: int) -> str:
        return chr(token_id - 10)

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return "".join(chr(t - 10) for t in ids if t >= 10)

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True) -> str:
        text = "".join(f"<{m['role']}>{m['content']}\n" for m in messages)
        return text + ("<assistant>" if add_generation_prompt else "")

    def encode_chat(
        self, messages: list[dict], add_generation_prompt: bool = True, **variables: object
    ) -> list[int]:
        text = self.apply_chat_template(messages, add_generation_prompt)
        return self.encode(text, add_special_tokens=False)


def text_chunks(
    text: str,
    *,
    per_chunk: int = 2,
    reason: str = "stop",
    logprobs: bool = False,
    prompt_tokens: int = 5,
    cached: int = 0,
) -> list[pb.TokenChunk]:
    """The chunks a worker would send for `text`, `per_chunk` characters (tokens) each."""
    chunks = []
    for start in range(0, len(text), per_chunk):
        piece = text[start : start + per_chunk]
        ids = [ord(c) + 10 for c in piece]
        lps = (
            [
                pb.TokenLogprob(
                    token_id=i, logprob=-0.5, top=[pb.TopLogprob(token_id=i, logprob=-0.5)]
                )
                for i in ids
            ]
            if logprobs
            else []
        )
        chunks.append(
            pb.TokenChunk(
                index=start,
                token_ids=ids,
                text=piece,
                logprobs=lps,
                num_prompt_tokens=prompt_tokens,
                num_cached_tokens=cached,
            )
        )
    chunks[-1].finished = True
    chunks[-1].finish_reason = reason
    chunks[-1].num_output_tokens = len(text)
    return chunks


class FakeStream:
    def __init__(self, chunks: list[pb.TokenChunk], hang: bool) -> None:
        self._chunks, self._hang = list(chunks), hang
        self.closed = False
        self.placement = pb.Placement(prefill_worker_id="w1", decode_worker_id="w1")
        self.read = 0  # chunks taken so far

    def __aiter__(self) -> FakeStream:
        return self

    async def __anext__(self) -> pb.TokenChunk:
        if self._chunks:
            await asyncio.sleep(0)
            chunk = self._chunks.pop(0)
            self.read += 1
            if chunk.error.code:
                raise ApiError(400, chunk.error.message)
            return chunk
        if self._hang:
            await asyncio.sleep(3600)
        raise StopAsyncIteration

    def has_chunk(self) -> bool:
        return bool(self._chunks)

    async def close(self) -> None:
        self.closed = True


@dataclass
class FakeBackend:
    """Answers every request with `script` (text or chunks); records submissions and cancels."""

    script: str | list[pb.TokenChunk] = "Hello world"
    hang: bool = False  # after the scripted chunks, wait forever (a slow worker)
    submit_error: ApiError | None = None
    fleet: FleetView = field(default_factory=FleetView)
    submitted: list[tuple[str, str, list[int], pb.SamplingParams]] = field(default_factory=list)
    cancelled: list[str] = field(default_factory=list)
    streams: list[FakeStream] = field(default_factory=list)
    placements: list[pb.Placement | None] = field(default_factory=list)  # as submitted
    reads_before_submit: list[int] = field(default_factory=list)  # chunks read by then
    # LoRA loads: each worker's scripted reply (absent: ok; None: it does not answer)
    lora_replies: dict[str, pb.LoRAAdapterReply | None] = field(default_factory=dict)
    lora_calls: list[tuple[str, pb.LoRAAdapterRequest]] = field(default_factory=list)

    def connected(self) -> bool:
        return True

    async def not_ready(self) -> str | None:
        return None

    async def submit(
        self,
        rid: str,
        model: str,
        prompt_ids: list[int],
        params: pb.SamplingParams,
        placement: pb.Placement | None = None,
    ) -> FakeStream:
        if self.submit_error:
            raise self.submit_error
        self.submitted.append((rid, model, prompt_ids, params))
        self.placements.append(placement)
        self.reads_before_submit.append(sum(s.read for s in self.streams))
        chunks = text_chunks(self.script) if isinstance(self.script, str) else self.script
        if self.hang and chunks and chunks[-1].finished:
            chunks = chunks[:-1]
        stream = FakeStream(chunks, self.hang)
        self.streams.append(stream)
        return stream

    async def cancel(self, rid: str, reason: str) -> None:
        self.cancelled.append(rid)

    async def lora_call(
        self, worker_id: str, request: pb.LoRAAdapterRequest
    ) -> pb.LoRAAdapterReply | None:
        self.lora_calls.append((worker_id, request))
        return self.lora_replies.get(worker_id, pb.LoRAAdapterReply(ok=True, status=200))


def fake_state(
    backend: FakeBackend | None = None, limiter: RateLimiter | None = None, **settings: object
) -> GatewayState:
    settings.setdefault("max_model_len", 256)
    return GatewayState(
        settings=GatewaySettings(**settings),
        backend=backend or FakeBackend(),
        tokenizer=CharTokenizer(),
        limiter=limiter or NoLimit(),
        model_id=MODEL,
        metrics=GatewayMetrics(),
    )


def documented_model(
    doc: dict, method: str, path: str, status: int, content_type: str = "application/json"
):
    """The pydantic model the OpenAPI document names for this answer (by its $ref)."""
    from tokenyard.services.gateway import schemas
    from tokenyard.services.gateway.responses_api import schemas as responses_schemas

    operation = doc["paths"][path][method.lower()]
    schema = operation["responses"][str(status)]["content"][content_type]["schema"]
    name = schema["$ref"].rsplit("/", 1)[-1]
    return getattr(schemas, name, None) or getattr(responses_schemas, name)
