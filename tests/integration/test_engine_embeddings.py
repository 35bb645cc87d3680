"""Pooling requests (embeddings) in the engine against HF transformers' hidden states.

fp32 weights and KV pool; a small step budget so long prompts are pooled across several
chunks, and pooling requests share steps with a generating one.
"""

from __future__ import annotations

import pytest
import torch
from test_engine_vs_hf import FP32_KV

from tokenyard.engine.sampling_params import SamplingParams

TOL = 1e-4
TEXTS = [
    "The quick brown fox",
    "In a distant galaxy, far beyond the reach of any telescope, a small robot named Pip woke up "
    "and looked around the empty hangar for the first time in a thousand years.",
    "Paris",
]


@pytest.fixture(scope="module")
def engine(make_engine):
    return make_engine(**FP32_KV, max_num_batched_tokens=16)


def hf_embedding(hf_model, ids: list[int], pooling: str) -> torch.Tensor:
    with torch.inference_mode():
        hidden = hf_model.model(torch.tensor([ids])).last_hidden_state[0].float()
    vector = hidden.mean(dim=0) if pooling == "mean" else hidden[-1]
    return torch.nn.functional.normalize(vector, dim=0)


def run_all(engine, requests: dict[str, tuple[list[int], SamplingParams]]) -> dict:
    for rid, (ids, params) in requests.items():
        engine.add_request(rid, ids, params)
    outputs: dict = {}
    while engine.has_unfinished():
        for out in engine.step():
            outputs.setdefault(out.request_id, []).append(out)
    return outputs


@pytest.mark.parametrize("pooling", ["mean", "last"])
def test_pooled_hidden_states_equal_hf(engine, hf_model, pooling):
    prompts = [engine.tokenizer.encode(t) for t in TEXTS]
    requests = {
        f"{pooling}-{i}": (ids, SamplingParams(max_tokens=1, pooling=pooling))
        for i, ids in enumerate(prompts)
    }
    # A generating request in the same steps: pooling is batched with other work.
    requests["gen"] = (prompts[1], SamplingParams(max_tokens=8, temperature=0.0))
    outputs = run_all(engine, requests)
    assert len(outputs["gen"]) == 8
    for i, ids in enumerate(prompts):
        (out,) = outputs[f"{pooling}-{i}"]  # one output: no token is sampled
        assert out.finished and out.new_token_ids == [] and out.num_output_tokens == 0
        assert out.num_prompt_tokens == len(ids)
        ours = torch.tensor(out.embedding)
        ref = hf_embedding(hf_model, ids, pooling)
        assert ours.shape == ref.shape == (engine.model_config.hidden_size,)
        assert torch.allclose(ours, ref, atol=TOL, rtol=0), (ours - ref).abs().max()
        assert abs(ours.norm().item() - 1.0) < 1e-5
    engine.block_manager.check_no_leaks()


def test_mean_pooling_takes_no_prefix_cache_hits(engine, hf_model):
    """A prompt whose blocks are cached by an earlier request is still pooled over every row."""
    ids = engine.tokenizer.encode(TEXTS[1])
    run_all(engine, {"warm": (ids, SamplingParams(max_tokens=1, temperature=0.0))})
    outputs = run_all(engine, {"again": (ids, SamplingParams(max_tokens=1, pooling="mean"))})
    (out,) = outputs["again"]
    ref = hf_embedding(hf_model, ids, "mean")
    assert out.num_cached_tokens == 0
    assert torch.allclose(torch.tensor(out.embedding), ref, atol=TOL, rtol=0)


def test_a_pooling_request_cannot_be_prefill_only(engine):
    with pytest.raises(ValueError, match="prefill_only"):
        engine.add_request("p", [1, 2, 3], SamplingParams(pooling="mean"), prefill_only=True)
    with pytest.raises(ValueError, match="pooling"):
        SamplingParams(pooling="max")  # type: ignore[arg-type]
