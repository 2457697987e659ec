"""A cap on request body size, as plain ASGI middleware in front of the app.

A body over the cap is answered 413 in the OpenAI error shape as soon as it is
known to be too large: at once when ``Content-Length`` says so, otherwise when
the received bytes pass the cap. Nothing over the cap is buffered or parsed.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

from fastapi.responses import JSONResponse

from services.router.protocol import APIError

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]


def too_large(limit: int) -> APIError:
    return APIError(
        413,
        f"the request body is larger than {limit} bytes, the most this server accepts "
        "(--max-request-body-bytes); send a shorter prompt",
        "invalid_request_error",
        None,
        "request_too_large",
    )


class BodySizeLimit:
    """Refuse bodies over ``limit`` bytes with 413; pass everything else through unchanged."""

    def __init__(self, app: ASGIApp, limit: int, on_refused: Callable[[str], None] | None = None) -> None:
        self.app = app
        self.limit = limit
        self.on_refused = on_refused

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = dict(scope.get("headers") or [])
        declared = headers.get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.limit:
            await self._refuse(scope, receive, send)
            return
        chunks, size = [], 0
        while True:
            message = await receive()
            if message["type"] != "http.request":
                break  # the client left; the app sees the disconnect below
            chunks.append(message.get("body", b""))
            size += len(chunks[-1])
            if size > self.limit:
                await self._refuse(scope, receive, send)
                return
            if not message.get("more_body", False):
                message = {"type": "http.request", "body": b"".join(chunks), "more_body": False}
                break
        replayed = False

        async def replay() -> Message:
            nonlocal replayed
            if not replayed:
                replayed = True
                return message
            return await receive()

        await self.app(scope, replay, send)

    async def _refuse(self, scope: Scope, receive: Receive, send: Send) -> None:
        if self.on_refused is not None:
            self.on_refused(scope.get("path", ""))
        error = too_large(self.limit)
        await JSONResponse(error.body(), status_code=413, headers={"connection": "close"})(scope, receive, send)
