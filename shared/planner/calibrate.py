"""Measure our engine on this machine at the shipped precision (bf16 weights, int4 linears):
the figures the `cpu` entry is calibrated from, and the ones its predictions are checked
against. Imports the engine lazily; nothing here runs at import.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

from tokenyard.planner.catalog import DTYPE_BYTES, MODELS, ModelSpec
from tokenyard.planner.roofline import Deployment

if TYPE_CHECKING:
    from tokenyard.models.kernel_choice import LinearKernel

SHIPPED = {"dtype": "auto", "quantization": "int4"}  # what `tokenyard up` runs
DEFAULT_MODEL = "smollm2-135m"


@dataclass(frozen=True)
class EngineFigures:
    prompt_len: int
    output_len: int
    batch: int
    ttft_s: float  # the first request's, all of the batch submitted together
    decode_step_s: float  # median step once every sequence decodes

    @property
    def context(self) -> float:
        return self.prompt_len + self.output_len / 2


def make_engine():
    from tokenyard.engine.config import EngineConfig
    from tokenyard.engine.llm_engine import LLMEngine

    return LLMEngine(
        EngineConfig(
            **SHIPPED,
            max_num_seqs=64,
            max_num_batched_tokens=1024,
            kv_cache_bytes=512 * 1024**2,
            enable_prefix_caching=False,
        )
    )


def measure(engine, batch: int, prompt_len: int, output_len: int, tag: str = "") -> EngineFigures:
    from tokenyard.engine.sampling_params import SamplingParams

    params = SamplingParams(max_tokens=output_len, temperature=0.0, ignore_eos=True)
    vocab = engine.tokenizer.vocab_size if hasattr(engine.tokenizer, "vocab_size") else 1000
    ids = [
        [(17 + 31 * i + 7 * j) % min(vocab, 20000) + 100 for j in range(prompt_len)]
        for i in range(batch)
    ]
    start = time.perf_counter()
    for i, p in enumerate(ids):
        engine.add_request(f"{tag}{batch}-{prompt_len}-{i}", p, params)
    first: float | None = None
    started: set[str] = set()
    steps: list[float] = []
    last = time.perf_counter()
    while engine.has_unfinished():
        outs = engine.step()
        now = time.perf_counter()
        if first is None and outs:
            first = now - start
        all_decoding = len(started) == batch
        for o in outs:
            started.add(o.request_id)
        if all_decoding and engine.has_unfinished():
            steps.append(now - last)
        last = now
    assert first is not None
    return EngineFigures(prompt_len, output_len, batch, first, statistics.median(steps))


def warm(engine) -> None:
    measure(engine, 2, 32, 8, tag="warm")


def best_of(engine, runs: int, shapes: dict[str, tuple[int, int, int]]) -> dict[str, EngineFigures]:
    """Each shape's (batch, prompt length, output length) fastest TTFT and decode step over
    `runs` rounds, every round measuring every shape in turn: the calibration points and
    the checked ones then see the same moments of the machine, and the first run of a new
    shape (which pays for what the CPU's matmul library builds for it) and a hiccup only
    ever make a run slower, so the minimum."""
    seen: dict[str, list[EngineFigures]] = {name: [] for name in shapes}
    for i in range(runs):
        for name, (batch, prompt_len, output_len) in shapes.items():
            seen[name].append(measure(engine, batch, prompt_len, output_len, tag=f"{name}r{i}-"))
    return {
        name: EngineFigures(
            f[0].prompt_len,
            f[0].output_len,
            f[0].batch,
            min(x.ttft_s for x in f),
            min(x.decode_step_s for x in f),
        )
        for name, f in seen.items()
    }


def calibrate(
    b1: EngineFigures,
    b32: EngineFigures,
    bw_gbs: float,
    tflops: float,
    model: ModelSpec,
    small: EngineFigures | None = None,
    small_rows: int = 0,
    dense_dtype: str = "",
    wide: EngineFigures | None = None,
) -> dict:
    """Efficiencies that make the roofline meet our engine at these measurements: `small`,
    a decode of at most `small_rows` sequences, runs the weight-only kernels that batches
    up to `small_rows` take (b32 runs the dense matmul, or with `wide` the widening kernel).
    `wide`, a decode of a few more rows than `small_rows` through a kernel that widens the
    weights every step (AMX), gives that kernel's floor as a rate over the weights: what
    is left of its step once the per-row work is taken out, that work's rate coming from
    the difference between `b32` and `wide` (rows add time above the floor; the floor does
    not move with them)."""
    from tokenyard.planner.catalog import Hardware

    probe = Hardware("probe", 1, bw_gbs, tflops, 0, 0, 1, 0, 1, 0, 1, "air", 1.0,
                     decode_bw_eff=1.0, decode_flops_eff=1.0, prefill_flops_eff=1.0,
                     step_overhead_ms=0.0)  # fmt: skip
    dep = Deployment(model, probe, weights_dtype="int4")
    overhead = b1.decode_step_s - dep.decode_step_s(1, b1.context)
    ideal_32 = dep.decode_step_s(32, b32.context)  # at 100% of the matmul rate
    ideal_prefill = dep.prefill_s(b1.prompt_len)
    small_eff = {}
    if small is not None and small_rows:
        ideal_small = dep.decode_step_s(small.batch, small.context)
        small_eff = {
            "small_batch_rows": small_rows,
            "small_batch_flops_eff": round(
                ideal_small / max(small.decode_step_s - overhead, 1e-6), 4
            ),
        }
    widen = {}
    decode_eff = ideal_32 / max(b32.decode_step_s - overhead, 1e-6)
    if wide is not None:
        weights = model.params_touched(wide.batch) * DTYPE_BYTES["int4"]
        per_rows_s = b32.decode_step_s - wide.decode_step_s  # the rows 32 has beyond wide's
        extra = dep.decode_compute_s(32, b32.context) - dep.decode_compute_s(
            wide.batch, wide.context
        )
        floor_s = wide.decode_step_s - overhead
        if per_rows_s > 0 and extra > 0:  # noise can invert the two: then no per-row split
            decode_eff = extra / per_rows_s
            floor_s -= dep.decode_compute_s(wide.batch, wide.context, decode_eff)
        widen = {"widen_gbs": round(weights / max(floor_s, 1e-6) / 1e9, 3)}
    return {
        **small_eff,
        **widen,
        **({"dense_dtype": dense_dtype} if dense_dtype and small_eff else {}),
        "step_overhead_ms": round(1e3 * max(overhead, 0.0), 3),
        "decode_flops_eff": round(decode_eff, 4),
        "prefill_flops_eff": round(ideal_prefill / max(b1.ttft_s - overhead, 1e-6), 4),
        "memory_read_gbs": round(bw_gbs, 2),
        "matmul_tflops": round(tflops, 4),
    }


def weight_only_rows(dtype: str) -> int:
    """The most rows an int4 layer of an engine computing in `dtype` runs through its
    weight-only kernel; 0 where that kernel runs every row count and no dense copy is kept
    (fp32 layers on AVX2-only CPUs: int16 activations). On AMX CPUs (bf16), the decode rows
    that take linear_i16 rather than linear_amx, which widens the weights every step."""
    kernel = _int4_kernel(dtype)
    if kernel.amx_above is not None:
        return kernel.amx_above
    return kernel.dense_above if kernel.dense is not None else 0


def widens_weights(dtype: str) -> bool:
    """Whether steps above weight_only_rows widen the int4 weights every step (AMX)."""
    return _int4_kernel(dtype).amx_above is not None


def _int4_kernel(dtype: str) -> LinearKernel:
    """What a typical int4 layer (whole blocks, a dense copy allowed) runs on this machine."""
    import torch

    from tokenyard.models.kernel_choice import LinearSpec, choose_linear_kernel

    return choose_linear_kernel(LinearSpec(getattr(torch, dtype), 4, True, True))


def default_model() -> ModelSpec:
    return MODELS[DEFAULT_MODEL]


@dataclass(frozen=True)
class Lengths:
    """Output lengths of the four measurements: the benchmark's, or the test's short form."""

    b1_output: int = 64
    b32_output: int = 64
    b8_output: int = 64
    long_output: int = 4
    runs: int = 1  # each measurement's repeats (best_of)


SHORT = Lengths(b1_output=24, b32_output=8, b8_output=8, long_output=4, runs=3)


def calibrate_and_check(engine, bw_gbs: float, tflops: float, lengths: Lengths = Lengths()) -> dict:
    """Calibrate on a batch-1 and a 32-sequence decode and a 128-token prefill, then predict
    two points not calibrated on (an 8-sequence decode, a 512-token prompt's TTFT) and
    compare with what the engine does, measured in the same moment."""
    from tokenyard.planner.cpu import cpu_hardware

    warm(engine)
    # The weight-only kernels' efficiency is taken at the largest batch they run (12 or 14
    # rows): from a 4-sequence step, the 8-sequence prediction ran 25-58% fast on an AVX2
    # CPU, whose int4 kernel costs more per row past four rows.
    small_rows = weight_only_rows(engine.config.dtype)
    widening = widens_weights(engine.config.dtype)
    shapes = {
        "b1": (1, 128, lengths.b1_output),
        # without a dense copy one kernel runs every row count: no second regime to calibrate
        **({"small": (small_rows, 128, lengths.b8_output)} if small_rows else {}),
        # AMX: 16 rows pass over the weights as 8 do (widening them), not a quarter of 32
        **({"wide": (16, 128, lengths.b8_output)} if widening else {}),
        "b32": (32, 128, lengths.b32_output),
        "b8": (8, 128, lengths.b8_output),
        "long": (1, 512, lengths.long_output),
    }
    best = best_of(engine, lengths.runs, shapes)
    b1, b32, b8, long = (best[name] for name in ("b1", "b32", "b8", "long"))
    small, wide = best.get("small"), best.get("wide")
    model = default_model()
    # the dtype of the dense copy that steps above small_rows read (AMX keeps none)
    dense = (
        ""
        if widening
        else {"bfloat16": "bf16", "float32": "fp32"}.get(str(engine.config.dtype), "")
    )
    values = calibrate(b1, b32, bw_gbs, tflops, model, small, small_rows, dense, wide)
    dep = Deployment(model, cpu_hardware(values, remeasure=False), weights_dtype="int4")
    predicted = {
        "b8_decode_tok_s": 8 / dep.decode_step_s(8, b8.context),
        "ttft_512_ms": 1e3 * dep.prefill_s(512),
    }
    measured = {"b8_decode_tok_s": 8 / b8.decode_step_s, "ttft_512_ms": 1e3 * long.ttft_s}
    return {
        "calibration": values,
        "calibration_points": {
            "b1": b1.__dict__, "b32": b32.__dict__, **({"small": small.__dict__} if small else {}),
            **({"wide": wide.__dict__} if wide else {})
        },
        "checked": {
            k: {"predicted": predicted[k], "measured": measured[k],
                "error": predicted[k] / measured[k] - 1}
            for k in predicted
        },
    }  # fmt: skip
