"""What deterministic mode costs: bf16 + int4 with and without `deterministic=True`, same run.

    python benchmarks/deterministic.py --doc docs/precision.md

Batches of 1, 8 and 32 requests (`--batches`), each request PROMPT_LEN prompt + OUTPUT_LEN
output tokens, greedy. Each batch is timed for both engines in alternation (A B A B ...) so
that a noisy, shared machine slows both alike. Reported per batch and mode: the median wall
time, split into prefill (until every request has its first token) and decode (the rest),
and output tokens per second; and the deterministic/default ratios. Bounded: no new repeat
starts after `--seconds-per-batch` (one always runs), and the JSON is written after each
batch size.
"""

from __future__ import annotations

import argparse
import json
import platform
import random
import statistics
import time
from pathlib import Path

from result_path import OUT_HELP, out_path

from tokenyard.bench.text import text_of_tokens
from tokenyard.engine.config import EngineConfig
from tokenyard.engine.llm_engine import LLMEngine
from tokenyard.engine.sampling_params import SamplingParams
from tokenyard.models.loader import load_model

PROMPT_LEN, OUTPUT_LEN, REPEATS = 64, 16, 3
PARAMS = SamplingParams(max_tokens=OUTPUT_LEN, temperature=0, ignore_eos=True)
MODES = ("default", "deterministic")


def timed(engine: LLMEngine, prompts: list[list[int]], tag: str) -> tuple[float, float]:
    """(prefill s, decode s) of one batch run to the end."""
    start = time.perf_counter()
    for i, p in enumerate(prompts):
        engine.add_request(f"{tag}-{i}", p, PARAMS)
    started: set[str] = set()
    prefilled = None
    while engine.has_unfinished():
        for out in engine.step():
            if out.new_token_ids:
                started.add(out.request_id)
        if prefilled is None and len(started) == len(prompts):
            prefilled = time.perf_counter()
    end = time.perf_counter()
    prefilled = prefilled or end
    return prefilled - start, end - prefilled


def measure(
    engines: dict[str, LLMEngine], prompts: list[list[int]], repeats: int, seconds: float
) -> dict:
    runs: dict[str, list[tuple[float, float]]] = {m: [] for m in engines}
    start = time.perf_counter()
    for r in range(repeats):
        if r and time.perf_counter() - start > seconds:
            break
        for mode, engine in engines.items():
            runs[mode].append(timed(engine, prompts, f"b{len(prompts)}-{r}"))
    row: dict = {"batch": len(prompts), "repeats": len(runs["default"])}
    for mode, times in runs.items():
        prefill = statistics.median(t[0] for t in times)
        decode = statistics.median(t[1] for t in times)
        total = statistics.median(sum(t) for t in times)
        row[mode] = {
            "wall_s": round(total, 3),
            "prefill_s": round(prefill, 3),
            "decode_s": round(decode, 3),
            "output_tok_s": round(len(prompts) * OUTPUT_LEN / total, 2),
            "runs": [[round(a, 3), round(b, 3)] for a, b in times],
        }
    for part in ("wall_s", "prefill_s", "decode_s"):
        row[f"ratio_{part[:-2]}"] = round(row["deterministic"][part] / row["default"][part], 2)
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, help=OUT_HELP)
    parser.add_argument("--doc", help="also replace the cost table in this markdown file")
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32])
    parser.add_argument("--repeats", type=int, default=REPEATS)
    parser.add_argument("--seconds-per-batch", type=float, default=60.0)
    args = parser.parse_args()
    args.out = out_path(args.out, "deterministic")
    started = time.perf_counter()
    loaded = load_model()
    engines = {
        mode: LLMEngine(
            EngineConfig(
                dtype="bfloat16",
                quantization="int4",
                deterministic=mode == "deterministic",
                enable_prefix_caching=False,  # every repeat computes its prompts
                kv_cache_bytes=256 * 1024**2,
            ),
            loaded=loaded,
        )
        for mode in MODES
    }
    rng = random.Random(0)
    tok = loaded.tokenizer
    prompts = [
        tok.encode(text_of_tokens(rng, PROMPT_LEN))[:PROMPT_LEN] for _ in range(max(args.batches))
    ]
    rows = []
    for batch in args.batches:
        rows.append(measure(engines, prompts[:batch], args.repeats, args.seconds_per_batch))
        result = {
            "precision": "bf16 + int4",
            "prompt_tokens": PROMPT_LEN,
            "output_tokens": OUTPUT_LEN,
            "machine": f"{platform.machine()} {platform.processor()}, shared with other jobs",
            "wall_s": round(time.perf_counter() - started, 1),
            "rows": rows,
        }
        args.out.write_text(json.dumps(result, indent=2) + "\n")
        print(json.dumps({k: v for k, v in rows[-1].items() if k not in MODES}))
    table = "\n".join(
        [
            "| batch | default s (prefill + decode) | deterministic s (prefill + decode) "
            "| deterministic / default: total, prefill, decode |",
            "|---|---|---|---|",
            *(
                f"| {r['batch']} | {_cell(r['default'])} | {_cell(r['deterministic'])} "
                f"| {r['ratio_wall']}x, {r['ratio_prefill']}x, {r['ratio_decode']}x |"
                for r in rows
            ),
        ]
    )
    if args.doc:
        _replace_between(Path(args.doc), "deterministic-cost", table)
    print(table)


def _cell(mode: dict) -> str:
    return f"{mode['wall_s']} ({mode['prefill_s']} + {mode['decode_s']})"


def _replace_between(doc: Path, marker: str, new: str) -> None:
    begin, end = f"<!-- {marker} -->", f"<!-- /{marker} -->"
    head, rest = doc.read_text().split(begin)
    _, tail = rest.split(end)
    doc.write_text(f"{head}{begin}\n{new}\n{end}{tail}")


if __name__ == "__main__":
    main()
