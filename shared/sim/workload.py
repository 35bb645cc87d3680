"""Requests for the fleet simulator: synthetic arrival processes, or a `tokenyard bench` run.

Every request carries its arrival time, prompt and output lengths, and the key of the
prefix it shares with others (a system prompt, or a conversation's history) with that
prefix's length, so the simulator can tell which worker's cache holds it.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass, replace
from pathlib import Path


@dataclass(frozen=True)
class SimRequest:
    rid: int
    arrival_s: float
    prompt_len: int
    output_len: int
    prefix_key: str = ""  # "" = nothing shared
    prefix_len: int = 0  # leading prompt tokens shared under prefix_key
    cache_key: str = ""  # what this request leaves in the cache for a later one ("" = none)
    cache_len: int = 0  # and how many tokens of it


@dataclass(frozen=True)
class WorkloadSpec:
    kind: str = "poisson"  # poisson | bursts | shared-prefix | multi-turn | day
    requests: int = 1000
    rate: float = 10.0  # mean requests per second
    prompt_len: int = 1024
    output_len: int = 256
    # bursts: the rate alternates between rate * burst_factor and a lull with the same mean
    burst_factor: float = 4.0
    burst_period_s: float = 20.0
    # shared-prefix: prefixes of this length, picked by a Zipf law over `groups`
    groups: int = 64
    prefix_len: int = 768
    zipf_s: float = 1.1
    # multi-turn: conversations of `turns` turns, `think_s` between answer and next prompt
    turns: int = 4
    think_s: float = 5.0
    # day: a day's load curve (DAY_CURVE, `rate` at its peak) compressed into `day_s`
    # seconds, with a burst of `day_burst_factor` x the curve for `day_burst_s` seconds from
    # `day_burst_at` (a share of the day); `requests` is ignored, the curve decides
    day_s: float = 240.0
    day_burst_at: float = 0.5
    day_burst_s: float = 10.0
    day_burst_factor: float = 1.5
    seed: int = 0


# The request rate of each hour of a day as a share of the peak: a trough before dawn, a
# morning ramp, a plateau through the working day and a second peak in the evening.
DAY_CURVE = (
    0.45, 0.38, 0.32, 0.28, 0.26, 0.27, 0.32, 0.42, 0.55, 0.68, 0.78, 0.85,
    0.88, 0.9, 0.9, 0.88, 0.86, 0.87, 0.92, 0.98, 1.0, 0.92, 0.75, 0.58,
)  # fmt: skip


def _lengths(rng: random.Random, spec: WorkloadSpec) -> tuple[int, int]:
    """Prompt and output lengths around the means (uniform within +-25%)."""
    p = max(1, int(spec.prompt_len * rng.uniform(0.75, 1.25)))
    o = max(1, int(spec.output_len * rng.uniform(0.75, 1.25)))
    return p, o


def _zipf_weights(n: int, s: float) -> list[float]:
    return [1.0 / (k + 1) ** s for k in range(n)]


def generate(spec: WorkloadSpec) -> list[SimRequest]:
    rng = random.Random(spec.seed)
    if spec.kind == "multi-turn":
        return _multi_turn(spec, rng)
    if spec.kind == "day":
        return _day(spec, rng)
    out: list[SimRequest] = []
    t = 0.0
    weights = _zipf_weights(spec.groups, spec.zipf_s)
    for rid in range(spec.requests):
        t += rng.expovariate(_rate_at(t, spec))
        prompt, output = _lengths(rng, spec)
        if spec.kind == "shared-prefix":
            group = rng.choices(range(spec.groups), weights)[0]
            prompt = max(prompt, spec.prefix_len + 16)
            key = f"p{group}"
            out.append(
                SimRequest(rid, t, prompt, output, key, spec.prefix_len, key, spec.prefix_len)
            )
        elif spec.kind in ("poisson", "bursts"):
            out.append(SimRequest(rid, t, prompt, output))
        else:
            raise ValueError(f"unknown workload kind {spec.kind!r}")
    return out


def _multi_turn(spec: WorkloadSpec, rng: random.Random) -> list[SimRequest]:
    """Conversations start as a Poisson process; each turn resends the whole history."""
    out: list[SimRequest] = []
    conversations = max(1, spec.requests // spec.turns)
    t = 0.0
    rid = 0
    for c in range(conversations):
        t += rng.expovariate(spec.rate / spec.turns)
        at, history = t, 0
        for turn in range(spec.turns):
            prompt, output = _lengths(rng, spec)
            # A rough turn duration stands in for the answer time: the simulator does not
            # feed back real completion times into arrivals (open loop).
            key = f"c{c}t{turn}"
            prev = f"c{c}t{turn - 1}" if turn else ""
            length = history + prompt + output
            out.append(SimRequest(rid, at, history + prompt, output, prev, history, key, length))
            rid += 1
            history += prompt + output
            at += spec.think_s + output * 0.03
    out.sort(key=lambda r: r.arrival_s)
    return [replace(r, rid=i) for i, r in enumerate(out)]


def day_rate(t: float, spec: WorkloadSpec) -> float:
    """The day's request rate at `t` seconds: the hourly curve, linear between hours."""
    hour = (t / spec.day_s * 24.0) % 24.0
    h = int(hour)
    a, b = DAY_CURVE[h], DAY_CURVE[(h + 1) % 24]
    rate = spec.rate * (a + (b - a) * (hour - h))
    burst_from = spec.day_burst_at * spec.day_s
    if burst_from <= t < burst_from + spec.day_burst_s:
        rate *= spec.day_burst_factor
    return rate


