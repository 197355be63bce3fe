"""The generation engine: one model, its state, the prompt in passes of at most PREFILL_CHUNK
tokens (after what the prompt cache already holds), then one token per step."""

from __future__ import annotations

import sys
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any

import numpy as np

from .backends.base import NO_TOKEN, Backend, KVCache, PendingArray, ReadyArray, SamplingParams, Tensor
from .backends.run_plan import DEFAULT_MAX_SEQ_LEN
from .config import ModelSpec
from .decode_loop import Picking, decoded_tokens
from .dump import dump_from_env
from .errors import AtlasError
from .kvcache import KVCacheOptions, new_states
from .layers.step import Dump, Step
from .models import load_model
from .prompt_cache import PromptCache, Resume, ResumeFilter, StateCheckpoint
from .safetensors import Checkpoint
from .sampling import (
    Penalties, TokenLogprob, check_logit_bias_ids, check_logprobs, check_sampling, choose_token, draw_uniform, host_argmax,
    host_pick, is_int, pick_state, token_logprob,
)
from .snapshot import DeltaNetSnapshot
from .turns import GenerationTurns

if TYPE_CHECKING:
    from .structured import TokenConstraint


PREFILL_CHUNK = 4096  # prompt tokens per forward: bounds a step's activations at any context length
NAN_CAUSES = ("a weight may hold NaN or infinity (--check-weights scans them) or an activation overflowed "
              "(ATLAS_DUMP=layers writes each layer's output, to find the first that goes bad)")
SCORE_ROWS = 64  # prompt rows whose logits [rows, V] are made at once when prompt tokens are scored
PromptForward = Callable[[Tensor, Tensor], tuple[Tensor, Tensor | None]]  # ids, positions -> hidden, head input
PromptPass = tuple[int, int, Tensor, Tensor, Tensor | None]  # start, stop, positions, hidden, head input


def prefill_chunks(tokens: int, chunk: int) -> list[tuple[int, int]]:
    """[start, stop) ranges of at most `chunk` tokens covering `tokens` prompt tokens in order."""
    return [(start, min(start + chunk, tokens)) for start in range(0, tokens, chunk)]


def split_passes(passes: list[tuple[int, int]], offset: int, marks: Sequence[int]) -> list[tuple[int, int]]:
    """`passes` shifted by `offset`, each split where it spans one of `marks` (absolute positions)."""
    out: list[tuple[int, int]] = []
    for start, stop in passes:
        start, stop = start + offset, stop + offset
        for mark in sorted(m for m in marks if start < m < stop):
            out.append((start, mark))
            start = mark
        out.append((start, stop))
    return out


@dataclass
class GenerationStats:
    token_ids: list[int] = field(default_factory=list)  # new tokens, the eos that stopped it included
    prompt_tokens: int = 0
    cached_tokens: int = 0  # prompt tokens the prompt cache held (not run again)
    prefill_seconds: float = 0.0
    decode_seconds: float = 0.0
    logprobs: list[TokenLogprob] = field(default_factory=list)  # one per new token, when asked for
    prompt_logprobs: list[TokenLogprob | None] = field(default_factory=list)  # one per prompt token, when asked for


@dataclass(frozen=True)
class GenerationRequest:
    prompt_ids: list[int]
    max_tokens: int
    sampling: SamplingParams
    seed: int | None
    eos_ids: set[int]
    on_token: Callable[[int], bool | None] | None = None  # a true return ends the generation (a stop string)
    logprobs: int | None = None  # None: none; N: each token's log-probability and the N most likely
    prompt_logprobs: int | None = None  # the same for the prompt's tokens (the first has none)
    constraint: TokenConstraint | None = None  # structured output (sampling.structured)

    def __post_init__(self) -> None:
        """Every way into Engine.run builds one: bad values are one line here, not numpy's
        ValueError (a negative seed) or a silent loop bound (a float max_tokens)."""
        if not is_int(self.max_tokens) or self.max_tokens < 0:
            raise AtlasError(f"max_tokens must be an integer >= 0, got {self.max_tokens!r}")
        check_logprobs(self.logprobs)
        check_logprobs(self.prompt_logprobs)
        if self.seed is not None and (not is_int(self.seed) or self.seed < 0):
            raise AtlasError(f"seed must be a non-negative integer, got {self.seed!r}")


