"""Structured outputs: OpenAI's `response_format` and vLLM's `guided_*` fields -> the grammar
spec the workers enforce (tokenyard.engine.guided). Pure: no network, no app state.

A spec is checked here, before it queues, so a bad schema, regex or grammar is a 400 that
names its field, never a failed request on a worker.
"""

from __future__ import annotations

import json
from typing import Any

from tokenyard.engine.grammar import GuidedError, validate
from tokenyard.engine.sampling_params import GuidedKind, GuidedSpec
from tokenyard.services.gateway.errors import invalid
from tokenyard.v1 import serving_pb2 as pb

GUIDED_FIELDS = ("guided_json", "guided_regex", "guided_choice", "guided_grammar")


def response_format_spec(response_format: dict[str, Any] | None) -> GuidedSpec | None:
    """OpenAI's `response_format`: text (nothing), json_object, or json_schema."""
    if not response_format:
        return None
    kind = response_format.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return GuidedSpec("json_object")
    if kind == "json_schema":
        body = response_format.get("json_schema")
        if not isinstance(body, dict) or not isinstance(body.get("schema", {}), dict):
            raise invalid(
                "'response_format.json_schema' must be an object with a 'schema' object",
                "response_format",
            )
        # OpenAI allows a missing schema: any JSON object then.
        schema = body.get("schema") or {"type": "object"}
        return GuidedSpec("json_schema", json.dumps(schema))
    raise invalid(
        f"'response_format.type' must be text, json_object or json_schema, not {kind!r}",
        "response_format",
    )


def guided_field_spec(fields: dict[str, Any]) -> tuple[str, GuidedSpec] | None:
    """vLLM's extra fields; at most one may be set. Returns (field name, spec)."""
    present = [(name, value) for name, value in fields.items() if value is not None]
    if not present:
        return None
    if len(present) > 1:
        names = ", ".join(name for name, _ in present)
        raise invalid(f"set at most one of {names}", present[1][0])
    name, value = present[0]
    if name == "guided_json":
        try:
            schema = json.loads(value) if isinstance(value, str) else value
        except ValueError as exc:
            raise invalid(f"'guided_json' is not valid JSON: {exc}", name) from exc
        if not isinstance(schema, dict):
            raise invalid("'guided_json' must be a JSON schema object", name)
        return name, GuidedSpec("json_schema", json.dumps(schema))
    if name == "guided_choice":
        if not value or not all(isinstance(c, str) and c for c in value):
            raise invalid("'guided_choice' must be a list of non-empty strings", name)
        return name, GuidedSpec("choice", json.dumps(value))
    kind: GuidedKind = "regex" if name == "guided_regex" else "grammar"
    return name, GuidedSpec(kind, value)


def checked(spec: GuidedSpec, param: str) -> pb.GuidedDecoding:
    """The spec on the wire, once llguidance has accepted it."""
    try:
        validate(spec)
    except GuidedError as exc:
        raise invalid(str(exc), param) from exc
    return pb.GuidedDecoding(kind=spec.kind, value=spec.value)
