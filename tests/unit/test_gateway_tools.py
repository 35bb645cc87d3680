"""Tool calls and several choices through the gateway, on a scripted backend: parsing, the
OpenAI shapes (whole and streamed, as the official client reads them), usage, best_of."""

from __future__ import annotations

import json

import openai
import pytest
from fastapi.testclient import TestClient
from gateway_fakes import MODEL, FakeBackend, fake_state, text_chunks

from tokenyard.services.gateway.app import create_app
from tokenyard.services.gateway.tools import ToolStreamParser, parse

CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
    },
}
ASK = [{"role": "user", "content": "Weather in Paris?"}]


@pytest.fixture
def backend() -> FakeBackend:
    return FakeBackend()


@pytest.fixture
def oai(backend):
    state = fake_state(backend, max_model_len=4096)
    with TestClient(create_app(state.settings, state)) as http:
        yield openai.OpenAI(
            base_url="http://testserver/v1", api_key="none", http_client=http, max_retries=0
        )


def test_parse_keeps_only_valid_calls_to_known_tools():
    content, calls = parse("Sure. " + CALL + "\n" + CALL.replace("Paris", "Rome"), {"get_weather"})
    assert content == "Sure."
    assert [json.loads(c.arguments) for c in calls] == [{"city": "Paris"}, {"city": "Rome"}]
    assert len({c.id for c in calls}) == 2
    for bad in (CALL.replace("get_weather", "other"), "<tool_call>{oops</tool_call>"):
        assert parse(bad, {"get_weather"}) == (bad, [])


def test_stream_parser_holds_back_a_tag_until_it_is_one():
    parser = ToolStreamParser({"get_weather"})
    assert parser.feed("Hi <") == ("Hi ", [])
    assert parser.feed("b>") == ("<b>", [])
    assert parser.feed("<tool_") == ("", [])
    assert parser.feed('call>\n{"na') == ("", [])  # a call, but no name yet


def test_stream_parser_sends_the_name_first_then_argument_fragments():
    parser = ToolStreamParser({"get_weather"})
    deltas = [d for i in range(0, len(CALL), 5) for d in parser.feed(CALL[i : i + 5])[1]]
    head, *fragments = deltas
    assert (head.index, head.name, head.arguments) == (0, "get_weather", "")
    assert head.id and head.id.startswith("call_")
    assert len(fragments) > 1 and all(d.id is None and d.name is None for d in fragments)
    assert "".join(d.arguments for d in fragments) == parse(CALL, {"get_weather"})[1][0].arguments
    assert parser.flush() == ""


def _streamed(text: str, size: int, names: set[str]) -> tuple[str, list[tuple[str, str]]]:
    """`text` fed `size` characters at a time, reassembled as OpenAI's clients do."""
    parser = ToolStreamParser(names)
    content, calls = "", {}
    for i in range(0, len(text), size):
        piece, deltas = parser.feed(text[i : i + size])
        content += piece
        for d in deltas:
            name, args = calls.get(d.index, ("", ""))
            calls[d.index] = (name + (d.name or ""), args + d.arguments)
    content += parser.flush()
    return content, [calls[i] for i in sorted(calls)]


NESTED = (
    '<tool_call>\n{"name": "plan", "arguments": {"steps": [{"say": "a } b"}, '
    '{"say": "q\\" {"}], "n": 2}}\n</tool_call>'
)


@pytest.mark.parametrize(
    "text",
    [
        CALL,
        "Let me check. " + CALL,
        CALL + "\n" + CALL.replace("Paris", "Rome"),  # parallel calls
        NESTED,  # braces and escaped quotes inside strings
        CALL.replace('{"name": "get_weather", "arguments"', '{"arguments"')[:-13]
        + ', "name": "get_weather"}\n</tool_call>',  # arguments first: sent whole
        CALL.replace("get_weather", "other"),  # unknown tool: content
        "<tool_call>{oops</tool_call> and <b>text</b>",
        "a <tool_call> never closed",
    ],
)
def test_streamed_calls_and_content_equal_the_whole_answer(text):
    names = {"get_weather", "plan"}
    content, calls = parse(text, names)
    whole = ((content or "").strip(), [(c.name, c.arguments) for c in calls])
    for size in (1, 2, 3, 7, len(text)):
        streamed, streamed_calls = _streamed(text, size, names)
        # A stream cannot take back the space it sent before a call; the whole answer strips it.
        assert (streamed.strip(), streamed_calls) == whole, size


def test_streamed_parallel_calls_have_their_own_index_and_id():
    text = CALL + "\n" + CALL.replace("Paris", "Rome")
    parser = ToolStreamParser({"get_weather"})
    deltas = [d for i in range(0, len(text), 4) for d in parser.feed(text[i : i + 4])[1]]
    heads = [d for d in deltas if d.id]
    assert [d.index for d in heads] == [0, 1] and heads[0].id != heads[1].id
    for index, city in ((0, "Paris"), (1, "Rome")):
        args = "".join(d.arguments for d in deltas if d.index == index)
        assert json.loads(args) == {"city": city}


