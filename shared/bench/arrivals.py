"""Open-loop arrival times."""

from __future__ import annotations

import math
import random


def poisson_arrivals(rate: float, n: int, rng: random.Random) -> list[float]:
    """Send offsets in seconds for a Poisson process at `rate` requests/s: the first at 0,
    then exponential gaps of mean 1/rate. An infinite rate sends everything at once."""
    if rate <= 0:
        raise ValueError(f"request rate must be positive, got {rate}")
    if math.isinf(rate):
        return [0.0] * n
    offsets, t = [], 0.0
    for _ in range(n):
        offsets.append(t)
        t += rng.expovariate(rate)
    return offsets
