"""Which parsers read the served model's output: its tool-call format and its reasoning
markers, chosen once at start from the settings (`--tool-call-parser`, `--reasoning-parser`)
or, for tool calls, from the chat template."""

from __future__ import annotations

from dataclasses import dataclass, field

from tokenyard.services.gateway.reasoning import ReasoningSyntax, syntax_named
from tokenyard.services.gateway.tool_parsers import (
    DEFAULT,
    PARSERS,
    ToolParser,
    detect,
    parser_named,
)


@dataclass(frozen=True)
class Parsers:
    tool: ToolParser = field(default_factory=lambda: PARSERS[DEFAULT])
    reasoning: ReasoningSyntax | None = None


def parsers_for(
    tool_call_parser: str | None, reasoning_parser: str | None, chat_template: str | None
) -> Parsers:
    """ValueError (one line) for a name no parser has."""
    tool = parser_named(tool_call_parser) if tool_call_parser else detect(chat_template)
    reasoning = syntax_named(reasoning_parser) if reasoning_parser else None
    return Parsers(tool, reasoning)
