"""Workload generators: deterministic per seed, the right shapes, the SSE reader."""

import json

import pytest

from tokenyard.bench import text, workloads
from tokenyard.bench.sse import SSEParser
from tokenyard.bench.workloads import Conversation, Session, Turn, WorkloadOptions


@pytest.mark.parametrize("name", ["chat", "shared-prefix", "multi-turn", "long-context"])
def test_generators_are_deterministic_per_seed(name):
    opts = WorkloadOptions(num_requests=12, seed=3, context_len=300)
    assert workloads.build(name, opts) == workloads.build(name, opts)
    other = WorkloadOptions(num_requests=12, seed=4, context_len=300)
    assert workloads.build(name, opts) != workloads.build(name, other)
    assert sum(len(s.turns) for s in workloads.build(name, opts)) == 12


def test_chat_lengths_follow_the_median():
    sessions = workloads.build(
        "chat", WorkloadOptions(num_requests=400, input_len=200, output_len=50)
    )
    outs = sorted(s.turns[0].max_tokens for s in sessions)
    assert 40 <= outs[200] <= 60
    assert outs[-1] > 2 * outs[200] > 4 * outs[0]  # a spread, not a constant
    words = sorted(len(s.turns[0].user.split()) for s in sessions)
    assert 0.8 * 200 / text.TOKENS_PER_WORD <= words[200] <= 1.3 * 200 / text.TOKENS_PER_WORD
    fixed = workloads.build("chat", WorkloadOptions(num_requests=5, output_len=32, len_sigma=0))
    assert {s.turns[0].max_tokens for s in fixed} == {32}


def test_shared_prefix_shares_one_long_system_prompt():
    sessions = workloads.build("shared-prefix", WorkloadOptions(num_requests=5, prefix_len=500))
    systems = {s.prelude[0]["content"] for s in sessions}
    assert len(systems) == 1 and sessions[0].prelude[0]["role"] == "system"
    assert len(systems.pop().split()) >= 500 / text.TOKENS_PER_WORD
    assert len({s.turns[0].user for s in sessions}) == 5


def test_multi_turn_splits_requests_into_conversations():
    sessions = workloads.build("multi-turn", WorkloadOptions(num_requests=10, turns=4))
    assert [len(s.turns) for s in sessions] == [4, 4, 2]


def test_long_context_documents_differ_and_are_long():
    sessions = workloads.build("long-context", WorkloadOptions(num_requests=3, context_len=2000))
    users = [s.turns[0].user for s in sessions]
    assert len(set(users)) == 3
    assert all(len(u.split()) >= 2000 / text.TOKENS_PER_WORD for u in users)


def test_conversation_resends_history_with_real_replies():
    session = Session(({"role": "system", "content": "sys"},), (Turn("q1", 5), Turn("q2", 6)))
    conv = Conversation(session)
    first, max_tokens = conv.next_request()
    assert [m["content"] for m in first] == ["sys", "q1"] and max_tokens == 5
    conv.add_reply("answer one")
    second, _ = conv.next_request()
    assert [m["role"] for m in second] == ["system", "user", "assistant", "user"]
    assert second[2]["content"] == "answer one"
    assert conv.done()


def test_dataset_jsonl(tmp_path):
    path = tmp_path / "prompts.jsonl"
    lines = [
        {"prompt": "hello there", "max_tokens": 7},
        {"messages": [{"role": "system", "content": "s"}, {"role": "user", "content": "u"}]},
    ]
    path.write_text("\n".join(json.dumps(x) for x in lines) + "\n\n")
    sessions = workloads.build(
        "dataset", WorkloadOptions(num_requests=3, dataset=path, output_len=9)
    )
    assert sessions[0] == Session((), (Turn("hello there", 7),))
    assert sessions[1] == Session(({"role": "system", "content": "s"},), (Turn("u", 9),))
    assert sessions[2] == sessions[0]  # cycled
    path.write_text('{"text": "no"}\n')
    with pytest.raises(ValueError, match="prompts.jsonl:1"):
        workloads.build("dataset", WorkloadOptions(num_requests=1, dataset=path))


def test_render_prompt_for_completions():
    assert workloads.render_prompt([{"role": "user", "content": "verbatim"}]) == "verbatim"
    rendered = workloads.render_prompt(
        [{"role": "system", "content": "s"}, {"role": "user", "content": "u"}]
    )
    assert rendered == "System: s\n\nUser: u\n\nAssistant:"


def test_sse_parser_stamps_lines_with_the_bytes_that_completed_them():
    parser = SSEParser()
    assert parser.feed(b'data: {"a"', 1) == []
    events = parser.feed(b": 1}\r\n\r\n: keep-alive\n\nevent: x\ndata: [DONE]\n", 2)
    assert [(e.t_ns, e.data) for e in events] == [(2, '{"a": 1}'), (2, "[DONE]")]
    assert parser.feed(b"data: tail", 3) == []
    assert [(e.t_ns, e.data) for e in parser.flush(4)] == [(4, "tail")]


def test_token_counter_uses_the_project_tokenizer_when_it_loads():
    from tokenyard.bench.records import TokenCounter

    count = TokenCounter().count("hello world, this is a test")
    assert count is not None, "the default model's tokenizer did not load (make setup installs it)"
    assert 5 <= count <= 10  # 7 with SmolLM2's BPE; no BOS counted


def test_generated_lengths_match_the_tokenizer():
    import random

    from tokenyard.bench.records import TokenCounter

    count = TokenCounter().count(text.text_of_tokens(random.Random(0), 1000))
    assert count is not None, "the default model's tokenizer did not load (make setup installs it)"
    assert 900 <= count <= 1100
