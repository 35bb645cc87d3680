"""POST /v1/completions (the legacy text endpoint)."""

from __future__ import annotations

import asyncio
import time

from fastapi import APIRouter, Request, Response

from tokenyard.services.gateway.deps import Caller, State, admit_prepared
from tokenyard.services.gateway.responses import CompletionFormat
from tokenyard.services.gateway.routes.common import GENERATION_ERRORS, sse_response
from tokenyard.services.gateway.schemas import CompletionRequest, CompletionResponse
from tokenyard.services.gateway.serve import Generation, new_request_id
from tokenyard.services.gateway.translate import prepare_completion

router = APIRouter(prefix="/v1", tags=["completions"])


@router.post(
    "/completions",
    response_model=CompletionResponse,
    responses={**sse_response("The completion"), **GENERATION_ERRORS},
)
async def create_completion(
    body: CompletionRequest, state: State, caller: Caller, request: Request
) -> Response:
    state.check_model(body.model)
    # Tokenizing a long prompt takes a while: off the event loop, which serves every stream.
    prepared = await asyncio.to_thread(
        prepare_completion,
        body,
        state.tokenizer,
        state.max_model_len(),
        state.settings.default_max_tokens,
    )
    await admit_prepared(state, caller, prepared)
    fmt = CompletionFormat(
        rid=new_request_id("cmpl"),
        model=body.model,
        created=int(time.time()),
        tokenizer=state.tokenizer,
        logprobs=body.logprobs is not None,
        include_usage=prepared.include_usage,
        n=prepared.n,
        echo=prepared.echo,
        num_prompts=len(prepared.prompts),
    )
    return await Generation(state, "completions", prepared, fmt).serve(request, body.model)
