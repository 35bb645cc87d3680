"""Calibrate the planner's `cpu` entry against our engine, and check its predictions.

    python benchmarks/planner_cpu.py            # writes shared/planner/cpu_calibration.yaml
                                                # and benchmarks/results/planner_cpu.json

Calibration points: a batch-1 decode (the per-step overhead) and a 32-sequence decode and a
128-token prefill (the share of the matmul rate each reaches). Checked points, not used to
calibrate: an 8-sequence decode and a 512-token prompt's TTFT.
"""

from __future__ import annotations

import argparse
import json
import platform
from pathlib import Path

import torch

from tokenyard.planner import calibrate, cpu
from tokenyard.planner.roofline import Deployment


def run(threads: int | None) -> dict:
    if threads:
        torch.set_num_threads(threads)
    bw, tflops = cpu.memory_read_gbs(), cpu.matmul_tflops()
    engine = calibrate.make_engine()
    calibrate.warm(engine)
    b1 = calibrate.measure(engine, 1, 128, 64)
    b32 = calibrate.measure(engine, 32, 128, 64)
    b8 = calibrate.measure(engine, 8, 128, 64)
    long = calibrate.measure(engine, 1, 512, 4)
    model = calibrate.default_model()
    values = calibrate.calibrate(b1, b32, bw, tflops, model)
    dep = Deployment(model, cpu.cpu_hardware(values, remeasure=False), weights_dtype="int4")
    predicted = {
        "b8_decode_tok_s": 8 / dep.decode_step_s(8, b8.context),
        "ttft_512_ms": 1e3 * (dep.prefill_s(512)),
    }
    measured = {"b8_decode_tok_s": 8 / b8.decode_step_s, "ttft_512_ms": 1e3 * long.ttft_s}
    return {
        "machine": {"platform": platform.platform(), "threads": torch.get_num_threads()},
        "calibration": values,
        "calibration_points": {"b1": b1.__dict__, "b32": b32.__dict__},
        "checked": {
            k: {"predicted": predicted[k], "measured": measured[k],
                "error": predicted[k] / measured[k] - 1}
            for k in predicted
        },
    }  # fmt: skip


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="benchmarks/results/planner_cpu.json")
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--no-save", action="store_true", help="do not rewrite the calibration")
    args = parser.parse_args()
    result = run(args.threads)
    if not args.no_save:
        cpu.save_calibration(result["calibration"])
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    for name, c in result["checked"].items():
        print(
            f"{name}: predicted {c['predicted']:.1f}, measured {c['measured']:.1f} ({c['error']:+.0%})"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
