"""The gateway's one settings object (environment prefix TOKENYARD_GATEWAY_)."""

from __future__ import annotations

import secrets
from typing import Annotated, Literal

from pydantic import Field, field_validator
from pydantic_settings import BaseSettings, NoDecode, SettingsConfigDict

from tokenyard.engine.fair_queue import PRIORITY_MAX, PRIORITY_MIN
from tokenyard.services.gateway.reasoning import syntax_named
from tokenyard.services.gateway.tool_parsers import parser_named


class GatewaySettings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="TOKENYARD_GATEWAY_", protected_namespaces=())

    nats_url: str = "nats://127.0.0.1:4222"
    # This gateway's own prefix for its requests' tokens and cancels (ty.tokens.<id>.<request>):
    # with per-gateway NATS users (`tokenyard up`) it must be the id the user was made for.
    # Unset: a fresh random id per process.
    instance_id: str = Field(
        default_factory=lambda: f"gw-{secrets.token_hex(4)}", pattern=r"^[A-Za-z0-9_-]{1,64}$"
    )
    # Copies of the prefill work queue on a NATS cluster (3 on a 3-node cluster); the
    # workers' TOKENYARD_WORKER_JETSTREAM_REPLICAS must say the same.
    jetstream_replicas: int = Field(default=1, ge=1, le=5)
    host: str = "127.0.0.1"
    port: int = Field(default=8000, ge=1, le=65535)

    # The tokenizer comes from the model the workers serve; None = the default model.
    model_path: str | None = None
    # The name clients put in "model" (None = the model file's name, as the workers say it);
    # heartbeats may add the names workers report.
    model_id: str | None = None
    # 0 = take it from the workers' heartbeats (the longest a live worker serves; the router
    # places a request only on a worker whose own context holds it).
    max_model_len: int = Field(default=0, ge=0)
    block_size: int = Field(default=16, ge=1)
    # The admin API (POST /v1/load_lora_adapter, /v1/unload_lora_adapter) takes this token
    # (Authorization: Bearer or X-Admin-Token); unset: admin actions are disabled.
    admin_token: str | None = None
    lora_timeout_s: float = Field(default=60.0, gt=0)  # a worker reads and checks the adapter
    # How the model writes tool calls (vLLM's names: hermes, llama3_json, mistral; qwen is
    # hermes). None = the family the chat template writes, hermes when it names none.
    tool_call_parser: str | None = None
    # How the model marks its reasoning (deepseek_r1, qwen3, granite, generic:<open>,<close>).
    # None = no reasoning parser: the thinking stays in the content.
    reasoning_parser: str | None = None

    # Empty (and no keys_db_url) = open gateway. From the environment: a comma-separated list.
    api_keys: Annotated[list[str], NoDecode] = Field(default_factory=list)
    # API keys made with `tokenyard keys create` (SQLAlchemy URL); their per-minute limits
    # are counted in Redis when redis_url is set, else in this gateway's memory.
    keys_db_url: str | None = None

    # Per-key token bucket: `rate_limit_rps` requests per second, bursts up to
    # `rate_limit_burst`. 0 = no limit. Redis when redis_url is set, else in memory.
    rate_limit_rps: float = Field(default=0.0, ge=0)
    rate_limit_burst: int = Field(default=20, ge=1)
    redis_url: str | None = None

    connect_timeout_s: float = Field(default=15.0, gt=0)  # first NATS connection, at start
    route_timeout_s: float = Field(default=2.0, gt=0)
    # No chunk for this long: the request fails with a clear error instead of hanging.
    # Generous because a CPU worker may queue a request behind many others.
    idle_timeout_s: float = Field(default=120.0, gt=0)
    # No chunk for this long while the worker that owes the next one misses its heartbeats:
    # fail. NOTE: longer than a prefill job's redelivery to another worker after a kill -9
    # (ack wait plus 3 missed heartbeats: 3-5 s in the benchmark, then a new prefill), which
    # would still save the request; 20 s left clients hanging on truly lost requests.
    dead_worker_grace_s: float = Field(default=10.0, gt=0)
    # A request whose worker died waits this long (when longer than dead_worker_grace_s)
    # for a worker to go on with it: before its first token the prefill work queue
    # redelivers its job once a worker is back; mid-stream a live worker resumes it, and
    # with none live (one worker, or a whole role down) the gateway holds the stream for
    # the restarted one. A restarted worker loads its model first (10-30 s on a busy CPU
    # host), so this wait is longer.
    prefill_redelivery_grace_s: float = Field(default=60.0, gt=0)
    # Heartbeats older than this many intervals mark a worker dead (the router's rule).
    missed_heartbeats: int = Field(default=3, ge=1)
    retry_after_s: int = Field(default=1, ge=1)
    # Cap on generated tokens when a request gives no max_tokens (None = the rest of the
    # context, as vLLM; a CPU worker then runs for minutes that nobody asked for).
    default_max_tokens: int | None = Field(default=1024, ge=1)
    # /v1/embeddings: how the final hidden states become one vector when a request does not
    # say ("last": the last prompt token's, as vLLM pools a causal LM; "mean": every token's).
    embedding_pooling: Literal["mean", "last"] = "last"
    # A request still running after this many seconds ends with 504 and is cancelled on the
    # workers (0 = no deadline).
    request_timeout_s: float = Field(default=600.0, ge=0)
    # Larger bodies get 413 before they are read (the context is 8k tokens: ~50 kB of text).
    max_body_bytes: int = Field(default=4 * 1024 * 1024, ge=1024)
    shutdown_grace_s: float = Field(default=10.0, ge=0)  # open requests at SIGTERM
    # How long an idle client connection stays open. Longer than clients' own pools keep
    # one (httpx 5 s) and load balancers' idle timeouts (often 60 s): a server that closes
    # first can close it just as a client sends on it, and the client sees a reset
    # connection, not an answer (uvicorn's own default is 5 s).
    keep_alive_s: int = Field(default=75, ge=1)
    log_level: str = "info"
    # The router's TOKENYARD_ROUTER_DISAGGREGATION: /ready asks the router's placement rule
    # whether a request could be placed now, and "always" forbids a decode worker's local
    # prefill.
    router_disaggregation: Literal["auto", "always", "never"] = "auto"
    # Stored responses of the Responses API (previous_response_id, GET /v1/responses/{id}):
    # a SQLAlchemy URL, shared by every gateway of a deployment (PostgreSQL); None = a
    # SQLite file of this process's own, gone when it stops.
    responses_db_url: str | None = None
    # How long a stored response is kept (OpenAI keeps them 30 days); 0 = until deleted.
    responses_retention_s: float = Field(default=30 * 24 * 3600.0, ge=0)
    # How often expired responses are deleted (reads never return one past its time).
    responses_purge_interval_s: float = Field(default=300.0, gt=0)
    # Default `priority` per API key, for requests that name none (lower = more urgent; a
    # request's own field wins): from the environment "name=priority,...", where a name is a
    # key's prefix or its tenant (the prefix wins). Keys named nowhere get 0.
    priority_tiers: Annotated[dict[str, int], NoDecode] = Field(default_factory=dict)
    # Optional services whose /health the gateway's /ready reports (never waits on): from
    # the environment "name=url,name=url", e.g. "kvcache=http://127.0.0.1:9101/health".
    optional_services: Annotated[dict[str, str], NoDecode] = Field(default_factory=dict)

    @field_validator("tool_call_parser")
    @classmethod
    def _known_tool_parser(cls, value: str | None) -> str | None:
        if value:
            parser_named(value)  # ValueError naming the known ones
        return value or None

    @field_validator("reasoning_parser")
    @classmethod
    def _known_reasoning_parser(cls, value: str | None) -> str | None:
        if value:
            syntax_named(value)
        return value or None

    @field_validator("optional_services", mode="before")
    @classmethod
    def _split_services(cls, value: object) -> object:
        if not isinstance(value, str):
            return value
        pairs = [item.strip().split("=", 1) for item in value.split(",") if item.strip()]
        if any(len(pair) != 2 or not all(pair) for pair in pairs):
            raise ValueError(f"expected name=url,name=url; got {value!r}")
        return {name.strip(): url.strip() for name, url in pairs}

    @field_validator("priority_tiers", mode="before")
    @classmethod
    def _split_tiers(cls, value: object) -> object:
        if not isinstance(value, str):
            return value
        pairs = [item.strip().rsplit("=", 1) for item in value.split(",") if item.strip()]
        if any(len(pair) != 2 or not all(pair) for pair in pairs):
            raise ValueError(f"expected name=priority,name=priority; got {value!r}")
        return {name.strip(): priority.strip() for name, priority in pairs}

    @field_validator("priority_tiers", mode="after")
    @classmethod
    def _tiers_in_range(cls, value: dict[str, int]) -> dict[str, int]:
        for name, priority in value.items():
            if not PRIORITY_MIN <= priority <= PRIORITY_MAX:
                raise ValueError(
                    f"priority of {name!r} must be in [{PRIORITY_MIN}, {PRIORITY_MAX}], "
                    f"got {priority}"
                )
        return value

    @field_validator("api_keys", mode="before")
    @classmethod
    def _split_keys(cls, value: object) -> object:
        if isinstance(value, str):
            return [key.strip() for key in value.split(",") if key.strip()]
        return value
