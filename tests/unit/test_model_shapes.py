"""benchmarks/model_shapes.py: real models' shapes with random weights, loadable by the engine
and, as a GGUF, in llama.cpp's layout."""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import sys
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch

from tokenyard import LLM, SamplingParams
from tokenyard.models.loader import load_model, load_tokenizer

_PATH = Path(__file__).resolve().parents[2] / "benchmarks" / "model_shapes.py"


@pytest.fixture(scope="module")
def shapes():
    spec = importlib.util.spec_from_file_location("model_shapes_under_test", _PATH)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses resolve the module's annotations through it
    spec.loader.exec_module(module)
    yield module
    del sys.modules[spec.name]


def _tiny(shapes, name: str):
    """The named shape's family and head ratio at a size that loads in a second."""
    real = shapes.SHAPES[name]
    heads, kv_heads = real.heads // 4, real.kv_heads // 4 or 1
    if name.startswith("qwen"):  # 14 / 2 keeps its odd ratio: 7 query heads per KV head
        heads, kv_heads = real.heads, real.kv_heads
    return dataclasses.replace(
        real, name=f"tiny-{name}", layers=2, hidden=128, intermediate=256, heads=heads,
        kv_heads=kv_heads, head_dim=16,
    )  # fmt: skip


@pytest.fixture(scope="module", params=["llama-3.2-1b", "qwen2.5-0.5b"])
def written(request, shapes, tmp_path_factory):
    shape = _tiny(shapes, request.param)
    folder = tmp_path_factory.mktemp("shapes") / shape.name
    shapes.write_checkpoint(shape, folder, seed=3)
    return shape, folder


def test_real_shapes_are_the_published_configs(shapes):
    llama, qwen = shapes.SHAPES["llama-3.2-1b"], shapes.SHAPES["qwen2.5-0.5b"]
    assert (llama.layers, llama.hidden, llama.intermediate) == (16, 2048, 8192)
    assert (llama.heads, llama.kv_heads, llama.head_dim) == (32, 8, 64)
    assert llama.tied and not llama.attention_bias and llama.rope_theta == 500000.0
    assert llama.rope_scaling is not None and llama.rope_scaling["rope_type"] == "llama3"
    assert (qwen.layers, qwen.hidden, qwen.intermediate) == (24, 896, 4864)
    assert (qwen.heads, qwen.kv_heads, qwen.head_dim) == (14, 2, 64)
    assert qwen.tied and qwen.attention_bias and qwen.rope_theta == 1000000.0
    # the 1B shape's parameters with the real vocabulary: Llama 3.2 1B's 1.24 B
    assert shapes.parameters(llama, 128256)["total"] == 1_235_814_400


def test_config_fields_reach_the_engine(written):
    shape, folder = written
    config = load_model(str(folder)).config
    assert config.architecture == shape.architecture
    assert (config.num_hidden_layers, config.hidden_size) == (shape.layers, shape.hidden)
    assert config.intermediate_size == shape.intermediate
    assert (config.num_attention_heads, config.num_key_value_heads) == (
        shape.heads,
        shape.kv_heads,
    )
    assert config.head_dim == shape.head_dim
    assert config.attention_bias == shape.attention_bias
    assert config.tie_word_embeddings == shape.tied
    assert config.rope_theta == shape.rope_theta
    assert config.rope_scaling == shape.rope_scaling
    assert config.vocab_size == load_tokenizer(str(folder)).vocab_size == 49152


def test_the_engine_generates_from_it(written):
    _, folder = written
    llm = LLM(model=str(folder), dtype="float32")
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True, logprobs=1)
    out = llm.chat([{"role": "user", "content": "hello"}], params)[0]
    assert len(out.token_ids) == 4
    assert all(0 <= t < 49152 for t in out.token_ids)
    assert out.logprobs is not None
    assert all(np.isfinite(lp.logprob) for lp in out.logprobs)
    assert llm.tokenizer.eos_token_id == 2  # the default model's <|im_end|>


def test_an_untied_shape_has_its_own_output_projection(shapes):
    untied = shapes.tensor_shapes(_tiny(shapes, "tinyllama-1.1b"), 64)
    assert untied["lm_head.weight"] == untied["model.embed_tokens.weight"] == (64, 128)
    assert "lm_head.weight" not in shapes.tensor_shapes(_tiny(shapes, "llama-3.2-1b"), 64)
    assert shapes.gguf_name("lm_head.weight") == "output.weight"


