"""POST /tokenize and /detokenize, in vLLM's shape: the served model's tokenizer, no worker."""

from __future__ import annotations

import asyncio

from fastapi import APIRouter

from tokenyard.services.gateway import tools
from tokenyard.services.gateway.deps import Caller, State
from tokenyard.services.gateway.errors import invalid
from tokenyard.services.gateway.routes.common import error_responses
from tokenyard.services.gateway.schemas import (
    ChatCompletionRequest,
    DetokenizeRequest,
    DetokenizeResponse,
    TokenizeRequest,
    TokenizeResponse,
)
from tokenyard.services.gateway.translate import (
    Tokenizer,
    chat_messages,
    check_prompt_size,
    message_text,
)

router = APIRouter(tags=["tokenize"])
_ERRORS = error_responses(400, 401, 404, 422, 429)


def tokenize_ids(body: TokenizeRequest, tokenizer: Tokenizer) -> list[int]:
    """The ids the model would read for this prompt or these messages."""
    if body.prompt is not None:
        special = True if body.add_special_tokens is None else body.add_special_tokens
        return tokenizer.encode(body.prompt, add_special_tokens=special)
    if body.continue_final_message:
        raise invalid(
            "continue_final_message is not supported: the chat template closes every message",
            "continue_final_message",
        )
    assert body.messages is not None  # the schema asks for one of the two
    if not body.messages:
        raise invalid("'messages' must contain at least one message", "messages")
    chat = ChatCompletionRequest(model=body.model or "", messages=body.messages, tools=body.tools)
    native = body.tools and tools.template_knows_tools(getattr(tokenizer, "chat_template", None))
    try:
        ids = tokenizer.encode_chat(
            chat_messages(chat, tokenizer),
            add_generation_prompt=body.add_generation_prompt,
            **({"tools": body.tools} if native else {}),
        )
    except ValueError as exc:  # no template, or one that refuses these roles
        raise invalid(f"cannot render the chat template: {exc}", "messages") from exc
    if body.add_special_tokens:
        # What the tokenizer puts around any text (a BOS), before the template's own tokens.
        ids = tokenizer.encode("", add_special_tokens=True) + ids
    return ids


def _texts(body: TokenizeRequest) -> list[str]:
    if body.prompt is not None:
        return [body.prompt]
    return [message_text(m) for m in body.messages or []]


@router.post("/tokenize", response_model=TokenizeResponse, responses=_ERRORS)
async def tokenize(body: TokenizeRequest, state: State, _: Caller) -> TokenizeResponse:
    if body.model is not None:
        state.check_model(body.model)
    max_model_len = state.max_model_len()
    check_prompt_size(_texts(body), max_model_len, "messages" if body.messages else "prompt")
    tokenizer = state.tokenizer
    ids = await asyncio.to_thread(tokenize_ids, body, tokenizer)
    strs = [tokenizer.token_text(t) for t in ids] if body.return_token_strs else None
    return TokenizeResponse(
        count=len(ids), max_model_len=max_model_len, tokens=ids, token_strs=strs
    )


@router.post("/detokenize", response_model=DetokenizeResponse, responses=_ERRORS)
async def detokenize(body: DetokenizeRequest, state: State, _: Caller) -> DetokenizeResponse:
    if body.model is not None:
        state.check_model(body.model)
    vocab_size = state.tokenizer.vocab_size
    if any(t >= vocab_size for t in body.tokens):
        raise invalid(f"token ids must lie in [0, {vocab_size})", "tokens")
    text = await asyncio.to_thread(state.tokenizer.decode, body.tokens, False)
    return DetokenizeResponse(prompt=text)
