"""The router's published ``/openapi.json``, made to say what the server does.

FastAPI documents a 422 that the router never sends (validation errors are
answered 400 in the OpenAI shape) and none of the statuses it does send. This
module replaces the error responses of every operation with the ones the
router answers, in the OpenAI error shape, and documents that the generation
endpoints stream ``text/event-stream`` when ``stream`` is true. The numeric
bounds come from the request models themselves (``services.router.protocol``).
"""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi

ERROR_SCHEMA: dict[str, Any] = {
    "type": "object",
    "required": ["error"],
    "properties": {
        "error": {
            "type": "object",
            "required": ["message", "type"],
            "properties": {
                "message": {"type": "string"},
                "type": {"type": "string"},
                "param": {"anyOf": [{"type": "string"}, {"type": "null"}]},
                "code": {"anyOf": [{"type": "string"}, {"type": "null"}]},
            },
        }
    },
}

# One server-sent event (with ``stream``): ``data`` is a JSON chunk, or ``[DONE]`` at the end.
SSE_EVENT_SCHEMA: dict[str, Any] = {
    "type": "object",
    "required": ["data"],
    "properties": {"data": {"type": "string"}, "event": {"type": "string"}},
    "description": "server-sent events, when stream is true",
}

_DESCRIPTIONS = {
    "400": "Invalid request: a field out of range, a malformed body, a prompt over the context length",
    "401": "Missing or wrong API key (when the router runs with --api-key)",
    "404": "The model named in the request is not served here (or the resource does not exist)",
    "405": "Method not allowed (the Allow header lists the allowed ones)",
    "413": "The request body is larger than the router accepts",
    "429": "Every worker of a pool is at --max-queued-requests; retry after the Retry-After header",
    "503": "No worker can serve the request now; retry later",
    "504": "The request ran past --request-timeout",
}

# Statuses each operation answers besides 200, keyed by (method, path). Other POST routes
# answer like the generation ones; a GET path with a parameter answers 404 for an unknown one.
GENERATION_ERRORS = ("400", "404", "413", "503")
OPERATION_ERRORS: dict[tuple[str, str], tuple[str, ...]] = {
    ("post", "/v1/completions"): (*GENERATION_ERRORS, "429", "504"),
    ("post", "/v1/chat/completions"): (*GENERATION_ERRORS, "429", "504"),
    ("get", "/health"): ("503",),
    ("get", "/kv_index"): ("404",),  # without kv_aware routing there is no index
}


# Media types of 200 answers that FastAPI cannot infer (StreamingResponse, Prometheus text).
OK_CONTENT: dict[tuple[str, str], dict[str, Any]] = {
    ("post", "/v1/completions"): {"text/event-stream": {"schema": SSE_EVENT_SCHEMA}},
    ("post", "/v1/chat/completions"): {"text/event-stream": {"schema": SSE_EVENT_SCHEMA}},
    ("get", "/metrics"): {"text/plain": {"schema": {"type": "string"}}},
}


def _error_response(status: str) -> dict[str, Any]:
    return {
        "description": _DESCRIPTIONS[status],
        "content": {"application/json": {"schema": {"$ref": "#/components/schemas/ErrorResponse"}}},
    }


def router_openapi(app: FastAPI) -> dict[str, Any]:
    """FastAPI's schema with the router's real responses."""
    schema = get_openapi(title=app.title, version=app.version, routes=app.routes, description=app.description)
    components = schema.setdefault("components", {}).setdefault("schemas", {})
    for name in ("HTTPValidationError", "ValidationError"):
        components.pop(name, None)
    components["ErrorResponse"] = ERROR_SCHEMA
    for path, operations in schema.get("paths", {}).items():
        for method, operation in operations.items():
            responses = operation.setdefault("responses", {})
            responses.pop("422", None)
            default = GENERATION_ERRORS if method == "post" else ("404",) if "{" in path else ()
            statuses = OPERATION_ERRORS.get((method, path), default)
            if path.startswith("/v1/"):
                statuses = ("401", *statuses)
            for status in statuses:
                responses[status] = _error_response(status)
            if (method, path) in OK_CONTENT:
                ok = responses.setdefault("200", {"description": "Successful Response"})
                ok.setdefault("content", {}).update(OK_CONTENT[(method, path)])
    return schema


def install_openapi(app: FastAPI) -> None:
    """Serve ``router_openapi`` (computed once) at ``/openapi.json``."""
    cached: dict[str, Any] = {}

    def openapi() -> dict[str, Any]:
        if not cached:
            cached.update(router_openapi(app))
        return cached

    app.openapi = openapi  # type: ignore[method-assign]
