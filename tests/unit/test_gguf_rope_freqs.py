"""Llama 3's RoPE scaling in a GGUF: llama.cpp's converter writes it as a `rope_freqs.weight`
tensor of per-pair divisors rather than metadata; the loader must apply it, so the GGUF
scores every position as the safetensors checkpoint with the equivalent rope_scaling does."""

from __future__ import annotations

import dataclasses
import importlib.util
import sys
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch

from tokenyard.engine.config import EngineConfig
from tokenyard.engine.llm_engine import LLMEngine
from tokenyard.engine.sampling_params import SamplingParams
from tokenyard.models.errors import ModelLoadError
from tokenyard.models.gguf_file import GGUFFile
from tokenyard.models.gguf_loader import read_config
from tokenyard.models.llama import RotaryEmbedding
from tokenyard.models.loader import LoadedModel, load_model

_SHAPES = Path(__file__).resolve().parents[2] / "benchmarks" / "model_shapes.py"
# Short wavelengths against a short original context, so that the factors change the
# rotation of most dimensions within the test's 96 positions (Llama 3.2's own theta and
# 8,192 tokens would change them by a few thousandths of a radian there).
ROPE_SCALING = {
    "factor": 8.0,
    "high_freq_factor": 4.0,
    "low_freq_factor": 1.0,
    "original_max_position_embeddings": 64,
    "rope_type": "llama3",
}
TOL = 2e-4  # fp32 engines on the same bf16 weights: only float rounding differs


@pytest.fixture(scope="module")
def shapes():
    spec = importlib.util.spec_from_file_location("model_shapes_for_rope", _SHAPES)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses resolve the module's annotations through it
    spec.loader.exec_module(module)
    yield module
    del sys.modules[spec.name]


@pytest.fixture(scope="module")
def checkpoint(shapes, tmp_path_factory):
    """A tiny Llama 3 written twice: safetensors with rope_scaling, and a bf16 GGUF (the
    same weights exactly) with rope_freqs.weight; q/k weights large enough that attention
    depends on position."""
    shape = dataclasses.replace(
        shapes.SHAPES["llama-3.2-1b"], name="tiny-llama3-rope", layers=2, hidden=128,
        intermediate=256, heads=4, kv_heads=2, head_dim=32, rope_theta=10000.0,
        max_position_embeddings=4096, rope_scaling=ROPE_SCALING,
    )  # fmt: skip
    folder = tmp_path_factory.mktemp("rope") / shape.name
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(shapes, "WEIGHT_STD", 0.25)
        shapes.write_checkpoint(shape, folder, seed=7, gguf_type="bf16")
    return folder, shapes.gguf_path(folder, "bf16")


def prompt_logprobs(loaded: LoadedModel) -> torch.Tensor:
    """Every prompt position's log-probability of the next prompt token: [95]."""
    config = EngineConfig(dtype="float32", kv_cache_dtype="float32", kv_cache_bytes=8 << 20)
    engine = LLMEngine(config, loaded=loaded)
    ids = torch.randint(5, 2000, (96,), generator=torch.Generator().manual_seed(0)).tolist()
    engine.add_request("r", ids, SamplingParams(max_tokens=1, prompt_logprobs=0))
    seq = engine.seqs["r"]
    while engine.has_unfinished():
        engine.step()
    assert seq.prompt_logprobs[0] is None and len(seq.prompt_logprobs) == len(ids)
    return torch.tensor([lp.logprob for lp in seq.prompt_logprobs[1:]])


def test_the_gguf_reads_the_factors_into_its_rope_scaling(checkpoint, shapes):
    _, path = checkpoint
    with GGUFFile(str(path)) as file:
        config = read_config(file)
    assert config.rope_scaling is not None
    factors = config.rope_scaling["freq_factors"]
    assert len(factors) == config.head_dim // 2
    assert factors[0] == 1.0 and factors[-1] == ROPE_SCALING["factor"]
    # the RoPE tables the two checkpoints build are the same, up to the factors' fp32
    hf = load_model(str(checkpoint[0])).config
    ours, theirs = RotaryEmbedding(config, 256), RotaryEmbedding(hf, 256)
    torch.testing.assert_close(ours.cos, theirs.cos, atol=1e-5, rtol=0)
    torch.testing.assert_close(ours.sin, theirs.sin, atol=1e-5, rtol=0)


def test_gguf_with_rope_freqs_scores_as_the_safetensors_model(checkpoint):
    folder, path = checkpoint
    from_gguf, from_hf = load_model(str(path)), load_model(str(folder))
    for name, tensor in from_hf.weights.items():  # the same weights exactly: only RoPE differs
        assert torch.equal(from_gguf.weights[name], tensor), name
    ours, theirs = prompt_logprobs(from_gguf), prompt_logprobs(from_hf)
    torch.testing.assert_close(ours, theirs, atol=TOL, rtol=0)
    # Without the factors (the loader's old behaviour) the scores are far apart: the
    # comparison above can tell.
    unscaled = dataclasses.replace(from_gguf.config, rope_scaling=None)
    dropped = prompt_logprobs(dataclasses.replace(from_gguf, config=unscaled))
    assert (dropped - theirs).abs().max().item() > 50 * TOL


def test_a_rope_freqs_tensor_of_the_wrong_length_is_refused(tmp_path):
    path = tmp_path / "bad-rope.gguf"
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_block_count(1)
    writer.add_context_length(128)
    writer.add_embedding_length(64)
    writer.add_feed_forward_length(128)
    writer.add_head_count(4)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_vocab_size(32)
    writer.add_tensor("rope_freqs.weight", np.ones(3, np.float32))  # head_dim 16: 8 pairs
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with GGUFFile(str(path)) as file, pytest.raises(ModelLoadError) as error:
        read_config(file)
    assert "rope_freqs.weight holds 3 factors" in str(error.value)
    assert "rotates 8 pairs" in str(error.value)
