"""/v1/embeddings: inputs -> prompts for pooling requests, pooled vectors -> the answer. Pure.

Each input is its own pooling request on the workers (pb.SamplingParams.pooling): the engine
computes its prompt, batched with whatever else runs, and answers with the pooled, normalized
final hidden state. `dimensions` keeps the first components and normalizes again (Matryoshka
style), which is what OpenAI's shortened embeddings are.
"""

from __future__ import annotations

import base64
import math
import struct
from typing import cast

from tokenyard.services.gateway.errors import invalid
from tokenyard.services.gateway.schemas import Embedding, EmbeddingRequest
from tokenyard.services.gateway.translate import Tokenizer, check_prompt, check_prompt_size
from tokenyard.v1 import serving_pb2 as pb


def inputs(request: EmbeddingRequest) -> list[str] | list[list[int]]:
    """The request's inputs, one per embedding: strings or token-id lists."""
    given = request.input
    if isinstance(given, str):
        return [given]
    if not given:
        raise invalid("'input' must not be empty", "input")
    if isinstance(given[0], int):
        return [cast(list[int], given)]
    return cast(list[str] | list[list[int]], given)


def prompts(request: EmbeddingRequest, tokenizer: Tokenizer, max_model_len: int) -> list[list[int]]:
    """Each input's token ids, checked as a prompt is (not empty, fits, in the vocabulary)."""
    items = inputs(request)
    texts = [item for item in items if isinstance(item, str)]
    check_prompt_size(texts, max_model_len, "input")
    out = []
    for item in items:
        ids = item if isinstance(item, list) else _encode(tokenizer, item)
        check_prompt(ids, max_model_len, "input", tokenizer.vocab_size)
        out.append(ids)
    return out


def _encode(tokenizer: Tokenizer, text: str) -> list[int]:
    return tokenizer.encode(text) if text else []


def pooling_params(pooling: str, cache_salt: str) -> pb.SamplingParams:
    # max_tokens 1: the router and the token limits count no output beyond it, and a prefill
    # worker runs it whole instead of handing it to a decode worker.
    return pb.SamplingParams(max_tokens=1, pooling=pooling, cache_salt=cache_salt)


def shortened(vector: list[float], dimensions: int | None) -> list[float]:
    """The first `dimensions` components, normalized again; refused past the model's size."""
    if dimensions is None or dimensions == len(vector):
        return vector
    if dimensions > len(vector):
        raise invalid(
            f"dimensions ({dimensions}) is larger than the model's embedding size ({len(vector)})",
            "dimensions",
        )
    head = vector[:dimensions]
    norm = math.sqrt(sum(x * x for x in head)) or 1.0
    return [x / norm for x in head]


def encoded(index: int, vector: list[float], encoding_format: str) -> Embedding:
    if encoding_format == "base64":
        packed = struct.pack(f"<{len(vector)}f", *vector)
        return Embedding(index=index, embedding=base64.b64encode(packed).decode())
    return Embedding(index=index, embedding=vector)
