"""Speculative decoding's pure parts: prompt lookup, the acceptance rule (checked against the
target distribution with a fixed seed), the config, the scheduler's and pool's share."""

from __future__ import annotations

import json

import pytest
import torch

from tokenyard.engine.block_manager import BlockManager
from tokenyard.engine.config import EngineConfig
from tokenyard.engine.sampling_params import SamplingParams
from tokenyard.engine.scheduler import Scheduler
from tokenyard.engine.sequence import Sequence, Status
from tokenyard.engine.spec.config import SpeculativeConfig
from tokenyard.engine.spec.ngram import propose_ngram
from tokenyard.engine.spec.rejection import verify_greedy, verify_sampled

# --- prompt lookup ---------------------------------------------------------------------


def test_ngram_proposes_what_followed_the_latest_earlier_match():
    tokens = [1, 2, 3, 9, 9, 1, 2, 3, 7, 8, 5, 1, 2, 3]
    assert propose_ngram(tokens, k=2, min_n=2, max_n=3) == [7, 8]


def test_ngram_prefers_the_longest_suffix():
    # "2 3" last followed by 6, but the 3-gram "1 2 3" only ever by 4.
    tokens = [1, 2, 3, 4, 0, 2, 3, 6, 1, 2, 3]
    assert propose_ngram(tokens, k=1, min_n=2, max_n=3) == [4]
    assert propose_ngram(tokens, k=1, min_n=2, max_n=2) == [6]


def test_ngram_without_a_match_or_near_the_end():
    assert propose_ngram([1, 2, 3, 4, 5], k=4, min_n=2, max_n=4) == []
    assert propose_ngram([5, 6, 5, 6], k=4, min_n=2, max_n=4) == [5, 6]  # only what exists
    assert propose_ngram([3], k=4, min_n=1, max_n=4) == []


# --- greedy verification ---------------------------------------------------------------


def _one_hot_rows(best: list[int], vocab: int = 8) -> torch.Tensor:
    logits = torch.zeros(len(best), vocab)
    logits[torch.arange(len(best)), torch.tensor(best)] = 5.0
    return logits


def test_greedy_keeps_the_matching_prefix_and_the_targets_next_token():
    logits = _one_hot_rows([3, 4, 6, 1])
    assert verify_greedy(logits, [3, 4, 5]) == [3, 4, 6]  # third draft replaced
    assert verify_greedy(logits, [3, 4, 6]) == [3, 4, 6, 1]  # all kept, plus the bonus
    assert verify_greedy(logits, [2, 4, 6]) == [3]  # the first rejected: one token still


# --- rejection sampling, checked statistically -------------------------------------------

VOCAB = 6
TRIALS = 20_000
# With 20,000 draws the total-variation distance of an empirical distribution over 6 tokens
# from its true one is about 0.01; each wrong sampler below lands 0.1 or more away.
TV_TOL = 0.025


def _dist(*weights: float) -> torch.Tensor:
    w = torch.tensor(weights, dtype=torch.float32)
    return w / w.sum()


# Target p over 3 positions and a draft q over 2 that disagree with it on purpose.
P = torch.stack([_dist(5, 1, 1, 6, 2, 1), _dist(1, 4, 2, 1, 1, 7), _dist(2, 2, 2, 2, 2, 2)])
Q = torch.stack([_dist(1, 6, 1, 1, 4, 1), _dist(6, 1, 1, 3, 1, 1)])


def _tv(a: torch.Tensor, b: torch.Tensor) -> float:
    return 0.5 * float((a - b).abs().sum())


def _freq(tokens: list[int]) -> torch.Tensor:
    return torch.bincount(torch.tensor(tokens), minlength=VOCAB).float() / len(tokens)


def test_wrong_samplers_miss_the_tolerance():
    """Guard on the test below: the samplers it must tell apart are far enough from p."""
    p, q = P[0], Q[0]
    always_accept = q  # drafts kept regardless of p
    accept = torch.minimum(p, q)
    resample_from_p = accept + (1 - accept.sum()) * p  # rejection redraws from p, not p - q
    assert _tv(p, always_accept) > 4 * TV_TOL
    assert _tv(p, resample_from_p) > 4 * TV_TOL


