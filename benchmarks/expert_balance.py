"""Expert parallelism's placement balancer on a router skewed towards a few experts: the
ranks' load imbalance (max / mean of the (token, expert) pairs each rank runs) before and
after one rebalance.

    .venv/bin/python benchmarks/expert_balance.py [--experts 8] [--ep 2] [--redundant 0 1]
        [--hot 2] [--prompts 16] [--out expert_balance.json]

Builds a tiny random Mixtral with transformers (fp32, `--layers` layers of `--experts`
experts, top-2) and skews every layer's router towards experts 0 .. hot-1, which the
initial placement puts on rank 0 (the worst case, as when a checkpoint's hot experts sit
together): every embedding row gets one shared direction (`--shift`), so the hidden states
share it, and the hot experts' router rows get `--skew` / |m|^2 times the mean router input
m measured on HF's own forward pass, so most tokens score them higher. Then, per `--redundant` setting, one engine
at expert_parallel_size `--ep`:

1. runs workload A (random prompts), reading the tokens each rank ran under the initial
   placement: `before`;
2. rebalances once from A's counts (replicas of the hot experts into the spare slots,
   experts moved between ranks, no restart);
3. runs workload B (other random prompts from the same distribution) under the new
   placement: `after`, measured, out of sample; `b_under_initial` is what B's routing
   would have given the initial placement (the counterfactual, from the counts).

Results as JSON outside the repo (result_path).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
from result_path import OUT_HELP, out_path

from tokenyard import LLM, SamplingParams
from tokenyard.engine.contract import Prompt
from tokenyard.models.expert_parallel import ep_blocks
from tokenyard.models.expert_placement import imbalance, initial_placement, rank_loads
from tokenyard.models.loader import load_tokenizer

VOCAB = 49152  # the default tokenizer's, which the folder reuses


def skewed_mixtral(args: argparse.Namespace, folder: Path) -> float:
    """Save the skewed checkpoint; returns the hot experts' share of HF's routing."""
    import transformers

    config = transformers.MixtralConfig(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=args.layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        num_local_experts=args.experts,
        num_experts_per_tok=2,
        tie_word_embeddings=False,
        initializer_range=0.2,
    )
    torch.manual_seed(0)
    model = transformers.MixtralForCausalLM(config).eval()
    with torch.no_grad():  # a direction every token's hidden state shares, for the router
        shared = torch.randn(64, generator=torch.Generator().manual_seed(3))
        model.model.embed_tokens.weight += args.shift * shared / shared.norm()
    gates = [layer.mlp.gate for layer in model.model.layers]
    inputs: list[list[torch.Tensor]] = [[] for _ in gates]
    hooks = [
        g.register_forward_hook(lambda m, a, out, i=i: inputs[i].append(a[0].reshape(-1, 64)))
        for i, g in enumerate(gates)
    ]
    with torch.inference_mode():
        model(torch.tensor([prompts(4, seed=99)[0]]))
        for h in hooks:
            h.remove()
        for gate, seen in zip(gates, inputs, strict=True):
            mean = torch.cat(seen).mean(dim=0)
            gate.weight[: args.hot] += args.skew * mean / mean.dot(mean)
        share = hot_share(model, gates, args.hot)
    model.save_pretrained(str(folder))
    tokenizer = load_tokenizer()
    tokenizer.backend.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(
        json.dumps({"bos_token": tokenizer.bos_token, "eos_token": tokenizer.eos_token})
    )
    return share


def hot_share(model: Any, gates: list[Any], hot: int) -> float:
    """The hot experts' share of the top-2 choices on a sample of prompts."""
    chosen: list[torch.Tensor] = []
    hooks = [
        g.register_forward_hook(
            lambda m, a, out: chosen.append(
                torch.topk(a[0].reshape(-1, 64) @ m.weight.T, 2).indices
            )
        )
        for g in gates
    ]
    model(torch.tensor([prompts(1, seed=98)[0]]))
    for h in hooks:
        h.remove()
    ids = torch.cat([c.flatten() for c in chosen])
    return float((ids < hot).float().mean())


def prompts(n: int, seed: int, length: int = 48) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(100, VOCAB, (length,), generator=g).tolist() for _ in range(n)]


def run(folder: Path, args: argparse.Namespace, redundant: int) -> dict[str, Any]:
    llm = LLM(
        str(folder),
        expert_parallel_size=args.ep,
        expert_redundant_slots=redundant,
        kv_cache_bytes=16 * 1024**2,
        num_threads=1,
        enable_prefix_caching=False,
    )
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0.0, ignore_eos=True)
    try:
        balancer = llm.engine.expert_balancer
        assert balancer is not None
        llm.generate(list[Prompt](prompts(args.prompts, seed=1)), params)
        window_a = balancer.window()
        start = time.perf_counter()
        record = balancer.rebalance()
        seconds = time.perf_counter() - start
        llm.generate(list[Prompt](prompts(args.prompts, seed=2)), params)
        window_b = balancer.window()
        slots = [b.slots for b in ep_blocks(llm.engine.runner.model)]
    finally:
        llm.close()
    initial = initial_placement(args.experts, args.ep, redundant)
    layers = []
    for i, ((_, ran_a), (counts_b, ran_b)) in enumerate(zip(window_a, window_b, strict=True)):
        layers.append(
            {
                "before": imbalance([float(n) for n in ran_a]),
                "after": imbalance([float(n) for n in ran_b]),
                "b_under_initial": imbalance(rank_loads(counts_b, initial, args.ep)),
                "estimated_after_on_a": record.after[i] if record else None,
                "rank_tokens_before": ran_a,
                "rank_tokens_after": ran_b,
                "placement": slots[i],
            }
        )
    return {
        "redundant_slots_per_rank": redundant,
        "rebalanced": record is not None,
        "rebalance_seconds": seconds,
        "layers": layers,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--experts", type=int, default=8)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--ep", type=int, default=2)
    parser.add_argument("--hot", type=int, default=2, help="experts the router favours")
    parser.add_argument("--skew", type=float, default=3.0, help="logit added for the hot ones")
    parser.add_argument(
        "--shift", type=float, default=2.0, help="norm of the direction added to every embedding"
    )
    parser.add_argument("--redundant", type=int, nargs="+", default=[0, 1])
    parser.add_argument("--prompts", type=int, default=16, help="per workload, 48 tokens each")
    parser.add_argument("--max-tokens", type=int, default=8)
    parser.add_argument("--out", help=OUT_HELP)
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp) / "skewed-mixtral"
        share = skewed_mixtral(args, folder)
        runs = [run(folder, args, r) for r in args.redundant]
    result = {
        "model": f"tiny random Mixtral, {args.layers} layers x {args.experts} experts, top-2",
        "expert_parallel_size": args.ep,
        "hot_experts": args.hot,
        "hot_share_of_choices": share,
        "device": "cpu (gloo)",
        "runs": runs,
    }
    path = out_path(args.out, "expert_balance")
    path.write_text(json.dumps(result, indent=2))
    for r in runs:
        for i, layer in enumerate(r["layers"]):
            sys.stdout.write(
                f"redundant {r['redundant_slots_per_rank']} layer {i}: max/mean "
                f"{layer['before']:.3f} -> {layer['after']:.3f} "
                f"(B under the initial placement {layer['b_under_initial']:.3f})\n"
            )
    sys.stdout.write(f"hot experts' share of choices {share:.2f}; results in {path}\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
