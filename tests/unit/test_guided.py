"""Guided decoding's pure parts: specs to grammars, bitmask unpacking, closing mode, and the
logit_bias / min_tokens processors."""

from __future__ import annotations

import json

import llguidance
import pytest
import torch

from tokenyard.engine.grammar import GuidedError, grammar_for, validate
from tokenyard.engine.guided import _closing_row, unpack_bitmask
from tokenyard.engine.logits_processors import apply_processors
from tokenyard.engine.sampling_params import GuidedSpec, SamplingParams
from tokenyard.engine.sequence import Sequence


@pytest.mark.parametrize(
    "spec",
    [
        GuidedSpec("json_object"),
        GuidedSpec("json_schema", '{"type": "object", "properties": {"a": {"type": "integer"}}}'),
        GuidedSpec("regex", "[0-9]{3}"),
        GuidedSpec("choice", '["yes", "no \\"quoted\\""]'),
        GuidedSpec("grammar", 'start: "a" b\nb: /[0-9]+/'),
    ],
)
def test_valid_specs_pass(spec):
    validate(spec)


@pytest.mark.parametrize(
    ("spec", "needle"),
    [
        (GuidedSpec("json_schema", "{"), "invalid json_schema"),
        (GuidedSpec("regex", "(["), "invalid regex"),
        (GuidedSpec("grammar", "start: nowhere"), "invalid grammar"),
    ],
)
def test_invalid_specs_raise(spec, needle):
    with pytest.raises(GuidedError) as info:
        validate(spec)
    assert needle in str(info.value)


def test_unpack_bitmask_is_least_significant_bit_first():
    words = torch.tensor([[0b1011, -1], [0, 1]], dtype=torch.int32)
    allowed = unpack_bitmask(words, 40)
    assert allowed.shape == (2, 40)
    assert allowed[0, :4].tolist() == [True, True, False, True] and not allowed[0, 4:32].any()
    assert allowed[0, 32:].all()
    assert allowed[1].nonzero().flatten().tolist() == [32]


def test_closing_row_prefers_an_allowed_closer_over_the_likeliest_token():
    row = torch.tensor([5.0, 1.0, 0.5, -1.0])
    allowed = torch.tensor([True, False, True, True])
    closers = torch.tensor([False, True, False, True])  # token 1 closes but is not allowed
    out = _closing_row(row, allowed, closers)
    assert out.argmax().item() == 3 and torch.isinf(out[:3]).all()
    no_closer = _closing_row(row, allowed, torch.zeros(4, dtype=torch.bool))
    assert no_closer.argmax().item() == 0


def seq(params: SamplingParams, outputs: int) -> Sequence:
    s = Sequence("r", [1, 2], params, arrival=0)
    s.token_ids.extend([3] * outputs)
    return s


def test_logit_bias_and_min_tokens():
    logits = torch.zeros(3, 6)
    seqs = [
        seq(SamplingParams(logit_bias={4: 7.5, 1: -100.0}), 0),
        seq(SamplingParams(max_tokens=8, min_tokens=2, stop_token_ids=[5]), 1),
        seq(SamplingParams(max_tokens=8, min_tokens=2, stop_token_ids=[5]), 2),
    ]
    out = apply_processors(logits, seqs, eos_ids={0})
    assert out[0].tolist() == [0.0, -100.0, 0.0, 0.0, 7.5, 0.0]
    assert torch.isinf(out[1, [0, 5]]).all() and not torch.isinf(out[1, 1:5]).any()
    assert not torch.isinf(out[2]).any()  # min_tokens reached: EOS and stop ids are back
    assert not logits.any()  # the model's logits are left alone
    assert apply_processors(logits, [seq(SamplingParams(), 0)], {0}) is logits


class _ByteTokenizer:
    """One token per byte and an EOS: enough for llguidance to match text exactly."""

    eos_token_id = 256
    bos_token_id = None
    tokens = [bytes([i]) for i in range(256)] + [b"<eos>"]
    special_token_ids = [256]

    def __call__(self, text: bytes) -> list[int]:
        return list(text)


BYTES = llguidance.LLTokenizer(llguidance.TokenizerWrapper(_ByteTokenizer()))


def accepts(spec: GuidedSpec, text: str) -> bool:
    matcher = llguidance.LLMatcher(BYTES, grammar_for(spec))
    assert not matcher.is_error(), matcher.get_error()
    return matcher.consume_tokens(list(text.encode())) and matcher.is_accepting()


def schema(**properties: dict) -> GuidedSpec:
    return GuidedSpec("json_schema", json.dumps({"type": "object", "properties": properties}))


@pytest.mark.parametrize(
    ("text", "ok"),
    [
        ('{"n": -9000000000000000000}', True),
        ('{"n": 9000000000000000001}', False),  # past the default bound: 19 digits at most
        ('{"n": 12345678901234567890}', False),
        ('{"x": 3.141593}', True),
        ('{"x": 3.1415926}', False),  # 7 fraction digits
        ('{"x": 1e5}', False),  # no exponent
        ('{"x": 123456789012345678901.5}', False),
    ],
)
def test_json_numbers_are_bounded_by_default(text, ok):
    spec = schema(n={"type": "integer"}, x={"type": "number"})
    assert accepts(spec, text) is ok


def test_a_schemas_own_bounds_win():
    spec = schema(
        n={"type": "integer", "minimum": 0},
        x={"type": "number", "maximum": 1, "multipleOf": 0.25},
        e={"type": "integer", "enum": [2**63 - 1]},  # enum is data: no default bound
    )
    assert accepts(spec, '{"n": 5}') and not accepts(spec, '{"n": -1}')
    assert not accepts(spec, '{"n": 10000000000000000000}')  # the default maximum
    assert accepts(spec, '{"x": -12345678.75}') and not accepts(spec, '{"x": 0.3}')
    assert accepts(spec, '{"e": 9223372036854775807}')


def test_json_object_bounds_numbers_at_any_depth():
    spec = GuidedSpec("json_object")
    assert accepts(spec, '{"a": [1, 2.5, {"b": null, "c": "text"}], "d": true}')
    assert not accepts(spec, '{"a": [{"b": 11111111111111111111111}]}')
    assert not accepts(spec, "[1]")


def test_whitespace_between_json_tokens_is_bounded_unless_the_schema_says_otherwise():
    spec = schema(a={"type": "integer"})
    assert accepts(spec, '{\n    "a": 1\n}')
    assert not accepts(spec, "{" + " " * 25 + '"a": 1}')
    own = {"x-guidance": {"whitespace_pattern": "[ ]+"}, "type": "object"}
    assert accepts(GuidedSpec("json_schema", json.dumps(own)), "{" + " " * 40 + "}")


def test_strings_are_bounded_unless_the_schema_bounds_them():
    spec = schema(s={"type": "string"}, p={"type": "string", "pattern": "^a+$"})
    assert accepts(spec, '{"s": "' + "x" * 4096 + '"}')
    assert not accepts(spec, '{"s": "' + "x" * 4097 + '"}')
    assert accepts(spec, '{"p": "' + "a" * 5000 + '"}')
    assert not accepts(GuidedSpec("json_object"), '{"s": ["' + "x" * 4097 + '"]}')
