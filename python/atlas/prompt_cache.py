"""The prompt cache: a prompt that starts with tokens an earlier request already ran resumes after
them instead of prefilling from position 0 (llama.cpp's prompt cache, vLLM's prefix caching), for
one sequence at a time.

What a resume needs. A full-attention layer's KV row p holds token p's keys and values until a
later pass writes position p again, so a prefix stays usable while its rows are not overwritten
(`rows`: the token sequence the KV rows hold). The Gated DeltaNet layers' conv and recurrent
states fold in the whole sequence and cannot be rolled back, so a resume point needs them as they
were there: either the live states (the sequence fed so far, `history`) or a checkpoint, a copy
of them taken during an earlier prefill.

Where checkpoints are taken. At the end of each prompt (a later prompt that extends it, as a
chat's next turn or a longer completion does, resumes there) and, for prompts of MIN_TAIL_PROMPT
tokens or more, CHECKPOINT_TAIL tokens before the end: a chat's next turn re-renders the previous
turn's generation prompt differently (Qwen's history drops the "<think>" the generation prompt
opened), so it leaves the previous prompt a few tokens before its end. That checkpoint costs one
extra short pass. A checkpoint also keeps its last token's final hidden state, so a prompt equal
to a checkpoint's tokens needs no pass at all (its logits come from that row), and, for the MTP
head, the hidden row the head reads. At most `capacity` checkpoints are kept, the least recently
used dropped first; one whose tokens the KV rows no longer hold is dropped at once.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

from .backends.base import Backend, Tensor
from .snapshot import DeltaNetSnapshot, copy_tensor

CHECKPOINT_TAIL = 16  # tokens before a prompt's end where its second checkpoint goes
MIN_TAIL_PROMPT = 128  # shorter prompts get only the end checkpoint (the extra pass would cost more than it saves)


@dataclass
class StateCheckpoint:
    """The DeltaNet states after `ids`, with the last token's rows."""

    ids: list[int]
    states: DeltaNetSnapshot
    hidden: Tensor  # [1, H] final-normed hidden state of the last token
    head_input: Tensor  # [1, H] the row the MTP head reads for the last token (valid when has_head_input)
    has_head_input: bool = False
    last_used: int = 0


@dataclass(frozen=True)
class Resume:
    """Where a prefill starts: the prompt's first `start` tokens are in the state once the
    checkpoint (None: the live state as it is) is restored; 0: a fresh state."""

    start: int = 0
    checkpoint: StateCheckpoint | None = None


ResumeFilter = Callable[[int, StateCheckpoint | None], bool]  # (start, checkpoint) -> usable by this caller


def common_prefix(a: list[int], b: list[int]) -> bool:
    """a is a prefix of b."""
    return len(a) <= len(b) and b[: len(a)] == a


