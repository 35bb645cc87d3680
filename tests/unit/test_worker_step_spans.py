"""A request's engine steps as child spans (services/worker/step_spans.py): the prefill to
the first token, one span per decode step, and the steps past the cap as one."""

from __future__ import annotations

from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from tokenyard.services.worker.step_spans import MAX_STEP_SPANS, record_steps


def finished(prefill_tokens: int | None, outputs: list[tuple[int, int]]):
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    tracer = provider.get_tracer("t")
    with tracer.start_as_current_span("generate") as parent:
        record_steps(tracer, 1_000, outputs, prefill_tokens=prefill_tokens)
    spans = [s for s in exporter.get_finished_spans() if s.name != "generate"]
    assert all(s.parent.span_id == parent.get_span_context().span_id for s in spans)
    return spans


def test_the_prefill_then_each_decode_step_back_to_back():
    spans = finished(40, [(5_000, 1), (6_000, 1), (8_000, 2)])
    assert [s.name for s in spans] == ["engine.prefill", *["engine.decode_step"] * 2]
    assert [(s.start_time, s.end_time) for s in spans] == [
        (1_000, 5_000),
        (5_000, 6_000),
        (6_000, 8_000),
    ]
    assert spans[0].attributes["tokenyard.prompt_tokens"] == 40
    assert spans[2].attributes["tokenyard.new_tokens"] == 2


def test_a_hand_off_has_only_decode_steps_and_a_long_answer_is_capped():
    outputs = [(2_000 + 10 * i, 1) for i in range(MAX_STEP_SPANS + 30)]
    spans = finished(None, outputs)
    assert len(spans) == MAX_STEP_SPANS + 1
    assert {s.name for s in spans[:-1]} == {"engine.decode_step"}
    rest = spans[-1]
    assert rest.name == "engine.decode_steps" and rest.attributes["tokenyard.steps"] == 30
    assert rest.end_time == outputs[-1][0]
    assert finished(None, []) == []
