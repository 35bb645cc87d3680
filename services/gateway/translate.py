"""OpenAI request -> prompt token ids and pb.SamplingParams. Pure: no network, no app state.

Every rejection is an OpenAIError(400) that names the offending field, so a client sees
what to fix; nothing a client sends can reach the workers in a shape they would refuse.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

from tokenyard.services.gateway.errors import OpenAIError, invalid
from tokenyard.services.gateway.schemas import (
    ChatCompletionRequest,
    ChatMessage,
    CompletionRequest,
    SamplingFields,
)
from tokenyard.v1 import serving_pb2 as pb

_UINT64 = 1 << 64


class Tokenizer(Protocol):
    """The part of tokenyard.models.tokenizer.Tokenizer the gateway uses."""

    @property
    def vocab_size(self) -> int: ...

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]: ...

    def token_text(self, token_id: int) -> str: ...

    def encode_chat(self, messages: list[dict]) -> list[int]: ...


@dataclass(frozen=True)
class Prepared:
    """A validated request, ready for the bus."""

    prompt_ids: list[int]
    params: pb.SamplingParams
    stream: bool
    include_usage: bool


# --- prompts ------------------------------------------------------------------------------


def message_text(message: ChatMessage) -> str:
    if message.content is None:
        return ""
    if isinstance(message.content, str):
        return message.content
    return "".join(part.text for part in message.content)


def chat_prompt_ids(request: ChatCompletionRequest, tokenizer: Tokenizer) -> list[int]:
    if not request.messages:
        raise invalid("'messages' must contain at least one message", "messages")
    messages = [{"role": m.role, "content": message_text(m)} for m in request.messages]
    try:
        # NOTE: not encode(apply_chat_template(...)): that would parse role markers a user
        # typed into their message as real ones.
        return tokenizer.encode_chat(messages)
    except ValueError as exc:  # no template, or one that refuses these roles
        raise invalid(f"cannot render the chat template: {exc}", "messages") from exc


def completion_prompt_ids(request: CompletionRequest, tokenizer: Tokenizer) -> list[int]:
    prompt = request.prompt
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
        if len(prompt) != 1:
            raise invalid(
                "batched prompts are not supported: send one prompt per request", "prompt"
            )
        prompt = prompt[0]
    if isinstance(prompt, str):
        return tokenizer.encode(prompt) if prompt else []
    return list(prompt)


def check_prompt(
    prompt_ids: Sequence[int], max_model_len: int, param: str, vocab_size: int = 0
) -> None:
    if not prompt_ids:
        raise invalid("the prompt is empty", param, "empty_prompt")
    if max_model_len and len(prompt_ids) >= max_model_len:
        raise invalid(
            f"this model's maximum context length is {max_model_len} tokens; the prompt has "
            f"{len(prompt_ids)} tokens (leave room for at least one generated token)",
            param,
            "context_length_exceeded",
        )
    if vocab_size and any(not 0 <= t < vocab_size for t in prompt_ids):
        raise invalid(f"token ids must lie in [0, {vocab_size})", param)


# --- sampling -----------------------------------------------------------------------------


def unsupported(request: SamplingFields, extra: dict[str, bool]) -> None:
    """Fields the gateway parses but does not serve: refuse them clearly, never ignore them."""
    if request.n != 1:
        raise invalid("only n=1 is supported", "n")
    if request.logit_bias:
        raise invalid("logit_bias is not supported", "logit_bias")
    for param, present in extra.items():
        if present:
            raise invalid(f"'{param}' is not supported by this server", param)


def resolve_max_tokens(
    requested: int | None, num_prompt: int, max_model_len: int, default_cap: int | None
) -> int:
    room = max_model_len - num_prompt if max_model_len else None
    if requested is None:
        candidates = [v for v in (room, default_cap) if v is not None]
        if not candidates:
            raise OpenAIError(503, "the model's context length is not known yet: no worker seen")
        return min(candidates)
    if room is not None and requested > room:
        raise invalid(
            f"this model's maximum context length is {max_model_len} tokens; you requested "
            f"{num_prompt + requested} tokens ({num_prompt} in the prompt, {requested} for the "
            "completion); reduce the prompt or max_tokens",
            "max_tokens",
            "context_length_exceeded",
        )
    return requested


def stop_list(stop: str | list[str] | None) -> list[str]:
    if stop is None:
        return []
    return [s for s in ([stop] if isinstance(stop, str) else stop) if s]


def sampling_params(
    request: SamplingFields, max_tokens: int, logprobs: int | None
) -> pb.SamplingParams:
    params = pb.SamplingParams(
        max_tokens=max_tokens,
        temperature=1.0 if request.temperature is None else request.temperature,
        top_p=1.0 if request.top_p is None else request.top_p,
        # NOTE: 0 means "off" to OpenAI-style clients; the engine spells off as -1.
        top_k=request.top_k if request.top_k > 0 else -1,
        min_p=request.min_p,
        presence_penalty=request.presence_penalty,
        frequency_penalty=request.frequency_penalty,
        repetition_penalty=request.repetition_penalty,
        stop=stop_list(request.stop),
        stop_token_ids=request.stop_token_ids,
        ignore_eos=request.ignore_eos,
    )
    if request.seed is not None:
        params.seed = request.seed % _UINT64
    if logprobs is not None:
        params.logprobs = logprobs
    return params


def chat_logprobs(request: ChatCompletionRequest) -> int | None:
    if request.top_logprobs is not None and not request.logprobs:
        raise invalid("'top_logprobs' requires 'logprobs' to be true", "top_logprobs")
    return (request.top_logprobs or 0) if request.logprobs else None


# --- whole requests -----------------------------------------------------------------------


def prepare_chat(
    request: ChatCompletionRequest,
    tokenizer: Tokenizer,
    max_model_len: int,
    default_cap: int | None = None,
) -> Prepared:
    unsupported(request, {"tools": bool(request.tools), "response_format": _structured(request)})
    logprobs = chat_logprobs(request)
    prompt_ids = chat_prompt_ids(request, tokenizer)
    check_prompt(prompt_ids, max_model_len, "messages")
    requested = request.max_completion_tokens or request.max_tokens
    param = "max_completion_tokens" if request.max_completion_tokens else "max_tokens"
    try:
        max_tokens = resolve_max_tokens(requested, len(prompt_ids), max_model_len, default_cap)
    except OpenAIError as exc:
        exc.param = exc.param and param
        raise
    return _prepared(request, prompt_ids, sampling_params(request, max_tokens, logprobs))


def prepare_completion(
    request: CompletionRequest,
    tokenizer: Tokenizer,
    max_model_len: int,
    default_cap: int | None = None,
) -> Prepared:
    unsupported(
        request,
        {
            "echo": request.echo,
            "suffix": bool(request.suffix),
            "best_of": (request.best_of or 1) > 1,
        },
    )
    prompt_ids = completion_prompt_ids(request, tokenizer)
    check_prompt(prompt_ids, max_model_len, "prompt", tokenizer.vocab_size)
    max_tokens = resolve_max_tokens(request.max_tokens, len(prompt_ids), max_model_len, default_cap)
    return _prepared(request, prompt_ids, sampling_params(request, max_tokens, request.logprobs))


def _structured(request: ChatCompletionRequest) -> bool:
    return bool(request.response_format) and request.response_format.get("type") != "text"


def _prepared(
    request: SamplingFields, prompt_ids: list[int], params: pb.SamplingParams
) -> Prepared:
    include_usage = bool(request.stream_options and request.stream_options.include_usage)
    return Prepared(prompt_ids, params, request.stream, include_usage)
