"""Builds the model and the KV pool, and accounts for serving memory's three tenants:
weights, KV cache, and buffers (RoPE tables and the step's activation workspace)."""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import math
import mmap
from dataclasses import dataclass

import torch
import torch.distributed as dist

from tokenyard.engine.budget import (
    MIB,
    MIN_KV_BLOCKS,
    DeviceMemory,
    MemoryBudgetError,
    host_memory,
    kv_cache_budget,
    share_of,
    utilization_of,
)
from tokenyard.engine.config import EngineConfig
from tokenyard.engine.pipeline import RankPlace, stage_tp_group
from tokenyard.engine.shared_weights import share_weights
from tokenyard.kv.layout import KVLayout
from tokenyard.models.expert_parallel import apply_ep
from tokenyard.models.llama import LlamaForCausalLM
from tokenyard.models.loader import LoadedModel
from tokenyard.models.moe import SparseMoeBlock, moe_blocks
from tokenyard.models.pp import apply_pp, check_pp, stage_layers
from tokenyard.models.quantize import (
    Fp8Linear,
    QuantizedLinear,
    keeps_dense,
    prepack,
    quantize,
)
from tokenyard.models.tp import VocabParallelEmbedding, apply_tp, check_tp

log = logging.getLogger(__name__)

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
SUPPORTED_ARCHITECTURES = ("llama", "mistral", "qwen2", "mixtral", "qwen2_moe")


@dataclass
class MemoryReport:
    weights_bytes: int
    kv_cache_bytes: int
    buffers_bytes: int  # RoPE tables + an estimate of the largest step's activations
    num_blocks: int
    block_nbytes: int
    # Weight bytes one batch-1 decode step reads: every projection (its quantized copy where
    # there is one), the norms, and one embedding row. Memory bandwidth over this is the
    # ceiling on single-sequence decode speed.
    decode_read_bytes: int = 0
    # Mixture-of-Experts: the experts' share of weights_bytes, and how many experts each
    # sparse layer holds and runs per token (a batch-1 step reads only the ones it runs).
    expert_weights_bytes: int = 0
    num_experts: int = 0
    experts_per_token: int = 0
    # Tensor parallelism: every figure above is one rank's (its weight shards, its KV pool
    # of num_kv_heads / tp_size heads); each of the tp_size ranks holds as much.
    tp_size: int = 1
    # Pipeline parallelism: the figures are stage 0's rank's (its layers' weights and KV);
    # the engine has tp_size x pp_size ranks.
    pp_size: int = 1
    # Speculative decoding's draft model (tokenyard.engine.spec.draft), on top of the above:
    # the weights it adds (a self-draft's int4 copies only: it shares the target's other
    # tensors) and its own KV pool (none for a self-draft, which writes the target's).
    draft_weights_bytes: int = 0
    draft_kv_cache_bytes: int = 0
    block_size: int = 0  # tokens per KV block
    # The device's free memory once this engine's pool and buffers are in (None: unknown),
    # and the engine's share of the device when a utilization sized the pool (engine.budget).
    free_bytes: int | None = None
    budget_bytes: int | None = None
    utilization: str = ""  # the setting that gave the budget, e.g. "cpu_memory_utilization 0.5"

    @property
    def total_bytes(self) -> int:
        return (
            self.weights_bytes
            + self.kv_cache_bytes
            + self.buffers_bytes
            + self.draft_weights_bytes
            + self.draft_kv_cache_bytes
        )

    def describe(self) -> str:
        """The split in one line: weights, KV pool (blocks and tokens), activations, what
        is left free; then the budget that sized the pool, where one did."""
        mib = MIB
        world = self.tp_size * self.pp_size
        ranks = f" per rank, x{world} ranks" if world > 1 else ""
        experts = (
            f" (experts {self.expert_weights_bytes / mib:.1f} MiB: {self.num_experts} per layer, "
            f"{self.experts_per_token} active per token)"
            if self.num_experts
            else ""
        )
        draft = (
            f", draft weights {self.draft_weights_bytes / mib:.1f} MiB, "
            f"draft KV cache {self.draft_kv_cache_bytes / mib:.1f} MiB"
            if self.draft_weights_bytes or self.draft_kv_cache_bytes
            else ""
        )
        tokens = f" / {self.num_blocks * self.block_size} tokens" if self.block_size else ""
        free = f", free left {self.free_bytes / mib:.1f} MiB" if self.free_bytes is not None else ""
        budget = (
            f" (budget {self.budget_bytes / mib:.1f} MiB: {self.utilization})"
            if self.budget_bytes is not None
            else ""
        )
        return (
            f"weights {self.weights_bytes / mib:.1f} MiB{experts}, "
            f"KV cache {self.kv_cache_bytes / mib:.1f} MiB = {self.num_blocks} blocks{tokens} "
            f"({self.block_nbytes / 1024:.0f} KiB each), "
            f"activations and tables {self.buffers_bytes / mib:.1f} MiB{draft}{free}{budget}{ranks}"
        )


