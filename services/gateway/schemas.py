"""OpenAI's request and response bodies as pydantic models: the OpenAPI document is built from them.

vLLM's sampling extensions (`top_k`, `min_p`, `repetition_penalty`, `ignore_eos`,
`stop_token_ids`) ride in the same body, as OpenAI clients send them through `extra_body`.
Unknown fields are ignored, as vLLM does, so clients that send newer fields keep working.
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Field,
    SerializerFunctionWrapHandler,
    model_serializer,
    model_validator,
)

from tokenyard.api_errors import ErrorDetail, ErrorResponse  # noqa: F401  (part of this API's schemas)
from tokenyard.engine.fair_queue import PRIORITY_MAX, PRIORITY_MIN

# What the protobuf carries (serving.proto: uint32 max_tokens and stop_token_ids, int32 top_k):
# a larger value would be a 500 at serialization instead of a 400 here.
UINT32_MAX = 2**32 - 1
INT32_MAX = 2**31 - 1
# vLLM's bound on `seed` (a C long); the protobuf's uint64 takes it modulo 2^64.
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1
# List and string sizes: generous for real use, small enough that one body cannot make the
# gateway tokenize or the workers match megabytes of text.
MAX_MESSAGES = 2048
MAX_TOOLS = 128
MAX_STOP = 16
MAX_STOP_CHARS = 1024
MAX_STOP_TOKEN_IDS = 256
MAX_NAME_CHARS = 256
MAX_CHOICES = 256  # guided_choice


def valid_unicode(value: str) -> str:
    """JSON may carry lone surrogates ("\\ud800"); they are not text and cannot be encoded."""
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise ValueError(f"not valid Unicode: a lone surrogate at position {exc.start}") from None
    return value


def _unicode_everywhere(value: object) -> None:
    if isinstance(value, str):
        valid_unicode(value)
    elif isinstance(value, dict):
        for key, item in value.items():
            _unicode_everywhere(key)
            _unicode_everywhere(item)
    elif isinstance(value, list):
        for item in value:
            _unicode_everywhere(item)


Text = Annotated[str, AfterValidator(valid_unicode)]
Name = Annotated[str, Field(max_length=MAX_NAME_CHARS), AfterValidator(valid_unicode)]
StopString = Annotated[str, Field(max_length=MAX_STOP_CHARS), AfterValidator(valid_unicode)]
Stop = StopString | Annotated[list[StopString], Field(max_length=MAX_STOP)] | None
Penalty = Annotated[float, Field(ge=-2.0, le=2.0)]
TokenCount = Annotated[int, Field(ge=1, le=UINT32_MAX)]
TokenId = Annotated[int, Field(ge=0, le=UINT32_MAX)]


def _json_text(value: dict | None) -> dict | None:
    _unicode_everywhere(value)
    return value


JsonObject = Annotated[dict, AfterValidator(_json_text)]


class _Body(BaseModel):
    model_config = ConfigDict(extra="ignore")


class StreamOptions(_Body):
    include_usage: bool = False


class SamplingFields(_Body):
    """The fields both endpoints share."""

    model: Name
    max_tokens: TokenCount | None = None
    temperature: Annotated[float, Field(ge=0.0, le=2.0)] | None = None
    top_p: Annotated[float, Field(gt=0.0, le=1.0)] | None = None
    n: Annotated[int, Field(ge=1, le=128)] = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: Stop = None
    presence_penalty: Penalty = 0.0
    frequency_penalty: Penalty = 0.0
    seed: Annotated[int, Field(ge=INT64_MIN, le=INT64_MAX)] | None = None
    user: Name | None = None
    logit_bias: (
        Annotated[dict[str, Annotated[float, Field(ge=-100.0, le=100.0)]], Field(max_length=1024)]
        | None
    ) = None
    # vLLM's extensions
    top_k: Annotated[int, Field(ge=-1, le=INT32_MAX)] = -1
    min_p: Annotated[float, Field(ge=0.0, le=1.0)] = 0.0
    repetition_penalty: Annotated[float, Field(gt=0.0, le=2.0)] = 1.0
    ignore_eos: bool = False
    # Only requests with the same salt share cached prefixes (vLLM's field). A caller with
    # an API key is always inside its tenant's own namespace, whatever it sends here.
    cache_salt: Name | None = None
    stop_token_ids: Annotated[
        list[Annotated[int, Field(ge=0, le=UINT32_MAX)]], Field(max_length=MAX_STOP_TOKEN_IDS)
    ] = Field(default_factory=list)
    min_tokens: Annotated[int, Field(ge=0, le=UINT32_MAX)] = 0
    guided_json: Text | JsonObject | None = None
    guided_regex: Text | None = None
    guided_choice: Annotated[list[Text], Field(max_length=MAX_CHOICES)] | None = None
    guided_grammar: Text | None = None  # Lark, as llguidance reads it
    # vLLM's scheduling extension: lower = more urgent. Unset: the API key's default tier
    # (the gateway's priority_tiers), else 0.
    priority: Annotated[int, Field(ge=PRIORITY_MIN, le=PRIORITY_MAX)] | None = None


# --- chat ---------------------------------------------------------------------------------


class TextPart(_Body):
    type: Literal["text"]
    text: Text


class FunctionCall(_Body):
    name: Name
    arguments: Text  # JSON text


class ToolCall(_Body):
    id: Name
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(_Body):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Text | Annotated[list[TextPart], Field(max_length=MAX_MESSAGES)] | None = None
    name: Name | None = None
    tool_calls: Annotated[list[ToolCall], Field(max_length=MAX_TOOLS)] | None = None
    tool_call_id: Name | None = None  # a tool result answers this call

    @model_validator(mode="after")
    def _tool_answers_name_their_call(self) -> ChatMessage:
        if self.role == "tool" and not self.tool_call_id:
            raise ValueError("a message with role 'tool' needs 'tool_call_id'")
        return self


class ChatCompletionRequest(SamplingFields):
    messages: Annotated[list[ChatMessage], Field(max_length=MAX_MESSAGES)]
    max_completion_tokens: TokenCount | None = None
    logprobs: bool = False
    top_logprobs: Annotated[int, Field(ge=0, le=20)] | None = None
    tools: Annotated[list[JsonObject], Field(max_length=MAX_TOOLS)] | None = None
    tool_choice: Name | JsonObject | None = None
    parallel_tool_calls: bool = True
    response_format: JsonObject | None = None
    # vLLM's: extra variables for the chat template (e.g. Qwen3's enable_thinking).
    chat_template_kwargs: JsonObject | None = None
    # OpenAI's; refused when set: the served model's reasoning has no effort setting.
    reasoning_effort: str | None = None
    # vLLM's: false leaves the reasoning (with a reasoning parser) out of the answer.
    include_reasoning: bool = True


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None


class ChatTokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob]


class ChoiceLogprobs(BaseModel):
    content: list[ChatTokenLogprob] | None


class AssistantMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None
    # The model's thinking, split from the answer by the served model's reasoning parser.
    reasoning_content: str | None = None
    tool_calls: list[ToolCall] | None = None

    @model_serializer(mode="wrap")
    def _omit_absent_calls(self, handler: SerializerFunctionWrapHandler) -> dict:
        # OpenAI leaves `tool_calls` out of a message that makes none (and a message
        # without reasoning has no `reasoning_content`).
        data = handler(self)
        for key in ("tool_calls", "reasoning_content"):
            if data.get(key) is None:
                data.pop(key, None)
        return data


FinishReason = Literal["stop", "length", "tool_calls", "abort", "error"]


class ChatChoice(BaseModel):
    index: int
    message: AssistantMessage
    logprobs: ChoiceLogprobs | None = None
    finish_reason: FinishReason | None


class PromptTokensDetails(BaseModel):
    cached_tokens: int = 0


ENERGY_FIELDS = ("energy_joules", "energy_source", "energy_joules_modelled")


class EnergyUsage(BaseModel):
    # Tokenyard's own (docs/autoscaling.md): the joules of the engine steps that computed
    # this request, measured by a hardware counter ("measured:rapl", "measured:nvml") where
    # every worker that served it reads one, else the facilities power model's ("modelled");
    # energy_joules_modelled beside a measured figure. Absent where no worker reported any.
    energy_joules: float | None = None
    energy_source: str | None = None
    energy_joules_modelled: float | None = None

    @model_serializer(mode="wrap")
    def _omit_absent_energy(self, handler: SerializerFunctionWrapHandler) -> dict:
        data = handler(self)
        for key in ENERGY_FIELDS:
            if data.get(key) is None:
                data.pop(key, None)
        return data


class Usage(EnergyUsage):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails | None = None


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage


class FunctionCallDelta(BaseModel):
    name: str | None = None
    arguments: str | None = None


class ToolCallDelta(BaseModel):
    index: int
    id: str | None = None
    type: Literal["function"] | None = None
    function: FunctionCallDelta


class DeltaMessage(BaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None
    reasoning_content: str | None = None
    tool_calls: list[ToolCallDelta] | None = None


class ChatChunkChoice(BaseModel):
    index: int
    delta: DeltaMessage
    logprobs: ChoiceLogprobs | None = None
    finish_reason: FinishReason | None = None


class ChatCompletionChunk(BaseModel):
    """One `data:` event of a streamed chat completion."""

    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: Usage | None = None


# --- completions --------------------------------------------------------------------------


class CompletionRequest(SamplingFields):
    # A string, token ids, or a batch of either: a list of strings or of token-id lists.
    prompt: Text | list[Text] | list[TokenId] | list[list[TokenId]]
    max_tokens: TokenCount | None = 16  # OpenAI's default for this endpoint
    logprobs: Annotated[int, Field(ge=0, le=20)] | None = None
    echo: bool = False
    suffix: Text | None = None
    best_of: Annotated[int, Field(ge=1, le=128)] | None = None


class CompletionLogprobs(BaseModel):
    tokens: list[str]
    token_logprobs: list[float]
    top_logprobs: list[dict[str, float]]
    text_offset: list[int]


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: FinishReason | None


class CompletionResponse(BaseModel):
    """The whole answer, or (streamed) one `data:` event of it."""

    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None


# --- embeddings ---------------------------------------------------------------------------

MAX_EMBEDDING_INPUTS = 2048  # OpenAI's limit on inputs per request


class EmbeddingRequest(_Body):
    model: Name
    # A string, a list of strings, token ids, or a list of token-id lists: one embedding each.
    input: (
        Text
        | Annotated[list[Text], Field(max_length=MAX_EMBEDDING_INPUTS)]
        | list[TokenId]
        | Annotated[list[list[TokenId]], Field(max_length=MAX_EMBEDDING_INPUTS)]
    )
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: Annotated[int, Field(ge=1, le=UINT32_MAX)] | None = None
    user: Name | None = None
    # Tokenyard's extension: how the model's final hidden states become one vector (the
    # gateway's setting when unset).
    pooling: Literal["mean", "last"] | None = None


class Embedding(BaseModel):
    object: Literal["embedding"] = "embedding"
    index: int
    embedding: list[float] | str  # a str: base64 of little-endian float32s


class EmbeddingUsage(BaseModel):
    prompt_tokens: int
    total_tokens: int


class EmbeddingResponse(BaseModel):
    object: Literal["list"] = "list"
    data: list[Embedding]
    model: str
    usage: EmbeddingUsage


# --- tokenize, detokenize (vLLM's shape) ---------------------------------------------------


class TokenizeRequest(_Body):
    """A text `prompt`, or chat `messages` rendered by the chat template (one of the two)."""

    model: Name | None = None
    prompt: Text | None = None
    messages: Annotated[list[ChatMessage], Field(max_length=MAX_MESSAGES)] | None = None
    tools: Annotated[list[JsonObject], Field(max_length=MAX_TOOLS)] | None = None
    # vLLM's defaults: special tokens for a prompt, none for messages (the template has them).
    add_special_tokens: bool | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    return_token_strs: bool = False

    @model_validator(mode="after")
    def _prompt_or_messages(self) -> TokenizeRequest:
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("send exactly one of 'prompt' and 'messages'")
        return self


class TokenizeResponse(BaseModel):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None = None


class DetokenizeRequest(_Body):
    model: Name | None = None
    tokens: list[TokenId]


class DetokenizeResponse(BaseModel):
    prompt: str


# --- models, health, errors ---------------------------------------------------------------


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "tokenyard"
    max_model_len: int | None = None
    root: str | None = None  # what it serves: the model itself, or a LoRA adapter's name
    parent: str | None = None  # a LoRA adapter's base model (None for a base model)


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class Health(BaseModel):
    status: Literal["ok"] = "ok"


class WorkerInfo(BaseModel):
    worker_id: str
    role: str
    model: str
    num_running: int
    num_waiting: int
    num_free_blocks: int
    num_blocks: int
    age_s: float


class Readiness(BaseModel):
    ready: bool
    nats_connected: bool
    roles: dict[str, int]
    workers: list[WorkerInfo]
    reason: str | None = None  # why not ready
    # The stack's optional services (KV cache, telemetry, facilities): "up" or "down: why".
    # One that is down leaves the gateway ready: requests are served without it.
    optional_services: dict[str, str] = {}
