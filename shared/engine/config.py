"""Engine settings: what model, what precision, how the KV pool and the step budget are sized."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from tokenyard import platforms
from tokenyard.engine.fair_queue import Policy, check_policy
from tokenyard.engine.spec.config import SpeculativeConfig

if TYPE_CHECKING:
    import torch

    from tokenyard.kv.layout import KVLayout


def auto_dtype(device: str) -> str:
    """The faster activation dtype for ``device``: see ``EngineConfig.dtype``."""
    if device.startswith("cuda") or platforms.cpu().native_bf16:
        return "bfloat16"
    return "float32"


# EngineConfig.dense_copies' choices (tokenyard.models.quantize.keeps_dense).
DENSE_COPIES = ("auto", "all", "none")

# The names vLLM and SGLang take for an e4m3 pool, beside torch's own.
_FP8_KV_NAMES = ("fp8", "fp8_e4m3", "float8_e4m3fn")


def kv_cache_dtype_for(kv_cache_dtype: str, dtype: str, device: str) -> str:
    """The KV pool's dtype: see ``EngineConfig.kv_cache_dtype``; refuses pairs not built."""
    cpu = device == "cpu"
    if kv_cache_dtype == "auto":
        kv_cache_dtype = "float16" if cpu and dtype == "float32" else dtype
    if kv_cache_dtype in _FP8_KV_NAMES:
        kv_cache_dtype = "float8_e4m3fn"
    narrower = cpu and (
        (dtype == "float32" and kv_cache_dtype == "float16")
        or (dtype in ("float32", "bfloat16") and kv_cache_dtype == "float8_e4m3fn")
    )
    if kv_cache_dtype != dtype and not narrower:
        raise ValueError(
            f"kv_cache_dtype {kv_cache_dtype!r} with dtype {dtype!r} on {device!r}: the KV "
            "pool takes the compute dtype, or on a CPU float16 beside float32, or fp8 "
            "(float8_e4m3fn) beside bfloat16 or float32"
        )
    return kv_cache_dtype


