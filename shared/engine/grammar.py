"""Grammars of structured outputs, checked without a tokenizer or torch: the gateway
refuses a bad schema, regex or Lark grammar with this before a request queues, and the
engine's `tokenyard.engine.guided` builds each request's matcher from `grammar_for`.

JSON numbers are bounded by default (`bounded`): an integer or number the schema leaves
unbounded gets at most 19 integer digits (within +-9e18, inside int64) and 6 fraction digits,
no exponent. A longer number has no use (no float or int64 holds it), and a small model that
starts repeating a digit would otherwise run to `max_tokens` (docs/structured_outputs.md).
Strings get at most 4096 characters, and whitespace between tokens 24 at a time.
"""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Any

import llguidance

from tokenyard.engine.sampling_params import GuidedSpec

if TYPE_CHECKING:
    from llguidance._lib import JsonCompileOptions  # typed, not exported

# The largest bound llguidance turns into a range of digits: 9e18 is exact as a float and
# below 2**63 (its range compiler refuses the int64 limits themselves).
INT_BOUND = 9 * 10**18
FRACTION_STEP = 1e-6  # 6 fraction digits (llguidance's multipleOf takes down to 1e-10)
# Generous: it stops a runaway at a large max_tokens, not an answer (a bound costs tens of
# microseconds of mask per token: docs/structured_outputs.md).
STRING_MAX_LENGTH = 4096
# A string with any of these is bounded by the schema already.
_STRING_BOUNDS = frozenset({"maxLength", "pattern", "format", "enum", "const"})
# Whitespace between tokens: a newline and indentation, not a run to max_tokens. A schema's
# own "x-guidance" whitespace_pattern replaces this default.
JSON_DEFAULTS: JsonCompileOptions = {"whitespace_pattern": r"[\x20\x0A\x0D\x09]{1,24}"}
# Keys whose values are JSON data, not subschemas: a bound added there would change the data.
_DATA_KEYS = frozenset({"enum", "const", "default", "examples", "x-guidance"})


class GuidedError(ValueError):
    """The grammar is not valid (bad schema, regex or Lark); the request is refused."""


def grammar_for(spec: GuidedSpec) -> str:
    """The llguidance grammar of a spec; GuidedError when it cannot be one."""
    M = llguidance.LLMatcher
    try:
        if spec.kind == "json_schema":
            schema = json.dumps(bounded(json.loads(spec.value)))
            return M.grammar_from_json_schema(schema, defaults=JSON_DEFAULTS)
        if spec.kind == "json_object":
            return M.grammar_from_json_schema(ANY_OBJECT, defaults=JSON_DEFAULTS)
        if spec.kind == "regex":
            return M.grammar_from_regex(spec.value)
        if spec.kind == "llguidance":
            if not isinstance(json.loads(spec.value).get("grammars"), list):
                raise ValueError("an llguidance grammar is an object with a 'grammars' list")
            return spec.value
        if spec.kind == "choice":
            choices = json.loads(spec.value)
            return M.grammar_from_lark("start: " + " | ".join(json.dumps(c) for c in choices))
        return M.grammar_from_lark(spec.value)
    except (ValueError, TypeError, AttributeError) as exc:  # json and llguidance: ValueError
        raise GuidedError(f"invalid {spec.kind}: {exc}") from exc


def validate(spec: GuidedSpec) -> None:
    """Raise GuidedError when the spec is not a grammar llguidance can run (no tokenizer
    needed: the gateway checks requests with this before they queue)."""
    is_error, messages = llguidance.LLMatcher.validate_grammar_with_warnings(grammar_for(spec))
    if is_error:
        raise GuidedError(f"invalid {spec.kind}: {'; '.join(messages)}")


def bounded(schema: Any) -> Any:
    """A copy of a JSON schema whose unbounded integers, numbers and strings get the default
    bounds (a side the schema bounds itself keeps the schema's bound)."""
    if isinstance(schema, list):
        return [bounded(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: v if k in _DATA_KEYS else bounded(v) for k, v in schema.items()}
    types = out.get("type")
    types = types if isinstance(types, list) else [types]
    if ("integer" in types or "number" in types) and not _DATA_KEYS & out.keys():
        _bound_range(out)
        if "number" in types and "multipleOf" not in out:
            out["multipleOf"] = FRACTION_STEP
    if "string" in types and not _STRING_BOUNDS & out.keys():
        out["maxLength"] = STRING_MAX_LENGTH
    return out


def _bound_range(schema: dict[str, Any]) -> None:
    low = schema.get("minimum", schema.get("exclusiveMinimum"))
    high = schema.get("maximum", schema.get("exclusiveMaximum"))
    if low is None and _number(high, -INT_BOUND) >= -INT_BOUND:
        schema["minimum"] = -INT_BOUND
    if high is None and _number(low, INT_BOUND) <= INT_BOUND:
        schema["maximum"] = INT_BOUND


def _number(value: Any, default: float) -> float:
    return value if isinstance(value, int | float) and not isinstance(value, bool) else default


def _any_value() -> dict[str, Any]:
    """Any JSON value, its numbers and strings bounded as `bounded` bounds them."""
    value = {"$ref": "#/$defs/value"}
    return {
        "anyOf": [
            {"type": "null"},
            {"type": "boolean"},
            bounded({"type": "integer"}),
            bounded({"type": "number"}),
            bounded({"type": "string"}),
            {"type": "array", "items": value},
            {"type": "object", "additionalProperties": value},
        ]
    }


# response_format json_object: any object, its numbers and strings bounded.
ANY_OBJECT = {
    "type": "object",
    "additionalProperties": {"$ref": "#/$defs/value"},
    "$defs": {"value": _any_value()},
}


# The answer's grammar, referenced from the reasoning block's grammar (`@answer`).
_ANSWER = "answer"
_REGEX_SPECIAL = set(r"\.+*?()|[]{}^$#&-~/")


def after_reasoning(spec: GuidedSpec, start: str, end: str, opened_in_prompt: bool) -> GuidedSpec:
    """A grammar that lets free reasoning between `start` and `end` come first, then holds
    the answer to `spec`. With `opened_in_prompt` the output begins inside the reasoning
    (the prompt wrote `start`), so the block must be closed before the answer; otherwise
    the block is optional. Whitespace between the block and the answer is free."""
    grammars = _top_level(grammar_for(spec))["grammars"]
    answer = {**grammars[0], "name": grammars[0].get("name") or _ANSWER}
    # NOTE: lazy: the reasoning ends at the first closing marker, as the parser reads it.
    block = f"reasoning[lazy]: /(?s:.*){_regex_literal(end)}/"
    opener = f"{json.dumps(start)}?" if opened_in_prompt else json.dumps(start)
    think = f"{opener} reasoning /[ \\t\\r\\n]*/"
    head = think if opened_in_prompt else f"({think})?"
    lark = f"start: {head} @{answer['name']}\n{block}\n"
    top = {"grammars": [{"lark_grammar": lark}, answer, *grammars[1:]]}
    return GuidedSpec("llguidance", json.dumps(top))


def _top_level(grammar: str) -> dict[str, Any]:
    """llguidance's grammar builders answer JSON (TopLevelGrammar), or Lark text as is."""
    try:
        return json.loads(grammar)
    except ValueError:
        return {"grammars": [{"lark_grammar": grammar}]}


def _regex_literal(text: str) -> str:
    return "".join("\\" + c if c in _REGEX_SPECIAL else c for c in text)
