"""Grammars of structured outputs, checked without a tokenizer or torch: the gateway
refuses a bad schema, regex or Lark grammar with this before a request queues, and the
engine's `tokenyard.engine.guided` builds each request's matcher from `grammar_for`.
"""

from __future__ import annotations

import json

import llguidance

from tokenyard.engine.sampling_params import GuidedSpec


class GuidedError(ValueError):
    """The grammar is not valid (bad schema, regex or Lark); the request is refused."""


def grammar_for(spec: GuidedSpec) -> str:
    """The llguidance grammar of a spec; GuidedError when it cannot be one."""
    M = llguidance.LLMatcher
    try:
        if spec.kind == "json_schema":
            return M.grammar_from_json_schema(json.loads(spec.value))
        if spec.kind == "json_object":
            return M.grammar_from_json_schema({"type": "object"})
        if spec.kind == "regex":
            return M.grammar_from_regex(spec.value)
        if spec.kind == "choice":
            choices = json.loads(spec.value)
            return M.grammar_from_lark("start: " + " | ".join(json.dumps(c) for c in choices))
        return M.grammar_from_lark(spec.value)
    except (ValueError, TypeError) as exc:  # json and llguidance both raise ValueError
        raise GuidedError(f"invalid {spec.kind}: {exc}") from exc


def validate(spec: GuidedSpec) -> None:
    """Raise GuidedError when the spec is not a grammar llguidance can run (no tokenizer
    needed: the gateway checks requests with this before they queue)."""
    is_error, messages = llguidance.LLMatcher.validate_grammar_with_warnings(grammar_for(spec))
    if is_error:
        raise GuidedError(f"invalid {spec.kind}: {'; '.join(messages)}")
