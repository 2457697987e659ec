"""Which request fields the router implements, and the 400 for the ones it does not.

A field that is accepted must do what it says, so a request naming a field of
the OpenAI or vLLM request schemas that the request model does not declare is
refused with a 400 naming that field, and so is a field no schema knows. A
field counts as implemented exactly when the pydantic request model declares
it: adding a field to ``CompletionRequest`` / ``ChatCompletionRequest`` is all
it takes to lift its refusal, and ``KNOWN_FIELDS`` is the one list to shrink
(or extend) as features land.

Clients often send a field with its "off" value (``"best_of": 1``,
``"use_beam_search": false``, ``null``); such values ask for nothing and pass.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel

from services.router.protocol import bad_request

# Fields of OpenAI's and vLLM's completion / chat request schemas that the router may not declare yet,
# with the value that means "not asked" (None alone always means that).
_OFF = object()  # no "off" value besides null / empty
KNOWN_FIELDS: dict[str, object] = {
    # OpenAI, both endpoints
    "suffix": "",
    # OpenAI chat
    "audio": _OFF,
    "modalities": ["text"],
    "prediction": _OFF,
    "reasoning_effort": _OFF,
    "verbosity": _OFF,
    "web_search_options": _OFF,
    "service_tier": "auto",
    "store": False,
    "metadata": _OFF,
    "prompt_cache_key": _OFF,
    "prompt_cache_retention": _OFF,
    "safety_identifier": _OFF,
    # structured output and tools
    "response_format": {"type": "text"},
    "tools": _OFF,
    "tool_choice": "none",
    "parallel_tool_calls": _OFF,
    "functions": _OFF,
    "function_call": "none",
    "structured_outputs": _OFF,
    "guided_json": _OFF,
    "guided_regex": _OFF,
    "guided_choice": _OFF,
    "guided_grammar": _OFF,
    "guided_decoding_backend": _OFF,
    "guided_whitespace_pattern": _OFF,
    "structural_tag": _OFF,
    # vLLM sampling extras
    "include_stop_str_in_output": False,
    "spaces_between_special_tokens": True,
    "prompt_logprobs": _OFF,
    "logits_processors": _OFF,
    "thinking_token_budget": _OFF,
    # vLLM request extras
    "continue_final_message": False,
    "add_special_tokens": _OFF,
    "documents": _OFF,
    "chat_template": _OFF,
    "chat_template_kwargs": _OFF,
    "mm_processor_kwargs": _OFF,
    "media_io_kwargs": _OFF,
    "include_reasoning": _OFF,
    "priority": 0,
    "request_id": _OFF,
    "cache_salt": _OFF,
    "kv_transfer_params": _OFF,
    "vllm_xargs": _OFF,
    "prompt_embeds": _OFF,
    "return_tokens_as_token_ids": False,
    "return_token_ids": False,
    "echo": False,
}


def _asks_nothing(name: str, value: Any) -> bool:
    if value is None or value == {} or value == []:
        return True
    off = KNOWN_FIELDS.get(name, _OFF)
    return off is not _OFF and value == off and type(value) is type(off)


def check_fields(request: BaseModel, prefix: str = "") -> None:
    """Refuse, with a 400 naming it, the first field of ``request`` that the router does not implement."""
    for name, value in (request.model_extra or {}).items():
        if _asks_nothing(name, value):
            continue
        if name in KNOWN_FIELDS and not prefix:
            raise bad_request(f"{name} is not supported by this server; remove it from the request", name)
        raise bad_request(f"Unrecognized request argument supplied: {prefix}{name}", f"{prefix}{name}")
    stream_options = getattr(request, "stream_options", None)
    if isinstance(stream_options, BaseModel):
        check_fields(stream_options, "stream_options.")
