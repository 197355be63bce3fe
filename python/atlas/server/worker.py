"""The one engine thread. The model is loaded on it and every generation runs on it (a CUDA
context belongs to the thread that opened it); jobs queue in arrival order, each generation
starts from its prompt alone (prefill starts fresh or, through the prompt cache, from a state that
holds exactly the prompt's first tokens), and a cancelled job stops before its next token."""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any, TypeVar

from ..backends.cuda.driver import context_lost
from ..errors import AtlasError
from ..llm import LLM, GenerateOptions, OutputText, context_capacity, iter_tokens
from ..sampling import TokenLogprob
from ..speculative import SpecStats
from ..structured import NoAllowedToken
from .errors import RequestError
from .metrics import Metrics, RequestRecord, SpecCounts

if TYPE_CHECKING:
    from ..beam_search import BeamSearchParams, BeamSearchSequence

log = logging.getLogger("atlas.serve")
T = TypeVar("T")
MIN_WIRE_LOGPROB = -9999.0  # what a body carries for -inf (vLLM's value)


@dataclass(frozen=True)
class ScoredToken:
    """A generated token's logprob entry: its text, log-probability, and the most likely tokens."""

    text: str
    logprob: float | None  # None: the prompt's first token (echo), which nothing predicts
    top: tuple[tuple[str, float], ...] = ()
    token: int = -1
    top_ids: tuple[int, ...] = ()  # the ids of `top`

    def named_by_id(self) -> ScoredToken:
        """vLLM's return_tokens_as_token_ids: each token written "token_id:<id>" (any token, even
        one that holds part of a UTF-8 character, stays identifiable)."""
        top = tuple((f"token_id:{t}", logprob) for t, (_, logprob) in zip(self.top_ids, self.top, strict=True))
        return ScoredToken(f"token_id:{self.token}", self.logprob, top, self.token, self.top_ids)


PromptLogprobs = dict[str, dict[str, Any]]  # token id -> {"logprob", "rank", "decoded_token"}


@dataclass(frozen=True)
class TextPiece:
    text: str
    scored: tuple[ScoredToken, ...] = ()  # the tokens generated since the previous piece (logprobs asked for)
    token_ids: tuple[int, ...] = ()  # the ids generated since the previous piece (Returns.token_ids)
    tokens: int = 0  # how many tokens were generated since the previous piece


@dataclass(frozen=True)
class Returns:
    """What a job sends back beside the generated text."""

    echo: str | None = None  # the prompt's text, sent first (with its scores when opts.prompt_logprobs)
    prompt_logprobs: int | None = None  # vLLM's prompt_logprobs: Finished carries them
    token_ids: bool = False  # vLLM's return_token_ids: every generated id rides on a piece
    started: bool = False  # a Started event first, when the engine takes the job (background responses)


@dataclass(frozen=True)
class Finished:
    finish_reason: str  # "stop" | "length"
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int = 0  # prompt tokens the prompt cache held
    spec: SpecCounts = SpecCounts()  # MTP speculation, when it ran
    stop_reason: str | int | None = None  # vLLM's: the stop string or stop_token_ids id that ended it
    prompt_logprobs: tuple[PromptLogprobs | None, ...] | None = None  # vLLM's, when asked for (the first token: None)
    prompt_seconds: float = 0.0  # from the engine taking the job to its first new token (llama.cpp's timings)
    generation_seconds: float = 0.0  # from the first new token to the last


@dataclass(frozen=True)
class Searched(Finished):
    """A beam search's end (atlas.beam_search): its best beams, best first; the counts are the best's."""

    beams: tuple[BeamSearchSequence, ...] = ()


@dataclass(frozen=True)
class Pooled(Finished):
    """An embedding job's end (atlas.embed): the prompt's final hidden state pooled, not normalised."""

    vector: tuple[float, ...] = ()


@dataclass(frozen=True)
class Failed:
    message: str
    status: int = 500  # 503: the engine cannot run any request again


@dataclass(frozen=True)
class Started:
    """The job left the queue: the engine runs it now (sent only when Returns.started asks)."""


@dataclass(frozen=True)
class Called:
    """A call's end (EngineWorker.call): what the function returned."""

    value: Any


Event = TextPiece | Finished | Failed | Started | Called


@dataclass
class Job:
    prompt_ids: list[int]
    opts: GenerateOptions
    emit: Callable[[Event], None]  # called on the engine thread
    cancelled: threading.Event = field(default_factory=threading.Event)
    returns: Returns = Returns()
    queued_at: float = field(default_factory=time.perf_counter)
    first_token_at: float | None = None  # set by generate
    held_positions: int = 0  # KV-cache positions it holds while it runs (prompt + tokens so far; set by generate)
    beam: BeamSearchParams | None = None  # a beam search (its one event: Searched) instead of a generation
    pooling: str | None = None  # an embedding (its one event: Pooled), pooled so (atlas.embed.POOLINGS)
    call: Callable[[LLM], Any] | None = None  # a function run on the engine (its one event: Called), no request


