"""OpenAI API request and response models (pydantic), and the API error type.

Requests accept the OpenAI fields the router implements plus vLLM's sampling
extras (``top_k``, ``min_p``, ``repetition_penalty``, ``min_tokens``,
``ignore_eos``, ``stop_token_ids``, ``skip_special_tokens``). Fields a request
model does not declare are kept in ``model_extra`` and refused by
``services.router.fields.check_fields``; nested objects ignore theirs.
"""

from __future__ import annotations

import dataclasses
from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    StrictInt,
    StrictStr,
    model_serializer,
)

from services.router.structured import StructuredOutputFields
from services.router.tools import ToolFields
from shared.engine.sampling_params import InvalidRequestError, SamplingParams


def _not_bool(value: Any) -> Any:
    """JSON ``true``/``false`` are not numbers, though pydantic's lax mode reads them as 1/0."""
    if isinstance(value, bool):
        raise ValueError("a number is required, not a boolean")
    return value


NotBool = BeforeValidator(_not_bool)
Int64 = Annotated[int, Field(ge=-(2**63), le=2**63 - 1), NotBool]

# Numeric ranges, enforced here and published in /openapi.json (the OpenAI API's where it has one).
MAX_N = 128
MAX_STOP_STRINGS = 4
INT32_MAX = 2**31 - 1
Temperature = Annotated[float, Field(ge=0, le=2, allow_inf_nan=False), NotBool]
Probability = Annotated[float, Field(ge=0, le=1, allow_inf_nan=False), NotBool]
Penalty = Annotated[float, Field(ge=-2, le=2, allow_inf_nan=False), NotBool]
RepetitionPenalty = Annotated[float, Field(gt=0, le=100, allow_inf_nan=False), NotBool]
TopK = Annotated[int, Field(ge=-1, le=INT32_MAX), NotBool]
TokenCount = Annotated[int, Field(ge=1, le=INT32_MAX), NotBool]
TokenId = Annotated[int, Field(ge=0, le=INT32_MAX), NotBool]
# Published bounds only: serving.check_top_logprobs refuses values outside them, naming the field.
NumLogprobs = Annotated[int, Field(json_schema_extra={"minimum": 0, "maximum": 20}), NotBool]
StopString = Annotated[str, Field(min_length=1)]
# Roles the OpenAI chat API accepts.
Role = Literal["system", "developer", "user", "assistant", "tool", "function"]


class APIError(Exception):
    """An error answered in the OpenAI shape ``{"error": {message, type, param, code}}``."""

    def __init__(
        self,
        status_code: int,
        message: str,
        err_type: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
    ) -> None:
        super().__init__(message)
        self.status_code = status_code
        self.message = message
        self.err_type = err_type
        self.param = param
        self.code = code

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.err_type, "param": self.param, "code": self.code}}


