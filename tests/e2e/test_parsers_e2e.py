"""A gateway with the llama3_json tool-call parser and the qwen3 reasoning parser, in front
of the real stack (default model), driven by the official SDK: `required` and named
`tool_choice` make the model write a call in the Llama 3 JSON format (after an optional
reasoning block), read back the same whole and streamed."""

from __future__ import annotations

import json
import os

import jsonschema
import openai
import pytest
from openai_gateway_proc import gateway_process

pytestmark = pytest.mark.slow

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The current weather in a city",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 30},
                "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
            },
            "required": ["city", "unit"],
            "additionalProperties": False,
        },
    },
}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture(scope="module")
def client(request):
    if os.environ.get("TOKENYARD_E2E_GATEWAY_URL"):
        pytest.skip("needs the stack's NATS URL")
    stack = request.getfixturevalue("stack")
    settings = {"tool_call_parser": "llama3_json", "reasoning_parser": "qwen3"}
    with gateway_process(stack.nats_url, **settings) as gateway:
        yield openai.OpenAI(
            base_url=f"{gateway.url}/v1", api_key="none", max_retries=0, timeout=300
        )


def _streamed(stream) -> tuple[str, dict[int, dict], str | None]:
    reasoning, calls, finish = "", {}, None
    for chunk in stream:
        for c in chunk.choices:
            reasoning += getattr(c.delta, "reasoning_content", None) or ""
            for tc in c.delta.tool_calls or []:
                call = calls.setdefault(tc.index, {"id": tc.id, "name": "", "arguments": ""})
                call["name"] += tc.function.name or ""
                call["arguments"] += tc.function.arguments or ""
            finish = c.finish_reason or finish
    return reasoning, calls, finish


@pytest.mark.parametrize(
    "tool_choice", ["required", {"type": "function", "function": {"name": "get_weather"}}]
)
def test_forced_call_in_the_llama3_format_whole_and_streamed(client, tool_choice):
    model = client.models.list().data[0].id
    ask = dict(
        model=model,
        messages=ASK,
        tools=[WEATHER],
        tool_choice=tool_choice,
        parallel_tool_calls=False,
        max_tokens=96,
        temperature=0,
    )
    whole = client.chat.completions.create(**ask)
    choice = whole.choices[0]
    assert choice.finish_reason == "tool_calls" and not choice.message.content
    [call] = choice.message.tool_calls
    assert call.function.name == "get_weather"
    arguments = json.loads(call.function.arguments)
    jsonschema.validate(arguments, WEATHER["function"]["parameters"])

    reasoning, calls, finish = _streamed(client.chat.completions.create(**ask, stream=True))
    assert finish == "tool_calls" and list(calls) == [0]
    assert calls[0]["name"] == "get_weather" and calls[0]["id"]
    # Greedy: the same tokens, read the same way whole and streamed.
    assert json.loads(calls[0]["arguments"]) == arguments
    assert (reasoning or None) == getattr(choice.message, "reasoning_content", None)
