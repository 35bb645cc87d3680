"""The arithmetic of a run: pure functions over request records.

Definitions (the ones vLLM's and SGLang's benchmarks use, so numbers compare):
- TTFT: send to the first chunk that carries output text.
- ITL: the gaps between consecutive output chunks, pooled over all requests. A server
  that packs several tokens in one chunk shows fewer, longer gaps; TPOT is unaffected.
- TPOT: per request, (last output chunk - first output chunk) / (output tokens - 1).
- E2E: send to the last byte of the stream.
- Goodput: completed requests per second that met every SLO given. TTFT, TPOT and E2E
  SLOs apply per request (as vLLM and DistServe define goodput); the ITL SLO applies to
  EVERY gap of the request, i.e. its largest ITL must be within it (stricter than a p99).
"""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import asdict, dataclass
from typing import Any

from tokenyard.bench.records import RequestRecord
from tokenyard.stats import percentile

QUANTILES = (50, 90, 99)


@dataclass(frozen=True)
class SLOs:
    ttft_ms: float | None = None
    itl_ms: float | None = None
    tpot_ms: float | None = None
    e2e_ms: float | None = None

    def given(self) -> dict[str, float]:
        return {k: v for k, v in asdict(self).items() if v is not None}


def stats(values: list[float]) -> dict[str, float | None]:
    if not values:
        return {"mean": None, **{f"p{q}": None for q in QUANTILES}, "max": None}
    out: dict[str, float | None] = {"mean": sum(values) / len(values)}
    out.update({f"p{q}": percentile(values, q) for q in QUANTILES})
    out["max"] = max(values)
    return out


def itl_ms(chunk_ms: list[float]) -> list[float]:
    return [b - a for a, b in zip(chunk_ms, chunk_ms[1:], strict=False)]


def tpot_ms(record: RequestRecord) -> float | None:
    if not record.output_tokens or record.output_tokens < 2 or len(record.chunk_ms) < 2:
        return None
    return (record.chunk_ms[-1] - record.chunk_ms[0]) / (record.output_tokens - 1)


def meets_slos(record: RequestRecord, slos: SLOs) -> bool:
    if not record.ok:
        return False
    checks = [
        (slos.ttft_ms, record.ttft_ms),
        (slos.itl_ms, max(itl_ms(record.chunk_ms), default=None)),
        (slos.tpot_ms, tpot_ms(record)),
        (slos.e2e_ms, record.e2e_ms),
    ]
    # NOTE: a value that cannot exist (no ITL for a one-chunk reply) does not fail the SLO.
    return all(limit is None or value is None or value <= limit for limit, value in checks)


def duration_s(records: list[RequestRecord]) -> float:
    """First send to last end among the measured (non-warm-up) requests."""
    if not records:
        return 0.0
    return max(r.end_s for r in records) - min(r.start_s for r in records)


def throughput_windows(records: list[RequestRecord], window_s: float = 1.0) -> list[dict]:
    """Output tokens/s and completed requests/s per window from the first send. A
    request's output tokens are spread evenly over its output chunks."""
    ok = [r for r in records if r.ok]
    if not ok:
        return []
    t0 = min(r.start_s for r in records)
    count = max(1, math.ceil((max(r.end_s for r in records) - t0) / window_s))
    tokens, done = [0.0] * count, [0] * count
    for r in ok:
        per_chunk = (r.output_tokens or 0) / max(1, len(r.chunk_ms))
        for ms in r.chunk_ms:
            tokens[min(count - 1, int((r.start_s + ms / 1e3 - t0) / window_s))] += per_chunk
        done[min(count - 1, int((r.end_s - t0) / window_s))] += 1
    return [
        {
            "t_s": i * window_s,
            "output_tok_s": tokens[i] / window_s,
            "requests_s": done[i] / window_s,
        }
        for i in range(count)
    ]


def summarize(records: list[RequestRecord], slos: SLOs) -> dict:
    measured = [r for r in records if not r.warmup]
    ok = [r for r in measured if r.ok]
    span = duration_s(measured)
    per_s = (lambda x: x / span) if span > 0 else (lambda x: 0.0)
    prompt_total = sum(r.prompt_tokens or 0 for r in ok)
    output_total = sum(r.output_tokens or 0 for r in ok)
    met = sum(meets_slos(r, slos) for r in ok)
    return {
        "requests": {"measured": len(measured), "ok": len(ok), "failed": len(measured) - len(ok)},
        "errors": dict(Counter(r.error_kind for r in measured if not r.ok)),
        "error_codes": dict(
            Counter(f"{r.error_kind}/{r.error_code}" for r in measured if r.error_code)
        ),
        "duration_s": span,
        "request_throughput": per_s(len(ok)),
        "input_token_throughput": per_s(prompt_total),
        "output_token_throughput": per_s(output_total),
        "total_token_throughput": per_s(prompt_total + output_total),
        "prompt_tokens": prompt_total,
        "output_tokens": output_total,
        "token_source": dict(Counter(r.token_source for r in ok)),
        "ttft_ms": stats([r.ttft_ms for r in ok if r.ttft_ms is not None]),
        "itl_ms": stats([gap for r in ok for gap in itl_ms(r.chunk_ms)]),
        "tpot_ms": stats([t for r in ok if (t := tpot_ms(r)) is not None]),
        "e2e_ms": stats([r.e2e_ms for r in ok]),
        "goodput": {
            "slos": slos.given(),
            "met": met,
            "fraction": met / len(measured) if measured else 0.0,
            "requests_s": per_s(met),
        },
        "energy": energy(ok, slos),
    }


def energy(ok: list[RequestRecord], slos: SLOs) -> dict[str, Any] | None:
    """Output tokens per joule from the server's usage.energy_joules (None where it sent
    none): over every completed request, and at the SLO (the tokens of requests that met
    the SLOs over the joules of all of them, as goodput counts)."""
    known = [r for r in ok if r.energy_joules is not None]
    joules = sum(r.energy_joules or 0.0 for r in known)
    if not known or joules <= 0:
        return None
    tokens = sum(r.output_tokens or 0 for r in known)
    at_slo = sum(r.output_tokens or 0 for r in known if meets_slos(r, slos))
    return {
        "requests": len(known),
        "joules": joules,
        "sources": dict(Counter(r.energy_source for r in known)),
        "joules_per_request": joules / len(known),
        "output_tokens_per_joule": tokens / joules,
        "output_tokens_per_joule_at_slo": at_slo / joules,
    }
