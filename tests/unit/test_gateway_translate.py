"""OpenAI request -> prompt ids and pb.SamplingParams, and the 400s for what cannot be served."""

from __future__ import annotations

import pytest
from gateway_fakes import BOS, CharTokenizer
from pydantic import ValidationError

from tokenyard.api_errors import ApiError
from tokenyard.services.gateway.schemas import ChatCompletionRequest, CompletionRequest
from tokenyard.services.gateway.translate import prepare_chat, prepare_completion

TOK = CharTokenizer()
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}},
            "required": ["city"],
        },
    },
}


def chat(**fields: object) -> ChatCompletionRequest:
    fields.setdefault("messages", [{"role": "user", "content": "hi"}])
    return ChatCompletionRequest(model="m", **fields)


def completion(**fields: object) -> CompletionRequest:
    fields.setdefault("prompt", "abc")
    return CompletionRequest(model="m", **fields)


def test_chat_renders_template_without_extra_special_tokens():
    prepared = prepare_chat(
        chat(messages=[{"role": "user", "content": [{"type": "text", "text": "hi"}]}]), TOK, 256
    )
    assert prepared.prompt_ids == TOK.encode("<user>hi\n<assistant>", add_special_tokens=False)
    assert BOS not in prepared.prompt_ids


def test_chat_sampling_fields_map_onto_params():
    req = chat(
        max_completion_tokens=7,
        max_tokens=99,
        temperature=0.3,
        top_p=0.9,
        seed=-1,
        stop="END",
        presence_penalty=0.5,
        frequency_penalty=-0.5,
        logprobs=True,
        top_logprobs=3,
        top_k=5,
        min_p=0.1,
        repetition_penalty=1.2,
        ignore_eos=True,
        stream=True,
        stream_options={"include_usage": True},
    )
    prepared = prepare_chat(req, TOK, 256)
    p = prepared.params
    assert p.max_tokens == 7  # max_completion_tokens wins over the deprecated max_tokens
    assert (p.temperature, p.top_p, p.top_k, p.repetition_penalty) == pytest.approx(
        (0.3, 0.9, 5, 1.2)
    )
    assert p.min_p == pytest.approx(0.1)
    assert (p.presence_penalty, p.frequency_penalty) == (0.5, -0.5)
    assert p.seed == 2**64 - 1
    assert list(p.stop) == ["END"]
    assert p.ignore_eos and p.HasField("logprobs") and p.logprobs == 3
    assert prepared.stream and prepared.include_usage


def test_defaults_are_openais():
    p = prepare_chat(chat(), TOK, 256).params
    assert (p.temperature, p.top_p, p.top_k, p.min_p, p.repetition_penalty) == (
        1.0,
        1.0,
        -1,
        0.0,
        1.0,
    )
    assert not p.HasField("seed") and not p.HasField("logprobs")
    # no max_tokens: the rest of the context, as vLLM does
    assert p.max_tokens == 256 - len(prepare_chat(chat(), TOK, 256).prompt_ids)
    assert prepare_completion(completion(), TOK, 256).params.max_tokens == 16


def test_default_max_tokens_cap_applies_only_when_unset():
    assert prepare_chat(chat(), TOK, 256, default_cap=10).params.max_tokens == 10
    assert prepare_chat(chat(max_tokens=50), TOK, 256, default_cap=10).params.max_tokens == 50


def test_completion_prompt_forms():
    assert prepare_completion(completion(prompt="ab"), TOK, 256).prompt_ids == [
        BOS,
        ord("a") + 10,
        ord("b") + 10,
    ]
    assert prepare_completion(completion(prompt=["ab"]), TOK, 256).prompt_ids == TOK.encode("ab")
    assert prepare_completion(completion(prompt=[5, 6, 7]), TOK, 256).prompt_ids == [5, 6, 7]
    assert prepare_completion(completion(prompt=[[5, 6]]), TOK, 256).prompt_ids == [5, 6]


