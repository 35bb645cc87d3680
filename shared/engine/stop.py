"""Stop strings over streamed text: never emit a stop string, never hold back more than needed.

Text that could still be the start of a stop string is held back until the next piece
decides it; everything before that is released at once.
"""

from __future__ import annotations


class StopChecker:
    def __init__(self, stop: list[str], include_stop: bool = False) -> None:
        self.stop = stop
        self.include_stop = include_stop
        self.held = ""

    def feed(self, piece: str, *, final: bool) -> tuple[str, bool]:
        """Add new text -> (text to release now, whether a stop string was hit)."""
        if not self.stop:
            return piece, False
        text = self.held + piece
        hit = _first_stop(text, self.stop)
        if hit is not None:
            start, s = hit
            self.held = ""
            return text[: start + len(s)] if self.include_stop else text[:start], True
        if final:
            self.held = ""
            return text, False
        keep = _partial_stop_suffix(text, self.stop)
        self.held = text[len(text) - keep :] if keep else ""
        return text[: len(text) - keep], False


def _first_stop(text: str, stops: list[str]) -> tuple[int, str] | None:
    found = [(i, s) for s in stops if (i := text.find(s)) >= 0]
    return min(found) if found else None


def _partial_stop_suffix(text: str, stops: list[str]) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of some stop string."""
    best = 0
    for s in stops:
        for n in range(min(len(s) - 1, len(text)), best, -1):
            if text.endswith(s[:n]):
                best = n
                break
    return best
