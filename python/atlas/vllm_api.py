"""vLLM's offline API over atlas.LLM, so a vLLM script runs with its import changed:
`llm.generate(prompts, SamplingParams(...))` and `llm.chat(messages, SamplingParams(...))` answer
with a list of RequestOutput, one per prompt, each holding `n` CompletionOutputs (vLLM's field
names and meanings). Without sampling_params, LLM.generate keeps atlas's own keyword API."""

from __future__ import annotations

import json
from dataclasses import dataclass, field, fields, replace
from typing import TYPE_CHECKING, Any

from .errors import AtlasError

if TYPE_CHECKING:
    from .llm import LLM, GenerateOptions, GenerationResult
    from .sampling import TokenLogprob

MAX_N = 64  # completions per prompt, generated one after another


@dataclass
class StructuredOutputsParams:
    """vLLM's structured outputs: one of a JSON schema (`json`, a dict or its text), a regex, a
    choice of texts, a GBNF grammar, or any JSON object (`json_object`)."""

    json: str | dict[str, Any] | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None

    def options(self) -> dict[str, Any]:
        """generate_options()'s keywords for the format."""
        schema = self.json
        if isinstance(schema, str):
            try:
                schema = json.loads(schema)
            except json.JSONDecodeError as err:
                raise AtlasError(f"structured_outputs.json is not JSON ({err.msg} at {err.pos}); give a "
                                 "JSON schema, as a dict or its text") from None
        return {"json_schema": schema, "regex": self.regex, "choice": self.choice, "grammar": self.grammar,
                "json_object": bool(self.json_object)}


@dataclass
class SamplingParams:
    """vLLM's SamplingParams (its defaults: temperature 1, max_tokens 16; None: as many as the
    context holds); checked as LLM.generate's options when a generation starts."""

    n: int = 1
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: off
    min_p: float = 0.0
    seed: int | None = None  # completion j of a prompt samples with seed + j
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    max_tokens: int | None = 16
    min_tokens: int = 0
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    truncate_prompt_tokens: int | None = None
    structured_outputs: StructuredOutputsParams | None = None
    guided_decoding: StructuredOutputsParams | None = None  # vLLM's earlier name of structured_outputs
    logit_bias: dict[int, float] | None = None
    allowed_token_ids: list[int] | None = None
    bad_words: list[str] | None = None

    def options(self) -> dict[str, Any]:
        """generate_options()'s keywords (max_tokens and n are the caller's)."""
        shared = {f.name: getattr(self, f.name) for f in fields(self)} | {
            "top_k": 0 if self.top_k == -1 else self.top_k,
            "stop_token_ids": self.stop_token_ids or (), "bad_words": self.bad_words or ()}
        for name in ("n", "max_tokens", "structured_outputs", "guided_decoding"):
            del shared[name]
        if self.structured_outputs is not None and self.guided_decoding is not None:
            raise AtlasError("structured_outputs and guided_decoding (its earlier name) are both given; give one")
        shape = self.structured_outputs if self.guided_decoding is None else self.guided_decoding
        if shape is None:
            return shared
        if not isinstance(shape, StructuredOutputsParams):
            raise AtlasError(f"structured_outputs must be a StructuredOutputsParams, got {type(shape).__name__}")
        return shared | shape.options()


GuidedDecodingParams = StructuredOutputsParams  # vLLM's earlier name


@dataclass
class Logprob:
    """One token's log-probability, its rank among the step's logits (1: the most likely) and text."""

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None  # with logprobs asked for
    logprobs: list[dict[int, Logprob]] | None  # per token: itself and the most likely ones
    finish_reason: str | None = None  # "stop" or "length"
    stop_reason: int | str | None = None  # the stop string or stop_token_ids id that ended it (None: an eos)

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None  # None for a prompt given as token ids
    prompt_token_ids: list[int]
    prompt_logprobs: list[dict[int, Logprob] | None] | None  # the first token's: None
    outputs: list[CompletionOutput] = field(default_factory=list)
    finished: bool = True
    num_cached_tokens: int = 0  # prompt tokens the prompt cache held


