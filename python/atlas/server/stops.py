"""What ends a generation besides max_tokens: stop strings (matched by atlas.stop_strings), stop
token ids, and the model's eos tokens unless ignore_eos."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Stops:
    strings: tuple[str, ...] = ()
    token_ids: tuple[int, ...] = ()  # vLLM's stop_token_ids: their text stays in the output
    ignore_eos: bool = False  # vLLM's: generate max_tokens whatever the model's eos (benchmarks)

    def end_ids(self, eos_ids: set[int]) -> set[int]:
        """The token ids that end a generation."""
        return (set() if self.ignore_eos else set(eos_ids)) | set(self.token_ids)
