"""Per-request records: what the JSON results keep, with times relative to the run start."""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass, field
from typing import Any

from tokenyard.bench.client import Exchange

log = logging.getLogger(__name__)


@dataclass
class RequestRecord:
    index: int  # order of sending within the run
    session: int
    turn: int
    warmup: bool
    start_s: float  # sent, seconds after the run started
    end_s: float  # last byte ([DONE]) or failure
    ok: bool
    max_tokens: int
    error_kind: str | None = None
    error: str | None = None
    error_code: str | None = (
        None  # the server's own code for it, e.g. "rate_limited", if it gave one
    )
    http_status: int | None = None
    scheduled_s: float | None = None  # open loop: when the arrival process said to send
    prompt_tokens: int | None = None
    output_tokens: int | None = None
    token_source: str = "usage"  # "usage", "tokenizer" or "chunks": where output_tokens came from
    chunk_ms: list[float] = field(default_factory=list)  # output chunks, ms after start_s
    # usage.energy_joules and its label (a Tokenyard server's; None from other servers)
    energy_joules: float | None = None
    energy_source: str | None = None

    @property
    def e2e_ms(self) -> float:
        return (self.end_s - self.start_s) * 1e3

    @property
    def ttft_ms(self) -> float | None:
        return self.chunk_ms[0] if self.chunk_ms else None

    @property
    def send_lag_ms(self) -> float | None:
        return None if self.scheduled_s is None else (self.start_s - self.scheduled_s) * 1e3


def make_record(
    ex: Exchange, *, t0_ns: int, index: int, session: int, turn: int, max_tokens: int,
    warmup: bool = False, scheduled_ns: int | None = None,
) -> RequestRecord:  # fmt: skip
    usage = ex.usage or {}
    return RequestRecord(
        index=index,
        session=session,
        turn=turn,
        warmup=warmup,
        start_s=(ex.start_ns - t0_ns) / 1e9,
        end_s=(ex.end_ns - t0_ns) / 1e9,
        ok=ex.ok,
        max_tokens=max_tokens,
        error_kind=ex.error_kind,
        error=ex.error,
        error_code=error_code(ex.error),
        http_status=ex.status,
        scheduled_s=None if scheduled_ns is None else (scheduled_ns - t0_ns) / 1e9,
        prompt_tokens=usage.get("prompt_tokens"),
        output_tokens=usage.get("completion_tokens"),
        energy_joules=usage.get("energy_joules"),
        energy_source=usage.get("energy_source"),
        chunk_ms=[round((t - ex.start_ns) / 1e6, 4) for t in ex.chunk_ns],
    )


def error_code(detail: str | None) -> str | None:
    """`code` (else `type`) of an OpenAI-style error body, `{"error": {...}}` or the bare object."""
    try:
        body = json.loads(detail or "")
    except json.JSONDecodeError:
        return None
    inner = body.get("error", body) if isinstance(body, dict) else None
    if not isinstance(inner, dict):
        return None
    code = inner.get("code") or inner.get("type")
    return str(code) if code is not None else None


class TokenCounter:
    """Counts tokens where the server sent no `usage`: with the project's tokenizer when
    it can be loaded, else one token per streamed chunk (exact only for servers that send
    a token per chunk). Each record says which source it used."""

    def __init__(self, path: str | None = None) -> None:
        self._path = path  # a model file or folder; None: the project's default model
        self._tokenizer: Any = None
        self._tried = False

    def _load(self) -> Any:
        if not self._tried:
            self._tried = True
            try:
                from tokenyard.models.loader import load_tokenizer

                self._tokenizer = load_tokenizer(self._path)
            # NOTE: broad on purpose: the tokenizer is optional here and any failure to load
            # it (module missing, model file missing) only downgrades to chunk counting.
            except Exception as exc:
                log.warning("no client-side tokenizer (%s); counting chunks instead", exc)
        return self._tokenizer

    def count(self, text: str) -> int | None:
        tokenizer = self._load()
        if tokenizer is None:
            return None
        try:
            encoded = tokenizer.encode(text, add_special_tokens=False)  # no BOS in a count
        except TypeError:  # a tokenizer without that switch
            encoded = tokenizer.encode(text)
        ids = getattr(encoded, "ids", encoded)
        return len(ids)

    def fill(self, record: RequestRecord, prompt_text: str, output_text: str) -> None:
        """Fill the counts `usage` did not give."""
        if record.output_tokens is None and record.ok:
            counted = self.count(output_text)
            record.output_tokens = counted if counted is not None else len(record.chunk_ms)
            record.token_source = "tokenizer" if counted is not None else "chunks"
        if record.prompt_tokens is None and record.ok:
            record.prompt_tokens = self.count(prompt_text)
