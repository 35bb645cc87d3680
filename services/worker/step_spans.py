"""A request's engine steps as child spans of its `generate` / `prefill` / `decode` span, so
the console's trace waterfall shows where its time went: the prefill (every chunk of the
prompt, up to its first token), then one span per decode step that gave it tokens.

Built after the request ends from the times its stream received outputs (TokenStream
records them), so the engine loop pays nothing per step. Past MAX_STEP_SPANS steps the rest
become one span with a step count: a long answer does not flood the trace store.
"""

from __future__ import annotations

from opentelemetry import trace

MAX_STEP_SPANS = 64


def record_steps(
    tracer: trace.Tracer,
    started_ns: int,
    outputs: list[tuple[int, int]],
    *,
    prefill_tokens: int | None,
) -> None:
    """Child spans of the current span: `outputs` are (unix ns, tokens) per step that gave
    the request tokens. `prefill_tokens`: the prompt tokens computed here before the first
    token (None when the prompt came computed, as in a hand-off: every step is a decode)."""
    if not outputs:
        return
    at = started_ns
    for i, (end_ns, tokens) in enumerate(outputs[:MAX_STEP_SPANS]):
        if i == 0 and prefill_tokens is not None:
            name, attributes = "engine.prefill", {"tokenyard.prompt_tokens": prefill_tokens}
        else:
            name, attributes = "engine.decode_step", {"tokenyard.step": i}
        attributes["tokenyard.new_tokens"] = tokens
        tracer.start_span(name, start_time=at, attributes=attributes).end(end_time=end_ns)
        at = end_ns
    rest = outputs[MAX_STEP_SPANS:]
    if rest:
        attributes = {"tokenyard.steps": len(rest), "tokenyard.new_tokens": sum(t for _, t in rest)}
        span = tracer.start_span("engine.decode_steps", start_time=at, attributes=attributes)
        span.end(end_time=rest[-1][0])
