"""What ends a generation besides max_tokens: stop strings over the streamed text (text that may
begin one is held back until it cannot, so a stop string never reaches the client, not even in
part), stop token ids, and the model's eos tokens unless ignore_eos."""

from __future__ import annotations

from dataclasses import dataclass

from .reasoning import partial_suffix


@dataclass(frozen=True)
class Stops:
    strings: tuple[str, ...] = ()
    token_ids: tuple[int, ...] = ()  # vLLM's stop_token_ids: their text stays in the output
    ignore_eos: bool = False  # vLLM's: generate max_tokens whatever the model's eos (benchmarks)

    def end_ids(self, eos_ids: set[int]) -> set[int]:
        """The token ids that end a generation."""
        return (set() if self.ignore_eos else set(eos_ids)) | set(self.token_ids)


class StopMatcher:
    def __init__(self, stops: tuple[str, ...]) -> None:
        self.stops = tuple(s for s in stops if s)
        self.pending = ""
        self.stopped = False

    def push(self, piece: str) -> str:
        """Add generated text; return what may be sent now (after a stop: nothing more)."""
        if self.stopped:
            return ""
        self.pending += piece
        hits = [i for i in (self.pending.find(s) for s in self.stops) if i >= 0]
        if hits:
            self.stopped = True
            text, self.pending = self.pending[: min(hits)], ""
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
