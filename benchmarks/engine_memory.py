"""What an engine holds in memory at a model's shape, and what its steps cost, for settings
compared in alternation.

    .venv/bin/python benchmarks/engine_memory.py --shape llama-3.2-1b --rounds 3 \
        --variant default --variant 'no-dense:dense_weights=never'

Each variant is a set of EngineConfig fields on top of a CPU worker's (dtype auto, int4, a
prefaulted 1 GiB KV pool as `peers.py` gives the stack at a shape, no prefix cache). Every
measurement is a fresh process that builds the engine, reads its PSS and RSS
(/proc/self/smaps_rollup) and peak RSS, then times a --prompt-token prefill (the step or
steps to its first token) and decode steps at each --batch size (wall clock around
`engine.step()`). Rounds run the variants in turn, the order reversed every round, so a
host whose speed moves biases none of them; the summary takes medians over rounds.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from decode_profile import decode_steps, finish, prefill  # beside this script
from engine import prompts
from result_path import OUT_HELP, out_path

KV_MIB = 1024


def memory_now() -> dict[str, float]:
    """This process's PSS, RSS and peak RSS in MiB, once glibc has handed back the heap that
    loading and steps freed (a worker does so whenever it idles)."""
    from tokenyard.lifecycle import trim_heap

    gc.collect()
    trim_heap()
    rollup = Path("/proc/self/smaps_rollup").read_text().splitlines()[1:]
    fields = {line.split(":")[0]: int(line.split()[1]) for line in rollup}
    status = Path("/proc/self/status").read_text()
    peak = next(int(line.split()[1]) for line in status.splitlines() if line.startswith("VmHWM"))
    return {
        "pss_mib": round(fields["Pss"] / 1024, 1),
        "rss_mib": round(fields["Rss"] / 1024, 1),
        "peak_rss_mib": round(peak / 1024, 1),
    }


def parse_variant(text: str) -> tuple[str, dict[str, Any]]:
    """'name:key=value,key=value' (values as JSON where they parse, else strings)."""
    name, _, rest = text.partition(":")
    fields: dict[str, Any] = {}
    for item in filter(None, rest.split(",")):
        key, _, value = item.partition("=")
        try:
            fields[key] = json.loads(value)
        except json.JSONDecodeError:
            fields[key] = value
    return name, fields


def build(model: str, fields: dict[str, Any]):
    from tokenyard.engine.config import EngineConfig
    from tokenyard.engine.llm_engine import LLMEngine

    config: dict[str, Any] = {
        "model": model,
        "dtype": "auto",
        "quantization": "int4",
        "max_num_seqs": 64,
        "kv_cache_bytes": KV_MIB * 1024**2,
        "prefault_kv_pool": True,
        "enable_prefix_caching": False,
    }
    return LLMEngine(EngineConfig(**(config | fields)))


def time_prefill(engine, tokens: int, repeats: int) -> float:
    """Median seconds from adding one `tokens`-token prompt to its first token."""
    from tokenyard.engine.sampling_params import SamplingParams

    params = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    times = []
    for i in range(repeats):
        (prompt,) = prompts(engine.tokenizer, 1, tokens)
        engine.add_request(f"prefill-{i}", prompt, params)
        start = time.perf_counter()
        while engine.has_unfinished():
            engine.step()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def child(model: str, fields: dict[str, Any], args: argparse.Namespace) -> dict[str, Any]:
    start = time.perf_counter()
    engine = build(model, fields)
    built_s = time.perf_counter() - start
    result: dict[str, Any] = {
        "build_s": round(built_s, 1),
        "after_build": memory_now(),
        "split": engine.memory.describe(),
        "weights_mib": round(engine.memory.weights_bytes / 1024**2, 1),
    }
    if args.no_steps:
        result["after_steps"] = result["after_build"]
        return result
    prefill(engine, 1, 16, 4, "warm")
    decode_steps(engine, 4)
    finish(engine, 1, "warm")
    result["prefill_ms"] = round(time_prefill(engine, args.prompt_tokens, args.repeats) * 1e3, 1)
    steps = {}
    for batch in (int(b) for b in args.batch.split(",")):
        prefill(engine, batch, args.context, 2 * args.steps, f"b{batch}")
        steps[str(batch)] = round(statistics.median(decode_steps(engine, args.steps)) * 1e3, 2)
        finish(engine, batch, f"b{batch}")
    result["step_ms"] = steps
    result["after_steps"] = memory_now()
    return result


def run_child(args: argparse.Namespace, model: str, variant: str) -> dict[str, Any]:
    argv = [sys.executable, __file__, "--child", variant, "--model", model]
    argv += ["--batch", args.batch, "--context", str(args.context), "--steps", str(args.steps)]
    argv += ["--prompt-tokens", str(args.prompt_tokens), "--repeats", str(args.repeats)]
    argv += ["--no-steps"] if args.no_steps else []
    done = subprocess.run(argv, capture_output=True, text=True, env=os.environ.copy())
    if done.returncode != 0:
        raise RuntimeError(f"variant {variant!r} failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def summary(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Medians over rounds of one variant."""

    def med(get) -> float:
        return round(statistics.median(get(r) for r in runs), 2)

    return {
        "pss_mib": med(lambda r: r["after_steps"]["pss_mib"]),
        "pss_after_build_mib": med(lambda r: r["after_build"]["pss_mib"]),
        "peak_rss_mib": med(lambda r: r["after_steps"]["peak_rss_mib"]),
        "prefill_ms": med(lambda r: r.get("prefill_ms", 0.0)),
        "step_ms": {b: med(lambda r, b=b: r["step_ms"][b]) for b in runs[0].get("step_ms", {})},
        "split": runs[-1]["split"],
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    where = parser.add_mutually_exclusive_group(required=True)
    where.add_argument("--shape", help="a benchmarks/model_shapes.py shape (written on first use)")
    where.add_argument("--model", help="an HF folder or a .gguf file")
    parser.add_argument(
        "--variant",
        action="append",
        help="name:field=value,... EngineConfig fields over a worker's (repeatable; "
        "default: one variant, 'default')",
    )
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--batch", default="1,8,32", help="decode batch sizes")
    parser.add_argument("--context", type=int, default=128, help="prompt tokens per decoding row")
    parser.add_argument("--steps", type=int, default=12, help="decode steps timed per batch")
    parser.add_argument("--prompt-tokens", type=int, default=512)
    parser.add_argument("--repeats", type=int, default=3, help="prefills timed per process")
    parser.add_argument("--no-steps", action="store_true", help="memory only: no timings")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--out", type=Path, help=OUT_HELP)
    args = parser.parse_args()

    model = args.model
    if args.shape:
        import model_shapes

        model = str(model_shapes.ensure(args.shape))
    if args.child is not None:
        print(json.dumps(child(model, parse_variant(args.child)[1], args)))
        return 0
    variants = args.variant or ["default"]
    runs: dict[str, list[dict[str, Any]]] = {parse_variant(v)[0]: [] for v in variants}
    for i in range(args.rounds):
        for variant in variants if i % 2 == 0 else variants[::-1]:
            name = parse_variant(variant)[0]
            runs[name].append(run_child(args, model, variant))
            last = runs[name][-1]
            print(
                f"round {i + 1} {name}: PSS {last['after_steps']['pss_mib']} MiB, "
                f"prefill {last.get('prefill_ms')} ms, steps {last.get('step_ms')} ms",
                flush=True,
            )
    doc = {
        "model": args.shape or model,
        "load_average": os.getloadavg(),
        "variants": {v: parse_variant(v)[1] for v in variants},
        "summary": {name: summary(r) for name, r in runs.items()},
        "runs": runs,
    }
    for name, s in doc["summary"].items():
        print(f"{name}: {json.dumps({k: v for k, v in s.items() if k != 'split'})}")
        print(f"    {s['split']}")
    out = out_path(args.out, "engine_memory")
    out.write_text(json.dumps(doc, indent=2))
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
