"""OpenAI request -> prompt token ids and pb.SamplingParams. Pure: no network, no app state.

Every rejection is an ApiError(400) that names the offending field, so a client sees
what to fix; nothing a client sends can reach the workers in a shape they would refuse.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, replace
from typing import Any, Protocol, cast

from tokenyard.api_errors import ApiError
from tokenyard.engine.grammar import GuidedError, after_reasoning
from tokenyard.engine.sampling_params import GuidedSpec
from tokenyard.services.gateway import tools
from tokenyard.services.gateway.errors import invalid
from tokenyard.services.gateway.parsers import Parsers
from tokenyard.services.gateway.schemas import (
    ChatCompletionRequest,
    ChatMessage,
    CompletionRequest,
    SamplingFields,
)
from tokenyard.services.gateway.structured import (
    checked,
    guided_field_spec,
    response_format_spec,
)
from tokenyard.v1 import serving_pb2 as pb

_UINT64 = 1 << 64
# A token stands for at most this many bytes of text: the longest tokens of common
# vocabularies (runs of spaces or dashes) are under 100. A prompt with more bytes than
# max_model_len times this can never fit, and is refused before it is tokenized.
MAX_BYTES_PER_TOKEN = 128
# Sequences one completions request may start: its prompts times the choices of each.
MAX_SEQUENCES = 1024


class Tokenizer(Protocol):
    """The part of tokenyard.models.tokenizer.Tokenizer the gateway uses."""

    @property
    def vocab_size(self) -> int: ...

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]: ...

    def token_text(self, token_id: int) -> str: ...

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str: ...

    def encode_chat(
        self, messages: list[dict], add_generation_prompt: bool = True, **variables: object
    ) -> list[int]: ...


@dataclass(frozen=True)
class Prepared:
    """A validated request, ready for the bus."""

    prompt_ids: list[int]
    params: pb.SamplingParams
    stream: bool
    include_usage: bool
    cache_salt: str | None = None  # as the request asked; deps.cache_salt decides the salt
    n: int = 1  # choices returned
    best_of: int = 1  # sequences generated; the n with the highest logprob are returned
    echo: tuple[str, ...] = ()  # completions: each prompt's text, before its choices' (or none)
    tool_names: frozenset[str] = frozenset()  # parse calls to these out of the output
    user: str = ""  # the caller's end user, recorded on the request's trace span
    priority: int | None = None  # as the request asked; deps.admit_prepared decides it
    # Completions with a list of prompts: the prompts after the first (prompt_ids). Prompt i's
    # choice j is choice i * n + j of the answer, as OpenAI numbers them.
    more_prompts: tuple[list[int], ...] = ()

    @property
    def prompts(self) -> list[list[int]]:
        return [self.prompt_ids, *self.more_prompts]

    @property
    def num_prompt_tokens(self) -> int:
        return sum(len(p) for p in self.prompts)


# --- prompts ------------------------------------------------------------------------------


def message_text(message: ChatMessage) -> str:
    if message.content is None:
        return ""
    if isinstance(message.content, str):
        return message.content
    return "".join(part.text for part in message.content)


def chat_messages(
    request: ChatCompletionRequest, tokenizer: Tokenizer, parsers: Parsers = Parsers()
) -> list[dict]:
    """The messages as the chat template reads them; tools described in a system message,
    in the tool-call parser's format, when the template does not render them itself."""
    native = tools.template_knows_tools(getattr(tokenizer, "chat_template", None))
    messages = []
    for m in request.messages:
        message: dict = {"role": m.role, "content": message_text(m)}
        if m.tool_calls and native:
            message["tool_calls"] = [c.model_dump() for c in m.tool_calls]
        elif m.tool_calls:
            calls = parsers.tool.written_calls([c.model_dump() for c in m.tool_calls])
            message["content"] = "\n".join(t for t in (message["content"], calls) if t)
        if m.tool_call_id:
            message["tool_call_id"] = m.tool_call_id
        messages.append(message)
    if request.tools and not native:
        system = parsers.tool.system_prompt(tools.functions(request.tools))
        if messages[0]["role"] in ("system", "developer"):
            messages[0] = {**messages[0], "content": messages[0]["content"] + "\n\n" + system}
        else:
            messages.insert(0, {"role": "system", "content": system})
    return messages


def chat_prompt_ids(
    request: ChatCompletionRequest, tokenizer: Tokenizer, parsers: Parsers = Parsers()
) -> list[int]:
    if not request.messages:
        raise invalid("'messages' must contain at least one message", "messages")
    messages = chat_messages(request, tokenizer, parsers)
    native = request.tools and tools.template_knows_tools(getattr(tokenizer, "chat_template", None))
    extra: dict[str, Any] = {
        **template_kwargs(request),
        **({"tools": request.tools} if native else {}),
    }
    try:
        # NOTE: not encode(apply_chat_template(...)): that would parse role markers a user
        # typed into their message as real ones.
        return tokenizer.encode_chat(messages, **extra)
    except ValueError as exc:  # no template, or one that refuses these roles
        raise invalid(f"cannot render the chat template: {exc}", "messages") from exc


