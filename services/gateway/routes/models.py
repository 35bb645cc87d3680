"""GET /v1/models and /v1/models/{model}."""

from __future__ import annotations

from fastapi import APIRouter

from tokenyard.services.gateway.deps import Authenticated, State
from tokenyard.services.gateway.routes.common import error_responses
from tokenyard.services.gateway.schemas import ModelCard, ModelList

router = APIRouter(prefix="/v1", tags=["models"])


def _card(state: State, model: str) -> ModelCard:
    """A base model's card, or a LoRA adapter's with its base as `parent` (as vLLM lists
    them)."""
    _, adapter = state.resolve_model(model)
    return ModelCard(
        id=model,
        created=state.created,
        max_model_len=state.max_model_len() or None,
        root=model,
        parent=state.adapters()[adapter] if adapter else None,
    )


@router.get("/models", response_model=ModelList, responses=error_responses(401))
async def list_models(state: State, _: Authenticated) -> ModelList:
    return ModelList(data=[_card(state, m) for m in state.served_models()])


@router.get("/models/{model}", response_model=ModelCard, responses=error_responses(401, 404))
async def get_model(model: str, state: State, _: Authenticated) -> ModelCard:
    state.check_model(model)
    return _card(state, model)
