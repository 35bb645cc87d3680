"""A serving plan from a model, a workload and a kind of accelerator.

    plan = make_plan(catalog.model("llama-3.1-70b"), catalog.hardware("h100"), Workload(users=1000))
    plan.to_json()["gpus_total"]

The steps, each a formula in docs/planning.md:
1. parallelism: the smallest tensor-parallel size (a power of two inside the scale-up
   domain) whose replica holds the weights and KV for `min_batch` full conversations;
   pipeline stages across domains only when the whole domain cannot;
2. decode: the largest batch whose step time meets the inter-token target and whose KV
   fits; replicas = users / batch;
3. prefill: requests per second times prompt tokens against one replica's prefill rate at
   a target utilisation, TTFT from the M/D/1 queue plus the KV hand-off;
4. facilities: nodes, racks, IT power at full load, facility power (PUE) and the water
   flow that carries the heat away at a given temperature rise.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field

from tokenyard.planner.catalog import Hardware, ModelSpec
from tokenyard.planner.roofline import Deployment

WATER_KJ_PER_KG_K = 4.186


@dataclass(frozen=True)
class Workload:
    users: int = 100  # concurrent conversations, each streaming its answer
    tps_per_user: float = 20.0  # output tokens per second each user must see
    prompt_len: int = 1024
    output_len: int = 256
    ttft_slo_ms: float = 2000.0
    itl_slo_ms: float = 0.0  # 0: 1000 / tps_per_user
    think_time_s: float = 0.0  # between a user's answer and their next prompt
    prefix_hit_rate: float = 0.0  # share of prompt tokens served from the prefix cache

    @property
    def itl_target_s(self) -> float:
        per_user = 1.0 / self.tps_per_user
        return min(self.itl_slo_ms / 1e3, per_user) if self.itl_slo_ms > 0 else per_user

    @property
    def request_rate(self) -> float:
        """Requests per second the users send: one per answer, back to back."""
        return self.users / (self.output_len / self.tps_per_user + self.think_time_s)


@dataclass(frozen=True)
class PlanSettings:
    min_batch: int = 8  # a replica must hold at least this many full conversations
    prefill_utilization: float = 0.7  # keep prefill queues short
    network_gbs: float = 50.0  # between prefill and decode replicas (400 Gb/s)
    coolant_delta_t_c: float = 10.0
    max_pp: int = 16


@dataclass
class Plan:
    model: str
    hardware: str
    weights_dtype: str
    kv_dtype: str
    tp: int
    pp: int
    ep: int
    gpus_per_replica: int
    memory_per_gpu_gb: dict[str, float]
    kv_capacity_tokens: int
    kv_capacity_seqs: int
    decode_batch: int
    decode_itl_ms: float
    decode_tok_s_per_replica: float
    decode_replicas: int
    requests_per_s: float
    prefill_tok_s_per_replica: float
    prefill_replicas: int
    ttft_ms: float
    gpus_total: int
    nodes: int
    racks: int
    it_power_kw: float
    facility_power_kw: float
    coolant_flow_lpm: float
    warnings: list[str] = field(default_factory=list)
    workload: dict = field(default_factory=dict)

    def to_json(self) -> dict:
        return asdict(self)

    def up_args(self) -> list[str]:
        """`tokenyard up`'s flags for one replica of each pool of this plan (the stack on one
        host; the replica counts are the fleet's)."""
        args = [
            "--tensor-parallel-size", str(self.tp),
            "--pipeline-parallel-size", str(self.pp),
        ]  # fmt: skip
        if self.ep > 1:
            args += ["--expert-parallel-size", str(self.ep)]
        return args


class PlanError(ValueError):
    """The model cannot be served on this hardware at all (say, weights beyond every layout)."""


def layouts(hw: Hardware, s: PlanSettings) -> list[tuple[int, int]]:
    """Every (tp, pp) the planner may choose on `hw`, in the order it tries them: tensor
    parallelism in powers of two up to the scale-up domain, then pipeline stages of the
    whole domain."""
    tps = [t for t in (1, 2, 4, 8, 16, 32, 64) if t <= hw.domain]
    return [(tp, 1) for tp in tps] + [(tps[-1], pp) for pp in range(2, s.max_pp + 1)]


def expert_parallel_size(model: ModelSpec, tp: int, pp: int = 1) -> int:
    """The plan's ep: a MoE model's experts spread over the tensor-parallel ranks; in
    pipeline stages they are sliced by tensor parallelism instead (the engine does not
    combine expert parallelism with stages yet)."""
    return tp if model.is_moe and pp == 1 else 1


def choose_parallelism(
    model: ModelSpec, hw: Hardware, workload: Workload, dtypes: tuple[str, str], s: PlanSettings
) -> Deployment:
    need = s.min_batch * (workload.prompt_len + workload.output_len)
    for tp, pp in layouts(hw, s):
        dep = Deployment(model, hw, tp, pp, *dtypes)
        if dep.kv_capacity_tokens() >= need:
            return dep
    weights_gb = Deployment(model, hw, 1, 1, *dtypes).weight_bytes / 1e9
    tp, _ = layouts(hw, s)[-1]
    raise PlanError(
        f"{model.name} ({weights_gb:.0f} GB of {dtypes[0]} weights) with KV for "
        f"{s.min_batch} conversations does not fit {s.max_pp} pipeline stages of "
        f"{tp} x {hw.name}"
    )


