"""What deterministic mode costs: bf16 + int4 with and without `deterministic=True`, same run.

    python benchmarks/deterministic.py --out benchmarks/results/deterministic.json --doc docs/precision.md

Two workloads, each timed for both engines in alternation (A B A B ...) so that a noisy,
shared machine slows both alike: (a) one request, 128 prompt + 32 output tokens; (b) 16
requests together, 128 prompt + 32 output tokens each. Reported: the median wall time of
each and the deterministic/default ratio.
"""

from __future__ import annotations

import argparse
import json
import platform
import random
import statistics
import time
from pathlib import Path

from tokenyard.bench.text import text_of_tokens
from tokenyard.engine.config import EngineConfig
from tokenyard.engine.llm_engine import LLMEngine
from tokenyard.engine.sampling_params import SamplingParams
from tokenyard.models.loader import load_model

PROMPT_LEN, OUTPUT_LEN, CONCURRENT, REPEATS = 128, 32, 16, 3
PARAMS = SamplingParams(max_tokens=OUTPUT_LEN, temperature=0, ignore_eos=True)


def timed(engine: LLMEngine, prompts: list[list[int]], tag: str) -> float:
    start = time.perf_counter()
    for i, p in enumerate(prompts):
        engine.add_request(f"{tag}-{i}", p, PARAMS)
    while engine.has_unfinished():
        engine.step()
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="benchmarks/results/deterministic.json")
    parser.add_argument("--doc", help="also replace the cost table in this markdown file")
    args = parser.parse_args()
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
        for mode in ("default", "deterministic")
    }
    rng = random.Random(0)
    tok = loaded.tokenizer
    prompts = [tok.encode(text_of_tokens(rng, PROMPT_LEN))[:PROMPT_LEN] for _ in range(CONCURRENT)]
    workloads = {"1 request": prompts[:1], f"{CONCURRENT} requests": prompts}
    times: dict[str, dict[str, list[float]]] = {w: {m: [] for m in engines} for w in workloads}
    for r in range(REPEATS):
        for w, batch in workloads.items():
            for mode, engine in engines.items():
                times[w][mode].append(timed(engine, batch, f"{w}-{r}"))
    rows = []
    for w, by_mode in times.items():
        default, det = (statistics.median(by_mode[m]) for m in ("default", "deterministic"))
        rows.append(
            {
                "workload": f"{w}, {PROMPT_LEN} prompt + {OUTPUT_LEN} output tokens",
                "default_s": round(default, 3),
                "deterministic_s": round(det, 3),
                "ratio": round(det / default, 2),
                "runs": by_mode,
            }
        )
    result = {
        "precision": "bf16 + int4",
        "repeats": REPEATS,
        "machine": f"{platform.machine()} {platform.processor()}, shared with other jobs",
        "rows": rows,
    }
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    table = "\n".join(
        [
            "| workload | default s | deterministic s | deterministic / default |",
            "|---|---|---|---|",
            *(
                f"| {r['workload']} | {r['default_s']} | {r['deterministic_s']} | {r['ratio']}x |"
                for r in rows
            ),
        ]
    )
    if args.doc:
        _replace_between(Path(args.doc), "deterministic-cost", table)
    print(table)


def _replace_between(doc: Path, marker: str, new: str) -> None:
    begin, end = f"<!-- {marker} -->", f"<!-- /{marker} -->"
    head, rest = doc.read_text().split(begin)
    _, tail = rest.split(end)
    doc.write_text(f"{head}{begin}\n{new}\n{end}{tail}")


if __name__ == "__main__":
    main()
