"""`tokenyard bench` against the real stack started by `tokenyard up`.

Set TOKENYARD_BENCH_URL to measure a stack that is already running instead of starting one.
"""

import collections
import contextlib
import os
import signal
import subprocess
import sys
import threading
import time

import pytest

from tokenyard.bench import metrics
from tokenyard.bench.client import Target
from tokenyard.bench.runner import Load, run_load
from tokenyard.bench.workloads import WorkloadOptions, build
from tokenyard.bus.embedded import free_port

pytestmark = pytest.mark.slow

MODEL = "SmolLM2-135M-Instruct"
START_TIMEOUT_S = 300
BANNER = "Tokenyard is up"


@contextlib.contextmanager
def _stack():
    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "tokenyard.cli", "up", "--port", str(port), "--console-port", "0"],
        start_new_session=True,  # its own process group: everything it started stops with it
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    output: collections.deque[str] = collections.deque(maxlen=200)
    drain = threading.Thread(target=lambda: output.extend(proc.stdout), daemon=True)
    drain.start()  # a full pipe would block the stack
    try:
        deadline = time.monotonic() + START_TIMEOUT_S
        while not any(BANNER in line for line in list(output)):
            if proc.poll() is not None:
                pytest.fail(f"tokenyard up exited {proc.returncode}:\n{''.join(output)}")
            assert time.monotonic() < deadline, f"no banner in time:\n{''.join(output)}"
            time.sleep(0.5)
        yield f"http://127.0.0.1:{port}"
    finally:
        os.killpg(proc.pid, signal.SIGINT)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        drain.join(timeout=5)


@pytest.fixture(scope="module")
def gateway():
    url = os.environ.get("TOKENYARD_BENCH_URL")
    if url:
        yield url
        return
    with _stack() as url:
        yield url


def _opts(n, **kw):
    return WorkloadOptions(num_requests=n, input_len=40, output_len=8, len_sigma=0, **kw)


def _check_consistent(records):
    assert records and all(r.ok for r in records), [r.error for r in records if not r.ok]
    for r in records:
        assert r.token_source == "usage"  # the gateway sends usage when asked
        assert 1 <= r.output_tokens <= r.max_tokens
        assert len(r.chunk_ms) <= r.output_tokens  # a chunk carries at least one token
        assert 0 < r.ttft_ms <= r.e2e_ms
        assert r.prompt_tokens > 0


async def test_chat_closed_loop_against_the_stack(gateway):
    target = Target(gateway, MODEL, ignore_eos=True, timeout_s=120)
    warm = build("chat", _opts(1, seed=1))
    result = await run_load(target, build("chat", _opts(4)), Load(concurrency=2), warmup=warm)
    _check_consistent(result.records)
    assert sum(r.warmup for r in result.records) == 1
    assert all(r.output_tokens == r.max_tokens for r in result.records)  # ignore_eos honoured
    summary = metrics.summarize(result.records, metrics.SLOs())
    # The warm-up request is not counted.
    assert summary["requests"]["ok"] == 4 and summary["output_tokens"] == 4 * 8
    assert summary["ttft_ms"]["p50"] <= summary["e2e_ms"]["p50"]


async def test_multi_turn_history_grows_in_the_servers_count(gateway):
    target = Target(gateway, MODEL, timeout_s=120)
    result = await run_load(target, build("multi-turn", _opts(3, turns=3)), Load(concurrency=1))
    _check_consistent(result.records)
    prompts = [r.prompt_tokens for r in result.records]
    assert prompts[0] < prompts[1] < prompts[2]  # each turn resends the history


async def test_completions_endpoint_and_shared_prefix(gateway):
    target = Target(gateway, MODEL, endpoint="completions", timeout_s=120)
    sessions = build("shared-prefix", _opts(3, prefix_len=200))
    result = await run_load(target, sessions, Load(request_rate=2.0), seed=1)
    _check_consistent(result.records)
