"""The memory budget's arithmetic (tokenyard.engine.budget): a CPU engine's share of the host,
what its KV pool gets of it, the host's memory as /proc and cgroups state it, and the split
line the engine logs at start."""

from __future__ import annotations

from pathlib import Path

import pytest

from tokenyard.engine.budget import (
    DEFAULT_CPU_KV_BYTES,
    GIB,
    MIB,
    MemoryBudgetError,
    cgroup_memory,
    host_memory,
    kv_cache_budget,
    parse_meminfo,
    share_of,
)
from tokenyard.engine.config import EngineConfig
from tokenyard.engine.memory import MemoryReport
from tokenyard.services.launch.config import StackConfig
from tokenyard.services.launch.placement import Placement

BLOCK = 192 * 1024  # one qwen2.5-0.5b block of 16 tokens in bf16


def budget(config: EngineConfig, *, weights: int, buffers: int, free: int, total: int) -> int:
    return kv_cache_budget(
        config, buffers_bytes=buffers, own=weights, free=free, total=total, block_nbytes=BLOCK
    )


def test_a_cpu_share_less_weights_and_buffers_is_the_pool():
    # 24 GiB host, half of it ours; 1.1 GiB of weights, 50 MiB of buffers, 18 GiB free.
    config = EngineConfig(cpu_memory_utilization=0.5)
    got = budget(config, weights=1100 * MIB, buffers=50 * MIB, free=18 * GIB, total=24 * GIB)
    assert got == 12 * GIB - 1100 * MIB - 50 * MIB


def test_a_cpu_pool_is_never_more_than_is_free_now():
    # Other processes hold most of the host: our 0.9 share would not fit; what is free does.
    config = EngineConfig(cpu_memory_utilization=0.9)
    got = budget(config, weights=GIB, buffers=50 * MIB, free=3 * GIB, total=24 * GIB)
    assert got == 3 * GIB - 50 * MIB


def test_tensor_parallel_cpu_ranks_split_the_share_of_their_one_host():
    config = EngineConfig(cpu_memory_utilization=0.5)
    config.tensor_parallel_size = 2  # set after the checks, which want a divisible model
    assert share_of(config, 24 * GIB) == 6 * GIB
    got = budget(config, weights=GIB, buffers=0, free=20 * GIB, total=24 * GIB)
    assert got == 5 * GIB


def test_an_explicit_pool_overrides_the_budget():
    config = EngineConfig(cpu_memory_utilization=0.01, kv_cache_bytes=64 * MIB)
    assert budget(config, weights=GIB, buffers=0, free=GIB, total=24 * GIB) == 64 * MIB


def test_without_a_budget_a_cpu_pool_is_512_mib_or_what_is_free():
    config = EngineConfig()
    assert share_of(config, 24 * GIB) is None
    roomy = budget(config, weights=GIB, buffers=50 * MIB, free=10 * GIB, total=24 * GIB)
    assert roomy == DEFAULT_CPU_KV_BYTES
    tight = budget(config, weights=GIB, buffers=50 * MIB, free=300 * MIB, total=24 * GIB)
    assert tight == 250 * MIB


def test_a_model_that_does_not_fit_its_budget_is_refused_with_the_figures():
    config = EngineConfig(cpu_memory_utilization=0.05)  # 1.2 GiB of 24
    with pytest.raises(MemoryBudgetError) as refused:
        budget(config, weights=1150 * MIB, buffers=100 * MIB, free=18 * GIB, total=24 * GIB)
    message = str(refused.value)
    assert "does not fit its memory budget on this host" in message
    assert "cpu_memory_utilization 0.05 of 24.0 GiB is 1228.8 MiB" in message
    assert "weights 1150.0 MiB, activations and tables 100.0 MiB" in message
    assert "no room left for 2 KV blocks (0.38 MiB)" in message
    assert "Raise cpu_memory_utilization" in message


def test_a_budget_of_fewer_than_two_blocks_is_refused():
    config = EngineConfig(cpu_memory_utilization=0.5)
    total = 2 * (GIB + BLOCK)  # a share of GIB + BLOCK
    with pytest.raises(MemoryBudgetError):  # it leaves a byte short of two blocks
        budget(config, weights=GIB - BLOCK + 1, buffers=0, free=total, total=total)
    assert budget(config, weights=GIB - BLOCK, buffers=0, free=total, total=total) == 2 * BLOCK


