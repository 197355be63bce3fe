"""Background responses (`background: true`, as OpenAI's and vLLM's Responses API): the request is
answered at once with the response `queued`, the generation goes on in a task of the server's event
loop, GET /v1/responses/{id} shows it `queued` until the engine takes it (the worker's Started
event; a stream gets response.queued, then response.in_progress), then `in_progress` (with its
output so far) and then as it ended,
POST /v1/responses/{id}/cancel stops it (status `cancelled`), and the events of a streamed one are
kept, so a client that lost its connection resumes with
GET /v1/responses/{id}?stream=true&starting_after=<sequence_number>. A background stream's client
leaving does not stop the generation. Finished streams' events are kept for the newest `capacity`
of them while their text stays under `max_bytes`."""

from __future__ import annotations

import asyncio
import logging
from collections import OrderedDict
from collections.abc import AsyncGenerator
from typing import Any

from .errors import RequestError
from .responses_api import ResponseStream, stream_response
from .worker import Event

log = logging.getLogger("atlas.serve")
KEPT_FINISHED = 64  # finished background streams whose events stay resumable
KEPT_EVENT_BYTES = 64 << 20  # ... while their events' text stays under this


class BackgroundRun:
    """One background response: its generation task and, for a streamed one, the events it wrote."""

    def __init__(self, stream: ResponseStream, events: AsyncGenerator[Event, None], keep_events: bool) -> None:
        self.stream = stream
        self.keep_events = keep_events
        self.lines: list[str] = []  # server-sent events (when kept); line i has sequence_number i
        self.bytes = 0
        self.finished = False
        self._changed = asyncio.Event()
        self._task = asyncio.create_task(self._drive(events))

    async def _drive(self, events: AsyncGenerator[Event, None]) -> None:
        try:
            async for line in stream_response(self.stream, events):
                self._log([line])
        except asyncio.CancelledError:  # cancel(): closing the events frees the engine's slot
            self._end(self.stream.cancel())
        except Exception as err:  # a fault here, not the engine's (those arrive as events)
            log.exception("background response %s failed", self.stream.meta.id)
            self._end(self.stream.fail(f"internal error: {type(err).__name__}: {err}"))
        else:
            self._end([])

    def _log(self, lines: list[str]) -> None:
        if self.keep_events:
            self.lines += lines
            self.bytes += sum(map(len, lines))
        self._changed.set()
        self._changed = asyncio.Event()

    def _end(self, lines: list[str]) -> None:
        self.finished = True
        self._log(lines)

    def snapshot(self) -> dict[str, Any]:
        """The response before it ends: queued until the engine takes it, then in progress with its
        output so far."""
        return self.stream.meta.body("in_progress", self.stream.so_far()) if self.stream.running else self.stream.meta.body("queued", [])

    async def cancel(self) -> None:
        self._task.cancel()
        await asyncio.wait([self._task])  # not `await task`: a cancellation of the caller stays its own
        if not self.finished:  # cancelled before its first step: _drive never ran
            self._end(self.stream.cancel())

    async def follow(self, after: int) -> AsyncGenerator[str, None]:
        """The events after sequence number `after`, then each as it is written, to the last."""
        index = after + 1
        while True:
            while index < len(self.lines):
                yield self.lines[index]
                index += 1
            if self.finished:
                return
            await self._changed.wait()


class BackgroundRuns:
    """The server's background responses by id: every running one, and the newest finished streams
    (for their events)."""

    def __init__(self, capacity: int = KEPT_FINISHED, max_bytes: int = KEPT_EVENT_BYTES) -> None:
        self.capacity, self.max_bytes = capacity, max_bytes
        self._runs: OrderedDict[str, BackgroundRun] = OrderedDict()

    def start(self, stream: ResponseStream, events: AsyncGenerator[Event, None], keep_events: bool) -> BackgroundRun:
        self._evict()
        run = BackgroundRun(stream, events, keep_events)
        self._runs[stream.meta.id] = run
        return run

    def _evict(self) -> None:
        """Finished runs go, oldest first, past `capacity` of them or `max_bytes` of their events;
        those that kept no events go at once."""
        finished = [key for key, run in self._runs.items() if run.finished]
        kept = [key for key in finished if self._runs[key].keep_events]
        total = sum(self._runs[key].bytes for key in kept)
        for key in finished:
            if not self._runs[key].keep_events:
                del self._runs[key]
        for count, key in enumerate(kept):
            if len(kept) - count <= self.capacity and total <= self.max_bytes:
                break
            total -= self._runs.pop(key).bytes

    def get(self, response_id: str) -> BackgroundRun | None:
        return self._runs.get(response_id)

    def running(self, response_id: str) -> BackgroundRun | None:
        run = self._runs.get(response_id)
        return run if run is not None and not run.finished else None

    def forget(self, response_id: str) -> None:
        self._runs.pop(response_id, None)

    async def cancel_all(self) -> None:
        """At shutdown: every running generation stops, stored as cancelled."""
        for run in list(self._runs.values()):
            if not run.finished:
                await run.cancel()


def resume_after(query: Any) -> int:
    """GET /v1/responses/{id}?stream=true&starting_after=N: the sequence number to resume after (-1: from the start)."""
    value = query.get("starting_after", "-1")
    try:
        after = int(value) if value.isascii() else -2
    except ValueError:
        after = -2
    if after < -1:
        raise RequestError(f"'starting_after' must be a sequence number (an integer >= 0), got {value!r}",
                           "starting_after")
    return after
