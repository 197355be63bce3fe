"""--api-key: a pure ASGI gate in front of the app (a streamed response passes through untouched)."""

from __future__ import annotations

import hmac

from starlette.responses import JSONResponse
from starlette.types import ASGIApp, Receive, Scope, Send

from . import messages_api
from .errors import error_body
from .paths import route_path

OPEN_PATHS = {"/health", "/ping", "/metrics", "/version"}  # for load balancers and scrapers; every other route needs the key


class ApiKeyGate:
    """A pure ASGI gate (a streamed response passes through untouched): every route but OPEN_PATHS
    needs the bearer key."""

    def __init__(self, app: ASGIApp, key: str) -> None:
        self.app = app
        self.key = key.encode()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and route_path(scope) not in OPEN_PATHS and not self.authorized(scope):
            message = "invalid or missing API key: send 'Authorization: Bearer <key>' (or 'x-api-key: <key>')"
            anthropic = messages_api.is_messages_path(route_path(scope))
            body = messages_api.error_body(message, 401) if anthropic else \
                error_body(message, "invalid_request_error", code="invalid_api_key")
            await JSONResponse(body, status_code=401)(scope, receive, send)
            return
        await self.app(scope, receive, send)

    def authorized(self, scope: Scope) -> bool:
        """`Authorization: Bearer <key>` (OpenAI's clients) or `x-api-key: <key>` (Anthropic's)."""
        headers = dict(scope["headers"])
        scheme, _, token = headers.get(b"authorization", b"").partition(b" ")
        if scheme.lower() == b"bearer" and hmac.compare_digest(token.strip(), self.key):
            return True
        return hmac.compare_digest(headers.get(b"x-api-key", b"").strip(), self.key)
