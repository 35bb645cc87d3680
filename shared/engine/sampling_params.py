"""Per-request sampling settings, validated when made so bad input fails before it queues."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from tokenyard.engine.fair_queue import check_priority
from tokenyard.kv.hashing import adapter_salt

GuidedKind = Literal["json_schema", "json_object", "regex", "choice", "grammar", "llguidance"]
GUIDED_KINDS: tuple[GuidedKind, ...] = (
    "json_schema",
    "json_object",
    "regex",
    "choice",
    "grammar",
    "llguidance",
)
Pooling = Literal["mean", "last"]
POOLINGS: tuple[Pooling, ...] = ("mean", "last")


@dataclass(frozen=True)
class GuidedSpec:
    """What the output must follow (engine/guided.py). `value`: the JSON schema text, the
    regex, the Lark grammar, or the JSON list of choices; empty for json_object; for
    llguidance, a grammar already in llguidance's own JSON form (made by the gateway, e.g. a
    reasoning block before another grammar: `grammar.after_reasoning`)."""

    kind: GuidedKind
    value: str = ""


@dataclass
class SamplingParams:
    max_tokens: int = 16
    temperature: float = 1.0  # 0 = greedy
    top_p: float = 1.0
    top_k: int = -1  # -1 = off
    min_p: float = 0.0
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    logprobs: int | None = None  # None: none; 0: the chosen token's; N: and the top N
    prompt_logprobs: int | None = None  # same, for every prompt token after the first
    include_stop_str_in_output: bool = False
    # Prefix-cache namespace: only sequences with the same salt share cached blocks.
    cache_salt: str = ""
    min_tokens: int = 0  # EOS and stop token ids are held back until this many are out
    logit_bias: dict[int, float] = field(default_factory=dict)  # token id -> added to its logit
    guided: GuidedSpec | None = None  # a grammar the output must follow
    # An embedding request (engine/pooling.py): the prompt is computed, nothing is sampled,
    # and the one output carries the pooled final hidden state.
    pooling: Pooling | None = None
    # Scheduling, not sampling; they travel with the params as cache_salt does
    # (engine/fair_queue.py): lower `priority` = more urgent (vLLM's convention), and the
    # tenant whose fair share of tokens this request is charged to.
    priority: int = 0
    tenant: str = ""
    # The LoRA adapter the request runs on, by its name (engine/lora.py); "" = the base model.
    lora: str = ""

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self._check()

    def _check(self) -> None:
        if not isinstance(self.max_tokens, int) or self.max_tokens <= 0:
            raise ValueError(f"max_tokens must be a positive integer, got {self.max_tokens!r}")
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k == 0 or self.top_k < -1:
            raise ValueError(f"top_k must be -1 (off) or a positive integer, got {self.top_k}")
        if not 0.0 <= self.min_p <= 1.0:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not -2.0 <= value <= 2.0:
                raise ValueError(f"{name} must be in [-2, 2], got {value}")
        if self.repetition_penalty <= 0:
            raise ValueError(f"repetition_penalty must be > 0, got {self.repetition_penalty}")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and not 0 <= value <= 20:
                raise ValueError(f"{name} must be between 0 and 20, got {value}")
        if not 0 <= self.min_tokens <= self.max_tokens:
            raise ValueError(f"min_tokens must be in [0, max_tokens], got {self.min_tokens}")
        if any(not -100.0 <= v <= 100.0 for v in self.logit_bias.values()):
            raise ValueError("logit_bias values must be in [-100, 100]")
        if any(not s for s in self.stop):
            raise ValueError("stop strings must not be empty")
        if self.pooling is not None and self.pooling not in POOLINGS:
            raise ValueError(f"pooling must be one of {POOLINGS}, got {self.pooling!r}")
        check_priority(self.priority)

    @property
    def prefix_salt(self) -> str:
        """The prefix cache's salt: cache_salt, and the adapter when there is one."""
        return adapter_salt(self.cache_salt, self.lora)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def has_penalties(self) -> bool:
        return bool(
            self.presence_penalty or self.frequency_penalty or self.repetition_penalty != 1.0
        )