def build_model_and_pool(
    loaded: LoadedModel, config: EngineConfig, rank: int = 0
) -> tuple[LlamaForCausalLM, torch.Tensor, KVLayout, MemoryReport]:
    """The model (rank `rank`'s share of it under tensor and pipeline parallelism: its
    stage's layers, its heads of them) and its KV pool."""
    mc = loaded.config
    if mc.architecture not in SUPPORTED_ARCHITECTURES:
        raise ValueError(f"unsupported model architecture {mc.architecture!r}")
    tp = config.tensor_parallel_size
    check_tp(mc, tp)
    check_pp(mc, config.pipeline_parallel_size)
    place = RankPlace.of(config, rank)
    dtype = _DTYPES[config.dtype]
    max_positions = min(
        config.max_model_len or mc.max_position_embeddings, mc.max_position_embeddings
    )
    device = torch.device(config.device)
    if device.type == "cuda" and config.quantization:
        raise ValueError("quantization runs on the CPU only so far; use device='cpu' with it")
    if device.type == "cuda" and config.kv_pool_factory is not None:
        raise ValueError("a kv_pool_factory (shared-memory KV pool) is for device='cpu' only")
    with torch.device("meta"):  # no time spent initialising weights we overwrite anyway
        model = LlamaForCausalLM(mc, max_positions)
    # Sharded on the host, so a GPU only ever holds its rank's share of the weights.
    model.to_empty(device=device if config.world_size == 1 else torch.device("cpu"))
    model.load_weights(loaded.weights)
    ep = config.expert_parallel_size
    apply_tp(model, place.tp_rank, tp, stage_tp_group(place), shard_experts=ep == 1)
    apply_pp(model, place.stage, place.pp)
    apply_ep(model, rank, ep, config.expert_redundant_slots)
    model.to(device=device, dtype=dtype)
    if model.rope is not None and device.type != "cpu":  # plain attributes: not moved by .to()
        model.rope.cos, model.rope.sin = model.rope.cos.to(device), model.rope.sin.to(device)
    if config.quantization:
        dense = keeps_dense(model, config.quantization, config.dense_copies)
        quantize(model, config.quantization, keep_dense=dense and not config.deterministic)
    if device.type == "cpu":
        compact_embeddings(model)
    for block in moe_blocks(model):
        block.batch_invariant = config.deterministic
    if config.shared_weights_dir and device.type == "cpu":
        share_weights(model, config.shared_weights_dir)
    elif config.prepack_weights and device.type == "cpu":
        prepack(model)
    layout = kv_layout(loaded, config, place.stage)
    weights_bytes = _weights_bytes(model)
    buffers_bytes = _buffers_bytes(model, config, dtype)
    memory = _device_memory(device)
    num_blocks = _pool_blocks(config, layout, memory, weights_bytes, buffers_bytes, device)
    kv_dtype = layout.torch_dtype
    if config.kv_pool_factory is None:
        shape = layout.pool_shape(num_blocks)
        if device.type == "cpu":
            kv_cache = zeroed_pool(shape, kv_dtype)
        else:
            kv_cache = torch.zeros(shape, dtype=kv_dtype, device=device)
    else:
        kv_cache = config.kv_pool_factory(layout, num_blocks)
        assert kv_cache.shape == layout.pool_shape(num_blocks) and kv_cache.dtype == kv_dtype
        assert kv_cache.is_contiguous()
    if config.prefault_kv_pool and device.type == "cpu":
        prefault(kv_cache)
    report = MemoryReport(
        weights_bytes=weights_bytes,
        kv_cache_bytes=kv_cache.numel() * kv_cache.element_size(),
        buffers_bytes=buffers_bytes,
        num_blocks=num_blocks,
        block_nbytes=layout.block_nbytes,
        decode_read_bytes=_decode_read_bytes(model),
        expert_weights_bytes=sum(_weights_bytes(e) for b in moe_blocks(model) for e in b.experts),
        num_experts=mc.num_local_experts,
        experts_per_token=mc.num_experts_per_tok,
        tp_size=tp,
        pp_size=config.pipeline_parallel_size,
        block_size=config.block_size,
        free_bytes=memory.free - num_blocks * layout.block_nbytes - buffers_bytes,
        budget_bytes=None if config.kv_cache_bytes is not None else share_of(config, memory.total),
        utilization=_utilization_label(config),
    )
    return model, kv_cache, layout, report


