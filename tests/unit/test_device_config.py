"""The engine's device settings: checked when made, and the KV budget a GPU leaves."""

from __future__ import annotations

import pytest
import torch

from tokenyard.engine.budget import DEFAULT_CPU_KV_BYTES, MemoryBudgetError, kv_cache_budget
from tokenyard.engine.config import EngineConfig

GIB = 1024**3


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"device": "gpu"}, "device must be 'cpu', 'cuda' or 'cuda:<index>'"),
        ({"device": "cpu:1"}, "device must be"),
        ({"device": "cuda:x"}, "device must be"),
        ({"gpu_memory_utilization": 0.0}, "gpu_memory_utilization must be in"),
        ({"gpu_memory_utilization": 1.5}, "gpu_memory_utilization must be in"),
        ({"tensor_parallel_size": 0}, "tensor_parallel_size must be at least 1"),
        ({"dtype": "bfloat16", "kv_cache_dtype": "float16"}, "kv_cache_dtype 'float16' with"),
        ({"kv_cache_dtype": "int8"}, "the KV pool takes the compute dtype"),
    ],
)
def test_bad_device_settings_fail_at_once(kwargs, message):
    with pytest.raises(ValueError, match=message):
        EngineConfig(**kwargs)


def test_the_kv_pool_dtype_follows_the_compute_dtype():
    # fp32 compute on a CPU keeps its KV pool in fp16 unless told otherwise
    assert EngineConfig().kv_cache_dtype == "float16"
    assert EngineConfig(kv_cache_dtype="float32").kv_cache_dtype == "float32"
    assert EngineConfig(dtype="bfloat16").kv_cache_dtype == "bfloat16"
    assert EngineConfig(dtype="float16").kv_cache_dtype == "float16"


@pytest.mark.parametrize("name", ["fp8", "fp8_e4m3", "float8_e4m3fn"])
def test_an_fp8_pool_is_asked_for_by_vllms_names_or_torchs(name):
    assert EngineConfig(dtype="bfloat16", kv_cache_dtype=name).kv_cache_dtype == "float8_e4m3fn"
    assert EngineConfig(kv_cache_dtype=name).kv_cache_dtype == "float8_e4m3fn"  # beside fp32
    with pytest.raises(ValueError, match="fp8 \\(float8_e4m3fn\\) beside bfloat16 or float32"):
        EngineConfig(dtype="float16", kv_cache_dtype=name)


@pytest.mark.skipif(
    torch.cuda.is_available(), reason="checks the message on a machine without CUDA"
)
def test_cuda_without_a_gpu_says_so():
    with pytest.raises(ValueError, match="CUDA is not available"):
        EngineConfig(device="cuda")


def test_cpu_budget_is_the_setting_or_the_default():
    host = {"buffers_bytes": 0, "own": 0, "free": 10 * GIB, "total": 16 * GIB}
    assert kv_cache_budget(EngineConfig(), **host) == DEFAULT_CPU_KV_BYTES
    assert kv_cache_budget(EngineConfig(kv_cache_bytes=123456), **host) == 123456


def gpu_config(**kwargs) -> EngineConfig:
    """A CUDA config on a machine without one: built on the CPU, then pointed at cuda."""
    config = EngineConfig(**kwargs)
    config.device = "cuda"
    return config


def test_gpu_budget_is_our_share_less_weights_and_buffers():
    # 80 GiB device, 0.9 of it ours; 6 GiB of our weights, 1 GiB of buffers, 74 GiB free.
    device = {"buffers_bytes": GIB, "own": 6 * GIB, "free": 74 * GIB, "total": 80 * GIB}
    budget = kv_cache_budget(gpu_config(gpu_memory_utilization=0.9), **device)
    assert budget == int(80 * GIB * 0.9) - 6 * GIB - GIB
    # An explicit size wins over the share.
    assert kv_cache_budget(gpu_config(kv_cache_bytes=2 * GIB), **device) == 2 * GIB


def test_gpu_budget_never_exceeds_what_is_free():
    # Another process holds 50 GiB: our 0.9 share would not fit; what is free does.
    device = {"buffers_bytes": GIB, "own": 6 * GIB, "free": 24 * GIB, "total": 80 * GIB}
    assert kv_cache_budget(gpu_config(), **device) == 23 * GIB


def test_a_full_gpu_is_a_clear_error():
    device = {"buffers_bytes": GIB, "own": 6 * GIB, "free": GIB, "total": 80 * GIB}
    with pytest.raises(MemoryBudgetError, match="does not fit its memory budget on cuda"):
        kv_cache_budget(gpu_config(gpu_memory_utilization=0.5), **device)