# Variables the gateway sets itself, or whose text the template would write as its own
# (special tokens and all): a client may not set them.
_RESERVED_TEMPLATE_VARIABLES = frozenset(
    {
        "messages",
        "tools",
        "add_generation_prompt",
        "bos_token",
        "eos_token",
        "unk_token",
        "pad_token",
    }
)


def template_kwargs(request: ChatCompletionRequest) -> dict[str, object]:
    """`chat_template_kwargs`: switches for the template (enable_thinking: false). Only
    booleans and numbers: a string would be rendered as template text, where role markers
    and special tokens are real."""
    kwargs = request.chat_template_kwargs or {}
    for key, value in kwargs.items():
        if key in _RESERVED_TEMPLATE_VARIABLES:
            raise invalid(f"chat_template_kwargs may not set {key!r}", "chat_template_kwargs")
        if value is not None and not isinstance(value, bool | int | float):
            raise invalid(
                f"chat_template_kwargs values must be booleans or numbers; {key!r} is not",
                "chat_template_kwargs",
            )
    return dict(kwargs)


def completion_prompts(request: CompletionRequest) -> list[str] | list[list[int]]:
    """The request's prompts: one string or token-id list each (a list of them is a batch)."""
    prompt = request.prompt
    if isinstance(prompt, str):
        return [prompt]
    if prompt and isinstance(prompt[0], (str, list)):
        return cast(list[str] | list[list[int]], prompt)
    # A flat list is one prompt's token ids (or empty).
    return [cast(list[int], prompt)]


def completion_prompt_ids(prompt: str | list[int], tokenizer: Tokenizer) -> list[int]:
    if isinstance(prompt, str):
        return tokenizer.encode(prompt) if prompt else []
    return list(prompt)


def _prompt_texts(request: CompletionRequest) -> list[str]:
    """The prompt's text (none for token ids): what tokenizing it would read."""
    prompt = request.prompt
    if isinstance(prompt, str):
        return [prompt]
    return [p for p in prompt if isinstance(p, str)]


def check_prompt_size(texts: Iterable[str], max_model_len: int, param: str) -> None:
    """Refuse a prompt whose text cannot fit in the context, without tokenizing it."""
    if not max_model_len:
        return
    size = sum(len(text.encode()) for text in texts)
    if size > max_model_len * MAX_BYTES_PER_TOKEN:
        raise invalid(
            f"this model's maximum context length is {max_model_len} tokens; the prompt has "
            f"{size} bytes of text, more than {max_model_len} tokens can hold",
            param,
            "context_length_exceeded",
        )


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


def logit_bias(request: SamplingFields, vocab_size: int) -> dict[int, float]:
    """OpenAI's {"token id": bias} -> {token id: bias}; ids must lie in the vocabulary."""
    out = {}
    for key, bias in (request.logit_bias or {}).items():
        try:
            token = int(key)
        except ValueError:
            raise invalid(f"logit_bias keys are token ids, not {key!r}", "logit_bias") from None
        if not 0 <= token < (vocab_size or 1 << 31):
            raise invalid(f"logit_bias token id {token} is not in [0, {vocab_size})", "logit_bias")
        out[token] = bias
    return out


def check_choices(n: int, best_of: int | None, stream: bool) -> int:
    """How many sequences to generate for `n` choices (best_of, when set, at least n)."""
    best = best_of or n
    if best < n:
        raise invalid(f"best_of ({best}) must be at least n ({n})", "best_of")
    if best > n and stream:
        raise invalid(
            "best_of cannot be streamed: the best choices are known at the end", "best_of"
        )
    return best


def resolve_max_tokens(
    requested: int | None, num_prompt: int, max_model_len: int, default_cap: int | None
) -> int:
    room = max_model_len - num_prompt if max_model_len else None
    if requested is None:
        candidates = [v for v in (room, default_cap) if v is not None]
        if not candidates:
            raise ApiError(503, "the model's context length is not known yet: no worker seen")
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
    if request.min_tokens > max_tokens:
        raise invalid(
            f"min_tokens ({request.min_tokens}) exceeds max_tokens ({max_tokens})", "min_tokens"
        )
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
        min_tokens=request.min_tokens,
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
    parsers: Parsers = Parsers(),
) -> Prepared:
    check_choices(request.n, None, request.stream)
    if request.reasoning_effort is not None:
        raise invalid(
            "reasoning_effort is not supported: the served model's reasoning has no effort "
            "setting (a reasoning parser only splits the thinking from the answer)",
            "reasoning_effort",
        )
    logprobs = chat_logprobs(request)
    guided, tool_names = chat_guidance(request, parsers)
    check_prompt_size(map(message_text, request.messages), max_model_len, "messages")
    prompt_ids = chat_prompt_ids(request, tokenizer, parsers)
    check_prompt(prompt_ids, max_model_len, "messages")
    requested = request.max_completion_tokens or request.max_tokens
    param = "max_completion_tokens" if request.max_completion_tokens else "max_tokens"
    try:
        max_tokens = resolve_max_tokens(requested, len(prompt_ids), max_model_len, default_cap)
    except ApiError as exc:
        exc.param = exc.param and param
        raise
    params = sampling_params(request, max_tokens, logprobs)
    params.logit_bias.update(logit_bias(request, tokenizer.vocab_size))
    if guided is not None:
        params.guided.CopyFrom(guided)
    return _prepared(request, prompt_ids, params, tool_names=tool_names)