# Narrower dtypes an fp32 embedding table may be kept in where it holds every value exactly.
_COMPACT_DTYPES = (torch.bfloat16, torch.float16)


def compact_embeddings(model: LlamaForCausalLM) -> bool:
    """Keep an fp32 embedding table in bf16 or fp16 where that holds every value exactly (a
    16-bit checkpoint upcast for fp32 compute): a token's row is read and widened, the same
    values at half the bytes (the 1B shape's table is 384 MiB in fp32). Not where another
    layer multiplies by the table as it is (an output projection tied to it and kept dense).
    Whether it did."""
    embed, head = model.embed_tokens, model.lm_head
    if type(embed) is not torch.nn.Embedding or embed.weight.dtype != torch.float32:
        return False  # a vocab shard, a later pipeline stage's placeholder, a narrow table
    weight = embed.weight
    dense_head = head.dense if isinstance(head, QuantizedLinear) else getattr(head, "weight", None)
    if dense_head is weight:
        return False
    for dtype in _COMPACT_DTYPES:
        narrow = weight.detach().to(dtype)
        if torch.equal(narrow.float(), weight):
            embed.weight = torch.nn.Parameter(narrow, requires_grad=False)
            return True
    return False


def _device_memory(device: torch.device) -> DeviceMemory:
    """The device's memory now: a GPU's as CUDA reports it, else the host's."""
    if device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        return DeviceMemory(total=total, free=free)
    return host_memory()


def _pool_blocks(
    config: EngineConfig,
    layout: KVLayout,
    memory: DeviceMemory,
    weights_bytes: int,
    buffers_bytes: int,
    device: torch.device,
) -> int:
    """How many KV blocks the pool holds (engine.budget), agreed between tensor-parallel
    ranks; MemoryBudgetError when fewer than MIN_KV_BLOCKS fit."""
    # What the engine already holds on the device: on a GPU all torch has reserved there
    # (weights and tables); on a CPU its weights as loaded, measured tensor by tensor.
    own = torch.cuda.memory_reserved(device) if device.type == "cuda" else weights_bytes
    kv_bytes = kv_cache_budget(
        config,
        buffers_bytes=buffers_bytes,
        own=own,
        free=memory.free,
        total=memory.total,
        block_nbytes=layout.block_nbytes,
    )
    num_blocks = kv_bytes // layout.block_nbytes
    if config.world_size > 1:
        num_blocks = _agree(num_blocks, device)
    if num_blocks < MIN_KV_BLOCKS:
        raise MemoryBudgetError(
            f"a KV pool of {kv_bytes} bytes holds fewer than {MIN_KV_BLOCKS} KV blocks "
            f"of {layout.block_nbytes} bytes"
        )
    if config.kv_cache_bytes is not None and kv_bytes + buffers_bytes > memory.free:
        log.warning(
            "the KV pool asked for (%.1f MiB) and the step's buffers (%.1f MiB) exceed the "
            "%.1f MiB free now: the process may run out of memory as the pool fills",
            kv_bytes / MIB,
            buffers_bytes / MIB,
            memory.free / MIB,
        )
    return num_blocks


def _utilization_label(config: EngineConfig) -> str:
    utilization = utilization_of(config)
    if utilization is None:
        return ""
    name = "gpu" if config.device.startswith("cuda") else "cpu"
    return f"{name}_memory_utilization {utilization:g}"


def _agree(num_blocks: int, device: torch.device) -> int:
    """The block count every rank can hold: rank 0's block tables index every rank's pool."""
    n = torch.tensor([num_blocks], dtype=torch.long, device=device)
    dist.all_reduce(n, op=dist.ReduceOp.MIN)
    return int(n.item())


_MADV_POPULATE_WRITE = 23  # Linux 5.14+; Python's mmap module may not name it


def prefault(pool: torch.Tensor) -> None:
    """Make every page of a freshly made, all-zero CPU pool resident now.

    A lazily resident pool faults a page in on its first write, which made a fresh
    prompt's `write_kv` several times slower than on written pages (docs/benchmarks.md),
    and a pool whose prefix cache may fill it becomes resident in full after a few dozen
    requests anyway. The
    kernel populates the range itself (MADV_POPULATE_WRITE, no data written); where it
    cannot, one zero byte is written per page, which is why the pool must still be zeros."""
    if pool.device.type != "cpu" or pool.numel() == 0:
        return
    page = mmap.PAGESIZE
    start = pool.data_ptr() // page * page
    end = pool.data_ptr() + pool.numel() * pool.element_size()
    libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
    libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    if libc.madvise(ctypes.c_void_p(start), end - start, _MADV_POPULATE_WRITE) == 0:
        return
    log.debug("MADV_POPULATE_WRITE failed (errno %d); writing each page", ctypes.get_errno())
    flat = pool.view(-1).view(torch.uint8)
    first = (-pool.data_ptr()) % page  # the first byte of the pool on a page boundary
    flat[first::page].zero_()
    flat[:1].zero_()


