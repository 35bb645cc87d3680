"""LoRA adapters: a PEFT folder's checks (each error names what is wrong) and the slots'
policy (LRU eviction, never of an adapter a running sequence pins), on a tiny model."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from tokenyard.engine.lora import LoRAManager, UnknownAdapter
from tokenyard.models.config import ModelConfig
from tokenyard.models.llama import LlamaForCausalLM
from tokenyard.models.lora import apply_lora
from tokenyard.models.lora_adapter import AdapterLimit, InvalidAdapter, load_adapter

CONFIG = ModelConfig(
    architecture="llama",
    vocab_size=64,
    hidden_size=16,
    intermediate_size=24,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=4,
    rms_norm_eps=1e-6,
    rope_theta=10000.0,
    max_position_embeddings=64,
    tie_word_embeddings=True,
)
SHAPES = {"q_proj": (16, 16), "v_proj": (16, 8), "down_proj": (24, 16)}  # (in, out)
PREFIX = "base_model.model.model.layers"


def write_adapter(folder: Path, r: int = 4, **config) -> Path:
    """A PEFT-format folder adapting q, v and down in both layers."""
    folder.mkdir(parents=True, exist_ok=True)
    settings = {"peft_type": "LORA", "r": r, "lora_alpha": 2 * r, "bias": "none"}
    settings["target_modules"] = list(SHAPES)
    (folder / "adapter_config.json").write_text(json.dumps(settings | config))
    tensors = {}
    for layer in range(2):
        for module, (i, o) in SHAPES.items():
            block = "mlp" if module == "down_proj" else "self_attn"
            key = f"{PREFIX}.{layer}.{block}.{module}"
            tensors[f"{key}.lora_A.weight"] = torch.randn(r, i)
            tensors[f"{key}.lora_B.weight"] = torch.randn(o, r)
    save_file(tensors, str(folder / "adapter_model.safetensors"))
    return folder


def test_loads_and_folds_the_scaling_into_b(tmp_path):
    folder = write_adapter(tmp_path / "a")
    adapter = load_adapter("a", str(folder), CONFIG, max_rank=8)
    assert adapter.rank == 4 and len(adapter.weights) == 6
    from safetensors.torch import load_file

    raw = load_file(str(folder / "adapter_model.safetensors"))
    b = raw[f"{PREFIX}.1.self_attn.v_proj.lora_B.weight"]
    torch.testing.assert_close(adapter.weights[(1, "v_proj")][1], b * 2.0)  # alpha / r
    rs = load_adapter("rs", str(write_adapter(tmp_path / "rs", use_rslora=True)), CONFIG, 8)
    assert not torch.equal(rs.weights[(0, "q_proj")][1], adapter.weights[(0, "q_proj")][1])


@pytest.mark.parametrize(
    ("breakage", "message"),
    [
        (lambda f: (f / "adapter_config.json").unlink(), "adapter_config.json missing"),
        (lambda f: (f / "adapter_model.safetensors").unlink(), "none of"),
        (lambda f: (f / "adapter_config.json").write_text("{r: 4"), "not valid JSON"),
        (
            lambda f: (f / "adapter_model.safetensors").write_bytes(b"garbage"),
            "cannot read adapter_model.safetensors",
        ),
    ],
)
def test_broken_files_are_named(tmp_path, breakage, message):
    folder = write_adapter(tmp_path / "a")
    breakage(folder)
    with pytest.raises(InvalidAdapter, match=message):
        load_adapter("a", str(folder), CONFIG, max_rank=8)


def test_unknown_target_module_is_named(tmp_path):
    folder = write_adapter(tmp_path / "a", target_modules=["q_proj", "lm_head"])
    with pytest.raises(InvalidAdapter, match=r"unknown target module\(s\) \['lm_head'\]"):
        load_adapter("a", str(folder), CONFIG, max_rank=8)


def test_a_tensor_of_another_shape_than_the_base_is_named(tmp_path):
    folder = write_adapter(tmp_path / "a")
    file = folder / "adapter_model.safetensors"
    from safetensors.torch import load_file

    tensors = load_file(str(file))
    tensors[f"{PREFIX}.0.mlp.down_proj.lora_A.weight"] = torch.randn(4, 32)  # base: 24 in
    save_file(tensors, str(file))
    with pytest.raises(InvalidAdapter, match=r"layer 0 down_proj: lora_A \(4, 32\)"):
        load_adapter("a", str(folder), CONFIG, max_rank=8)


def test_rank_beyond_the_limit_names_the_limit(tmp_path):
    folder = write_adapter(tmp_path / "a", r=16)
    with pytest.raises(AdapterLimit, match="beyond max_lora_rank 8") as raised:
        load_adapter("a", str(folder), CONFIG, max_rank=8)
    assert raised.value.limit == "max_lora_rank"


def test_unsupported_options_are_refused(tmp_path):
    folder = write_adapter(tmp_path / "a", use_dora=True)
    with pytest.raises(InvalidAdapter, match="use_dora is not supported"):
        load_adapter("a", str(folder), CONFIG, max_rank=8)


@pytest.fixture
def manager(tmp_path):
    with torch.device("meta"):
        model = LlamaForCausalLM(CONFIG, 64)
    model.to_empty(device="cpu")
    layers = apply_lora(model, max_loras=2, max_rank=8)
    assert model.lora_batch is not None
    m = LoRAManager(layers, model.lora_batch, CONFIG, max_loras=2, max_lora_rank=8, max_cpu_loras=3)
    for name in "abc":
        m.load(name, str(write_adapter(tmp_path / name)))
    return m


def test_slots_evict_the_least_recent_unpinned(manager):
    manager.pin("a")
    manager.pin("b")
    assert not manager.can_pin("c")  # both slots pinned by running sequences
    manager.unpin("a")
    manager.unpin("b")
    manager.pin("b")  # b in use again: a is now the least recently used
    manager.unpin("b")
    manager.pin("c")
    assert manager.slots == ["c", "b"] and manager.num_swaps == 3
    qkv = manager.layers[0]["qkv_proj"]
    assert torch.count_nonzero(qkv.a[0]) > 0 and torch.count_nonzero(qkv.b[1]) > 0


def test_step_groups_rows_by_slot(manager):
    manager.pin("a")
    manager.pin("b")
    manager.prepare_step([("b", 1), ("", 2), ("a", 3), ("b", 2)], prompt=True)
    groups = {slot: rows.tolist() for slot, rows in manager.batch.groups}
    assert groups == {1: [0, 6, 7], 0: [3, 4, 5]} and manager.batch.prompt
    manager.prepare_step([("a", 4)], prompt=False)
    assert manager.batch.groups == [(0, None)]  # every row: no index
    manager.prepare_step([("", 4)], prompt=False)
    assert manager.batch.groups == []


def test_limits_and_unknown_names(manager, tmp_path):
    with pytest.raises(AdapterLimit, match=r"max_cpu_loras \(3\) reached") as raised:
        manager.load("d", str(write_adapter(tmp_path / "d")))
    assert raised.value.limit == "max_cpu_loras"
    with pytest.raises(AdapterLimit, match="already loaded"):
        manager.load("a", str(tmp_path / "a"))
    with pytest.raises(UnknownAdapter, match="'zz' does not exist"):
        manager.check("zz")
    assert manager.unload("c", in_use=True) is False
    with pytest.raises(UnknownAdapter, match="being unloaded"):
        manager.check("c")
    manager.finish_unloads(in_use=set())
    assert [a.name for a in manager.info()] == ["a", "b"]
