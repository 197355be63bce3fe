"""Stop strings over streamed text: text that may begin a stop string is held back until it
cannot, so a stop string never reaches the reader, not even in part, unless asked for (vLLM's
include_stop_str_in_output: the text then ends with it) (LLM.generate / stream and the server)."""

from __future__ import annotations


class StopMatcher:
    def __init__(self, stops: tuple[str, ...], include: bool = False) -> None:
        self.stops = tuple(s for s in stops if s)
        self.include = include  # the stop string that ends the text is part of it
        self.pending = ""
        self.stopped = False
        self.matched: str | None = None  # the stop string that ended the text

    def push(self, piece: str) -> str:
        """Add generated text; return what may be sent now (after a stop: nothing more)."""
        if self.stopped:
            return ""
        self.pending += piece
        hits = [(i, s) for i, s in ((self.pending.find(s), s) for s in self.stops) if i >= 0]
        if hits:
            self.stopped = True
            at, self.matched = min(hits, key=lambda hit: hit[0])  # the earliest; at one place, the first listed
            text, self.pending = self.pending[: at + len(self.matched) if self.include else at], ""
            return text
        keep = self._held_back()
        text = self.pending[: len(self.pending) - keep]
        self.pending = self.pending[len(self.pending) - keep :]
        return text

    def flush(self) -> str:
        """The held-back tail once generation has ended without a stop string."""
        text, self.pending = ("" if self.stopped else self.pending), ""
        return text

    def _held_back(self) -> int:
        """Length of the longest tail of the pending text that begins some stop string."""
        return max((partial_suffix(self.pending, stop) for stop in self.stops), default=0)


def partial_suffix(text: str, tag: str) -> int:
    """Length of the longest end of `text` that begins `tag` (shorter than it)."""
    for size in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:size]):
            return size
    return 0
