"""OpenAI-style error bodies: {"error": {"message", "type", "param", "code"}}."""

from __future__ import annotations

from typing import Any


class RequestError(Exception):
    """A client mistake answered with `status` and an OpenAI error body naming the parameter."""

    def __init__(self, message: str, param: str | None = None, code: str | None = None, status: int = 400):
        super().__init__(message)
        self.message = message
        self.param = param
        self.code = code
        self.status = status

    @property
    def headers(self) -> dict[str, str] | None:
        return {"Retry-After": str(RETRY_AFTER_S)} if self.status == 503 else None  # the openai client waits that long


RETRY_AFTER_S = 1


def error_body(message: str, kind: str, param: str | None = None, code: str | None = None) -> dict[str, Any]:
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


def request_error_body(err: RequestError) -> dict[str, Any]:
    kind = "invalid_request_error" if err.status < 500 else "server_error"
    return error_body(err.message, kind, err.param, err.code)
