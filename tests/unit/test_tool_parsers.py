"""Tool-call parsers per model family: each family's calls read back whole and streamed (the
stream adds up to the whole answer at every split point), text that is not a valid call
kept as content, the grammars of `required` and named `tool_choice` in each family's format,
and the choice of a family by name or chat template."""

from __future__ import annotations

import json

import llguidance
import pytest

from tokenyard.engine.grammar import grammar_for
from tokenyard.services.gateway.tool_parsers import PARSERS, detect, parser_named
from tokenyard.services.gateway.tools import functions

NAMES = {"get_weather", "plan"}
FNS = functions(
    [
        {
            "type": "function",
            "function": {
                "name": "get_weather",
                "parameters": {
                    "type": "object",
                    "properties": {"city": {"type": "string"}},
                    "required": ["city"],
                    "additionalProperties": False,
                },
            },
        },
        {"type": "function", "function": {"name": "plan"}},
    ]
)
PARIS = {"city": "Paris"}
ROME = {"city": "Rome"}
NESTED = {"steps": [{"say": "a } b"}, {"say": 'q" {'}], "n": 2}

HERMES = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
LLAMA = '{"name": "get_weather", "parameters": {"city": "Paris"}}'
LLAMA_ROME = LLAMA.replace("Paris", "Rome")
MISTRAL = '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris"}}]'


def _calls(calls) -> list[tuple[str, dict]]:
    return [(c.name, json.loads(c.arguments)) for c in calls]


# (family, text, content, calls) as the whole answer reads them
CASES = [
    ("hermes", HERMES, None, [("get_weather", PARIS)]),
    ("qwen", "Let me look. " + HERMES, "Let me look.", [("get_weather", PARIS)]),
    ("llama3_json", LLAMA, None, [("get_weather", PARIS)]),
    ("llama3_json", "<|python_tag|>" + LLAMA, None, [("get_weather", PARIS)]),
    (
        "llama3_json",
        f"  {LLAMA}; {LLAMA_ROME}",
        None,
        [("get_weather", PARIS), ("get_weather", ROME)],
    ),
    ("llama3_json", LLAMA.replace("parameters", "arguments"), None, [("get_weather", PARIS)]),
    (
        "llama3_json",
        json.dumps({"name": "plan", "parameters": NESTED}),
        None,
        [("plan", NESTED)],
    ),
    (
        "llama3_json",
        f"{LLAMA} and then some words",
        "and then some words",
        [("get_weather", PARIS)],
    ),
    ("llama3_json", "Sure: " + LLAMA, "Sure: " + LLAMA, []),  # text first: no call
    (
        "llama3_json",
        LLAMA.replace("get_weather", "other"),
        LLAMA.replace("get_weather", "other"),
        [],
    ),
    (
        "llama3_json",
        '{"name": "get_weather", "parameters": {"ci',
        '{"name": "get_weather", "parameters": {"ci',
        [],
    ),
    ("llama3_json", '{"a": 1}', '{"a": 1}', []),  # JSON, but not a call
    ("mistral", MISTRAL, None, [("get_weather", PARIS)]),
    ("mistral", "Checking. " + MISTRAL, "Checking.", [("get_weather", PARIS)]),
    ("mistral", MISTRAL[len("[TOOL_CALLS]") :], None, [("get_weather", PARIS)]),  # tag skipped
    (
        "mistral",
        '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris"}}, '
        '{"name": "get_weather", "arguments": "{\\"city\\": \\"Rome\\"}"}]',
        None,
        [("get_weather", PARIS), ("get_weather", ROME)],
    ),
    ("mistral", '[TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}', None, [("get_weather", PARIS)]),
    (
        "mistral",
        'On it [TOOL_CALLS]get_weather{"city": "Paris"}[TOOL_CALLS]plan[ARGS]{"n": 2} ok',
        "On it  ok",
        [("get_weather", PARIS), ("plan", {"n": 2})],
    ),
    ("mistral", '[TOOL_CALLS]nope[ARGS]{"a": 1}', '[TOOL_CALLS]nope[ARGS]{"a": 1}', []),
    ("mistral", "[TOOL_CALLS]get_weather[ARGS]", "[TOOL_CALLS]get_weather[ARGS]", []),
    ("mistral", "[1] is a footnote", "[1] is a footnote", []),
    ("mistral", "[TOOL_CALLS][{oops}] x", "[TOOL_CALLS][{oops}] x", []),
    (
        "mistral",
        MISTRAL.replace("get_weather", "other"),
        MISTRAL.replace("get_weather", "other"),
        [],
    ),
    ("mistral", '[TOOL_CALLS][{"name": "get_weather"', '[TOOL_CALLS][{"name": "get_weather"', []),
]


@pytest.mark.parametrize(("family", "text", "content", "calls"), CASES)
def test_whole_answer(family, text, content, calls):
    got_content, got_calls = parser_named(family).parse(text, NAMES)
    assert (got_content, _calls(got_calls)) == (content, calls)
    assert len({c.id for c in got_calls}) == len(got_calls)


def _streamed(family: str, text: str, points: list[int]) -> tuple[str, list[tuple[str, dict]]]:
    """`text` fed in pieces cut at `points`, reassembled as OpenAI's clients do."""
    stream = parser_named(family).stream(NAMES)
    content, calls = "", {}
    for a, b in zip([0, *points], [*points, len(text)], strict=True):
        piece, deltas = stream.feed(text[a:b])
        content += piece
        for d in deltas:
            if d.id:
                assert d.index not in calls  # a call is announced once, with its id
            name, args = calls.get(d.index, ("", ""))
            calls[d.index] = (name + (d.name or ""), args + d.arguments)
    content += stream.flush()
    return content, [(name, json.loads(args)) for name, args in (calls[i] for i in sorted(calls))]


