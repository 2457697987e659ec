"""The small endpoints vLLM clients call: one model card, tokenize / detokenize, load, version.

``POST /tokenize`` takes ``prompt`` (completions) or ``messages`` (chat, after
the template) and answers ``{count, max_model_len, tokens, token_strs}``;
``POST /detokenize`` takes ``tokens`` and answers ``{prompt}``. ``GET /load``
is the number of generation requests in flight, ``GET /version`` the server's
version.
"""

from __future__ import annotations

from importlib import metadata
from pathlib import Path
from typing import TYPE_CHECKING

from fastapi import FastAPI
from pydantic import StrictInt, StrictStr

from services.router.fields import check_fields
from services.router.protocol import ChatMessage, ModelCard, RequestBody, bad_request
from services.router.serving import chat_prompt_ids, check_model
from services.router.token_controls import check_vocab

if TYPE_CHECKING:
    from services.router.app import RouterState


def server_version() -> str:
    """The installed package's version, else the one in ``pyproject.toml``."""
    try:
        return metadata.version("cleave")
    except metadata.PackageNotFoundError:
        pyproject = Path(__file__).resolve().parents[2] / "pyproject.toml"
        for line in pyproject.read_text().splitlines() if pyproject.is_file() else []:
            if line.startswith("version"):
                return line.split("=", 1)[1].strip().strip('"')
        return "unknown"


class TokenizeRequest(RequestBody):
    model: str | None = None
    prompt: StrictStr | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool | None = None  # default: True for a prompt, False for messages (the template has them)
    add_generation_prompt: bool = True
    return_token_strs: bool = False


class DetokenizeRequest(RequestBody):
    model: str | None = None
    tokens: list[StrictInt]


def _tokenize(state: RouterState, req: TokenizeRequest) -> list[int]:
    if (req.prompt is None) == (req.messages is None):
        raise bad_request("send exactly one of prompt and messages", "prompt")
    if req.prompt is not None:
        add_special = True if req.add_special_tokens is None else req.add_special_tokens
        return state.tokenizer.encode(req.prompt, add_special_tokens=add_special)
    add_special = bool(req.add_special_tokens)
    return chat_prompt_ids(req.messages or [], req.add_generation_prompt, state.tokenizer, add_special)


def install_extra_routes(app: FastAPI, state: RouterState, created: int) -> None:
    """Add the small endpoints to the router ``app``."""

    @app.get("/v1/models/{model_name:path}")
    async def model_card(model_name: str) -> dict:
        info = state.model_info()
        check_model(model_name, info)
        card = ModelCard(id=info.name, created=created, root=state.settings.model, max_model_len=info.max_model_len)
        return card.model_dump()

    @app.post("/tokenize")
    async def tokenize(body: TokenizeRequest) -> dict:
        info = state.model_info()
        check_model(body.model, info)
        check_fields(body)
        ids = _tokenize(state, body)
        strs = [state.tokenizer.id_to_token(t) for t in ids] if body.return_token_strs else None
        return {"count": len(ids), "max_model_len": info.max_model_len, "tokens": ids, "token_strs": strs}

    @app.post("/detokenize")
    async def detokenize(body: DetokenizeRequest) -> dict:
        info = state.model_info()
        check_model(body.model, info)
        check_fields(body)
        check_vocab(body.tokens, info.vocab_size, "tokens")
        return {"prompt": state.tokenizer.decode(body.tokens, skip_special_tokens=False)}

    @app.get("/load")
    async def load() -> dict:
        return {"server_load": state.in_flight}

    @app.get("/version")
    async def version() -> dict:
        return {"version": server_version()}
