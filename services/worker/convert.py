"""Between wire messages and the engine's types."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from tokenyard.engine.outputs import RequestOutput, TokenLogprob
from tokenyard.engine.sampling_params import GUIDED_KINDS, GuidedSpec
from tokenyard.v1 import serving_pb2 as pb

DEFAULT_MAX_TOKENS = 16


def engine_params(p: pb.SamplingParams, params_cls: Any) -> Any:
    """The engine's SamplingParams from the wire's (proto3 zeros mean "not set")."""
    guided = None
    if p.HasField("guided"):
        if p.guided.kind not in GUIDED_KINDS:
            raise ValueError(f"unknown guided decoding kind {p.guided.kind!r}")
        guided = GuidedSpec(p.guided.kind, p.guided.value)  # type: ignore[arg-type]
    return params_cls(
        max_tokens=p.max_tokens or DEFAULT_MAX_TOKENS,
        temperature=p.temperature,
        top_p=p.top_p or 1.0,
        top_k=p.top_k if p.top_k else -1,
        min_p=p.min_p,
        seed=p.seed if p.HasField("seed") else None,
        presence_penalty=p.presence_penalty,
        frequency_penalty=p.frequency_penalty,
        repetition_penalty=p.repetition_penalty or 1.0,
        stop=list(p.stop),
        stop_token_ids=list(p.stop_token_ids),
        ignore_eos=p.ignore_eos,
        logprobs=p.logprobs if p.HasField("logprobs") else None,
        cache_salt=p.cache_salt,
        min_tokens=p.min_tokens,
        logit_bias=dict(p.logit_bias),
        guided=guided,
        pooling=p.pooling or None,
        priority=p.priority,
        tenant=p.tenant,
        lora=p.lora,
    )


def logprobs_pb(
    logprobs: list[TokenLogprob] | None, decode: Callable[[list[int]], str]
) -> list[pb.TokenLogprob]:
    if not logprobs:
        return []
    return [
        pb.TokenLogprob(
            token_id=lp.token_id,
            logprob=lp.logprob,
            token=decode([lp.token_id]),
            top=[pb.TopLogprob(token_id=t, logprob=v, token=decode([t])) for t, v in lp.top],
        )
        for lp in logprobs
    ]


def token_chunk(
    out: RequestOutput,
    *,
    index: int,
    worker_id: str,
    decode: Callable[[list[int]], str],
    cached_tokens: int | None = None,
) -> pb.TokenChunk:
    """One engine output as the TokenChunk the gateway reads ("prefilled" is not an end)."""
    finished = bool(out.finished) and out.finish_reason != "prefilled"
    return pb.TokenChunk(
        request_id=out.request_id,
        index=index,
        token_ids=out.new_token_ids,
        text=out.new_text or "",
        logprobs=logprobs_pb(out.logprobs, decode),
        finished=finished,
        finish_reason=(out.finish_reason or "") if finished else "",
        num_prompt_tokens=out.num_prompt_tokens,
        num_output_tokens=out.num_output_tokens,
        num_cached_tokens=out.num_cached_tokens if cached_tokens is None else cached_tokens,
        worker_id=worker_id,
        embedding=out.embedding or [],
        **energy_fields(out),
    )


def energy_fields(out: RequestOutput) -> dict[str, Any]:
    if out.energy is None:
        return {}
    fields: dict[str, Any] = {
        "energy_joules": out.energy.modelled,
        "energy_source": out.energy.source,
    }
    if out.energy.measured is not None:
        fields["energy_joules_measured"] = out.energy.measured
    return fields


def error_chunk(
    request_id: str, index: int, worker_id: str, code: pb.Error.Code, message: str
) -> pb.TokenChunk:
    return pb.TokenChunk(
        request_id=request_id,
        index=index,
        finished=True,
        finish_reason="error",
        error=pb.Error(code=code, message=message),
        worker_id=worker_id,
    )
