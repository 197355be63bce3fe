"""Stored responses of the Responses API (`store`, true unless a request says false, as OpenAI's):
kept in memory, the newest `capacity` of them (atlas.serve --response-store N), so a request can go
on from one (`previous_response_id`: its input and output items come before the new input, its
instructions do not), GET / DELETE /v1/responses/{id} find it and GET
/v1/responses/{id}/input_items lists what it answered. The oldest also go while the kept
ones' JSON passes `max_bytes` (a request body may be 64 MiB). Nothing survives a restart."""

from __future__ import annotations

import json
import threading
from collections import OrderedDict
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from .errors import RequestError

DEFAULT_RESPONSE_STORE = 256  # responses kept; the oldest goes first
MAX_STORED_BYTES = 256 << 20  # their JSON, each counted whole (a chained conversation's shared items again each time)
DEFAULT_ITEM_PAGE, MAX_ITEM_PAGE = 20, 100  # input items listed per page: OpenAI's default and limit


@dataclass(frozen=True)
class StoredResponse:
    body: dict[str, Any]  # the final response object, as it was sent
    items: tuple[dict[str, Any], ...]  # the conversation as input items: earlier ones, this input, this output

    def size(self) -> int:
        return len(json.dumps(self.body)) + len(json.dumps(self.items))

    def input_items(self) -> list[dict[str, Any]]:
        """What the response answered: the conversation without its own output, oldest first."""
        return list(self.items[: len(self.items) - len(self.body.get("output", ()))])


class ResponseStore:
    def __init__(self, capacity: int = DEFAULT_RESPONSE_STORE, max_bytes: int = MAX_STORED_BYTES) -> None:
        self.capacity, self.max_bytes = capacity, max_bytes
        self._kept: OrderedDict[str, tuple[StoredResponse, int]] = OrderedDict()
        self._bytes = 0
        self._lock = threading.Lock()

    def put(self, response_id: str, stored: StoredResponse) -> None:
        """Keeps `stored` as the newest, in place of what the id held (a background response's queued body)."""
        size = stored.size()
        with self._lock:
            replaced = self._kept.pop(response_id, None)
            self._bytes -= 0 if replaced is None else replaced[1]
            self._kept[response_id] = (stored, size)
            self._bytes += size
            while self._kept and (len(self._kept) > self.capacity or self._bytes > self.max_bytes):
                self._bytes -= self._kept.popitem(last=False)[1][1]

    @property
    def stored_bytes(self) -> int:
        return self._bytes

    def get(self, response_id: str) -> StoredResponse | None:
        with self._lock:
            kept = self._kept.get(response_id)
        return None if kept is None else kept[0]

    def delete(self, response_id: str) -> bool:
        with self._lock:
            kept = self._kept.pop(response_id, None)
            self._bytes -= 0 if kept is None else kept[1]
        return kept is not None

    def earlier_items(self, body: Any) -> list[dict[str, Any]]:
        """The items a request goes on from (its previous_response_id's conversation; none without one)."""
        if not isinstance(body, dict) or body.get("previous_response_id") is None:
            return []
        previous = body["previous_response_id"]
        if not isinstance(previous, str):
            raise RequestError("'previous_response_id' must be a string", "previous_response_id")
        stored = self.get(previous)
        if stored is None:
            why = "this server stores none (--response-store 0)" if not self.capacity else \
                f"it is not among those kept (--response-store {self.capacity}), was sent with store false, or was deleted"
            raise RequestError(f"no stored response has id {previous!r}: {why}", "previous_response_id",
                               "previous_response_not_found")
        if stored.body["status"] in ("queued", "in_progress"):
            raise RequestError(f"response {previous!r} is still in progress: go on from it once GET "
                               f"/v1/responses/{previous} says it completed", "previous_response_id")
        return list(stored.items)


def item_page(items: list[dict[str, Any]], query: Mapping[str, str]) -> dict[str, Any]:
    """OpenAI's list of a response's input items: `order` desc (newest first, the default) or asc,
    the items `after` / `before` an item id in that order, at most `limit` (1..100, default 20) of
    them (with before alone: those nearest it)."""
    order, limit = query.get("order", "desc"), query.get("limit", str(DEFAULT_ITEM_PAGE))
    if order not in ("asc", "desc"):
        raise RequestError(f"'order' must be 'asc' or 'desc', got {order!r}", "order")
    if not (limit.isascii() and limit.isdigit() and len(limit) <= 3 and 1 <= int(limit) <= MAX_ITEM_PAGE):
        raise RequestError(f"'limit' must be an integer in 1..{MAX_ITEM_PAGE}, got {limit[:24]!r}", "limit")
    ordered = items if order == "asc" else items[::-1]
    ids = [item["id"] for item in ordered]
    start = item_index(ids, query, "after") + 1 if "after" in query else 0
    stop = item_index(ids, query, "before") if "before" in query else len(ordered)
    span = range(start, max(start, stop))
    chosen = span[-int(limit):] if "before" in query and "after" not in query else span[: int(limit)]
    page = [ordered[i] for i in chosen]
    return {"object": "list", "data": page, "first_id": page[0]["id"] if page else None,
            "last_id": page[-1]["id"] if page else None, "has_more": len(page) < len(span)}


def item_index(ids: list[str], query: Mapping[str, str], name: str) -> int:
    if query[name] not in ids:
        raise RequestError(f"'{name}': this response has no input item with id {query[name]!r}", name)
    return ids.index(query[name])


def not_found(response_id: str) -> RequestError:
    return RequestError(f"no stored response has id {response_id!r}", None, "not_found", status=404)
