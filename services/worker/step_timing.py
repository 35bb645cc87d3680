"""Measured engine step times: a line fit for the router's cost model, and a log summary.

Each engine step computes some tokens (prefill chunks plus one per decoding sequence) and
takes some seconds. On a CPU the step time is close to linear in the tokens it computes:

    step_s ~= fixed_s + per_token_s * tokens

``StepTiming`` fits that line by least squares over the last ``WINDOW`` steps and reports
it in heartbeats; the router predicts each worker's inter-token latency from it. It also
sums what the loop did between reports (engine time, dispatch time, idle gaps), which the
worker logs so a profile of a loaded stack has per-step figures beside the samples.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

WINDOW = 256  # steps in the fit: a few seconds of a busy worker


@dataclass
class StepWindow:
    """What the engine loop did since the last summary."""

    steps: int = 0
    tokens: int = 0
    outputs: int = 0
    engine_s: float = 0.0  # inside engine.step() on the engine thread
    dispatch_s: float = 0.0  # on the event loop: publishing the step's outputs
    max_step_s: float = 0.0

    def describe(self, wall_s: float) -> str:
        if not self.steps:
            return "idle"
        return (
            f"{self.steps} steps in {wall_s:.1f} s: engine {self.engine_s / wall_s:.0%}, "
            f"dispatch {self.dispatch_s / wall_s:.0%}; "
            f"{self.engine_s / self.steps * 1e3:.1f} ms/step (max {self.max_step_s * 1e3:.0f}), "
            f"{self.tokens / self.steps:.1f} tokens/step, {self.outputs / wall_s:.1f} out tok/s"
        )


class StepTiming:
    def __init__(self, window: int = WINDOW) -> None:
        self._samples: deque[tuple[int, float]] = deque(maxlen=window)
        self.current = StepWindow()

    def record(self, tokens: int, outputs: int, engine_s: float, dispatch_s: float) -> None:
        if tokens > 0:
            self._samples.append((tokens, engine_s))
        w = self.current
        w.steps += 1
        w.tokens += tokens
        w.outputs += outputs
        w.engine_s += engine_s
        w.dispatch_s += dispatch_s
        w.max_step_s = max(w.max_step_s, engine_s)

    def take_window(self) -> StepWindow:
        window, self.current = self.current, StepWindow()
        return window

    def fit(self) -> tuple[float, float]:
        """(fixed_s, per_token_s); (0, 0) before the first two steps."""
        n = len(self._samples)
        if n < 2:
            return 0.0, 0.0
        mean_x = sum(x for x, _ in self._samples) / n
        mean_y = sum(y for _, y in self._samples) / n
        sxx = sum((x - mean_x) ** 2 for x, _ in self._samples)
        if sxx < n:  # steps all of about one size: no slope to read, so all of it per token
            return 0.0, mean_y / mean_x
        sxy = sum((x - mean_x) * (y - mean_y) for x, y in self._samples)
        per_token = max(sxy / sxx, 0.0)
        fixed = max(mean_y - per_token * mean_x, 0.0)
        return fixed, per_token
