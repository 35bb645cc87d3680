"""POST /v1/embeddings: one pooling request per input, run by the workers' engines."""

from __future__ import annotations

import asyncio

import anyio
from fastapi import APIRouter, Request, Response
from fastapi.responses import JSONResponse

from tokenyard.api_errors import ApiError
from tokenyard.services.gateway.backend import TokenStream
from tokenyard.services.gateway.deps import Caller, State, cache_salt, charge_tokens
from tokenyard.services.gateway.embeddings import encoded, pooling_params, prompts, shortened
from tokenyard.services.gateway.routes.common import error_responses
from tokenyard.services.gateway.schemas import EmbeddingRequest, EmbeddingResponse, EmbeddingUsage
from tokenyard.services.gateway.serve import (
    CLIENT_CLOSED,
    REQUEST_ID_SCOPE_KEY,
    ClientGone,
    new_request_id,
    until_disconnect,
)
from tokenyard.services.gateway.state import GatewayState
from tokenyard.v1 import serving_pb2 as pb

router = APIRouter(prefix="/v1", tags=["embeddings"])


@router.post(
    "/embeddings",
    response_model=EmbeddingResponse,
    responses=error_responses(400, 401, 404, 422, 429, 503, 504),
)
async def create_embeddings(
    body: EmbeddingRequest, state: State, caller: Caller, request: Request
) -> Response:
    state.check_model(body.model)
    ids = await asyncio.to_thread(prompts, body, state.tokenizer, state.max_model_len())
    num_tokens = sum(map(len, ids))
    await charge_tokens(state, caller, num_tokens)
    pooling = body.pooling or state.settings.embedding_pooling
    params = pooling_params(pooling, cache_salt(caller, None))
    rid = new_request_id("embd")
    request.scope[REQUEST_ID_SCOPE_KEY] = rid
    try:
        vectors = await until_disconnect(request, pooled(state, rid, body.model, ids, params))
    except ClientGone:
        return Response(status_code=CLIENT_CLOSED)
    state.metrics.prompt_tokens.inc(num_tokens)
    answer = EmbeddingResponse(
        data=[
            encoded(i, shortened(v, body.dimensions), body.encoding_format)
            for i, v in enumerate(vectors)
        ],
        model=body.model,
        usage=EmbeddingUsage(prompt_tokens=num_tokens, total_tokens=num_tokens),
    )
    return JSONResponse(answer.model_dump())


async def pooled(
    state: GatewayState, rid: str, model: str, prompts: list[list[int]], params: pb.SamplingParams
) -> list[list[float]]:
    """Every prompt's vector, in order. All are queued before any is awaited, so the engine
    computes them in the same steps; what has not finished when this fails is cancelled."""
    rids = [f"{rid}-{i}" for i in range(len(prompts))]
    streams: list[TokenStream] = []
    done: set[int] = set()
    try:
        for sub_rid, ids in zip(rids, prompts, strict=True):
            streams.append(await state.backend.submit(sub_rid, model, ids, params))

        async def one(i: int) -> list[float]:
            vector = await _vector(streams[i])
            done.add(i)
            return vector

        tasks = [asyncio.create_task(one(i)) for i in range(len(streams))]
        try:
            return list(await asyncio.gather(*tasks))
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
    finally:
        with anyio.CancelScope(shield=True):  # also when the client left
            for i, stream in enumerate(streams):
                if i not in done:
                    await state.backend.cancel(rids[i], "embedding request ended")
                await stream.close()


async def _vector(stream: TokenStream) -> list[float]:
    async for chunk in stream:
        if chunk.finished:
            if not chunk.embedding:
                raise ApiError(
                    503, f"the request ended without an embedding ({chunk.finish_reason})"
                )
            return list(chunk.embedding)
    raise ApiError(503, "the request ended without an embedding")