@dataclass(frozen=True)
class PreparedPrompt:
    text: str | None
    ids: list[int]
    opts: GenerateOptions
    n: int


def generate_outputs(llm: LLM, prompts: object, sampling_params: object, *, progress: bool = True,
                     rendered: bool = False) -> list[RequestOutput]:
    """LLM.generate(prompts, sampling_params): every prompt checked first, then each prompt's n
    completions in turn. rendered: the prompts are chat-rendered token ids (LLM.chat), reported
    with their text."""
    from .llm import progress_bar

    batch = [prompts] if single_prompt(prompts) else list(prompts)  # type: ignore[call-overload]
    params = sampling_params if isinstance(sampling_params, (list, tuple)) else [sampling_params] * len(batch)
    if len(params) != len(batch):
        raise AtlasError(f"sampling_params holds {len(params)} entries for {len(batch)} prompts; give one, or one per prompt")
    prepared = [prepare(llm, prompt, p, rendered) for prompt, p in zip(batch, params)]
    return [request_output(llm, p, llm.next_request_id()) for p in progress_bar(prepared, progress)]


def single_prompt(prompts: object) -> bool:
    """Not a list of prompts (texts, token-id lists, vLLM's prompt dicts): one prompt."""
    return not (isinstance(prompts, (list, tuple)) and bool(prompts)
                and all(isinstance(p, (str, list, tuple, dict)) for p in prompts))


def prepare(llm: LLM, prompt: object, params: object, rendered: bool) -> PreparedPrompt:
    from .llm import options_from

    if not isinstance(params, SamplingParams):
        raise AtlasError(f"sampling_params must be an atlas.SamplingParams (or a list of them), got {type(params).__name__}")
    if not isinstance(params.n, int) or isinstance(params.n, bool) or not 1 <= params.n <= MAX_N:
        raise AtlasError(f"SamplingParams.n must be an integer in 1..{MAX_N}, got {params.n!r}")
    text, given = prompt_parts(prompt)
    opts = llm.seeded(options_from({**params.options(), "max_tokens": params.max_tokens}))  # None: LLM.fitted's
    ids = llm.prepare(given, opts)
    if rendered:
        text = llm.tokenizer.decode(ids, skip_special_tokens=False)
    return PreparedPrompt(text, ids, opts, params.n)


def prompt_parts(prompt: object) -> tuple[str | None, str | list[int]]:
    """(the prompt's text, what LLM.prepare takes): vLLM's TextPrompt / TokensPrompt dicts too."""
    if isinstance(prompt, dict):
        if set(prompt) == {"prompt"} and isinstance(prompt["prompt"], str):
            return prompt["prompt"], prompt["prompt"]
        if set(prompt) == {"prompt_token_ids"}:
            return None, prompt["prompt_token_ids"]
        raise AtlasError(f"a prompt dict holds 'prompt' (text) or 'prompt_token_ids', got keys {sorted(prompt)}")
    return (prompt if isinstance(prompt, str) else None), prompt  # type: ignore[return-value]


def request_output(llm: LLM, prompt: PreparedPrompt, request_id: str) -> RequestOutput:
    outputs, results = [], []
    for j in range(prompt.n):
        seed = None if prompt.opts.seed is None else prompt.opts.seed + j
        result = llm.generate_with(prompt.ids, replace(prompt.opts, seed=seed), None)
        results.append(result)
        outputs.append(completion_output(llm, j, result))
    scored = results[0].prompt_logprobs
    listed = None if scored is None else [None if s is None else logprob_entry(llm, s) for s in scored]
    return RequestOutput(request_id, prompt.text, list(prompt.ids), listed, outputs,
                         num_cached_tokens=results[0].cached_tokens)


def completion_output(llm: LLM, index: int, result: GenerationResult) -> CompletionOutput:
    scores = result.logprobs
    listed = None if scores is None else [logprob_entry(llm, s) for s in scores]
    cumulative = None if scores is None else float(sum(s.logprob for s in scores))
    return CompletionOutput(index, result.text, list(result.token_ids), cumulative, listed, result.finish_reason,
                            result.stop_reason)