def chat_guidance(
    request: ChatCompletionRequest, parsers: Parsers = Parsers()
) -> tuple[pb.GuidedDecoding | None, frozenset[str]]:
    """The grammar (response_format, guided_*, or a forced tool call in the parser's
    format) and the tools whose calls are parsed out of the output. With a reasoning parser
    the grammar holds the answer only: free reasoning may come first."""
    fns = tools.functions(request.tools) if request.tools else {}
    forced = tools.chosen(request.tool_choice, list(fns)) if fns else None
    if request.tool_choice not in (None, "none", "auto") and not fns:
        raise invalid("tool_choice needs tools", "tool_choice")
    specs = []
    if (spec := response_format_spec(request.response_format)) is not None:
        specs.append(("response_format", spec))
    if (field := guided_field_spec(_guided_fields(request))) is not None:
        specs.append(field)
    if forced:
        # A named function is called once, as OpenAI does; `required` may call several.
        parallel = request.parallel_tool_calls and request.tool_choice == "required"
        specs.append(("tool_choice", parsers.tool.call_grammar(fns, forced, parallel)))
    if len(specs) > 1:
        names = " and ".join(name for name, _ in specs)
        raise invalid(f"{names} cannot be combined: each constrains the whole output", specs[1][0])
    parsed = frozenset(fns) if fns and request.tool_choice != "none" else frozenset()
    if not specs:
        return None, parsed
    param, spec = specs[0]
    if parsers.reasoning is not None:
        spec = _after_reasoning(spec, parsers, param)
    return checked(spec, param), parsed


def _after_reasoning(spec: GuidedSpec, parsers: Parsers, param: str) -> GuidedSpec:
    syntax = parsers.reasoning
    assert syntax is not None
    try:
        return after_reasoning(spec, syntax.start, syntax.end, syntax.opened_in_prompt)
    except GuidedError as exc:
        raise invalid(str(exc), param) from exc


def _guided_fields(request: SamplingFields) -> dict[str, object]:
    return {
        "guided_json": request.guided_json,
        "guided_regex": request.guided_regex,
        "guided_choice": request.guided_choice,
        "guided_grammar": request.guided_grammar,
    }


def prepare_completion(
    request: CompletionRequest,
    tokenizer: Tokenizer,
    max_model_len: int,
    default_cap: int | None = None,
) -> Prepared:
    if request.suffix:
        raise invalid(
            "suffix is not supported: the served model has no fill-in-the-middle format", "suffix"
        )
    if request.echo and request.logprobs is not None:
        raise invalid("echo with logprobs is not supported (no prompt logprobs)", "echo")
    best_of = check_choices(request.n, request.best_of, request.stream)
    prompts = completion_prompts(request)
    for text in _prompt_texts(request):  # each prompt must fit on its own
        check_prompt_size([text], max_model_len, "prompt")
    if len(prompts) * best_of > MAX_SEQUENCES:
        raise invalid(
            f"{len(prompts)} prompts with {best_of} choices each start more than "
            f"{MAX_SEQUENCES} sequences; send fewer prompts per request",
            "prompt",
        )
    all_ids = [completion_prompt_ids(p, tokenizer) for p in prompts]
    for ids in all_ids:
        check_prompt(ids, max_model_len, "prompt", tokenizer.vocab_size)
    longest = max(len(ids) for ids in all_ids)
    max_tokens = resolve_max_tokens(request.max_tokens, longest, max_model_len, default_cap)
    logprobs = request.logprobs
    if best_of > request.n and logprobs is None:
        logprobs = 0  # ranking needs each token's logprob; the answer leaves them out
    params = sampling_params(request, max_tokens, logprobs)
    params.logit_bias.update(logit_bias(request, tokenizer.vocab_size))
    if (field := guided_field_spec(_guided_fields(request))) is not None:
        params.guided.CopyFrom(checked(field[1], field[0]))
    echo: tuple[str, ...] = ()
    if request.echo:
        echo = tuple(
            p if isinstance(p, str) else tokenizer.decode(ids)
            for p, ids in zip(prompts, all_ids, strict=True)
        )
    prepared = _prepared(request, all_ids[0], params, best_of=best_of, echo=echo)
    return replace(prepared, more_prompts=tuple(all_ids[1:]))


def _prepared(
    request: SamplingFields,
    prompt_ids: list[int],
    params: pb.SamplingParams,
    *,
    best_of: int | None = None,
    echo: tuple[str, ...] = (),
    tool_names: frozenset[str] = frozenset(),
) -> Prepared:
    include_usage = bool(request.stream_options and request.stream_options.include_usage)
    return Prepared(
        prompt_ids,
        params,
        request.stream,
        include_usage,
        request.cache_salt,
        n=request.n,
        best_of=best_of or request.n,
        echo=echo,
        tool_names=tool_names,
        user=request.user or "",
        priority=request.priority,
    )
