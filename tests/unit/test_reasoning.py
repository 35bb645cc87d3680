"""Reasoning parsers: the thinking split from the answer, whole and streamed (the stream's
pieces add up to the whole answer's split at every split point), and the grammar that lets
free reasoning come before a constrained answer."""

from __future__ import annotations

import json

import llguidance
import pytest

from tokenyard.engine.grammar import GuidedError, after_reasoning, grammar_for, validate
from tokenyard.engine.sampling_params import GuidedSpec
from tokenyard.services.gateway.reasoning import ReasoningStream, split, syntax_named

QWEN3 = syntax_named("qwen3")
R1 = syntax_named("deepseek_r1")
GRANITE = syntax_named("granite")
TAGS = syntax_named("generic:<reasoning>,</reasoning>")


@pytest.mark.parametrize(
    ("syntax", "text", "reasoning", "content"),
    [
        (QWEN3, "<think>Paris is in France.</think>\n\nParis.", "Paris is in France.", "Paris."),
        (QWEN3, "Paris.", None, "Paris."),  # no block: all answer
        (QWEN3, "  <think>a</think>b", "a", "b"),
        (QWEN3, "<think>cut by max_tokens", "cut by max_tokens", None),
        (QWEN3, "Hi <think>not a block</think>", None, "Hi <think>not a block</think>"),
        (QWEN3, "<think></think>\nAnswer", None, "Answer"),
        (R1, "<think>\nhmm</think>42", "\nhmm", "42"),
        (R1, "hmm, the prompt opened it</think> 42", "hmm, the prompt opened it", "42"),
        (R1, "never closed", "never closed", None),
        (R1, "a</think>b</think>c", "a", "b</think>c"),  # the first closing marker ends it
        (GRANITE, "Here is my thought process: x. Here is my response: y", " x. ", "y"),
        (TAGS, "<reasoning>r</reasoning>c", "r", "c"),
        (TAGS, "<think>r</think>c", None, "<think>r</think>c"),
    ],
)
def test_whole_split(syntax, text, reasoning, content):
    assert split(syntax, text) == (reasoning, content)


def _streamed(syntax, text: str, points: list[int]) -> tuple[str | None, str | None]:
    stream = ReasoningStream(syntax)
    reasoning = content = ""
    for a, b in zip([0, *points], [*points, len(text)], strict=True):
        r, c = stream.feed(text[a:b])
        reasoning, content = reasoning + r, content + c
    r, c = stream.flush()
    return (reasoning + r) or None, (content + c) or None


@pytest.mark.parametrize("syntax", [QWEN3, R1, GRANITE, TAGS])
@pytest.mark.parametrize(
    "text",
    [
        "<think>one\ntwo</think>\n\nthree",
        "<think>x</thi",
        "  <thin",
        "plain answer with </think> inside",
        "Here is my thought process: a Here is my response: b",
        "<reasoning>r</reasoning>\n c",
        "",
    ],
)
def test_streamed_equals_whole_at_every_split_point(syntax, text):
    whole = split(syntax, text)
    for at in range(len(text) + 1):  # every single split point
        assert _streamed(syntax, text, [at]) == whole, at
    for size in (1, 2, 3, 5):
        assert _streamed(syntax, text, list(range(size, len(text), size))) == whole, size


def test_stream_holds_back_a_marker_until_it_is_one():
    stream = ReasoningStream(QWEN3)
    assert stream.feed("<thi") == ("", "")
    assert stream.feed("nk>I think") == ("I think", "")
    assert stream.feed(" more</th") == (" more", "")
    assert stream.feed("ink>\n") == ("", "")
    assert stream.feed("Answer") == ("", "Answer")


@pytest.mark.parametrize("name", ["nope", "generic:", "generic:<a>", "generic:<a>,<a>"])
def test_unknown_or_malformed_names_are_one_line_errors(name):
    with pytest.raises(ValueError) as info:
        syntax_named(name)
    assert "\n" not in str(info.value)


class _ByteTokenizer:
    eos_token_id = 256
    bos_token_id = None
    tokens = [bytes([i]) for i in range(256)] + [b"<eos>"]
    special_token_ids = [256]

    def __call__(self, text: bytes) -> list[int]:
        return list(text)


BYTES = llguidance.LLTokenizer(llguidance.TokenizerWrapper(_ByteTokenizer()))
SCHEMA = GuidedSpec(
    "json_schema",
    json.dumps({"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}),
)


def accepts(spec: GuidedSpec, text: str) -> bool:
    matcher = llguidance.LLMatcher(BYTES, grammar_for(spec))
    assert not matcher.is_error(), matcher.get_error()
    return matcher.consume_tokens(list(text.encode())) and matcher.is_accepting()


@pytest.mark.parametrize(
    ("syntax", "text", "ok"),
    [
        (QWEN3, '{"a": 1}', True),  # the block is optional
        (QWEN3, '<think>maybe {"a": "x"}?</think>\n\n{"a": 1}', True),
        (QWEN3, '<think>free</think>{"b": 1}', False),  # the answer still follows the schema
        (QWEN3, "<think>never closed", False),
        (R1, '{"a": 1}', False),  # the prompt opened the block: it must be closed first
        (R1, 'thinking</think>{"a": 1}', True),
        (R1, '<think>thinking</think> {"a": 1}', True),
        (GRANITE, 'Here is my thought process: hm. Here is my response: {"a": 2}', True),
    ],
)
def test_grammar_allows_free_reasoning_then_the_constrained_answer(syntax, text, ok):
    spec = after_reasoning(SCHEMA, syntax.start, syntax.end, syntax.opened_in_prompt)
    validate(spec)
    assert accepts(spec, text) is ok
    if ok:  # what the grammar lets through, the parser splits into the same answer
        assert json.loads(split(syntax, text)[1] or "") == json.loads(text[text.rfind("{") :])


@pytest.mark.parametrize(
    ("spec", "good", "bad"),
    [
        (GuidedSpec("regex", "[0-9]+"), "12", "a"),
        (GuidedSpec("choice", '["yes", "no"]'), "no", "maybe"),
        (GuidedSpec("grammar", 'start: "x" NUM\nNUM: /[0-9]/'), "x1", "y1"),
    ],
)
def test_every_guided_kind_can_follow_reasoning(spec, good, bad):
    wrapped = after_reasoning(spec, "<think>", "</think>", False)
    assert accepts(wrapped, f"<think>t</think>{good}") and accepts(wrapped, good)
    assert not accepts(wrapped, f"<think>t</think>{bad}")


@pytest.mark.parametrize("value", ["not json", '{"x": 1}', "[1]"])
def test_a_malformed_llguidance_grammar_is_refused(value):
    with pytest.raises(GuidedError):
        validate(GuidedSpec("llguidance", value))
