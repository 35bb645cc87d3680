"""Reasoning: the thinking a model writes between two markers before its answer, split out of
the answer into `reasoning_content`, whole and streamed. Pure: no network, no app state.

A family's markers and whether its chat template opens the block itself make a
:class:`ReasoningSyntax`, chosen per model by name (`--reasoning-parser`, vLLM's names):

- `qwen3`: `<think>...</think>` at the start of the output, optional (a model asked not
  to think writes none);
- `deepseek_r1`: the same markers, but the template may end the prompt with `<think>`,
  so the output begins inside the reasoning (a leading `<think>` is dropped);
- `granite`: "Here is my thought process:" ... "Here is my response:";
- `generic:<open>,<close>`: any other pair of markers, as qwen3 reads its tags.

Once the block is open, everything up to the closing marker is reasoning, also when the
output ends first (cut by max_tokens). Whitespace between the block and the answer belongs
to neither. The whole answer is split by feeding it to the same streaming splitter, so a
stream's pieces always add up to the whole answer's split.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

GENERIC = "generic:"


@dataclass(frozen=True)
class ReasoningSyntax:
    name: str
    start: str
    end: str
    # The chat template writes `start` at the end of the prompt: the output begins inside.
    opened_in_prompt: bool = False


SYNTAXES = {
    s.name: s
    for s in (
        ReasoningSyntax("deepseek_r1", "<think>", "</think>", opened_in_prompt=True),
        ReasoningSyntax("qwen3", "<think>", "</think>"),
        ReasoningSyntax("granite", "Here is my thought process:", "Here is my response:"),
    )
}


def syntax_named(name: str) -> ReasoningSyntax:
    """The syntax of a `--reasoning-parser` name; ValueError (one line) when unknown."""
    if name in SYNTAXES:
        return SYNTAXES[name]
    if name.startswith(GENERIC):
        start, _, end = name[len(GENERIC) :].partition(",")
        if start and end and start != end:
            return ReasoningSyntax(name, start, end)
        raise ValueError(f"a generic reasoning parser is 'generic:<open>,<close>', not {name!r}")
    known = ", ".join([*SYNTAXES, GENERIC + "<open>,<close>"])
    raise ValueError(f"unknown reasoning parser {name!r}; known: {known}")


class _State(Enum):
    BEFORE = "before"  # nothing but whitespace yet: the block may still open
    INSIDE = "inside"  # reasoning
    BETWEEN = "between"  # just closed: whitespace before the answer is dropped
    ANSWER = "answer"


class ReasoningStream:
    """Splits text, as it arrives, into (reasoning, content) pieces. A marker split over
    several pieces is held back until it is clearly one or clearly not."""

    def __init__(self, syntax: ReasoningSyntax) -> None:
        self.syntax = syntax
        self._state = _State.BEFORE
        self._held = ""

    def feed(self, text: str, final: bool = False) -> tuple[str, str]:
        self._held += text
        reasoning: list[str] = []
        content: list[str] = []
        while self._held:
            before = (self._state, len(self._held))
            out, piece = self._step(final)
            (reasoning if out == "reasoning" else content).append(piece)
            if (self._state, len(self._held)) == before:
                break  # waiting for more text
        return "".join(reasoning), "".join(content)

    def flush(self) -> tuple[str, str]:
        """The output ended: what was held back goes where it stands."""
        return self.feed("", final=True)

    def _step(self, final: bool) -> tuple[str, str]:
        """One move of the state machine over the held text: (which part, text for it)."""
        if self._state is _State.BEFORE:
            return self._before(final)
        if self._state is _State.INSIDE:
            return self._inside(final)
        if self._state is _State.BETWEEN:
            rest = self._held.lstrip()
            self._held = rest
            if rest:
                self._state = _State.ANSWER
            return "content", ""
        text, self._held = self._held, ""
        return "content", text

    def _before(self, final: bool) -> tuple[str, str]:
        start = self.syntax.start
        rest = self._held.lstrip()
        if rest.startswith(start):
            self._state, self._held = _State.INSIDE, rest[len(start) :]
            return "reasoning", ""
        if not final and start.startswith(rest):  # whitespace, or a start marker begun
            return "content", ""
        if self.syntax.opened_in_prompt:
            self._state = _State.INSIDE
            return "reasoning", ""
        self._state = _State.ANSWER
        return "content", ""

    def _inside(self, final: bool) -> tuple[str, str]:
        end = self.syntax.end
        at = self._held.find(end)
        if at >= 0:
            text, self._held = self._held[:at], self._held[at + len(end) :]
            self._state = _State.BETWEEN
            return "reasoning", text
        keep = 0 if final else partial_len(self._held, end)
        text, self._held = (
            self._held[: len(self._held) - keep],
            self._held[len(self._held) - keep :],
        )
        return "reasoning", text


def split(syntax: ReasoningSyntax, text: str) -> tuple[str | None, str | None]:
    """A whole answer -> (reasoning, content); None where there is none."""
    stream = ReasoningStream(syntax)
    reasoning, content = stream.feed(text)
    more_reasoning, more_content = stream.flush()
    reasoning += more_reasoning
    content += more_content
    return (reasoning or None), (content or None)


def partial_len(text: str, tag: str) -> int:
    """How many trailing characters of `text` could begin `tag`."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if tag.startswith(text[-n:]):
            return n
    return 0