class EngineWorker:
    """Owns the LLM on a dedicated thread; `events()` runs one generation and yields its events."""

    def __init__(self, load: Callable[[], LLM]) -> None:
        self._load = load
        self._jobs: queue.Queue[Job | None] = queue.Queue()
        self._loaded = threading.Event()
        self._load_error: BaseException | None = None
        self._thread = threading.Thread(target=self._main, name="atlas-engine", daemon=True)
        self.llm: LLM | None = None
        self.metrics = Metrics()
        self.lost: str | None = None  # why no generation can run again (the GPU's context is lost)
        self.running: Job | None = None  # the job on the engine thread now

    @property
    def waiting(self) -> int:
        """Jobs queued behind the one running (approximate: the queue's own count)."""
        return self._jobs.qsize()

    def start(self) -> LLM:
        """Start the thread and wait until the model is loaded; a load error is raised here."""
        self._thread.start()
        self._loaded.wait()
        if self._load_error is not None:
            raise self._load_error
        assert self.llm is not None
        return self.llm

    def stop(self, timeout: float = 10.0) -> None:
        self._jobs.put(None)
        self._thread.join(timeout)

    def kv_cache_usage(self) -> float:
        """The share of the KV cache the running job holds (0 when idle: rows the prompt cache keeps
        are free to overwrite, as vLLM counts its cached blocks)."""
        job = self.running
        if job is None or self.llm is None:
            return 0.0
        return min(1.0, job.held_positions / context_capacity(self.llm.parts.spec, self.llm.parts.engine))

    @property
    def alive(self) -> bool:
        return self._thread.is_alive() and self.llm is not None and self.lost is None

    async def call(self, function: Callable[[LLM], T]) -> T:
        """function(llm) on the engine thread, in turn with the queued jobs (slot save / restore);
        an AtlasError it raises comes back as RequestError (400), a lost engine as a 503."""
        async for event in self.events([], GenerateOptions(), call=function):
            if isinstance(event, Called):
                return event.value
            if isinstance(event, Failed):
                raise RequestError(event.message, None, "unavailable" if event.status == 503 else None, event.status)
        raise AssertionError("a call ends with Called or Failed")

    async def events(
        self, prompt_ids: list[int], opts: GenerateOptions, returns: Returns = Returns(),
        beam: BeamSearchParams | None = None, pooling: str | None = None, call: Callable[[LLM], Any] | None = None,
    ) -> AsyncIterator[Event]:
        """Queue a generation (or a beam search, or an embedding) and yield its events; closing the
        iterator early cancels the job."""
        loop = asyncio.get_running_loop()
        inbox: asyncio.Queue[Event] = asyncio.Queue()

        def emit(event: Event) -> None:
            try:
                loop.call_soon_threadsafe(inbox.put_nowait, event)
            except RuntimeError:  # the event loop has closed: nobody is listening any more
                job.cancelled.set()

        if not self._thread.is_alive():  # nobody would ever take the job: answer instead of hanging
            yield Failed("the engine thread has stopped; restart the server")
            return
        if self.lost is not None:
            yield Failed(self.lost, status=503)
            return
        job = Job(prompt_ids, opts, emit, returns=returns, beam=beam, pooling=pooling, call=call)
        self._jobs.put(job)
        try:
            while True:
                event = await inbox.get()
                yield event
                if isinstance(event, (Finished, Failed, Called)):
                    return
        finally:
            job.cancelled.set()

    # --- engine thread ------------------------------------------------------------------------
    def _main(self) -> None:
        try:
            self.llm = self._load()
        except BaseException as err:  # noqa: BLE001 - handed to start() on the caller's thread
            self._load_error = err
            return
        finally:
            self._loaded.set()
        while (job := self._jobs.get()) is not None:
            if not job.cancelled.is_set():
                self.running = job
                self._run(job)
                self.running = None

    def _run(self, job: Job) -> None:
        """One job; its metrics are recorded before its last event, so a client that has its
        answer finds it counted."""
        assert self.llm is not None
        if self.lost is not None:  # queued before the context was lost
            job.emit(Failed(self.lost, status=503))
            return
        if job.call is not None:
            self._call(job, job.call)
            return
        self.metrics.started()
        if job.returns.started:
            job.emit(Started())
        started = time.perf_counter()
        try:
            finished = generate(self.llm, job)
        except NoAllowedToken as err:  # the request's own rules: a 400, not logged as a server fault
            self.metrics.record(request_record(job, None, started))
            job.emit(Failed(str(err), status=400))
            return
        except Exception as err:  # noqa: BLE001 - one failed request must not stop the server
            log.exception("generation failed")
            self.metrics.record(request_record(job, None, started))
            message = str(err) if isinstance(err, AtlasError) else f"{type(err).__name__}: {err}"
            if context_lost(err):
                self.lost = f"the GPU's CUDA context is lost ({message}); restart the server"
                log.error("%s: /health answers 503 and every request fails until then", self.lost)
            job.emit(Failed(f"generation failed: {message}"))
            return
        self.metrics.record(request_record(job, finished, started))
        job.emit(finished)


    def _call(self, job: Job, function: Callable[[LLM], Any]) -> None:
        assert self.llm is not None
        try:
            value = function(self.llm)
        except AtlasError as err:  # the request's file or the engine's settings: one line back
            job.emit(Failed(str(err), status=400))
            return
        except Exception as err:  # noqa: BLE001 - one failed call must not stop the server
            log.exception("engine call failed")
            if context_lost(err):
                self.lost = f"the GPU's CUDA context is lost ({type(err).__name__}: {err}); restart the server"
            job.emit(Failed(f"{type(err).__name__}: {err}"))
            return
        job.emit(Called(value))


