"""Workloads: what to send, generated locally from a seed (or read from a user's JSONL).

A workload is a list of sessions. A session is one conversation: a fixed prelude (system
prompt, earlier messages) and user turns sent in order, each after the previous reply has
arrived, so every turn resends the whole history with the server's real replies in it.
Single-turn workloads are sessions of one turn.

Lengths are in (approximate) tokens and drawn lognormal around a median, the shape that
real chat logs show: most prompts short, a long tail of long ones.
"""

from __future__ import annotations

import json
import math
import random
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from tokenyard.bench import text

Message = dict[str, str]


@dataclass(frozen=True)
class Turn:
    user: str
    max_tokens: int


@dataclass(frozen=True)
class Session:
    prelude: tuple[Message, ...]
    turns: tuple[Turn, ...]


@dataclass(frozen=True)
class WorkloadOptions:
    num_requests: int
    seed: int = 0
    input_len: int = 256  # median prompt tokens (chat, shared prefix, multi-turn turns)
    output_len: int = 128  # median max_tokens
    len_sigma: float = 0.6  # lognormal sigma; 0 gives fixed lengths
    prefix_len: int = 1024  # shared-prefix: tokens in the one system prompt
    turns: int = 4  # multi-turn: user turns per conversation
    context_len: int = 4000  # long-context: tokens of document per request
    dataset: Path | None = None


def lognormal_len(rng: random.Random, median: int, sigma: float) -> int:
    """A length around `median`, clipped to [1, 8 * median] so a tail draw cannot stall a run."""
    if sigma <= 0:
        return max(1, median)
    value = median * math.exp(sigma * rng.gauss(0.0, 1.0))
    return max(1, min(round(value), 8 * median))


def _user_turn(rng: random.Random, opts: WorkloadOptions) -> Turn:
    body = text.text_of_tokens(rng, lognormal_len(rng, opts.input_len, opts.len_sigma))
    return Turn(
        user=f"{text.question(rng)}\n\n{body}",
        max_tokens=lognormal_len(rng, opts.output_len, opts.len_sigma),
    )


def chat(rng: random.Random, opts: WorkloadOptions) -> list[Session]:
    return [Session((), (_user_turn(rng, opts),)) for _ in range(opts.num_requests)]


def shared_prefix(rng: random.Random, opts: WorkloadOptions) -> list[Session]:
    """One long system prompt, byte-identical for every user: what prefix caching serves."""
    system = "You are a careful assistant. " + text.text_of_tokens(rng, opts.prefix_len)
    prelude = ({"role": "system", "content": system},)
    return [Session(prelude, (_user_turn(rng, opts),)) for _ in range(opts.num_requests)]


def multi_turn(rng: random.Random, opts: WorkloadOptions) -> list[Session]:
    """ceil(n / turns) conversations; the last is cut short so the total is n requests."""
    sessions = []
    left = opts.num_requests
    while left > 0:
        count = min(opts.turns, left)
        sessions.append(Session((), tuple(_user_turn(rng, opts) for _ in range(count))))
        left -= count
    return sessions


def long_context(rng: random.Random, opts: WorkloadOptions) -> list[Session]:
    """A different long document per request (no sharing), then a question about it."""
    sessions = []
    for _ in range(opts.num_requests):
        document = text.text_of_tokens(rng, opts.context_len)
        user = f"Read this document.\n\n{document}\n\n{text.question(rng)}"
        max_tokens = lognormal_len(rng, opts.output_len, opts.len_sigma)
        sessions.append(Session((), (Turn(user, max_tokens),)))
    return sessions


def dataset(rng: random.Random, opts: WorkloadOptions) -> list[Session]:
    """The user's JSONL, in file order, cycled if shorter than --num-prompts. Each line is
    {"prompt": str} or {"messages": [...], last one from the user}, optional "max_tokens"."""
    if opts.dataset is None:
        raise ValueError("the dataset workload needs --dataset PATH")
    entries = _read_jsonl(opts.dataset)
    if not entries:
        raise ValueError(f"{opts.dataset}: no prompts")
    sessions = []
    for i in range(opts.num_requests):
        entry = entries[i % len(entries)]
        max_tokens = int(entry.get("max_tokens") or opts.output_len)
        prelude, user = _split_entry(entry)
        sessions.append(Session(prelude, (Turn(user, max_tokens),)))
    return sessions


def _read_jsonl(path: Path) -> list[dict]:
    entries = []
    for number, line in enumerate(path.read_text().splitlines(), start=1):
        if not line.strip():
            continue
        entry = json.loads(line)
        if not isinstance(entry, dict) or ("prompt" not in entry and "messages" not in entry):
            raise ValueError(f"{path}:{number}: expected an object with 'prompt' or 'messages'")
        entries.append(entry)
    return entries


def _split_entry(entry: dict) -> tuple[tuple[Message, ...], str]:
    if "prompt" in entry:
        return (), str(entry["prompt"])
    messages = [{"role": m["role"], "content": m["content"]} for m in entry["messages"]]
    if not messages or messages[-1]["role"] != "user":
        raise ValueError("a 'messages' entry must end with a user message")
    return tuple(messages[:-1]), messages[-1]["content"]


GENERATORS: dict[str, Callable[[random.Random, WorkloadOptions], list[Session]]] = {
    "chat": chat,
    "shared-prefix": shared_prefix,
    "multi-turn": multi_turn,
    "long-context": long_context,
    "dataset": dataset,
}


def build(name: str, opts: WorkloadOptions) -> list[Session]:
    """The same name, options and seed give the same sessions, byte for byte."""
    return GENERATORS[name](random.Random(opts.seed), opts)


class Conversation:
    """The live history of one session: the next request's messages, then the real reply."""

    def __init__(self, session: Session) -> None:
        self.session = session
        self.messages: list[Message] = list(session.prelude)
        self.next_turn = 0

    def done(self) -> bool:
        return self.next_turn >= len(self.session.turns)

    def next_request(self) -> tuple[list[Message], int]:
        turn = self.session.turns[self.next_turn]
        self.next_turn += 1
        self.messages.append({"role": "user", "content": turn.user})
        return list(self.messages), turn.max_tokens

    def add_reply(self, reply: str) -> None:
        self.messages.append({"role": "assistant", "content": reply})


def render_prompt(messages: list[Message]) -> str:
    """Messages as one plain prompt for /v1/completions. A lone user message goes verbatim,
    so a dataset's {"prompt": ...} reaches the server unchanged."""
    if len(messages) == 1 and messages[0]["role"] == "user":
        return messages[0]["content"]
    parts = [f"{m['role'].capitalize()}: {m['content']}" for m in messages]
    return "\n\n".join(parts) + "\n\nAssistant:"
