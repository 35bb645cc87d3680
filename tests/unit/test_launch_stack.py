"""The local stack refuses to start without a part it was asked for, instead of leaving it out."""

from __future__ import annotations

from pathlib import Path

import pytest

from tokenyard.services.launch import stack as launch
from tokenyard.services.launch.group import require_module
from tokenyard.services.launch.placement import gpu_placement
from tokenyard.services.launch.stack import LocalStack, StackConfig, StackError


def test_a_service_module_that_exists_is_accepted():
    for service in ("router", "prefill", "decode", "gateway", "kvcache", "facilities"):
        require_module(f"tokenyard.services.{service}")


@pytest.mark.parametrize("module", ["tokenyard.services.nope", "tokenyard.services.launch"])
def test_a_missing_service_module_is_an_error(module):
    # launch exists but has no __main__: it cannot run as a service either.
    with pytest.raises(StackError, match=module):
        require_module(module)


def test_spawning_a_missing_service_starts_nothing(tmp_path: Path):
    stack = LocalStack(StackConfig(log_dir=tmp_path))
    with pytest.raises(StackError, match="tokenyard.services.nope is not installed"):
        stack._spawn("nope", "tokenyard.services.nope", {})
    assert stack.procs == []


def test_facilities_without_an_inventory_fail_before_anything_starts(monkeypatch, tmp_path):
    missing = tmp_path / "inventory.yaml"
    monkeypatch.setenv("TOKENYARD_FACILITIES_INVENTORY_PATH", str(missing))
    stack = LocalStack(StackConfig(engine="fake", log_dir=tmp_path))
    with pytest.raises(StackError, match="--no-facilities") as info:
        stack.start()
    assert str(missing) in str(info.value)
    assert stack.procs == [] and stack.nats_url == ""


def test_the_operators_inventory_wins_over_the_example(monkeypatch, tmp_path):
    own = tmp_path / "site.yaml"
    own.write_text("racks: []\n")
    monkeypatch.setenv("TOKENYARD_FACILITIES_INVENTORY_PATH", str(own))
    assert launch.facilities_inventory() == own
    monkeypatch.delenv("TOKENYARD_FACILITIES_INVENTORY_PATH")
    assert launch.facilities_inventory().name == "inventory.example.yaml"


def test_gpu_placement_spreads_workers_and_splits_each_gpus_share():
    # 3 workers on 2 GPUs: GPU 0 holds workers 0 and 2, GPU 1 holds worker 1.
    placed = [gpu_placement(i, 3, 2, 0.9) for i in range(3)]
    assert placed == [("cuda:0", 0.45), ("cuda:1", 0.9), ("cuda:0", 0.45)]
    with pytest.raises(StackError, match="no CUDA GPU is visible"):
        gpu_placement(0, 1, 0, 0.9)


def test_an_external_nats_password_nats_server_would_misread_stops_the_start(monkeypatch, tmp_path):
    monkeypatch.setenv("TOKENYARD_NATS_OPERATOR_PASSWORD", "12345678901234567")
    config = StackConfig(nats_url="nats://127.0.0.1:4222", facilities=False, log_dir=tmp_path)
    stack = LocalStack(config)
    with pytest.raises(StackError, match="TOKENYARD_NATS_OPERATOR_PASSWORD"):
        stack.start()
    assert stack.procs == []


def test_gpu_placement_gives_a_tensor_parallel_worker_consecutive_gpus():
    # tp=2 on 4 GPUs: workers take GPUs 0-1 and 2-3 (their rank 0 is named), then share.
    placed = [gpu_placement(i, 3, 4, 0.9, tp=2) for i in range(3)]
    assert placed == [("cuda:0", 0.45), ("cuda:2", 0.9), ("cuda:0", 0.45)]
    with pytest.raises(StackError, match="--pipeline-parallel-size 4 needs 4 GPUs; 2 visible"):
        gpu_placement(0, 1, 2, 0.9, tp=4)


def test_a_failed_stack_keeps_its_temporary_logs_and_nothing_else():
    stack = LocalStack(StackConfig())
    tmp = stack.log_dir.parent
    (stack.log_dir / "decode-1.log").write_text("ModelLoadError: why\n")
    (tmp / "jetstream").mkdir()
    (tmp / "nats.conf").write_text("")
    stack.stop(keep_logs=True)
    assert (stack.log_dir / "decode-1.log").read_text() == "ModelLoadError: why\n"
    assert sorted(p.name for p in tmp.iterdir()) == ["logs"]
    stack.stop()  # a normal stop leaves nothing
    assert not tmp.exists()
