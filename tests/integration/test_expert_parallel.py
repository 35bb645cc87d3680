"""Expert parallelism: experts placed over two ranks (gloo on the CPU), tokens dispatched to
them and combined back by all-to-all, give HF's log-probabilities on tiny random Mixtral and
Qwen2-MoE checkpoints (fp32, the dense tests' tolerance), alone and beside tensor-parallel
attention, and still do after the placement balancer has replicated and moved experts
between steps (it runs after every step here, with one spare slot per rank)."""

from __future__ import annotations

import os

import pytest
import torch
from moe_checkpoints import hf_moe_model, save_hf_folder
from prometheus_client import REGISTRY

from tokenyard import LLM, SamplingParams
from tokenyard.models.expert_parallel import ExpertParallelMoE, ep_blocks
from tokenyard.models.expert_placement import initial_placement
from tokenyard.models.loader import load_model
from tokenyard.services.worker.metrics import WorkerMetrics

TOL = 1e-3  # as tests/integration/test_moe.py
# cuda: NCCL over two GPUs (scripts/gpu_check.sh); on one GPU every test here skips.
DEVICE = os.environ.get("TOKENYARD_TEST_DEVICE", "cpu")
pytestmark = pytest.mark.skipif(
    DEVICE != "cpu" and torch.cuda.device_count() < 2, reason="2 ranks need 2 GPUs"
)
PROMPTS = [[(7 * i + 3) % 4000 + 100 for i in range(n)] for n in (5, 41, 17)]
PARAMS = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True, logprobs=2)
ENGINE = dict(
    kv_cache_dtype="float32",  # fp32 through, as HF
    kv_cache_bytes=4 * 1024**2,
    max_num_batched_tokens=32,  # the 41-token prompt prefills in two chunks
    num_threads=1,
    expert_redundant_slots=1,
    expert_rebalance_interval=1,
    device=DEVICE,
)
LAYOUTS = {
    # experts over 2 ranks, attention whole on each
    "mixtral-ep2": ("mixtral", {}, 1),
    # attention's heads split over the same 2 ranks; a dense layer between sparse ones
    "qwen2_moe-tp2-ep2": ("qwen2_moe", {"num_hidden_layers": 3, "mlp_only_layers": [1]}, 2),
}


@pytest.mark.slow
@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_expert_parallel_matches_hf_across_rebalances(layout, tmp_path):
    kind, overrides, tp = LAYOUTS[layout]
    hf_model = hf_moe_model(kind, **overrides)
    folder = save_hf_folder(hf_model, tmp_path / kind)
    llm = LLM(str(folder), tensor_parallel_size=tp, expert_parallel_size=2, **ENGINE)
    try:
        results = llm.generate(PROMPTS, PARAMS)
        balancer = llm.engine.expert_balancer
        assert balancer is not None and balancer.history  # experts moved mid-generation
        blocks = ep_blocks(llm.engine.runner.model)
        slots = [b.slots for b in blocks]
        assert any(s != initial_placement(4, 2, 1) for s in slots)
        _assert_rank0_slots_hold_their_experts(llm.engine.runner.model, str(folder))
        counts = llm.engine.stats().expert_tokens  # rank 0 counts every rank's tokens
        tokens_run = sum(  # the prompts share a prefix: cached blocks are not run
            len(p) - r.num_cached_tokens + PARAMS.max_tokens - 1
            for p, r in zip(PROMPTS, results, strict=True)
        )
        assert all(sum(c) == 2 * tokens_run for c in counts)
        assert all(sum(b.tokens_per_rank.tolist()) == 2 * tokens_run for b in blocks)
    finally:
        llm.close()
    for prompt, result in zip(PROMPTS, results, strict=True):
        ids = prompt + result.token_ids
        with torch.inference_mode():
            ref = torch.log_softmax(hf_model(torch.tensor([ids])).logits[0].float(), dim=-1)
        for i, lp in enumerate(result.logprobs or []):
            row = ref[len(prompt) - 1 + i]
            assert abs(lp.logprob - row[lp.token_id].item()) <= TOL, (i, lp.logprob)
            for token_id, value in lp.top:
                assert abs(value - row[token_id].item()) <= TOL
            assert row.max().item() - row[lp.token_id].item() <= TOL  # greedy took HF's argmax


@pytest.mark.slow
def test_the_worker_exports_rank_imbalance_and_rebalances(tmp_path):
    """The worker's gauge of max/mean tokens per rank (per MoE layer, since the last
    rebalance and in the window it measured) and its count of rebalances, from a tiny
    Mixtral engine on two expert-parallel ranks whose balancer runs after every step."""
    folder = save_hf_folder(hf_moe_model("mixtral"), tmp_path / "mixtral")
    llm = LLM(str(folder), expert_parallel_size=2, **ENGINE)
    try:
        llm.generate(PROMPTS, PARAMS)
        stats = llm.engine.stats()
        history = llm.engine.expert_balancer.history
        blocks = ep_blocks(llm.engine.runner.model)
    finally:
        llm.close()
    balance = stats.expert_balance
    assert balance is not None and history and balance.num_rebalances == len(history)
    assert balance.before_last_rebalance == history[-1].before
    assert len(balance.now) == len(blocks) and all(x >= 1.0 for x in balance.now)
    metrics = WorkerMetrics("ep2-w", "both", "mixtral")
    metrics.on_stats(stats)
    labels = {"worker": "ep2-w", "role": "both", "model": "mixtral"}
    for layer in range(len(blocks)):
        for window, value in (
            ("current", balance.now[layer]),
            ("before_rebalance", balance.before_last_rebalance[layer]),
        ):
            gauge = REGISTRY.get_sample_value(
                "tokenyard:moe_rank_load_imbalance",
                {**labels, "layer": str(layer), "window": window},
            )
            assert gauge == value and gauge >= 1.0, (layer, window)
    rebalances = REGISTRY.get_sample_value("tokenyard:moe_expert_rebalances_total", labels)
    assert rebalances == len(history)


def _assert_rank0_slots_hold_their_experts(model, folder: str) -> None:
    """After the moves, each of rank 0's slots holds the checkpoint's weights of the expert
    its placement names (the gate rows of gate_up and all of down)."""
    weights = load_model(folder).weights
    sparse = [i for i, layer in enumerate(model.layers) if isinstance(layer.mlp, ExpertParallelMoE)]
    for i, block in zip(sparse, ep_blocks(model), strict=True):
        for slot, e in enumerate(block.local_experts(block.slots)):
            mixtral = f"model.layers.{i}.block_sparse_moe.experts.{e}."
            qwen = f"model.layers.{i}.mlp.experts.{e}."
            gate, down = (
                (weights[mixtral + "w1.weight"], weights[mixtral + "w2.weight"])
                if mixtral + "w1.weight" in weights
                else (weights[qwen + "gate_proj.weight"], weights[qwen + "down_proj.weight"])
            )
            expert = block.block.expert(slot)
            gate_up, down_weight = expert.gate_up_proj.weight.cpu(), expert.down_proj.weight.cpu()
            assert torch.equal(gate_up[: gate.shape[0]], gate.float())
            assert torch.equal(down_weight, down.float())
