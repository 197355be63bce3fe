"""vLLM's use_beam_search on the completions and chat routes: one beam search per prompt runs as
one engine job (atlas.beam_search), and its n best beams are the prompt's n choices, each read as
a generation's events (its whole text in one piece, then its end), so the answer, the stream and
the usage are built as for sampled choices."""

from __future__ import annotations

from collections.abc import AsyncGenerator, AsyncIterator
from contextlib import aclosing

import anyio

from .worker import Event, Failed, Finished, Searched, TextPiece


class SharedSearch:
    """A beam search job whose beams several choices read; the first choice read starts it."""

    def __init__(self, events: AsyncIterator[Event], prompt_tokens: int) -> None:
        self.events = events  # the job's events: not queued until first read
        self.prompt_tokens = prompt_tokens
        self.lock = anyio.Lock()
        self.outcome: Searched | Failed | None = None

    async def result(self) -> Searched | Failed:
        async with self.lock:
            if self.outcome is None:
                self.outcome = await self.run()
        return self.outcome

    async def run(self) -> Searched | Failed:
        async with aclosing(self.events):  # type: ignore[type-var]  # a cancelled read cancels the job
            async for event in self.events:
                if isinstance(event, (Searched, Failed)):
                    return event
        return Failed("the engine stopped before finishing")

    async def choice(self, index: int) -> AsyncGenerator[Event, None]:
        """Beam `index`'s text and end, as a generation's events."""
        outcome = await self.result()
        if isinstance(outcome, Failed):
            yield outcome
            return
        if index >= len(outcome.beams):  # a vocabulary narrower than n: an empty choice
            yield TextPiece("")
            yield Finished("length", outcome.prompt_tokens, 0, outcome.cached_tokens,
                           generation_seconds=outcome.generation_seconds)
            return
        beam = outcome.beams[index]
        generated = tuple(beam.tokens[self.prompt_tokens :])
        yield TextPiece(beam.text or "", token_ids=generated, tokens=len(generated))
        yield Finished(beam.finish_reason or "length", outcome.prompt_tokens, len(generated), outcome.cached_tokens,
                       generation_seconds=outcome.generation_seconds)
