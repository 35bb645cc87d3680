"""The served model's parsers through the gateway, on a scripted backend, as the official
client reads them: reasoning split into `reasoning_content` (whole and streamed), tool calls
in the configured family's format read from the answer part only, the forced-call grammar
in that format after an optional reasoning block, and bad parser names refused at start."""

from __future__ import annotations

import json

import openai
import pytest
from fastapi.testclient import TestClient
from gateway_fakes import MODEL, CharTokenizer, FakeBackend, fake_state, text_chunks
from pydantic import ValidationError

from tokenyard.services.gateway.app import create_app
from tokenyard.services.gateway.settings import GatewaySettings

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
    },
}
ASK = [{"role": "user", "content": "Weather in Paris?"}]
THOUGHT = "The user wants the weather; call get_weather."
LLAMA_CALL = '{"name": "get_weather", "parameters": {"city": "Paris"}}'


@pytest.fixture
def backend() -> FakeBackend:
    return FakeBackend()


def _client(backend: FakeBackend, **settings: str):
    state = fake_state(backend, max_model_len=4096, **settings)
    http = TestClient(create_app(state.settings, state))
    return http, openai.OpenAI(
        base_url="http://testserver/v1", api_key="none", http_client=http, max_retries=0
    )


@pytest.fixture
def oai(backend):
    http, client = _client(backend, reasoning_parser="qwen3", tool_call_parser="llama3_json")
    with http:
        yield client


def test_reasoning_and_a_call_whole_and_streamed(oai, backend):
    backend.script = text_chunks(f"<think>{THOUGHT}</think>\n\n{LLAMA_CALL}", per_chunk=3)
    out = oai.chat.completions.create(model=MODEL, messages=ASK, tools=[WEATHER])
    message = out.choices[0].message
    assert message.reasoning_content == THOUGHT
    assert message.content is None and out.choices[0].finish_reason == "tool_calls"
    [call] = message.tool_calls
    assert call.function.name == "get_weather"
    assert json.loads(call.function.arguments) == {"city": "Paris"}

    stream = oai.chat.completions.create(model=MODEL, messages=ASK, tools=[WEATHER], stream=True)
    deltas = [c.choices[0] for c in stream if c.choices]
    thought = "".join(getattr(d.delta, "reasoning_content", None) or "" for d in deltas)
    assert thought == THOUGHT
    assert not "".join(d.delta.content or "" for d in deltas)
    [streamed] = [tc for d in deltas for tc in (d.delta.tool_calls or [])]
    assert (streamed.function.name, streamed.function.arguments) == (
        call.function.name,
        call.function.arguments,
    )
    assert deltas[-1].finish_reason == "tool_calls"


def test_a_call_inside_the_reasoning_is_not_a_call(oai, backend):
    backend.script = f"<think>{LLAMA_CALL}</think>It is sunny."
    out = oai.chat.completions.create(model=MODEL, messages=ASK, tools=[WEATHER])
    message = out.choices[0].message
    assert message.reasoning_content == LLAMA_CALL and message.content == "It is sunny."
    assert message.tool_calls is None and out.choices[0].finish_reason == "stop"


def test_plain_answer_has_no_reasoning_field(oai, backend):
    backend.script = "Just an answer."
    body = oai.chat.completions.with_raw_response.create(model=MODEL, messages=ASK).http_response
    message = body.json()["choices"][0]["message"]
    assert message == {"role": "assistant", "content": "Just an answer."}


def test_forced_call_grammar_is_the_familys_after_optional_reasoning(oai, backend):
    backend.script = LLAMA_CALL
    oai.chat.completions.create(model=MODEL, messages=ASK, tools=[WEATHER], tool_choice="required")
    guided = backend.submitted[-1][3].guided
    assert guided.kind == "llguidance"
    top = json.loads(guided.value)
    root = top["grammars"][0]["lark_grammar"]
    assert '"<think>"' in root and "@answer" in root
    answer = top["grammars"][1]["lark_grammar"]
    assert '"parameters"' in answer and "<tool_call>" not in answer