def bad_request(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(400, message, "invalid_request_error", param, code)


# ---------------------------------------------------------------- requests


class _Request(BaseModel):
    model_config = ConfigDict(extra="ignore")


class RequestBody(BaseModel):
    """A request body: undeclared fields are kept, so that they can be refused by name."""

    model_config = ConfigDict(extra="allow")


class StreamOptions(RequestBody):
    include_usage: bool = False
    continuous_usage_stats: bool = False  # vLLM: usage on every chunk


class SamplingRequest(RequestBody):
    """Fields common to ``/v1/completions`` and ``/v1/chat/completions``."""

    model: str | None = None
    n: Annotated[int, Field(ge=1, le=MAX_N), NotBool] = 1
    temperature: Temperature | None = None
    top_p: Annotated[float, Field(gt=0, le=1, allow_inf_nan=False), NotBool] | None = None
    stop: StopString | Annotated[list[StopString], Field(max_length=MAX_STOP_STRINGS)] | None = None
    seed: Int64 | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    presence_penalty: Penalty | None = None
    frequency_penalty: Penalty | None = None
    user: str | None = None
    # vLLM extras
    top_k: TopK | None = None
    min_p: Probability | None = None
    repetition_penalty: RepetitionPenalty | None = None
    min_tokens: Annotated[int, Field(ge=0, le=INT32_MAX), NotBool] = 0
    ignore_eos: bool = False
    stop_token_ids: list[TokenId] | None = None
    skip_special_tokens: bool = True
    # ---- token-level controls and token ids (vLLM extras; services.router.token_controls)
    logit_bias: dict[StrictStr, float] | None = None
    allowed_token_ids: list[StrictInt] | None = None
    bad_words: list[StrictStr] | None = None
    return_token_ids: bool = False
    return_tokens_as_token_ids: bool = False
    truncate_prompt_tokens: StrictInt | None = None
    prompt_logprobs: StrictInt | None = None  # score the prompt, with this many alternatives per token
    # ---- beam search (vLLM extras; shared.engine.beam_search): best_of beams, the n best returned
    use_beam_search: bool = False
    best_of: StrictInt | None = None
    length_penalty: float = 1.0
    early_stopping: bool | Literal["never"] = False

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    @property
    def continuous_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.continuous_usage_stats)

    def to_sampling_params(self, max_tokens: int, logprobs: int | None, **token_controls: Any) -> SamplingParams:
        """Validated engine params for one choice (``n`` stays on the request: the router fans out)."""
        beam_search: dict[str, Any] = {
            "use_beam_search": self.use_beam_search, "best_of": self.best_of,
            "length_penalty": self.length_penalty, "early_stopping": self.early_stopping,
        }  # fmt: skip
        try:
            SamplingParams(n=self.n, max_tokens=max_tokens, **beam_search)
            return SamplingParams(
                n=1,
                temperature=1.0 if self.temperature is None else self.temperature,
                top_p=1.0 if self.top_p is None else self.top_p,
                top_k=0 if self.top_k is None else self.top_k,
                min_p=0.0 if self.min_p is None else self.min_p,
                seed=self.seed,
                presence_penalty=self.presence_penalty or 0.0,
                frequency_penalty=self.frequency_penalty or 0.0,
                repetition_penalty=1.0 if self.repetition_penalty is None else self.repetition_penalty,
                max_tokens=max_tokens,
                min_tokens=self.min_tokens,
                stop=[self.stop] if isinstance(self.stop, str) else list(self.stop or []),
                stop_token_ids=list(self.stop_token_ids or []),
                ignore_eos=self.ignore_eos,
                logprobs=logprobs,
                skip_special_tokens=self.skip_special_tokens,
                **token_controls,
                **(beam_search | {"best_of": None if self.best_of == self.n else self.best_of}),
            )
        except InvalidRequestError as e:
            # The engine's messages start with the offending field's name.
            first_word = str(e).split(" ", 1)[0]
            raise bad_request(str(e), first_word if first_word in type(self).model_fields else None) from None


def choice_params(params: SamplingParams, index: int) -> SamplingParams:
    """Params of the ``index``-th of ``n`` fanned-out choices: distinct seeds keep them independent.

    ``seed + index`` wraps around within int64, so that every seed the API accepts stays valid.
    """
    if params.seed is None or index == 0:
        return params
    return dataclasses.replace(params, seed=wrapped_seed(params.seed, index))


def wrapped_seed(seed: int, index: int) -> int:
    """The seed of sample ``index`` of a request seeded with ``seed``: ``seed + index`` wrapped within int64."""
    return (seed + index + 2**63) % 2**64 - 2**63


# The mixins' own configs would otherwise replace RequestBody's: undeclared fields must stay visible.
_BODY_CONFIG = ConfigDict(extra="allow", populate_by_name=True)


class CompletionRequest(SamplingRequest, StructuredOutputFields):
    model_config = _BODY_CONFIG
    prompt: StrictStr | list[StrictStr] | list[StrictInt] | list[list[StrictInt]]
    max_tokens: TokenCount | None = None
    logprobs: NumLogprobs | None = None
    echo: bool = False


class TextPart(_Request):
    type: str
    text: str | None = None


