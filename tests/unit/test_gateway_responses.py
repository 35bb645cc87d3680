"""TokenChunks -> OpenAI JSON and SSE: ordering, logprob shapes, usage, finish reasons."""

from __future__ import annotations

import json

from gateway_fakes import CharTokenizer, text_chunks

from tokenyard.services.gateway.responses import (
    Accumulator,
    ChatFormat,
    ChunkOrderer,
    CompletionFormat,
    completion_logprobs,
)
from tokenyard.v1 import serving_pb2 as pb

TOK = CharTokenizer()


def events(payloads: list[str]) -> list[dict | str]:
    out = []
    for p in payloads:
        assert p.startswith("data: ") and p.endswith("\n\n")
        body = p[len("data: ") : -2]
        out.append(body if body == "[DONE]" else json.loads(body))
    return out


def test_orderer_reorders_and_drops_duplicates():
    a, b, c = text_chunks("abcdef", per_chunk=2)
    orderer = ChunkOrderer()
    assert orderer.push(b) == []  # waits for index 0
    assert [x.index for x in orderer.push(a)] == [0, 2]
    assert orderer.push(a) == [] and orderer.push(b) == []  # redelivered
    assert [x.index for x in orderer.push(c)] == [4]
    assert orderer.finished and orderer.push(c) == []


def test_orderer_releases_an_empty_final_chunk():
    first = text_chunks("ab", per_chunk=2)[0]
    first.finished = False
    end = pb.TokenChunk(index=2, finished=True, finish_reason="stop")
    orderer = ChunkOrderer()
    assert orderer.push(end) == []
    assert [x.index for x in orderer.push(first)] == [0, 2]
    assert orderer.finished


def run(fmt, chunks) -> tuple[list, Accumulator]:
    acc = Accumulator()
    out = list(fmt.start())
    for chunk in chunks:
        acc.add(chunk)
        out.extend(fmt.events(chunk))
    out.extend(fmt.end([acc], 5))
    return events(out), acc


def test_chat_stream_shape_with_usage():
    fmt = ChatFormat("id1", "m", 1, TOK, logprobs=False, include_usage=True)
    evs, _ = run(fmt, text_chunks("Hello", per_chunk=2, cached=3))
    assert evs[-1] == "[DONE]"
    first, *content, finish, usage = evs[:-1]
    assert first["object"] == "chat.completion.chunk"
    assert first["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert "".join(e["choices"][0]["delta"]["content"] for e in content) == "Hello"
    assert all(e["usage"] is None for e in [first, *content, finish])
    assert finish["choices"][0]["finish_reason"] == "stop" and finish["choices"][0]["delta"] == {}
    assert all("role" not in e["choices"][0]["delta"] for e in content)
    assert usage["choices"] == []
    assert usage["usage"] == {
        "prompt_tokens": 5,
        "completion_tokens": 5,
        "total_tokens": 10,
        "prompt_tokens_details": {"cached_tokens": 3},
    }


def test_chat_stream_without_usage_has_no_usage_field():
    fmt = ChatFormat("id1", "m", 1, TOK, logprobs=False, include_usage=False)
    evs, _ = run(fmt, text_chunks("Hi"))
    assert all("usage" not in e for e in evs[:-1])


def test_chat_complete_with_logprobs():
    fmt = ChatFormat("id1", "m", 1, TOK, logprobs=True, include_usage=False)
    _, acc = run(fmt, text_chunks("hé", logprobs=True, reason="length"))
    body = fmt.complete([acc], 5).model_dump()
    choice = body["choices"][0]
    assert body["object"] == "chat.completion"
    assert choice["message"] == {"role": "assistant", "content": "hé"}
    assert choice["finish_reason"] == "length"
    content = choice["logprobs"]["content"]
    assert [c["token"] for c in content] == ["h", "é"]
    assert content[1]["bytes"] == list("é".encode())
    assert content[0]["top_logprobs"] == [{"token": "h", "logprob": -0.5, "bytes": [104]}]
    assert body["usage"]["total_tokens"] == 7


def test_completion_logprobs_offsets_count_characters():
    lps = [pb.TokenLogprob(token_id=ord(c) + 10, logprob=-1.0) for c in "abc"]
    shaped = completion_logprobs(lps, TOK, offset=4)
    assert shaped.tokens == ["a", "b", "c"]
    assert shaped.text_offset == [4, 5, 6]
    assert shaped.token_logprobs == [-1.0, -1.0, -1.0]
    assert shaped.top_logprobs == [{}, {}, {}]


def test_a_special_token_is_listed_but_takes_no_room_in_the_text():
    # the text skips special tokens (an end of turn generated under ignore_eos)
    lps = [pb.TokenLogprob(token_id=ord(c) + 10, logprob=-1.0) for c in "ab"]
    lps.append(pb.TokenLogprob(token_id=2, token="<eos>", logprob=-0.5))
    lps.append(pb.TokenLogprob(token_id=ord("c") + 10, logprob=-1.0))
    shaped = completion_logprobs(lps, TOK)
    assert shaped.tokens == ["a", "b", "<eos>", "c"]
    assert shaped.text_offset == [0, 1, 2, 2]


def test_completion_stream_and_whole():
    fmt = CompletionFormat("c1", "m", 1, TOK, logprobs=True, include_usage=True)
    evs, acc = run(fmt, text_chunks("abcd", per_chunk=2, logprobs=True))
    assert [e["object"] for e in evs[:-1]] == ["text_completion"] * 3
    assert [e["choices"][0]["logprobs"]["text_offset"] for e in evs[:2]] == [[0, 1], [2, 3]]
    assert evs[1]["choices"][0]["finish_reason"] == "stop"
    assert evs[2]["choices"] == [] and evs[2]["usage"]["completion_tokens"] == 4
    whole = fmt.complete([acc], 5).model_dump()
    assert whole["choices"][0]["text"] == "abcd"
    assert whole["choices"][0]["logprobs"]["tokens"] == ["a", "b", "c", "d"]


def test_internal_finish_reasons_never_leak():
    chunk = text_chunks("a", reason="prefilled")[0]
    acc = Accumulator()
    acc.add(chunk)
    assert acc.finish_reason == "stop"
