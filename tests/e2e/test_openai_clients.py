"""Structured outputs, tool calls and several choices on a real stack (prefill -> decode
hand-off on every request), driven by the clients applications use: the official `openai`
SDK and `langchain-openai`. Every JSON answer is validated with jsonschema."""

from __future__ import annotations

import json
import re
from pathlib import Path

import jsonschema
import pytest
from langchain_openai import ChatOpenAI
from pydantic import BaseModel, Field

pytestmark = pytest.mark.slow


class City(BaseModel):
    name: str = Field(max_length=30)
    country: str = Field(max_length=30)
    population: int = Field(ge=0, le=99_999_999)  # a small model repeats digits otherwise


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
ASK_CITY = [{"role": "user", "content": "Describe the city of Paris."}]
ASK_WEATHER = [{"role": "user", "content": "What is the weather in Paris?"}]


def test_sdk_parse_with_a_pydantic_model(client, model):
    out = client.chat.completions.parse(
        model=model, messages=ASK_CITY, response_format=City, max_tokens=48, temperature=0
    )
    choice = out.choices[0]
    assert isinstance(choice.message.parsed, City)
    jsonschema.validate(json.loads(choice.message.content), City.model_json_schema())


def test_json_cut_by_max_tokens_is_length_and_still_valid(client, model):
    schema = City.model_json_schema()
    out = client.chat.completions.create(
        model=model,
        messages=ASK_CITY,
        max_tokens=3,
        temperature=0,
        response_format={
            "type": "json_schema",
            "json_schema": {"name": "city", "schema": schema, "strict": True},
        },
    )
    assert out.choices[0].finish_reason == "length"
    jsonschema.validate(json.loads(out.choices[0].message.content), schema)


def test_sdk_streamed_required_tool_call(client, model):
    stream = client.chat.completions.create(
        model=model,
        messages=ASK_WEATHER,
        tools=[WEATHER],
        tool_choice="required",
        parallel_tool_calls=False,
        max_tokens=48,
        temperature=0,
        stream=True,
    )
    calls: dict[int, dict] = {}
    argument_deltas = 0
    finish = None
    for chunk in stream:
        for c in chunk.choices:
            for tc in c.delta.tool_calls or []:
                call = calls.setdefault(tc.index, {"id": tc.id, "name": "", "arguments": ""})
                call["name"] += tc.function.name or ""
                call["arguments"] += tc.function.arguments or ""
                argument_deltas += bool(tc.function.arguments)
            finish = c.finish_reason or finish
    assert finish == "tool_calls" and len(calls) == 1
    assert calls[0]["name"] == "get_weather" and calls[0]["id"]
    assert argument_deltas > 1  # the arguments arrive as they are generated
    jsonschema.validate(json.loads(calls[0]["arguments"]), WEATHER["function"]["parameters"])


def test_n_choices_share_the_prompt_and_each_follow_the_grammar(client, model):
    out = client.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": "Is the sky blue?"}],
        n=3,
        temperature=1.0,
        seed=5,
        max_tokens=4,
        extra_body={"guided_choice": ["yes", "no", "maybe"]},
    )
    assert [c.index for c in out.choices] == [0, 1, 2]
    assert all(c.message.content in ("yes", "no", "maybe") for c in out.choices)
    assert out.usage.completion_tokens >= 3  # summed over the choices
    assert out.usage.prompt_tokens_details.cached_tokens > 0  # choices 1, 2 reused choice 0's KV


def test_langchain_structured_output(url, model):
    llm = ChatOpenAI(
        model=model, base_url=f"{url}/v1", api_key="none", temperature=0, max_tokens=48
    )
    city = llm.with_structured_output(City).invoke("Describe the city of Paris.")
    assert isinstance(city, City)
    jsonschema.validate(city.model_dump(), City.model_json_schema())


def test_langchain_bind_tools(url, model):
    def get_weather(city: str, unit: str) -> str:
        """The current weather in a city.

        Args:
            city: the city
            unit: celsius or fahrenheit
        """
        return "sunny"

    llm = ChatOpenAI(
        model=model, base_url=f"{url}/v1", api_key="none", temperature=0, max_tokens=48
    )
    message = llm.bind_tools([get_weather], tool_choice="get_weather").invoke(
        "What is the weather in Paris?"
    )
    [call] = message.tool_calls
    assert call["name"] == "get_weather"
    schema = {
        "type": "object",
        "properties": {"city": {"type": "string"}, "unit": {"type": "string"}},
        "required": ["city", "unit"],
    }
    jsonschema.validate(call["args"], schema)


def readme_parse_example() -> str:
    """The README's `parse()` example, as a user copies it."""
    readme = (Path(__file__).resolve().parents[2] / "README.md").read_text()
    blocks = re.findall(r"```python\n(.*?)```", readme, re.DOTALL)
    [example] = [b for b in blocks if "completions.parse(" in b]
    return example


def test_the_readmes_parse_example_succeeds_at_its_max_tokens(url, model, capsys):
    example = readme_parse_example()
    assert "max_tokens=100" in example and 'model="SmolLM2-135M-Instruct"' in example
    code = example.replace("http://127.0.0.1:8000", url).replace("SmolLM2-135M-Instruct", model)
    # Sampled (the SDK's default temperature): a number once ran to max_tokens 2 times in 3.
    for _ in range(3):
        exec(compile(code, "README.md", "exec"), {"__name__": "readme"})  # noqa: S102
        assert "population_millions=" in capsys.readouterr().out
