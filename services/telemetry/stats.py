"""The fleet's live figures over a sliding window of finished requests; pure."""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from tokenyard.stats import percentile


@dataclass(frozen=True)
class Finished:
    """One finished request, as its root span told it."""

    at: float  # unix seconds, when it ended
    ttft_s: float | None
    duration_s: float
    prompt_tokens: int
    cached_tokens: int
    output_tokens: int
    energy_joules: float | None = None  # usage.energy_joules, where the workers reported it

    @property
    def itl_s(self) -> float | None:
        """Mean time between output tokens after the first."""
        if self.ttft_s is None or self.output_tokens < 2:
            return None
        return max(0.0, self.duration_s - self.ttft_s) / (self.output_tokens - 1)


def percentile_or_none(values: list[float], q: float) -> float | None:
    """The bench's percentile (tokenyard.stats); None for no values (a quiet window)."""
    return percentile(values, q) if values else None


class Window:
    """Finished requests of the last `window_s` seconds."""

    def __init__(self, window_s: float) -> None:
        self.window_s = window_s
        self.items: deque[Finished] = deque()

    def add(self, item: Finished) -> None:
        self.items.append(item)

    def current(self, now: float) -> list[Finished]:
        while self.items and self.items[0].at < now - self.window_s:
            self.items.popleft()
        return list(self.items)

    def figures(self, now: float) -> dict[str, float | None]:
        items = self.current(now)
        ttfts = [r.ttft_s for r in items if r.ttft_s is not None]
        itls = [x for x in (r.itl_s for r in items) if x is not None]
        prompt = sum(r.prompt_tokens for r in items)
        return {
            "requests_per_s": len(items) / self.window_s,
            "ttft_p50_s": percentile_or_none(ttfts, 50),
            "ttft_p99_s": percentile_or_none(ttfts, 99),
            "itl_p50_s": percentile_or_none(itls, 50),
            "itl_p99_s": percentile_or_none(itls, 99),
            "prefix_hit_rate": sum(r.cached_tokens for r in items) / prompt if prompt else None,
            "joules_per_token": joules_per_token(items),
        }


def joules_per_token(items: list[Finished]) -> float | None:
    """Energy per output token over the requests that reported energy (None: none did)."""
    known = [r for r in items if r.energy_joules is not None]
    tokens = sum(r.output_tokens for r in known)
    return sum(r.energy_joules or 0.0 for r in known) / tokens if tokens else None
