"""A load step on `tokenyard up --autoscale`: a worker is added, TTFT p99 recovers, and the
worker is drained and stopped once the load falls, with every request served.

    .venv/bin/python benchmarks/autoscale_step.py [--rate 1.0] [--max-num-seqs 4] \
        [--out autoscale_step.json]

Runs the real CLI, `tokenyard up --autoscale --min-workers 1 --max-workers 2` with the default
model (one prefill and one decode worker to start), and sends streamed completions as Poisson
arrivals from the client in three phases:

- base: `--rate` requests/s for `--base-s` seconds (TTFT p99 of this phase is the baseline);
- step: twice the rate, until the autoscaler has started a worker and `--hold-s` more seconds
  have passed (at most `--step-max-s`);
- fall: a quarter of the rate, until a worker has drained and stopped (at most
  `--fall-max-s`), then the client waits for every request in flight.

Every request's TTFT is timed from the client; the launcher's output says when a worker was
started and when one drained and stopped. "Recovered" is the first moment after the worker
started from which every `--window-s` window of requests sent until the end of the step has
TTFT p99 at most `--recover-factor` x the baseline p99. Every request must end with a
finish_reason (counted: sent, served, failed).

`--max-num-seqs` (default 2) is each worker's TOKENYARD_WORKER_MAX_NUM_SEQS, its slots: on a
fleet a worker is an accelerator of its own, and one more adds capacity; on a small CPU host
every worker shares the same cores, so one more adds none. Bounding each worker's running
sequences well below what the cores carry makes a worker saturate on its slots (its queue
grows while the CPU still has room), which one more worker relieves, as on a fleet. With the
default 32, a small CPU host runs out of cores long before a pool's busy share reaches the
policy's `high` mark, so the load would slow everything without a scaling signal.

`--slo-ttft-s` and `--slo-itl-s` are passed to `tokenyard up` (the policy's p99 targets,
read from the workers' histograms each interval). The load average of the host is recorded
before the stack starts, when the load begins and when it ends.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import os
import random
import re
import subprocess
import sys
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import httpx
from result_path import OUT_HELP, out_path

from tokenyard.bus.embedded import free_port
from tokenyard.stats import percentile

STARTED = re.compile(r"autoscaler: started (\S+)")
STOPPED = re.compile(r"autoscaler: (\S+) drained and stopped")
DRAINING = re.compile(r"autoscaler: draining (\S+)")
UP = "Tokenyard is up"
PROMPT = "Write one sentence about the weather in a city of your choice. Number {n}."
_serial = itertools.count()


@dataclass
class Sent:
    at: float  # seconds since the load began
    phase: str
    ttft_s: float | None = None
    end_s: float | None = None
    finish_reason: str | None = None
    error: str | None = None
    energy_joules: float | None = None
    tokens: int = 0


@dataclass
class Launcher:
    """The `tokenyard up` process and what its output said, with times."""

    proc: subprocess.Popen[str]
    t0: float
    lines: list[tuple[float, str]] = field(default_factory=list)
    up_at: float | None = None

    def follow(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            now = time.perf_counter() - self.t0
            self.lines.append((now, line.rstrip()))
            if UP in line and self.up_at is None:
                self.up_at = now

    def events(self, pattern: re.Pattern[str]) -> list[tuple[float, str]]:
        found = []
        for at, line in list(self.lines):
            m = pattern.search(line)
            if m:
                found.append((at, m.group(1)))
        return found


def loadavg() -> list[float] | None:
    try:
        return [float(x) for x in Path("/proc/loadavg").read_text().split()[:3]]
    except OSError:
        return None


def start_stack(args: argparse.Namespace, port: int, max_num_seqs: int, log_dir: Path) -> Launcher:
    cmd = [
        sys.executable, "-m", "tokenyard.cli", "up", "--autoscale",
        "--min-workers", "1", "--max-workers", "2",
        "--slo-ttft-s", str(args.slo_ttft_s), "--slo-itl-s", str(args.slo_itl_s),
        "--port", str(port), "--console-port", "0", "--log-dir", str(log_dir),
    ]  # fmt: skip
    env = {**os.environ, "TOKENYARD_WORKER_MAX_NUM_SEQS": str(max_num_seqs)}
    proc = subprocess.Popen(
        cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env
    )
    launcher = Launcher(proc, time.perf_counter())
    threading.Thread(target=launcher.follow, daemon=True).start()
    return launcher


async def one(client: httpx.AsyncClient, model: str, rec: Sent, t0: float, max_tokens: int) -> None:
    body = {
        "model": model,
        "prompt": PROMPT.format(n=next(_serial)),
        "max_tokens": max_tokens,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    started = time.perf_counter()
    try:
        async with client.stream("POST", "/v1/completions", json=body) as resp:
            if resp.status_code != 200:
                rec.error = f"{resp.status_code}: {(await resp.aread())[:200]!r}"
                return
            async for line in resp.aiter_lines():
                if not line.startswith("data: {"):
                    continue
                data = json.loads(line[6:])
                for choice in data.get("choices", []):
                    if rec.ttft_s is None and choice.get("text"):
                        rec.ttft_s = time.perf_counter() - started
                    if choice.get("finish_reason"):
                        rec.finish_reason = choice["finish_reason"]
                usage = data.get("usage") or {}
                rec.energy_joules = usage.get("energy_joules", rec.energy_joules)
                rec.tokens = usage.get("total_tokens", rec.tokens)
    except Exception as exc:  # counted as a failed request, never dropped silently
        rec.error = repr(exc)
    finally:
        rec.end_s = time.perf_counter() - t0


async def load(args: argparse.Namespace, launcher: Launcher, url: str, model: str) -> dict:
    rng = random.Random(args.seed)
    sent: list[Sent] = []
    tasks: set[asyncio.Task[None]] = set()
    t0 = time.perf_counter()
    marks: dict[str, float] = {}
    known = {w for _, w in launcher.events(STARTED)}  # none before the load

    def elapsed() -> float:
        return time.perf_counter() - t0

    def added() -> list[tuple[float, str]]:
        return [
            (at - (t0 - launcher.t0), w) for at, w in launcher.events(STARTED) if w not in known
        ]

    def stopped() -> list[tuple[float, str]]:
        """Workers drained and stopped once the load fell (the policy drains the least busy
        worker of the pool, which need not be the one it added)."""
        since = marks.get("fall", float("inf"))
        found = [(at - (t0 - launcher.t0), w) for at, w in launcher.events(STOPPED)]
        return [(at, w) for at, w in found if at >= since]

    async def send_until(phase: str, rate: float, done) -> None:  # noqa: ANN001
        marks[phase] = elapsed()
        while not done():
            await asyncio.sleep(rng.expovariate(rate))
            rec = Sent(at=elapsed(), phase=phase)
            sent.append(rec)
            task = asyncio.create_task(one(client, model, rec, t0, args.max_tokens))
            tasks.add(task)
            task.add_done_callback(tasks.discard)

    timeout = httpx.Timeout(args.request_timeout_s)
    async with httpx.AsyncClient(base_url=url, timeout=timeout) as client:
        base_end = args.base_s
        await send_until("base", args.rate, lambda: elapsed() >= base_end)
        step_t = elapsed()

        def step_done() -> bool:
            a = added()
            held = bool(a) and elapsed() - max(at for at, _ in a) >= args.hold_s
            return held or elapsed() - step_t >= args.step_max_s

        await send_until("step", 2 * args.rate, step_done)
        fall_t = elapsed()
        await send_until(
            "fall", args.rate / 4, lambda: bool(stopped()) or elapsed() - fall_t >= args.fall_max_s
        )
        marks["end_of_load"] = elapsed()
        if tasks:
            await asyncio.wait(tasks)
    return report(args, sent, marks, added(), stopped(), launcher, t0)


def p99(recs: list[Sent]) -> float | None:
    ttfts = [r.ttft_s for r in recs if r.ttft_s is not None]
    return percentile(ttfts, 99) if ttfts else None


def recovery(args: argparse.Namespace, sent: list[Sent], start: float, end: float, limit: float):
    """The first window start from which every later window (to `end`) has p99 <= limit."""
    w = args.window_s
    starts = [start + i * w / 2 for i in range(int((end - start) / (w / 2)) + 1)]
    ok = [(s, p99([r for r in sent if s <= r.at < s + w])) for s in starts if s + w <= end]
    for i, (s, _) in enumerate(ok):
        if all(v is not None and v <= limit for _, v in ok[i:]):
            return s
    return None


def report(args, sent, marks, added, stopped, launcher: Launcher, t0: float) -> dict[str, Any]:  # noqa: ANN001
    served = [r for r in sent if r.finish_reason and r.error is None]
    base = p99([r for r in sent if r.phase == "base"])
    first_add = min((at for at, _ in added), default=None)
    limit = args.recover_factor * base if base is not None else None
    recovered = None
    if first_add is not None and limit is not None:
        recovered = recovery(args, sent, first_add, marks["fall"], limit)
    energy = [r.energy_joules for r in served if r.energy_joules is not None]
    tokens = sum(r.tokens for r in served if r.energy_joules is not None)
    rel = t0 - launcher.t0
    return {
        "conditions": {k: v for k, v in vars(args).items() if k != "out"},
        "phases_s": marks,
        "workers_added": [{"at_s": at, "worker": w} for at, w in added],
        "workers_stopped_after_fall": [{"at_s": at, "worker": w} for at, w in stopped],
        "workers_stopped": [{"at_s": at - rel, "worker": w} for at, w in launcher.events(STOPPED)],
        "drains_begun": [{"at_s": at - rel, "worker": w} for at, w in launcher.events(DRAINING)],
        "requests": {
            "sent": len(sent),
            "served": len(served),
            "failed": len(sent) - len(served),
            "errors": sorted({r.error for r in sent if r.error})[:5],
            "by_phase": {p: sum(r.phase == p for r in sent) for p in ("base", "step", "fall")},
        },
        "ttft_p99_s": {
            "base": base,
            "step_before_worker": p99(
                [r for r in sent if r.phase == "step" and (first_add is None or r.at < first_add)]
            ),
            "step_after_worker": p99(
                [
                    r
                    for r in sent
                    if r.phase == "step" and first_add is not None and r.at >= first_add
                ]
            ),
            "fall": p99([r for r in sent if r.phase == "fall"]),
        },
        "recovery": {
            "limit_s": limit,
            "recovered_at_s": recovered,
            "after_step_s": None if recovered is None else recovered - marks["step"],
            "after_worker_started_s": None if recovered is None else recovered - (first_add or 0),
        },
        "energy": {
            "requests_with_energy": len(energy),
            "joules_total": sum(energy),
            "tokens_per_joule": tokens / sum(energy) if energy and sum(energy) > 0 else None,
        },
        "stack_up_s": launcher.up_at,
        "launcher_lines": [
            f"{at - rel:.1f} {line}" for at, line in launcher.lines if "autoscal" in line
        ],
        "requests_detail": [asdict(r) for r in sent],
    }


def plot(result: dict[str, Any], png: Path) -> None:
    """Each request's client TTFT by when it was sent (a failed one as an x), the phases,
    the workers added and those drained."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(10, 4.5))
    recs = result["requests_detail"]
    ok = [(r["at"], r["ttft_s"]) for r in recs if r["ttft_s"] is not None and not r["error"]]
    bad = [r["at"] for r in recs if r["error"] or not r["finish_reason"]]
    ax.scatter([a for a, _ in ok], [t for _, t in ok], s=8, label="TTFT (client)")
    if bad:
        ax.scatter(bad, [0] * len(bad), marker="x", color="red", label="failed")
    for name, at in result["phases_s"].items():
        ax.axvline(at, color="grey", linestyle=":")
        ax.text(at, ax.get_ylim()[1] * 0.95, f" {name}", fontsize=8, color="grey")
    for ev in result["workers_added"]:
        ax.axvline(ev["at_s"], color="green", label=f"{ev['worker']} added")
    for ev in result["drains_begun"]:
        ax.axvline(ev["at_s"], color="orange", linestyle="--", label=f"{ev['worker']} drains")
    ax.set_xlabel("seconds since the load began")
    ax.set_ylabel("TTFT (s)")
    ax.set_title("tokenyard up --autoscale: a load step (rate doubled, then a quarter)")
    ax.legend(fontsize=8, loc="upper left")
    fig.tight_layout()
    fig.savefig(png, dpi=100)
    plt.close(fig)


