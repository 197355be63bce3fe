"""json.loads for text from outside (files, flags, request fields, model output): nesting deeper
than Python's parser recurses is a JSONDecodeError like any other malformed text, so each
caller's one-line error covers it instead of a RecursionError traceback."""

from __future__ import annotations

import json
import math
import re
from typing import Any


def loads(text: str | bytes, **kwargs: Any) -> Any:
    doc = text if isinstance(text, str) else ""
    try:
        return json.loads(text, **kwargs)
    except RecursionError:
        raise json.JSONDecodeError("nested too deeply", doc, 0) from None
    except json.JSONDecodeError:
        raise
    except ValueError as err:  # int() past Python's 4300-digit limit; a parse_* hook's own refusal
        if "digits" not in str(err):
            raise
        raise json.JSONDecodeError("an integer too long to read (over 4300 digits)", doc, 0) from None


def flag_value(text: str, flag: str, hint: str) -> Any:
    """A command-line flag's JSON text, parsed; text that is not JSON is one AtlasError line:
    "<flag> is not JSON (<why>); <hint>"."""
    from .errors import AtlasError

    try:
        return loads(text)
    except json.JSONDecodeError as err:
        raise AtlasError(f"{flag} is not JSON ({err.msg}); {hint}") from None


def loads_finite(text: str) -> Any:
    """RFC 8259 JSON only, for text a response writes back as JSON (a model's tool arguments):
    NaN / Infinity, numbers past the float range (1e999) and strings with an unpaired UTF-16
    surrogate ("\\ud800") raise ValueError, as no JSON encoder or UTF-8 stream can carry them."""

    def refuse(literal: str) -> float:
        raise ValueError(f"{literal[:40]} is not a finite number")

    def finite(literal: str) -> float:
        value = float(literal)
        return value if math.isfinite(value) else refuse(literal)

    value = loads(text, parse_constant=refuse, parse_float=finite)
    if "\\u" in text and not encodable(value):
        raise ValueError("a string holds an unpaired UTF-16 surrogate")
    return value


def encodable(value: Any) -> bool:
    """Every string and key in a parsed value is valid Unicode (UTF-8 encodable)."""
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            return False
        return True
    if isinstance(value, dict):
        return all(encodable(key) and encodable(item) for key, item in value.items())
    if isinstance(value, list):
        return all(encodable(item) for item in value)
    return True


PATH_KEY = re.compile(r"[A-Za-z0-9_-]{1,64}")


def unpaired_surrogate_path(body: object) -> str | None:
    """The parameter path ("messages[0].content") of the first string, in document order, that is
    not valid Unicode, or of the object holding such a key; None when there is none ("" for the
    body itself). Paths are built only for the one found."""
    Link = tuple[object, object] | None  # (parent link, key or index)
    pending: list[tuple[object, Link]] = [(body, None)]
    while pending:
        value, link = pending.pop()
        if isinstance(value, str):
            if not value.isascii() and not utf8_clean(value):
                return _path(link)
        elif isinstance(value, dict):
            if not all(utf8_clean(key) for key in value):
                return _path(link)
            pending.extend((item, (link, key)) for key, item in reversed(value.items()) if isinstance(item, (str, dict, list)))
        elif isinstance(value, list):
            pending.extend((item, (link, i)) for i, item in reversed(list(enumerate(value))) if isinstance(item, (str, dict, list)))
    return None


def _path(link: tuple[object, object] | None) -> str:
    parts: list[str] = []
    while link is not None:
        link, key = link  # type: ignore[misc]
        if isinstance(key, int):
            parts.append(f"[{key}]")
        else:
            shown = str(key) if PATH_KEY.fullmatch(str(key)) else json.dumps(str(key)[:32])  # ASCII, one line
            parts.append(f".{shown}")
    return "".join(reversed(parts)).lstrip(".")


def utf8_clean(text: str) -> bool:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True
