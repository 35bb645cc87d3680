"""One streamed request, timed at the byte level, parsed by hand (not the openai client).

Every byte chunk off the socket is stamped with `time.perf_counter_ns()` before anything
else looks at it; see sse.py. The record keeps the stamps of the chunks that carried
output text, which is what TTFT and ITL are measured from.
"""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass, field
from typing import Any

import httpx

from tokenyard.bench.sse import DONE, SSEEvent, SSEParser
from tokenyard.bench.workloads import Message, render_prompt


@dataclass(frozen=True)
class Target:
    url: str  # the server's base URL, e.g. http://127.0.0.1:8000 (a trailing /v1 is fine)
    model: str
    endpoint: str = "chat"  # "chat" or "completions"
    ignore_eos: bool = False
    temperature: float = 0.0
    timeout_s: float = 300.0
    api_key: str | None = None
    extra_body: dict[str, Any] = field(default_factory=dict)

    @property
    def path_url(self) -> str:
        base = self.url.rstrip("/")
        base = base if base.endswith("/v1") else base + "/v1"
        return base + ("/chat/completions" if self.endpoint == "chat" else "/completions")

    def body(self, messages: list[Message], max_tokens: int) -> dict[str, Any]:
        body: dict[str, Any] = {
            "model": self.model,
            "max_tokens": max_tokens,
            "temperature": self.temperature,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        if self.endpoint == "chat":
            body["messages"] = messages
        else:
            body["prompt"] = render_prompt(messages)
        if self.ignore_eos:
            body["ignore_eos"] = True  # vLLM, SGLang and ours; others ignore unknown fields
        body.update(self.extra_body)
        return body

    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}


@dataclass
class Exchange:
    """What came back for one request, in raw form; times are perf_counter_ns."""

    start_ns: int
    end_ns: int = 0
    status: int | None = None
    chunk_ns: list[int] = field(default_factory=list)  # chunks that carried output text
    text: list[str] = field(default_factory=list)
    usage: dict[str, Any] | None = None  # token counts; Tokenyard adds energy_joules and its source
    error_kind: str | None = (
        None  # http_<status>, timeout, connection, protocol, stream_error, empty
    )
    error: str | None = None

    @property
    def ok(self) -> bool:
        return self.error_kind is None

    @property
    def output_text(self) -> str:
        return "".join(self.text)

    def fail(self, kind: str, detail: str) -> None:
        if self.error_kind is None:  # keep the first cause
            self.error_kind, self.error = kind, detail[:300]


async def stream_request(
    client: httpx.AsyncClient, target: Target, messages: list[Message], max_tokens: int
) -> Exchange:
    body = target.body(messages, max_tokens)
    ex = Exchange(start_ns=time.perf_counter_ns())
    try:
        async with (
            asyncio.timeout(target.timeout_s),
            client.stream("POST", target.path_url, json=body, headers=target.headers()) as resp,
        ):
            ex.status = resp.status_code
            if resp.status_code >= 400:
                detail = (await resp.aread()).decode("utf-8", "replace")
                ex.fail(f"http_{resp.status_code}", detail)
            else:
                await _read_stream(resp, ex, target.endpoint)
    except (TimeoutError, httpx.TimeoutException) as exc:
        ex.fail("timeout", repr(exc))
    except (httpx.TransportError, httpx.StreamError) as exc:
        ex.fail("connection", repr(exc))
    except (json.JSONDecodeError, AttributeError, KeyError, TypeError, IndexError) as exc:
        ex.fail("protocol", repr(exc))
    ex.end_ns = ex.end_ns or time.perf_counter_ns()
    if ex.ok and not ex.chunk_ns:
        ex.fail("empty", "the stream carried no output text")
    return ex


async def _read_stream(resp: httpx.Response, ex: Exchange, endpoint: str) -> None:
    parser = SSEParser()
    done = False
    # NOTE: read to the end even after [DONE]: leaving bytes unread makes httpx close the
    # connection instead of pooling it, and the next request would pay a new connect.
    async for chunk in resp.aiter_bytes():
        t_ns = time.perf_counter_ns()
        if not done:
            done = _take_events(parser.feed(chunk, t_ns), ex, endpoint)
    if not done:
        _take_events(parser.flush(time.perf_counter_ns()), ex, endpoint)


def _take_events(events: list[SSEEvent], ex: Exchange, endpoint: str) -> bool:
    """Fold events into the exchange; True once the stream said [DONE]."""
    for event in events:
        if event.data == DONE:
            ex.end_ns = event.t_ns
            return True
        payload = json.loads(event.data)
        if "error" in payload:
            ex.fail("stream_error", json.dumps(payload["error"]))
            continue
        if payload.get("usage"):
            ex.usage = payload["usage"]  # the last one wins (some servers send it per chunk)
        piece = _delta_text(payload, endpoint)
        if piece:
            ex.chunk_ns.append(event.t_ns)
            ex.text.append(piece)
    return False


def _delta_text(payload: dict[str, Any], endpoint: str) -> str:
    choices = payload.get("choices") or []
    if not choices:
        return ""  # the usage-only chunk
    if endpoint == "chat":
        delta = choices[0].get("delta") or {}
        return (delta.get("content") or "") + (delta.get("reasoning_content") or "")
    return choices[0].get("text") or ""
