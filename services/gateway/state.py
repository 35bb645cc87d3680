"""What one gateway process holds while it runs, reached by routes through `deps.State`."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from functools import cached_property

from tokenyard.api_errors import ApiError
from tokenyard.services.gateway.backend import Backend
from tokenyard.services.gateway.keylimits import MemoryMinuteLimits, MinuteLimits
from tokenyard.services.gateway.keys import KeyStore
from tokenyard.services.gateway.metrics import GatewayMetrics
from tokenyard.services.gateway.parsers import Parsers, parsers_for
from tokenyard.services.gateway.ratelimit import RateLimiter
from tokenyard.services.gateway.readiness import OptionalServices
from tokenyard.services.gateway.responses_api.store import ResponseStore
from tokenyard.services.gateway.settings import GatewaySettings
from tokenyard.services.gateway.translate import Tokenizer


@dataclass
class GatewayState:
    settings: GatewaySettings
    backend: Backend
    tokenizer: Tokenizer
    limiter: RateLimiter
    model_id: str
    metrics: GatewayMetrics = field(default_factory=GatewayMetrics)
    keys: KeyStore | None = None  # API keys in SQL (settings.keys_db_url)
    minute_limits: MinuteLimits = field(default_factory=MemoryMinuteLimits)
    optional_services: OptionalServices = field(default_factory=lambda: OptionalServices({}))
    responses: ResponseStore | None = None  # the Responses API's stored responses
    created: int = field(default_factory=lambda: int(time.time()))

    @cached_property
    def parsers(self) -> Parsers:
        """The served model's tool-call and reasoning parsers (names checked by settings)."""
        return parsers_for(
            self.settings.tool_call_parser,
            self.settings.reasoning_parser,
            getattr(self.tokenizer, "chat_template", None),
        )

    def max_model_len(self) -> int:
        return self.settings.max_model_len or self.backend.fleet.max_model_len(time.monotonic())

    def served_models(self) -> list[str]:
        """The base models, then the LoRA adapters the live workers hold."""
        bases = self.base_models()
        return [*bases, *sorted(self.adapters().keys() - set(bases))]

    def base_models(self) -> list[str]:
        others = self.backend.fleet.models(time.monotonic()) - {self.model_id}
        return [self.model_id, *sorted(others)]

    def adapters(self) -> dict[str, str]:
        """LoRA adapter -> its base model, as the live workers' heartbeats say."""
        return self.backend.fleet.adapters(time.monotonic())

    def resolve_model(self, model: str) -> tuple[str, str]:
        """(the base model to route to, the LoRA adapter or "") of a request's `model`."""
        parent = self.adapters().get(model)
        if parent is None or model in self.base_models():
            return model, ""
        return parent, model

    def response_store(self) -> ResponseStore:
        if self.responses is None:
            raise ApiError(503, "this gateway has no store for responses: send store: false")
        return self.responses

    def check_model(self, model: str) -> None:
        if model not in self.served_models():
            raise ApiError(
                404,
                f"the model '{model}' does not exist; this server serves: "
                f"{', '.join(self.served_models())}",
                param="model",
                code="model_not_found",
            )
