"""One check of two runs' outputs against each other: the same tokens, and every chosen,
top and prompt logprob within a tolerance (the parallel layouts' tests against one rank)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

TOL = 1e-3  # the dense fp32 tolerance of the HF-equivalence tests


def assert_same_logprobs(one: Sequence[Any], other: Sequence[Any], tol: float = TOL) -> None:
    for a, b in zip(one, other, strict=True):
        assert a.token_ids == b.token_ids
        assert a.logprobs and b.logprobs
        for la, lb in zip(a.logprobs, b.logprobs, strict=True):
            assert abs(la.logprob - lb.logprob) <= tol
            assert [t for t, _ in la.top] == [t for t, _ in lb.top]
            for (_, va), (_, vb) in zip(la.top, lb.top, strict=True):
                assert abs(va - vb) <= tol
        assert a.prompt_logprobs and b.prompt_logprobs
        for pa, pb in zip(a.prompt_logprobs[1:], b.prompt_logprobs[1:], strict=True):
            assert pa is not None and pb is not None and pa.token_id == pb.token_id
            assert abs(pa.logprob - pb.logprob) <= tol
