"""Cross-origin requests (CORS) for web pages that call the server from a browser, with vLLM's flags
and defaults: --allowed-origins, --allowed-methods and --allowed-headers as JSON lists (default
["*"]), --allowed-credentials. Starlette's CORSMiddleware sits outside the API-key gate, so a
browser's preflight (an OPTIONS request, which carries no key) is answered, and a 401 carries the
headers that let the page read it."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import TYPE_CHECKING

from ..errors import AtlasError
from .. import json_text

if TYPE_CHECKING:
    from starlette.middleware import Middleware

ANY = ("*",)


@dataclass(frozen=True)
class CorsPolicy:
    origins: tuple[str, ...] = ANY
    methods: tuple[str, ...] = ANY
    headers: tuple[str, ...] = ANY
    credentials: bool = False

    def middleware(self) -> Middleware:
        from starlette.middleware import Middleware
        from starlette.middleware.cors import CORSMiddleware

        return Middleware(CORSMiddleware, allow_origins=list(self.origins), allow_methods=list(self.methods),
                          allow_headers=list(self.headers), allow_credentials=self.credentials)


def string_list(flag: str, value: str) -> tuple[str, ...]:
    """A flag's JSON list of strings, e.g. '["https://chat.example.com"]', or one line."""
    example = "'[\"*\"]' or '[\"http://localhost:3000\"]'"
    try:
        parsed = json_text.loads(value)
    except json.JSONDecodeError as err:
        raise AtlasError(f"{flag} is not JSON ({err.msg}); give a list of strings, e.g. {example}") from None
    if not isinstance(parsed, list) or not all(isinstance(item, str) and item.strip() for item in parsed):
        raise AtlasError(f"{flag} must be a JSON list of non-empty strings, e.g. {example}")
    return tuple(parsed)


def cors_policy(origins: str, methods: str, headers: str, credentials: bool) -> CorsPolicy:
    """The flags' policy, each checked."""
    return CorsPolicy(string_list("--allowed-origins", origins), string_list("--allowed-methods", methods),
                      string_list("--allowed-headers", headers), credentials)
