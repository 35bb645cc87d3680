"""POST /v1/chat/completions."""

from __future__ import annotations

import asyncio
import time

from fastapi import APIRouter, Request, Response

from tokenyard.services.gateway.deps import Caller, State, admit_prepared
from tokenyard.services.gateway.responses import ChatFormat
from tokenyard.services.gateway.routes.common import GENERATION_ERRORS, sse_response
from tokenyard.services.gateway.schemas import (
    ChatCompletionRequest,
    ChatCompletionResponse,
)
from tokenyard.services.gateway.serve import Generation, new_request_id
from tokenyard.services.gateway.translate import prepare_chat

router = APIRouter(prefix="/v1", tags=["chat"])


@router.post(
    "/chat/completions",
    response_model=ChatCompletionResponse,
    responses={**sse_response("The completion"), **GENERATION_ERRORS},
)
async def create_chat_completion(
    body: ChatCompletionRequest, state: State, caller: Caller, request: Request
) -> Response:
    state.check_model(body.model)
    # Tokenizing a long prompt takes a while: off the event loop, which serves every stream.
    prepared = await asyncio.to_thread(
        prepare_chat,
        body,
        state.tokenizer,
        state.max_model_len(),
        state.settings.default_max_tokens,
        state.parsers,
    )
    await admit_prepared(state, caller, prepared)
    fmt = ChatFormat(
        rid=new_request_id("chatcmpl"),
        model=body.model,
        created=int(time.time()),
        tokenizer=state.tokenizer,
        logprobs=body.logprobs,
        include_usage=prepared.include_usage,
        n=prepared.n,
        tool_names=prepared.tool_names,
        parsers=state.parsers,
        include_reasoning=body.include_reasoning,
    )
    return await Generation(state, "chat", prepared, fmt).serve(request, body.model)
