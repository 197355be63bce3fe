"""Generations take turns on an engine: it holds one sequence's state (KV cache, DeltaNet states,
the step's buffers), so a generation that another one overtook would go on from the other's state
and write plausible text that is wrong.

Across threads, the engine's steps run one at a time (a re-entrant lock: a whole `generate()` is
one turn, so concurrent calls queue and each answers as if alone; a stream holds it for one token
at a time). Each generation takes a number when it starts; one that finds a newer number when it
resumes (a stream read after another generation ran, `generate()` called from an `on_text`
callback) fails with one line instead of continuing.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field

from .errors import AtlasError

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