class ChatMessage(_Request):
    role: Role
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_calls: list[dict[str, Any]] | None = None  # assistant turns that called tools
    tool_call_id: str | None = None  # "tool" turns: which call this answers

    def text(self) -> str:
        """Content as one string; text parts are joined by newlines."""
        if self.content is None or isinstance(self.content, str):
            return self.content or ""
        for part in self.content:
            if part.type != "text" or part.text is None:
                raise bad_request(f"content parts of type {part.type!r} are not supported; send text", "messages")
        return "\n".join(part.text or "" for part in self.content)


class ChatCompletionRequest(SamplingRequest, StructuredOutputFields, ToolFields):
    model_config = _BODY_CONFIG
    messages: list[ChatMessage]
    max_tokens: TokenCount | None = None
    max_completion_tokens: TokenCount | None = None
    logprobs: bool = False
    top_logprobs: NumLogprobs | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False  # vLLM: the prompt ends inside the last message, which the model continues
    echo: bool = False  # vLLM: prepend the last message's content when its role is the response's


# ---------------------------------------------------------------- responses

# Present only when asked for (``return_token_ids``), so the default shape stays OpenAI's.
TokenIds = Annotated[list[int] | None, Field(default=None, exclude_if=lambda v: v is None)]


class PromptTokensDetails(BaseModel):
    cached_tokens: int = 0  # prompt tokens served from the prefix cache


class UsageInfo(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: Annotated[PromptTokensDetails | None, Field(exclude_if=lambda v: v is None)] = None


class CompletionLogprobs(BaseModel):
    text_offset: list[int]
    token_logprobs: list[float | None]
    tokens: list[str]
    top_logprobs: list[dict[str, float] | None]


class PromptLogprob(BaseModel):
    """vLLM's entry of ``prompt_logprobs``: a token id (as the key) to this."""

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


PromptLogprobs = list[dict[str, PromptLogprob] | None]


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None
    prompt_token_ids: TokenIds = None  # with return_token_ids
    token_ids: TokenIds = None  # with return_token_ids
    prompt_logprobs: PromptLogprobs | None = None


class CompletionResponse(BaseModel):
    """Both the final body and, with ``stream``, every chunk (OpenAI uses one object type)."""

    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: UsageInfo | None = None


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None


class ChatTokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob] = Field(default_factory=list)


class ChatLogprobs(BaseModel):
    content: list[ChatTokenLogprob] | None = None


class ChatResponseMessage(BaseModel):
    role: str = "assistant"
    content: str | None = None
    tool_calls: list[dict[str, Any]] | None = None

    @model_serializer(mode="wrap")
    def _drop_absent_tool_calls(self, handler: Any) -> dict[str, Any]:
        body = handler(self)
        if body.get("tool_calls") is None:
            body.pop("tool_calls", None)
        return body


class ChatChoice(BaseModel):
    index: int
    message: ChatResponseMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    token_ids: TokenIds = None  # with return_token_ids


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: UsageInfo
    prompt_token_ids: TokenIds = None  # with return_token_ids
    prompt_logprobs: PromptLogprobs | None = None


class DeltaMessage(BaseModel):
    role: str | None = None
    content: str | None = None
    tool_calls: list[dict[str, Any]] | None = None  # stream shape: each entry carries its "index"

    @model_serializer
    def _drop_unset(self) -> dict[str, Any]:
        fields = (("role", self.role), ("content", self.content), ("tool_calls", self.tool_calls))
        return {k: v for k, v in fields if v is not None}


class ChatStreamChoice(BaseModel):
    index: int
    delta: DeltaMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    token_ids: TokenIds = None  # with return_token_ids


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatStreamChoice]
    usage: UsageInfo | None = None
    prompt_token_ids: TokenIds = None  # with return_token_ids, on the first chunk of a choice
    prompt_logprobs: Annotated[PromptLogprobs | None, Field(exclude_if=lambda v: v is None)] = None


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "cleave"
    root: str
    max_model_len: int


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]
