"""LoRA adapters: our engine's logprobs against HF transformers + PEFT on the same weights.

A tiny random Llama and two tiny random PEFT adapters on every projection (q/k/v/o and the
MLP's gate/up/down; the second at another rank, with rsLoRA scaling). Both sides run in fp32
with an fp32 KV pool; every sampled token's logprob (and its top 3) and every prompt token's
logprob must agree within 1e-3: an adapter alone, mixed in one batch with the base and the
other adapter, chunked (a 70-token prompt under a 48-token step budget), with one slot for
two adapters (they swap), and across a KV hand-off between two engines.
"""

from __future__ import annotations

import copy

import pytest
import torch
from moe_checkpoints import save_hf_folder

from tokenyard import LLM, LoRARequest, SamplingParams

TOL = 1e-3
PROMPTS = [[(7 * i + 3) % 4000 + 100 for i in range(n)] for n in (5, 41, 70, 17)]
PARAMS = SamplingParams(
    max_tokens=6, temperature=0.0, ignore_eos=True, logprobs=3, prompt_logprobs=2
)
ENGINE = dict(
    block_size=16,
    max_num_batched_tokens=48,  # the 70-token prompt prefills in two chunks
    max_num_seqs=8,
    kv_cache_bytes=4 * 1024**2,
    kv_cache_dtype="float32",
    num_threads=1,
    enable_lora=True,
    max_lora_rank=8,
)
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def _base_model():
    import transformers

    config = transformers.LlamaConfig(
        vocab_size=49152,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        rope_theta=50000.0,
        tie_word_embeddings=False,
        initializer_range=0.2,  # logits that differ: at 0.02 every token ties
    )
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(config).eval()


def _peft_model(base, seed: int, **lora):
    """A copy of `base` with a random adapter (B random too: PEFT's default B is zeros)."""
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(seed)
    config = LoraConfig(target_modules=TARGETS, init_lora_weights=False, **lora)
    model = get_peft_model(copy.deepcopy(base), config).eval()
    with torch.no_grad():  # PEFT's random init is small: make the adapter matter
        for name, p in model.named_parameters():
            if "lora_" in name:
                p.mul_(4.0)
    return model


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """{'': the base, 'a': adapter a, 'b': adapter b} as HF models, and the folders."""
    base = _base_model()
    folder = save_hf_folder(base, tmp_path_factory.mktemp("llama"))
    refs = {"": base}
    paths = {}
    for name, seed, lora in (
        ("a", 1, {"r": 8, "lora_alpha": 16}),
        ("b", 2, {"r": 4, "lora_alpha": 8, "use_rslora": True}),
    ):
        refs[name] = _peft_model(base, seed, **lora)
        paths[name] = tmp_path_factory.mktemp(f"adapter-{name}")
        refs[name].save_pretrained(str(paths[name]))
    return str(folder), refs, paths


@pytest.fixture(scope="module")
def llm(models):
    folder, _, _ = models
    engine = LLM(folder, max_loras=2, **ENGINE)
    yield engine
    engine.close()


def _request(paths, name: str) -> LoRARequest | None:
    return LoRARequest(name, ord(name), str(paths[name])) if name else None


def _hf_logprobs(model, ids: list[int]) -> torch.Tensor:
    with torch.inference_mode():
        logits = model(torch.tensor([ids])).logits[0].float()
    return torch.log_softmax(logits, dim=-1)


def _assert_matches(model, result) -> None:
    ids = result.prompt_token_ids + result.token_ids
    ref = _hf_logprobs(model, ids)
    n = len(result.prompt_token_ids)
    assert result.logprobs and len(result.logprobs) == len(result.token_ids)
    for i, lp in enumerate(result.logprobs):
        row = ref[n - 1 + i]
        assert abs(lp.logprob - row[lp.token_id].item()) <= TOL, (i, lp.logprob)
        for token_id, value in lp.top:
            assert abs(value - row[token_id].item()) <= TOL
        assert row.max().item() - row[lp.token_id].item() <= TOL  # greedy: HF's argmax
    assert result.prompt_logprobs and result.prompt_logprobs[0] is None
    for i, lp in enumerate(result.prompt_logprobs[1:], start=1):
        assert lp is not None and lp.token_id == ids[i]
        assert abs(lp.logprob - ref[i - 1][ids[i]].item()) <= TOL, (i, lp.logprob)


def test_adapter_alone_matches_peft(models, llm):
    _, refs, paths = models
    results = llm.generate(PROMPTS, PARAMS, lora_request=_request(paths, "a"))
    for r in results:
        _assert_matches(refs["a"], r)
    # the adapter changes the answer: the test would catch an adapter that adds nothing
    base = llm.generate(PROMPTS[:1], PARAMS)[0]
    assert abs(base.logprobs[0].logprob - results[0].logprobs[0].logprob) > 10 * TOL


