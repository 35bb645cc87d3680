"""The worker's Prometheus metrics, named as vLLM names them under the `tokenyard:` prefix.

Dashboards and alerts written for `vllm:num_requests_running`, `vllm:kv_cache_usage_perc`,
`vllm:time_to_first_token_seconds` and the rest work on `tokenyard:...` unchanged but for
the prefix. Labels: worker, role, model. They live in the process-wide registry, which the
worker's ops server serves at /metrics.
"""

from __future__ import annotations

import time
from typing import Any

from prometheus_client import Counter, Gauge, Histogram

from tokenyard.engine.outputs import EngineStats, ExpertBalanceStats, TenantQueueStats

LABELS = ("worker", "role", "model")
# vLLM's request-latency buckets, cut at two minutes.
_LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 20, 40, 80, 120)
_TOKEN_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 1, 2.5, 5)

RUNNING = Gauge("tokenyard:num_requests_running", "Sequences in the running batch", LABELS)
WAITING = Gauge("tokenyard:num_requests_waiting", "Sequences waiting to be scheduled", LABELS)
KV_USAGE = Gauge("tokenyard:kv_cache_usage_perc", "KV-cache blocks in use, 0 to 1", LABELS)
PREFIX_QUERIES = Counter(
    "tokenyard:prefix_cache_queries", "Prompt tokens looked up in the prefix cache", LABELS
)
PREFIX_HITS = Counter(
    "tokenyard:prefix_cache_hits", "Prompt tokens served from the prefix cache", LABELS
)
PREEMPTIONS = Counter("tokenyard:num_preemptions", "Sequences preempted", LABELS)
EXPERT_TOKENS = Counter(
    "tokenyard:moe_expert_tokens",
    "Tokens routed to each expert of each MoE layer (load balance)",
    (*LABELS, "layer", "expert"),
)
# Expert parallelism's placement balancer (engine/expert_balance.py): max / mean tokens per
# rank in each MoE layer (1.0 = even), since the last rebalance (window "current") and in
# the window the last rebalance measured, before it moved experts (window "before_rebalance").
EXPERT_RANK_IMBALANCE = Gauge(
    "tokenyard:moe_rank_load_imbalance",
    "Max / mean tokens per expert-parallel rank in each MoE layer (1.0 = even)",
    (*LABELS, "layer", "window"),
)
EXPERT_REBALANCES = Counter(
    "tokenyard:moe_expert_rebalances", "Expert placements recomputed and applied", LABELS
)
# Speculative decoding, as vLLM counts it: acceptance rate = accepted / draft tokens, mean
# accepted length = (accepted + drafts) / drafts (the target's own token counted).
SPEC_DRAFTS = Counter(
    "tokenyard:spec_decode_num_drafts", "Verifications of drafted tokens (one per sequence)", LABELS
)
SPEC_DRAFT_TOKENS = Counter(
    "tokenyard:spec_decode_num_draft_tokens", "Drafted tokens verified", LABELS
)
SPEC_ACCEPTED_TOKENS = Counter(
    "tokenyard:spec_decode_num_accepted_tokens", "Drafted tokens the target kept", LABELS
)
# Per tenant (engine/fair_queue.py): the engine's waiting queue and each tenant's share.
# Mean queue wait = rate(..._queue_wait_seconds) / rate(..._admitted).
TENANT_LABELS = (*LABELS, "tenant")
TENANT_WAITING = Gauge(
    "tokenyard:tenant_requests_waiting", "Sequences waiting in the engine, by tenant", TENANT_LABELS
)
TENANT_ADMITTED = Counter(
    "tokenyard:tenant_admitted", "Sequences admitted from the waiting queue", TENANT_LABELS
)
TENANT_WAIT = Counter(
    "tokenyard:tenant_queue_wait_seconds",
    "Summed time admitted sequences spent in the engine's waiting queue",
    TENANT_LABELS,
)
TENANT_TOKENS = Counter(
    "tokenyard:tenant_tokens", "Tokens computed for the tenant (its fair share)", TENANT_LABELS
)
# Per LoRA adapter (engine/lora.py): sequences running on it, and swaps into a model slot.
LORA_LABELS = (*LABELS, "lora")
LORA_RUNNING = Gauge(
    "tokenyard:lora_requests_running", "Sequences running on each LoRA adapter", LORA_LABELS
)
LORA_SWAPS = Counter(
    "tokenyard:lora_swaps", "LoRA adapters copied from host memory into a model slot", LABELS
)
PROMPT_TOKENS = Counter("tokenyard:prompt_tokens", "Prompt tokens prefilled here", LABELS)
GENERATION_TOKENS = Counter(
    "tokenyard:generation_tokens", "Tokens generated and streamed here", LABELS
)
REQUEST_SUCCESS = Counter(
    "tokenyard:request_success",
    "Requests ended here, by finish reason",
    (*LABELS, "finished_reason"),
)
TTFT = Histogram(
    "tokenyard:time_to_first_token_seconds",
    "Arrival at the gateway to the first token streamed (where it was made)",
    LABELS,
    buckets=_LATENCY_BUCKETS,
)
ITL = Histogram(
    "tokenyard:inter_token_latency_seconds",
    "Time between two streamed steps of one request",
    LABELS,
    buckets=_TOKEN_BUCKETS,
)
E2E = Histogram(
    "tokenyard:e2e_request_latency_seconds",
    "Arrival at the gateway to the last token, on the worker that finished the request",
    LABELS,
    buckets=_LATENCY_BUCKETS,
)
QUEUE_TIME = Histogram(
    "tokenyard:request_queue_time_seconds",
    "Arrival at the gateway to admission into the engine (work queue and admission cap)",
    LABELS,
    buckets=_LATENCY_BUCKETS,
)

