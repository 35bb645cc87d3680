"""Render a model's Jinja chat template the way Hugging Face transformers does."""

from __future__ import annotations

import json
from datetime import datetime
from functools import lru_cache
from typing import Any

from jinja2 import Template
from jinja2.ext import loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment


class TemplateError(ValueError):
    """Raised by a template's own `raise_exception(...)`."""


def render_chat_template(template: str, messages: list[dict[str, Any]], **variables: Any) -> str:
    return _compile(template).render(messages=messages, **variables)


@lru_cache(maxsize=8)
def _compile(template: str) -> Template:
    # NOTE: trim_blocks/lstrip_blocks are what transformers uses; templates are written for them.
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env.from_string(template)


def _raise(message: str) -> None:
    raise TemplateError(message)


def _tojson(
    value: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: Any = None,
    sort_keys: bool = False,
) -> str:
    # Jinja's own tojson escapes HTML characters, which would change the prompt text.
    return json.dumps(
        value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )
