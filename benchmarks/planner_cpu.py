"""Calibrate the planner's `cpu` entry against our engine, and check its predictions.

    python benchmarks/planner_cpu.py    # writes this CPU kind's entry of
                                        # shared/planner/cpu_calibration.yaml and a
                                        # planner_cpu_<kind> JSON (see result_path.py)

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
from result_path import OUT_HELP, out_path

from tokenyard.planner import calibrate, cpu


def run(threads: int | None) -> dict:
    if threads:
        torch.set_num_threads(threads)
    bw, tflops = cpu.memory_read_gbs(), cpu.matmul_tflops()
    result = calibrate.calibrate_and_check(calibrate.make_engine(), bw, tflops)
    machine = {
        "platform": platform.platform(),
        "threads": torch.get_num_threads(),
        "kind": cpu.cpu_kind(),
    }
    return {"machine": machine, **result}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, help=OUT_HELP)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--no-save", action="store_true", help="do not rewrite the calibration")
    args = parser.parse_args()
    result = run(args.threads)
    if not args.no_save:
        cpu.save_calibration(result["calibration"])
    out = out_path(args.out, f"planner_cpu_{cpu.cpu_kind()}")
    out.write_text(json.dumps(result, indent=1) + "\n")
    for name, c in result["checked"].items():
        print(
            f"{name}: predicted {c['predicted']:.1f}, measured {c['measured']:.1f} ({c['error']:+.0%})"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
