"""Conditional disaggregation: does handing a sequence to a decode worker pay?

The prompt runs on the prefill worker P either way, so the choice is where the output
tokens are decoded: on P (aggregated) or on the decode worker D (disaggregated, after a
KV hand-off). Each worker's heartbeat carries its measured step time as a line,
``step ~= fixed + per_token * tokens computed in the step``, its running sequences and
the prompt tokens queued on it. For this request's m output tokens:

    itl(w)      = fixed_w + per_token_w * (running_w + 1)          # one more decode row
                + per_token_w * queued_prompt_w / m                 # prefill work it waits behind
    hand_off    = handoff_fixed + handoff_per_token * prompt_tokens # export, pull, commit
    disaggregate  iff  m * (itl(P) - itl(D)) > hand_off

P's queued prompts stall its decode rows (chunked prefill shares the step); D only
decodes. On a small host this keeps short requests aggregated while the decode worker
has nothing to do better, and spreads decoding over both workers (both cores) once P
is busy, which a fixed prompt-length threshold never did. A worker that has not measured
its steps yet is assumed to run at ``CostConfig``'s defaults; only differences matter.
"""

from __future__ import annotations

from dataclasses import dataclass

from tokenyard.fleet import WorkerView


@dataclass(frozen=True)
class CostConfig:
    default_fixed_ms: float = 5.0  # a worker's step time before it has measured any
    default_ms_per_token: float = 1.0
    default_max_tokens: int = 128  # a request that names no max_tokens
    # Export, NATS request/reply, shared-memory pull and commit: a few ms of both
    # workers' time, plus the KV bytes (about 0.02 ms per prompt token over shm here).
    handoff_fixed_ms: float = 10.0
    handoff_ms_per_token: float = 0.02


@dataclass(frozen=True)
class Choice:
    disaggregate: bool
    reason: str
    itl_prefill_ms: float
    itl_decode_ms: float
    handoff_ms: float


def step_line(w: WorkerView, config: CostConfig) -> tuple[float, float]:
    """(fixed_ms, ms_per_token) as measured, or the defaults before the first measure."""
    hb = w.heartbeat
    if hb.step_ms_per_token <= 0:
        return config.default_fixed_ms, config.default_ms_per_token
    return hb.step_fixed_ms, hb.step_ms_per_token


def predicted_itl_ms(w: WorkerView, max_tokens: int, config: CostConfig) -> float:
    """Inter-token latency of one more sequence decoding on ``w``."""
    fixed, per_token = step_line(w, config)
    hb = w.heartbeat
    rows = hb.num_running + hb.num_waiting + w.pending_decodes + 1
    queued = hb.pending_prompt_tokens + w.pending_prompt_tokens
    return fixed + per_token * rows + per_token * queued / max(1, max_tokens)


def compare(
    prefill: WorkerView,
    decode: WorkerView,
    num_prompt_tokens: int,
    max_tokens: int,
    config: CostConfig | None = None,
) -> Choice:
    config = config or CostConfig()
    m = max_tokens or config.default_max_tokens
    on_p = predicted_itl_ms(prefill, m, config)
    on_d = predicted_itl_ms(decode, m, config)
    handoff = config.handoff_fixed_ms + config.handoff_ms_per_token * num_prompt_tokens
    saved = m * (on_p - on_d)
    figures = f"itl {on_p:.1f} ms here vs {on_d:.1f} ms there, hand-off {handoff:.0f} ms"
    if saved > handoff:
        return Choice(True, f"decode worker is faster ({figures})", on_p, on_d, handoff)
    return Choice(False, f"hand-off does not pay ({figures})", on_p, on_d, handoff)
