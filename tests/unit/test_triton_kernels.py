"""Every Triton kernel against its pure-torch twin, run by Triton's interpreter on the CPU
(TRITON_INTERPRET=1), at small shapes with odd sizes; and each twin against the torch code
the engine's CPU path runs, so the kernels compute what the model computes.

With TOKENYARD_TEST_DEVICE=cuda (scripts/gpu_check.sh) the kernels run compiled on the GPU
instead, in bfloat16 too, against the same twins."""

from __future__ import annotations

import os

import pytest
import torch

DEVICE = os.environ.get("TOKENYARD_TEST_DEVICE", "cpu")
if DEVICE == "cpu":
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported
pytest.importorskip("triton")

from tokenyard.kernels.triton import activation, decode_attention, kv_write, norm, rope  # noqa: E402
from tokenyard.kernels.triton import prefill_attention as prefill  # noqa: E402
from tokenyard.models import fused  # noqa: E402
from tokenyard.models.attention import AttnMetadata, PrefillSpan, paged_attention  # noqa: E402

# NOTE: float16, not bfloat16: the interpreter runs on numpy, which has no bfloat16
# (scripts/gpu_check.sh covers bfloat16 on a GPU).
DTYPES = [torch.float32, torch.float16] + ([torch.bfloat16] if DEVICE != "cpu" else [])
# On a GPU, fp32 matmuls inside tl.dot may run in TF32.
TOL = {
    torch.float32: 1e-5 if DEVICE == "cpu" else 2e-3,
    torch.float16: 1e-2,
    torch.bfloat16: 3e-2,
}


def dev(t: torch.Tensor) -> torch.Tensor:
    """A copy on the device the kernels run on (the twins run on the CPU)."""
    return t.clone().to(DEVICE)


def close(a: torch.Tensor, b: torch.Tensor, dtype: torch.dtype) -> None:
    torch.testing.assert_close(a.cpu().float(), b.cpu().float(), atol=TOL[dtype], rtol=TOL[dtype])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("with_residual", [True, False])
def test_add_rms_norm(dtype, with_residual):
    g = torch.Generator().manual_seed(1)
    x = torch.randn(7, 37, generator=g).to(dtype)
    res = torch.randn(7, 37, generator=g).to(dtype) if with_residual else None
    w = torch.randn(37, generator=g).to(dtype)
    want, want_sum = norm.add_rms_norm_torch(x, res, w, 1e-6)
    got, got_sum = norm.add_rms_norm(dev(x), None if res is None else dev(res), dev(w), 1e-6)
    close(got, want, dtype)
    close(got_sum, want_sum, dtype)


def test_add_rms_norm_twin_is_the_models():
    x, res, w = torch.randn(5, 33), torch.randn(5, 33), torch.randn(33)
    want, want_sum = fused.add_rms_norm(x.clone(), res.clone(), w, 1e-5)
    got, got_sum = norm.add_rms_norm_torch(x, res, w, 1e-5)
    close(got, want, torch.float32)
    close(got_sum, want_sum, torch.float32)