def test_draft_model_rejection_sampling_follows_the_target():
    g = torch.Generator().manual_seed(1234)
    first, second = [], []
    for _ in range(TRIALS):
        drafts = [int(torch.multinomial(Q[i], 1, generator=g)) for i in range(2)]
        out = verify_sampled(P, drafts, Q, g)
        assert 1 <= len(out) <= 3 and out[:-1] == drafts[: len(out) - 1]
        first.append(out[0])
        if out[0] == drafts[0] and len(out) > 1:
            second.append(out[1])  # the first draft was kept: the next token follows p_2
    assert _tv(_freq(first), P[0]) < TV_TOL
    assert len(second) > TRIALS // 5
    assert _tv(_freq(second), P[1]) < 2 * TV_TOL


def test_prompt_lookup_rejection_sampling_follows_the_target():
    """n-gram drafts come with no distribution: a point mass on the proposed token."""
    g = torch.Generator().manual_seed(99)
    first = [verify_sampled(P[:2], [3], None, g)[0] for _ in range(TRIALS)]
    assert _tv(_freq(first), P[0]) < TV_TOL
    # and a draft the target finds unlikely is mostly replaced, by other tokens than it
    unlikely = [verify_sampled(P[:2], [1], None, g) for _ in range(2000)]
    kept = sum(out[0] == 1 and len(out) == 2 for out in unlikely) / 2000
    assert abs(kept - float(P[0, 1])) < 0.03


def test_seeded_verification_is_reproducible():
    a = verify_sampled(P, [0, 5], Q, torch.Generator().manual_seed(7))
    b = verify_sampled(P, [0, 5], Q, torch.Generator().manual_seed(7))
    assert a == b


# --- config ------------------------------------------------------------------------------


def test_config_from_dict_and_json():
    cfg = SpeculativeConfig.parse({"method": "ngram", "num_speculative_tokens": 3})
    assert cfg.method == "ngram" and cfg.num_speculative_tokens == 3
    text = json.dumps({"method": "draft", "model": None, "quantization": "int4"})
    cfg = SpeculativeConfig.parse(text)
    assert cfg.method == "draft" and cfg.model is None and cfg.quantization == "int4"


@pytest.mark.parametrize(
    ("value", "message"),
    [
        ({"method": "medusa"}, "method must be one of"),
        ({"num_speculative_tokens": 4}, 'needs a "method"'),
        ({"method": "ngram", "num_speculative_tokens": 0}, "num_speculative_tokens"),
        ({"method": "ngram", "lookahead": 2}, "unknown speculative config keys"),
        ("{not json", "not valid JSON"),
        ({"method": "draft", "quantization": "int3"}, "quantization"),
    ],
)
def test_bad_config_is_refused(value, message):
    with pytest.raises(ValueError, match=message):
        SpeculativeConfig.parse(value)


# --- scheduler and block pool ---------------------------------------------------------------

BS = 4


def _decoding(bm: BlockManager, n_tokens: int, rid: str = "r") -> Sequence:
    seq = Sequence(rid, list(range(n_tokens)), SamplingParams(), arrival=0)
    bm.allocate(seq)
    seq.num_computed_tokens = n_tokens - 1  # one sampled token not yet through the model
    return seq


def test_scheduler_appends_drafts_when_the_budget_has_room():
    bm = BlockManager(16, BS)
    sched = Scheduler(bm, max_num_seqs=4, max_num_batched_tokens=5)
    seq = _decoding(bm, 6)
    sched.add_running(seq)
    seq.spec_token_ids = [11, 12, 13, 14]
    (s,) = sched.schedule()
    assert (s.num_tokens, s.spec_token_ids) == (1, [11, 12, 13, 14])
    assert len(seq.block_table) == 3  # slots for positions up to 9 (5 + 1 + 4 - 1)
    assert seq.spec_token_ids == []  # consumed


def test_scheduler_drops_drafts_that_do_not_fit():
    bm = BlockManager(16, BS)
    sched = Scheduler(bm, max_num_seqs=4, max_num_batched_tokens=4)
    seq = _decoding(bm, 6)
    sched.add_running(seq)
    seq.spec_token_ids = [11, 12, 13, 14]
    (s,) = sched.schedule()
    assert (s.num_tokens, s.spec_token_ids) == (1, [])