class Engine:
    def __init__(
        self,
        spec: ModelSpec,
        checkpoint: Checkpoint,
        backend: Backend,
        max_seq_len: int = DEFAULT_MAX_SEQ_LEN,
        *,
        kv_cache: KVCacheOptions | None = None,
        prompt_cache: int = 0,
    ):
        """prompt_cache: checkpoints the prompt cache keeps (0: off; atlas.prompt_cache)."""
        if max_seq_len < 1:
            raise AtlasError(f"max_seq_len must be >= 1, got {max_seq_len}")
        self.spec = spec
        self.backend = backend
        self.max_seq_len = max_seq_len
        self.prefill_chunk = PREFILL_CHUNK  # the caches and states carry one pass into the next
        self.kv_plan = (kv_cache or KVCacheOptions()).plan(spec.layer_types, spec.head_dim, backend.name)  # per layer
        run_info = {"model_type": spec.model_type, "num_hidden_layers": spec.num_hidden_layers}
        env_dump = dump_from_env(backend, run_info)  # ATLAS_DUMP: checked before the weights load
        self.model = load_model(spec, checkpoint, backend)
        self.dump: Dump | None = env_dump  # set to receive every named intermediate (not during graphs)
        self.prompt_cache = PromptCache(backend, prompt_cache)
        self.turns = GenerationTurns()  # one sequence's state: generations take turns on it
        self.reset()

    def reset(self) -> None:
        """Fresh caches and states; the decode step is rebuilt on first use for the new buffers.
        The prompt cache forgets first: interrupted (Ctrl-C) after it, the next prompt starts fresh
        again instead of resuming into states that are gone."""
        self.prompt_cache.reset()
        self._decode: Callable[[Tensor, Tensor], Tensor] | None = None
        self.states: list[Any] = []  # the old states go back to the memory pool before new ones are made
        self.states = new_states(self.model.layers, self.backend, self.max_seq_len, self.kv_plan)

    # --- steps --------------------------------------------------------------------------------
    def forward(self, ids: Tensor, positions: Tensor) -> Tensor:
        """ids, positions [T] i32 -> final-normed hidden [T, H]; updates the state in place."""
        step = Step(self.backend, positions, self.dump)
        step.emit("positions", positions)  # tells a dump where each forward starts
        return self.model.forward(step, ids, self.states)

    def _last_logits(self, ids: Tensor, positions: Tensor) -> Tensor:
        """Logits of the last token only [1, V]."""
        hidden = self.forward(ids, positions)  # [T, H]
        return self.model.logits(Step(self.backend, positions, self.dump), self._row(hidden, ids.shape[0] - 1))

    def _row(self, t: Tensor, row: int) -> Tensor:
        """t [T, H] -> its row `row` [1, H] (a view on the backend: valid while t is)."""
        return self.backend.rows(t, row, row + 1)

    def _decode_step(self, ids: Tensor, positions: Tensor) -> Tensor:
        step = Step(self.backend, positions, None)
        return self.model.logits(step, self.forward(ids, positions))  # [1, V]

    def _ids(self, values: list[int], start: int) -> tuple[Tensor, Tensor]:
        ids = self.backend.upload(np.asarray(values, dtype=np.int32), "i32")
        positions = self.backend.upload(np.arange(start, start + len(values), dtype=np.int32), "i32")
        return ids, positions

    def prefill(self, prompt_ids: list[int]) -> Tensor:
        """Run the prompt, `prefill_chunk` tokens a pass, from what the prompt cache holds of it (a
        fresh state without one) -> logits of its last token [1, V]."""
        return self._run_prompt(prompt_ids, None)[0]

    def prefill_scored(self, prompt_ids: list[int], top: int) -> tuple[Tensor, list[TokenLogprob | None]]:
        """prefill() from a fresh state that also scores each prompt token after the first under
        the logits of the one before it, with the `top` most likely (echo, prompt logprobs)
        -> (logits of the last token [1, V], [None, TokenLogprob, ...] one per prompt token)."""
        return self._run_prompt(prompt_ids, top)

    def _run_prompt(self, prompt_ids: list[int], score_top: int | None) -> tuple[Tensor, list[TokenLogprob | None]]:
        self.check_ids(prompt_ids, 0)
        resume = self.resume(prompt_ids, None if score_top is None else lambda start, checkpoint: False)
        scores: list[TokenLogprob | None] = [None]
        if resume.start == len(prompt_ids):  # the whole prompt is a checkpoint's: its last row gives the logits
            assert resume.checkpoint is not None
            _, positions = self._ids(prompt_ids[-1:], len(prompt_ids) - 1)
            last = self.finite_row(resume.checkpoint.hidden, len(prompt_ids))
            return self.model.logits(Step(self.backend, positions, self.dump), last), scores
        passes = self.prompt_forwards(prompt_ids, resume.start, lambda ids, positions: (self.forward(ids, positions), None))
        for start, stop, positions, hidden, _ in passes:
            if score_top is not None:
                scores += self._score_rows(hidden, positions, prompt_ids, (start, stop), score_top)
        last = self.finite_row(self._row(hidden, stop - start - 1), len(prompt_ids))  # [1, H]
        return self.model.logits(Step(self.backend, positions, self.dump), last), scores

    def pooled(self, prompt_ids: list[int], pooling: str) -> np.ndarray:
        """The prompt's final-normed hidden rows pooled into one vector [H] f32 (atlas.embed), as one
        turn (atlas.turns): "last" its last row (resuming from the prompt cache), "mean" the mean
        of every row (from a fresh state: a cached start has no rows)."""
        with self.turns.lock:
            self.turns.start()
            self.check_ids(prompt_ids, 0)
            resume = self.resume(prompt_ids, None if pooling == "last" else lambda start, checkpoint: False)
            if resume.start == len(prompt_ids):
                assert resume.checkpoint is not None
                return self.backend.to_numpy(self.finite_row(resume.checkpoint.hidden, len(prompt_ids)))[0]
            total = np.zeros(self.spec.hidden_size, np.float64)  # [H]
            passes = self.prompt_forwards(prompt_ids, resume.start, lambda ids, positions: (self.forward(ids, positions), None))
            for start, stop, _, hidden, _ in passes:
                if pooling == "mean":
                    total += self.backend.to_numpy(hidden).sum(axis=0, dtype=np.float64)  # [H]
            last = self.backend.to_numpy(self.finite_row(self._row(hidden, stop - start - 1), len(prompt_ids)))[0]  # [H]
            return (total / len(prompt_ids)).astype(np.float32) if pooling == "mean" else last

    def finite_row(self, hidden: Tensor, prompt_tokens: int) -> Tensor:
        """The prompt's last hidden row [1, H], checked: NaN or infinity there (a NaN or infinite
        weight, an activation that overflowed) makes every logit NaN and every pick noise, so the
        generation stops with one line instead (the prompt cache forgets states that hold it)."""
        if not int(self.backend.to_numpy(self.backend.nonfinite_count(hidden))[0]):
            return hidden
        self.prompt_cache.forget()
        raise AtlasError(f"the model's hidden state after the prompt ({prompt_tokens} tokens) holds NaN or infinity, so "
                         f"its output would be noise: {NAN_CAUSES}")

    def checked(self, tokens: list[int], model: str = "model") -> list[int]:
        """Picks read back, checked: NO_TOKEN (a row of logits of NaN alone: the state went NaN
        mid-answer, past finite_row's check of the prompt) stops the generation with one line."""
        if NO_TOKEN in tokens:
            raise self.went_nan(model)
        return tokens

    def went_nan(self, model: str = "model") -> AtlasError:
        self.prompt_cache.forget()  # its newest states hold the NaN
        return AtlasError(f"the {model}'s logits went NaN during the generation, so its output would be noise: {NAN_CAUSES}")

    def prompt_forwards(self, prompt_ids: list[int], start: int, forward: PromptForward) -> Iterator[PromptPass]:
        """The prompt's tokens from `start` on in passes through `forward` (-> hidden [n, H], the
        MTP head's input [n, H] or None), the prompt cache told of each pass and checkpointed at
        its marks -> (start, stop, positions, hidden, head input) of each pass."""
        marks = self.prompt_cache.marks(start, len(prompt_ids))
        for a, b in self.prompt_passes(start, len(prompt_ids), marks):
            ids, positions = self._ids(prompt_ids[a:b], a)
            with self.prompt_cache.feeding(prompt_ids[a:b], a):
                hidden, head_input = forward(ids, positions)
            if b in marks:
                head_row = None if head_input is None else self._row(head_input, b - a - 1)
                self.prompt_cache.save(self.states, self._row(hidden, b - a - 1), head_row)
            yield a, b, positions, hidden, head_input

    def _score_rows(
        self, hidden: Tensor, positions: Tensor, prompt_ids: list[int], span: tuple[int, int], top: int
    ) -> list[TokenLogprob]:
        """A pass's rows start..stop-1 (hidden [n, H]) score the prompt tokens after them."""
        scored: list[TokenLogprob] = []
        for a, b, logits in self._row_logits(hidden, positions, span, (span[0], len(prompt_ids) - 1)):
            scored += self.score_rows(logits, prompt_ids[a + 1 : b + 1], top)
        return scored

    def _row_logits(self, hidden: Tensor, positions: Tensor, span: tuple[int, int],
                    wanted: tuple[int, int]) -> Iterator[tuple[int, int, Tensor]]:
        """(a, b, logits [b - a, V]) of a pass's rows span[0]..span[1]-1 (hidden [n, H]) that lie in
        wanted[0]..wanted[1]-1, in blocks of SCORE_ROWS rows."""
        start, stop = span
        for a in range(max(start, wanted[0]), min(stop, wanted[1]), SCORE_ROWS):
            b = min(a + SCORE_ROWS, stop, wanted[1])
            rows = self.backend.rows(hidden, a - start, b - start)  # [b - a, H]
            yield a, b, self.model.logits(Step(self.backend, positions), rows)

    def prefill_logits(self, prompt_ids: list[int], first: int) -> Iterator[tuple[int, int, Tensor]]:
        """The prompt from a fresh state (atlas.perplexity): (a, b, logits [b - a, V]) of its rows
        first..n-2 in blocks (row p's logits score token p + 1), as the passes make them."""
        self.check_ids(prompt_ids, 0)
        self.resume(prompt_ids, lambda start, checkpoint: False)
        forward = lambda ids, positions: (self.forward(ids, positions), None)  # noqa: E731
        for start, stop, positions, hidden, _ in self.prompt_forwards(prompt_ids, 0, forward):
            yield from self._row_logits(hidden, positions, (start, stop), (first, len(prompt_ids) - 1))

    def resume(self, prompt_ids: list[int], usable: ResumeFilter | None = None) -> Resume:
        """Put the state where the prompt cache holds the longest usable start of the prompt
        (restoring a checkpoint), or fresh; a dump sees every forward, so it always starts fresh."""
        resume = self.prompt_cache.choose(prompt_ids, usable) if self.dump is None else Resume()
        if resume.start == 0:
            self.reset()
            return resume
        if resume.checkpoint is not None:
            self.restore_states(resume.checkpoint.states)
        self.prompt_cache.resumed(resume)
        return resume

    def resumable(self, start: int, checkpoint: StateCheckpoint | None) -> bool:
        """Whether a generation can resume after `start` tokens from `checkpoint` (None: the live
        states): anywhere here; a speculative engine needs its head's rows too."""
        return True

    def extra_caches(self) -> dict[str, tuple[KVCache, int]]:
        """KV caches beside the layers' that a saved sequence keeps (atlas.sequence_state), each
        with how many of its rows hold the live sequence: none here."""
        return {}

    def extra_caches_restored(self, rows: dict[str, int]) -> None:
        """extra_caches' first rows[name] rows were written back from a saved sequence."""

    def restore_states(self, snapshot: DeltaNetSnapshot) -> None:
        """Copy a snapshot back into the DeltaNet states; the prompt cache forgets them if it fails."""
        try:
            snapshot.restore(self.states)
        except BaseException:  # half copied
            self.prompt_cache.forget()
            raise

    def prompt_passes(self, start: int, stop: int, marks: Sequence[int] = ()) -> Iterator[tuple[int, int]]:
        """[a, b) of each prefill pass over prompt tokens start..stop-1 in order: at most
        `prefill_chunk` tokens each, and one ending at each of `marks`; with a progress bar on
        stderr (cleared when done) when there is more than one."""
        from tqdm import tqdm

        passes = split_passes(prefill_chunks(stop - start, self.prefill_chunk), start, marks)
        bar = tqdm(total=stop - start, desc="prefill", unit="tok", file=sys.stderr, leave=False, disable=len(passes) == 1)
        with bar:
            for a, b in passes:
                yield a, b
                bar.update(b - a)

    def decode(self, token: int, position: int) -> Tensor:
        """One token at `position` -> its logits [1, V]."""
        self.check_ids([token], position)
        with self.prompt_cache.feeding([token], position):
            return self._one_token_logits(*self._ids([token], position))

    def decode_tensor(self, ids: Tensor, position: int, token: int | None = None) -> Tensor:
        """decode() for a token already on the backend (ids [1] i32, the previous pick_tensor):
        the greedy chain argmax -> next embedding stays on the device. `token`: the same id as read
        back, for the prompt cache (None: the cache forgets what the state holds)."""
        if tuple(ids.shape) != (1,):
            raise AtlasError(f"decode_tensor takes one token id of shape (1,), got {tuple(ids.shape)}")
        positions = self._step_position(position)
        if token is None:
            self.prompt_cache.forget()
            return self._one_token_logits(ids, positions)
        with self.prompt_cache.feeding([token], position):
            return self._one_token_logits(ids, positions)

    def decode_unread(self, ids: Tensor, position: int) -> Tensor:
        """decode_tensor of a pick not read back yet (the loop running ahead, atlas.decode_loop):
        the prompt cache learns its id from read_pick(fed_at=position)."""
        positions = self._step_position(position)
        try:
            return self._one_token_logits(ids, positions)
        except BaseException:
            self.prompt_cache.forget()
            raise

    def eager_decode(self, ids: Tensor, position: int) -> Tensor:
        """decode_tensor's step with its kernels launched one by one from the host, never a graph
        replay (bench/step_profile.py times each launch). The prompt cache forgets the state."""
        positions = self._step_position(position)
        self.prompt_cache.forget()
        return self._decode_step(ids, positions)

    def _step_position(self, position: int) -> Tensor:
        """[1] i32 on the backend for a decode step of a token already there, checked against
        max_seq_len (only the position: the id came from argmax / sample over the vocabulary)."""
        self.check_ids([0], position)
        return self.backend.upload(np.array([position], dtype=np.int32), "i32")

    def _one_token_logits(self, ids: Tensor, positions: Tensor) -> Tensor:
        """ids, positions [1] i32 -> logits [1, V] through the backend's decode step (a CUDA graph
        replay), built on first use after a reset."""
        if self.dump is not None:  # a dump needs every intermediate: eager, no graph replay
            return self._last_logits(ids, positions)
        if self._decode is None:
            self._decode = self.backend.make_decode_step(self._decode_step)
        return self._decode(ids, positions)

    def logits(self, ids: list[int]) -> np.ndarray:
        """Teacher-forced logits of every position [T, V] from a fresh state."""
        self.check_ids(ids, 0)
        self.reset()
        token_ids, positions = self._ids(ids, 0)
        step = Step(self.backend, positions, self.dump)
        with self.prompt_cache.feeding(ids, 0):
            hidden = self.forward(token_ids, positions)
        return self.backend.to_numpy(self.model.logits(step, hidden))

    def check_ids(self, ids: list[int], start: int) -> None:
        if not ids:
            raise AtlasError("the prompt is empty; give at least one token")
        if start + len(ids) > self.max_seq_len:
            raise AtlasError(
                f"{start + len(ids)} tokens exceed max_seq_len {self.max_seq_len}; "
                "shorten the prompt or max_tokens, or raise max_seq_len"
            )
        bad = [i for i in ids if not 0 <= i < self.spec.vocab_size]
        if bad:
            raise AtlasError(f"token id {bad[0]} is outside the vocabulary (0..{self.spec.vocab_size - 1})")

    # --- generation ---------------------------------------------------------------------------
    def pick(self, logits: Tensor, sampling: SamplingParams, rng: np.random.Generator) -> int:
        return self.pick_tensor(logits, sampling, rng)[0]

    def pick_tensor(
        self, logits: Tensor, sampling: SamplingParams, rng: np.random.Generator, penalties: Penalties | None = None
    ) -> tuple[int, Tensor]:
        """The chosen id read back (to stream it) and the backend tensor [1] i32 holding it (to feed
        decode_tensor without a host round trip). Penalties and logit_bias change the logits on the
        backend first (`penalties` carries the history and records the pick; a fresh one, without
        history, when None); only structured output and the host filters (typical-p, top-n-sigma,
        XTC: a second draw, XTC's chance; DRY) read the logits back to pick on the host."""
        if penalties is None and (sampling.adjusts_logits or sampling.host_state):
            penalties = Penalties([])
        if penalties is not None and (forced := penalties.forced()) is not None:
            token_t = self.backend.upload(np.array([forced], dtype=np.int32), "i32")
            penalties.add(forced, token_t)
            return forced, token_t
        if not sampling.on_host:
            token_t = self.queue_pick(logits, sampling, rng, penalties)
            return self.read_pick(ReadyArray(self.backend.to_numpy(token_t)), penalties), token_t
        uniform = draw_uniform(rng) if sampling.temperature else 0.0
        xtc_chance = draw_uniform(rng) if sampling.xtc_draws else None
        if penalties is not None and sampling.adjusts_logits:
            logits = penalties.apply(self.backend, logits, sampling)  # [1, V]
        token = self._host_pick(logits, sampling, uniform, xtc_chance, penalties)
        token_t = self.backend.upload(np.array([token], dtype=np.int32), "i32")
        if penalties is not None:
            penalties.add(token, token_t)
        return token, token_t

    def queue_pick(self, logits: Tensor, sampling: SamplingParams, rng: np.random.Generator,
                   penalties: Penalties | None) -> Tensor:
        """pick_tensor's pick on the backend (sampling not on the host), not read back: the [1] i32
        tensor there, counted for the penalties. read_pick takes its id."""
        uniform = draw_uniform(rng) if sampling.temperature else 0.0
        if penalties is not None and sampling.adjusts_logits:
            logits = penalties.apply(self.backend, logits, sampling)  # [1, V]
        token_t = self.backend.argmax(logits) if sampling.temperature == 0 else self.backend.sample(logits, sampling, uniform)
        if penalties is not None:
            penalties.counted(token_t)
        return token_t

    def read_pick(self, pending: PendingArray, penalties: Penalties | None, fed_at: int | None = None) -> int:
        """The id of a queued pick, read back (the oldest one not read). fed_at: the position where
        a decode step queued before this read (decode_unread) already fed it, which the prompt
        cache now learns; if the read fails, what the state holds is unknown."""
        try:
            token = self.checked([int(pending.result()[0])])[0]
        except BaseException:
            if fed_at is not None:
                self.prompt_cache.forget()
            raise
        if penalties is not None:
            penalties.read(token)
        if fed_at is not None:
            self.prompt_cache.fed([token], fed_at)
        return token

    def _host_pick(self, logits: Tensor, sampling: SamplingParams, uniform: float, xtc_chance: float | None,
                   penalties: Penalties | None) -> int:
        """A pick on the host: structured output's, or the filters' over the row read back (less
        DRY's penalties first, which structured output then sees too)."""
        constraint = None if penalties is None else penalties.constraint
        if sampling.structured and constraint is None:
            raise AtlasError("structured output needs its constraint: generate through atlas.LLM")
        if constraint is not None and not sampling.host_state:
            return self._structured_pick(logits, sampling, uniform, constraint, xtc_chance)
        row = self.backend.to_numpy(logits)[0]  # [V]
        if np.isnan(row).all():
            raise self.went_nan()
        if sampling.dry and penalties is not None:
            row = penalties.dry_row(row, sampling)  # [V]
        if sampling.mirostat_on and penalties is not None:
            if constraint is not None and not constraint.complete:
                row = constraint.mask(row, sampling.temperature)  # [V] the allowed tokens alone
            elif constraint is not None:
                return constraint.greedy(row)
            return penalties.mirostat_state(sampling).pick(row, sampling, uniform)
        if constraint is not None:
            return host_pick(row, sampling, uniform, constraint, xtc_chance)
        return choose_token(row, sampling, uniform, xtc_chance) if sampling.temperature else host_argmax(row)

    def _structured_pick(self, logits: Tensor, sampling: SamplingParams, uniform: float,
                         constraint: TokenConstraint, xtc_chance: float | None = None) -> int:
        """A greedy pick (or a complete shape's end) tries the backend's most likely ids first; a
        sampled one walks the backend's summary of the row (the most likely ids and logits, the
        log-sum-exp at the temperature). So a GPU reads back at most a few KB, and the row only
        when neither settles the pick."""
        from .structured import GREEDY_CANDIDATES, SAMPLE_CANDIDATES, ListedRow

        if sampling.temperature == 0 or constraint.complete:
            token = constraint.first_allowed(self.backend.to_numpy(self.backend.top_ids(logits, GREEDY_CANDIDATES)))
        else:
            vocab = int(logits.shape[-1])
            row_zero = self.backend.upload(np.zeros(1, dtype=np.int32), "i32")
            summary = self.backend.logprob_rows(logits, row_zero, min(SAMPLE_CANDIDATES, vocab), sampling.temperature)
            lse = self.backend.to_numpy(summary.lse)[0].astype(np.float64)  # hi, lo
            ids, values = self.backend.to_numpy(summary.ids)[0], self.backend.to_numpy(summary.values)[0]
            token = constraint.sample_listed(ListedRow(ids, values, float(lse[0] + lse[1]), vocab), sampling, uniform)
        if token is not None:
            return token
        row = self.backend.to_numpy(logits)[0]  # [V]
        if np.isnan(row).all():
            raise self.went_nan()
        return host_pick(row, sampling, uniform, constraint, xtc_chance)

    def token_logprob(self, logits: Tensor, token: int, top: int) -> TokenLogprob:
        """The picked token's log-probability under logits [1, V] and the `top` most likely."""
        return self.score_rows(logits, [token], top)[0]

    def score_rows(self, logits: Tensor, tokens: list[int], top: int) -> list[TokenLogprob]:
        """Each row of logits [R, V] scoring its token (sampling.token_logprob's values) from
        Backend.logprob_rows, so a GPU reads back a few floats a row; a row it cannot summarise
        (its peak not finite, or fewer than `top` ids listed) is read back whole."""
        summary = self.backend.logprob_rows(logits, self.backend.upload(np.array(tokens, dtype=np.int32), "i32"), top)
        parts = (summary.lse, summary.picked, summary.ranks, summary.ids, summary.values)
        lse, picked, ranks, ids, values = (self.backend.to_numpy(t) for t in parts)
        scored, whole = [], None
        for r, token in enumerate(tokens):
            if not np.isfinite(lse[r, 0]) or (top and ids[r].min() < 0):
                whole = self.backend.to_numpy(logits) if whole is None else whole  # [R, V]
                scored.append(token_logprob(whole[r], token, top))
                continue
            shift = float(lse[r, 0]) + float(lse[r, 1])
            alternatives = tuple((int(i), float(v) - shift) for i, v in zip(ids[r], values[r]))
            scored.append(TokenLogprob(token, float(picked[r]) - shift, alternatives, int(ranks[r])))
        return scored

    def generate(
        self,
        prompt_ids: list[int],
        max_tokens: int,
        sampling: SamplingParams,
        seed: int | None,
        eos_ids: set[int],
        on_token: Callable[[int], bool | None] | None = None,
    ) -> GenerationStats:
        request = GenerationRequest(list(prompt_ids), max_tokens, sampling, seed, set(eos_ids), on_token)
        return self.run(request)

    def run(self, request: GenerationRequest) -> GenerationStats:
        """One generation as one turn (atlas.turns): calls from other threads wait for it, and
        request.on_token may not start another generation on this engine."""
        with self.turns.lock:
            mine = self.turns.start()
            return self._generate(replace(request, on_token=self.turns.guarded(request.on_token, mine)))

    def _generate(self, request: GenerationRequest) -> GenerationStats:
        check_sampling(request.sampling)
        check_logit_bias_ids(request.sampling, self.spec.vocab_size)
        self.check_ids(request.prompt_ids, max(request.max_tokens - 1, 0))  # the last token is not fed
        stats = GenerationStats(prompt_tokens=len(request.prompt_ids))
        if request.max_tokens == 0 and request.prompt_logprobs is None:
            return stats
        rng = np.random.default_rng(request.seed)
        penalties = pick_state(request.prompt_ids, request.eos_ids, request.sampling, request.constraint)
        started = time.perf_counter()
        if request.prompt_logprobs is None:
            logits = self.prefill(request.prompt_ids)
        else:
            logits, stats.prompt_logprobs = self.prefill_scored(request.prompt_ids, request.prompt_logprobs)
        if request.max_tokens == 0:  # the prompt's scores only
            stats.prefill_seconds = time.perf_counter() - started
            return stats
        stats.cached_tokens = self.prompt_cache.last_hit
        picking = Picking(request.sampling, rng, penalties, keeps_logits=request.logprobs is not None)
        tokens = decoded_tokens(self, logits, len(request.prompt_ids), request.max_tokens, picking)
        token, logits = next(tokens)
        stats.prefill_seconds = time.perf_counter() - started  # up to the first token read back
        started = time.perf_counter()
        while self._accept(token, logits, stats, request) and len(stats.token_ids) < request.max_tokens:
            token, logits = next(tokens)
        stats.decode_seconds = time.perf_counter() - started
        return stats

    def _accept(self, token: int, logits: Tensor | None, stats: GenerationStats, request: GenerationRequest,
                score: TokenLogprob | None = None) -> bool:
        """Record a token picked from logits [1, V] (with logprobs: scored there, unless `score` is
        given); False when it ends the generation."""
        stats.token_ids.append(token)
        if request.logprobs is not None:
            stats.logprobs.append(score if score is not None else self.token_logprob(logits, token, request.logprobs))
        if request.on_token is not None and request.on_token(token):
            return False
        return token not in request.eos_ids
