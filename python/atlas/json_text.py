"""json.loads for text from outside (files, flags, request fields, model output): nesting deeper
than Python's parser recurses is a JSONDecodeError like any other malformed text, so each
caller's one-line error covers it instead of a RecursionError traceback."""

from __future__ import annotations

import json
from typing import Any


def loads(text: str | bytes, **kwargs: Any) -> Any:
    try:
        return json.loads(text, **kwargs)
    except RecursionError:
        raise json.JSONDecodeError("nested too deeply", text if isinstance(text, str) else "", 0) from None
