"""Generations take turns on an engine: it holds one sequence's state (KV cache, DeltaNet states,
the step's buffers), so a generation that another one overtook would go on from the other's state
and write plausible text that is wrong.

The engine holds the turns, so every caller gets them (LLM, the server's worker). Across threads,
its steps run one at a time (a re-entrant lock: a whole Engine.run, i.e. `generate()`, is one turn,
so concurrent calls queue and each answers as if alone; iter_tokens, i.e. a stream, holds it for
one token at a time). Each generation takes a number when it starts; one that finds a newer
number when it resumes (a stream read after another generation ran, `generate()` called from an
`on_text` callback) fails with one line instead of continuing.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import TypeVar

from .errors import AtlasError

T = TypeVar("T")
OVERTAKEN = (
    "another generation ran on this LLM while this one was open (a stream read after a later "
    "generate() or stream() started, or a generation started from on_text); an LLM runs one "
    "sequence at a time: finish or close a stream before starting the next generation"
)

CLOSED = "this LLM was closed (LLM.close() or the end of its with-block) and its memory freed; load a new LLM"


@dataclass
class GenerationTurns:
    lock: threading.RLock = field(default_factory=threading.RLock)
    latest: int = 0  # the number of the generation that started last
    closed: bool = False  # LLM.close(): no generation may start or go on

    def start(self) -> int:
        """A new generation's number (call with the lock held)."""
        if self.closed:
            raise AtlasError(CLOSED)
        self.latest += 1
        return self.latest

    def check(self, mine: int) -> None:
        """AtlasError when the LLM was closed or a generation started after `mine` (call with the
        lock held)."""
        if self.closed:
            raise AtlasError(CLOSED)
        if self.latest != mine:
            raise AtlasError(OVERTAKEN)

    def guarded(self, callback: Callable[[int], T] | None, mine: int) -> Callable[[int], T] | None:
        """callback, followed by check(mine): a callback may not start a generation of its own."""
        if callback is None:
            return None

        def checked(token: int) -> T:
            result = callback(token)
            self.check(mine)
            return result

        return checked

    def taken(self, steps: Iterator[T]) -> Iterator[T]:
        """steps, one item per turn, as one generation numbered at its first item: an item read
        after a newer generation started is AtlasError(OVERTAKEN)."""
        mine: int | None = None
        while True:
            with self.lock:  # calls from other threads wait between the items
                if mine is None:
                    mine = self.start()
                else:
                    self.check(mine)
                item = next(steps, None)
            if item is None:
                return
            yield item