@pytest.mark.parametrize(("family", "text", "content", "calls"), CASES)
def test_streamed_equals_whole_at_every_split_point(family, text, content, calls):
    for at in range(len(text) + 1):
        streamed, streamed_calls = _streamed(family, text, [at])
        # A stream cannot take back the space it sent before a call; the whole answer strips it.
        assert (streamed.strip() or None, streamed_calls) == (content, calls), at
    for size in (1, 2, 3, 7):
        streamed, streamed_calls = _streamed(family, text, list(range(size, len(text), size)))
        assert (streamed.strip() or None, streamed_calls) == (content, calls), size


def test_llama3_content_is_streamed_as_soon_as_it_is_not_a_call():
    stream = parser_named("llama3_json").stream(NAMES)
    assert stream.feed("  ") == ("", [])  # still could be a call
    assert stream.feed("<|pyth") == ("", [])
    assert stream.feed("on_tag|>") == ("", [])
    piece, [delta] = stream.feed(LLAMA)
    assert piece == "" and (delta.index, delta.name) == (0, "get_weather") and delta.id
    assert json.loads(delta.arguments) == PARIS
    plain = parser_named("llama3_json").stream(NAMES)
    assert plain.feed("Hello") == ("Hello", [])


def test_mistral_streams_content_until_the_marker():
    stream = parser_named("mistral").stream(NAMES)
    assert stream.feed("Checking [TOOL") == ("Checking ", [])
    assert stream.feed("_CALLS][") == ("", [])
    _, [delta] = stream.feed('{"name": "get_weather", "arguments": {"city": "Paris"}}]')
    assert delta.name == "get_weather" and json.loads(delta.arguments) == PARIS


class _ByteTokenizer:
    eos_token_id = 256
    bos_token_id = None
    tokens = [bytes([i]) for i in range(256)] + [b"<eos>"]
    special_token_ids = [256]

    def __call__(self, text: bytes) -> list[int]:
        return list(text)


BYTES = llguidance.LLTokenizer(llguidance.TokenizerWrapper(_ByteTokenizer()))


def accepts(spec, text: str) -> bool:
    matcher = llguidance.LLMatcher(BYTES, grammar_for(spec))
    assert not matcher.is_error(), matcher.get_error()
    return matcher.consume_tokens(list(text.encode())) and matcher.is_accepting()


@pytest.mark.parametrize("family", sorted(PARSERS))
def test_forced_call_grammar_emits_what_the_family_parses(family):
    """required/named tool_choice: the grammar accepts the family's own way of writing the
    call (as written back into a prompt), refuses another tool, and parses back."""
    parser = parser_named(family)
    written = parser.written_calls(
        [{"function": {"name": "get_weather", "arguments": json.dumps(PARIS)}}]
    )
    named = parser.call_grammar(FNS, ["get_weather"], parallel=False)
    assert accepts(named, written), written
    assert not accepts(named, written.replace("Paris", 'Paris", "x": "1'))  # schema holds
    only_plan = parser.call_grammar(FNS, ["plan"], parallel=False)
    assert not accepts(only_plan, written)
    assert _calls(parser.parse(written, NAMES)[1]) == [("get_weather", PARIS)]


@pytest.mark.parametrize("family", ["llama3_json", "mistral", "hermes"])
def test_parallel_grammar_takes_several_calls(family):
    parser = parser_named(family)
    calls = [
        {"function": {"name": "get_weather", "arguments": json.dumps(city)}}
        for city in (PARIS, ROME)
    ]
    written = parser.written_calls(calls)
    assert accepts(parser.call_grammar(FNS, sorted(NAMES), parallel=True), written)
    assert not accepts(parser.call_grammar(FNS, sorted(NAMES), parallel=False), written)
    assert _calls(parser.parse(written, NAMES)[1]) == [
        ("get_weather", PARIS),
        ("get_weather", ROME),
    ]


def test_system_prompts_name_each_familys_format():
    assert "<tool_call>" in parser_named("hermes").system_prompt(FNS)
    assert '"parameters"' in parser_named("llama3_json").system_prompt(FNS)
    assert "[TOOL_CALLS]" in parser_named("mistral").system_prompt(FNS)


@pytest.mark.parametrize(
    ("template", "family"),
    [
        (None, "hermes"),
        ("{% for m in messages %}{{ m.content }}{% endfor %}", "hermes"),
        ("{{ '<tool_call>' }}{{ tools }}", "hermes"),
        ("{%- if tools %}[AVAILABLE_TOOLS]{% endif %}{{ '[TOOL_CALLS]' }}", "mistral"),
        ("{{- '<|python_tag|>' }}{{ tool_call.parameters }}", "llama3_json"),
        ("{%- if message.role == 'ipython' %}{{ parameters }}{% endif %}", "llama3_json"),
    ],
)
def test_family_detected_from_the_chat_template(template, family):
    assert detect(template).name == family


def test_unknown_parser_name_is_one_line():
    with pytest.raises(ValueError) as info:
        parser_named("pythonic_v9")
    assert "\n" not in str(info.value) and "hermes" in str(info.value)
