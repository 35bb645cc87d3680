"""The Responses API's pure parts: items -> chat messages, a request -> the chat request,
errors named by this API's fields, and the Response and its stream built from chunks."""

from __future__ import annotations

import json

import pytest
from gateway_fakes import MODEL, CharTokenizer, text_chunks

from tokenyard.api_errors import ApiError
from tokenyard.services.gateway.responses import Accumulator
from tokenyard.services.gateway.responses_api.format import ResponsesFormat
from tokenyard.services.gateway.responses_api.schemas import ResponsesRequest, ResponseStreamEvent
from tokenyard.services.gateway.responses_api.translate import (
    chat_messages,
    chat_request,
    prepare_response,
)

WEATHER = {
    "type": "function",
    "name": "get_weather",
    "description": "The weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
    "strict": True,
}


def request(**fields) -> ResponsesRequest:
    return ResponsesRequest.model_validate({"model": MODEL, **fields})


def test_items_become_chat_messages_with_calls_joined_to_their_assistant_turn():
    items = [
        {"type": "message", "role": "user", "content": "weather?"},
        {
            "type": "message",
            "role": "assistant",
            "content": [{"type": "output_text", "text": "Let me see."}],
        },
        {
            "type": "function_call",
            "call_id": "c1",
            "name": "get_weather",
            "arguments": '{"city":"Paris"}',
        },
        {
            "type": "function_call",
            "call_id": "c2",
            "name": "get_weather",
            "arguments": '{"city":"Rome"}',
        },
        {"type": "function_call_output", "call_id": "c1", "output": "sunny"},
        {
            "type": "function_call_output",
            "call_id": "c2",
            "output": [{"type": "input_text", "text": "rain"}],
        },
    ]
    messages = chat_messages(items)
    assert [m["role"] for m in messages] == ["user", "assistant", "tool", "tool"]
    assert messages[1]["content"] == "Let me see."
    assert [c["id"] for c in messages[1]["tool_calls"]] == ["c1", "c2"]
    assert messages[1]["tool_calls"][1]["function"] == {
        "name": "get_weather",
        "arguments": '{"city":"Rome"}',
    }
    assert messages[3] == {"role": "tool", "tool_call_id": "c2", "content": "rain"}


def test_a_call_without_an_assistant_text_starts_its_own_message():
    items = [
        {"role": "user", "content": "hi"},
        {"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{}"},
    ]
    assert chat_messages(items)[1] == {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}
        ],
    }


def test_an_output_for_no_earlier_call_is_refused_naming_its_item():
    items = [{"type": "function_call_output", "call_id": "nope", "output": "1"}]
    with pytest.raises(ApiError) as err:
        chat_messages(items)
    assert err.value.status == 400 and err.value.param == "input.0.call_id"


def test_request_fields_map_onto_the_chat_request():
    req = request(
        input="Weather in Paris?",
        instructions="Be brief.",
        tools=[WEATHER],
        tool_choice={"type": "function", "name": "get_weather"},
        parallel_tool_calls=False,
        max_output_tokens=20,
        temperature=0.5,
        text={"format": {"type": "json_schema", "name": "x", "schema": {"type": "object"}}},
    )
    chat = chat_request(req, [{"type": "message", "role": "user", "content": "Weather in Paris?"}])
    assert [(m.role, m.content) for m in chat.messages] == [
        ("system", "Be brief."),
        ("user", "Weather in Paris?"),
    ]
    assert chat.tools == [
        {
            "type": "function",
            "function": {
                "name": "get_weather",
                "description": "The weather in a city",
                "parameters": WEATHER["parameters"],
            },
        }
    ]
    assert chat.tool_choice == {"type": "function", "function": {"name": "get_weather"}}
    assert chat.parallel_tool_calls is False
    assert chat.max_completion_tokens == 20 and chat.temperature == 0.5
    assert chat.response_format == {
        "type": "json_schema",
        "json_schema": {"name": "x", "schema": {"type": "object"}, "strict": None},
    }


def test_history_comes_before_the_new_input_and_instructions_are_not_carried():
    history = [
        {"type": "message", "role": "user", "content": "first"},
        {
            "type": "message",
            "role": "assistant",
            "content": [{"type": "output_text", "text": "one"}],
        },
    ]
    prepared, context = prepare_response(request(input="second"), history, CharTokenizer(), 256)
    prompt = CharTokenizer().decode(prepared.prompt_ids)
    assert prompt == "<user>first\n<assistant>one\n<user>second\n<assistant>"
    assert context == [*history, {"type": "message", "role": "user", "content": "second"}]


