"""Paged attention in plain torch (the CPU path, and the reference for the Triton kernel).

A step's tokens are flattened into one batch of T rows, decode rows first:

    rows:  [d0 d1 ... d(B-1) | p0 chunk ......... | p1 chunk .... ]
            one token per      a prefill chunk per sequence,
            decoding sequence  any offset into its prompt

Every row's key and value are written into the pool at its slot; then decoding rows attend
over their block tables in one batched call, and each prefill chunk attends causally over
its context (cached prefix + earlier chunks + itself).

On a CPU the cache write and the attention run in C++ kernels (`tokenyard.kernels.cpu`)
that walk the block tables in place. There a prefill chunk's rows attend as rows of their
own, each over its context up to its own position (`AttnMetadata.kernel_rows`), in the same
call as the decoding rows: no gathered keys, no mask, no [n, context] score matrix in
memory. Prompt chunks and other prefill spans of `SDPA_MIN_ROWS` rows or more go instead
to the span kernel `kernel_choice.choose_span_attention` picks for the pool and the model:
on CPUs with AMX torch's fused attention (`F.scaled_dot_product_attention`), whose tiles
run on AMX; on CPUs with AVX512-BF16 and no AMX our own `span_attention`, which scores a
tile of rows against 16 keys per instruction. The torch code here is the kernels' twin,
used where they cannot be built and compared against them in the tests.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property

import torch
import torch.nn.functional as F

from tokenyard.kernels import cpu as cpu_kernels
from tokenyard.models import kernel_choice
from tokenyard.models.kernel_choice import SDPA, SDPA_MIN_ROWS


@dataclass
class PrefillSpan:
    start: int  # first row of this chunk in the step's flattened batch
    num_tokens: int  # rows in this chunk
    context_len: int  # tokens attended to: computed before this chunk + the chunk itself
    block_ids: torch.Tensor  # [ceil(context_len / block_size)] physical blocks, in order
    prompt: bool = False  # prompt tokens (not a draft's tokens to verify)


@dataclass
class CpuSplit:
    """A CPU step's attention (AttnMetadata.cpu_split): the rows `rows` (None: every row of
    the step; empty: none) attend in our kernel over `tables` and `lens`, and `spans` in
    `span_kernel` (kernel_choice.SDPA or SPAN_ATTENTION; None where there are none)."""

    rows: torch.Tensor | None
    tables: torch.Tensor
    lens: torch.Tensor
    spans: list[PrefillSpan]
    span_kernel: str | None = None


@dataclass
class AttnMetadata:
    slot_blocks: torch.Tensor  # [T] block id that each row's K/V is written into
    slot_offsets: torch.Tensor  # [T] offset inside that block
    num_decode: int = 0
    decode_block_tables: torch.Tensor | None = None  # [B, max_blocks], padded with block 0
    decode_context_lens: torch.Tensor | None = None  # [B] tokens each decode row attends to
    prefills: list[PrefillSpan] = field(default_factory=list)
    block_size: int = 16
    # The step carries prompt tokens (any span's): every quantized layer with a dense copy
    # then uses it, whatever the row count (LinearKernel.dense_step).
    prompt_step: bool = False
    _cpu_splits: dict[tuple[torch.dtype, tuple[int, int, int]], CpuSplit] = field(
        default_factory=dict, repr=False
    )

    @cached_property
    def decode_mask(self) -> torch.Tensor:
        """[B, 1, 1, max_blocks * block_size] bool (True = attend), for the torch path."""
        assert self.decode_block_tables is not None and self.decode_context_lens is not None
        width = self.decode_block_tables.shape[1] * self.block_size
        return (torch.arange(width)[None, :] < self.decode_context_lens[:, None])[:, None, None, :]

    @cached_property
    def kernel_rows(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Every row as one query over its own context, for the CPU kernel: block tables
        [T, max_blocks] (padded with block 0) and context lengths [T]. A prefill chunk's rows
        share their span's table and see keys up to their own positions (causal)."""
        return self.rows_of(self.prefills)

    def cpu_split(self, pool_dtype: torch.dtype, heads: tuple[int, int, int]) -> CpuSplit:
        """How this step's rows attend on a CPU with the kernels built beside a pool of
        `pool_dtype`, for a model of `heads` (query heads, KV heads, head_dim), worked out once
        per step (every layer splits the same way)."""
        key = (pool_dtype, heads)  # the split depends on the model's heads too
        split = self._cpu_splits.get(key)
        if split is None:
            split = self._cpu_splits[key] = _cpu_split(self, pool_dtype, heads)
        return split

    def rows_of(self, spans: list[PrefillSpan]) -> tuple[torch.Tensor, torch.Tensor]:
        """`kernel_rows` for the decode rows and these prefill spans only, in that order."""
        parts = [] if self.decode_block_tables is None else [self.decode_block_tables]
        lens = [] if self.decode_context_lens is None else [self.decode_context_lens]
        for span in spans:
            parts.append(span.block_ids.expand(span.num_tokens, -1))
            first = span.context_len - span.num_tokens + 1
            lens.append(torch.arange(first, span.context_len + 1))
        width = max(t.shape[1] for t in parts)
        tables = torch.cat([torch.nn.functional.pad(t, (0, width - t.shape[1])) for t in parts])
        return tables, torch.cat(lens)