# The KV tiers as a worker sees them. Hit rate per tier: kv_hit_tokens{tier} / prompt_tokens
# (tier "local": this worker's prefix cache; "shared": fetched from the KV-cache service).
KV_HIT_TOKENS = Counter(
    "tokenyard:kv_hit_tokens",
    "Prompt tokens not computed, by the tier that held them",
    (*LABELS, "tier"),
)
KV_FETCH_BYTES = Counter(
    "tokenyard:kv_fetch_bytes", "Bytes of KV blocks fetched from the KV-cache service", LABELS
)
KV_OFFLOAD_BYTES = Counter(
    "tokenyard:kv_offload_bytes",
    "Bytes of KV blocks sent to the KV-cache service, by what they were (prompt or reply)",
    (*LABELS, "source"),
)
KV_OFFLOAD_DROPPED_BYTES = Counter(
    "tokenyard:kv_offload_dropped_bytes",
    "Bytes of KV blocks not sent to the KV-cache service: over the bandwidth budget",
    (*LABELS, "source"),
)
KV_OFFLOAD_FAILURES = Counter(
    "tokenyard:kv_offload_failures", "Offloads to the KV-cache service that failed", LABELS
)


class WorkerMetrics:
    """One worker's children of the metrics above, and the engine counters last seen."""

    def __init__(self, worker: str, role: str, model: str) -> None:
        self.labels = {"worker": worker, "role": role, "model": model}
        # Totals since start that the heartbeats carry (the counters above are per process
        # and label set, not readable back per worker without reaching into prometheus).
        self.kv_offload_bytes = 0
        self.kv_fetch_bytes = 0
        # prefix queries, prefix hits, preemptions, drafts, draft tokens, accepted tokens
        self._engine_totals = (0, 0, 0, 0, 0, 0)
        self._expert_totals: list[list[int]] = []  # [moe layer][expert]
        self._rebalances = 0
        self._tenant_totals: dict[str, TenantQueueStats] = {}
        self._loras: set[str] = set()
        self._lora_swaps = 0
        self._children: dict[Any, Any] = {}  # by metric (hashed by identity)

    def child(self, metric: Any) -> Any:
        """This worker's child of `metric`, looked up once. Each token's two observations
        made it per call: prometheus_client's labels() (a lock, a tuple, a dict lookup) was
        30-40 of the worker's event-loop samples in 12 s at 32 concurrent requests."""
        child = self._children.get(metric)
        if child is None:
            child = self._children[metric] = metric.labels(**self.labels)
        return child

    def on_stats(self, stats: EngineStats) -> None:
        """Engine stats (cumulative counters) from a heartbeat."""
        self.child(RUNNING).set(stats.num_running)
        self.child(WAITING).set(stats.num_waiting)
        used = stats.num_blocks - stats.num_free_blocks
        self.child(KV_USAGE).set(used / stats.num_blocks if stats.num_blocks else 0.0)
        totals = (
            stats.prefix_cache_queries,
            stats.prefix_cache_hits,
            stats.num_preemptions,
            stats.spec_num_drafts,
            stats.spec_draft_tokens,
            stats.spec_accepted_tokens,
        )
        counters = (
            PREFIX_QUERIES,
            PREFIX_HITS,
            PREEMPTIONS,
            SPEC_DRAFTS,
            SPEC_DRAFT_TOKENS,
            SPEC_ACCEPTED_TOKENS,
        )
        for metric, now, before in zip(counters, totals, self._engine_totals, strict=True):
            if now > before:
                self.child(metric).inc(now - before)
        self._engine_totals = totals
        self._on_expert_tokens(stats.expert_tokens)
        if stats.expert_balance is not None:
            self._on_expert_balance(stats.expert_balance)
        self._on_tenants(stats.tenants)
        self._on_loras(stats)

    def _on_loras(self, stats: EngineStats) -> None:
        for name in self._loras - stats.loras.keys():  # unloaded: no stale series
            LORA_RUNNING.remove(*self.labels.values(), name)
        for name, running in stats.loras.items():
            LORA_RUNNING.labels(**self.labels, lora=name).set(running)
        self._loras = set(stats.loras)
        self.child(LORA_SWAPS).inc(stats.lora_swaps - self._lora_swaps)
        self._lora_swaps = stats.lora_swaps

    def _on_tenants(self, tenants: dict[str, TenantQueueStats]) -> None:
        for tenant, now in tenants.items():
            before = self._tenant_totals.get(tenant, TenantQueueStats())
            labels = {**self.labels, "tenant": tenant}
            TENANT_WAITING.labels(**labels).set(now.num_waiting)
            for metric, grown in (
                (TENANT_ADMITTED, now.num_admitted - before.num_admitted),
                (TENANT_WAIT, now.wait_s_total - before.wait_s_total),
                (TENANT_TOKENS, now.num_tokens - before.num_tokens),
            ):
                if grown > 0:
                    metric.labels(**labels).inc(grown)
        self._tenant_totals = tenants

    def _on_expert_tokens(self, counts: list[list[int]]) -> None:
        for layer, row in enumerate(counts):
            before = self._expert_totals[layer] if layer < len(self._expert_totals) else []
            for expert, now in enumerate(row):
                seen = before[expert] if expert < len(before) else 0
                if now > seen:
                    labels = {**self.labels, "layer": str(layer), "expert": str(expert)}
                    EXPERT_TOKENS.labels(**labels).inc(now - seen)
        self._expert_totals = [list(row) for row in counts]

    def _on_expert_balance(self, balance: ExpertBalanceStats) -> None:
        for window, loads in (
            ("current", balance.now),
            ("before_rebalance", balance.before_last_rebalance),
        ):
            for layer, value in enumerate(loads):
                labels = {**self.labels, "layer": str(layer), "window": window}
                EXPERT_RANK_IMBALANCE.labels(**labels).set(value)
        rebalances = self.child(EXPERT_REBALANCES)  # 0 from the first stats, not absent
        if balance.num_rebalances > self._rebalances:
            rebalances.inc(balance.num_rebalances - self._rebalances)
        self._rebalances = balance.num_rebalances

    def on_prompt(self, num_tokens: int, queued_s: float) -> None:
        self.child(PROMPT_TOKENS).inc(num_tokens)
        self.child(QUEUE_TIME).observe(max(0.0, queued_s))

    def on_kv_hits(self, local_tokens: int, shared_tokens: int) -> None:
        if local_tokens > 0:
            KV_HIT_TOKENS.labels(**self.labels, tier="local").inc(local_tokens)
        if shared_tokens > 0:
            KV_HIT_TOKENS.labels(**self.labels, tier="shared").inc(shared_tokens)

    def on_offload(self, source: str, sent_bytes: int, dropped_bytes: int) -> None:
        if sent_bytes > 0:
            KV_OFFLOAD_BYTES.labels(**self.labels, source=source).inc(sent_bytes)
            self.kv_offload_bytes += sent_bytes
        if dropped_bytes > 0:
            KV_OFFLOAD_DROPPED_BYTES.labels(**self.labels, source=source).inc(dropped_bytes)

    def on_fetch(self, nbytes: int) -> None:
        KV_FETCH_BYTES.labels(**self.labels).inc(nbytes)
        self.kv_fetch_bytes += nbytes

    def timer(self, *, first_token_here: bool, arrival_unix_ns: int = 0) -> RequestTimer:
        return RequestTimer(self, first_token_here, since_arrival_s(arrival_unix_ns))