@dataclass
class PromptCache:
    backend: Backend
    capacity: int  # checkpoints kept; 0: no reuse at all, every prefill starts fresh
    history: list[int] | None = field(default_factory=list)  # tokens the live states hold; None: unknown
    beyond: list[int] = field(default_factory=list)  # tokens the KV rows hold past `history`
    checkpoints: list[StateCheckpoint] = field(default_factory=list)
    spare: list[StateCheckpoint] = field(default_factory=list)  # dropped ones, their buffers reused
    last_hit: int = 0  # prompt tokens the latest prefill took from the cache
    _clock: int = 0

    @property
    def enabled(self) -> bool:
        return self.capacity > 0

    # --- choosing where a prompt starts ------------------------------------------------------
    def choose(self, prompt: list[int], usable: ResumeFilter | None = None) -> Resume:
        """The longest usable start: the live states when the prompt extends what they hold (ties
        go to them: nothing to copy), else the longest checkpoint whose tokens begin the prompt."""
        best = Resume()
        if not self.enabled:
            return best
        ok = usable or (lambda start, checkpoint: True)
        live = self.history
        if live and len(live) < len(prompt) and common_prefix(live, prompt) and ok(len(live), None):
            best = Resume(len(live))
        for checkpoint in self.checkpoints:
            length = len(checkpoint.ids)
            if length > best.start and common_prefix(checkpoint.ids, prompt) and ok(length, checkpoint):
                best = Resume(length, checkpoint)
        return best

    def resumed(self, resume: Resume) -> None:
        """The engine restored `resume.checkpoint` (if any) into its states."""
        self.last_hit = resume.start
        if resume.checkpoint is not None:
            assert self.history is not None, "a valid checkpoint's tokens are in the rows, so the live tokens are known"
            self.beyond = (self.history + self.beyond)[resume.start :]
            self.history = list(resume.checkpoint.ids)
            self._touch(resume.checkpoint)

    # --- following the live states -----------------------------------------------------------
    def reset(self) -> None:
        """Fresh states and caches: nothing is held any more."""
        self.history, self.beyond, self.last_hit = [], [], 0
        self._drop(list(self.checkpoints))

    def restored(self, ids: list[int]) -> None:
        """After reset, the states were written back from a saved sequence of `ids` (atlas.sequence_state)."""
        if self.enabled:
            self.history, self.beyond = list(ids), []

    def forget(self) -> None:
        """What the states hold is unknown (a pass that failed half way, a token fed without its
        id): nothing can be reused until the next fresh start."""
        self.history, self.beyond = None, []
        self._drop(list(self.checkpoints))

    @contextmanager
    def feeding(self, tokens: list[int], start: int) -> Iterator[None]:
        """Around a pass that feeds `tokens` at positions start..: `fed` after it, `forget` if it fails."""
        try:
            yield
        except BaseException:
            self.forget()
            raise
        self.fed(tokens, start)

    def fed(self, tokens: list[int], start: int) -> None:
        """`tokens` went through the model at positions start.. (states and KV rows updated)."""
        if not self.enabled:
            return
        if self.history is None or start != len(self.history):  # not a continuation: nothing known holds
            self.forget()
            return
        self.history.extend(tokens)
        if self.beyond[: len(tokens)] == tokens:
            del self.beyond[: len(tokens)]
        elif self.beyond:  # the rows past `start` change; with none, no checkpoint reaches past it
            self.beyond = []
            self._drop([c for c in self.checkpoints if not common_prefix(c.ids, self.history)])

    def rolled_back(self, length: int) -> None:
        """The DeltaNet states went back to their copy after `length` tokens (a rejected speculative
        draft); the KV rows past it still hold the tokens that were fed."""
        if self.enabled and self.history is not None:
            self.beyond = self.history[length:] + self.beyond
            del self.history[length:]

    # --- checkpoints -------------------------------------------------------------------------
    def marks(self, start: int, stop: int) -> list[int]:
        """Positions in (start, stop] after which a prefill of prompt tokens start..stop-1 takes a
        checkpoint (at most the tail and the end)."""
        if not self.enabled:
            return []
        tail = stop - CHECKPOINT_TAIL
        return ([tail] if stop >= MIN_TAIL_PROMPT and tail > start else []) + [stop]

    def save(self, states: list[Any], hidden: Tensor, head_input: Tensor | None = None) -> None:
        """Checkpoint the states as they are now, after the live `history`; hidden / head_input [1, H]."""
        if not self.enabled or not self.history:
            return
        checkpoint = next((c for c in self.checkpoints if c.ids == self.history), None)
        if checkpoint is not None:
            self._drop([checkpoint])  # refilled below: a failed copy must not leave it half written
        checkpoint = self._slot(states, hidden)
        checkpoint.states.take(states)
        copy_tensor(self.backend, checkpoint.hidden, hidden)
        checkpoint.has_head_input = head_input is not None
        if head_input is not None:
            copy_tensor(self.backend, checkpoint.head_input, head_input)
        checkpoint.ids = list(self.history)
        self.checkpoints.append(checkpoint)
        self._touch(checkpoint)

    def _slot(self, states: list[Any], hidden: Tensor) -> StateCheckpoint:
        """A checkpoint to fill: a spare one, else a new one while under capacity, else the least
        recently used."""
        if len(self.checkpoints) >= self.capacity:
            self._drop([min(self.checkpoints, key=lambda c: c.last_used)])
        if self.spare:
            return self.spare.pop()
        shape = tuple(hidden.shape)
        rows = (self.backend.zeros(shape, "f32"), self.backend.zeros(shape, "f32"))
        return StateCheckpoint([], DeltaNetSnapshot.for_states(self.backend, states), *rows)

    def _drop(self, checkpoints: list[StateCheckpoint]) -> None:
        for checkpoint in checkpoints:
            self.checkpoints.remove(checkpoint)
            checkpoint.ids = []
            self.spare.append(checkpoint)

    def _touch(self, checkpoint: StateCheckpoint) -> None:
        self._clock += 1
        checkpoint.last_used = self._clock
