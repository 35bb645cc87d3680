"""The Responses API's bodies as pydantic models: the request, its input items, the
Response object, and the typed events of a stream.

NOTE: unlike the chat and completion bodies, a Responses request forbids fields it does
not know (and `errors.from_validation` names them): a field this server cannot honour is
a 400 naming it, never silently dropped. Fields accepted only in their default form
(`include`, `truncation`, `background`, `service_tier`, `text.verbosity`) are typed so.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Discriminator, Field, RootModel, Tag

from tokenyard.services.gateway.schemas import (
    MAX_MESSAGES,
    MAX_TOOLS,
    EnergyUsage,
    JsonObject,
    Name,
    Text,
    TokenCount,
)

MAX_METADATA = 16  # OpenAI's limit on metadata pairs
ItemStatus = Literal["in_progress", "completed", "incomplete"]


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", populate_by_name=True, serialize_by_alias=True)


# --- input items --------------------------------------------------------------------------


class InputText(_Strict):
    type: Literal["input_text"]
    text: Text


class InputOutputText(_Strict):
    """An earlier answer's text, sent back as input (as the SDKs do)."""

    type: Literal["output_text"]
    text: Text
    annotations: Annotated[list[JsonObject], Field(max_length=0)] = Field(default_factory=list)
    logprobs: list[JsonObject] | None = None


ContentPart = Annotated[InputText | InputOutputText, Field(discriminator="type")]


class InputMessage(_Strict):
    type: Literal["message"] = "message"
    role: Literal["user", "assistant", "system", "developer"]
    # NOTE: the list first: a bad list is then reported by its bad part, not as "not a string".
    content: Annotated[list[ContentPart], Field(max_length=MAX_MESSAGES)] | Text
    id: Name | None = None
    status: ItemStatus | None = None
    phase: Literal["commentary", "final_answer"] | None = None


class FunctionCallInput(_Strict):
    """A call the model made earlier (an output item sent back as input)."""

    type: Literal["function_call"]
    call_id: Name
    name: Name
    arguments: Text  # JSON text
    id: Name | None = None
    status: ItemStatus | None = None


class FunctionCallOutputInput(_Strict):
    """The caller's result of a function call, answering `call_id`."""

    type: Literal["function_call_output"]
    call_id: Name
    output: Annotated[list[InputText], Field(max_length=MAX_MESSAGES)] | Text
    id: Name | None = None
    status: ItemStatus | None = None


def _item_kind(item: Any) -> str:
    """A message may leave out its `type`."""
    if isinstance(item, dict):
        return str(item.get("type", "message"))
    return str(getattr(item, "type", "message"))


InputItem = Annotated[
    Annotated[InputMessage, Tag("message")]
    | Annotated[FunctionCallInput, Tag("function_call")]
    | Annotated[FunctionCallOutputInput, Tag("function_call_output")],
    Discriminator(_item_kind),
]


# --- tools and text format ----------------------------------------------------------------


class FunctionTool(_Strict):
    type: Literal["function"]
    name: Name
    description: Text | None = None
    parameters: JsonObject | None = None
    strict: bool | None = None


class FunctionChoice(_Strict):
    type: Literal["function"]
    name: Name


ToolChoice = Literal["none", "auto", "required"] | FunctionChoice


class FormatText(_Strict):
    type: Literal["text"]


class FormatJsonObject(_Strict):
    type: Literal["json_object"]


class FormatJsonSchema(_Strict):
    type: Literal["json_schema"]
    name: Name
    schema_: JsonObject = Field(alias="schema")
    description: Text | None = None
    strict: bool | None = None


TextFormat = Annotated[
    FormatText | FormatJsonObject | FormatJsonSchema, Field(discriminator="type")
]


class TextConfig(_Strict):
    format: TextFormat = Field(default_factory=lambda: FormatText(type="text"))
    # A hint this server cannot follow: only OpenAI's default is accepted.
    verbosity: Literal["medium"] | None = None


# --- the request --------------------------------------------------------------------------


class ResponsesRequest(_Strict):
    model: Name
    input: Annotated[list[InputItem], Field(max_length=MAX_MESSAGES)] | Text | None = None
    instructions: Text | None = None
    previous_response_id: Name | None = None
    store: bool = True
    stream: bool = False
    max_output_tokens: TokenCount | None = None
    temperature: Annotated[float, Field(ge=0.0, le=2.0)] | None = None
    top_p: Annotated[float, Field(gt=0.0, le=1.0)] | None = None
    tools: Annotated[list[FunctionTool], Field(max_length=MAX_TOOLS)] | None = None
    tool_choice: ToolChoice | None = None
    parallel_tool_calls: bool | None = None
    text: TextConfig | None = None
    metadata: Annotated[dict[Name, Text], Field(max_length=MAX_METADATA)] | None = None
    user: Name | None = None
    # Accepted in their default form only.
    include: Annotated[list[Name], Field(max_length=0)] | None = None
    truncation: Literal["disabled"] | None = None
    background: Literal[False] | None = None
    service_tier: Literal["auto", "default"] | None = None