def _rows(t: torch.Tensor) -> torch.Tensor:
    """`t` [T, heads, head_dim] as the CPU kernels take it: each row's heads side by side,
    the rows any stride apart. q, k and v split from the fused projection already are; a
    copy of each, 90 calls a step, cost a few percent of a decode step (docs/benchmarks.md)."""
    if t.stride(2) == 1 and t.stride(1) == t.shape[2] and t.stride(0) >= t.shape[1] * t.shape[2]:
        return t
    return t.contiguous()


def paged_attention(
    q: torch.Tensor,  # [T, num_heads, head_dim], already rotated
    k: torch.Tensor,  # [T, num_kv_heads, head_dim], already rotated
    v: torch.Tensor,  # [T, num_kv_heads, head_dim]
    kv_layer: torch.Tensor,  # [num_blocks, 2, block_size, num_kv_heads, head_dim] (a view)
    meta: AttnMetadata,
    scale: float,
) -> torch.Tensor:  # [T, num_heads, head_dim]
    if q.is_cuda:
        return _paged_attention_triton(q, k, v, kv_layer, meta, scale)
    kernels = cpu_kernels.ops_for(q)
    if kernels is not None:
        kernels.write_kv(_rows(k), _rows(v), kv_layer, meta.slot_blocks, meta.slot_offsets)
        split = meta.cpu_split(kv_layer.dtype, (q.shape[1], kv_layer.shape[-2], kv_layer.shape[-1]))
        if not split.spans:
            return kernels.decode_attention(_rows(q), kv_layer, split.tables, split.lens, scale)
        return _attend_fused(kernels, q, k, v, kv_layer, split, scale)
    # [T, 2, H_kv, D]; a pool narrower than the activations (fp16 or fp8) rounds them here
    kv_layer[meta.slot_blocks, :, meta.slot_offsets] = to_pool(
        torch.stack((k, v), dim=1), kv_layer.dtype
    )
    out = torch.empty_like(q)
    num_kv_heads, head_dim = k.shape[1], k.shape[2]
    if meta.num_decode:
        b = meta.num_decode
        assert meta.decode_block_tables is not None
        # Gather keys and values separately: each gather lands contiguous, so merging the
        # (block, offset) axes into one context axis is a free view, not another copy.
        keys = kv_layer[:, 0][meta.decode_block_tables].view(
            b, -1, num_kv_heads, head_dim
        )  # [B, ctx, H_kv, D]
        values = kv_layer[:, 1][meta.decode_block_tables].view(b, -1, num_kv_heads, head_dim)
        out[:b] = attend(
            q[:b].unsqueeze(2),
            keys.transpose(1, 2).to(q.dtype),
            values.transpose(1, 2).to(q.dtype),
            meta.decode_mask,
            scale,
        ).squeeze(2)
    for span in meta.prefills:
        rows = slice(span.start, span.start + span.num_tokens)
        keys, values = _span_keys_values(span, k, v, kv_layer)
        mask = _chunk_causal_mask(span.num_tokens, span.context_len, q.device)
        o = attend(
            q[rows].transpose(0, 1)[None],
            keys.transpose(0, 1)[None].to(q.dtype),
            values.transpose(0, 1)[None].to(q.dtype),
            mask[None, None],
            scale,
        )  # [1, H, n, D]
        out[rows] = o[0].transpose(0, 1)
    return out