def test_tool_call_answer_whole_and_streamed(oai, backend):
    backend.script = text_chunks(CALL, per_chunk=7)
    out = oai.chat.completions.create(model=MODEL, messages=ASK, tools=[WEATHER])
    choice = out.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    [call] = choice.message.tool_calls
    assert call.function.name == "get_weather"
    assert json.loads(call.function.arguments) == {"city": "Paris"}
    stream = oai.chat.completions.create(model=MODEL, messages=ASK, tools=[WEATHER], stream=True)
    deltas = [c.choices[0] for c in stream if c.choices]
    head, *fragments = [tc for d in deltas for tc in (d.delta.tool_calls or [])]
    assert head.index == 0 and head.id.startswith("call_") and head.type == "function"
    assert head.function.name == "get_weather"
    assert len(fragments) > 1 and {f.index for f in fragments} == {0}
    assert all(f.id is None and f.function.name is None for f in fragments)
    arguments = head.function.arguments + "".join(f.function.arguments for f in fragments)
    assert arguments == call.function.arguments  # equal to the whole answer's
    assert not "".join(d.delta.content or "" for d in deltas)
    assert deltas[-1].finish_reason == "tool_calls"


def test_plain_text_with_tools_stays_content(oai, backend):
    backend.script = text_chunks("It is sunny <3")
    out = oai.chat.completions.create(model=MODEL, messages=ASK, tools=[WEATHER])
    assert out.choices[0].message.content == "It is sunny <3"
    assert out.choices[0].message.tool_calls is None and out.choices[0].finish_reason == "stop"


def test_n_choices_whole_and_streamed_with_summed_usage(oai, backend):
    out = oai.chat.completions.create(model=MODEL, messages=ASK, n=3, seed=7)
    assert [c.index for c in out.choices] == [0, 1, 2]
    assert all(c.message.content == "Hello world" for c in out.choices)
    assert out.usage.completion_tokens == 3 * 11 and out.usage.prompt_tokens == 5
    rids = [s[0] for s in backend.submitted]
    assert rids[1:] == [f"{rids[0]}-1", f"{rids[0]}-2"]
    assert [s[3].seed for s in backend.submitted] == [7, 8, 9]  # a seed of its own per choice
    stream = oai.chat.completions.create(
        model=MODEL, messages=ASK, n=2, stream=True, stream_options={"include_usage": True}
    )
    text: dict[int, str] = {0: "", 1: ""}
    ends = {}
    usage = None
    for chunk in stream:
        usage = chunk.usage or usage
        for c in chunk.choices:
            text[c.index] += c.delta.content or ""
            if c.finish_reason:
                ends[c.index] = c.finish_reason
    assert text == {0: "Hello world", 1: "Hello world"} and ends == {0: "stop", 1: "stop"}
    assert usage.completion_tokens == 22


def test_n_choices_start_together_on_the_first_choice_workers(oai, backend):
    for stream in (False, True):
        for seen in (backend.placements, backend.reads_before_submit, backend.streams):
            seen.clear()
        out = oai.chat.completions.create(model=MODEL, messages=ASK, n=3, stream=stream)
        if stream:
            assert len(list(out)) > 3
        # Choices 1 and 2 are sent before choice 0's first token is read, to its workers.
        assert backend.reads_before_submit == [0, 0, 0]
        assert backend.placements[0] is None  # routed
        assert backend.placements[1:] == [backend.streams[0].placement] * 2


def test_best_of_returns_the_most_likely_and_echo(oai, backend):
    backend.script = text_chunks("ab", logprobs=True)
    out = oai.completions.create(model=MODEL, prompt="Say", n=1, best_of=3, echo=True)
    assert len(out.choices) == 1 and out.choices[0].text == "Sayab"
    assert out.choices[0].logprobs is None  # used for ranking, not asked for
    assert out.usage.completion_tokens == 6 and len(backend.submitted) == 3


def test_a_tool_call_grammar_bounds_its_arguments_as_structured_outputs_do():
    from tokenyard.engine.grammar import INT_BOUND, STRING_MAX_LENGTH
    from tokenyard.services.gateway.tools import call_grammar

    params = {"type": "object", "properties": {"n": {"type": "integer"}, "s": {"type": "string"}}}
    fns = {"f": {"name": "f", "parameters": params}}
    spec = call_grammar(fns, ["f"], parallel=False)
    schema = json.loads(spec.value.split("%json ", 1)[1])
    arguments = schema["anyOf"][0]["properties"]["arguments"]["properties"]
    assert arguments["n"]["maximum"] == INT_BOUND and arguments["n"]["minimum"] == -INT_BOUND
    assert arguments["s"]["maxLength"] == STRING_MAX_LENGTH