def test_no_free_memory_for_the_default_pool_is_refused():
    with pytest.raises(MemoryBudgetError, match="no room for a KV pool on this host"):
        budget(EngineConfig(), weights=GIB, buffers=50 * MIB, free=50 * MIB, total=24 * GIB)


def test_a_bad_cpu_utilization_fails_when_the_config_is_made():
    for bad in (0.0, 1.5, -0.1):
        with pytest.raises(ValueError, match="cpu_memory_utilization must be in"):
            EngineConfig(cpu_memory_utilization=bad)


MEMINFO = """MemTotal:       24683772 kB
MemFree:         1062412 kB
MemAvailable:   18920232 kB
Buffers:          395312 kB
"""


def test_meminfo_gives_total_and_available_bytes():
    assert parse_meminfo(MEMINFO) == (24683772 * 1024, 18920232 * 1024)


def test_the_host_as_this_machine_states_it():
    host = host_memory()
    assert 0 < host.free <= host.total


def write(folder: Path, **files: str) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    for name, text in files.items():
        (folder / name.replace("_", ".", 1)).write_text(text)


def test_cgroup_v2_takes_the_tightest_limit_of_the_process_and_its_ancestors(tmp_path):
    # a pod limited to 4 GiB, its container unlimited ("max") below it
    write(
        tmp_path / "kubepods" / "pod1",
        memory_max=str(4 * GIB),
        memory_current=str(3 * GIB),
        memory_stat=f"anon 1\ninactive_file {GIB}\n",
    )
    write(tmp_path / "kubepods" / "pod1" / "ctr", memory_max="max", memory_current="5")
    write(tmp_path, memory_current="0")  # the root: no memory.max at all
    limit, used = cgroup_memory("0::/kubepods/pod1/ctr\n", tmp_path)
    assert (limit, used) == (4 * GIB, 2 * GIB)  # usage less inactive file pages


def test_cgroup_v1_no_limit_is_none(tmp_path):
    unlimited = "9223372036854771712"
    write(tmp_path / "memory" / "job", memory_limit_in_bytes=unlimited, memory_usage_in_bytes="9")
    write(tmp_path / "memory", memory_limit_in_bytes=unlimited, memory_usage_in_bytes="9")
    text = "4:memory:/job\n3:cpuset:/\n0::/\n"
    assert cgroup_memory(text, tmp_path) is None
    write(
        tmp_path / "memory" / "job",
        memory_limit_in_bytes=str(2 * GIB),
        memory_usage_in_bytes=str(GIB),
        memory_stat=f"cache 5\ntotal_inactive_file {MIB}\n",
    )
    assert cgroup_memory(text, tmp_path) == (2 * GIB, GIB - MIB)


def test_the_split_line_names_every_tenant_and_the_budget():
    report = MemoryReport(
        weights_bytes=1100 * MIB,
        kv_cache_bytes=1000 * BLOCK,
        buffers_bytes=50 * MIB,
        num_blocks=1000,
        block_nbytes=BLOCK,
        block_size=16,
        free_bytes=8 * GIB,
        budget_bytes=12 * GIB,
        utilization="cpu_memory_utilization 0.5",
    )
    line = report.describe()
    assert line.startswith("weights 1100.0 MiB, KV cache 187.5 MiB = 1000 blocks / 16000 tokens")
    assert "activations and tables 50.0 MiB" in line
    assert "free left 8192.0 MiB" in line
    assert line.endswith("(budget 12288.0 MiB: cpu_memory_utilization 0.5)")
    bare = MemoryReport(1, 1, 0, 1, 1).describe()
    assert "budget" not in bare and "free left" not in bare


def test_up_hands_each_cpu_worker_its_part_of_the_hosts_budget():
    split = Placement(StackConfig(prefill=2, decode=1, cpu_memory_utilization=0.6))
    assert split.device_env(1) == {"TOKENYARD_WORKER_CPU_MEMORY_UTILIZATION": "0.2"}
    # a worker added past the planned three shares the host with them
    assert split.device_env(4) == {"TOKENYARD_WORKER_CPU_MEMORY_UTILIZATION": "0.15"}
    one = Placement(StackConfig(aggregated=True, cpu_memory_utilization=0.6))
    assert one.device_env(1) == {"TOKENYARD_WORKER_CPU_MEMORY_UTILIZATION": "0.6"}
    assert Placement(StackConfig()).device_env(1) == {}