def generate(llm: LLM, job: Job) -> Finished:
    """Run one job on the calling (engine) thread, emitting text as it completes."""
    if job.beam is not None:
        return beam_searched(llm, job)
    if job.pooling is not None:
        return pooled(llm, job)
    taken = time.perf_counter()
    out = OutputText(llm.tokenizer, job.opts, llm.ending_ids(job.opts))
    eos_ids = llm.end_ids(job.opts)
    pending = Pending(llm, job.returns.token_ids)
    prompt_scores: list[TokenLogprob | None] = []
    count = 0
    last_token = -1
    constraint = llm.output_constraint(job.opts, eos_ids, job.prompt_ids)
    spec = SpecStats()
    echo = job.returns.echo
    job.held_positions = len(job.prompt_ids)
    tokens = iter_tokens(llm.parts.engine, job.prompt_ids, job.opts, eos_ids, scores=pending.scores,
                         prompt_scores=prompt_scores, constraint=constraint, spec_stats=spec,
                         dry_breakers=llm.dry_breakers(job.opts))
    for last_token in tokens:
        if count == 0:
            job.first_token_at = time.perf_counter()
            if echo is not None:
                job.emit(TextPiece(echo, scored_prompt(llm, job, prompt_scores)))
        count += 1
        job.held_positions += 1
        pending.ids.append(last_token)
        if text := out.push(last_token):
            job.emit(pending.piece(text))
        if out.stopped or job.cancelled.is_set():
            break
    if count == 0 and echo is not None:  # max_tokens 0: the prompt alone
        job.emit(TextPiece(echo, scored_prompt(llm, job, prompt_scores)))
    text = out.flush()
    if text or pending.waiting():
        job.emit(pending.piece(text))
    stopped = out.stopped or last_token in eos_ids
    cache = getattr(llm.parts.engine, "prompt_cache", None)
    cached = cache.last_hit if cache is not None and count else 0
    spec_counts = SpecCounts(spec.rounds, spec.drafted, spec.accepted)
    top = job.returns.prompt_logprobs
    listed = None if top is None else prompt_logprobs(llm, prompt_scores, top)
    first = job.first_token_at or time.perf_counter()
    return Finished("stop" if stopped else "length", len(job.prompt_ids), count, cached, spec_counts,
                    stop_reason=llm.stop_reason(out, job.opts, pending.ids), prompt_logprobs=listed,
                    prompt_seconds=first - taken, generation_seconds=time.perf_counter() - first)


def beam_searched(llm: LLM, job: Job) -> Searched:
    """A beam search job: its beams in one event; a cancelled job's search stops before its next step."""
    from ..beam_search import search

    assert job.beam is not None
    taken = time.perf_counter()
    job.held_positions = len(job.prompt_ids) + job.beam.max_tokens
    beams = tuple(search(llm, job.prompt_ids, job.beam, job.cancelled.is_set).sequences)
    job.first_token_at = time.perf_counter()
    best = beams[0]
    return Searched(best.finish_reason or "length", len(job.prompt_ids), len(best.tokens) - len(job.prompt_ids),
                    generation_seconds=job.first_token_at - taken, beams=beams)


