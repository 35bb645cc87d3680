"""An incremental server-sent-events reader that keeps the arrival time of the bytes.

httpx hands us byte chunks as they come off the socket; each chunk is stamped once with
a monotonic clock and every `data:` line completed inside it inherits that stamp. Line
decoding or JSON parsing later cannot skew the timing.
"""

from __future__ import annotations

from dataclasses import dataclass

DONE = "[DONE]"


@dataclass(frozen=True)
class SSEEvent:
    t_ns: int  # perf_counter_ns when the bytes that completed this line arrived
    data: str


class SSEParser:
    """Feed raw bytes; get one event per complete `data:` line (vLLM and SGLang send one
    JSON object per line). Comments (`:`), `event:`, `id:` and blank lines are skipped."""

    def __init__(self) -> None:
        self._buffer = b""

    def feed(self, chunk: bytes, t_ns: int) -> list[SSEEvent]:
        self._buffer += chunk
        *lines, self._buffer = self._buffer.split(b"\n")
        events = []
        for raw in lines:
            line = raw.rstrip(b"\r")
            if not line.startswith(b"data:"):
                continue
            events.append(SSEEvent(t_ns, line[5:].strip().decode("utf-8", "replace")))
        return events

    def flush(self, t_ns: int) -> list[SSEEvent]:
        """A final line the server did not terminate with a newline."""
        rest, self._buffer = self._buffer, b""
        return self.feed(rest + b"\n", t_ns) if rest.strip() else []
