"""The router's KV-aware placement against round-robin, on the stack itself.

    .venv/bin/python benchmarks/routing.py [--workers 2] [--rounds 1] [--shape NAME] \
        [--out routing.json]

Starts `tokenyard up --workers N` (aggregated workers, each with its own prefix cache; the
KV-cache service between them as `tokenyard up` runs it) once with `--router-placement
kv-aware` (the default) and once with `round-robin`, the order reversed each round, and
loads each with the same client (`tokenyard bench serve`, --ignore-eos, fixed lengths):

- multi-turn: conversations of several turns, each turn's prompt the whole history so far,
  so the worker that ran the previous turn holds all but the new user message;
- shared-prefix: one long system prompt, byte-identical for every request.

For each it reports output tok/s and TTFT p50/p99 per placement and the ratios
(round-robin's TTFT over kv-aware's: above 1 means kv-aware answers sooner).
"""

from __future__ import annotations

import argparse
import functools
import json
import sys
import tempfile
from pathlib import Path
from typing import Any

import model_shapes
from peers import Model, Workload, chosen_model, measure, start_tokenyard
from result_path import OUT_HELP, out_path

PLACEMENTS = ("kv-aware", "round-robin")


def workloads(args: argparse.Namespace) -> list[Workload]:
    fixed = ["--len-sigma", "0", "--output-len", str(args.output_len)]
    c, num = args.concurrency, args.num_prompts
    return [
        Workload(
            f"multi-turn c={c}",
            ["--workload", "multi-turn", "--turns", str(args.turns), "--input-len",
             str(args.turn_len), *fixed],
            c,
            num,
        ),
        Workload(
            f"shared-prefix c={c}",
            ["--workload", "shared-prefix", "--prefix-len", str(args.prefix_len),
             "--input-len", "48", *fixed],
            c,
            num,
        ),
    ]  # fmt: skip


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--num-prompts", type=int, default=48)
    parser.add_argument("--turns", type=int, default=6, help="multi-turn: turns a conversation")
    parser.add_argument(
        "--turn-len", type=int, default=96, help="multi-turn: tokens of each new user message"
    )
    parser.add_argument(
        "--prefix-len", type=int, default=768, help="shared-prefix: the system prompt's tokens"
    )
    parser.add_argument("--output-len", type=int, default=48)
    parser.add_argument(
        "--no-kvcache",
        action="store_true",
        help="run the stack without its KV-cache service, so a miss at the worker is recomputed "
        "(separates the router's share from the shared tier's)",
    )
    parser.add_argument("--shape", choices=list(model_shapes.SHAPES))
    parser.add_argument("--out", type=Path, help=OUT_HELP)
    args = parser.parse_args()
    model: Model = chosen_model(args.shape, None)
    loads = workloads(args)
    out = out_path(args.out, "routing")
    doc: dict[str, Any] = {
        "model": model.name,
        "workers": args.workers,
        "kvcache": not args.no_kvcache,
        "workloads": {w.label: w.flags for w in loads},
        "rounds": [],
    }
    with tempfile.TemporaryDirectory(prefix="tokenyard-routing-") as tmp:
        for r in range(args.rounds):
            order = PLACEMENTS if r % 2 == 0 else PLACEMENTS[::-1]
            results: dict[str, Any] = {}
            for placement in order:
                work = Path(tmp) / f"r{r}-{placement}"
                work.mkdir()
                flags = ["--workers", str(args.workers), "--router-placement", placement]
                flags += ["--no-kvcache"] if args.no_kvcache else []
                start = functools.partial(start_tokenyard, flags, work / "logs", model)
                results[placement] = measure(placement, start, work, loads, model.name)
            doc["rounds"].append(results)
            out.write_text(json.dumps(doc, indent=2))
    doc["ratios"] = ratios(doc["rounds"], [w.label for w in loads])
    out.write_text(json.dumps(doc, indent=2))
    for label, r in doc["ratios"].items():
        print(
            f"{label}: TTFT p50 round-robin / kv-aware {r['ttft_p50_rr_over_kv']}, "
            f"tok/s kv-aware / round-robin {r['tok_s_kv_over_rr']}"
        )
    print(f"wrote {out}")
    return 0


def ratios(rounds: list[dict[str, Any]], labels: list[str]) -> dict[str, Any]:
    """Per workload, each round's ratios and their median."""
    out: dict[str, Any] = {}
    for label in labels:
        ttft, tok = [], []
        for results in rounds:
            kv, rr = (results[p]["workloads"][label] for p in PLACEMENTS)
            ttft.append(round(rr["ttft_p50_ms"] / kv["ttft_p50_ms"], 3))
            tok.append(round(kv["output_tok_s"] / rr["output_tok_s"], 3))
        out[label] = {
            "ttft_p50_rr_over_kv": sorted(ttft)[len(ttft) // 2],
            "tok_s_kv_over_rr": sorted(tok)[len(tok) // 2],
            "per_round": {"ttft_p50_rr_over_kv": ttft, "tok_s_kv_over_rr": tok},
        }
    return out


if __name__ == "__main__":
    sys.exit(main())
