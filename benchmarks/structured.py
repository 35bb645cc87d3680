"""Structured outputs: schema-constrained requests against free text on the same engine.

    python benchmarks/structured.py [--out structured.json]

At concurrency 1 (one request at a time) and 8 (eight at once), each request asks for
at most MAX_TOKENS tokens at temperature 0: output tok/s over the wall time, TTFT (from
add_request to the first token), and for the guided runs what the grammar masks cost:
their compute time per token (on the mask thread, beside the forward pass) and the main
thread's wait for them after the forward pass (the only part that can add latency).
Free-text requests ignore EOS and stop at MAX_TOKENS; guided ones stop where the JSON ends,
so tok/s (not totals) is what compares. Both modes run in the same process, their waves
alternating, so they share the machine's state; on a shared machine compare the ratios.

Bounded in time: each concurrency runs up to `--rounds` waves per mode but starts no new
round once `--seconds-per-concurrency` have passed (one round always runs), and the JSON is
written after each concurrency, so a run cut short still leaves its figures.
"""

from __future__ import annotations

import argparse
import json
import platform
import time
from pathlib import Path

from result_path import OUT_HELP, out_path

from tokenyard.engine.config import EngineConfig
from tokenyard.engine.llm_engine import LLMEngine
from tokenyard.engine.sampling_params import GuidedSpec, SamplingParams

MAX_TOKENS = 32  # a JSON answer of the schema below fits; free text stops here
CONCURRENCY = (1, 8)
CITIES = ["Paris", "Tokyo", "Lima", "Cairo", "Oslo", "Delhi", "Quito", "Perth"]
SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 30},
        "country": {"type": "string", "maxLength": 30},
        "population": {"type": "integer", "minimum": 0, "maximum": 99_999_999},
    },
    "required": ["name", "country", "population"],
    "additionalProperties": False,
}


def params(guided: bool) -> SamplingParams:
    if guided:
        spec = GuidedSpec("json_schema", json.dumps(SCHEMA))
        return SamplingParams(max_tokens=MAX_TOKENS, temperature=0, guided=spec)
    return SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True)


def run_wave(engine: LLMEngine, wave: list[str], guided: bool, tag: str) -> tuple[int, list[float]]:
    """Requests added together and run to the end: (output tokens, TTFTs)."""
    start = time.perf_counter()
    for i, city in enumerate(wave):
        prompt = [{"role": "user", "content": f"Describe the city of {city} as JSON."}]
        engine.add_request(f"{tag}{i}", prompt, params(guided))
    first: dict[str, float] = {}
    tokens = 0
    while engine.has_unfinished():
        for out in engine.step():
            first.setdefault(out.request_id, time.perf_counter() - start)
            tokens += len(out.new_token_ids)
    return tokens, list(first.values())


class Tally:
    """One mode at one concurrency, summed over its rounds."""

    def __init__(self, guided: bool, concurrency: int) -> None:
        self.guided, self.concurrency = guided, concurrency
        self.requests = self.tokens = 0
        self.wall = 0.0
        self.ttfts: list[float] = []
        self.masks, self.compute_s, self.wait_s = 0, 0.0, 0.0

    def run(self, engine: LLMEngine, wave: list[str], tag: str) -> None:
        stats = engine.guide.stats
        masks0, compute0, wait0 = stats.num_masks, stats.compute_s, stats.wait_s
        start = time.perf_counter()
        tokens, ttfts = run_wave(engine, wave, self.guided, tag)
        self.wall += time.perf_counter() - start
        self.requests += len(wave)
        self.tokens += tokens
        self.ttfts += ttfts
        self.masks += stats.num_masks - masks0
        self.compute_s += stats.compute_s - compute0
        self.wait_s += stats.wait_s - wait0

    def report(self) -> dict:
        out = {
            "mode": "json_schema" if self.guided else "free_text",
            "concurrency": self.concurrency,
            "requests": self.requests,
            "output_tokens": self.tokens,
            "wall_s": round(self.wall, 3),
            "output_tok_s": round(self.tokens / self.wall, 2),
            "ttft_mean_s": round(sum(self.ttfts) / len(self.ttfts), 4),
        }
        if self.masks:
            out["mask_compute_us_per_token"] = round(self.compute_s / self.masks * 1e6, 1)
            out["mask_wait_us_per_token"] = round(self.wait_s / self.masks * 1e6, 1)
        return out


def measure(engine: LLMEngine, concurrency: int, rounds: int, seconds: float) -> list[dict]:
    """Free and guided waves alternate, so both modes see the same machine (it may be shared).
    No new round starts after `seconds`."""
    free, guided = Tally(False, concurrency), Tally(True, concurrency)
    start = time.perf_counter()
    for r in range(rounds):
        if r and time.perf_counter() - start > seconds:
            break
        wave = [CITIES[(r * concurrency + i) % len(CITIES)] for i in range(concurrency)]
        free.run(engine, wave, f"f{concurrency}.{r}.")
        guided.run(engine, wave, f"g{concurrency}.{r}.")
    return [free.report(), guided.report()]


def ratios(results: list[dict]) -> dict[str, float]:
    """Per concurrency: json_schema tok/s and TTFT over free text's."""
    out = {}
    for c in sorted({r["concurrency"] for r in results}):
        free, guided = (
            next(r for r in results if r["concurrency"] == c and r["mode"] == mode)
            for mode in ("free_text", "json_schema")
        )
        out[f"c{c}_json_over_free_tok_s"] = round(guided["output_tok_s"] / free["output_tok_s"], 3)
        out[f"c{c}_json_over_free_ttft"] = round(guided["ttft_mean_s"] / free["ttft_mean_s"], 3)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, help=OUT_HELP)
    parser.add_argument("--rounds", type=int, default=3, help="waves per mode and concurrency")
    parser.add_argument(
        "--seconds-per-concurrency",
        type=float,
        default=90.0,
        help="start no new round after this long (one round always runs)",
    )
    args = parser.parse_args()
    args.out = out_path(args.out, "structured")
    started = time.perf_counter()
    engine = LLMEngine(EngineConfig())
    run_wave(engine, CITIES[:1], True, "warm")  # builds the llguidance tokenizer once
    results: list[dict] = []
    for concurrency in CONCURRENCY:
        results += measure(engine, concurrency, args.rounds, args.seconds_per_concurrency)
        print(json.dumps(results[-2:]))
        report = {
            "benchmark": "structured",
            "model": engine.model_id,
            "machine": platform.processor() or platform.machine(),
            "max_tokens": MAX_TOKENS,
            "max_rounds": args.rounds,
            "note": "machine shared with other jobs while measured: compare the ratios",
            "wall_s": round(time.perf_counter() - started, 1),
            "results": results,
            "ratios": ratios(results),
        }
        args.out.write_text(json.dumps(report, indent=2) + "\n")


if __name__ == "__main__":
    main()
