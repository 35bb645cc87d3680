"""Where the time of a loaded `tokenyard up` goes: py-spy on every process, plus step timings.

    .venv/bin/python benchmarks/profile_stack.py --concurrency 32 --num-prompts 64 \
        [--out profile_stack.json] [--aggregated | --disaggregated]

Starts the stack as `tokenyard up` does (its defaults: dtype auto + int4 workers, KV-cache,
facilities and telemetry services), warms it, then loads it with `tokenyard bench serve`
(chat, fixed lengths, --ignore-eos) while `py-spy record --format raw` samples every Python process of the stack
and /proc gives every process's CPU seconds and resident memory. Samples are put in
buckets by the innermost frame that names a known part (model compute, sampler,
scheduling, tokenizer, protobuf, NATS, HTTP/SSE, event loop); the workers' own step
timings (the `steps:` lines they log every 10 s) are copied beside them. Needs py-spy
(the `bench` extra) and the right to ptrace the children (root, or ptrace_scope 0).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

from result_path import OUT_HELP, out_path

from tokenyard.bus.embedded import free_port
from tokenyard.cli import up
from tokenyard.services.launch.stack import LocalStack

# Innermost matching frame wins; earlier rows win over later ones within one frame.
BUCKETS: list[tuple[str, tuple[str, ...]]] = [
    ("tokenize/detokenize", ("tokenizer", "tokenizers", "jinja2", "detoken")),
    ("protobuf", ("google/protobuf", "_pb2")),
    ("engine: sampler", ("engine/sampler",)),
    ("engine: scheduler + blocks", ("engine/scheduler", "engine/block_manager", "engine/sequence",
                                   "engine/stop", "kv/hashing")),
    ("engine: step bookkeeping", ("engine/model_runner", "engine/llm_engine")),
    ("engine: model compute", ("models/", "kernels/", "torch/")),
    ("NATS client", ("nats/",)),
    ("HTTP, JSON, SSE", ("uvicorn", "starlette", "fastapi", "pydantic", "h11", "httptools",
                         "json/", "sse", "services/gateway")),
    ("worker glue", ("services/worker",)),
    ("router", ("services/router",)),
    ("event loop", ("asyncio/", "selectors", "uvloop")),
    ("gRPC / KV transfer", ("grpc", "kv/transfer", "kv/store", "services/kvcache")),
]  # fmt: skip

FRAME = re.compile(r"^(?P<fn>.*?) \((?P<file>[^:()]+)(?::\d+)?\)$")


def bucket_of(stack: str) -> str:
    """The bucket of one collapsed stack (frames root first, ';'-separated)."""
    for frame in reversed(stack.split(";")):
        m = FRAME.match(frame.strip())
        where = m.group("file") if m else frame
        for name, needles in BUCKETS:
            if any(n in where for n in needles):
                return name
    return "other"


def summarize_raw(path: Path, top: int = 12) -> dict:
    """py-spy's raw output (collapsed stacks with counts) -> buckets and top leaf frames."""
    buckets: Counter[str] = Counter()
    leaves: Counter[str] = Counter()
    total = 0
    if path.exists():
        for line in path.read_text(errors="replace").splitlines():
            stack, _, count = line.rpartition(" ")
            if not stack or not count.isdigit():
                continue
            n = int(count)
            total += n
            buckets[bucket_of(stack)] += n
            leaves[stack.split(";")[-1].strip()] += n
    return {
        "samples": total,
        "buckets": {k: round(v / total, 4) for k, v in buckets.most_common()} if total else {},
        "top_leaves": [[k, round(v / total, 4)] for k, v in leaves.most_common(top)]
        if total
        else [],
    }