def _span_keys_values(
    span: PrefillSpan, k: torch.Tensor, v: torch.Tensor, kv_layer: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """A prefill chunk's context keys and values [context_len, H_kv, D], in the pool's dtype:
    its own rows when nothing comes before it (no gather), else gathered from its blocks."""
    if span.context_len == span.num_tokens:
        rows = slice(span.start, span.start + span.num_tokens)
        return to_pool(k[rows], kv_layer.dtype), to_pool(v[rows], kv_layer.dtype)
    num_kv_heads, head_dim = k.shape[1], k.shape[2]
    keys = kv_layer[:, 0][span.block_ids].view(-1, num_kv_heads, head_dim)
    values = kv_layer[:, 1][span.block_ids].view(-1, num_kv_heads, head_dim)
    return keys[: span.context_len], values[: span.context_len]


def to_pool(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Keys or values as the pool keeps them. An fp8 pool saturates at e4m3's largest
    number, as the CPU kernel's write does: torch's own conversion makes NaN of anything
    past it."""
    if dtype == torch.float8_e4m3fn:
        limit = torch.finfo(dtype).max
        return x.clamp(-limit, limit).to(dtype)
    return x.to(dtype)


def prefill_span_kernel(pool_dtype: torch.dtype, heads: tuple[int, int, int]) -> str | None:
    """Where this machine's prefill spans attend beside such a pool, for such a model."""
    return kernel_choice.choose_span_attention(pool_dtype, heads, kernel_choice.capabilities())


def _cpu_split(
    meta: AttnMetadata, pool_dtype: torch.dtype, heads: tuple[int, int, int]
) -> CpuSplit:
    fused = []
    kernel = prefill_span_kernel(pool_dtype, heads)
    if kernel is not None:
        fused = [s for s in meta.prefills if s.prompt or s.num_tokens >= SDPA_MIN_ROWS]
    if not fused:
        return CpuSplit(None, *meta.kernel_rows, [])
    rest = [s for s in meta.prefills if not (s.prompt or s.num_tokens >= SDPA_MIN_ROWS)]
    if not (meta.num_decode or rest):
        none = torch.empty(0, dtype=torch.long)
        return CpuSplit(none, none.view(0, 1), none, fused, kernel)
    idx = torch.cat(
        [torch.arange(meta.num_decode)]
        + [torch.arange(s.start, s.start + s.num_tokens) for s in rest]
    )
    return CpuSplit(idx, *meta.rows_of(rest), fused, kernel)


def _attend_fused(
    kernels,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    kv_layer: torch.Tensor,
    split: CpuSplit,
    scale: float,
) -> torch.Tensor:
    """The CPU step with `split.spans` in torch's fused attention or `span_attention`
    (split.span_kernel), the other rows (decode rows, short spans) in one call of our kernel.
    The pool is written already. The kernels' decoder_layers does the same in C++
    (attend_layer)."""
    out = torch.empty_like(q)
    idx = split.rows
    if idx is not None and idx.numel():
        out[idx] = kernels.decode_attention(
            q[idx].contiguous(), kv_layer, split.tables, split.lens, scale
        )
    for span in split.spans:
        rows = slice(span.start, span.start + span.num_tokens)
        if kv_layer.dtype == q.dtype:
            keys, values = _span_keys_values(span, k, v, kv_layer)
        else:  # a narrower pool (fp8): the span's rows as written, widened in one pass
            keys, values = kernels.gather_kv(kv_layer, span.block_ids, span.context_len, q)
        if split.span_kernel != SDPA:
            out[rows] = kernels.span_attention(q[rows], keys, values, scale)
            continue
        fresh = span.context_len == span.num_tokens  # then a plain causal mask
        mask = None if fresh else _chunk_causal_mask(span.num_tokens, span.context_len, q.device)
        o = F.scaled_dot_product_attention(
            q[rows].transpose(0, 1)[None],
            keys.transpose(0, 1)[None],
            values.transpose(0, 1)[None],
            attn_mask=None if mask is None else mask[None, None],
            is_causal=fresh,
            scale=scale,
            enable_gqa=True,
        )  # [1, H, n, D]
        out[rows] = o[0].transpose(0, 1)
    return out


def _paged_attention_triton(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    kv_layer: torch.Tensor,
    meta: AttnMetadata,
    scale: float,
) -> torch.Tensor:
    """The same step on a GPU: every piece a Triton kernel reading the pool in place."""
    from tokenyard.kernels.triton import decode_attention, kv_write, prefill_attention

    q = q.contiguous()
    kv_write.write_kv(k.contiguous(), v.contiguous(), kv_layer, meta.slot_blocks, meta.slot_offsets)
    out = torch.empty_like(q)
    if meta.num_decode:
        assert meta.decode_block_tables is not None and meta.decode_context_lens is not None
        out[: meta.num_decode] = decode_attention.decode_attention(
            q[: meta.num_decode],
            kv_layer,
            meta.decode_block_tables.contiguous(),
            meta.decode_context_lens,
            scale,
        )
    if meta.prefills:
        spans = meta.prefills
        width = max(len(s.block_ids) for s in spans)
        tables = torch.zeros(len(spans), width, dtype=torch.long, device=q.device)
        for i, s in enumerate(spans):
            tables[i, : len(s.block_ids)] = s.block_ids
        ints = [
            [s.start for s in spans],
            [s.num_tokens for s in spans],
            [s.context_len for s in spans],
        ]
        starts, num_tokens, context_lens = torch.tensor(ints, device=q.device)
        prefill_attention.prefill_attention(
            q, kv_layer, tables, starts, num_tokens, context_lens, scale, out
        )
    return out


def attend(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, scale: float
) -> torch.Tensor:
    """Grouped-query attention with the softmax in fp32.

    q: [B, H, n, D]; k, v: [B, H_kv, ctx, D]; mask: [B or 1, 1, n, ctx] bool (True = attend).
    NOTE: written out rather than F.scaled_dot_product_attention: on CPUs torch's fused kernel
    was 1.5-12x slower here (bf16 above all) and it repeats K/V per query head for GQA.
    """
    b, h, n, d = q.shape
    h_kv, ctx = k.shape[1], k.shape[2]
    g = h // h_kv  # query heads per KV head: heads [i*g, (i+1)*g) read KV head i
    qg = q.reshape(b, h_kv, g * n, d)
    scores = (qg @ k.transpose(-1, -2)).float().view(b, h_kv, g, n, ctx) * scale
    scores = scores.masked_fill(~mask.unsqueeze(2), float("-inf"))
    probs = torch.softmax(scores, dim=-1).to(v.dtype).view(b, h_kv, g * n, ctx)
    return (probs @ v).view(b, h, n, d)


def _chunk_causal_mask(num_tokens: int, context_len: int, device: torch.device) -> torch.Tensor:
    """[n, ctx] bool: row i (absolute position ctx - n + i) sees keys 0..its own position."""
    first = context_len - num_tokens
    q_pos = torch.arange(first, context_len, device=device)[:, None]
    return torch.arange(context_len, device=device)[None, :] <= q_pos