def test_completion_logprobs_and_stop_list():
    p = prepare_completion(completion(logprobs=0, stop=["x", "", "yz"]), TOK, 256).params
    assert p.HasField("logprobs") and p.logprobs == 0
    assert list(p.stop) == ["x", "yz"]


def test_top_k_zero_means_off():
    assert prepare_chat(chat(top_k=0), TOK, 256).params.top_k == -1


def _error(fn, *args) -> ApiError:
    with pytest.raises(ApiError) as info:
        fn(*args)
    return info.value


@pytest.mark.parametrize(
    ("request_", "param", "needle"),
    [
        (chat(messages=[]), "messages", "at least one"),
        (chat(logit_bias={"a": 2.0}), "logit_bias", "token ids"),
        (chat(logit_bias={str(0x11000): 2.0}), "logit_bias", "not in"),
        (chat(tools=[{"type": "function"}]), "tools", "'type': 'function'"),
        (chat(tool_choice="required"), "tool_choice", "needs tools"),
        (
            chat(tools=[WEATHER], tool_choice={"type": "function", "function": {"name": "x"}}),
            "tool_choice",
            "not among",
        ),
        (chat(response_format={"type": "xml"}), "response_format", "json_schema"),
        (
            chat(response_format={"type": "json_object"}, guided_regex="a+"),
            "guided_regex",
            "cannot be combined",
        ),
        (chat(guided_regex="(["), "guided_regex", "invalid regex"),
        (chat(guided_json="{"), "guided_json", "not valid JSON"),
        (chat(guided_grammar="start: foo"), "guided_grammar", "invalid grammar"),
        (chat(guided_choice=[]), "guided_choice", "non-empty"),
        (chat(min_tokens=30, max_tokens=10), "min_tokens", "exceeds"),
        (chat(top_logprobs=2), "top_logprobs", "requires 'logprobs'"),
        (chat(max_tokens=250), "max_tokens", "maximum context length is 256"),
        (chat(max_completion_tokens=250), "max_completion_tokens", "maximum context length is 256"),
        (
            chat(messages=[{"role": "user", "content": "x" * 300}]),
            "messages",
            "maximum context length is 256",
        ),
    ],
)
def test_chat_rejections(request_, param, needle):
    err = _error(prepare_chat, request_, TOK, 256)
    assert err.status == 400 and err.param == param and needle in err.message
    assert err.type == "invalid_request_error"


@pytest.mark.parametrize(
    ("request_", "param", "needle"),
    [
        (completion(prompt=""), "prompt", "empty"),
        (completion(prompt=[]), "prompt", "empty"),
        (completion(prompt=["a", ""]), "prompt", "empty"),
        (completion(prompt=[[11, 12], [10**9]]), "prompt", "token ids"),
        (completion(prompt=["a"] * 9, n=128), "prompt", "more than 1024 sequences"),
        (completion(prompt=["a", "x" * 400]), "prompt", "the prompt has 401 tokens"),
        (completion(prompt=[10**9]), "prompt", "token ids"),
        (completion(echo=True, logprobs=1), "echo", "not supported"),
        (completion(suffix="}"), "suffix", "fill-in-the-middle"),
        (completion(best_of=2, n=3), "best_of", "at least n"),
        (completion(best_of=3, stream=True), "best_of", "cannot be streamed"),
        (completion(prompt="x" * 400), "prompt", "the prompt has 401 tokens"),
    ],
)
def test_completion_rejections(request_, param, needle):
    err = _error(prepare_completion, request_, TOK, 256)
    assert err.status == 400 and err.param == param and needle in err.message


@pytest.mark.parametrize(
    "fields",
    [
        {"temperature": 2.5},
        {"top_p": 0},
        {"presence_penalty": 3},
        {"n": 0},
        {"max_tokens": 0},
        {"top_logprobs": 21},
        {"messages": [{"role": "robot", "content": "x"}]},
    ],
)
def test_schema_rejects_out_of_range_values(fields):
    with pytest.raises(ValidationError):
        chat(**fields)