def _day(spec: WorkloadSpec, rng: random.Random) -> list[SimRequest]:
    """Poisson arrivals at the day's rate (by thinning: exact for a rate that changes)."""
    peak = spec.rate * max(DAY_CURVE) * max(1.0, spec.day_burst_factor)
    out: list[SimRequest] = []
    t = rng.expovariate(peak)
    while t < spec.day_s:
        if rng.random() * peak < day_rate(t, spec):
            prompt, output = _lengths(rng, spec)
            out.append(SimRequest(len(out), t, prompt, output))
        t += rng.expovariate(peak)
    return out


def _rate_at(t: float, spec: WorkloadSpec) -> float:
    """Poisson: constant. Bursts: `burst_factor` x the mean for 1/(2 x factor) of each period,
    and a lull for the rest, so that the mean stays `rate`."""
    if spec.kind != "bursts":
        return spec.rate
    high_share = 1.0 / (2.0 * spec.burst_factor)
    if (t % spec.burst_period_s) < high_share * spec.burst_period_s:
        return spec.rate * spec.burst_factor
    return spec.rate * 0.5 / (1.0 - high_share)


def from_bench(path: str | Path, run: int = -1) -> list[SimRequest]:
    """Requests from `tokenyard bench serve --out` results (one run's records, the last by
    default), or from a JSONL file of such records, at the times they were sent."""
    text = Path(path).read_text(encoding="utf-8")
    try:
        doc = json.loads(text)
    except json.JSONDecodeError:
        rows = [json.loads(line) for line in text.splitlines() if line.strip()]
    else:
        if not isinstance(doc, dict) or not doc.get("runs"):
            raise ValueError(f"{path}: not a bench results file (no runs)")
        rows = doc["runs"][run]["records"]
    rows = [r for r in rows if not r.get("warmup") and r.get("ok", True)]
    if not rows:
        raise ValueError(f"{path}: no measured requests")

    def sent(r: dict) -> float:
        at = r.get("scheduled_s")
        return float(at if at is not None else r.get("start_s") or 0.0)

    rows.sort(key=sent)
    t0 = sent(rows[0])
    out: list[SimRequest] = []
    for i, r in enumerate(rows):
        prompt = int(r.get("prompt_tokens") or 0)
        output = int(r.get("output_tokens") or r.get("max_tokens") or 0)
        if prompt <= 0 or output <= 0:
            raise ValueError(f"{path}: record {i} has no prompt or output token count")
        out.append(SimRequest(i, sent(r) - t0, prompt, output))
    return out