# --- the Response object ------------------------------------------------------------------


class OutputText(BaseModel):
    type: Literal["output_text"] = "output_text"
    text: str
    annotations: list[dict[str, Any]] = Field(default_factory=list)
    logprobs: list[dict[str, Any]] = Field(default_factory=list)


class OutputMessage(BaseModel):
    type: Literal["message"] = "message"
    id: str
    role: Literal["assistant"] = "assistant"
    status: ItemStatus
    content: list[OutputText]


class FunctionCallItem(BaseModel):
    type: Literal["function_call"] = "function_call"
    id: str
    call_id: str
    name: str
    arguments: str
    status: ItemStatus


OutputItem = Annotated[OutputMessage | FunctionCallItem, Field(discriminator="type")]


class InputTokensDetails(BaseModel):
    cached_tokens: int = 0


class OutputTokensDetails(BaseModel):
    reasoning_tokens: int = 0


class ResponseUsage(EnergyUsage):
    input_tokens: int
    input_tokens_details: InputTokensDetails
    output_tokens: int
    output_tokens_details: OutputTokensDetails
    total_tokens: int


class IncompleteDetails(BaseModel):
    reason: Literal["max_output_tokens"]


class ResponseError(BaseModel):
    code: str
    message: str


ResponseStatus = Literal["in_progress", "completed", "incomplete", "failed"]


class Response(BaseModel):
    id: str
    object: Literal["response"] = "response"
    created_at: int
    status: ResponseStatus
    model: str
    output: list[OutputItem]
    instructions: str | None = None
    previous_response_id: str | None = None
    max_output_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    tools: list[FunctionTool] = Field(default_factory=list)
    tool_choice: ToolChoice = "auto"
    parallel_tool_calls: bool = True
    text: TextConfig = Field(default_factory=TextConfig)
    truncation: Literal["disabled"] = "disabled"
    store: bool = True
    background: bool = False
    metadata: dict[str, str] = Field(default_factory=dict)
    user: str | None = None
    usage: ResponseUsage | None = None
    error: ResponseError | None = None
    incomplete_details: IncompleteDetails | None = None


class DeletedResponse(BaseModel):
    id: str
    object: Literal["response.deleted"] = "response.deleted"
    deleted: Literal[True] = True


class InputItemList(BaseModel):
    """GET /v1/responses/{id}/input_items: the conversation the response answered."""

    object: Literal["list"] = "list"
    data: list[dict[str, Any]]
    first_id: str | None = None
    last_id: str | None = None
    has_more: bool = False


# --- stream events ------------------------------------------------------------------------


class _Event(BaseModel):
    sequence_number: int


class LifecycleEvent(_Event):
    type: Literal[
        "response.created",
        "response.in_progress",
        "response.completed",
        "response.incomplete",
        "response.failed",
    ]
    response: Response


class OutputItemEvent(_Event):
    type: Literal["response.output_item.added", "response.output_item.done"]
    output_index: int
    item: OutputItem


class ContentPartEvent(_Event):
    type: Literal["response.content_part.added", "response.content_part.done"]
    item_id: str
    output_index: int
    content_index: int
    part: OutputText


class TextDeltaEvent(_Event):
    type: Literal["response.output_text.delta"]
    item_id: str
    output_index: int
    content_index: int
    delta: str
    logprobs: list[dict[str, Any]] = Field(default_factory=list)


class TextDoneEvent(_Event):
    type: Literal["response.output_text.done"]
    item_id: str
    output_index: int
    content_index: int
    text: str
    logprobs: list[dict[str, Any]] = Field(default_factory=list)


class ArgumentsDeltaEvent(_Event):
    type: Literal["response.function_call_arguments.delta"]
    item_id: str
    output_index: int
    delta: str


class ArgumentsDoneEvent(_Event):
    type: Literal["response.function_call_arguments.done"]
    item_id: str
    output_index: int
    name: str
    arguments: str


StreamEvent = Annotated[
    LifecycleEvent
    | OutputItemEvent
    | ContentPartEvent
    | TextDeltaEvent
    | TextDoneEvent
    | ArgumentsDeltaEvent
    | ArgumentsDoneEvent,
    Field(discriminator="type"),
]


class ResponseStreamEvent(RootModel[StreamEvent]):
    """One event of a streamed response: `event: <type>` and `data: <this JSON>`."""