def test_chat_errors_name_this_apis_fields():
    with pytest.raises(ApiError) as err:
        prepare_response(request(input="hi", max_output_tokens=1000), [], CharTokenizer(), 64)
    assert err.value.param == "max_output_tokens"
    assert "max_output_tokens" in err.value.message and "max_completion" not in err.value.message
    with pytest.raises(ApiError) as err:
        prepare_response(request(), [], CharTokenizer(), 64)
    assert err.value.param == "input"
    bad_schema = {"format": {"type": "json_schema", "name": "x", "schema": {"type": "nonsense"}}}
    with pytest.raises(ApiError) as err:
        prepare_response(request(input="hi", text=bad_schema), [], CharTokenizer(), 64)
    assert err.value.param == "text.format"


# --- the Response and its stream -----------------------------------------------------------


def accumulated(chunks) -> list[Accumulator]:
    acc = Accumulator()
    for chunk in chunks:
        acc.add(chunk)
    return [acc]


def streamed(fmt: ResponsesFormat, chunks) -> list[dict]:
    events = [*fmt.start()]
    for chunk in chunks:
        events.extend(fmt.events(chunk))
    events.extend(fmt.end(accumulated(chunks), 5))
    parsed = []
    for event in events:
        kind, data = event.strip().split("\n")
        body = json.loads(data.removeprefix("data: "))
        assert kind == f"event: {body['type']}"
        ResponseStreamEvent.model_validate(body)  # the documented event schema
        parsed.append(body)
    return parsed


def test_whole_answer_splits_text_and_calls_into_items():
    text = (
        'Sure.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
    )
    req = request(input="hi", tools=[WEATHER])
    fmt = ResponsesFormat(
        rid="resp_1", request=req, created=1, tool_names=frozenset({"get_weather"})
    )
    out = fmt.complete(accumulated(text_chunks(text, per_chunk=7)), 5)
    assert out.status == "completed"
    assert [item.type for item in out.output] == ["message", "function_call"]
    assert out.output[0].content[0].text == "Sure."
    call = out.output[1]
    assert (call.name, json.loads(call.arguments)) == ("get_weather", {"city": "Paris"})
    assert out.usage.input_tokens == 5 and out.usage.output_tokens == len(text)


def test_stream_events_are_numbered_and_add_up_to_the_final_response():
    req = request(input="hi", stream=True)
    fmt = ResponsesFormat(rid="resp_1", request=req, created=1)
    events = streamed(fmt, text_chunks("Hello world", per_chunk=3))
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    assert [e["type"] for e in events[:4]] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
    ]
    assert [e["type"] for e in events[-4:]] == [
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.completed",
    ]
    deltas = "".join(e["delta"] for e in events if e["type"] == "response.output_text.delta")
    final = events[-1]
    assert final["type"] == "response.completed"
    assert deltas == "Hello world" == final["response"]["output"][0]["content"][0]["text"]
    assert final["response"]["output"][0]["status"] == "completed"


def test_streamed_call_arguments_match_the_whole_answer():
    text = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
    names = frozenset({"get_weather"})
    req = request(input="hi", tools=[WEATHER], stream=True)
    events = streamed(ResponsesFormat("resp_1", req, 1, names), text_chunks(text, per_chunk=4))
    kinds = [e["type"] for e in events]
    assert "response.output_text.delta" not in kinds  # whitespace alone opens no message
    added = next(e for e in events if e["type"] == "response.output_item.added")
    assert added["item"]["type"] == "function_call" and added["item"]["name"] == "get_weather"
    args = "".join(
        e["delta"] for e in events if e["type"] == "response.function_call_arguments.delta"
    )
    done = next(e for e in events if e["type"] == "response.function_call_arguments.done")
    whole = ResponsesFormat("resp_2", request(input="hi", tools=[WEATHER]), 1, names).complete(
        accumulated(text_chunks(text)), 5
    )
    assert json.loads(args) == json.loads(done["arguments"]) == {"city": "Paris"}
    assert done["arguments"] == whole.output[0].arguments
    assert events[-1]["response"]["output"][0]["arguments"] == args


def test_max_output_tokens_ends_incomplete():
    req = request(input="hi", stream=True, max_output_tokens=4)
    events = streamed(ResponsesFormat("resp_1", req, 1), text_chunks("abcd", reason="length"))
    last = events[-1]
    assert last["type"] == "response.incomplete"
    assert last["response"]["incomplete_details"] == {"reason": "max_output_tokens"}
    assert last["response"]["output"][0]["status"] == "incomplete"
