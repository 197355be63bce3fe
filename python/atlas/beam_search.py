"""vLLM's beam search: `llm.beam_search(prompts, BeamSearchParams(beam_width=4, max_tokens=32))`
returns one BeamSearchOutput per prompt, its `sequences` the beam_width best by vLLM's score
(cumulative logprob / length ** length_penalty, the length counting the prompt and not an ending
eos), best first. As vLLM runs it, each step extends every live beam by one token through the
engine (max_tokens 1, the 2 x beam_width most likely next tokens, and the one picked at
`temperature`, as candidates) and keeps the beam_width best; a candidate ending with an
end-of-sequence token is complete and set aside. The prompt cache resumes each beam after its
prompt, so a step runs each beam's generated tokens again: a search costs about
beam_width x max_tokens^2 / 2 prompt tokens, meant for short answers."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from .errors import AtlasError
from .sampling import MAX_LOGPROBS, is_int, is_real
from .vllm_api import Logprob, logprob_entry, prompt_parts, single_prompt

if TYPE_CHECKING:
    from .llm import LLM, GenerateOptions

MAX_BEAM_WIDTH = MAX_LOGPROBS // 2  # a step lists 2 x beam_width candidates


@dataclass(frozen=True)
class BeamSearchParams:
    beam_width: int
    max_tokens: int
    ignore_eos: bool = False  # an eos is then an ordinary token: every beam runs max_tokens
    temperature: float = 0.0  # the pick each step adds to the candidates (0: the most likely, already listed)
    length_penalty: float = 1.0
    include_stop_str_in_output: bool = False  # vLLM's field; a beam search has no stop strings

    def check(self) -> None:
        if not is_int(self.beam_width) or not 1 <= self.beam_width <= MAX_BEAM_WIDTH:
            raise AtlasError(f"BeamSearchParams.beam_width must be an integer in 1..{MAX_BEAM_WIDTH}, got {self.beam_width!r}")
        if not is_int(self.max_tokens) or self.max_tokens < 1:
            raise AtlasError(f"BeamSearchParams.max_tokens must be an integer >= 1, got {self.max_tokens!r}")
        if not is_real(self.length_penalty):
            raise AtlasError(f"BeamSearchParams.length_penalty must be a number, got {self.length_penalty!r}")
        for name in ("ignore_eos", "include_stop_str_in_output"):
            if not isinstance(getattr(self, name), bool):
                raise AtlasError(f"BeamSearchParams.{name} must be True or False, got {getattr(self, name)!r}")


@dataclass
class BeamSearchSequence:
    tokens: list[int]  # the prompt's ids, then the generated ones
    logprobs: list[dict[int, Logprob]] = field(default_factory=list)  # per generated token: that step's candidates
    cum_logprob: float = 0.0  # of the generated tokens
    text: str | None = None  # the generated text (an ending eos left out)
    finish_reason: str | None = None  # "stop": it ended with an eos; "length": max_tokens
    stop_reason: int | str | None = None  # vLLM's: None (an eos, or the length)


@dataclass
class BeamSearchOutput:
    sequences: list[BeamSearchSequence]


def beam_search_score(tokens: list[int], cum_logprob: float, eos_ids: set[int], length_penalty: float) -> float:
    """vLLM's get_beam_search_score: the cumulative logprob over the sequence's length (the prompt
    included, an ending eos not) to the length_penalty."""
    length = len(tokens) - (1 if tokens and tokens[-1] in eos_ids else 0)
    return cum_logprob / (length**length_penalty)


def beam_search(llm: LLM, prompts: object, params: object, progress: bool) -> list[BeamSearchOutput]:
    """LLM.beam_search: every prompt checked (its ids and max_tokens fit the context) before any runs."""
    from .llm import generate_options, progress_bar

    if not isinstance(params, BeamSearchParams):
        raise AtlasError(f"params must be an atlas.BeamSearchParams, got {type(params).__name__}")
    params.check()
    batch = [prompts] if single_prompt(prompts) else list(prompts)  # type: ignore[call-overload]
    fits = generate_options(max_tokens=params.max_tokens)
    starts = [llm.prepare(prompt_parts(prompt)[1], fits) for prompt in batch]
    return [search(llm, ids, params) for ids in progress_bar(starts, progress)]


def search(llm: LLM, prompt_ids: list[int], params: BeamSearchParams,
           stopped: Callable[[], bool] = lambda: False) -> BeamSearchOutput:
    """The search for prompt ids already checked by LLM.prepare; `stopped` is asked before each
    step (the server's cancelled request): true ends the search with the beams it has."""
    from .llm import generate_options

    step = generate_options(max_tokens=1, logprobs=2 * params.beam_width, temperature=params.temperature)
    ends = set() if params.ignore_eos else llm.eos_ids()
    score: Callable[[BeamSearchSequence], float] = lambda beam: beam_search_score(  # noqa: E731
        beam.tokens, beam.cum_logprob, ends, params.length_penalty)
    beams, completed = [BeamSearchSequence(list(prompt_ids))], []
    for _ in range(params.max_tokens):
        if stopped():
            break
        grown = [child for beam in beams for child in children(llm, beam, step)]
        completed += [child for child in grown if child.tokens[-1] in ends]
        beams = sorted((c for c in grown if c.tokens[-1] not in ends), key=score, reverse=True)[: params.beam_width]
        if not beams:
            break
    best = sorted(completed + beams, key=score, reverse=True)[: params.beam_width]
    for beam in best:
        ended = beam.tokens[-1] in ends
        generated = beam.tokens[len(prompt_ids) : len(beam.tokens) - ended]
        beam.text = llm.tokenizer.decode(generated)
        beam.finish_reason = "stop" if ended else "length"
    return BeamSearchOutput(best)


def children(llm: LLM, beam: BeamSearchSequence, step: GenerateOptions) -> list[BeamSearchSequence]:
    """The beam extended by each candidate next token: the most likely ones and the pick."""
    scored = llm.generate_with(beam.tokens, llm.seeded(step), None).logprobs[0]  # type: ignore[index]
    candidates = dict(scored.top)
    candidates.setdefault(scored.token, scored.logprob)
    listed = beam.logprobs + [logprob_entry(llm, scored)]
    return [BeamSearchSequence(beam.tokens + [token], listed, beam.cum_logprob + logprob)
            for token, logprob in candidates.items()]
