"""What the engine hands out: plain dataclasses, no torch, shared by the engine and its fake.

The worker, the gateway's converters and the tests read only these, so they never import
the model code to understand an engine's answer.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from tokenyard.engine.sampling_params import SamplingParams


@dataclass
class TokenLogprob:
    token_id: int
    logprob: float
    top: list[tuple[int, float]] = field(default_factory=list)  # (token id, logprob), best first


@dataclass(frozen=True)
class Energy:
    """Joules of the steps that computed a request's tokens since its previous output."""

    modelled: float
    measured: float | None  # None: no hardware counter read
    source: str  # "measured:rapl", "measured:nvml" or "modelled"


@dataclass
class RequestOutput:
    """The tokens one step added to one request."""

    request_id: str
    new_token_ids: list[int]
    new_text: str
    finished: bool
    finish_reason: str | None  # stop | length | abort | prefilled | None
    num_prompt_tokens: int
    num_output_tokens: int
    num_cached_tokens: int
    logprobs: list[TokenLogprob] | None = None
    embedding: list[float] | None = None  # a pooling request's answer (SamplingParams.pooling)
    # Set by the worker's engine loop (tokenyard.facilities.energy), not by the engine.
    energy: Energy | None = None


@dataclass
class TenantQueueStats:
    """One tenant's share of the engine's waiting queue (engine/fair_queue.py)."""

    num_waiting: int = 0  # sequences waiting now
    num_admitted: int = 0  # sequences admitted so far (first admissions only)
    wait_s_total: float = 0.0  # their summed time in the waiting queue
    num_tokens: int = 0  # tokens computed for it so far (its fair-share clock)


@dataclass
class ExpertBalanceStats:
    """Expert parallelism's per-rank load (engine/expert_balance.py), per sparse layer: max /
    mean of the tokens the ranks ran (1.0 = even)."""

    now: list[float]  # since the last rebalance (or the start), under today's placement
    before_last_rebalance: list[float]  # in the window the last rebalance measured; [] if none
    num_rebalances: int = 0  # placements applied so far


@dataclass
class EngineStats:
    num_running: int
    num_waiting: int
    num_free_blocks: int
    num_blocks: int
    prefix_cache_hits: int  # prompt tokens served from the prefix cache
    prefix_cache_queries: int  # prompt tokens looked up
    num_preemptions: int
    # Speculative decoding (zero when off): verifications, drafted tokens verified, and kept.
    spec_num_drafts: int = 0
    spec_draft_tokens: int = 0
    spec_accepted_tokens: int = 0
    spec_acceptance_rate: float = 0.0  # accepted / drafted
    spec_mean_accepted_length: float = 0.0  # tokens emitted per verification, the bonus included
    # MoE load balance: tokens routed to each expert so far, [moe layer][expert] ([] if dense)
    expert_tokens: list[list[int]] = field(default_factory=list)
    expert_balance: ExpertBalanceStats | None = None  # with expert parallelism only
    # Prompt tokens still to compute (queued and part-prefilled sequences): queued work.
    num_pending_prompt_tokens: int = 0
    tenants: dict[str, TenantQueueStats] = field(default_factory=dict)  # by tenant
    # LoRA adapters served (engine/lora.py; unloading ones left out) -> sequences running on
    # each now; and adapters copied into a model slot so far (swaps from host memory).
    loras: dict[str, int] = field(default_factory=dict)
    lora_swaps: int = 0
    lora_paths: dict[str, str] = field(default_factory=dict)  # served adapter -> its folder
    lora_room: int = 0  # adapters it can load more (max_cpu_loras less those held)


class UnknownAdapter(ValueError, LookupError):
    """A request or an unload named a LoRA adapter the engine does not hold (a ValueError:
    bad input, refused where the others are)."""

    def __init__(self, name: str, detail: str = "") -> None:
        super().__init__(f"the LoRA adapter {name!r} does not exist{detail}")
        self.name = name


@dataclass
class AdapterInfo:
    """A LoRA adapter the engine holds (engine/lora.py)."""

    name: str
    path: str
    rank: int
    slot: int | None  # the model slot holding it now, if any
    num_running: int  # running sequences pinning it
    unloading: bool


@dataclass
class ExportedSequence:
    """A prefilled request, as a decode worker needs it to continue (see engine/handoff.py)."""

    request_id: str
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    block_ids: list[int]  # physical blocks holding the prompt's KV
    num_computed_tokens: int
    params: SamplingParams


class NoFreeBlocks(RuntimeError):
    """The KV pool cannot hold what was asked for now; retry later or elsewhere."""


class RequestIdInUse(ValueError):
    """A sequence of this request id is already in the engine: a second start of a request
    that runs (or is held) here. The worker joins the running one; it is never the client's
    fault (a ValueError for callers that treat every refusal alike)."""

    def __init__(self, request_id: str) -> None:
        super().__init__(f"request id {request_id!r} is already in use")
        self.request_id = request_id
