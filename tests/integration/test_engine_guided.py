"""Guided decoding on the real default model: outputs follow their grammar in a mixed batch,
when cut by max_tokens, and across a prefill-to-decode hand-off; logit_bias and min_tokens."""

from __future__ import annotations

import json

import jsonschema
import pytest

from tokenyard.engine.sampling_params import GuidedSpec, SamplingParams

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 24},
        "age": {"type": "integer"},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 12}, "maxItems": 2},
    },
    "required": ["name", "age", "tags"],
    "additionalProperties": False,
}
ASK = [{"role": "user", "content": "Describe a person as JSON with name, age and tags."}]


def run(engine, requests: dict[str, SamplingParams], prompt=ASK) -> dict[str, tuple[str, str, int]]:
    for rid, params in requests.items():
        engine.add_request(rid, prompt, params)
    text = {rid: "" for rid in requests}
    ends: dict[str, tuple[str, str, int]] = {}
    while engine.has_unfinished():
        for o in engine.step():
            text[o.request_id] += o.new_text
            if o.finished:
                ends[o.request_id] = (text[o.request_id], o.finish_reason, o.num_output_tokens)
    return ends


def person(**kw) -> SamplingParams:
    return SamplingParams(guided=GuidedSpec("json_schema", json.dumps(PERSON)), **kw)


@pytest.mark.slow
def test_mixed_batch_follows_each_grammar(engine):
    ends = run(
        engine,
        {
            "greedy": person(max_tokens=48, temperature=0),
            "seeded": person(max_tokens=48, temperature=0.7, seed=2),
            "free": SamplingParams(max_tokens=16, temperature=0),
            "choice": SamplingParams(
                max_tokens=8, temperature=1.0, seed=3, guided=GuidedSpec("choice", '["yes", "no"]')
            ),
            "regex": SamplingParams(
                max_tokens=16, temperature=0, guided=GuidedSpec("regex", "[0-9]{3}-[0-9]{4}")
            ),
            "object": SamplingParams(
                max_tokens=32, temperature=0, guided=GuidedSpec("json_object")
            ),
        },
    )
    for rid in ("greedy", "seeded"):
        jsonschema.validate(json.loads(ends[rid][0]), PERSON)
    assert ends["greedy"][1] == "stop"
    assert ends["choice"][0] in ("yes", "no")
    assert len(ends["regex"][0]) == 8 and ends["regex"][0][3] == "-"
    assert ends["regex"][0].replace("-", "").isdigit()
    assert isinstance(json.loads(ends["object"][0]), dict)
    assert not ends["free"][0].startswith("{")  # the free row was not masked by its neighbours
    engine.block_manager.check_no_leaks()


@pytest.mark.parametrize("max_tokens", [1, 6])
def test_cut_by_max_tokens_still_validates(engine, max_tokens):
    text, reason, n = run(engine, {"cut": person(max_tokens=max_tokens, temperature=0)})["cut"]
    assert reason == "length"
    jsonschema.validate(json.loads(text), PERSON)
    assert n >= max_tokens


@pytest.mark.slow
def test_grammar_survives_handoff_and_resume(make_engine):
    """Prefill (and the first token) on one engine, the rest on another: the decode side
    rebuilds the grammar from the spec and replays the tokens; the text equals one engine's."""
    prefill, decode = make_engine(), make_engine()
    params = person(max_tokens=32, temperature=0)
    prefill.add_request("h", ASK, params, prefill_only=True)
    while prefill.has_unfinished():
        prefill.step()
    exported = prefill.export_sequence("h")
    prefill.release("h")
    decode.import_sequence("h", exported.prompt_token_ids, exported.output_token_ids, params)
    decode.commit_import("h", kv_ok=False)
    tokens = list(exported.output_token_ids)
    while decode.has_unfinished():
        for o in decode.step():
            tokens.extend(o.new_token_ids)
    # a resume mid-decode: half the output travels, the new engine replays it
    half = tokens[: len(tokens) // 2]
    decode.import_sequence("r", exported.prompt_token_ids, half, params)
    decode.commit_import("r", kv_ok=False)
    resumed = list(half)
    while decode.has_unfinished():
        for o in decode.step():
            resumed.extend(o.new_token_ids)
    single = run(decode, {"one": params})["one"][0]
    tok = decode.tokenizer
    assert tok.decode(tokens) == tok.decode(resumed) == single
    jsonschema.validate(json.loads(single), PERSON)
    decode.block_manager.check_no_leaks()


def test_logit_bias_and_min_tokens(engine):
    comma = engine.tokenizer.encode(",", add_special_tokens=False)[0]
    ends = run(
        engine,
        {
            "bias": SamplingParams(max_tokens=4, temperature=0, logit_bias={comma: 100.0}),
            "min": SamplingParams(
                max_tokens=6,
                temperature=0,
                min_tokens=6,
                stop_token_ids=list(engine.tokenizer.eos_token_ids),
                guided=GuidedSpec("choice", '["ok"]'),
            ),
        },
        prompt=[{"role": "user", "content": "Say ok."}],
    )
    assert ends["bias"][0] == ",,,,"
    # the grammar allows only "ok" then the end, but min_tokens holds the end back: the
    # grammar wins (its output stays valid) and the sequence stops when the grammar is done
    assert ends["min"][0] == "ok"