def test_mixed_batch_of_base_and_two_adapters(models, llm):
    """One batch: every prompt on the base, on a and on b (chunked prefills included)."""
    _, refs, paths = models
    names = ["", "a", "b"] * len(PROMPTS)
    prompts = [p for p in PROMPTS for _ in range(3)]
    results = llm.generate(prompts, PARAMS, lora_request=[_request(paths, n) for n in names])
    for name, r in zip(names, results, strict=True):
        _assert_matches(refs[name], r)
    llm.engine.block_manager.check_no_leaks()


def test_prefix_cache_is_keyed_by_adapter(models, llm):
    """The same prompt on the base and then on an adapter shares no cached block; on the
    same adapter again it does."""
    _, refs, paths = models
    prompt = [[(11 * i + 5) % 4000 + 100 for i in range(40)]]
    params = SamplingParams(max_tokens=2, temperature=0.0, logprobs=0)
    assert llm.generate(prompt, params)[0].num_cached_tokens == 0
    first = llm.generate(prompt, params, lora_request=_request(paths, "a"))[0]
    assert first.num_cached_tokens == 0
    again = llm.generate(prompt, params, lora_request=_request(paths, "a"))[0]
    assert again.num_cached_tokens == 32
    assert again.token_ids == first.token_ids


def test_one_slot_swaps_adapters(models):
    """max_loras=1: a and b never share a batch; each waits for the other's slot."""
    folder, refs, paths = models
    llm = LLM(folder, max_loras=1, **ENGINE)
    names = ["a", "b", "", "b", "a"]
    results = llm.generate(
        PROMPTS[:1] * len(names), PARAMS, lora_request=[_request(paths, n) for n in names]
    )
    for name, r in zip(names, results, strict=True):
        _assert_matches(refs[name], r)
    assert llm.engine.lora is not None and llm.engine.lora.num_swaps >= 2


def test_adapter_across_a_kv_handoff(models, llm):
    """A prefill engine computes the prompt on adapter b; a decode engine (b loaded as well)
    imports its K/V and continues: the tokens after the hand-off still match PEFT."""
    folder, refs, paths = models
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True, logprobs=3, lora="b")
    prefill = llm.engine
    if all(a.name != "b" for a in prefill.list_loras()):
        prefill.add_lora("b", str(paths["b"]))
    prefill.add_request("h", PROMPTS[2], params, prefill_only=True)
    while prefill.has_unfinished():
        prefill.step()
    exported = prefill.export_sequence("h")
    kv = prefill.kv_cache[exported.block_ids].clone()  # the blocks a transfer would carry
    prefill.release("h")
    decode = LLM(folder, max_loras=2, **ENGINE)
    decode.engine.add_lora("b", str(paths["b"]))
    prompt, first = exported.prompt_token_ids, exported.output_token_ids
    dst = decode.engine.import_sequence("h", prompt, first, params)
    decode.engine.kv_cache[dst] = kv
    decode.engine.commit_import("h", kv_ok=True)
    seq = decode.engine.seqs["h"]
    while decode.engine.has_unfinished():
        decode.engine.step()
    ref = _hf_logprobs(refs["b"], seq.token_ids)
    assert len(seq.token_ids) == len(prompt) + params.max_tokens
    for i, lp in enumerate(seq.logprobs):  # the tokens sampled after the import
        pos = len(prompt) + len(first) + i
        assert lp.token_id == seq.token_ids[pos]
        assert abs(lp.logprob - ref[pos - 1][lp.token_id].item()) <= TOL
    assert seq.logprobs and ref[len(prompt) - 1].argmax().item() == first[0]
    decode.engine.block_manager.check_no_leaks()


def test_unload_lets_running_requests_finish(models, llm):
    """An unload while a request runs on the adapter: new requests are refused at once, the
    running one finishes with all its tokens, and then the adapter is gone."""
    from tokenyard.engine.lora import UnknownAdapter

    _, _, paths = models
    engine = llm.engine
    engine.add_lora("gone", str(paths["a"]))
    params = SamplingParams(max_tokens=4, ignore_eos=True, lora="gone")
    engine.add_request("u", PROMPTS[0], params)
    engine.step()
    assert engine.remove_lora("gone") is False
    with pytest.raises(UnknownAdapter, match="being unloaded"):
        engine.add_request("u2", PROMPTS[0], params)
    seq = engine.seqs["u"]
    while engine.has_unfinished():
        engine.step()
    assert seq.num_output_tokens == 4 and seq.finish_reason == "length"
    assert "gone" not in [a.name for a in engine.list_loras()]
    assert "gone" not in engine.lora.slots
