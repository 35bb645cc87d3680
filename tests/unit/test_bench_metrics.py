"""The arithmetic of `tokenyard bench` on inputs whose answers are known by hand."""

import random
import statistics

import numpy as np
import pytest

from tokenyard.bench import metrics
from tokenyard.bench.arrivals import poisson_arrivals
from tokenyard.bench.records import RequestRecord, error_code
from tokenyard.stats import percentile


def rec(start_s, end_s, chunk_ms, output_tokens=None, ok=True, error_kind=None, **kw):
    return RequestRecord(
        index=0, session=0, turn=0, warmup=kw.pop("warmup", False), start_s=start_s,
        end_s=end_s, ok=ok, max_tokens=16, error_kind=error_kind, chunk_ms=chunk_ms,
        output_tokens=len(chunk_ms) if output_tokens is None else output_tokens,
        prompt_tokens=kw.pop("prompt_tokens", 10), **kw,
    )  # fmt: skip


def test_percentile_matches_hand_values_and_numpy():
    values = [4.0, 1.0, 3.0, 2.0]
    assert percentile(values, 50) == 2.5
    assert percentile(values, 90) == pytest.approx(3.7)
    assert percentile(values, 99) == pytest.approx(3.97)
    assert percentile([7.0], 99) == 7.0
    data = list(np.random.default_rng(0).lognormal(size=101))
    for q in (50, 90, 99):
        assert percentile(data, q) == pytest.approx(np.percentile(data, q))


def test_percentile_of_nothing_raises_and_stats_of_nothing_is_empty():
    with pytest.raises(ValueError):
        percentile([], 50)
    assert metrics.stats([]) == {"mean": None, "p50": None, "p90": None, "p99": None, "max": None}


def test_stats():
    s = metrics.stats([1.0, 2.0, 3.0, 10.0])
    assert s["mean"] == 4.0 and s["p50"] == 2.5 and s["max"] == 10.0


def test_itl_and_tpot_from_chunk_timestamps():
    assert metrics.itl_ms([10.0, 15.0, 25.0, 26.0]) == [5.0, 10.0, 1.0]
    assert metrics.itl_ms([10.0]) == []
    # 4 chunks but the server's usage says 7 tokens: TPOT spreads the time over 6 gaps
    assert metrics.tpot_ms(rec(0, 1, [10.0, 15.0, 25.0, 40.0], output_tokens=7)) == 5.0
    assert metrics.tpot_ms(rec(0, 1, [10.0], output_tokens=1)) is None


def test_ttft_e2e_and_send_lag():
    r = rec(1.0, 1.5, [20.0, 30.0], scheduled_s=0.99)
    assert r.ttft_ms == 20.0
    assert r.e2e_ms == pytest.approx(500.0)
    assert r.send_lag_ms == pytest.approx(10.0)


def test_goodput_counts_requests_meeting_every_slo():
    records = [
        rec(0.0, 1.0, [50.0, 60.0, 70.0]),  # meets all
        rec(0.0, 1.0, [150.0, 160.0]),  # TTFT too slow
        rec(0.0, 1.0, [50.0, 60.0, 200.0]),  # one gap of 140 ms breaks the ITL SLO
        rec(0.0, 2.0, [50.0]),  # one chunk: no ITL, not failed for it
        rec(0.0, 2.0, [], ok=False, error_kind="http_429"),
    ]
    slos = metrics.SLOs(ttft_ms=100, itl_ms=100)
    assert [metrics.meets_slos(r, slos) for r in records] == [True, False, False, True, False]
    summary = metrics.summarize(records, slos)
    assert summary["goodput"]["met"] == 2
    assert summary["goodput"]["requests_s"] == pytest.approx(1.0)  # 2 met over 2 s
    assert summary["goodput"]["fraction"] == pytest.approx(2 / 5)
    assert summary["goodput"]["slos"] == {"ttft_ms": 100, "itl_ms": 100}
    # the TPOT SLO is per request: (200 - 50) / 2 = 75 ms fails 50, passes 100
    assert not metrics.meets_slos(records[2], metrics.SLOs(tpot_ms=50))
    assert metrics.meets_slos(records[2], metrics.SLOs(tpot_ms=100))
    assert not metrics.meets_slos(records[0], metrics.SLOs(e2e_ms=999))


def test_summary_throughput_errors_and_warmup_exclusion():
    records = [
        rec(0.0, 100.0, [1.0], warmup=True),  # would stretch the duration if counted
        rec(1.0, 2.0, [100.0, 200.0, 300.0], output_tokens=30, prompt_tokens=100),
        rec(1.5, 3.0, [100.0, 200.0], output_tokens=20, prompt_tokens=50),
        rec(2.0, 2.5, [], ok=False, error_kind="timeout", prompt_tokens=None),
        rec(2.0, 2.1, [], ok=False, error_kind="http_500", prompt_tokens=None),
    ]
    s = metrics.summarize(records, metrics.SLOs())
    assert s["requests"] == {"measured": 4, "ok": 2, "failed": 2}
    assert s["errors"] == {"timeout": 1, "http_500": 1}
    assert s["duration_s"] == 2.0
    assert s["request_throughput"] == 1.0
    assert s["output_token_throughput"] == 25.0
    assert s["input_token_throughput"] == 75.0
    assert s["ttft_ms"]["mean"] == 100.0
    assert s["itl_ms"]["p50"] == 100.0
    assert s["goodput"]["met"] == 2  # no SLO given: every completed request counts


def test_throughput_windows():
    records = [
        # 4 tokens in 2 chunks at 0.5 s and 1.5 s after t=0
        rec(0.0, 1.6, [500.0, 1500.0], output_tokens=4),
        rec(1.0, 2.5, [200.0], output_tokens=3),  # chunk at 1.2 s
    ]
    windows = metrics.throughput_windows(records, window_s=1.0)
    assert [w["output_tok_s"] for w in windows] == [2.0, 5.0, 0.0]
    assert [w["requests_s"] for w in windows] == [0.0, 1.0, 1.0]
    assert [w["t_s"] for w in windows] == [0.0, 1.0, 2.0]


def test_poisson_arrivals_statistics_and_seed():
    rate, n = 4.0, 20000
    offsets = poisson_arrivals(rate, n, random.Random(7))
    gaps = [b - a for a, b in zip(offsets, offsets[1:], strict=False)]
    assert offsets[0] == 0.0 and len(offsets) == n
    assert statistics.fmean(gaps) == pytest.approx(1 / rate, rel=0.03)
    assert statistics.stdev(gaps) == pytest.approx(1 / rate, rel=0.05)  # exponential: sd = mean
    # arrivals in 1 s windows are Poisson: variance equals mean
    counts = np.bincount(np.floor(offsets).astype(int))[:-1]
    assert counts.var() / counts.mean() == pytest.approx(1.0, abs=0.1)
    assert offsets == poisson_arrivals(rate, n, random.Random(7))
    assert offsets != poisson_arrivals(rate, n, random.Random(8))
    assert poisson_arrivals(float("inf"), 3, random.Random(0)) == [0.0, 0.0, 0.0]
    with pytest.raises(ValueError):
        poisson_arrivals(0.0, 3, random.Random(0))


def test_error_code_from_openai_style_bodies():
    body = '{"error": {"message": "m", "type": "service_unavailable", "code": "no_workers"}}'
    assert error_code(body) == "no_workers"
    assert error_code('{"message": "m", "type": "overloaded"}') == "overloaded"
    assert error_code("Internal Server Error") is None
    assert error_code(None) is None
    assert error_code("[1, 2]") is None