def model_id(url: str) -> str:
    return httpx.get(f"{url}/v1/models", timeout=30).json()["data"][0]["id"]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--rate", type=float, default=1.0, help="base requests/s (the step doubles it)")
    p.add_argument("--max-tokens", type=int, default=24)
    p.add_argument("--max-num-seqs", type=int, default=2, help="each worker's slots")
    p.add_argument("--slo-ttft-s", type=float, default=5.0, help="the policy's TTFT p99 target")
    p.add_argument("--slo-itl-s", type=float, default=1.0, help="the policy's ITL p99 target")
    p.add_argument("--base-s", type=float, default=40.0)
    p.add_argument(
        "--hold-s", type=float, default=60.0, help="step load kept after a worker starts"
    )
    p.add_argument("--step-max-s", type=float, default=150.0)
    p.add_argument("--fall-max-s", type=float, default=150.0)
    p.add_argument("--window-s", type=float, default=10.0)
    p.add_argument("--recover-factor", type=float, default=1.5)
    p.add_argument("--request-timeout-s", type=float, default=300.0)
    p.add_argument("--ready-timeout-s", type=float, default=600.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", help=OUT_HELP)
    args = p.parse_args()
    out = out_path(args.out, "autoscale_step")
    port = free_port()
    log_dir = out.with_suffix(".logs")
    load_before = loadavg()
    launcher = start_stack(args, port, args.max_num_seqs, log_dir)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.perf_counter() + args.ready_timeout_s
        while launcher.up_at is None:
            if launcher.proc.poll() is not None or time.perf_counter() > deadline:
                print("\n".join(line for _, line in launcher.lines[-30:]))
                raise SystemExit("tokenyard up did not come up")
            time.sleep(1)
        load_begins = loadavg()
        result = asyncio.run(load(args, launcher, url, model_id(url)))
        result["loadavg"] = {"before_stack": load_before, "load_begins": load_begins,
                             "load_ends": loadavg()}  # fmt: skip
    finally:
        launcher.proc.terminate()
        try:
            launcher.proc.wait(60)
        except subprocess.TimeoutExpired:
            launcher.proc.kill()
    out.write_text(json.dumps(result, indent=2))
    plot(result, out.with_suffix(".png"))
    brief = {k: v for k, v in result.items() if k not in ("requests_detail",)}
    print(json.dumps(brief, indent=2))
    print(f"results: {out}; logs: {log_dir}")
    r = result["requests"]
    ok = r["failed"] == 0 and result["workers_added"] and result["workers_stopped_after_fall"]
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
