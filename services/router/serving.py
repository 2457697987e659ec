"""From an OpenAI request to worker choices, and from choice deltas to OpenAI bodies.

``prepare_completion`` / ``prepare_chat`` validate and tokenize (raising
``APIError``), ``CompletionFormat`` / ``ChatFormat`` shape stream chunks and
final bodies, and ``ChoiceResult`` accumulates a choice for non-stream answers.
All of it is pure: no I/O, no workers.
"""

from __future__ import annotations

import dataclasses
import json
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import jinja2

from services.router.fields import check_fields
from services.router.generation import ChoiceDelta, ChoiceSpec, PromptTokenLogprob, TokenInfo
from services.router.prompt_scores import echo_logprobs, join, prompt_logprobs_body
from services.router.protocol import (
    MAX_N,
    APIError,
    ChatChoice,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatLogprobs,
    ChatMessage,
    ChatResponseMessage,
    ChatStreamChoice,
    ChatTokenLogprob,
    CompletionChoice,
    CompletionLogprobs,
    CompletionRequest,
    CompletionResponse,
    DeltaMessage,
    PromptTokensDetails,
    SamplingRequest,
    TopLogprob,
    UsageInfo,
    bad_request,
    choice_params,
)
from services.router.structured import ConstraintError, StructuredOutputFields
from services.router.token_controls import check_vocab, token_controls, truncate_prompt
from services.router.tools import ToolCallStream, ToolPlan, extract_tool_calls, message_for_template, plan_tools
from shared.structured.constraint import Constraint
from shared.tokenizer import Tokenizer

MAX_TOP_LOGPROBS = 20
COMPLETION_DEFAULT_MAX_TOKENS = 16
DEFAULT_MAX_CHOICES = 256  # prompts x n of one request (--max-choices-per-request)
PROMPT_CHARS_SLACK = 4
# JSON has no -inf; OpenAI-compatible servers clamp impossible tokens to this.
MIN_LOGPROB = -9999.0


@dataclass(frozen=True)
class ModelInfo:
    name: str
    max_model_len: int
    vocab_size: int
    eos_token_ids: frozenset[int]
    tool_call_parser: str | None = None