def pooled(llm: LLM, job: Job) -> Pooled:
    """An embedding job: the prompt's pooled vector in one event."""
    taken = time.perf_counter()
    job.held_positions = len(job.prompt_ids)
    vector = llm.parts.engine.pooled(job.prompt_ids, job.pooling)
    cache = getattr(llm.parts.engine, "prompt_cache", None)
    return Pooled("stop", len(job.prompt_ids), 0, cache.last_hit if cache is not None else 0,
                  prompt_seconds=time.perf_counter() - taken, vector=tuple(vector.tolist()))


@dataclass
class Pending:
    """The tokens generated since the last text piece, and their scores, for the next piece."""

    llm: LLM
    with_ids: bool  # the pieces carry the ids (Returns.token_ids)
    scores: list[TokenLogprob] = field(default_factory=list)  # iter_tokens appends (logprobs asked for)
    ids: list[int] = field(default_factory=list)
    sent_scores: int = 0
    sent_ids: int = 0  # ids a piece has accounted for (carried, with with_ids)

    def piece(self, text: str) -> TextPiece:
        ids = tuple(self.ids[self.sent_ids :]) if self.with_ids else ()
        piece = TextPiece(text, scored(self.llm, self.scores[self.sent_scores :]), ids, len(self.ids) - self.sent_ids)
        self.sent_scores, self.sent_ids = len(self.scores), len(self.ids)
        return piece

    def waiting(self) -> bool:
        """Scores or asked-for ids that no piece has carried yet."""
        return len(self.scores) > self.sent_scores or (self.with_ids and len(self.ids) > self.sent_ids)


def scored(llm: LLM, scores: list[TokenLogprob]) -> tuple[ScoredToken, ...]:
    """TokenLogprobs -> entries with each token's text (special tokens spelled out, as vLLM does;
    a token that holds part of a UTF-8 character reads as U+FFFD)."""
    return tuple(ScoredToken(token_text(llm, s.token), wire_logprob(s.logprob),
                             tuple((token_text(llm, t), wire_logprob(lp)) for t, lp in s.top), s.token,
                             tuple(t for t, _ in s.top))
                 for s in scores)


def token_text(llm: LLM, token: int) -> str:
    return llm.tokenizer.decode([token], skip_special_tokens=False)


def wire_logprob(logprob: float) -> float:
    """A log-probability JSON can carry: -inf (a token the row rules out, or a NaN logit) as
    MIN_WIRE_LOGPROB, as vLLM sends it."""
    return logprob if logprob >= MIN_WIRE_LOGPROB else MIN_WIRE_LOGPROB


def scored_prompt(llm: LLM, job: Job, scores: list[TokenLogprob | None]) -> tuple[ScoredToken, ...]:
    """The echoed prompt's entries (none unless its logprobs were asked for), each with the
    request's logprobs alternatives (prompt_logprobs may have asked for more); the first has no logprob."""
    if not scores:
        return ()
    first = ScoredToken(token_text(llm, job.prompt_ids[0]), None, token=job.prompt_ids[0])
    top = job.opts.logprobs or 0
    return (first, *scored(llm, [replace(s, top=s.top[:top]) for s in scores[1:] if s is not None]))


def prompt_logprobs(llm: LLM, scores: list[TokenLogprob | None], top: int) -> tuple[PromptLogprobs | None, ...]:
    """vLLM's prompt_logprobs: per prompt token (the first: None) the token's own entry (its rank
    among the row's logits), then the `top` most likely (ranks 1..top; the token among them takes
    its place's rank, as vLLM's dict does). Each id is decoded once (the same ones head every row)."""
    texts: dict[int, str] = {}

    def entry(token: int, logprob: float, rank: int | None) -> dict[str, Any]:
        text = texts.get(token)
        if text is None:
            text = texts[token] = token_text(llm, token)
        return {"logprob": wire_logprob(logprob), "rank": rank, "decoded_token": text}

    listed: list[PromptLogprobs | None] = [None]
    for s in scores[1:]:
        assert s is not None
        row = {str(s.token): entry(s.token, s.logprob, s.rank)}
        row.update((str(t), entry(t, lp, i + 1)) for i, (t, lp) in enumerate(s.top[:top]))
        listed.append(row)
    return tuple(listed)


def request_record(job: Job, finished: Finished | None, started: float) -> RequestRecord:
    now = time.perf_counter()
    first = None if job.first_token_at is None else job.first_token_at - started
    timing = {"queue_s": started - job.queued_at, "first_token_s": first, "run_s": now - started}
    if finished is None:
        return RequestRecord("failed", **timing)
    cancelled = job.cancelled.is_set()
    return RequestRecord("cancelled" if cancelled else "finished", "abort" if cancelled else finished.finish_reason,
                         finished.prompt_tokens, finished.cached_tokens, finished.completion_tokens,
                         spec=finished.spec, **timing)
