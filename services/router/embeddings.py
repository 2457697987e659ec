"""``POST /v1/embeddings``: the model's final hidden states, pooled by the workers.

Each input is one worker request with ``max_tokens=1`` and ``pooling`` set, so
the decode worker's engine batches it with generation like any other prefill
(an embedding never disaggregates: there is no decode to hand over).
``pooling`` (``last``, the default, or ``mean``) and ``normalize`` (default
true) are extensions; ``encoding_format`` is ``float`` or ``base64`` (float32
little-endian, as OpenAI); ``dimensions`` is refused unless it equals the
model's hidden size, since the vector cannot be shortened.
"""

from __future__ import annotations

import asyncio
import base64
import struct
import uuid
from typing import TYPE_CHECKING, Literal

from fastapi import FastAPI, Request
from pydantic import StrictInt, StrictStr

from services.router.fields import check_fields
from services.router.generation import CallContext, ChoiceSpec, worker_tokens
from services.router.metrics import RequestTimer
from services.router.protocol import RequestBody, bad_request
from services.router.serving import check_model, input_items
from services.router.token_controls import check_vocab, truncate_prompt
from shared.engine.sampling_params import SamplingParams

if TYPE_CHECKING:
    from services.router.app import RouterState

MAX_INPUTS = 2048


class EmbeddingRequest(RequestBody):
    model: str | None = None
    input: StrictStr | list[StrictStr] | list[StrictInt] | list[list[StrictInt]]
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: StrictInt | None = None
    user: str | None = None
    # extensions
    pooling: Literal["last", "mean"] = "last"
    normalize: bool = True
    truncate_prompt_tokens: StrictInt | None = None


def embedding_inputs(req: EmbeddingRequest, state: RouterState, max_model_len: int) -> list[list[int]]:
    """The ``input`` field as token id lists (strings are encoded with the model's special tokens)."""
    items = input_items(req.input, "input")
    if len(items) > MAX_INPUTS:
        raise bad_request(f"input has {len(items)} items; at most {MAX_INPUTS} per request", "input")
    prompts = []
    for item in items:
        if isinstance(item, str):
            ids = state.tokenizer.encode(item, add_special_tokens=True)
        else:
            ids = list(item)
            check_vocab(ids, state.model_config.vocab_size, "input")
        ids = truncate_prompt(ids, req.truncate_prompt_tokens, max_model_len)
        if len(ids) >= max_model_len:
            raise bad_request(
                f"input has {len(ids)} tokens; this model's maximum context length is {max_model_len}", "input"
            )
        prompts.append(ids)
    return prompts


def encode_vector(vector: list[float], encoding_format: str) -> list[float] | str:
    if encoding_format == "float":
        return vector
    return base64.b64encode(struct.pack(f"<{len(vector)}f", *vector)).decode("ascii")


async def _embed_one(ctx: CallContext, spec: ChoiceSpec) -> list[float]:
    async for response in worker_tokens(ctx, spec):
        if response.embedding:
            return list(response.embedding)
        if response.finish_reason:
            break
    raise RuntimeError(f"worker answered {spec.request_id} without an embedding")


def install_embeddings(app: FastAPI, state: RouterState) -> None:
    """Add ``POST /v1/embeddings`` to the router ``app``."""

    @app.post("/v1/embeddings")
    async def embeddings(body: EmbeddingRequest, request: Request) -> dict:
        info = state.model_info()
        check_model(body.model, info)
        check_fields(body)
        hidden_size = state.model_config.hidden_size
        if body.dimensions is not None and body.dimensions != hidden_size:
            raise bad_request(
                f"dimensions={body.dimensions} is not supported: this model's embeddings have {hidden_size}",
                "dimensions",
            )
        prompts = embedding_inputs(body, state, info.max_model_len)
        request_id = f"embd-{uuid.uuid4().hex}"
        assert state.pools is not None, "worker pools start with the app"
        ctx = CallContext(
            state.pools,
            (("x-request-id", request_id),),
            state.settings.rpc_timeout_s,
            state.settings.disagg_min_prompt_tokens,
            state.metrics,
            RequestTimer(state.metrics),
        )
        params = SamplingParams(max_tokens=1, pooling=body.pooling, normalize=body.normalize)
        specs = [ChoiceSpec(i, f"{request_id}-{i}", ids, params) for i, ids in enumerate(prompts)]
        state.in_flight += 1
        try:
            vectors = await asyncio.gather(*(_embed_one(ctx, spec) for spec in specs))
        finally:
            state.in_flight -= 1
        num_tokens = sum(len(p) for p in prompts)
        data = [
            {"object": "embedding", "index": i, "embedding": encode_vector(v, body.encoding_format)}
            for i, v in enumerate(vectors)
        ]
        return {
            "object": "list",
            "data": data,
            "model": info.name,
            "usage": {"prompt_tokens": num_tokens, "total_tokens": num_tokens},
        }
