"""What the planner knows of models and hardware: published figures, one entry each.

Model figures come from each model's config.json (layers, hidden size, attention heads,
KV heads, head dim, experts); parameter counts from its model card. Hardware figures are
the vendors' datasheet numbers for one accelerator (dense, not sparse, FLOPs), the node and
rack power of their reference systems, and the cooling those racks use. The ``cpu`` entry is
not here: it is measured on the machine that runs the planner (`tokenyard.planner.cpu`).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

GB = 1e9

# Bytes per stored element, scales included (int4: one bf16 scale per group of 128).
DTYPE_BYTES = {
    "fp32": 4.0,
    "bf16": 2.0,
    "fp16": 2.0,
    "fp8": 1.0 + 2 / 128,
    "int8": 1.0 + 2 / 128,
    "int4": 0.5 + 2 / 128,
}


@dataclass(frozen=True)
class ModelSpec:
    name: str
    total_params: float
    active_params: float  # per token: equal to total for a dense model
    layers: int
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    experts: int = 0  # routed experts per MoE layer (0: dense)
    experts_per_token: int = 0
    # Elements of KV cache per token per layer when it is not 2 x kv_heads x head_dim
    # (multi-head latent attention keeps one compressed latent plus a RoPE key).
    kv_elems_per_layer: int = 0

    @property
    def is_moe(self) -> bool:
        return self.experts > 0

    @property
    def kv_elems_per_token(self) -> int:
        per_layer = self.kv_elems_per_layer or 2 * self.kv_heads * self.head_dim
        return self.layers * per_layer

    @property
    def expert_params(self) -> float:
        """Parameters in routed experts: total = dense + X, active = dense + X * k / E."""
        if not self.is_moe:
            return 0.0
        share = self.experts_per_token / self.experts
        return (self.total_params - self.active_params) / (1.0 - share)

    def params_touched(self, batch: int) -> float:
        """Parameters a decode step over `batch` tokens reads: dense weights plus every expert
        at least one token was routed to (uniform routing: 1 - (1 - k/E)^batch of them)."""
        if not self.is_moe:
            return self.total_params
        dense = self.total_params - self.expert_params
        touched = 1.0 - (1.0 - self.experts_per_token / self.experts) ** max(batch, 1)
        return dense + self.expert_params * touched


MODELS: dict[str, ModelSpec] = {
    m.name: m
    for m in (
        ModelSpec("smollm2-135m", 134.5e6, 134.5e6, 30, 576, 9, 3, 64, 49152),
        ModelSpec("llama-3.1-8b", 8.03e9, 8.03e9, 32, 4096, 32, 8, 128, 128256),
        ModelSpec("llama-3.1-70b", 70.6e9, 70.6e9, 80, 8192, 64, 8, 128, 128256),
        ModelSpec("llama-3.1-405b", 405.9e9, 405.9e9, 126, 16384, 128, 8, 128, 128256),
        ModelSpec("mixtral-8x7b", 46.7e9, 12.9e9, 32, 4096, 32, 8, 128, 32000, 8, 2),
        ModelSpec(
            "deepseek-v3", 671e9, 37e9, 61, 7168, 128, 128, 128, 129280, 256, 8,
            kv_elems_per_layer=512 + 64,
        ),
        ModelSpec("qwen3-30b-a3b", 30.5e9, 3.3e9, 48, 2048, 32, 4, 128, 151936, 128, 8),
        ModelSpec("qwen3-235b-a22b", 235e9, 22e9, 94, 4096, 64, 4, 128, 151936, 128, 8),
    )
}  # fmt: skip


@dataclass(frozen=True)
class Hardware:
    name: str
    memory_gb: float  # HBM (or RAM) per accelerator
    bandwidth_gbs: float  # memory bandwidth per accelerator
    bf16_tflops: float  # dense
    fp8_tflops: float  # dense; 0 = no fp8 tensor cores
    link_gbs: float  # scale-up link (NVLink, Infinity Fabric) per accelerator, one direction
    domain: int  # accelerators in one scale-up domain (the largest tensor-parallel group)
    tdp_w: float
    per_node: int  # accelerators per server (or compute tray)
    node_kw: float  # one server at full load, accelerators included
    rack_kw: float  # the rack's power budget
    cooling: str  # "air" or "liquid"
    pue: float  # facility power / IT power for that cooling
    # What the engine reaches of the datasheet, and what a step costs beyond it. GPU values are
    # typical of tuned servers (see docs/planning.md); the cpu entry's are measured here.
    decode_bw_eff: float = 0.7
    decode_flops_eff: float = 0.5
    prefill_flops_eff: float = 0.5
    step_overhead_ms: float = 2.0
    # A CPU engine runs a decode of at most this many sequences through its weight-only
    # (int4) kernels and larger ones through the dense copy's matmul: two kernels, each with
    # its own share of the matmul rate. 0: one kernel for every batch (GPU entries).
    small_batch_rows: int = 0
    small_batch_flops_eff: float = 0.0
    # The dense copy's dtype ("bf16", "fp32"), which those larger batches read in place of
    # the quantized weights; "" = the weights' own. On a CPU with AMX a 32-row step is bound
    # by that read, not by the matmul.
    dense_dtype: str = ""
    # A CPU kernel that widens the quantized weights to the matmul's dtype on every step (int4
    # to bf16 tiles for AMX) passes over them no faster than this, in GB of quantized weights
    # a second, however few rows the step has: a floor for steps above small_batch_rows.
    # 0: no such floor (GPU entries, CPUs whose larger steps read a dense copy).
    widen_gbs: float = 0.0
    memory_utilization: float = 0.9  # the share the engine may take (gpu_memory_utilization)
    buffer_fraction: float = 0.05  # activations, graphs, allocator slack, of the whole memory
    allreduce_latency_us: float = 8.0
    racks_max_nodes: int = 0  # > 0: the rack is built for this many nodes (NVL72: 18 trays)

    @property
    def nodes_per_rack(self) -> int:
        if self.racks_max_nodes:
            return self.racks_max_nodes
        return max(1, int(self.rack_kw // self.node_kw))

    def flops(self, weights_dtype: str) -> float:
        fp8 = weights_dtype in ("fp8",) and self.fp8_tflops > 0
        return (self.fp8_tflops if fp8 else self.bf16_tflops) * 1e12


HARDWARE: dict[str, Hardware] = {
    h.name: h
    for h in (
        # H100 SXM5 80 GB; DGX H100 is 10.2 kW; four per 45 kW air-cooled rack.
        Hardware("h100", 80, 3350, 989, 1979, 450, 8, 700, 8, 10.2, 45, "air", 1.4),
        # H200 SXM 141 GB: H100's compute with more and faster HBM3e.
        Hardware("h200", 141, 4800, 989, 1979, 450, 8, 700, 8, 10.2, 45, "air", 1.4),
        # HGX B200 180 GB; DGX B200 is 14.3 kW; four per 60 kW liquid-assisted rack.
        Hardware("b200", 180, 8000, 2250, 4500, 900, 8, 1000, 8, 14.3, 60, "liquid", 1.15),
        # GB200 NVL72: 72 GPUs in one NVLink domain, 18 trays of 4, about 132 kW per rack.
        Hardware(
            "gb200", 186, 8000, 2500, 5000, 900, 72, 1200, 4, 7.2, 132, "liquid", 1.15,
            racks_max_nodes=18,
        ),
        # MI300X 192 GB; an 8-GPU platform is about 10.5 kW.
        Hardware("mi300x", 192, 5300, 1307, 2615, 448, 8, 750, 8, 10.5, 45, "air", 1.4),
    )
}  # fmt: skip


def model(name: str) -> ModelSpec:
    try:
        return MODELS[name]
    except KeyError:
        raise ValueError(f"unknown model {name!r} (known: {', '.join(sorted(MODELS))})") from None


def hardware(name: str) -> Hardware:
    if name == "cpu":
        from tokenyard.planner.cpu import cpu_hardware

        return cpu_hardware()
    try:
        return HARDWARE[name]
    except KeyError:
        known = ", ".join([*sorted(HARDWARE), "cpu"])
        raise ValueError(f"unknown hardware {name!r} (known: {known})") from None


def custom_model(base: ModelSpec | None = None, **fields: float | int | str) -> ModelSpec:
    """A preset with some fields replaced, or a model from explicit fields alone."""
    if base is None:
        return ModelSpec(**fields)  # type: ignore[arg-type]
    return replace(base, **fields)  # type: ignore[arg-type]