def logprob_entry(llm: LLM, score: TokenLogprob) -> dict[int, Logprob]:
    """vLLM's per-position dict: the chosen token first, then the most likely ones (rank 1, 2, ...)."""
    def text(token: int) -> str:
        return llm.tokenizer.decode([token], skip_special_tokens=False)

    entry = {score.token: Logprob(score.logprob, score.rank, text(score.token))}
    for rank, (token, logprob) in enumerate(score.top, start=1):
        entry.setdefault(token, Logprob(logprob, rank, text(token)))
    return entry



@dataclass(frozen=True)
class EngineArgs:
    """vLLM's LLM(...) engine arguments that atlas.LLM takes beside its own keywords."""

    max_model_len: int | None = None  # atlas's max_seq_len
    seed: int | None = None  # generations without a seed draw theirs from a stream seeded by it
    enable_prefix_caching: bool | None = None  # False: prompt_cache 0
    speculative_config: dict[str, Any] | None = None  # {"method": "mtp", "num_speculative_tokens": k}: spec_k
    tensor_parallel_size: int = 1  # atlas runs a model on one GPU
    pipeline_parallel_size: int = 1
    data_parallel_size: int = 1
    dtype: str = "auto"  # the checkpoint's own
    gpu_memory_utilization: float | None = None  # not used: the KV cache holds max_model_len positions
    trust_remote_code: bool = False  # not used: atlas runs no checkpoint code
    max_num_seqs: int | None = None  # not used: one sequence at a time

    @classmethod
    def of(cls, args: dict[str, Any]) -> EngineArgs:
        """The arguments LLM's own keywords did not take; an unknown one is one line."""
        import difflib
        import inspect

        from .llm import LLM

        known = [f.name for f in fields(cls)]
        for name in args:
            if name not in known:
                own = [n for n in inspect.signature(LLM.__init__).parameters if n not in ("self", "engine_args")]
                near = difflib.get_close_matches(name, [*known, *own], n=1)
                raise AtlasError(f"LLM() got an unknown argument {name!r}" + (f"; did you mean {near[0]!r}?" if near else ""))
        engine = cls(**args)
        engine.check()
        return engine

    def check(self) -> None:
        from .llm import check_bools

        check_bools(trust_remote_code=self.trust_remote_code)
        if self.enable_prefix_caching is not None:
            check_bools(enable_prefix_caching=self.enable_prefix_caching)
        for name in ("tensor_parallel_size", "pipeline_parallel_size", "data_parallel_size"):
            if getattr(self, name) != 1:
                raise AtlasError(f"{name}={getattr(self, name)!r}: atlas runs a model on one GPU; leave it out or give 1")
        if self.dtype not in ("auto", "bfloat16"):
            raise AtlasError(f"dtype={self.dtype!r}: atlas runs the checkpoint's own (bf16 or its quantized format); "
                             "give 'auto' or leave it out")
        if self.seed is not None and (not isinstance(self.seed, int) or isinstance(self.seed, bool) or self.seed < 0):
            raise AtlasError(f"seed must be a non-negative integer, got {self.seed!r}")

    def max_seq_len(self, max_seq_len: int | None) -> int | None:
        if self.max_model_len is not None and max_seq_len is not None and self.max_model_len != max_seq_len:
            raise AtlasError(f"max_seq_len={max_seq_len} and max_model_len={self.max_model_len} disagree; give one")
        return max_seq_len if self.max_model_len is None else self.max_model_len

    def spec_k(self, spec_k: int | None) -> int | None:
        from .vllm_flags import spec_drafts

        if self.speculative_config is None:
            return spec_k
        if spec_k is not None:
            raise AtlasError("speculative_config and spec_k exclude each other; give one of them")
        return spec_drafts(json.dumps(self.speculative_config))

    def prompt_cache(self, checkpoints: int) -> int:
        return 0 if self.enable_prefix_caching is False else checkpoints

