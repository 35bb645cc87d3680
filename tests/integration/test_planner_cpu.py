"""The planner's `cpu` entry against our engine on the machine that runs this test.

Calibrated here, in the same process and moment (so neither another machine's calibration
nor a different load enters): a batch-1 and a 32-sequence decode and a 128-token prompt.
Checked: an 8-sequence decode's tokens per second and a 512-token prompt's TTFT, neither of
which the calibration saw, each within 25% of the engine's measured figure.
"""

from __future__ import annotations

import pytest

from tokenyard.planner import calibrate, cpu

pytestmark = [
    pytest.mark.slow,
    pytest.mark.calibration,
    pytest.mark.timeout(900),
]  # a loaded machine: minutes

TOLERANCE = 0.25


def test_cpu_entry_predicts_our_engine_within_25_percent():
    bw, tflops = cpu.memory_read_gbs(), cpu.matmul_tflops()
    result = calibrate.calibrate_and_check(calibrate.make_engine(), bw, tflops, calibrate.SHORT)
    errors = {name: c["error"] for name, c in result["checked"].items()}
    assert set(errors) == {"b8_decode_tok_s", "ttft_512_ms"}
    for name, c in result["checked"].items():
        assert abs(c["error"]) <= TOLERANCE, (
            f"{name}: predicted {c['predicted']:.1f}, measured {c['measured']:.1f} "
            f"({c['error']:+.0%}); calibration {result['calibration']}"
        )