def decode_batch(dep: Deployment, workload: Workload, cap_seqs: int) -> int:
    """The largest batch meeting the ITL target (at least 1), within the KV capacity."""
    context = workload.prompt_len + workload.output_len / 2
    target = workload.itl_target_s

    def ok(b: int) -> bool:
        return dep.decode_step_s(b, context) <= target

    if cap_seqs <= 1 or not ok(1):
        return 1
    lo, hi = 1, 2
    while hi <= cap_seqs and ok(hi):
        lo, hi = hi, hi * 2
    hi = min(hi, cap_seqs + 1)
    while hi - lo > 1:  # ok(lo), not ok(hi) or hi beyond capacity
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if ok(mid) else (lo, mid)
    return lo


def make_plan(
    model: ModelSpec,
    hw: Hardware,
    workload: Workload,
    *,
    weights_dtype: str = "bf16",
    kv_dtype: str = "bf16",
    settings: PlanSettings | None = None,
) -> Plan:
    s = settings or PlanSettings()
    warnings: list[str] = []
    dep = choose_parallelism(model, hw, workload, (weights_dtype, kv_dtype), s)
    conversation = workload.prompt_len + workload.output_len
    cap_tokens = dep.kv_capacity_tokens()
    cap_seqs = cap_tokens // conversation
    batch = decode_batch(dep, workload, cap_seqs)
    context = workload.prompt_len + workload.output_len / 2
    itl = dep.decode_step_s(batch, context)
    if itl > workload.itl_target_s:
        warnings.append(
            f"inter-token target {workload.itl_target_s * 1e3:.0f} ms unmet even at batch 1 "
            f"({itl * 1e3:.0f} ms): use more tensor parallelism or faster accelerators"
        )
    decode_replicas = math.ceil(workload.users / batch)

    cached = int(workload.prompt_len * workload.prefix_hit_rate)
    new_tokens = workload.prompt_len - cached
    service_s = dep.prefill_s(new_tokens, cached)
    rate = workload.request_rate
    prefill_replicas = max(1, math.ceil(rate * service_s / s.prefill_utilization))
    rho = rate * service_s / prefill_replicas
    wait_s = rho * service_s / (2 * (1 - rho))  # M/D/1 (per replica, even split)
    ttft = wait_s + service_s + dep.kv_transfer_s(workload.prompt_len, s.network_gbs) + itl
    if ttft * 1e3 > workload.ttft_slo_ms:
        warnings.append(
            f"TTFT {ttft * 1e3:.0f} ms exceeds the {workload.ttft_slo_ms:.0f} ms target: "
            "one prompt's prefill is too long for this replica"
        )

    gpus = (prefill_replicas + decode_replicas) * dep.gpus
    nodes = math.ceil(gpus / hw.per_node)
    racks = math.ceil(nodes / hw.nodes_per_rack)
    it_kw = nodes * hw.node_kw
    memory = {k: round(v / 1e9, 2) for k, v in dep.memory_per_gpu().items()}
    return Plan(
        model=model.name,
        hardware=hw.name,
        weights_dtype=weights_dtype,
        kv_dtype=kv_dtype,
        tp=dep.tp,
        pp=dep.pp,
        ep=expert_parallel_size(model, dep.tp, dep.pp),
        gpus_per_replica=dep.gpus,
        memory_per_gpu_gb={
            "weights": memory["weights"],
            "kv": memory["kv"],
            "buffers": memory["buffers"],
        },
        kv_capacity_tokens=cap_tokens,
        kv_capacity_seqs=cap_seqs,
        decode_batch=batch,
        decode_itl_ms=round(itl * 1e3, 2),
        decode_tok_s_per_replica=round(batch / itl, 1),
        decode_replicas=decode_replicas,
        requests_per_s=round(rate, 3),
        prefill_tok_s_per_replica=round(new_tokens / service_s, 1),
        prefill_replicas=prefill_replicas,
        ttft_ms=round(ttft * 1e3, 1),
        gpus_total=gpus,
        nodes=nodes,
        racks=racks,
        it_power_kw=round(it_kw, 1),
        facility_power_kw=round(it_kw * hw.pue, 1),
        coolant_flow_lpm=round(coolant_flow_lpm(it_kw, s.coolant_delta_t_c), 1),
        warnings=warnings,
        workload=asdict(workload),
    )


def coolant_flow_lpm(heat_kw: float, delta_t_c: float) -> float:
    """Water flow that carries `heat_kw` away warming by `delta_t_c`: P = m_dot x c_p x dT."""
    return heat_kw / (WATER_KJ_PER_KG_K * delta_t_c) * 60.0