def test_seeded_weights_are_deterministic(shapes):
    shape = _tiny(shapes, "qwen2.5-0.5b")
    a, b = shapes.random_weights(shape, 64, seed=5), shapes.random_weights(shape, 64, seed=5)
    c = shapes.random_weights(shape, 64, seed=6)
    name = "model.layers.1.self_attn.q_proj.bias"
    assert torch.equal(a[name], b[name])
    assert not torch.equal(a[name], c[name])
    assert a[name].dtype == torch.bfloat16
    assert torch.equal(a["model.norm.weight"], torch.ones(shape.hidden, dtype=torch.bfloat16))


def test_gguf_reads_back_in_llama_cpp_names_and_shapes(shapes, written):
    shape, folder = written
    reader = gguf.GGUFReader(str(shapes.gguf_path(folder)))
    arch = shape.architecture
    assert reader.fields["general.architecture"].contents() == arch
    assert reader.fields[f"{arch}.block_count"].contents() == shape.layers
    assert reader.fields[f"{arch}.attention.head_count_kv"].contents() == shape.kv_heads
    assert reader.fields["tokenizer.ggml.pre"].contents() == "smollm"
    tensors = {t.name: t for t in reader.tensors}
    q = shape.heads * shape.head_dim
    # GGUF lists dimensions innermost first
    assert list(tensors["blk.1.attn_q.weight"].shape) == [shape.hidden, q]
    assert list(tensors["blk.0.ffn_down.weight"].shape) == [shape.intermediate, shape.hidden]
    assert tensors["blk.0.ffn_up.weight"].tensor_type == gguf.GGMLQuantizationType.Q4_1
    assert tensors["blk.0.attn_norm.weight"].tensor_type == gguf.GGMLQuantizationType.F32
    assert ("blk.0.attn_q.bias" in tensors) == shape.attention_bias
    assert ("output.weight" in tensors) == (not shape.tied)
    assert ("rope_freqs.weight" in tensors) == (shape.rope_scaling is not None)
    expected_count = 1 + shape.layers * (9 + 3 * shape.attention_bias) + 1 + (not shape.tied)
    assert len(tensors) == expected_count + ("rope_freqs.weight" in tensors)


def test_gguf_holds_the_same_weights(shapes, written):
    """The engine's GGUF loader undoes llama.cpp's q/k permutation: the GGUF's weights are
    the safetensors' up to Q4_1's rounding."""
    shape, folder = written
    hf = load_model(str(folder)).weights
    from_gguf = load_model(str(shapes.gguf_path(folder))).weights
    assert set(hf) == set(from_gguf)
    for name in (
        "model.layers.0.self_attn.q_proj.weight",
        "model.layers.1.self_attn.k_proj.weight",
    ):
        error = (from_gguf[name] - hf[name]).abs().max().item()
        assert error < 0.01, (name, error)  # std 0.02 weights, 4-bit steps of about 0.006
        assert error > 0  # quantized, not copied


def test_llama3_rope_factors(shapes):
    """llama.cpp's rope_freqs: 1 for wavelengths under 8,192 / 4, the factor (32) past
    8,192, smoothly between."""
    factors = shapes.llama3_rope_factors(shapes.SHAPES["llama-3.2-1b"])
    assert len(factors) == 32
    assert factors[0] == 1.0 and factors[-1] == 32.0
    assert factors == sorted(factors)
    assert any(1.0 < f < 32.0 for f in factors)


def test_written_config_is_what_transformers_expects(written):
    shape, folder = written
    config = json.loads((folder / "config.json").read_text())
    family = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM"}[shape.architecture]
    assert config["architectures"] == [family]
    assert config["torch_dtype"] == "bfloat16"
    assert (folder / "tokenizer" / "tokenizer.json").is_file()
    assert not (folder / "tokenizer" / "config.json").exists()  # see tokenizer_folder
    assert "<|im_start|>" in (folder / "chat_template.jinja").read_text()


def test_output_is_written_outside_the_repo_by_default(shapes, monkeypatch):
    monkeypatch.delenv(shapes.ROOT_ENV, raising=False)
    assert shapes.shapes_root() == Path.home() / ".cache/tokenyard/shapes"
    assert not shapes.shapes_root().resolve().is_relative_to(_PATH.parents[1])
