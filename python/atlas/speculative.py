"""MTP speculative decoding: the MTP head drafts K tokens (its argmax), the main model verifies
them in one prefill-style pass over K+1 positions, the longest prefix the main model's own picks
agree with is kept plus the main model's pick after it (the bonus), so the output equals plain
decoding's.

Sampled requests too (and requests for logprobs: the emitted tokens' rows are scored in the
verify pass; prompt logprobs decode without speculation). The main model's rows are picked in
order as plain decoding picks (the same penalties, structured-output mask and one random draw
per pick), up to the first pick that differs from its draft. Each emitted token is thus a draw
from the main model's distribution after the tokens before it, with the same draw plain decoding
would make there: with a seed the output is plain decoding's token for token (a draft is kept
with probability p(draft), which is speculative sampling's rule min(1, p/q) for a draft
distribution q that is one-hot on the draft, and a rejected row's pick is a draw from p without
the draft, the residual max(0, p - q)).

Rollback on rejection. The KV caches of full-attention layers (main and MTP) need none: a row is
only read after the step that owns its position wrote it, so rows past the accepted prefix are
simply overwritten later. The DeltaNet conv and recurrent states advance over all K+1 tokens in
the verify pass, so they are snapshotted before it; when a draft is rejected they are restored
and the accepted tokens are replayed: put in front of the next verify pass (same pass, a few more
positions), or run at once when consecutive rejections have piled up more than K+1 of them.
This needs only the ops the backends already have (the recurrent op updates its state in place
over the whole step and exposes no per-token states), and a rejection costs no extra pass over
the weights, which is what a decode step on the GPU pays for.

The MTP head sees the main model's final-normed hidden state (as vLLM's qwen3_5_mtp /
qwen3_next_mtp are fed); `hidden_source="pre_norm"` feeds the residual stream before the final
norm instead. Draft steps after the first feed the head its own mtp-normed output.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any, Literal

import numpy as np

from .backends.base import Backend, KVCache, SamplingParams, Tensor
from .backends.run_plan import DEFAULT_MAX_SEQ_LEN, RunPlan
from .config import ModelSpec
from .engine import Engine, GenerationRequest, GenerationStats
from .errors import AtlasError
from .layers.step import Step
from .prompt_cache import StateCheckpoint
from .safetensors import Checkpoint
from .sampling import Penalties, TokenLogprob, check_logit_bias_ids, check_sampling, pick_state
from .snapshot import DeltaNetSnapshot, persist

DEFAULT_SPEC_K = 2
MAX_SPEC_K = 3
HiddenSource = Literal["final_norm", "pre_norm"]
HIDDEN_SOURCES: tuple[HiddenSource, ...] = ("final_norm", "pre_norm")


@dataclass
class SpecStats(GenerationStats):
    spec_k: int = 0
    rounds: int = 0  # verify passes
    drafted: int = 0  # draft tokens proposed
    accepted: int = 0  # draft tokens the main model agreed with

    @property
    def acceptance_rate(self) -> float:
        return self.accepted / self.drafted if self.drafted else 0.0


@dataclass
class Cursor:
    """Where decoding stands between verify passes."""

    position: int  # `token` goes here next
    token: int  # the last emitted token, not yet fed to the main model
    replay: list[int]  # accepted tokens the restored state still lacks, at position - len(replay) ..
    mtp_start: int  # position of the first row of the head's pending input
    mtp_ids: list[int]  # tokens at mtp_start+1 ..; rows past mtp_last are padding
    mtp_hidden: Tensor  # [len(mtp_ids), H] main hidden states at mtp_start .., persistent
    mtp_last: int  # the row whose output drafts the token after `token`


@dataclass
class Picks:
    """How one request's tokens are chosen: its settings, random draws and pick state (penalty
    history, structured-output constraint), as Engine.run would carry them."""

    sampling: SamplingParams
    rng: np.random.Generator
    penalties: Penalties | None = None
    logprobs: int | None = None  # score each pick, listing this many alternatives
    scores: list[TokenLogprob] = field(default_factory=list)  # one per pick, in order

    @classmethod
    def of(cls, request: GenerationRequest) -> Picks:
        state = pick_state(request.prompt_ids, request.eos_ids, request.sampling, request.constraint)
        return cls(request.sampling, np.random.default_rng(request.seed), state, request.logprobs)

    @classmethod
    def greedy(cls) -> Picks:
        return cls(SamplingParams(), np.random.default_rng(0))  # argmax: no draws

    def follow(self, drafts: list[int], greedy: list[int]) -> list[int]:
        """Raw greedy's picks from each row's argmax (greedy[i] follows drafts[:i]): the drafts
        they agree with, then the first that differs; a token the pick state forces (a thinking
        budget's closing) takes its row's place."""
        if self.penalties is None:
            return greedy[: accepted_prefix(drafts, greedy) + 1]
        chosen: list[int] = []
        for i, best in enumerate(greedy[: len(drafts) + 1]):
            forced = self.penalties.forced()
            chosen.append(best if forced is None else forced)
            self.penalties.add(chosen[-1])
            if i == len(drafts) or chosen[-1] != drafts[i]:
                break
        return chosen


def accepted_prefix(drafts: list[int], greedy: list[int]) -> int:
    """How many drafts match the main model's greedy tokens (greedy[i] follows drafts[:i])."""
    count = 0
    while count < len(drafts) and drafts[count] == greedy[count]:
        count += 1
    return count


class SpeculativeEngine(Engine):
    """An Engine that decodes with the MTP head; requests for prompt logprobs decode as usual
    (they score every prompt row in a fresh prefill)."""

    def __init__(
        self,
        spec: ModelSpec,
        checkpoint: Checkpoint,
        backend: Backend,
        spec_k: int = DEFAULT_SPEC_K,
        *,
        max_seq_len: int = DEFAULT_MAX_SEQ_LEN,
        hidden_source: HiddenSource = "final_norm",
        kv_cache: Any = None,  # atlas.kvcache.KVCacheOptions for the main model's caches
        prompt_cache: int = 0,  # checkpoints of the prompt cache (0: off)
    ):
        from .models.qwen3_5_moe_mtp import load_mtp_head

        check_spec_k(spec_k)
        if hidden_source not in HIDDEN_SOURCES:
            raise AtlasError(f"hidden_source must be one of {', '.join(HIDDEN_SOURCES)}, got {hidden_source!r}")
        super().__init__(spec, checkpoint, backend, max_seq_len, kv_cache=kv_cache, prompt_cache=prompt_cache)
        self.spec_k = spec_k
        self.hidden_source = hidden_source
        self.head = load_mtp_head(spec, checkpoint, backend, self.model)
        self.mtp_cache = self.head.new_state(backend, max_seq_len)
        self.snapshot = DeltaNetSnapshot.for_states(backend, self.states)

    def reset(self) -> None:
        super().reset()
        self.mtp_rows = 0  # the head's KV rows 0.. that hold its inputs for the live sequence
        # The main model's verify pass per token count, made by the backend's make_decode_step (on a
        # GPU a CUDA graph, captured at first use: ~470 kernels launched from the host a pass
        # otherwise); rebuilt after a reset, for the new states.
        self._verify_steps: dict[int, Callable[[Tensor, Tensor], tuple[Tensor, Tensor]]] = {}

    def prefill(self, prompt_ids: list[int]) -> Tensor:
        """The plain path's prefill (requests for prompt logprobs): the head's rows past the resume
        point are not written, so they no longer match."""
        logits = super().prefill(prompt_ids)
        self._head_rows_past_resume_stale()
        return logits

    def pooled(self, prompt_ids: list[int], pooling: str) -> np.ndarray:
        """The plain path's pooled rows (atlas.embed): the head's rows past the resume point are not written."""
        vector = super().pooled(prompt_ids, pooling)
        self._head_rows_past_resume_stale()
        return vector

    def _head_rows_past_resume_stale(self) -> None:
        """After a plain-path prompt: the head's rows hold this prefix's inputs only up to where it resumed."""
        self.mtp_rows = min(self.mtp_rows, self.prompt_cache.last_hit)

    # --- generation ---------------------------------------------------------------------------
    def _generate(self, request: GenerationRequest) -> GenerationStats:
        if request.prompt_logprobs is not None or request.max_tokens <= 0:
            return super()._generate(request)
        check_sampling(request.sampling)
        check_logit_bias_ids(request.sampling, self.spec.vocab_size)
        self.check_ids(request.prompt_ids, request.max_tokens - 1)  # the last token is not fed
        stats = SpecStats(prompt_tokens=len(request.prompt_ids), spec_k=self.spec_k)
        started = time.perf_counter()
        picks = Picks.of(request)
        for index, token in enumerate(self.speculative_tokens(request.prompt_ids, request.max_tokens, stats, picks)):
            if not stats.token_ids:
                stats.prefill_seconds = time.perf_counter() - started
                started = time.perf_counter()
            score = picks.scores[index] if picks.logprobs is not None else None
            if not self._accept(token, None, stats, request, score) or len(stats.token_ids) >= request.max_tokens:
                break
        stats.decode_seconds = time.perf_counter() - started
        stats.cached_tokens = self.prompt_cache.last_hit
        return stats

    def speculative_tokens(
        self, prompt_ids: list[int], max_tokens: int, stats: SpecStats | None = None, picks: Picks | None = None
    ) -> Iterator[int]:
        """The tokens after the prompt (greedy when `picks` is None), at most max_tokens; the
        caller stops at eos."""
        stats = stats if stats is not None else SpecStats(spec_k=self.spec_k)
        picks = picks if picks is not None else Picks.greedy()
        cursor = self._prefill(prompt_ids, picks)
        yield cursor.token
        emitted = 1
        while emitted < max_tokens:
            k = min(self.spec_k, max_tokens - emitted - 1, self.max_seq_len - cursor.position - 1)
            drafts = self._draft(cursor, k) if k > 0 else []
            cursor, accepted = self._verify(cursor, drafts, picks)
            stats.rounds += 1
            stats.drafted += len(drafts)
            stats.accepted += accepted
            for token in [*drafts[:accepted], cursor.token]:
                yield token
            emitted += accepted + 1

    # --- steps --------------------------------------------------------------------------------
    def _verify_forward(self, ids: Tensor, positions: Tensor) -> tuple[Tensor, Tensor]:
        """_main_forward for a verify pass, through its step for this many tokens (launched kernel
        by kernel when a dump is attached, which needs every intermediate)."""
        if self.dump is not None:
            return self._main_forward(ids, positions)
        tokens = int(ids.shape[0])
        if tokens not in self._verify_steps:
            self._verify_steps[tokens] = self.backend.make_decode_step(self._main_forward)
        return self._verify_steps[tokens](ids, positions)

    def _main_forward(self, ids: Tensor, positions: Tensor) -> tuple[Tensor, Tensor]:
        """-> (final-normed hidden [T, H], the hidden the MTP head reads [T, H])."""
        if self.hidden_source == "final_norm":
            out = self.forward(ids, positions)
            return out, out
        name = f"layer.{len(self.model.layers) - 1}.out"
        captured: dict[str, Tensor] = {}
        outer = self.dump

        def dump(key: str, t: Tensor) -> None:
            if key == name:
                captured[key] = t
            if outer is not None:
                outer(key, t)

        step = Step(self.backend, positions, dump)
        step.emit("positions", positions)  # as Engine.forward: a dump sees where each forward starts
        out = self.model.forward(step, ids, self.states)
        return out, captured[name]

    def _targets(self, hidden: Tensor, positions: Tensor, picks: Picks, drafts: list[int], skip: int = 0) -> list[int]:
        """The main model's picks over rows skip.. of hidden [T, H] (row skip+i follows drafts[:i]):
        the drafts it agrees with, then its own pick after them. Raw greedy: one argmax over all
        rows; otherwise Engine.pick_tensor row by row, stopping at the first disagreement, so only
        emitted tokens are picked (each with its random draw, counted in the penalty history).
        With picks.logprobs the picked rows' raw logits are scored into picks.scores."""
        logits = self.model.logits(Step(self.backend, positions, self.dump), hidden)  # [T, V]
        if picks.sampling.raw_greedy:
            greedy = self.checked([int(t) for t in self.backend.to_numpy(self.backend.argmax(logits))][skip:])
            chosen = picks.follow(drafts, greedy)
        else:
            chosen = []
            for i in range(len(drafts) + 1):
                row = self._row(logits, skip + i)  # [1, V]
                chosen.append(self.pick_tensor(row, picks.sampling, picks.rng, picks.penalties)[0])
                if i == len(drafts) or chosen[-1] != drafts[i]:
                    break
        if picks.logprobs is not None:
            picked = self.backend.rows(logits, skip, skip + len(chosen))  # [N, V]
            picks.scores += self.score_rows(picked, chosen, picks.logprobs)
        return chosen

    def _prefill(self, prompt_ids: list[int], picks: Picks | None = None) -> Cursor:
        """The prompt in passes after what the prompt cache holds; the head takes each pass's rows
        but the last at once (their next tokens are known), the last pass's with the first draft."""
        self.check_ids(prompt_ids, 0)
        picks = picks if picks is not None else Picks.greedy()
        resume = self.resume(prompt_ids, self.resumable)
        n = len(prompt_ids)
        if resume.checkpoint is not None:
            self.mtp_rows = min(self.mtp_rows, resume.start - 1)
            head_input = persist(self.backend, resume.checkpoint.head_input)  # [1, H] the head's row start-1
            if resume.start == n:  # all of the prompt was a checkpoint's
                _, positions = self._ids(prompt_ids[-1:], n - 1)
                token = self._targets(self.finite_row(resume.checkpoint.hidden, n), positions, picks, [])[0]
                return Cursor(n, token, [], n - 1, [token], head_input, 0)
            self._head_rows(prompt_ids, resume.start - 1, resume.start, head_input)
        for start, stop, positions, out, mtp_in in self.prompt_forwards(prompt_ids, resume.start, self._main_forward):
            if stop < n:  # the head's embedding recycles step memory: its hidden input must persist
                self._head_rows(prompt_ids, start, stop, persist(self.backend, mtp_in))
        mtp_hidden = persist(self.backend, mtp_in)
        last = stop - start - 1
        token = self._targets(self.finite_row(self._row(out, last), n), positions, picks, [])[0]
        return Cursor(n, token, [], start, [*prompt_ids[start + 1 :], token], mtp_hidden, last)

    def _head_rows(self, prompt_ids: list[int], start: int, stop: int, hidden: Tensor) -> None:
        """The head over its rows start..stop-1 (hidden [stop-start, H]), whose next tokens are the prompt's."""
        ids, positions = self._ids(prompt_ids[start + 1 : stop + 1], start)
        self.head.forward(Step(self.backend, positions), ids, hidden, self.mtp_cache)
        self.mtp_rows = stop

    def resumable(self, start: int, checkpoint: StateCheckpoint | None) -> bool:
        """Whether a speculative prefill can resume at `start`: the head's rows before start-1 hold
        this prefix's inputs, and the checkpoint has the row start-1 reads (the live states have not)."""
        return checkpoint is not None and checkpoint.has_head_input and self.mtp_rows >= start - 1

    def extra_caches(self) -> dict[str, tuple[KVCache, int]]:
        return {"mtp": (self.mtp_cache, self.mtp_rows)}

    def extra_caches_restored(self, rows: dict[str, int]) -> None:
        self.mtp_rows = rows.get("mtp", 0)

    def _draft(self, cursor: Cursor, k: int) -> list[int]:
        """k draft tokens: the head over its pending rows, then k-1 single steps on its own output."""
        ids, positions = self._ids(cursor.mtp_ids, cursor.mtp_start)
        # the head's steps stay out of ATLAS_DUMP, which records the main model's forwards
        out = self.head.forward(Step(self.backend, positions), ids, cursor.mtp_hidden, self.mtp_cache)
        if self.mtp_rows >= cursor.mtp_start:  # rows past mtp_last are padding, and the drafts' own below
            self.mtp_rows = cursor.mtp_start + cursor.mtp_last + 1
        hidden = self._row(out, cursor.mtp_last)  # [1, H]
        drafts: list[int] = []
        for i in range(k):
            logits = self.head.logits(Step(self.backend, positions), hidden)  # [1, V]
            drafts += self.checked([int(self.backend.to_numpy(self.backend.argmax(logits))[0])], "MTP head")
            if i + 1 < k:
                ids, positions = self._ids([drafts[-1]], cursor.position + i)
                hidden = persist(self.backend, hidden)
                hidden = self.head.forward(Step(self.backend, positions), ids, hidden, self.mtp_cache)
        return drafts

    def _verify(self, cursor: Cursor, drafts: list[int], picks: Picks) -> tuple[Cursor, int]:
        """One main-model pass over [*replay, token, *drafts]; keep the agreeing prefix, roll back
        the rest (the restored state then lacks the accepted tokens: the next cursor's replay)."""
        replayed = len(cursor.replay)
        start = cursor.position - replayed
        fed = [*cursor.replay, cursor.token, *drafts]
        if drafts and not cursor.replay:  # with a replay pending the state is the snapshot already
            self.snapshot.take(self.states)
        ids, positions = self._ids(fed, start)
        with self.prompt_cache.feeding(fed, start):
            out, mtp_in = self._verify_forward(ids, positions)  # [R+K+1, H] each
        mtp_hidden = persist(self.backend, mtp_in)
        chosen = self._targets(out, positions, picks, drafts, replayed)  # the rows after token and each kept draft
        accepted = len(chosen) - 1
        replay: list[int] = []
        if accepted < len(drafts):
            self.restore_states(self.snapshot)
            self.prompt_cache.rolled_back(start)
            replay = fed[: replayed + accepted + 1]
            if len(replay) > self.spec_k + 1:  # bound the verify pass: catch up now
                with self.prompt_cache.feeding(replay, start):
                    self.forward(*self._ids(replay, start))
                replay = []
        bonus = chosen[accepted]
        pending = [*fed[1 : replayed + accepted + 1], bonus]
        pending += [bonus] * (len(fed) - len(pending))  # padding rows: outputs unused, cache rows rewritten later
        position = cursor.position + accepted + 1
        cursor = Cursor(position, bonus, replay, start, pending, mtp_hidden, replayed + accepted)
        return cursor, accepted


# --- choosing and building ------------------------------------------------------------------------
def check_spec_k(spec_k: int) -> None:
    if isinstance(spec_k, bool) or not isinstance(spec_k, int) or not 1 <= spec_k <= MAX_SPEC_K:
        raise AtlasError(f"spec_k must be an integer in 1..{MAX_SPEC_K}, got {spec_k!r}; pass 1, 2 or 3")


def build_engine(
    spec: ModelSpec, checkpoint: Checkpoint, backend: Backend, spec_k: int | None = None, run: RunPlan | None = None
) -> tuple[Engine, str]:
    """The engine and a line saying whether it speculates. spec_k: None = on (k=2) when the
    checkpoint has an MTP head; 0 = off, the head is not loaded; 1..3 = on with that k. `run`:
    the caches' capacity and KV level (its load_mtp is the caller's business: spec_k decides)."""
    from .models.qwen3_5_moe_mtp import has_mtp_head

    run = run or RunPlan()
    caches = {"max_seq_len": run.max_seq_len, "kv_cache": run.kv_cache, "prompt_cache": run.prompt_cache}
    if spec_k is not None and spec_k != 0:
        check_spec_k(spec_k)
    if spec_k == 0:
        engine, speculation = Engine(spec, checkpoint, backend, **caches), "off (--no-spec)"
    elif not has_mtp_head(checkpoint):
        speculation = "off: the checkpoint has no MTP head (mtp.* tensors)"
        if spec_k is not None:
            speculation += f", so --spec-k {spec_k} is ignored"
        engine = Engine(spec, checkpoint, backend, **caches)
    else:
        k = DEFAULT_SPEC_K if spec_k is None else spec_k
        engine, speculation = SpeculativeEngine(spec, checkpoint, backend, k, **caches), f"MTP k={k}"
    if run.prefill_chunk is not None:
        engine.prefill_chunk = run.prefill_chunk
    return engine, speculation


def spec_k_from_flags(spec_k: int | None, no_spec: bool) -> int | None:
    """--spec-k / --no-spec -> build_engine's spec_k."""
    if no_spec and spec_k is not None:
        raise AtlasError("--spec-k and --no-spec exclude each other; give one of them")
    return 0 if no_spec else spec_k


def acceptance_summary(rounds: int, drafted: int, accepted: int, new_tokens: int) -> str:
    """The stats-line part of a speculative run, e.g. 'MTP acceptance 62% (31/50 drafts, 2.2 tokens/pass)'."""
    per_pass = (new_tokens - 1) / rounds if rounds else 0.0  # the first token comes from the prefill
    rate = accepted / drafted if drafted else 0.0
    return f"MTP acceptance {rate:.0%} ({accepted}/{drafted} drafts, {per_pass:.2f} tokens/pass)"