def since_arrival_s(arrival_unix_ns: int) -> float:
    """Seconds since the gateway took the request (0 when it did not say)."""
    return max(0.0, time.time() - arrival_unix_ns / 1e9) if arrival_unix_ns else 0.0


class RequestTimer:
    """Times one request's stream on this worker: TTFT (where its first token is made),
    the gaps between its streamed steps, and its end."""

    def __init__(self, metrics: WorkerMetrics, first_token_here: bool, age_s: float) -> None:
        self.metrics = metrics
        # NOTE: timed from the request's arrival at the gateway, as vLLM times from arrival
        # at its front end: TTFT and E2E then include queueing and the hand-off.
        self.started = time.monotonic() - age_s
        self.first_token_here = first_token_here
        self.last_output: float | None = None

    def on_tokens(self, num_tokens: int) -> None:
        if num_tokens <= 0:
            return
        now = time.monotonic()
        if self.last_output is not None:
            self.metrics.child(ITL).observe(now - self.last_output)
        elif self.first_token_here:
            self.metrics.child(TTFT).observe(now - self.started)
        self.last_output = now
        self.metrics.child(GENERATION_TOKENS).inc(num_tokens)

    def on_finish(self, reason: str) -> None:
        """A request that ended here (not one prefilled for another worker or handed back)."""
        REQUEST_SUCCESS.labels(**self.metrics.labels, finished_reason=reason).inc()
        self.metrics.child(E2E).observe(time.monotonic() - self.started)
