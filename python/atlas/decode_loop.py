"""The decode loop of Engine.generate and LLM streaming: the tokens picked from the prompt's last
logits and from one decode step per token after it.

On a backend that queues its work (a GPU) the loop runs one step ahead: the step that feeds
token N, and token N+1's pick, are queued before token N is read back, so the GPU computes while
the host waits for the id, streams it and decides whether to go on. Stopping after token N (an
end-of-sequence id, a stop string) then leaves that one step computed for nothing; the state holds
token N, which the prompt cache records. Where the host needs each token's logits (logprobs, a
pick made on the host or constrained by structured output) a step is queued only once the
previous token is read.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np

from .backends.base import SamplingParams, Tensor
from .sampling import Penalties


@dataclass
class Picking:
    """How each token is picked: the settings, the seeded draws, the penalties' history."""

    sampling: SamplingParams
    rng: np.random.Generator
    penalties: Penalties | None
    keeps_logits: bool = False  # the consumer reads each token's logits (its logprobs)


def decoded_tokens(engine: Any, logits: Tensor, position: int, limit: int, picking: Picking) -> Iterator[tuple[int, Tensor | None]]:
    """Up to `limit` tokens, the first picked from `logits` (the last prompt token's [1, V]) and fed
    at `position`, each with the logits it was picked from (None when the loop ran ahead: those
    logits are gone). The consumer stops by leaving the loop. engine: atlas.engine.Engine or a
    wrapper of it (every step goes through its decode_* methods)."""
    constrained = picking.penalties is not None and picking.penalties.constraint is not None
    ahead = engine.backend.runs_ahead and not (picking.sampling.on_host or picking.keeps_logits or constrained)
    steps = _queued_ahead if ahead else _in_turn
    return steps(engine, logits, position, limit, picking)


def _in_turn(engine: Any, logits: Tensor, position: int, limit: int, picking: Picking) -> Iterator[tuple[int, Tensor | None]]:
    token, token_t = engine.pick_tensor(logits, picking.sampling, picking.rng, picking.penalties)
    for count in range(1, limit + 1):
        yield token, logits
        if count == limit:
            return
        logits = engine.decode_tensor(token_t, position, token)
        token, token_t = engine.pick_tensor(logits, picking.sampling, picking.rng, picking.penalties)
        position += 1


def _queued_ahead(engine: Any, logits: Tensor, position: int, limit: int, picking: Picking) -> Iterator[tuple[int, None]]:
    # The first token is read at once: it streams before the first step (a graph capture) is made.
    token, token_t = engine.pick_tensor(logits, picking.sampling, picking.rng, picking.penalties)
    yield token, None
    if limit == 1:
        return
    token_t = engine.queue_pick(engine.decode_tensor(token_t, position, token), picking.sampling, picking.rng,
                                picking.penalties)
    pending = engine.backend.read_later(token_t)
    for count in range(2, limit + 1):
        position += 1
        feeds = count < limit  # a later token will be wanted: the step that feeds this one goes first
        if feeds:
            logits = engine.decode_unread(token_t, position)
            token_t = engine.queue_pick(logits, picking.sampling, picking.rng, picking.penalties)
            following = engine.backend.read_later(token_t)
        yield engine.read_pick(pending, picking.penalties, position if feeds else None), None
        if not feeds:
            return
        pending = following
