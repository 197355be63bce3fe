"""vLLM's request ids: a client's X-Request-Id header (else a body's request_id) names a chat or
completions answer (`chatcmpl-<id>`, `cmpl-<id>`), and --enable-request-id-headers sends
X-Request-Id back on every response (the client's, else a new one), so a gateway's logs and the
answers it relayed meet."""

from __future__ import annotations

import uuid

from starlette.types import ASGIApp, Message, Receive, Scope, Send

HEADER = b"x-request-id"


class RequestIdHeaders:
    """A pure ASGI middleware (streams pass through): a request without X-Request-Id gets a new
    one before the app sees it, so the answer's id and the response header agree."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        value = dict(scope["headers"]).get(HEADER)
        if not value:
            value = uuid.uuid4().hex.encode()
            scope = {**scope, "headers": [*scope["headers"], (HEADER, value)]}

        async def send_with_id(message: Message) -> None:
            if message["type"] == "http.response.start":
                message = {**message, "headers": [*message.get("headers", []), (HEADER, value)]}
            await send(message)

        await self.app(scope, receive, send_with_id)
