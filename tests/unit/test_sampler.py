"""Sampling on synthetic logits: filters, penalties, seeds, logprobs; and stop strings."""

from __future__ import annotations

import pytest
import torch

from tokenyard.engine.sampler import sample
from tokenyard.engine.sampling_params import SamplingParams
from tokenyard.engine.sequence import Sequence
from tokenyard.engine.stop import StopChecker


def seqs(*params: SamplingParams, output=(5, 5, 6)) -> list[Sequence]:
    out = []
    for i, p in enumerate(params):
        s = Sequence(str(i), [1, 2, 3], p, arrival=i)
        s.token_ids.extend(output)
        out.append(s)
    return out


LOGITS = torch.tensor([[0.0, 1.0, 2.0, 3.0, 4.0, 5.0, 2.5, -1.0]])


def draw_many(params: SamplingParams, n=300) -> set[int]:
    seen = set()
    for i in range(n):
        p = SamplingParams(**{**params.__dict__, "seed": i})
        tokens, _ = sample(LOGITS.clone(), seqs(p, output=()))
        seen.add(tokens[0])
    return seen


def test_greedy_takes_argmax():
    tokens, lps = sample(
        LOGITS.repeat(2, 1),
        seqs(SamplingParams(temperature=0), SamplingParams(temperature=0, logprobs=2)),
    )
    assert tokens == [5, 5]
    assert lps[0] is None
    assert lps[1].token_id == 5 and [t for t, _ in lps[1].top] == [5, 4]
    assert lps[1].logprob == pytest.approx(torch.log_softmax(LOGITS[0], -1)[5].item())


def test_top_k_top_p_min_p_restrict_the_support():
    assert draw_many(SamplingParams(temperature=1.0, top_k=2)) == {4, 5}
    # probs: token 5 -> 0.60, 4 -> 0.22, 3 -> 0.08, 6 -> 0.05: a mass of 0.7 needs two tokens
    assert draw_many(SamplingParams(temperature=1.0, top_p=0.7)) == {4, 5}
    assert draw_many(SamplingParams(temperature=1.0, top_p=0.5)) == {5}
    assert draw_many(SamplingParams(temperature=1.0, min_p=0.3)) == {4, 5}
    assert len(draw_many(SamplingParams(temperature=1.0))) > 3


def test_seed_is_reproducible_whatever_the_neighbours():
    p = SamplingParams(temperature=1.0, seed=1234)
    alone, _ = sample(LOGITS.clone(), seqs(p))
    crowd_logits = torch.cat([torch.randn(3, 8), LOGITS])
    others = [
        SamplingParams(temperature=0.7),
        SamplingParams(temperature=0),
        SamplingParams(temperature=1.3, seed=9),
    ]
    crowd, _ = sample(crowd_logits, seqs(*others, p))
    assert crowd[-1] == alone[0]


def test_seeded_draws_differ_by_position():
    p = SamplingParams(temperature=5.0, seed=7)
    draws = set()
    for n in range(20):
        tokens, _ = sample(LOGITS.clone(), seqs(p, output=tuple([0] * n)))
        draws.add(tokens[0])
    assert len(draws) > 1


def test_penalties_push_repeated_tokens_down():
    greedy = SamplingParams(temperature=0)
    assert sample(LOGITS.clone(), seqs(greedy))[0] == [5]
    assert sample(LOGITS.clone(), seqs(SamplingParams(temperature=0, frequency_penalty=2.0)))[
        0
    ] == [4]
    # token 5 appeared twice: 5 - 2 * 0.6 - 0.6 = 3.2 < 4
    pp = SamplingParams(temperature=0, frequency_penalty=0.6, presence_penalty=0.6)
    assert sample(LOGITS.clone(), seqs(pp))[0] == [4]
    rp = SamplingParams(temperature=0, repetition_penalty=1.3)  # 5 / 1.3 < 4
    assert sample(LOGITS.clone(), seqs(rp))[0] == [4]


@pytest.mark.parametrize(
    "kwargs",
    [
        dict(max_tokens=0),
        dict(max_tokens=-3),
        dict(temperature=-0.1),
        dict(top_p=0.0),
        dict(top_p=1.5),
        dict(top_k=0),
        dict(min_p=2.0),
        dict(presence_penalty=3.0),
        dict(repetition_penalty=0.0),
        dict(logprobs=21),
        dict(stop=[""]),
    ],
)
def test_bad_sampling_params_are_refused(kwargs):
    with pytest.raises(ValueError) as err:
        SamplingParams(**kwargs)
    assert next(iter(kwargs)).split("_")[0] in str(err.value)


def test_stop_string_split_across_pieces_is_never_emitted():
    c = StopChecker(["###", "END"])
    out = []
    for piece in ["Hello ", "wor", "ld #", "#", "# tail"]:
        text, stopped = c.feed(piece, final=False)
        out.append(text)
        if stopped:
            break
    assert "".join(out) == "Hello world "
    assert stopped


def test_partial_stop_prefix_released_at_the_end():
    c = StopChecker(["STOP"])
    assert c.feed("abc ST", final=False) == ("abc ", False)
    assert c.feed("", final=True) == ("ST", False)


def test_include_stop_string():
    c = StopChecker(["\n\n"], include_stop=True)
    assert c.feed("a\n\nb", final=False) == ("a\n\n", True)


def test_greedy_tokens_are_argmax_ties_and_masked_rows_included():
    from tokenyard.engine.sampler import greedy_tokens

    g = torch.Generator().manual_seed(5)
    logits = torch.randn(33, 49_152, generator=g)
    logits[3, [7, 90, 40_000]] = 50.0  # a three-way tie: the first index wins
    logits[4] = float("-inf")
    logits[4, 123] = 0.0  # a grammar mask leaves one token
    logits[5, :] = 1.0  # all tied
    got = greedy_tokens(logits)
    assert torch.equal(got, logits.argmax(dim=-1))
    assert got[3].item() == 7 and got[4].item() == 123 and got[5].item() == 0