def proc_cpu_s(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def proc_rss_bytes(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    return 0


def start_stack(args: argparse.Namespace, log_dir: Path) -> LocalStack:
    parser = argparse.ArgumentParser()
    up.add_arguments(parser)  # exactly what `tokenyard up` runs, defaults included
    argv = ["--port", str(free_port()), "--log-dir", str(log_dir)]
    layout = ["--aggregated"] if args.aggregated else ["--disaggregated"] if args.split else []
    config = up.config_from(parser.parse_args(argv + layout))
    stack = LocalStack(config).start()
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        stack.check_alive()
        body = stack.ready()
        if body is not None and stack.all_workers_registered(body):
            return stack
        time.sleep(0.5)
    stack.stop()
    raise SystemExit("the stack did not become ready in 300 s")


def bench(url: str, args: argparse.Namespace, out: Path, num: int, warmup: int) -> dict:
    argv = [
        sys.executable, "-m", "tokenyard.cli", "bench", "serve", "--url", url,
        "--workload", "chat", "--input-len", str(args.input_len),
        "--output-len", str(args.output_len), "--len-sigma", "0", "--ignore-eos",
        "--concurrency", str(args.concurrency), "--num-prompts", str(num),
        "--warmup", str(warmup), "--no-progress", "--out", str(out), "--plots", str(out.parent),
    ]  # fmt: skip
    subprocess.run(argv, check=True, stdout=subprocess.DEVNULL)
    return json.loads(out.read_text())["runs"][0]["summary"]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--aggregated", action="store_true")
    p.add_argument("--disaggregated", dest="split", action="store_true")
    p.add_argument("--concurrency", type=int, default=32)
    p.add_argument("--num-prompts", type=int, default=64)
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--rate", type=int, default=50, help="py-spy samples per second")
    p.add_argument("--out", type=Path, help=OUT_HELP)
    args = p.parse_args()
    args.out = out_path(args.out, "profile_stack")
    pyspy = shutil.which("py-spy") or str(Path(sys.executable).with_name("py-spy"))
    if not Path(pyspy).exists():
        raise SystemExit("py-spy is not installed: pip install -e '.[bench]'")
    work = Path(tempfile.mkdtemp(prefix="tokenyard-profile-"))
    stack = start_stack(args, work / "logs")
    try:
        bench(stack.gateway_url, args, work / "warm.json", args.concurrency, 0)
        procs = {p.name: p.pid for p in stack.procs if p.alive()}
        cpu0 = {n: proc_cpu_s(pid) for n, pid in procs.items()}
        spies = {
            n: subprocess.Popen(
                [
                    pyspy,
                    "record",
                    "--pid",
                    str(pid),
                    "--format",
                    "raw",
                    "--rate",
                    str(args.rate),
                    "--nonblocking",
                    "--output",
                    str(work / f"{n}.txt"),
                ],
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
            )  # fmt: skip
            for n, pid in procs.items()
            if n != "nats"
        }
        started = time.monotonic()
        summary = bench(stack.gateway_url, args, work / "load.json", args.num_prompts, 0)
        wall = time.monotonic() - started
        cpu = {n: proc_cpu_s(pid) - cpu0[n] for n, pid in procs.items()}
        rss = {n: proc_rss_bytes(pid) for n, pid in procs.items()}
        for spy in spies.values():
            spy.send_signal(signal.SIGINT)
        for spy in spies.values():
            spy.wait(timeout=60)
        steps = {
            p.name: [
                line.split(" INFO ", 1)[-1]
                for line in (work / "logs" / f"{p.name}.log").read_text().splitlines()
                if "steps:" in line
            ][-3:]
            for p in stack.workers
        }
    finally:
        stack.stop()
    doc = {
        "config": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
        "machine": {"cpus": os.cpu_count(), "load_avg_before": os.getloadavg()},
        "wall_s": wall,
        "bench": {
            "output_tok_s": summary["output_token_throughput"],
            "ttft_p50_ms": summary["ttft_ms"]["p50"],
            "ok": summary["requests"]["ok"],
            "failed": summary["requests"]["failed"],
        },
        "processes": {
            n: {
                "cpu_cores": round(cpu[n] / wall, 3),
                "rss_mib": round(rss[n] / 2**20, 1),
                **(summarize_raw(work / f"{n}.txt") if n in spies else {}),
                **({"step_log": steps[n]} if n in steps else {}),
            }
            for n in procs
        },
    }
    args.out.write_text(json.dumps(doc, indent=2) + "\n")
    print_report(doc)
    return 0


def print_report(doc: dict) -> None:
    b = doc["bench"]
    print(
        f"{b['output_tok_s']:.1f} output tok/s, TTFT p50 {b['ttft_p50_ms']:.0f} ms, "
        f"{b['ok']} ok / {b['failed']} failed, {doc['wall_s']:.1f} s"
    )
    for name, p in doc["processes"].items():
        top = ", ".join(f"{k} {v:.0%}" for k, v in list(p.get("buckets", {}).items())[:6])
        print(f"{name:>12}: {p['cpu_cores']:.2f} cores, {p['rss_mib']:.0f} MiB  {top}")
        for line in p.get("step_log", [])[-1:]:
            print(f"{'':>14}{line}")


if __name__ == "__main__":
    raise SystemExit(main())
