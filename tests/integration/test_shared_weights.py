"""Weights shared between engines through one read-only file (tokenyard.engine.shared_weights):
two engines in two processes map the same file and answer exactly as a private engine does;
a dead builder's leftovers, a full directory and the stack's clean-up."""

from __future__ import annotations

import multiprocessing as mp
from dataclasses import asdict
from pathlib import Path

import pytest
import torch
from torch import nn

from tokenyard.engine import shared_weights
from tokenyard.engine.shared_weights import SUFFIX, share_weights
from tokenyard.services.launch.stack import LocalStack, StackConfig

PROMPT = [{"role": "user", "content": "Name three rivers of Europe."}]


def _greedy(engine) -> list[dict]:
    from tokenyard.engine.sampling_params import SamplingParams

    engine.add_request("r", PROMPT, SamplingParams(temperature=0.0, max_tokens=12, logprobs=3))
    out = []
    while engine.has_unfinished():
        for o in engine.step():
            out.extend(asdict(lp) for lp in o.logprobs or [])
    return out


def _engine_in_a_process(directory: str, results: mp.Queue) -> None:
    from tokenyard.engine.config import EngineConfig
    from tokenyard.engine.llm_engine import LLMEngine

    engine = LLMEngine(
        EngineConfig(
            dtype="float32",
            quantization="int4",
            kv_cache_bytes=32 * 1024**2,
            shared_weights_dir=directory,
        )
    )
    maps = Path("/proc/self/maps").read_text()
    mapped = sorted({line.split()[-1] for line in maps.splitlines() if directory in line})
    results.put((mapped, _greedy(engine)))


@pytest.mark.slow
def test_two_engine_processes_map_one_file_and_answer_as_a_private_engine(tmp_path, make_engine):
    directory = tmp_path / "weights"
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    procs = [
        ctx.Process(target=_engine_in_a_process, args=(str(directory), results)) for _ in range(2)
    ]
    for p in procs:
        p.start()
    try:
        (maps_a, out_a), (maps_b, out_b) = results.get(timeout=600), results.get(timeout=600)
    finally:
        for p in procs:
            p.join(60)
            p.kill()
    files = sorted(directory.glob(f"*{SUFFIX}"))
    assert len(files) == 1, files  # built once, by whichever engine came first
    assert maps_a == maps_b == [str(files[0])]
    assert not list(directory.glob("*.tmp"))
    # Shared weights are never packed (quantize.prepack), so the private engine compares
    # with its dense copy left plain: on an AVX2 CPU a packed fp32 copy runs oneDNN's
    # matmul instead of MKL's, which orders its sums otherwise.
    private = make_engine(
        dtype="float32", quantization="int4", kv_cache_bytes=32 * 1024**2, prepack_weights=False
    )
    expected = _greedy(private)
    assert len(expected) == 12
    assert out_a == expected and out_b == expected  # token ids and logprobs, exactly


class Tiny(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(3)
        self.embed = nn.Embedding(64, 32)
        self.embed.weight.data = torch.randn(64, 32, generator=g)
        self.proj = nn.Linear(32, 64, bias=False)
        self.proj.weight = self.embed.weight  # tied, as SmolLM2's output projection is
        self.register_buffer("packed", torch.arange(100, dtype=torch.uint8))
        self.requires_grad_(False)


def test_tied_weights_stay_one_tensor_and_a_second_model_reuses_the_file(tmp_path):
    a, b = Tiny(), Tiny()
    x = torch.tensor([1, 5, 9])
    expected = a.proj(a.embed(x))
    path = share_weights(a, tmp_path)
    assert path is not None and share_weights(b, tmp_path) == path
    assert a.embed.weight.data_ptr() == a.proj.weight.data_ptr()
    assert torch.equal(a.proj(a.embed(x)), expected)
    assert torch.equal(b.packed, torch.arange(100, dtype=torch.uint8))
    assert len(list(tmp_path.glob(f"*{SUFFIX}"))) == 1


def test_other_weights_get_a_file_of_their_own(tmp_path):
    a, b = Tiny(), Tiny()
    b.packed[0] = 7
    assert share_weights(a, tmp_path) != share_weights(b, tmp_path)


def test_a_dead_builders_temporary_file_is_removed_and_never_mapped(tmp_path):
    model = Tiny()
    key = shared_weights._content_key(shared_weights._layout(model)[0])
    stale = tmp_path / f"{key}{SUFFIX}.4242.tmp"
    stale.write_bytes(b"half written")
    path = share_weights(model, tmp_path)
    assert path == tmp_path / f"{key}{SUFFIX}" and not stale.exists()


def test_a_directory_without_room_leaves_the_weights_private(tmp_path, monkeypatch):
    monkeypatch.setattr(shared_weights, "HEADROOM_BYTES", 1 << 60)
    model = Tiny()
    before = model.embed.weight.data_ptr()
    assert share_weights(model, tmp_path) is None
    assert model.embed.weight.data_ptr() == before
    assert not list(tmp_path.glob(f"*{SUFFIX}")) and not list(tmp_path.glob("*.tmp"))


def test_the_stack_gives_workers_a_directory_and_removes_it_on_stop(launch_stack):
    config = StackConfig(
        engine="fake", decode=1, kvcache=False, facilities=False, telemetry=False, gateway=False
    )
    assert LocalStack(config).shared_weights_dir is None  # nothing made before start()
    with launch_stack(config) as stack:
        directory = stack.shared_weights_dir
        assert directory is not None and directory.is_dir()
        env = Path(f"/proc/{stack.workers[0].pid}/environ").read_bytes().split(b"\0")
        assert f"TOKENYARD_WORKER_SHARED_WEIGHTS_DIR={directory}".encode() in env
        (directory / f"x{SUFFIX}").write_bytes(b"weights")
    assert not directory.exists()


def test_one_worker_keeps_its_weights_private(launch_stack):
    """Nobody to share with, and private weights are packed for oneDNN (quantize.prepack)."""
    config = StackConfig(
        engine="fake", aggregated=True, kvcache=False, facilities=False, telemetry=False,
        gateway=False,
    )  # fmt: skip
    with launch_stack(config) as stack:
        assert stack.shared_weights_dir is None
        env = Path(f"/proc/{stack.workers[0].pid}/environ").read_bytes().split(b"\0")
        assert not any(e.startswith(b"TOKENYARD_WORKER_SHARED_WEIGHTS_DIR=") for e in env)
