"""The Responses API on a real stack (gateway -> router -> prefill -> decode over NATS, the
real model on the CPU): the official `openai` SDK's `responses.create` and
`responses.stream`, a stored conversation continued by `previous_response_id`, structured
output through `text.format`, and an OpenAI Agents SDK agent that calls a function tool.

Uses the suite's `stack` fixture, or with TOKENYARD_E2E_GATEWAY_URL set, a running stack.
"""

from __future__ import annotations

import asyncio
import json

import jsonschema
import openai
import pytest
from agents import (
    Agent,
    ModelSettings,
    OpenAIResponsesModel,
    Runner,
    function_tool,
    set_tracing_disabled,
)
from pydantic import BaseModel, Field

pytestmark = pytest.mark.slow


class City(BaseModel):
    name: str = Field(max_length=30)
    country: str = Field(max_length=30)


def test_create_and_stream_agree_and_a_conversation_continues(client, model):
    ask = {"model": model, "input": "Name three colors.", "max_output_tokens": 12, "temperature": 0}
    whole = client.responses.create(**ask, instructions="Answer briefly.")
    assert whole.status in ("completed", "incomplete") and whole.output_text
    assert 0 < whole.usage.output_tokens <= 12

    with client.responses.stream(**ask, instructions="Answer briefly.") as stream:
        kinds = []
        deltas = []
        for event in stream:
            kinds.append(event.type)
            if event.type == "response.output_text.delta":
                deltas.append(event.delta)
        final = stream.get_final_response() if "response.completed" in kinds else None
    assert kinds[:2] == ["response.created", "response.in_progress"]
    assert kinds[-1] in ("response.completed", "response.incomplete")
    assert "".join(deltas) == whole.output_text  # temperature 0: the same answer

    follow = client.responses.create(
        model=model,
        input="Which of them is the warmest?",
        previous_response_id=whole.id,
        max_output_tokens=8,
        temperature=0,
    )
    assert follow.previous_response_id == whole.id and follow.output_text
    # The stored conversation: the first question, its answer, the new question.
    items = client.responses.input_items.list(follow.id).data
    assert [item.role for item in items] == ["user", "assistant", "user"]
    alone = client.responses.create(
        model=model, input="Which of them is the warmest?", max_output_tokens=1, store=False
    )
    assert follow.usage.input_tokens > alone.usage.input_tokens + whole.usage.output_tokens
    assert client.responses.retrieve(whole.id).output_text == whole.output_text
    client.responses.delete(whole.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(whole.id)
    if final is not None:
        assert final.output_text == whole.output_text


def test_structured_output_through_text_format(client, model):
    out = client.responses.parse(
        model=model,
        input="Describe the city of Paris.",
        text_format=City,
        max_output_tokens=48,
        temperature=0,
    )
    jsonschema.validate(json.loads(out.output_text), City.model_json_schema())
    assert isinstance(out.output_parsed, City)


def test_forced_function_call_and_its_output(client, model):
    tool = {
        "type": "function",
        "name": "get_weather",
        "description": "The current weather in a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 30}},
            "required": ["city"],
            "additionalProperties": False,
        },
        "strict": True,
    }
    # One call (not parallel: the grammar would allow call after call up to the token cap).
    ask = {
        "model": model,
        "tools": [tool],
        "tool_choice": "required",
        "parallel_tool_calls": False,
        "max_output_tokens": 64,
        "temperature": 0,
    }
    called = client.responses.create(**ask, input="What is the weather in Paris?")
    calls = [item for item in called.output if item.type == "function_call"]
    assert calls and calls[0].name == "get_weather"
    assert set(json.loads(calls[0].arguments)) == {"city"}
    answer = client.responses.create(
        model=model,
        previous_response_id=called.id,
        input=[{"type": "function_call_output", "call_id": calls[0].call_id, "output": "22 C"}],
        max_output_tokens=16,
        temperature=0,
    )
    assert answer.output_text


def test_agents_sdk_runs_a_tool_using_agent(url, model):
    set_tracing_disabled(True)  # nothing leaves this machine
    seen: list[str] = []

    @function_tool(is_enabled=lambda ctx, agent: not seen)
    def get_weather(city: str) -> str:
        """The current weather in a city."""
        seen.append(city)
        return f"It is 22 C and sunny in {city}."

    # NOTE: the tool is forced on the first turn (a small model may not call it by itself)
    # and is off once it ran, so the second turn must answer in words: deterministic.
    agent = Agent(
        name="weather",
        instructions="You answer questions about the weather.",
        tools=[get_weather],
        model=OpenAIResponsesModel(
            model=model,
            openai_client=openai.AsyncOpenAI(
                base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=300
            ),
        ),
        model_settings=ModelSettings(tool_choice="get_weather", temperature=0, max_tokens=128),
    )
    result = asyncio.run(Runner.run(agent, "What is the weather in Paris?", max_turns=4))
    assert len(seen) == 1 and seen[0]
    kinds = [item.type for item in result.new_items]
    assert kinds[:2] == ["tool_call_item", "tool_call_output_item"]
    assert kinds[-1] == "message_output_item" and result.final_output