def test_structured_output_also_follows_reasoning(oai, backend):
    backend.script = '<think>hm</think>{"a": 1}'
    out = oai.chat.completions.create(
        model=MODEL, messages=ASK, response_format={"type": "json_object"}
    )
    assert out.choices[0].message.content == '{"a": 1}'
    assert backend.submitted[-1][3].guided.kind == "llguidance"


def test_without_parsers_settings_nothing_changes(backend):
    http, client = _client(backend)
    with http:
        backend.script = f"<think>{THOUGHT}</think>{LLAMA_CALL}"
        out = client.chat.completions.create(model=MODEL, messages=ASK, tools=[WEATHER])
        message = out.choices[0].message
        assert message.content == backend.script and message.tool_calls is None
        assert getattr(message, "reasoning_content", None) is None
        client.chat.completions.create(
            model=MODEL, messages=ASK, tools=[WEATHER], tool_choice="required"
        )
        assert backend.submitted[-1][3].guided.kind == "grammar"  # hermes, no reasoning block


def test_history_calls_are_written_in_the_familys_format(oai, backend):
    backend.script = "Done."
    history = [
        *ASK,
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
    ]
    oai.chat.completions.create(model=MODEL, messages=history, tools=[WEATHER])
    prompt = CharTokenizer().decode(backend.submitted[-1][2])
    assert LLAMA_CALL in prompt and "<tool_call>" not in prompt


@pytest.mark.parametrize(
    "settings",
    [{"tool_call_parser": "nope"}, {"reasoning_parser": "nope"}, {"reasoning_parser": "generic:x"}],
)
def test_unknown_parser_names_are_refused_at_start(settings):
    with pytest.raises(ValidationError) as info:
        GatewaySettings(**settings)
    assert "unknown" in str(info.value) or "generic:<open>,<close>" in str(info.value)


class _TemplateVariables(CharTokenizer):
    """Records the variables the chat template is rendered with."""

    def __init__(self) -> None:
        self.seen: list[dict] = []

    def encode_chat(self, messages: list[dict], **variables: object) -> list[int]:
        self.seen.append(variables)
        return super().encode_chat(messages)


def test_chat_template_kwargs_reach_the_template_and_bad_ones_are_400(backend):
    state = fake_state(backend, max_model_len=4096, reasoning_parser="qwen3")
    state.tokenizer = tokenizer = _TemplateVariables()
    with TestClient(create_app(state.settings, state)) as http:
        client = openai.OpenAI(
            base_url="http://testserver/v1", api_key="none", http_client=http, max_retries=0
        )
        off = {"chat_template_kwargs": {"enable_thinking": False}}
        client.chat.completions.create(model=MODEL, messages=ASK, extra_body=off)
        assert tokenizer.seen[-1] == {"enable_thinking": False}
        for kwargs in ({"enable_thinking": "<|im_start|>system"}, {"add_generation_prompt": 0}):
            with pytest.raises(openai.BadRequestError) as info:
                client.chat.completions.create(
                    model=MODEL, messages=ASK, extra_body={"chat_template_kwargs": kwargs}
                )
            assert info.value.body["param"] == "chat_template_kwargs"


def test_reasoning_effort_is_refused_naming_the_field(oai):
    with pytest.raises(openai.BadRequestError) as info:
        oai.chat.completions.create(model=MODEL, messages=ASK, reasoning_effort="low")
    assert info.value.body["param"] == "reasoning_effort"


def test_include_reasoning_false_leaves_the_thinking_out(oai, backend):
    backend.script = text_chunks(f"<think>{THOUGHT}</think>\n\nIt is sunny.", per_chunk=3)
    extra = {"include_reasoning": False}
    out = oai.chat.completions.create(model=MODEL, messages=ASK, extra_body=extra)
    message = out.choices[0].message
    assert getattr(message, "reasoning_content", None) is None
    assert message.content == "It is sunny."
    stream = oai.chat.completions.create(model=MODEL, messages=ASK, stream=True, extra_body=extra)
    deltas = [c.choices[0].delta for c in stream if c.choices]
    assert not any(getattr(d, "reasoning_content", None) for d in deltas)
    assert "".join(d.content or "" for d in deltas) == "It is sunny."
