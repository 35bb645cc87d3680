"""The worker's step-time fit and window summary (pure arithmetic)."""

from __future__ import annotations

import pytest

from tokenyard.services.worker.step_timing import StepTiming


def test_fit_recovers_a_line():
    timing = StepTiming()
    for tokens in (1, 8, 16, 64, 128, 1, 32):
        timing.record(tokens, outputs=1, engine_s=0.004 + 0.0005 * tokens, dispatch_s=0.0)
    fixed, per_token = timing.fit()
    assert fixed == pytest.approx(0.004)
    assert per_token == pytest.approx(0.0005)


def test_steps_of_one_size_put_it_all_per_token():
    timing = StepTiming()
    for _ in range(5):
        timing.record(16, outputs=16, engine_s=0.032, dispatch_s=0.001)
    assert timing.fit() == (0.0, pytest.approx(0.002))


def test_no_fit_before_two_steps_and_empty_steps_are_not_samples():
    timing = StepTiming()
    timing.record(0, outputs=0, engine_s=0.0001, dispatch_s=0.0)
    timing.record(4, outputs=4, engine_s=0.01, dispatch_s=0.0)
    assert timing.fit() == (0.0, 0.0)


def test_window_sums_and_resets():
    timing = StepTiming()
    timing.record(10, outputs=10, engine_s=0.02, dispatch_s=0.002)
    timing.record(30, outputs=2, engine_s=0.05, dispatch_s=0.001)
    window = timing.take_window()
    assert (window.steps, window.tokens, window.outputs) == (2, 40, 12)
    assert window.engine_s == pytest.approx(0.07) and window.max_step_s == pytest.approx(0.05)
    assert "35.0 ms/step" in window.describe(1.0)
    assert timing.take_window().steps == 0 and timing.current.describe(1.0) == "idle"