def test_unknown_context_length_skips_the_length_check_but_caps_nothing_silently():
    assert prepare_chat(chat(max_tokens=5), TOK, 0).params.max_tokens == 5
    err = _error(prepare_chat, chat(), TOK, 0)
    assert err.status == 503


# --- structured outputs, tools, n, echo ----------------------------------------------------


@pytest.mark.parametrize(
    ("fields", "kind", "needle"),
    [
        ({"response_format": {"type": "json_object"}}, "json_object", ""),
        (
            {
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {
                        "name": "p",
                        "schema": {"type": "object", "properties": {"a": {"type": "integer"}}},
                        "strict": True,
                    },
                }
            },
            "json_schema",
            '"a"',
        ),
        ({"guided_json": {"type": "array"}}, "json_schema", "array"),
        ({"guided_regex": "[0-9]+"}, "regex", "[0-9]+"),
        ({"guided_choice": ["yes", "no"]}, "choice", '"no"'),
        ({"guided_grammar": 'start: "a"+'}, "grammar", '"a"'),
        ({"tools": [WEATHER], "tool_choice": "required"}, "grammar", "get_weather"),
    ],
)
def test_structured_fields_become_one_checked_grammar(fields, kind, needle):
    params = prepare_chat(chat(**fields), TOK, 4096).params
    assert params.HasField("guided") and params.guided.kind == kind
    assert needle in params.guided.value


def test_response_format_text_and_auto_tools_leave_the_output_free():
    assert not prepare_chat(chat(response_format={"type": "text"}), TOK, 256).params.HasField(
        "guided"
    )
    prepared = prepare_chat(chat(tools=[WEATHER]), TOK, 4096)
    assert not prepared.params.HasField("guided")
    assert prepared.tool_names == {"get_weather"}
    assert prepare_chat(chat(tools=[WEATHER], tool_choice="none"), TOK, 4096).tool_names == set()


def test_tools_and_tool_history_are_rendered_for_a_template_without_tools():
    messages = [
        {"role": "user", "content": "Weather in Paris?"},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "c1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "c1", "content": "sunny"},
    ]
    prompt = prepare_chat(chat(messages=messages, tools=[WEATHER]), TOK, 100_000).prompt_ids
    text = "".join(TOK.token_text(t) for t in prompt)
    assert text.startswith("<system>You may call functions")
    assert '"name": "get_weather"' in text and "The weather in a city" in text
    assert (
        '<assistant><tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
        in text
    )
    assert "<tool>sunny" in text


def test_logit_bias_min_tokens_n_and_echo():
    prepared = prepare_chat(chat(logit_bias={"42": -100, "7": 5.5}, min_tokens=3, n=3), TOK, 256)
    assert dict(prepared.params.logit_bias) == {42: -100.0, 7: 5.5}
    assert prepared.params.min_tokens == 3 and prepared.n == prepared.best_of == 3
    done = prepare_completion(completion(echo=True, best_of=4, n=2), TOK, 256)
    assert done.echo == ("abc",) and done.n == 2 and done.best_of == 4
    assert done.params.logprobs == 0  # best_of ranks by logprob even when none are asked


def test_a_batch_of_prompts_gives_each_its_ids_and_echo():
    done = prepare_completion(completion(prompt=["ab", "xyz"], echo=True, max_tokens=4), TOK, 256)
    assert done.prompts == [TOK.encode("ab"), TOK.encode("xyz")]
    assert done.echo == ("ab", "xyz") and done.num_prompt_tokens == 3 + 4
    ids = prepare_completion(completion(prompt=[[11, 12], [13]]), TOK, 256)
    assert ids.prompts == [[11, 12], [13]] and ids.echo == ()
    # max_tokens left unset fills the room the longest prompt leaves
    room = prepare_completion(completion(prompt=["a", "x" * 100], max_tokens=None), TOK, 256, None)
    assert room.params.max_tokens == 256 - 101