def zeroed_pool(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """A zeroed tensor in anonymous memory that becomes resident page by page as it is
    written (torch.zeros writes every page up front: a large KV pool would count whole in
    RSS before its first request)."""
    nbytes = math.prod(shape) * dtype.itemsize
    buf = mmap.mmap(-1, max(nbytes, 1))
    return torch.frombuffer(buf, dtype=torch.uint8, count=nbytes).view(dtype).view(shape)


def _weights_bytes(model: torch.nn.Module, shared_with: torch.nn.Module | None = None) -> int:
    """Bytes of the model's tensors, each counted once (tied embeddings are one tensor);
    those of `shared_with` are left out (a self-draft shares the target's)."""
    seen = {_identity(t) for t in _tensors(shared_with)} if shared_with is not None else set()
    total = 0
    for t in _tensors(model):
        if _identity(t) not in seen:
            seen.add(_identity(t))
            total += t.numel() * t.element_size()
    return total


def _identity(t: torch.Tensor) -> int:
    """Where a tensor's bytes are; a packed (opaque) weight has no pointer, only itself."""
    return id(t) if t.is_mkldnn else t.data_ptr()


def _tensors(model: torch.nn.Module) -> list[torch.Tensor]:
    return [*model.parameters(), *model.buffers()]


def draft_weights_bytes(draft: torch.nn.Module, target: torch.nn.Module) -> int:
    """What a draft model's weights add to the target's (tensors they share count once)."""
    return _weights_bytes(draft, shared_with=target)


def _decode_read_bytes(module: torch.nn.Module) -> int:
    if isinstance(module, SparseMoeBlock):  # a token runs top_k of the experts
        experts = sum(_decode_read_bytes(e) for e in module.experts)
        shared = _decode_read_bytes(module.shared_expert) if module.shared_expert else 0
        routers = _own_bytes(module)
        return experts * module.top_k // len(module.experts) + shared + routers
    bias = getattr(module, "bias", None)
    bias_bytes = bias.numel() * bias.element_size() if bias is not None else 0
    if isinstance(module, (QuantizedLinear, Fp8Linear)):
        return module.quantized_bytes() + bias_bytes
    if isinstance(module, torch.nn.Linear):
        return module.weight.numel() * module.weight.element_size() + bias_bytes
    if isinstance(module, (torch.nn.Embedding, VocabParallelEmbedding)):
        return module.weight.shape[1] * module.weight.element_size()
    return _own_bytes(module) + sum(_decode_read_bytes(c) for c in module.children())


def _own_bytes(module: torch.nn.Module) -> int:
    return sum(p.numel() * p.element_size() for p in module.parameters(recurse=False))


def _buffers_bytes(model: LlamaForCausalLM, config: EngineConfig, dtype: torch.dtype) -> int:
    assert model.rope is not None
    rope = 2 * model.rope.cos.numel() * model.rope.cos.element_size()
    mc, tp = model.config, config.tensor_parallel_size
    t = config.max_num_batched_tokens
    # per row: residual + normed + qkv + attention out + gate_up + activation (this rank's
    # heads and columns), and the gathered fp32 logits
    per_row = (
        3 * mc.hidden_size
        + (mc.num_attention_heads + 2 * mc.num_key_value_heads) * mc.head_dim // tp
        + mc.num_attention_heads * mc.head_dim // tp
        + 3 * mc.intermediate_size // tp
    )
    activations = t * per_row * dtype.itemsize + config.max_num_seqs * mc.vocab_size * 4
    return rope + activations


def kv_layout(loaded: LoadedModel, config: EngineConfig, stage: int = 0) -> KVLayout:
    """The KV pool's layout for this model at the config's KV dtype and block size: one rank's
    pool, which holds num_kv_heads / tensor_parallel_size of the model's KV heads, for the
    layers of its pipeline stage."""
    mc = loaded.config
    layers = stage_layers(mc.num_hidden_layers, stage, config.pipeline_parallel_size)
    return KVLayout(
        model_id=loaded.model_id,
        dtype=config.kv_cache_dtype,
        block_size=config.block_size,
        num_layers=len(layers),
        num_kv_heads=mc.num_key_value_heads // config.tensor_parallel_size,
        head_dim=mc.head_dim,
        tp_size=config.tensor_parallel_size,
    )