@dataclass
class EngineConfig:
    model: str | None = None  # a .gguf file or an HF folder; None = the default model
    # Weights and activations: float32 | bfloat16 | float16, or "auto": bfloat16 on a GPU
    # and on a CPU that multiplies bf16 natively (AVX512-BF16, AMX, Arm BF16), float32 on
    # other CPUs, where oneDNN emulates bf16 GEMMs at a third of fp32's speed.
    dtype: str = "float32"
    # The KV pool's dtype: float32 | bfloat16 | float16 | fp8 (float8_e4m3fn; also
    # "fp8_e4m3"), or "auto": float16 beside float32 compute on a CPU (decode attention
    # reads half the bytes; the kernels convert with F16C, and fp16 keeps 3 more mantissa
    # bits than the bf16 pools of bf16 engines), else the compute dtype. fp8 beside bf16 or
    # float32 on a CPU: keys and values rounded to e4m3 (saturated at +-448, no scales) as
    # they are written, read back to fp32 for the products. Other pairs are refused.
    kv_cache_dtype: str = "auto"
    # None | "int8" | "int4" | "fp8" (weight-only; tokenyard.models.quantize)
    quantization: str | None = None
    block_size: int = 16
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 512  # the per-step token budget (chunked prefill)
    # The waiting queue's order (engine/fair_queue.py): "fair" (priority, then a fair share
    # of tokens between tenants), "priority" (priority, then arrival) or "fcfs" (arrival).
    scheduling_policy: Policy = "fair"
    max_model_len: int | None = None  # None = the model's context length, capped at 8192
    # The KV pool's size; it overrides any budget. None: what the engine's share of its
    # device leaves once weights and buffers are in (as vLLM sizes it; engine.budget): on a
    # GPU gpu_memory_utilization's, on a CPU cpu_memory_utilization's, or without one 512 MiB.
    kv_cache_bytes: int | None = None
    device: str = "cpu"  # "cpu", "cuda" or "cuda:<index>": weights, KV pool and kernels
    gpu_memory_utilization: float = 0.9  # on CUDA: the share of the device this engine may use
    # On a CPU: the share of the host's memory (its cgroup's limit, in a container) this
    # engine may use for weights, buffers and KV pool; engines sharing a host split it.
    cpu_memory_utilization: float | None = None
    # Ranks one model is split over (tokenyard.models.tp): rank 0 is this process, the others
    # are processes the engine starts; on CUDA rank r takes the r-th device after `device`.
    tensor_parallel_size: int = 1
    # Stages the model's layers are split over (tokenyard.engine.pipeline): each stage of
    # tensor_parallel_size ranks holds a contiguous run of layers and their KV pool; rank
    # numbering is stage-major (rank = stage * tp + tp rank), rank 0 samples.
    pipeline_parallel_size: int = 1
    # LoRA adapters (engine/lora.py): the adapted projections hold `max_loras` adapters at
    # once (a batch mixes at most that many), each of rank up to `max_lora_rank`; up to
    # `max_cpu_loras` adapters wait in host memory and swap into a slot when a request
    # needs one. Off: no layer is touched and no step pays anything.
    enable_lora: bool = False
    max_loras: int = 4
    max_lora_rank: int = 16
    max_cpu_loras: int = 32
    # Ranks the experts of a Mixture-of-Experts model are placed over
    # (tokenyard.models.expert_parallel): 1, or the engine's whole set of ranks, which are
    # the tensor-parallel ranks when tensor_parallel_size > 1 (attention stays sharded by
    # heads) and otherwise as many ranks that each run the attention whole.
    expert_parallel_size: int = 1
    # Expert parallelism's load balancer (tokenyard.models.expert_placement): spare expert
    # slots per rank that hold replicas of the hottest experts, and how many steps apart
    # the placement is recomputed from the tokens counted since the last (0 = never).
    expert_redundant_slots: int = 0
    expert_rebalance_interval: int = 0
    enable_prefix_caching: bool = True
    # Whether the prefix cache keeps freed blocks while never-written ones remain, so a lazily
    # resident KV pool becomes resident in full; False: it reuses its oldest cached block
    # first, and the pool's resident size follows the peak of live sequences
    # (BlockManager.grow_for_cache). Workers with a KV-cache service behind them turn it off.
    prefix_cache_grows_pool: bool = True
    # Batch-invariant steps: a request's tokens do not depend on its batch neighbours, prefix
    # cache hits, chunking, preemption or a prefill-to-decode hand-off. Every row runs the
    # same kernels whatever the step's shape: the quantized kernel at any row count (no
    # dense copy) and the per-query decode attention for prompt tokens too. Needs int8 or
    # int4, whose kernels compute each row on its own (docs/precision.md has the cost).
    deterministic: bool = False
    num_threads: int | None = None  # torch intra-op threads; None = leave torch's default
    # Makes the KV pool: (layout, num_blocks) -> a zeroed contiguous tensor of
    # layout.pool_shape(num_blocks). None = private memory; workers pass a shared-memory
    # allocator so a peer on the same host can read blocks without a copy through a socket.
    kv_pool_factory: Callable[[KVLayout, int], torch.Tensor] | None = None
    # Make a CPU pool's pages resident when it is made (engine.memory.prefault) rather than
    # as blocks are first written: first writes then cost no page faults (2.5-2.9 ms of a
    # 158-token prefill on a 2-core Zen 4), and resident memory is the whole pool from the
    # start. Workers turn it on where their prefix cache fills the pool anyway.
    prefault_kv_pool: bool = False
    # A directory in shared memory (e.g. /dev/shm/tokenyard) where engines on one host share
    # their built weights as one read-only file (tokenyard.engine.shared_weights); CPU only.
    # None = private memory.
    shared_weights_dir: str | None = None
    # Private CPU weights only: keep each quantized layer's dense copy in oneDNN's packed
    # layout where that pays (QuantizedLinear.prepack: bf16 where oneDNN has a bf16 linear,
    # fp32 on CPUs without AVX-512).
    prepack_weights: bool = True
    # Quantized layers' dense copies for big steps (tokenyard.models.quantize.keeps_dense):
    # "all" keeps them at any size (faster big steps, more memory), "auto" keeps them where
    # all of a model's come to at most DENSE_COPIES_MAX_BYTES (a small model, where they
    # cost little memory), "none" never (each layer's quantized kernel runs every step).
    # NOTE: "all" by default until "auto"'s cost in speed at the 0.5B-1B shapes is measured
    # on a CPU that keeps copies (AVX-512 BF16); fp32 compute keeps none either way.
    # Deterministic mode keeps none whatever this says.
    dense_copies: str = "all"
    # Speculative decoding, in vLLM's keys: {"method": "ngram", "num_speculative_tokens": 4}
    # or {"method": "draft", "model": None, "quantization": "int4"} (tokenyard.engine.spec).
    # A dict or its JSON text is parsed into a SpeculativeConfig here.
    speculative_config: SpeculativeConfig | dict[str, Any] | str | None = None

    def __post_init__(self) -> None:
        if self.dtype == "auto":
            self.dtype = auto_dtype(self.device)
        if self.dtype not in ("float32", "bfloat16", "float16"):
            raise ValueError(f"dtype must be float32, bfloat16 or float16, got {self.dtype!r}")
        self.kv_cache_dtype = kv_cache_dtype_for(self.kv_cache_dtype, self.dtype, self.device)
        if self.quantization not in (None, "int8", "int4", "fp8"):
            raise ValueError(
                f"quantization must be None, 'int8', 'int4' or 'fp8', got {self.quantization!r}"
            )
        if self.dense_copies not in DENSE_COPIES:
            raise ValueError(
                f"dense_copies must be one of {DENSE_COPIES}, got {self.dense_copies!r}"
            )
        if self.deterministic and self.quantization not in ("int8", "int4"):
            raise ValueError(
                "deterministic mode needs quantization 'int8' or 'int4' (their kernels compute "
                f"each row on its own; dense matmuls do not promise that), got {self.quantization!r}"
            )
        if self.block_size <= 0 or self.block_size & (self.block_size - 1):
            raise ValueError(f"block_size must be a power of two, got {self.block_size}")
        if self.max_num_seqs <= 0 or self.max_num_batched_tokens <= 0:
            raise ValueError("max_num_seqs and max_num_batched_tokens must be positive")
        check_policy(self.scheduling_policy)
        if self.speculative_config is not None:
            # With `deterministic`, only greedy requests speculate (Speculator.greedy_only).
            self.speculative_config = SpeculativeConfig.parse(self.speculative_config)
        self._check_tensor_parallel()
        self._check_pipeline_parallel()
        self._check_expert_parallel()
        self._check_lora()
        self._check_device()

    @property
    def world_size(self) -> int:
        """The engine's ranks (processes, and GPUs on CUDA): tp x pp, where expert-parallel
        ranks are the tensor-parallel ones (or as many ranks of whole attention)."""
        return (
            max(self.tensor_parallel_size, self.expert_parallel_size) * self.pipeline_parallel_size
        )

    def _check_lora(self) -> None:
        if not self.enable_lora:
            return
        if self.max_loras < 1 or self.max_lora_rank < 1:
            raise ValueError("max_loras and max_lora_rank must be at least 1")
        if self.max_cpu_loras < self.max_loras:
            raise ValueError(
                f"max_cpu_loras ({self.max_cpu_loras}) must be at least max_loras "
                f"({self.max_loras})"
            )
        if self.world_size != 1:
            raise ValueError(
                "LoRA adapters run on one rank only so far: tensor_parallel_size and "
                "pipeline_parallel_size 1"
            )

    def _check_device(self) -> None:
        kind, _, index = self.device.partition(":")
        if kind not in ("cpu", "cuda") or (index and (kind == "cpu" or not index.isdigit())):
            raise ValueError(f"device must be 'cpu', 'cuda' or 'cuda:<index>', got {self.device!r}")
        for name in ("gpu_memory_utilization", "cpu_memory_utilization"):
            value = getattr(self, name)
            if value is not None and not 0.0 < value <= 1.0:
                raise ValueError(f"{name} must be in (0, 1], got {value}")
        if kind == "cuda":
            gpu = platforms.gpu()
            if not gpu.available:
                raise ValueError(f"device {self.device!r} asked for, but CUDA is not available")
            last = int(index or 0) + self.world_size - 1
            if last >= gpu.count:
                raise ValueError(
                    f"device {self.device!r} with {self.world_size} ranks (tensor_parallel_size "
                    f"{self.tensor_parallel_size}, pipeline_parallel_size "
                    f"{self.pipeline_parallel_size}, expert_parallel_size "
                    f"{self.expert_parallel_size}) needs CUDA device {last}: only "
                    f"{gpu.count} CUDA devices"
                )

    def _check_tensor_parallel(self) -> None:
        """What tensor parallelism does not combine with, refused up front."""
        tp = self.tensor_parallel_size
        if tp < 1:
            raise ValueError(f"tensor_parallel_size must be at least 1, got {tp}")
        if tp == 1:
            return
        if self.speculative_config is not None:
            raise ValueError(
                "speculative decoding runs on one rank only so far: drop speculative_config "
                f"or use tensor_parallel_size=1 (got {tp})"
            )
        if self.kv_pool_factory is not None:
            raise ValueError(
                "a kv_pool_factory (shared-memory KV pool) holds one rank's pool: not with "
                f"tensor_parallel_size {tp}"
            )

    def _check_pipeline_parallel(self) -> None:
        """What pipeline stages do not combine with, refused up front."""
        pp = self.pipeline_parallel_size
        if pp < 1:
            raise ValueError(f"pipeline_parallel_size must be at least 1, got {pp}")
        if pp == 1:
            return
        if self.speculative_config is not None:
            raise ValueError(
                "speculative decoding runs on one rank only so far: drop speculative_config "
                f"or use pipeline_parallel_size=1 (got {pp})"
            )
        if self.kv_pool_factory is not None:
            raise ValueError(
                "a kv_pool_factory (shared-memory KV pool) holds one rank's pool: not with "
                f"pipeline_parallel_size {pp}"
            )

    def _check_expert_parallel(self) -> None:
        """Expert parallelism's shape and what it does not combine with, refused up front."""
        ep, tp = self.expert_parallel_size, self.tensor_parallel_size
        if ep < 1:
            raise ValueError(f"expert_parallel_size must be at least 1, got {ep}")
        if self.expert_redundant_slots < 0 or self.expert_rebalance_interval < 0:
            raise ValueError("expert_redundant_slots and expert_rebalance_interval must be >= 0")
        if ep == 1:
            return
        if self.pipeline_parallel_size != 1:
            raise ValueError(
                f"expert_parallel_size {ep} with pipeline_parallel_size "
                f"{self.pipeline_parallel_size}: not combined yet; in stages the experts are "
                "sliced by tensor_parallel_size"
            )
        if tp not in (1, ep):
            raise ValueError(
                f"expert_parallel_size {ep} with tensor_parallel_size {tp}: the experts are "
                "placed over the engine's ranks, so choose tensor_parallel_size 1 or "
                f"{ep} (attention replicated, or sharded over the same {ep} ranks)"
            )
        refused = {
            "speculative_config": self.speculative_config,
            "kv_pool_factory": self.kv_pool_factory,
            "quantization": self.quantization,  # the balancer copies plain weights
            "shared_weights_dir": self.shared_weights_dir,  # read-only; experts move
        }
        for name, value in refused.items():
            if value is not None:
                raise ValueError(f"{name} is not supported with expert_parallel_size {ep} yet")