@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_and_mul(dtype):
    x = torch.randn(5, 2 * 45, generator=torch.Generator().manual_seed(2)).to(dtype)
    close(activation.silu_and_mul(dev(x), block=16), activation.silu_and_mul_torch(x), dtype)
    close(activation.silu_and_mul_torch(x), fused.silu_and_mul(x), dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_rotary_in_place(dtype):
    g = torch.Generator().manual_seed(3)
    head_dim, num_q, num_kv = 10, 3, 1
    qkv = torch.randn(6, (num_q + 2 * num_kv) * head_dim, generator=g).to(dtype)
    positions = torch.tensor([0, 5, 2, 8, 8, 1])
    cos, sin = torch.randn(9, head_dim, generator=g), torch.randn(9, head_dim, generator=g)
    want, got, model = qkv.clone(), dev(qkv), qkv.clone()
    rope.rotary_torch_(want, positions, cos, sin, num_q + num_kv, head_dim)
    rope.rotary_(got, dev(positions), dev(cos), dev(sin), num_q + num_kv, head_dim)
    got = got.cpu()
    fused.rotary_(model, positions, cos, sin, num_q + num_kv, head_dim)
    close(got, want, dtype)
    close(model, want, dtype)
    assert torch.equal(got[:, (num_q + num_kv) * head_dim :], qkv[:, (num_q + num_kv) * head_dim :])


def pool(dtype: torch.dtype, block_size: int = 16, num_kv_heads: int = 2, head_dim: int = 12):
    """A 3-layer pool; kernels get its layer 1 (a strided view, as the engine passes it)."""
    g = torch.Generator().manual_seed(4)
    full = torch.randn(11, 3, 2, block_size, num_kv_heads, head_dim, generator=g).to(dtype)
    return full


def dev_layer(full: torch.Tensor) -> torch.Tensor:
    """Layer 1 of a copy of the whole pool on the kernels' device."""
    return dev(full)[:, 1]


@pytest.mark.parametrize("dtype", DTYPES)
def test_write_kv(dtype):
    full = pool(dtype, block_size=4)
    layer = full[:, 1]
    k, v = torch.randn(5, 2, 12).to(dtype), torch.randn(5, 2, 12).to(dtype)
    blocks, offsets = torch.tensor([3, 3, 0, 10, 5]), torch.tensor([0, 3, 1, 2, 3])
    want = layer.clone()
    kv_write.write_kv_torch(k, v, want, blocks, offsets)
    on_device = dev_layer(full)
    kv_write.write_kv(dev(k), dev(v), on_device, dev(blocks), dev(offsets))
    assert torch.equal(on_device.cpu(), want)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("block_size", [4, 16])
def test_decode_attention_gqa(dtype, block_size):
    full = pool(dtype, block_size=block_size, num_kv_heads=2, head_dim=12)
    layer = full[:, 1]
    q = torch.randn(3, 6, 12, generator=torch.Generator().manual_seed(5)).to(dtype)
    tables = torch.tensor([[1, 4, 6], [2, 0, 0], [7, 3, 9]], dtype=torch.int32)
    lens = torch.tensor([block_size * 2 + 1, 3, block_size * 3], dtype=torch.int32)
    want = decode_attention.decode_attention_torch(q, layer, tables, lens, 12**-0.5)
    got = decode_attention.decode_attention(
        dev(q), dev_layer(full), dev(tables), dev(lens), 12**-0.5
    )
    close(got, want, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_prefill_attention_over_a_cached_prefix(dtype):
    full = pool(dtype, block_size=16, num_kv_heads=2, head_dim=24)
    layer = full[:, 1]
    # Chunk 0: 3 rows after a 32-token cached prefix; chunk 1: a fresh 20-token prompt;
    # chunk 2: one row at the end of a 17-token context.
    q = torch.randn(24, 6, 24, generator=torch.Generator().manual_seed(6)).to(dtype)
    tables = torch.tensor([[1, 4, 6], [2, 5, 0], [7, 3, 8]], dtype=torch.int32)
    starts, ntok, lens = (
        torch.tensor([0, 3, 23]),
        torch.tensor([3, 20, 1]),
        torch.tensor([35, 20, 17]),
    )
    want, got = torch.zeros_like(q), torch.zeros_like(q)
    prefill.prefill_attention_torch(q, layer, tables, starts, ntok, lens, 24**-0.5, want)
    got = dev(got)
    prefill.prefill_attention(
        dev(q), dev_layer(full), dev(tables), dev(starts), dev(ntok), dev(lens), 24**-0.5, got
    )
    close(got, want, dtype)


def test_attention_twins_are_the_models():
    """Both attention twins agree with tokenyard.models.attention.paged_attention."""
    layer = pool(torch.float32, block_size=16, num_kv_heads=2, head_dim=12)[:, 1]
    g = torch.Generator().manual_seed(7)
    # Row 0 decodes (context 20 in blocks 1, 4); rows 1..5 are a chunk at positions 11..15.
    q, k, v = (torch.randn(6, h, 12, generator=g) for h in (6, 2, 2))
    meta = AttnMetadata(
        slot_blocks=torch.tensor([4, 2, 2, 2, 2, 2]),
        slot_offsets=torch.tensor([3, 11, 12, 13, 14, 15]),
        num_decode=1,
        decode_block_tables=torch.tensor([[1, 4]]),
        decode_context_lens=torch.tensor([20]),
        prefills=[PrefillSpan(1, 5, 16, torch.tensor([2]))],
    )
    model_layer = layer.clone()
    want = paged_attention(q, k, v, model_layer, meta, 12**-0.5)
    kv_write.write_kv_torch(k, v, layer, meta.slot_blocks, meta.slot_offsets)
    assert torch.equal(layer, model_layer)
    got = torch.zeros_like(q)
    got[:1] = decode_attention.decode_attention_torch(
        q[:1], layer, meta.decode_block_tables, meta.decode_context_lens, 12**-0.5
    )
    tables = torch.tensor([[2]], dtype=torch.int32)
    prefill.prefill_attention_torch(
        q, layer, tables, torch.tensor([1]), torch.tensor([5]), torch.tensor([16]), 12**-0.5, got
    )
    close(got, want, torch.float32)