def test_trim_rolls_back_slots_of_rejected_drafts():
    bm = BlockManager(16, BS)
    seq = _decoding(bm, 6)
    bm.append_slots(seq, 1 + 6)  # positions 5..11: three blocks
    assert len(seq.block_table) == 3
    free_before = bm.num_free_blocks
    bm.trim(seq)  # only 6 tokens exist: two blocks
    assert len(seq.block_table) == 2 and bm.num_free_blocks == free_before + 1
    bm.free_sequence(seq)
    bm.check_no_leaks()


# --- metrics ---------------------------------------------------------------------------------


def test_worker_metrics_count_drafts_and_acceptance_from_engine_stats():
    from prometheus_client import REGISTRY

    from tokenyard.engine.llm_engine import EngineStats
    from tokenyard.services.worker.metrics import WorkerMetrics

    labels = {"worker": "spec-metrics", "role": "decode", "model": "m"}
    metrics = WorkerMetrics(**labels)

    def stats(drafts: int, drafted: int, accepted: int) -> EngineStats:
        return EngineStats(1, 0, 10, 20, 0, 0, 0, drafts, drafted, accepted)

    def value(name: str) -> float | None:
        return REGISTRY.get_sample_value(f"tokenyard:spec_decode_{name}_total", labels)

    metrics.on_stats(stats(2, 8, 5))
    metrics.on_stats(stats(5, 20, 14))  # cumulative: the counters move by the difference
    assert (value("num_drafts"), value("num_draft_tokens"), value("num_accepted_tokens")) == (
        5.0,
        20.0,
        14.0,
    )


# --- when to speculate ------------------------------------------------------------------------


def _running(bm: BlockManager, tokens: list[int], rid: str, **params) -> Sequence:
    seq = Sequence(rid, tokens, SamplingParams(max_tokens=50, **params), arrival=0)
    bm.allocate(seq)
    seq.num_computed_tokens = len(tokens) - 1
    seq.status = Status.RUNNING
    return seq


def test_speculator_drafts_for_decoding_sequences_and_stops_for_large_batches():
    from tokenyard.engine.spec.speculator import Speculator

    bm = BlockManager(32, BS)
    config = SpeculativeConfig(method="ngram", num_speculative_tokens=3, disable_by_batch_size=3)
    spec = Speculator(config, bm, max_model_len=64)
    copy = [5, 6, 7, 8, 9, 5, 6, 7]
    a = _running(bm, copy, "a")
    penalized = _running(bm, copy, "p", repetition_penalty=1.2)
    spec.propose([a, penalized])
    assert a.spec_token_ids == [8, 9, 5] and penalized.spec_token_ids == []
    third = _running(bm, copy, "c")
    spec.propose([a, penalized, third])  # three running: off for this step, stale drafts gone
    assert a.spec_token_ids == [] and spec.stats.num_disabled_steps == 1


def test_speculator_drafts_no_further_than_max_tokens():
    from tokenyard.engine.spec.speculator import Speculator

    bm = BlockManager(32, BS)
    spec = Speculator(SpeculativeConfig(method="ngram"), bm, max_model_len=64)
    seq = _running(bm, [5, 6, 7, 8, 9, 5, 6, 7], "a")
    seq.params.max_tokens = 3
    seq.num_prompt_tokens = 7  # one output token so far: two more allowed, so one draft
    spec.propose([seq])
    assert seq.spec_token_ids == [8]


def test_greedy_only_speculator_leaves_sampled_requests_alone():
    """Deterministic mode: greedy output cannot change with speculation, sampled draws can."""
    from tokenyard.engine.spec.speculator import Speculator

    bm = BlockManager(32, BS)
    spec = Speculator(SpeculativeConfig(method="ngram"), bm, max_model_len=64, greedy_only=True)
    copy = [5, 6, 7, 8, 9, 5, 6, 7]
    greedy = _running(bm, copy, "g", temperature=0)
    sampled = _running(bm, copy, "s", temperature=0.8, seed=1)
    spec.propose([greedy, sampled])
    assert greedy.spec_token_ids[:2] == [8, 9] and sampled.spec_token_ids == []


def test_deterministic_mode_takes_a_speculative_config():
    spec = {"method": "ngram"}
    config = EngineConfig(quantization="int4", deterministic=True, speculative_config=spec)
    assert isinstance(config.speculative_config, SpeculativeConfig)