@dataclass
class Prepared:
    """A validated request: its prompts and one ``ChoiceSpec`` per worker request."""

    request_id: str
    prompts: list[list[int]]
    specs: list[ChoiceSpec]
    stream: bool
    include_usage: bool
    tool_plan: ToolPlan | None = None  # chat with tools: how calls come back
    continuous_usage: bool = False  # stream_options.continuous_usage_stats: usage on every chunk
    return_token_ids: bool = False
    echo_texts: list[str] | None = None  # completions echo: the prompt text of each prompt
    echo_token_texts: list[list[str]] | None = None  # completions echo with logprobs: each prompt's tokens
    echo_num_top: int = 0
    prompt_logprobs: bool = False  # prompt_logprobs asked: the response carries them
    forks: list[ChoiceSpec] | None = None  # n > 1: one worker request per prompt, forked by the engine

    @property
    def num_prompt_tokens(self) -> int:
        return sum(len(p) for p in self.prompts)

    @property
    def worker_requests(self) -> list[ChoiceSpec]:
        """What goes to the workers: a fork per prompt when n > 1, else one request per choice."""
        return self.forks if self.forks is not None else self.specs

    @property
    def choices_per_prompt(self) -> int:
        return max(1, len(self.specs) // max(1, len(self.prompts)))


def check_common(req: SamplingRequest, model: ModelInfo) -> None:
    """Checks every generation request gets first: the model, unimplemented fields, stream_options."""
    check_model(req.model, model)
    check_fields(req)
    if req.stream_options is not None and not req.stream:
        raise bad_request("stream_options is only allowed when stream is true", "stream_options")


def check_model(requested: str | None, model: ModelInfo) -> None:
    if requested is not None and requested != model.name:
        raise APIError(
            404, f"The model `{requested}` does not exist.", "invalid_request_error", "model", "model_not_found"
        )


def check_token_ids(token_ids: list[int], vocab_size: int, param: str) -> None:
    bad = [t for t in token_ids if not 0 <= t < vocab_size]
    if bad:
        raise bad_request(f"token id {bad[0]} in {param} is outside the vocabulary [0, {vocab_size})", param)


def resolve_max_tokens(num_prompt_tokens: int, requested: int | None, default: int | None, max_model_len: int) -> int:
    """``requested`` if it fits the context; when omitted, ``default`` capped to what remains (or all of it)."""
    if requested is not None and requested < 1:
        raise bad_request(f"max_tokens must be at least 1, got {requested}", "max_tokens")
    remaining = max_model_len - num_prompt_tokens
    if requested is None and remaining >= 1:
        return remaining if default is None else min(default, remaining)
    completion = requested if requested is not None else 1
    if requested is None or num_prompt_tokens + requested > max_model_len:
        raise bad_request(
            f"This model's maximum context length is {max_model_len} tokens. However, you requested "
            f"{num_prompt_tokens + completion} tokens ({num_prompt_tokens} in the messages, {completion} in the "
            "completion). Please reduce the length of the messages or completion.",
            "messages",
            "context_length_exceeded",
        )
    return requested


def check_text_fits(text: str, tokenizer: Tokenizer, max_model_len: int, param: str) -> None:
    """Refuse, before tokenizing it, a text so long that no tokenization of it fits the context.

    ``len(text) / max_token_chars`` is a lower bound on its token count; the slack factor
    keeps normalizers that shorten text (collapsing spaces) from refusing a prompt that fits.
    """
    min_tokens = len(text) // (tokenizer.max_token_chars * PROMPT_CHARS_SLACK)
    if min_tokens > max_model_len:
        raise bad_request(
            f"This model's maximum context length is {max_model_len} tokens. However, the {param} has "
            f"{len(text)} characters, which is at least {min_tokens} tokens. Please reduce the length of the "
            f"{param}.",
            param,
            "context_length_exceeded",
        )


def input_items(value, field: str) -> list[str | list[int]]:
    """A prompt-like field as a list of items: a string, strings, token ids, or lists of token ids."""
    items: list[str | list[int]]
    if isinstance(value, str) or (value and isinstance(value[0], int)):
        items = [value]  # one item: a string or one list of ids
    else:
        items = list(value)  # several items
    if not items or any(len(item) == 0 for item in items):
        raise bad_request(f"{field} must not be empty", field)
    return items


def completion_prompts(
    req: CompletionRequest, tokenizer: Tokenizer, vocab_size: int, max_model_len: int | None = None
) -> list[list[int]]:
    """The prompt field as token id lists: a string, strings, token ids, or lists of token ids."""
    items = input_items(req.prompt, "prompt")
    prompts = []
    for item in items:
        if isinstance(item, str):
            if max_model_len is not None:
                check_text_fits(item, tokenizer, max_model_len, "prompt")
            prompts.append(tokenizer.encode(item, add_special_tokens=True))
        else:
            check_vocab(list(item), vocab_size, "prompt")
            prompts.append(list(item))
    return prompts


def chat_prompt(req: ChatCompletionRequest, tokenizer: Tokenizer, max_model_len: int | None = None) -> list[int]:
    """Apply the model's chat template; the rendered text carries its own special tokens."""
    if req.continue_final_message:
        if req.add_generation_prompt:
            raise bad_request(
                "continue_final_message and add_generation_prompt cannot both be true", "continue_final_message"
            )
        return continued_prompt_ids(req.messages, tokenizer, req.template_tools())
    return chat_prompt_ids(
        req.messages, req.add_generation_prompt, tokenizer, tools=req.template_tools(), max_model_len=max_model_len
    )


def continued_prompt_ids(chat_messages: list[ChatMessage], tokenizer: Tokenizer, tools: Any = None) -> list[int]:
    """The template's rendering cut right after the last message's content (no end-of-turn after it)."""
    if not chat_messages:
        raise bad_request("messages must not be empty", "messages")
    ids = chat_prompt_ids(chat_messages, False, tokenizer, tools=tools)
    text = tokenizer.decode(ids, skip_special_tokens=False)
    final = chat_messages[-1].text().strip()
    end = text.rfind(final) if final else -1
    if end < 0:
        raise bad_request("continue_final_message: the template does not show the last message's content", "messages")
    return tokenizer.encode(text[: end + len(final)], add_special_tokens=False)


def chat_prompt_ids(
    chat_messages: list[ChatMessage],
    add_generation_prompt: bool,
    tokenizer: Tokenizer,
    add_special_tokens: bool = False,
    tools: Any = None,
    max_model_len: int | None = None,
) -> list[int]:
    """Token ids of ``chat_messages`` after the chat template; with ``max_model_len``, a text that
    cannot fit is refused before it is tokenized."""
    if not chat_messages:
        raise bad_request("messages must not be empty", "messages")
    messages = []
    for message in chat_messages:
        entry: dict[str, Any] = {"role": message.role, "content": message.text()}
        if message.name is not None:
            entry["name"] = message.name
        messages.append(entry | message_for_template(message))
    try:
        text = tokenizer.apply_chat_template(messages, add_generation_prompt=add_generation_prompt, tools=tools)
    except (ValueError, jinja2.TemplateError) as e:
        raise bad_request(f"cannot apply the chat template: {e}", "messages") from None
    if max_model_len is not None:
        check_text_fits(text, tokenizer, max_model_len, "messages")
    return tokenizer.encode(text, add_special_tokens=add_special_tokens)


def request_constraint(req: SamplingRequest) -> Constraint | None:
    """The structured-output constraint of ``req`` (None without one); 400 on a bad field."""
    if not isinstance(req, StructuredOutputFields):
        return None
    try:
        return req.output_constraint()
    except ConstraintError as e:
        raise bad_request(str(e), e.param) from None


def _specs(
    request_id: str,
    req: SamplingRequest,
    prompts: list[list[int]],
    max_tokens: list[int],
    logprobs: int | None,
    model: ModelInfo,
    tokenizer: Tokenizer,
    constraint: Constraint | None = None,
    max_choices: int = DEFAULT_MAX_CHOICES,
) -> list[ChoiceSpec]:
    if req.n > MAX_N:
        raise bad_request(f"n must be at most {MAX_N}, got {req.n}", "n")
    if len(prompts) * req.n > max_choices:
        raise bad_request(
            f"{len(prompts)} prompts x n={req.n} is {len(prompts) * req.n} choices; this server generates at most "
            f"{max_choices} per request (--max-choices-per-request). Send fewer prompts or a smaller n.",
            "n",
        )
    check_token_ids(list(req.stop_token_ids or []), model.vocab_size, "stop_token_ids")
    controls = token_controls(req, tokenizer, model.vocab_size)
    check_top_logprobs(req.prompt_logprobs, "prompt_logprobs")
    scored = req.prompt_logprobs
    if isinstance(req, CompletionRequest) and req.echo and req.logprobs is not None:
        scored = max(scored or 0, req.logprobs)  # the echoed prompt needs its logprobs
    if scored is not None:
        controls["prompt_logprobs"] = scored
    constraint = request_constraint(req) if constraint is None else constraint
    specs = []
    for prompt_index, (prompt_ids, prompt_max_tokens) in enumerate(zip(prompts, max_tokens, strict=True)):
        params = req.to_sampling_params(prompt_max_tokens, logprobs, **controls)
        if constraint is not None:
            params = dataclasses.replace(params, constraint=constraint)
        for i in range(req.n):
            index = prompt_index * req.n + i
            spec_params = choice_params(params, i)
            specs.append(
                ChoiceSpec(index, f"{request_id}-{index}", prompt_ids, spec_params, req.return_tokens_as_token_ids)
            )
    return specs


def _forks(req: SamplingRequest, specs: list[ChoiceSpec]) -> list[ChoiceSpec] | None:
    """n > 1: the first choice of each prompt, asking the engine for all n (prefill once, share the blocks)."""
    if req.n == 1:
        return None
    return [dataclasses.replace(s, params=dataclasses.replace(s.params, n=req.n)) for s in specs[:: req.n]]


def _prepared(req: SamplingRequest, request_id: str, prompts: list[list[int]], specs: list[ChoiceSpec]) -> Prepared:
    return Prepared(
        request_id,
        prompts,
        specs,
        req.stream,
        req.include_usage,
        continuous_usage=req.continuous_usage,
        return_token_ids=req.return_token_ids,
        prompt_logprobs=req.prompt_logprobs is not None,
        forks=_forks(req, specs),
    )


def _echo_texts(req: CompletionRequest, prompts: list[list[int]], tokenizer: Tokenizer) -> list[str] | None:
    if not req.echo:
        return None
    strings = [req.prompt] if isinstance(req.prompt, str) else req.prompt
    if req.truncate_prompt_tokens is None and all(isinstance(p, str) for p in strings):
        return [str(p) for p in strings]
    return [tokenizer.decode(p, skip_special_tokens=req.skip_special_tokens) for p in prompts]


def check_top_logprobs(value: int | None, param: str) -> None:
    if value is not None and not 0 <= value <= MAX_TOP_LOGPROBS:
        raise bad_request(
            f"{param} must be in [0, {MAX_TOP_LOGPROBS}], got {value} (-1, the whole vocabulary, is not served)",
            param,
        )


def prepare_completion(
    req: CompletionRequest,
    request_id: str,
    model: ModelInfo,
    tokenizer: Tokenizer,
    max_choices: int = DEFAULT_MAX_CHOICES,
) -> Prepared:
    check_common(req, model)
    check_top_logprobs(req.logprobs, "logprobs")
    # A prompt to be truncated may be of any length; others that cannot fit are refused before tokenizing.
    fits_check = model.max_model_len if req.truncate_prompt_tokens is None else None
    prompts = completion_prompts(req, tokenizer, model.vocab_size, fits_check)
    prompts = [truncate_prompt(p, req.truncate_prompt_tokens, model.max_model_len) for p in prompts]
    echo_texts = _echo_texts(req, prompts, tokenizer)
    max_tokens = [
        resolve_max_tokens(len(p), req.max_tokens, COMPLETION_DEFAULT_MAX_TOKENS, model.max_model_len) for p in prompts
    ]
    specs = _specs(request_id, req, prompts, max_tokens, req.logprobs, model, tokenizer, max_choices=max_choices)
    prep = _prepared(req, request_id, prompts, specs)
    prep.echo_texts = echo_texts
    if req.echo and req.logprobs is not None:
        prep.echo_num_top = req.logprobs
        prep.echo_token_texts = [[tokenizer.decode([t], skip_special_tokens=False) for t in p] for p in prompts]
    return prep


def prepare_chat(
    req: ChatCompletionRequest,
    request_id: str,
    model: ModelInfo,
    tokenizer: Tokenizer,
    max_choices: int = DEFAULT_MAX_CHOICES,
) -> Prepared:
    check_common(req, model)
    if req.top_logprobs is not None and not req.logprobs:
        raise bad_request("top_logprobs requires logprobs to be true", "top_logprobs")
    check_top_logprobs(req.top_logprobs, "top_logprobs")
    plan, constraint = chat_tools(req, model)
    fits_check = model.max_model_len if req.truncate_prompt_tokens is None else None
    prompt_ids = truncate_prompt(
        chat_prompt(req, tokenizer, fits_check), req.truncate_prompt_tokens, model.max_model_len
    )
    requested = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
    max_tokens = resolve_max_tokens(len(prompt_ids), requested, None, model.max_model_len)
    logprobs = (req.top_logprobs or 0) if req.logprobs else None
    specs = _specs(request_id, req, [prompt_ids], [max_tokens], logprobs, model, tokenizer, constraint, max_choices)
    prep = _prepared(req, request_id, [prompt_ids], specs)
    prep.tool_plan = plan
    response_role = "assistant" if req.add_generation_prompt else req.messages[-1].role
    if req.echo and req.messages[-1].role == response_role:
        prep.echo_texts = [req.messages[-1].text()]
    return prep


def chat_tools(req: ChatCompletionRequest, model: ModelInfo) -> tuple[ToolPlan | None, Constraint | None]:
    """The tool plan and, for a forced call, its grammar (which excludes any other constraint)."""
    try:
        plan = plan_tools(req, model.tool_call_parser)
        constraint = plan.constraint() if plan is not None else None
    except ConstraintError as e:
        raise bad_request(str(e), e.param) from None
    if constraint is not None and request_constraint(req) is not None:
        raise bad_request("a forced tool call cannot be combined with response_format or guided output", "tool_choice")
    return plan, constraint


@dataclass
class ChoiceResult:
    """Everything one choice produced, for non-stream answers and the request log."""

    index: int
    text_parts: list[str] = field(default_factory=list)
    logprobs: list[TokenInfo] | None = None
    finish_reason: str | None = None
    num_tokens: int = 0
    token_ids: list[int] = field(default_factory=list)
    num_cached_tokens: int = 0
    prompt_logprobs: list[PromptTokenLogprob] | None = None

    def add(self, delta: ChoiceDelta) -> None:
        self.text_parts.append(delta.text)
        if delta.prompt_logprobs is not None:
            self.prompt_logprobs = delta.prompt_logprobs
        self.token_ids += delta.token_ids
        self.num_cached_tokens = max(self.num_cached_tokens, delta.num_cached_tokens)
        if delta.logprobs is not None:
            self.logprobs = (self.logprobs or []) + delta.logprobs
        self.finish_reason = delta.finish_reason or self.finish_reason
        self.num_tokens += delta.num_tokens

    @property
    def text(self) -> str:
        return "".join(self.text_parts)


def usage(prep: Prepared, results: list[ChoiceResult]) -> UsageInfo:
    completion = sum(r.num_tokens for r in results)
    # Cached prompt tokens count once per prompt: the best hit among its choices.
    per_prompt: dict[int, int] = {}
    for r in results:
        prompt_index = r.index // prep.choices_per_prompt
        per_prompt[prompt_index] = max(per_prompt.get(prompt_index, 0), r.num_cached_tokens)
    return UsageInfo(
        prompt_tokens=prep.num_prompt_tokens,
        completion_tokens=completion,
        total_tokens=prep.num_prompt_tokens + completion,
        prompt_tokens_details=PromptTokensDetails(cached_tokens=sum(per_prompt.values())),
    )


def _lp(value: float) -> float:
    """A logprob JSON can carry: NaN and -inf become ``MIN_LOGPROB`` (JSON has neither)."""
    if math.isnan(value):
        return MIN_LOGPROB
    return min(max(value, MIN_LOGPROB), 0.0)


def completion_logprobs(infos: list[TokenInfo] | None) -> CompletionLogprobs | None:
    if infos is None:
        return None
    return CompletionLogprobs(
        text_offset=[i.text_offset for i in infos],
        token_logprobs=[_lp(i.logprob) for i in infos],
        tokens=[i.token for i in infos],
        top_logprobs=[{i.token: _lp(i.logprob)} | {tok: _lp(lp) for tok, lp in i.top} for i in infos],
    )


def chat_logprobs(infos: list[TokenInfo] | None) -> ChatLogprobs | None:
    if infos is None:
        return None
    content = [
        ChatTokenLogprob(
            token=i.token,
            logprob=_lp(i.logprob),
            bytes=list(i.token.encode()),
            top_logprobs=[TopLogprob(token=t, logprob=_lp(lp), bytes=list(t.encode())) for t, lp in i.top],
        )
        for i in infos
    ]
    return ChatLogprobs(content=content)


def sse(payload: dict[str, Any] | str) -> str:
    """One server-sent event; a str is a chunk already rendered (``ChunkTemplate``)."""
    if isinstance(payload, str):
        return payload
    # allow_nan=False: JSON has no NaN or Infinity; a non-finite number is a bug to surface, not to send.
    return f"data: {json.dumps(payload, ensure_ascii=False, allow_nan=False, separators=(',', ':'))}\n\n"


_json_string = json.JSONEncoder(ensure_ascii=False).encode
_TEXT_MARK = "\u2063cleave-text\u2063"  # in no real chunk; marks where a chunk's text goes
_FINISH_NULL = '"finish_reason":null'


class ChunkTemplate:
    """The SSE event of a plain stream chunk (text and finish reason, nothing else asked for) as text around
    those two values: built once per choice from the chunk model itself, so it says exactly what the model
    would, then filled per token without building and dumping the model again (most of the router's work
    per token otherwise)."""

    def __init__(self, body: dict[str, Any]) -> None:
        event = sse(body)
        text_at, finish_at = event.find(_json_string(_TEXT_MARK)), event.find(_FINISH_NULL)
        # The text's key comes before finish_reason in both chunk kinds; both appear once.
        assert 0 <= text_at < finish_at and event.count(_TEXT_MARK) == 1 and event.count(_FINISH_NULL) == 1, event
        finish_at += len(_FINISH_NULL) - len("null")
        self._head, self._middle = event[:text_at], event[text_at + len(_json_string(_TEXT_MARK)) : finish_at]
        self._tail = event[finish_at + len("null") :]

    def render(self, text: str, finish_reason: str | None) -> str:
        finish = "null" if finish_reason is None else _json_string(finish_reason)
        return self._head + _json_string(text) + self._middle + finish + self._tail


SSE_DONE = "data: [DONE]\n\n"


class _StreamState:
    """Per-response state of the extras: a choice's first chunk (echo, prompt ids) and the running usage."""

    def __init__(self, prep: Prepared) -> None:
        self.prep, self.started, self.num_generated = prep, set[int](), 0
        # Chunks then carry text and a finish reason only (logprobs aside, which a delta says itself).
        self.plain = not (
            prep.return_token_ids
            or prep.prompt_logprobs
            or (prep.include_usage and prep.continuous_usage)
            or prep.echo_texts is not None
            or prep.tool_plan is not None
        )
        self._templates: dict[int, ChunkTemplate] = {}

    def template(self, index: int, make_body: Callable[[int], dict[str, Any]]) -> ChunkTemplate:
        template = self._templates.get(index)
        if template is None:
            template = self._templates[index] = ChunkTemplate(make_body(index))
        return template

    def first(self, delta: ChoiceDelta) -> bool:
        self.num_generated += delta.num_tokens
        is_first = delta.index not in self.started
        self.started.add(delta.index)
        return is_first

    def echo(self, index: int) -> str:
        texts = self.prep.echo_texts
        return texts[index // self.prep.choices_per_prompt] if texts is not None else ""

    def prompt_ids(self, index: int) -> list[int] | None:
        return self.prep.specs[index].prompt_ids if self.prep.return_token_ids else None

    def token_ids(self, token_ids: list[int]) -> list[int] | None:
        return list(token_ids) if self.prep.return_token_ids else None

    def carries_ids(self, delta: ChoiceDelta, first: bool) -> bool:
        """A delta without text still has a chunk when it carries asked-for token ids or prompt logprobs."""
        return (self.prep.return_token_ids and bool(delta.token_ids)) or (first and self.prep.prompt_logprobs)

    def prompt_scores(self, infos: list[PromptTokenLogprob] | None) -> list | None:
        return prompt_logprobs_body(infos) if self.prep.prompt_logprobs else None

    def logprobs(
        self, index: int, infos: list[TokenInfo] | None, prompt: list[PromptTokenLogprob] | None, first: bool
    ) -> CompletionLogprobs | None:
        """Completions logprobs; with echo, the prompt's come first (on a stream's first chunk)."""
        generated = completion_logprobs(infos)
        texts = self.prep.echo_token_texts
        if texts is None or not first:
            return generated
        prompt_index = index // self.prep.choices_per_prompt
        echoed = echo_logprobs(texts[prompt_index], prompt, self.prep.echo_num_top)
        return join(echoed, generated, len(self.echo(index)))

    def running_usage(self) -> UsageInfo | None:
        """With ``continuous_usage_stats``: the usage so far, on every chunk."""
        if not (self.prep.include_usage and self.prep.continuous_usage):
            return None
        prompt = self.prep.num_prompt_tokens
        return UsageInfo(
            prompt_tokens=prompt, completion_tokens=self.num_generated, total_tokens=prompt + self.num_generated
        )


class CompletionFormat:
    """``/v1/completions`` bodies: ``text_completion`` objects."""

    def __init__(self, prep: Prepared, model_name: str) -> None:
        self.prep, self.model_name, self.created = prep, model_name, int(time.time())
        self.state = _StreamState(prep)

    def _body(self, choices: list[CompletionChoice], usage_info: UsageInfo | None) -> dict[str, Any]:
        body = CompletionResponse(
            id=self.prep.request_id, created=self.created, model=self.model_name, choices=choices, usage=usage_info
        ).model_dump()
        if self.prep.stream and not self.prep.include_usage:
            body.pop("usage")
        return body

    def opening_chunks(self) -> list[dict[str, Any]]:
        return []

    def delta_chunk(self, delta: ChoiceDelta) -> dict[str, Any] | str | None:
        first = self.state.first(delta)
        if self.state.plain and delta.logprobs is None:
            if not (delta.num_tokens or delta.text or delta.finish_reason):
                return None
            return self.state.template(delta.index, self._plain_body).render(delta.text, delta.finish_reason)
        echo = self.state.echo(delta.index) if first else ""
        if not (delta.num_tokens or delta.text or delta.finish_reason or echo or self.state.carries_ids(delta, first)):
            return None
        choice = CompletionChoice(
            index=delta.index,
            text=echo + delta.text,
            logprobs=self.state.logprobs(delta.index, delta.logprobs, delta.prompt_logprobs, first),
            finish_reason=delta.finish_reason,
            prompt_token_ids=self.state.prompt_ids(delta.index) if first else None,
            token_ids=self.state.token_ids(delta.token_ids),
            prompt_logprobs=self.state.prompt_scores(delta.prompt_logprobs) if first else None,
        )
        return self._body([choice], self.state.running_usage())

    def _plain_body(self, index: int) -> dict[str, Any]:
        """The chunk the model makes for a plain delta (see _StreamState.plain), its text a mark."""
        return self._body([CompletionChoice(index=index, text=_TEXT_MARK, logprobs=None, finish_reason=None)], None)

    def usage_chunk(self, usage_info: UsageInfo) -> dict[str, Any]:
        return self._body([], usage_info)

    def response(self, results: list[ChoiceResult], usage_info: UsageInfo) -> dict[str, Any]:
        choices = [
            CompletionChoice(
                index=r.index,
                text=self.state.echo(r.index) + r.text,
                logprobs=self.state.logprobs(r.index, r.logprobs, r.prompt_logprobs, True),
                finish_reason=r.finish_reason,
                prompt_token_ids=self.state.prompt_ids(r.index),
                token_ids=self.state.token_ids(r.token_ids),
                prompt_logprobs=self.state.prompt_scores(r.prompt_logprobs),
            )
            for r in results
        ]
        return self._body(choices, usage_info)


class ChatFormat:
    """``/v1/chat/completions`` bodies: ``chat.completion`` and ``chat.completion.chunk`` objects."""

    def __init__(self, prep: Prepared, model_name: str) -> None:
        self.prep, self.model_name, self.created = prep, model_name, int(time.time())
        self.state = _StreamState(prep)
        self._tool_streams: dict[int, ToolCallStream] = {}

    def _chunk(
        self,
        choices: list[ChatStreamChoice],
        usage_info: UsageInfo | None,
        prompt_ids: list[int] | None = None,
        prompt_logprobs: list | None = None,
    ) -> dict[str, Any]:
        body = ChatCompletionChunk(
            id=self.prep.request_id,
            created=self.created,
            model=self.model_name,
            choices=choices,
            usage=usage_info,
            prompt_token_ids=prompt_ids,
            prompt_logprobs=prompt_logprobs,
        ).model_dump()
        if not self.prep.include_usage:
            body.pop("usage")
        return body

    def opening_chunks(self) -> list[dict[str, Any]]:
        """The assistant role first, once per choice (with ``return_token_ids``, the prompt's ids)."""
        return [
            self._chunk(
                [ChatStreamChoice(index=spec.index, delta=DeltaMessage(role="assistant", content=""))],
                None,
                self.state.prompt_ids(spec.index),
            )
            for spec in self.prep.specs
        ]

    def delta_chunk(self, delta: ChoiceDelta) -> dict[str, Any] | list[dict[str, Any]] | str | None:
        if self.prep.tool_plan is not None:
            return self._tool_chunks(delta, self.prep.tool_plan)
        first = self.state.first(delta)
        if self.state.plain and delta.logprobs is None and (delta.text or delta.num_tokens):
            return self.state.template(delta.index, self._plain_body).render(delta.text, delta.finish_reason)
        echo = self.state.echo(delta.index) if first else ""
        if not (delta.num_tokens or delta.text or delta.finish_reason or echo or self.state.carries_ids(delta, first)):
            return None
        # A token whose text is still held back (part of a character, a possible stop string) has a
        # chunk with empty content: one chunk per token, so clients see the pace of generation.
        content = echo + delta.text
        choice = ChatStreamChoice(
            index=delta.index,
            delta=DeltaMessage(content=content if content or delta.num_tokens else None),
            logprobs=chat_logprobs(delta.logprobs),
            finish_reason=delta.finish_reason,
            token_ids=self.state.token_ids(delta.token_ids),
        )
        scores = self.state.prompt_scores(delta.prompt_logprobs) if first else None
        return self._chunk([choice], self.state.running_usage(), prompt_logprobs=scores)

    def _plain_body(self, index: int) -> dict[str, Any]:
        """The chunk the model makes for a plain delta with content (see _StreamState.plain), its text a mark."""
        return self._chunk([ChatStreamChoice(index=index, delta=DeltaMessage(content=_TEXT_MARK))], None)

    def _tool_chunks(self, delta: ChoiceDelta, plan: ToolPlan) -> list[dict[str, Any]]:
        stream = self._tool_streams.setdefault(delta.index, ToolCallStream(plan))
        parts = stream.add(delta.text, delta.finish_reason is not None)
        chunks = [
            self._chunk([ChatStreamChoice(index=delta.index, delta=DeltaMessage(content=p.content, tool_calls=p.tool_calls))], None)
            for p in parts
        ]  # fmt: skip
        if delta.logprobs:
            # The tokens' logprobs in the order generated, even while the calls are still being read.
            logprobs = chat_logprobs(delta.logprobs)
            chunks.append(
                self._chunk([ChatStreamChoice(index=delta.index, delta=DeltaMessage(), logprobs=logprobs)], None)
            )
        if delta.finish_reason is not None:
            reason = "tool_calls" if stream.num_calls and delta.finish_reason == "stop" else delta.finish_reason
            chunks.append(
                self._chunk([ChatStreamChoice(index=delta.index, delta=DeltaMessage(), finish_reason=reason)], None)
            )
        return chunks

    def usage_chunk(self, usage_info: UsageInfo) -> dict[str, Any]:
        return self._chunk([], usage_info)

    def _message(self, result: ChoiceResult) -> tuple[ChatResponseMessage, str | None]:
        plan = self.prep.tool_plan
        if plan is None:
            return ChatResponseMessage(content=result.text), result.finish_reason
        content, calls = extract_tool_calls(plan, result.text)
        reason = "tool_calls" if calls and result.finish_reason == "stop" else result.finish_reason
        return ChatResponseMessage(content=content, tool_calls=calls or None), reason

    def response(self, results: list[ChoiceResult], usage_info: UsageInfo) -> dict[str, Any]:
        messages = [self._message(r) for r in results]
        choices = [
            ChatChoice(
                index=r.index,
                message=message
                if self.prep.tool_plan
                else ChatResponseMessage(content=self.state.echo(r.index) + r.text),
                logprobs=chat_logprobs(r.logprobs),
                finish_reason=reason,
                token_ids=self.state.token_ids(r.token_ids),
            )
            for r, (message, reason) in zip(results, messages, strict=True)
        ]
        return ChatCompletionResponse(
            id=self.prep.request_id,
            created=self.created,
            model=self.model_name,
            choices=choices,
            usage=usage_info,
            prompt_token_ids=self.state.prompt_ids(0),
            prompt_logprobs=self.state.prompt_scores(results[0].prompt_logprobs if results else None),
        ).model_dump()
