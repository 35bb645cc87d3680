"""Quality of every weight precision on one fixed text, against fp32 on the same weights.

    python benchmarks/precision.py --doc docs/precision.md [--out precision.json]

For each precision: perplexity of the text below (teacher-forced, every token after the
first), top-1 agreement with fp32 on that text (how often the most likely next token is the
same), and greedy agreement on chat prompts (the share of generated tokens equal to fp32's
before the first divergence, and how many answers are identical), plus the weight bytes. The
default model's GGUF is Q4_1, so "fp32" is those int4 weights dequantized: int4 re-packs the
same grid, and the other precisions round it further.
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import time
from pathlib import Path
from typing import Any

from result_path import OUT_HELP, out_path

from tokenyard.engine.config import EngineConfig
from tokenyard.engine.llm import GenerationResult, _result
from tokenyard.engine.llm_engine import LLMEngine
from tokenyard.engine.sampling_params import SamplingParams
from tokenyard.models.loader import LoadedModel, load_model

# (name, dtype, quantization, KV pool dtype); the first is the reference. "auto" KV pools are
# the compute dtype's, except fp16 beside fp32 (EngineConfig.kv_cache_dtype).
PRECISIONS = [
    ("fp32", "float32", None, "float32"),
    ("fp32, fp16 KV", "float32", None, "float16"),
    ("fp32 + int4, fp16 KV (shipped on AVX2-only CPUs)", "float32", "int4", "auto"),
    ("bf16", "bfloat16", None, "auto"),
    ("bf16 + int8", "bfloat16", "int8", "auto"),
    ("bf16 + fp8", "bfloat16", "fp8", "auto"),
    ("bf16 + int4 (shipped on CPUs with native bf16)", "bfloat16", "int4", "auto"),
    ("bf16, fp8 KV", "bfloat16", None, "fp8"),
    ("bf16 + int4, fp8 KV", "bfloat16", "int4", "fp8"),
]

TEXT = (
    "The harbor town woke early. Before the sun cleared the hills, the fishing boats were "
    "already sliding out past the breakwater, their lamps still lit, and the baker on the "
    "corner had opened his shutters to let the smell of bread into the street. Most people "
    "who lived there had never thought of the town as beautiful; it was simply where the "
    "work was. The cannery paid on Fridays, the ferry ran twice a day to the mainland, and "
    "in winter the wind came straight off the sea and found every gap in every window.\n\n"
    "A train leaves the station at nine in the morning and travels at sixty kilometres per "
    "hour. A second train leaves the same station an hour later on a parallel track, "
    "travelling at eighty kilometres per hour. To find when the second train catches the "
    "first, note that the first has a sixty kilometre lead when the second sets off, and "
    "the gap closes at twenty kilometres per hour, so the second train draws level three "
    "hours after it leaves, at noon, one hundred and eighty kilometres from the station.\n\n"
    "def mean(values):\n"
    '    """The arithmetic mean of a non-empty list of numbers."""\n'
    "    if not values:\n"
    '        raise ValueError("mean of an empty list")\n'
    "    return sum(values) / len(values)\n\n"
    "Water boils at one hundred degrees Celsius at sea level, but at lower temperatures on a "
    "mountain, because the air pressure there is lower. Cooks at high altitude therefore "
    "need longer to boil an egg, and some recipes adjust their baking times and amounts of "
    "leavening to make up for it."
)

CHATS = [
    "What is the capital of Italy?",
    "Write a haiku about the sea.",
    "Explain what a hash table is in two sentences.",
    "List three prime numbers greater than ten.",
    "Why is the sky blue?",
    "Give me a short tip for learning a new language.",
    "What is 12 times 7?",
    "Translate 'good morning' into French and Spanish.",
]
GEN_TOKENS = 48


def run(engine: LLMEngine, prompts: list[Any], params: SamplingParams) -> list[GenerationResult]:
    for i, p in enumerate(prompts):
        engine.add_request(f"q{i}", p, params)
    seqs = [engine.seqs[f"q{i}"] for i in range(len(prompts))]
    while engine.has_unfinished():
        engine.step()
    return [_result(s) for s in seqs]


def measure(
    loaded: LoadedModel, dtype: str, quantization: str | None, kv_cache_dtype: str = "auto"
) -> dict[str, Any]:
    config = EngineConfig(
        dtype=dtype,
        quantization=quantization,
        kv_cache_dtype=kv_cache_dtype,
        kv_cache_bytes=64 * 1024**2,
    )
    engine = LLMEngine(config, loaded=loaded)
    ids = engine.tokenizer.encode(TEXT)
    [scored] = run(engine, [ids], SamplingParams(max_tokens=1, prompt_logprobs=1))
    assert scored.prompt_logprobs is not None
    positions = [lp for lp in scored.prompt_logprobs if lp is not None]
    start = time.perf_counter()
    chats = [[{"role": "user", "content": c}] for c in CHATS]
    greedy = run(engine, chats, SamplingParams(max_tokens=GEN_TOKENS, temperature=0))
    return {
        "nll": [lp.logprob for lp in positions],
        "top1": [lp.top[0][0] for lp in positions],
        "answers": [r.token_ids for r in greedy],
        "texts": [r.text for r in greedy],
        "chat_seconds": time.perf_counter() - start,
        "weights_mib": engine.memory.weights_bytes / 1024**2,
        "decode_read_mib": engine.memory.decode_read_bytes / 1024**2,
    }


def compare(run: dict[str, Any], ref: dict[str, Any]) -> dict[str, Any]:
    nll = run["nll"]
    top1 = sum(a == b for a, b in zip(run["top1"], ref["top1"], strict=True)) / len(nll)
    matched = total = identical = 0
    for ours, theirs in zip(run["answers"], ref["answers"], strict=True):
        prefix = next(
            (i for i, (a, b) in enumerate(zip(ours, theirs, strict=False)) if a != b),
            min(len(ours), len(theirs)),
        )
        matched += prefix
        total += len(theirs)
        identical += ours == theirs
    return {
        "perplexity": round(math.exp(-sum(nll) / len(nll)), 3),
        "top1_agreement": round(top1, 4),
        "greedy_token_agreement": round(matched / total, 4),
        "identical_answers": f"{identical}/{len(ref['answers'])}",
        "weights_mib": round(run["weights_mib"], 1),
        "decode_read_mib": round(run["decode_read_mib"], 1),
        "chat_seconds": round(run["chat_seconds"], 2),
    }


def table(rows: list[dict[str, Any]]) -> str:
    lines = [
        "| precision | perplexity | top-1 agreement | greedy token agreement | identical answers "
        "| weights MiB | batch-1 decode reads MiB | chat batch s |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['precision']} | {r['perplexity']} | {r['top1_agreement']:.2%} "
            f"| {r['greedy_token_agreement']:.2%} | {r['identical_answers']} "
            f"| {r['weights_mib']} | {r['decode_read_mib']} | {r['chat_seconds']} |"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, help=OUT_HELP)
    parser.add_argument("--doc", help="also replace the table in this markdown file")
    parser.add_argument(
        "--only",
        help="precision names to run besides the reference, separated by ';' (default: all)",
    )
    args = parser.parse_args()
    wanted = PRECISIONS
    if args.only:
        names = {n.strip() for n in args.only.split(";")}
        unknown = names - {p[0] for p in PRECISIONS}
        if unknown:
            parser.error(
                f"unknown precisions {sorted(unknown)}; known: {[p[0] for p in PRECISIONS]}"
            )
        wanted = [PRECISIONS[0]] + [p for p in PRECISIONS[1:] if p[0] in names]
    loaded = load_model()
    runs = {name: measure(loaded, dtype, q, kv) for name, dtype, q, kv in wanted}
    ref = runs[PRECISIONS[0][0]]
    rows = [{"precision": name, **compare(r, ref)} for name, r in runs.items()]
    result = {
        "model": loaded.model_id,
        "text_tokens": len(ref["nll"]) + 1,
        "chat_prompts": len(CHATS),
        "gen_tokens": GEN_TOKENS,
        "machine": f"{platform.machine()} {platform.processor()}, shared with other jobs",
        "rows": rows,
        "fp32_answers": dict(zip(CHATS, ref["texts"], strict=True)),
    }
    out = out_path(args.out, "precision")
    out.write_text(json.dumps(result, indent=2) + "\n")
    if args.doc:
        _replace_table(Path(args.doc), table(rows))
    print(table(rows))


def _replace_table(doc: Path, new: str) -> None:
    """Swap the text between the two table markers for the new table."""
    begin, end = "<!-- precision-table -->", "<!-- /precision-table -->"
    text = doc.read_text()
    head, rest = text.split(begin)
    _, tail = rest.split(end)
    doc.write_text(f"{head}{begin}\n{new}\n{end}{tail}")


if __name__ == "__main__":
    main()
