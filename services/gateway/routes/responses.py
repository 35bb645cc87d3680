"""POST /v1/responses, GET and DELETE /v1/responses/{response_id} (OpenAI's Responses API),
served by the chat path; responses are stored per tenant (`store`, on by default)."""

from __future__ import annotations

import asyncio
import time
from typing import Any

from fastapi import APIRouter, Request
from fastapi import Response as HttpResponse
from pydantic import BaseModel

from tokenyard.api_errors import ApiError
from tokenyard.services.gateway.deps import Authenticated, Caller, Identity, State, admit_prepared
from tokenyard.services.gateway.responses_api.format import ResponsesFormat, new_response_id
from tokenyard.services.gateway.responses_api.schemas import (
    DeletedResponse,
    InputItemList,
    Response,
    ResponsesRequest,
)
from tokenyard.services.gateway.responses_api.translate import prepare_response
from tokenyard.services.gateway.routes.common import (
    GENERATION_ERRORS,
    error_responses,
    sse_response,
)
from tokenyard.services.gateway.serve import Generation
from tokenyard.services.gateway.state import GatewayState

router = APIRouter(prefix="/v1", tags=["responses"])


def owner_of(caller: Identity) -> str:
    """Whose a stored response is: the caller's tenant (everyone's on an open gateway)."""
    return caller.tenant or ""


def _missing(response_id: str) -> str:
    return f"no response with id '{response_id}' (it was not stored, has expired or was deleted)"


def not_found(response_id: str) -> ApiError:
    return ApiError(404, _missing(response_id), param="response_id", code="response_not_found")


def unknown_previous(response_id: str) -> ApiError:
    """A bad `previous_response_id` is a bad field of the request: 400, as OpenAI."""
    return ApiError(
        400, _missing(response_id), param="previous_response_id", code="response_not_found"
    )


async def _history(state: GatewayState, body: ResponsesRequest, owner: str) -> list[dict[str, Any]]:
    if body.previous_response_id is None:
        return []
    store = state.response_store()
    found = await asyncio.to_thread(store.get, body.previous_response_id, owner)
    if found is None:
        raise unknown_previous(body.previous_response_id)
    return found.history()


@router.post(
    "/responses",
    response_model=Response,
    responses={**sse_response("The response"), **GENERATION_ERRORS},
)
async def create_response(
    body: ResponsesRequest, state: State, caller: Caller, request: Request
) -> HttpResponse:
    state.check_model(body.model)
    owner = owner_of(caller)
    history = await _history(state, body, owner)
    prepared, context = await asyncio.to_thread(
        prepare_response,
        body,
        history,
        state.tokenizer,
        state.max_model_len(),
        state.settings.default_max_tokens,
        state.parsers,
    )
    await admit_prepared(state, caller, prepared)
    fmt = ResponsesFormat(
        rid=new_response_id(),
        request=body,
        created=int(time.time()),
        tool_names=prepared.tool_names,
        tool_parser=state.parsers.tool,
        reasoning=state.parsers.reasoning,
    )
    store = state.response_store() if body.store else None

    async def keep(response: BaseModel) -> None:
        assert store is not None
        try:
            await asyncio.to_thread(store.save, owner, response.model_dump(mode="json"), context)
        except Exception as exc:  # the answer exists; say plainly that it was not kept
            raise ApiError(503, f"the response could not be stored: {type(exc).__name__}") from exc

    generation = Generation(state, "responses", prepared, fmt, keep if store else None)
    return await generation.serve(request, body.model)


@router.get(
    "/responses/{response_id}/input_items",
    response_model=InputItemList,
    responses=error_responses(401, 404),
)
async def list_input_items(response_id: str, state: State, caller: Authenticated) -> InputItemList:
    """The items the response answered, oldest first (its whole chain's input)."""
    found = await asyncio.to_thread(state.response_store().get, response_id, owner_of(caller))
    if found is None:
        raise not_found(response_id)
    ids = [item.get("id") for item in found.context]
    return InputItemList(
        data=found.context, first_id=ids[0] if ids else None, last_id=ids[-1] if ids else None
    )


@router.get(
    "/responses/{response_id}",
    response_model=Response,
    responses=error_responses(401, 404),
)
async def get_response(response_id: str, state: State, caller: Authenticated) -> dict[str, Any]:
    found = await asyncio.to_thread(state.response_store().get, response_id, owner_of(caller))
    if found is None:
        raise not_found(response_id)
    return found.response


@router.delete(
    "/responses/{response_id}",
    response_model=DeletedResponse,
    responses=error_responses(401, 404),
)
async def delete_response(response_id: str, state: State, caller: Authenticated) -> DeletedResponse:
    deleted = await asyncio.to_thread(state.response_store().delete, response_id, owner_of(caller))
    if not deleted:
        raise not_found(response_id)
    return DeletedResponse(id=response_id)
