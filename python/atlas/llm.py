"""The Python API: `LLM(model, device).generate(prompt, ...)` and `.stream(...)`."""

from __future__ import annotations

import inspect
import itertools
import random
import sys
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import asdict, dataclass, field, fields, replace
from os import PathLike, fspath
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol, TypeVar, overload

from .errors import AtlasError
from .kvcache.names import DEFAULT_LEVEL
from .sampling_filters import DRY_BREAKERS
from .turns import GenerationTurns

if TYPE_CHECKING:
    from .backends.base import SamplingParams
    from .beam_search import BeamSearchOutput, BeamSearchParams
    from .embed import EmbeddingRequestOutput, PoolingParams
    from .sampling import TokenLogprob
    from .sampling_filters import Breakers
    from .sequence_state import SequenceFile
    from .structured import OutputFormat, TokenConstraint
    from .kvcache.options import KVCacheOptions
    from .config import ModelSpec
    from .tokenizer import Tokenizer
    from .vllm_api import RequestOutput
    from .vllm_api import SamplingParams as VllmSamplingParams

    SamplingParamsLike = VllmSamplingParams | Sequence[VllmSamplingParams]

T = TypeVar("T")
DEFAULT_MAX_TOKENS = 256
DEFAULT_PROMPT_CACHE = 4  # prompt-cache checkpoints of LLM and atlas.serve (an Engine made directly has none)
MAX_PROMPT_CACHE = 64
LAST_TURN_TOKENS = 4096  # a thinking budget reads at most this much of the prompt's last turn


@dataclass(frozen=True)
class GenerationResult:
    token_ids: list[int]  # the new tokens (eos included when generation stopped on it)
    text: str  # the new tokens decoded, special tokens skipped (unless skip_special_tokens=False)
    prompt_tokens: int
    prefill_tok_s: float  # over the prompt tokens run (those the prompt cache held are not)
    decode_tok_s: float
    spec_rounds: int = 0  # MTP speculation: verify passes, drafts proposed, drafts accepted
    spec_drafted: int = 0
    spec_accepted: int = 0
    cached_tokens: int = 0  # prompt tokens the prompt cache held
    logprobs: list[TokenLogprob] | None = None  # one per token in token_ids, when asked for
    finish_reason: str = "length"  # "stop": an eos token or a stop string ended it
    prompt_logprobs: list[TokenLogprob | None] | None = None  # one per prompt token (the first: None), when asked for
    stop_reason: str | int | None = None  # vLLM's: the stop string or stop_token_ids id that ended it (None: eos, length)


@dataclass(frozen=True)
class SamplingExtras:
    """min_p, the penalties, min_tokens, logit_bias and llama.cpp's typical-p, top-n-sigma, XTC,
    DRY, mirostat and dynatemp (their meaning: atlas.backends.base.SamplingParams; dry_sequence_breakers: texts no
    repeat reaches back past, made token ids by LLM.dry_breakers)."""

    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    min_tokens: int = 0  # vLLM's: no eos (or stop id) before this many tokens
    logit_bias: tuple[tuple[int, float], ...] = ()  # OpenAI's: (token id, bias in [-100, 100]) pairs
    typical_p: float = 1.0  # llama.cpp's samplers (atlas.sampling_filters)
    top_n_sigma: float = -1.0
    xtc_probability: float = 0.0
    xtc_threshold: float = 0.1
    dry_multiplier: float = 0.0
    dry_base: float = 1.75
    dry_allowed_length: int = 2
    dry_penalty_last_n: int = -1
    dry_sequence_breakers: tuple[str, ...] = DRY_BREAKERS
    mirostat: int = 0
    mirostat_tau: float = 5.0
    mirostat_eta: float = 0.1
    dynatemp_range: float = 0.0
    dynatemp_exponent: float = 1.0

    def __post_init__(self) -> None:
        python_scalars(self)


@dataclass(frozen=True)
class GenerateOptions:
    max_tokens: int | None = DEFAULT_MAX_TOKENS  # None: as many as the context holds after the prompt (vLLM's
    # max_tokens None, llama.cpp's -n -1)
    temperature: float = 0.0  # 0 = greedy
    top_k: int = 0  # 0 = off
    top_p: float = 1.0  # 1 = off
    seed: int | None = None
    chat: bool = False  # wrap a text prompt as one user message in the chat template
    logprobs: int | None = None  # None: off; N: each token's log-probability and the N most likely
    prompt_logprobs: int | None = None  # the same for the prompt's tokens; allows max_tokens 0
    extras: SamplingExtras = field(default_factory=SamplingExtras)  # min_p, penalties
    stop: tuple[str, ...] = ()  # strings that end the text (never part of it unless include_stop_str_in_output)
    output: OutputFormat | None = None  # structured output: JSON, a schema, a regex, a choice (atlas.structured)
    skip_special_tokens: bool = True  # vLLM's: False writes special tokens' text (not the eos that ends it)
    include_stop_str_in_output: bool = False  # vLLM's: the stop string that ends the text stays at its end
    truncate_prompt_tokens: int | None = None  # vLLM's: keep the prompt's last k tokens (-1: as many as fit)
    allowed_token_ids: tuple[int, ...] | None = None  # vLLM's: only these ids may be picked
    bad_words: tuple[str, ...] = ()  # vLLM's: no text ends with one of these words' tokens
    thinking_token_budget: int | None = None  # vLLM's: the reasoning block's most tokens (atlas.thinking_budget)
    ignore_eos: bool = False  # vLLM's (llama.cpp's --ignore-eos): the model's eos ends nothing; max_tokens are made
    stop_token_ids: tuple[int, ...] = ()  # vLLM's: these ids end the text too (their text kept)

    def __post_init__(self) -> None:
        python_scalars(self)


def python_scalar(value: Any) -> Any:
    """A numpy scalar as the Python value it holds; anything else as it is."""
    import numpy as np

    return value.item() if isinstance(value, np.generic) else value


def python_scalars(options: Any) -> None:
    """A frozen dataclass's numpy scalar fields made Python's: arithmetic on them had wrapped or
    overflowed (np.uint8(10) as truncate_prompt_tokens kept 130 tokens, np.int8 logprobs overflowed)."""
    for f in fields(options):
        object.__setattr__(options, f.name, python_scalar(getattr(options, f.name)))


class EngineLike(Protocol):
    """What LLM needs of atlas.engine.Engine."""

    backend: Any  # atlas.backends.base.Backend
    turns: GenerationTurns  # its generations take turns: run() is one, iter_tokens one per token

    def run(self, request: Any) -> Any: ...  # atlas.engine.GenerationRequest -> GenerationStats

    def prefill(self, prompt_ids: list[int]) -> Any: ...  # logits of the last prompt token [1, V]

    def prefill_scored(self, prompt_ids: list[int], top: int) -> tuple[Any, list[TokenLogprob | None]]: ...

    # atlas.decode_loop's steps: a pick read at once, or queued and read later; a decode step fed
    # a pick read before it, or one not yet read
    def pick_tensor(self, logits: Any, sampling: SamplingParams, rng: Any, penalties: Any = None) -> tuple[int, Any]: ...  # id, [1] i32

    def queue_pick(self, logits: Any, sampling: SamplingParams, rng: Any, penalties: Any) -> Any: ...  # [1] i32

    def read_pick(self, pending: Any, penalties: Any, fed_at: int | None = None) -> int: ...

    def decode_tensor(self, ids: Any, position: int, token: int | None = None) -> Any: ...  # logits [1, V]; ids, token from pick_tensor

    def decode_unread(self, ids: Any, position: int) -> Any: ...  # logits [1, V]; ids from queue_pick

    def token_logprob(self, logits: Any, token: int, top: int) -> TokenLogprob: ...

    def pooled(self, prompt_ids: list[int], pooling: str) -> Any: ...  # np.ndarray [H] (atlas.embed)


@dataclass
class LoadedModel:
    model_dir: Path
    spec: ModelSpec
    tokenizer: Tokenizer
    engine: EngineLike
    device: str  # which backend runs and why, e.g. "cpu (numpy ...; cuda unavailable: ...)"
    speculation: str = "off"  # e.g. "MTP k=2" or why it is off


def load_model(
    model: str | PathLike[str] | None, device: str, kv_cache: KVCacheOptions | None = None, spec_k: int | None = None,
    max_seq_len: int | None = None, prompt_cache: int = 0, *, hf_overrides: dict[str, Any] | None = None,
    check_weights: bool = False, enforce_eager: bool = False, max_num_batched_tokens: int | None = None,
    revision: str | None = None, download_dir: str | None = None,
) -> LoadedModel:
    """Resolve, read config and tokenizer, open the weights and build the engine. spec_k: MTP
    speculation (atlas.speculative.build_engine): None = k=2 when the checkpoint has the head,
    0 = off (the head is not loaded), 1..3 = that k. max_seq_len: KV cache positions (None: 4096,
    capped by the model's context; -1: all of it). prompt_cache: checkpoints of the prompt cache (0: off).
    hf_overrides: merged into config.json before it is read (vLLM's --hf-overrides).
    check_weights: every float tensor read and checked for NaN / infinity first (atlas.weight_check).
    enforce_eager: the CUDA backend decodes without CUDA graphs (vLLM's flag).
    max_num_batched_tokens: prompt tokens per forward pass (vLLM's name; at most engine.PREFILL_CHUNK).
    revision, download_dir: a repo id's snapshot and the cache it is found in (atlas.resolve)."""
    if isinstance(model, PathLike):
        model = fspath(model)
    if model is not None and not isinstance(model, str):
        raise AtlasError(f"model must be a registry name, an HF repo id or a directory path, got {model!r}")
    if kv_cache is not None:
        kv_cache.check()
    check_prompt_cache(prompt_cache)
    prefill_chunk = prefill_pass_tokens(max_num_batched_tokens)
    check_bools(check_weights=check_weights, enforce_eager=enforce_eager)
    if hf_overrides is not None and not isinstance(hf_overrides, dict):
        raise AtlasError(f"hf_overrides must be a dict of config.json fields, got {hf_overrides!r}")
    from .backends import create_backend
    from .backends.run_plan import RunPlan, context_length
    from .config import load_spec
    from .kvcache.options import KVCacheOptions
    from .resolve import resolve_model
    from .safetensors import Checkpoint
    from .speculative import build_engine
    from .tokenizer import Tokenizer

    model_dir = resolve_model(model, revision=revision, download_dir=download_dir)
    spec = load_spec(model_dir, hf_overrides)
    tokenizer = Tokenizer.open(model_dir)
    capacity = context_length(max_seq_len, spec.context_length)
    run = RunPlan(capacity, kv_cache or KVCacheOptions(), load_mtp=spec_k != 0, prompt_cache=prompt_cache,
                  eager=enforce_eager, prefill_chunk=prefill_chunk)
    checkpoint = Checkpoint.open(model_dir)
    if check_weights:
        from .weight_check import check_weights as check

        check(checkpoint)
    backend, reason = create_backend(device, model_dir, spec, run)
    engine, speculation = build_engine(spec, checkpoint, backend, spec_k, run)
    return LoadedModel(model_dir, spec, tokenizer, engine, reason, speculation)


class LLM:
    """A loaded model. `model`: None (the embedded demo), a directory, an HF repo id in the local
    cache or a registry name; `device`: "auto", "cpu" or "cuda"; `kv_cache_dtype` and
    `kv_high_precision_layers`: the KV cache level of the full-attention layers (atlas.kvcache.options);
    `spec_k`: MTP speculative decoding (None: k=2 when the checkpoint has the head, 0: off);
    `max_seq_len`: KV cache positions, prompt + generated (None: 4096, capped by the model's context;
    -1: all of it);
    `prompt_cache`: checkpoints of the prompt cache, so a prompt that starts like an earlier
    request's resumes after the shared tokens (atlas.prompt_cache; 0: off);
    `hf_overrides`: merged into config.json before it is read (vLLM's --hf-overrides), e.g.
    {"text_config": {"rope_parameters": {...}}} for YaRN;
    `check_weights`: read every float tensor first and refuse one holding NaN or infinity;
    `enforce_eager`: decode without CUDA graphs on a GPU (vLLM's; ATLAS_CUDA_GRAPHS=0 for this LLM);
    `max_num_batched_tokens`: prompt tokens per forward pass (vLLM's; default and most: 4096);
    `revision`, `download_dir`: a repo id's snapshot (branch, tag or commit hash) and the Hugging
    Face cache to find it in (vLLM's); `engine_args`: vLLM's LLM(...) arguments
    (atlas.vllm_api.EngineArgs: max_model_len, seed, enable_prefix_caching, speculative_config, and
    the ones with nothing to do on one GPU)."""

    def __init__(
        self,
        model: str | PathLike[str] | None = None,
        device: str = "auto",
        kv_cache_dtype: str = DEFAULT_LEVEL,
        kv_high_precision_layers: str | int = "auto",
        spec_k: int | None = None,
        max_seq_len: int | None = None,
        *,
        prompt_cache: int = DEFAULT_PROMPT_CACHE,
        hf_overrides: dict[str, Any] | None = None,
        check_weights: bool = False,
        enforce_eager: bool = False,
        max_num_batched_tokens: int | None = None,
        revision: str | None = None,
        download_dir: str | None = None,
        **engine_args: Any,
    ) -> None:
        from .kvcache.names import VLLM_KV_NAMES
        from .kvcache.options import KVCacheOptions
        from .vllm_api import EngineArgs

        kv_high_precision_layers, spec_k, max_seq_len, prompt_cache = (
            python_scalar(v) for v in (kv_high_precision_layers, spec_k, max_seq_len, prompt_cache))
        vllm = EngineArgs.of({name: python_scalar(value) for name, value in engine_args.items()})
        max_seq_len, spec_k, prompt_cache = vllm.max_seq_len(max_seq_len), vllm.spec_k(spec_k), vllm.prompt_cache(prompt_cache)
        self.seeds = None if vllm.seed is None else random.Random(vllm.seed)
        self.request_ids = itertools.count()  # vLLM's RequestOutput ids: "0", "1", ...
        kv_cache = KVCacheOptions(VLLM_KV_NAMES.get(kv_cache_dtype, kv_cache_dtype), kv_high_precision_layers)
        self.parts = load_model(model, device, kv_cache, spec_k, max_seq_len, prompt_cache, hf_overrides=hf_overrides,
                                check_weights=check_weights, enforce_eager=enforce_eager,
                                max_num_batched_tokens=max_num_batched_tokens, revision=revision,
                                download_dir=download_dir)
        self.breaker_ids: dict[tuple[str, ...], Breakers] = {}  # dry_breakers' recent sets

    @classmethod
    def from_loaded(cls, parts: LoadedModel) -> LLM:
        llm = cls.__new__(cls)
        llm.parts, llm.seeds, llm.request_ids = parts, None, itertools.count()
        llm.breaker_ids = {}
        return llm

    def close(self) -> None:
        """Free the model's memory now (device memory on a GPU) rather than when the LLM is
        collected; idempotent. Generating afterwards, or reading a stream opened before, is one
        AtlasError line. `with LLM(...) as llm:` closes at the end of the block."""
        turns = self.parts.engine.turns
        with turns.lock:  # after a generation running on another thread
            turns.closed = True
            self.parts.engine.backend.close()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @property
    def device(self) -> str:
        return self.parts.device

    @property
    def speculation(self) -> str:
        return self.parts.speculation

    def get_tokenizer(self) -> Tokenizer:
        """vLLM's name for the tokenizer (encode, decode, apply_chat_template)."""
        return self.parts.tokenizer

    @property
    def tokenizer(self) -> Tokenizer:
        return self.parts.tokenizer

    @property
    def model_dir(self) -> Path:
        return self.parts.model_dir

    @overload
    def generate(self, prompts: str | list[int], sampling_params: None = None, *,
                 on_text: Callable[[str], None] | None = None, use_tqdm: bool = True,
                 **options: Any) -> GenerationResult: ...

    @overload
    def generate(self, prompts: Sequence[str | list[int]], sampling_params: None = None, *, on_text: None = None,
                 use_tqdm: bool = True, **options: Any) -> list[GenerationResult]: ...

    @overload
    def generate(self, prompts: object, sampling_params: SamplingParamsLike, *,
                 use_tqdm: bool = True) -> list[RequestOutput]: ...

    def generate(
        self, prompts: object, sampling_params: SamplingParamsLike | None = None, *,
        on_text: Callable[[str], None] | None = None, use_tqdm: bool = True, **options: Any,
    ) -> GenerationResult | list[GenerationResult] | list[RequestOutput]:
        """Generate from a text prompt or prompt token ids; greedy when temperature is 0. A list of
        `prompts` (texts or token-id lists, as vLLM's LLM.generate takes) is a batch: every prompt
        is checked first, then each is generated in turn as if alone (the same seed for each),
        and the results come back in order. `on_text` receives one prompt's text pieces as they
        complete; `options`: generate_options()'s (max_tokens, temperature, top_k, top_p, seed,
        chat, logprobs, prompt_logprobs, min_p, presence_penalty, frequency_penalty,
        repetition_penalty, min_tokens, stop, logit_bias, json_object, json_schema, regex, choice,
        grammar, output_after, thinking_token_budget). With `sampling_params` (an
        atlas.SamplingParams, or one per prompt) instead of options: vLLM's LLM.generate, a list
        of RequestOutput (atlas.vllm_api). use_tqdm: a progress bar over a batch of prompts."""
        check_bools(use_tqdm=use_tqdm)
        if sampling_params is not None:
            if options or on_text is not None:
                raise AtlasError("give sampling_params or keyword options (and on_text), not both")
            from .vllm_api import generate_outputs

            return generate_outputs(self, prompts, sampling_params, progress=use_tqdm)
        opts = self.seeded(options_from(options))
        if on_text is not None and not callable(on_text):
            raise AtlasError(f"on_text must be a function taking each text piece, got {on_text!r:.60}")
        if not is_batch(prompts):
            return self.generate_with(self.prepare(prompts, opts), opts, on_text)  # type: ignore[arg-type]
        if on_text is not None:
            raise AtlasError("on_text streams one prompt's text; give one prompt, or leave on_text out for a batch")
        prepared = [self.prepare(p, opts) for p in prompts]  # type: ignore[union-attr]
        return [self.generate_with(ids, opts, None) for ids in progress_bar(prepared, use_tqdm)]

    def generate_with(
        self, prompt_ids: list[int], opts: GenerateOptions, on_text: Callable[[str], None] | None
    ) -> GenerationResult:
        """generate() for prompt ids already checked by prepare(); one turn of the engine
        (atlas.turns): calls from other threads wait for it."""
        from .engine import GenerationRequest

        opts = self.fitted(opts, prompt_ids)
        eos_ids = self.end_ids(opts)
        out, pieces = OutputText(self.parts.tokenizer, opts, self.ending_ids(opts)), []

        def emit(token: int) -> bool:
            """Pass the text on; True (stop) once a stop string is complete."""
            if piece := out.push(token):
                pieces.append(piece)
                if on_text:
                    on_text(piece)
            return out.stopped

        watch = on_text is not None or bool(opts.stop)
        sampling = sampling_params(opts, self.dry_breakers(opts))
        request = GenerationRequest(prompt_ids, opts.max_tokens, sampling, opts.seed, eos_ids,
                                    emit if watch else None, opts.logprobs, opts.prompt_logprobs,
                                    self.output_constraint(opts, eos_ids, prompt_ids))
        stats = self.parts.engine.run(request)
        if watch and (rest := out.flush()):
            pieces.append(rest)
            if on_text:
                on_text(rest)
        token_ids = [int(t) for t in stats.token_ids]
        stopped = out.stopped or (bool(token_ids) and token_ids[-1] in eos_ids)
        return GenerationResult(
            token_ids=token_ids,
            text="".join(pieces) if opts.stop else out.whole(token_ids),
            finish_reason="stop" if stopped else "length",
            stop_reason=self.stop_reason(out, opts, token_ids),
            prompt_tokens=int(stats.prompt_tokens),
            prefill_tok_s=rate(int(stats.prompt_tokens) - int(stats.cached_tokens), stats.prefill_seconds),
            decode_tok_s=rate(max(len(token_ids) - 1, 0), stats.decode_seconds),
            spec_rounds=getattr(stats, "rounds", 0),
            spec_drafted=getattr(stats, "drafted", 0),
            spec_accepted=getattr(stats, "accepted", 0),
            cached_tokens=int(stats.cached_tokens),
            logprobs=list(stats.logprobs) if opts.logprobs is not None else None,
            prompt_logprobs=list(stats.prompt_logprobs) if opts.prompt_logprobs is not None else None,
        )

    @overload
    def chat(self, messages: list[dict[str, Any]], sampling_params: None = None, *,
             template_kwargs: dict[str, Any] | None = None, add_generation_prompt: bool = True,
             continue_final_message: bool = False, chat_template_kwargs: dict[str, Any] | None = None,
             tools: list[dict[str, Any]] | None = None, **options: Any) -> GenerationResult: ...

    @overload
    def chat(self, messages: list[list[dict[str, Any]]], sampling_params: None = None, *,
             template_kwargs: dict[str, Any] | None = None, add_generation_prompt: bool = True,
             continue_final_message: bool = False, chat_template_kwargs: dict[str, Any] | None = None,
             tools: list[dict[str, Any]] | None = None, **options: Any) -> list[GenerationResult]: ...

    @overload
    def chat(self, messages: list[dict[str, Any]] | list[list[dict[str, Any]]], sampling_params: SamplingParamsLike,
             *, template_kwargs: dict[str, Any] | None = None, add_generation_prompt: bool = True,
             continue_final_message: bool = False, chat_template_kwargs: dict[str, Any] | None = None,
             tools: list[dict[str, Any]] | None = None, use_tqdm: bool = True) -> list[RequestOutput]: ...

    def chat(
        self, messages: list[dict[str, Any]] | list[list[dict[str, Any]]],
        sampling_params: SamplingParamsLike | None = None, *,
        template_kwargs: dict[str, Any] | None = None, add_generation_prompt: bool = True,
        continue_final_message: bool = False, chat_template_kwargs: dict[str, Any] | None = None,
        tools: list[dict[str, Any]] | None = None, **options: Any,
    ) -> GenerationResult | list[GenerationResult] | list[RequestOutput]:
        """The assistant's next turn after `messages` ({"role", "content"} dicts, as vLLM's
        LLM.chat takes them; a list of such conversations is a batch, as generate()'s), rendered
        with the model's chat template (`template_kwargs`, or vLLM's name `chat_template_kwargs`:
        extra template variables, e.g. enable_thinking=False; `tools`: OpenAI function tools the
        template describes, as vLLM's, the answer's calls left in its text; add_generation_prompt
        and continue_final_message as vLLM's: with the second, and the first False, the model goes
        on with the final message, e.g. an answer already started); `options` are generate()'s,
        or `sampling_params` as there (vLLM's: a list of RequestOutput, one per conversation)."""
        template_kwargs = chat_variables(template_kwargs, chat_template_kwargs, tools)
        batch = isinstance(messages, list) and bool(messages) and all(isinstance(c, list) for c in messages)
        conversations = messages if batch else [messages]
        for conversation in conversations:
            if not isinstance(conversation, list) or not all(isinstance(m, dict) for m in conversation):
                raise AtlasError("messages must be a list of {'role': ..., 'content': ...} dicts (or a list of such lists)")
        check_bools(add_generation_prompt=add_generation_prompt, continue_final_message=continue_final_message)
        prompts = [self.tokenizer.encode_chat(c, add_generation_prompt, template_kwargs, continue_final_message)  # type: ignore[arg-type]
                   for c in conversations]
        if sampling_params is not None:
            from .vllm_api import generate_outputs

            progress = options.pop("use_tqdm", True)
            check_bools(use_tqdm=progress)
            if options:
                raise AtlasError("give sampling_params or keyword options, not both")
            return generate_outputs(self, prompts, sampling_params, progress=progress, rendered=True)
        return self.generate(prompts, **options) if batch else self.generate(prompts[0], **options)

    def get_default_sampling_params(self) -> VllmSamplingParams:
        """vLLM's: SamplingParams holding the sampling generation_config.json recommends
        (temperature, top_p, top_k, min_p, repetition_penalty) over vLLM's defaults."""
        from .vllm_api import SamplingParams as VllmParams

        recommended = {name: int(value) if name == "top_k" else value for name, value in self.parts.spec.sampling_defaults}
        return VllmParams(**recommended)  # type: ignore[arg-type]

    def reset_prefix_cache(self) -> bool:
        """vLLM's: forget the prompt cache's checkpoints, so the next prompt runs from its first token."""
        with self.parts.engine.turns.lock:  # not in the middle of another thread's step
            cache = getattr(self.parts.engine, "prompt_cache", None)
            if cache is not None:
                cache.forget()
        return True

    def save_state(self, path: str | PathLike[str], within: list[int] | None = None) -> SequenceFile:
        """Save the sequence this LLM holds (its prompt cache's longest resume point: a chat's turns
        so far; with `within`, the longest whose tokens begin it, e.g. the last prompt's) to a file;
        load_state puts it back, here or in another process with this model and cache setting, so the
        next prompt that extends it runs only its new tokens (llama.cpp's slot save; atlas.sequence_state)."""
        from .sequence_state import save_sequence

        return save_sequence(self.parts.engine, Path(path), within)

    def load_state(self, path: str | PathLike[str]) -> SequenceFile:
        """Put back a sequence save_state wrote (llama.cpp's slot restore)."""
        from .sequence_state import restore_sequence

        return restore_sequence(self.parts.engine, Path(path))

    def beam_search(self, prompts: object, params: BeamSearchParams, *, use_tqdm: bool = False) -> list[BeamSearchOutput]:
        """vLLM's LLM.beam_search: for each prompt (a text, token ids, or vLLM's prompt dict; or a
        list of them), the params.beam_width best continuations (atlas.beam_search)."""
        from .beam_search import beam_search

        check_bools(use_tqdm=use_tqdm)
        return beam_search(self, prompts, params, use_tqdm)

    def embed(self, prompts: object, pooling_params: PoolingParams | None = None, *,
              truncate_prompt_tokens: int | None = None, use_tqdm: bool = False) -> list[EmbeddingRequestOutput]:
        """vLLM's LLM.embed: for each prompt (a text, token ids, or vLLM's prompt dict; or a list of
        them), its final hidden state pooled and L2-normalised (atlas.embed)."""
        from .embed import embed

        check_bools(use_tqdm=use_tqdm)
        return embed(self, prompts, pooling_params, truncate_prompt_tokens, use_tqdm)

    def stream(self, prompt: str | list[int], **options: Any) -> Iterator[str]:
        """Yield text pieces as they are generated (options: generate()'s; logprobs are generate()'s
        alone); stop reading to stop generating. The engine runs one sequence: a stream read after
        a later generation started on this LLM fails with one line (atlas.turns)."""
        opts = self.seeded(options_from(options))
        if opts.logprobs is not None or opts.prompt_logprobs is not None:
            raise AtlasError("stream() yields text only; ask generate() for logprobs")
        if is_batch(prompt):
            raise AtlasError("stream() takes one prompt; give a list of prompts to generate()")
        prompt_ids = self.prepare(prompt, opts)
        opts = self.fitted(opts, prompt_ids)
        eos_ids = self.end_ids(opts)
        out = OutputText(self.parts.tokenizer, opts, self.ending_ids(opts))
        for token in iter_tokens(self.parts.engine, prompt_ids, opts, eos_ids,
                                 constraint=self.output_constraint(opts, eos_ids, prompt_ids),
                                 dry_breakers=self.dry_breakers(opts)):
            if piece := out.push(token):
                yield piece
            if out.stopped:
                return
        if rest := out.flush():
            yield rest

    def prepare(self, prompt: str | list[int], opts: GenerateOptions) -> list[int]:
        """Check the options and encode the prompt: every input error surfaces here, before any
        token is generated."""
        from .sampling import check_logit_bias_ids
        from .token_rules import check_token_rules

        check_options(opts)
        check_logit_bias_ids(sampling_params(opts), self.parts.spec.vocab_size)
        check_token_rules(opts.allowed_token_ids, opts.bad_words, self.parts.spec.vocab_size)
        check_stop_token_ids(opts, self.parts.spec.vocab_size)
        if opts.output is not None and not self.end_ids(opts):
            raise AtlasError("structured output ends with an end-of-sequence token: leave ignore_eos out "
                             "(or give stop_token_ids)")
        if opts.output is not None and opts.allowed_token_ids is not None and not self.end_ids(opts) & set(opts.allowed_token_ids):
            raise AtlasError("structured output ends with an end-of-sequence token: allowed_token_ids must hold one "
                             f"({sorted(self.end_ids(opts))}) beside a structured output format")
        if opts.output is not None:
            check_token_terminals(opts.output.shape().tokens, self.parts.tokenizer, self.eos_ids())
        prompt_ids = encode_prompt(self.parts.tokenizer, prompt, opts.chat)
        prompt_ids = truncate_prompt(prompt_ids, opts.truncate_prompt_tokens, context_capacity(self.parts.spec, self.parts.engine))
        vocab = self.parts.spec.vocab_size
        bad = [t for t in prompt_ids if not 0 <= t < vocab]
        if bad:
            raise AtlasError(f"prompt token id {bad[0]} is outside the vocabulary [0, {vocab})")
        check_length(self.parts.spec, context_capacity(self.parts.spec, self.parts.engine), len(prompt_ids), opts.max_tokens)
        return prompt_ids

    def fitted(self, opts: GenerateOptions, prompt_ids: list[int]) -> GenerateOptions:
        """opts with max_tokens None made the new tokens the context holds after prompt_ids."""
        if opts.max_tokens is not None:
            return opts
        room = context_capacity(self.parts.spec, self.parts.engine) - len(prompt_ids) + 1
        if opts.extras.min_tokens > room:
            raise AtlasError(f"min_tokens ({opts.extras.min_tokens}) does not fit: the prompt has {len(prompt_ids)} "
                             f"tokens, so the context holds at most {room} new ones; lower min_tokens")
        return replace(opts, max_tokens=room)

    def output_constraint(self, opts: GenerateOptions, end_ids: set[int], prompt_ids: list[int]) -> TokenConstraint | None:
        """The per-generation rule of the picks when opts give one (end_ids: what may end the
        text): structured output, allowed_token_ids, bad_words, a thinking budget, or all of
        those given."""
        from .structured import OutputConstraint, TokenConstraint
        from .token_rules import AllConstraints, AllowedTokens, BadWords, bad_word_sequences

        tokenizer = self.parts.tokenizer
        parts: list[TokenConstraint] = []
        if opts.output is not None:
            shape = opts.output.shape()
            special = tokenizer.special_text if shape.uses_tokens else None
            parts.append(OutputConstraint(tokenizer.token_bytes, end_ids, shape, special))
        if opts.allowed_token_ids is not None:
            parts.append(AllowedTokens(opts.allowed_token_ids))
        if opts.bad_words:
            encode = lambda text: tokenizer.encode(text, add_special_tokens=False)  # noqa: E731
            parts.append(BadWords(bad_word_sequences(opts.bad_words, encode)))
        if opts.thinking_token_budget is not None:
            parts.append(self.thinking_budget(opts.thinking_token_budget, prompt_ids))
        return None if not parts else parts[0] if len(parts) == 1 else AllConstraints(parts)

    def thinking_budget(self, budget: int, prompt_ids: list[int]) -> TokenConstraint:
        """atlas.thinking_budget's cap for one generation after prompt_ids."""
        from .thinking_budget import CLOSING, END, START, ThinkingBudget

        tokenizer = self.parts.tokenizer
        table = tokenizer.token_bytes
        tags = {i: tag for tag in (START, END) if (i := tokenizer.backend.token_to_id(tag.decode())) is not None}

        def piece(token: int) -> bytes | None:  # a tag's bytes also when it is a special token; None: special
            return tags.get(token) or (table[token] if 0 <= token < len(table) else None)

        last_turn: list[bytes] = []  # the prompt after its last special token (a turn's start)
        for token in reversed(prompt_ids[-LAST_TURN_TOKENS:]):
            if (data := piece(token)) is None:
                break
            last_turn.append(data)
        closing = tokenizer.encode(CLOSING, add_special_tokens=False)
        return ThinkingBudget(budget, lambda t: piece(t) or b"", closing, b"".join(reversed(last_turn)))

    def seeded(self, opts: GenerateOptions) -> GenerateOptions:
        """opts with a seed drawn from LLM(seed=N)'s stream when they give none (vLLM's: the same
        calls in the same order sample alike)."""
        if opts.seed is not None or self.seeds is None:
            return opts
        return replace(opts, seed=self.seeds.randrange(1 << 31))

    def next_request_id(self) -> str:
        """vLLM's request ids: "0", "1", ... per LLM."""
        return str(next(self.request_ids))

    def stop_reason(self, out: OutputText, opts: GenerateOptions, token_ids: Sequence[int]) -> str | int | None:
        """What ended a generation, as vLLM's stop_reason: the stop string, else the last token
        when it is one of stop_token_ids and not an eos; None after an eos or at max_tokens."""
        if out.stopped:
            return out.matched
        if token_ids and token_ids[-1] in set(opts.stop_token_ids) - self.ending_ids(opts):
            return token_ids[-1]
        return None

    def dry_breakers(self, opts: GenerateOptions) -> Breakers:
        """DRY's sequence breakers of opts as token ids (sampling_filters.breaker_heads; special
        tokens' text included, as llama.cpp has it), made once for each of the last few sets."""
        from .sampling_filters import breaker_heads

        breakers = opts.extras.dry_sequence_breakers
        if opts.extras.dry_multiplier == 0 or not breakers:
            return ()
        if breakers not in self.breaker_ids:
            tokenizer = self.parts.tokenizer
            texts = list(tokenizer.token_bytes)
            for token, text in tokenizer.special_text.items():
                texts[token] = text
            while len(self.breaker_ids) >= KEPT_BREAKER_SETS:
                del self.breaker_ids[next(iter(self.breaker_ids))]
            self.breaker_ids[breakers] = breaker_heads(texts, breakers, lambda text: tokenizer.encode(text, False))
        return self.breaker_ids[breakers]

    def end_ids(self, opts: GenerateOptions) -> set[int]:
        """The ids that end a generation under opts: the eos ids (none under ignore_eos) and stop_token_ids."""
        return self.ending_ids(opts) | set(opts.stop_token_ids)

    def ending_ids(self, opts: GenerateOptions) -> set[int]:
        """The eos ids whose text stays out of the answer (none under ignore_eos)."""
        return set() if opts.ignore_eos else self.eos_ids()

    def eos_ids(self) -> set[int]:
        """The config's eos ids (generation_config.json first); else the tokenizer's eos."""
        ids = set(self.parts.spec.eos_token_ids)
        if not ids and self.parts.tokenizer.eos_token_id is not None:
            ids.add(self.parts.tokenizer.eos_token_id)
        return ids


KEPT_BREAKER_SETS = 8


def iter_tokens(
    engine: EngineLike, prompt_ids: list[int], opts: GenerateOptions, eos_ids: set[int], *,
    scores: list[TokenLogprob] | None = None,
    prompt_scores: list[TokenLogprob | None] | None = None,
    constraint: TokenConstraint | None = None,
    spec_stats: Any = None,
    dry_breakers: Breakers = (),
) -> Iterator[int]:
    """Engine.generate's loop as a generator over the engine's step API (prefill, decode, pick),
    with the same seeded RNG draws, so stream() and generate() give the same tokens. With
    opts.logprobs, each token's TokenLogprob is appended to `scores` before the token is yielded;
    with opts.prompt_logprobs, the prompt's go to `prompt_scores` before the first token. A
    speculative engine counts its verify passes and drafts into `spec_stats` (a
    speculative.SpecStats) when given. Each token's steps are one turn of the engine (atlas.turns):
    a token read after another generation started on it is one AtlasError line. dry_breakers:
    LLM.dry_breakers(opts)."""
    return engine.turns.taken(engine_tokens(engine, prompt_ids, opts, eos_ids, scores=scores, prompt_scores=prompt_scores,
                                            constraint=constraint, spec_stats=spec_stats, dry_breakers=dry_breakers))


def engine_tokens(
    engine: EngineLike, prompt_ids: list[int], opts: GenerateOptions, eos_ids: set[int], *,
    scores: list[TokenLogprob] | None, prompt_scores: list[TokenLogprob | None] | None,
    constraint: TokenConstraint | None, spec_stats: Any, dry_breakers: Breakers,
) -> Iterator[int]:
    """iter_tokens without the turns."""
    import numpy as np

    from .decode_loop import Picking, decoded_tokens
    from .sampling import pick_state

    sampling = sampling_params(opts, dry_breakers)
    rng = np.random.default_rng(opts.seed)
    penalties = pick_state(prompt_ids, eos_ids, sampling, constraint)
    speculative = getattr(engine, "speculative_tokens", None)  # atlas.speculative: not for prompt logprobs
    if speculative is not None and opts.prompt_logprobs is None and opts.max_tokens > 0:
        from .speculative import Picks

        picks = Picks(sampling, rng, penalties, opts.logprobs)
        for count, token in enumerate(speculative(prompt_ids, opts.max_tokens, spec_stats, picks), start=1):
            if opts.logprobs is not None and scores is not None:
                scores.append(picks.scores[count - 1])
            yield token
            if token in eos_ids or count == opts.max_tokens:
                return
        return
    if opts.prompt_logprobs is None:
        logits = engine.prefill(prompt_ids)
    else:
        logits, prompt_scored = engine.prefill_scored(prompt_ids, opts.prompt_logprobs)
        (prompt_scores if prompt_scores is not None else []).extend(prompt_scored)
    if opts.max_tokens == 0:
        return
    picking = Picking(sampling, rng, penalties, keeps_logits=opts.logprobs is not None)
    for token, logits in decoded_tokens(engine, logits, len(prompt_ids), opts.max_tokens, picking):
        if opts.logprobs is not None and scores is not None:
            scores.append(engine.token_logprob(logits, token, opts.logprobs))
        yield token
        if token in eos_ids:
            return


class OutputText:
    """Generated ids -> the text a reader gets: decoded as they come (special tokens skipped
    unless opts.skip_special_tokens is false), cut at the first of opts.stop (which stays at its end
    under opts.include_stop_str_in_output). With special tokens written, the end-of-sequence token
    that ends the text (one of `ending`) stays out of it unless include_stop_str_in_output, as vLLM
    leaves it out."""

    def __init__(self, tokenizer: Tokenizer, opts: GenerateOptions, ending: set[int]) -> None:
        from .stop_strings import StopMatcher

        self.tokenizer, self.skip_special = tokenizer, opts.skip_special_tokens
        self.decoder = tokenizer.stream_decoder(opts.skip_special_tokens)
        self.matcher = StopMatcher(opts.stop, opts.include_stop_str_in_output)
        shown = opts.skip_special_tokens or opts.include_stop_str_in_output
        self.hidden = frozenset() if shown else frozenset(ending)

    @property
    def stopped(self) -> bool:
        return self.matcher.stopped

    @property
    def matched(self) -> str | None:
        """The stop string that ended the text (None: none did)."""
        return self.matcher.matched

    def push(self, token: int) -> str:
        """The text `token` completes that may be sent now."""
        return "" if token in self.hidden else self.matcher.push(self.decoder.push(token))

    def flush(self) -> str:
        """What is still held back once generation has ended ("" after a stop string)."""
        return "" if self.matcher.stopped else self.matcher.push(self.decoder.flush()) + self.matcher.flush()

    def whole(self, token_ids: list[int]) -> str:
        """All of token_ids' text at once (no stop strings to look for)."""
        return self.tokenizer.decode([t for t in token_ids if t not in self.hidden], self.skip_special)


def truncate_prompt(prompt_ids: list[int], keep: int | None, capacity: int) -> list[int]:
    """vLLM's truncate_prompt_tokens: the prompt's last `keep` tokens (-1: the context's capacity;
    None: all of it)."""
    if keep is None:
        return prompt_ids
    keep = capacity if keep == -1 else keep
    return prompt_ids[-keep:] if len(prompt_ids) > keep else prompt_ids


def progress_bar(items: list[T], shown: bool) -> Iterable[T]:
    """A progress bar over a batch's prompts on stderr (none for one prompt)."""
    from tqdm import tqdm

    return tqdm(items, desc="prompts", unit="prompt", file=sys.stderr, leave=False, disable=not shown or len(items) < 2)


def is_batch(prompt: object) -> bool:
    """A list of prompts (texts or token-id lists), not one prompt's token ids."""
    return isinstance(prompt, (list, tuple)) and bool(prompt) and all(isinstance(p, (str, list, tuple)) for p in prompt)


def encode_prompt(tokenizer: Tokenizer, prompt: str | list[int], chat: bool) -> list[int]:
    """Text (optionally as one user chat message) or token ids -> prompt ids."""
    if isinstance(prompt, str):
        if chat:
            ids = tokenizer.encode_chat([{"role": "user", "content": prompt}])
        else:
            ids = tokenizer.encode(prompt)
    elif chat:
        raise AtlasError("chat=True needs a text prompt, not token ids")
    else:
        ids = token_ids(prompt)
    if not ids:
        raise AtlasError("the prompt is empty; give at least one token of text")
    return ids


def token_ids(prompt: object) -> list[int]:
    """A sequence of integer token ids (numpy integers too) -> list[int]; anything else is one line."""
    if isinstance(prompt, (bytes, dict, set)) or not hasattr(prompt, "__iter__"):
        raise AtlasError(f"the prompt must be text or a list of token ids, got {type(prompt).__name__}")
    from .sampling import is_int

    ids = list(prompt)  # type: ignore[call-overload]
    bad = [t for t in ids if not is_int(t)]
    if bad:
        raise AtlasError(f"prompt token ids must be integers, got {bad[0]!r}")
    return [int(t) for t in ids]


def options_from(options: dict[str, Any]) -> GenerateOptions:
    """generate_options(**options), an unknown name one line with the nearest known one."""
    import difflib

    for name in options:
        if name not in OPTION_NAMES:
            near = difflib.get_close_matches(name, OPTION_NAMES, n=1)
            hint = f"; did you mean {near[0]!r}?" if near else f"; the options are {', '.join(OPTION_NAMES)}"
            raise AtlasError(f"unknown option {name!r}{hint}")
    return generate_options(**options)


def generate_options(
    *,
    max_tokens: int | None = DEFAULT_MAX_TOKENS,
    temperature: float = 0.0,
    top_k: int = 0,
    top_p: float = 1.0,
    seed: int | None = None,
    chat: bool = False,
    logprobs: int | None = None,
    prompt_logprobs: int | None = None,
    min_p: float = 0.0,
    presence_penalty: float = 0.0,
    frequency_penalty: float = 0.0,
    repetition_penalty: float = 1.0,
    min_tokens: int = 0,
    stop: str | list[str] | None = None,
    logit_bias: Mapping[int, float] | None = None,
    json_object: bool = False,
    json_schema: Any = None,
    regex: str | None = None,
    choice: list[str] | None = None,
    grammar: str | None = None,
    output_after: str | None = None,
    skip_special_tokens: bool = True,
    include_stop_str_in_output: bool = False,
    truncate_prompt_tokens: int | None = None,
    allowed_token_ids: Sequence[int] | None = None,
    bad_words: Sequence[str] = (),
    thinking_token_budget: int | None = None,
    ignore_eos: bool = False,
    stop_token_ids: Sequence[int] = (),
    typical_p: float = 1.0,
    top_n_sigma: float = -1.0,
    xtc_probability: float = 0.0,
    xtc_threshold: float = 0.1,
    dry_multiplier: float = 0.0,
    dry_base: float = 1.75,
    dry_allowed_length: int = 2,
    dry_penalty_last_n: int = -1,
    dry_sequence_breakers: Sequence[str] = DRY_BREAKERS,
    mirostat: int = 0,
    mirostat_tau: float = 5.0,
    mirostat_eta: float = 0.1,
    dynatemp_range: float = 0.0,
    dynatemp_exponent: float = 1.0,
) -> GenerateOptions:
    """LLM.generate / stream keyword arguments -> GenerateOptions. max_tokens None: as many as the
    context holds after the prompt (vLLM's). logprobs (0..20): each token's
    log-probability and that many most likely alternatives (the model's distribution before
    temperature, top-k and top-p); prompt_logprobs: the same for the prompt's tokens after the first
    (scoring a text: max_tokens may then be 0); min_p, the penalties, min_tokens: as vLLM's
    (atlas.backends.base.SamplingParams); stop: strings that end the text, never part of it (the
    token that completes one is the last generated); logit_bias: token id -> a bias in [-100, 100]
    added to its logit before the penalties and sampling (OpenAI's; -100 bans a token, +100 all but
    forces it); json_object: JSON mode, the text is one JSON object (OpenAI's response_format
    json_object; it ends at the object's close, or is cut at max_tokens); json_schema: a JSON schema
    (parsed), the text is one value it admits (OpenAI's response_format json_schema; the supported
    keywords: atlas.json_schema); regex: the whole text matches this pattern; choice: the text is
    one of these (vLLM's structured outputs); grammar: GBNF rules (llama.cpp's) whose root derives
    the whole text (atlas.gbnf); output_after: the format starts once the text holds
    this (e.g. "</think>" when a thinking model's prompt opened its reasoning block; up to 4 line
    breaks may follow it); skip_special_tokens: False writes special tokens' text (the eos that ends
    the text stays out); include_stop_str_in_output: the stop string that ends the text stays at its
    end; truncate_prompt_tokens: keep the prompt's last k tokens (-1: as many as the context holds);
    allowed_token_ids: only these ids may be picked; bad_words: no text ends with one of these words
    (vLLM's five; the last two pick on the host, as structured output does); thinking_token_budget:
    the most tokens of a reasoning block before "</think>" is written for the model (vLLM's;
    atlas.thinking_budget); ignore_eos: the model's end-of-sequence tokens end nothing (vLLM's,
    llama.cpp's --ignore-eos: benchmarks); stop_token_ids: ids that end the text too, their text
    kept (vLLM's); typical_p, top_n_sigma, xtc_probability, xtc_threshold, dry_*, mirostat*,
    dynatemp_*: llama.cpp's samplers (atlas.sampling_filters; a pick then reads its row back to the host). Values are
    checked by LLM.prepare."""
    from .structured import OutputFormat
    from .sampling import logit_bias_pairs

    output = OutputFormat.of(json_object, json_schema, regex, choice, output_after, grammar)
    extras = SamplingExtras(min_p, presence_penalty, frequency_penalty, repetition_penalty, min_tokens,
                            logit_bias_pairs(logit_bias), typical_p, top_n_sigma, xtc_probability, xtc_threshold,
                            dry_multiplier, dry_base, dry_allowed_length, dry_penalty_last_n,
                            as_tuple(dry_sequence_breakers), mirostat, mirostat_tau, mirostat_eta, dynatemp_range,
                            dynatemp_exponent)
    return GenerateOptions(max_tokens, temperature, top_k, top_p, seed, chat, logprobs, prompt_logprobs, extras,
                           stop_strings(stop), output, skip_special_tokens, include_stop_str_in_output,
                           truncate_prompt_tokens, as_tuple(allowed_token_ids), as_tuple(bad_words),
                           thinking_token_budget, ignore_eos, as_tuple(stop_token_ids))


OPTION_NAMES = tuple(inspect.signature(generate_options).parameters)  # options_from's known names


def as_tuple(value: Any) -> Any:
    """A list (a request's JSON) as a tuple, so the options stay hashable; anything else as given
    (LLM.prepare says what is wrong with it)."""
    return tuple(value) if isinstance(value, list) else value


def stop_strings(stop: object) -> tuple[str, ...]:
    """generate()'s `stop`: None, a string, or a list of non-empty strings."""
    if stop is None:
        return ()
    stops = [stop] if isinstance(stop, str) else stop
    if not isinstance(stops, (list, tuple)) or not all(isinstance(s, str) and s for s in stops):
        raise AtlasError(f"stop must be a non-empty string or a list of them, got {stop!r}")
    return tuple(stops)


def check_token_terminals(terminals: frozenset[tuple[int | bytes, bool]], tokenizer: Tokenizer, end_ids: set[int]) -> None:
    """A grammar's token terminals name tokens of this vocabulary (ids in range, texts of one
    token), and none but a negated one names an end-of-sequence token (that token ends the text)."""
    for token, negated in sorted(terminals, key=str):
        shown = f"<[{token}]>" if isinstance(token, int) else token.decode(errors="replace")
        if isinstance(token, int) and not 0 <= token < tokenizer.vocab_size:
            raise AtlasError(f"grammar: token terminal {shown} is outside the vocabulary (0..{tokenizer.vocab_size - 1})")
        if isinstance(token, bytes) and token not in tokenizer.text_ids:
            raise AtlasError(f"grammar: token terminal {shown} is not one token of this model's "
                             "vocabulary; name the token by id (<[id]>) or write the text as a literal")
        if not negated and (token if isinstance(token, int) else tokenizer.text_ids[token]) in end_ids:
            raise AtlasError(f"grammar: token terminal {shown} is an end-of-sequence token, which ends the text "
                             "after the grammar's root: leave it out of the grammar")


def prefill_pass_tokens(max_num_batched_tokens: object) -> int | None:
    """vLLM's max_num_batched_tokens -> the engine's prompt tokens per pass: at most PREFILL_CHUNK,
    which the memory checks assume (None: the engine's default)."""
    from .engine import PREFILL_CHUNK
    from .sampling import is_int

    if max_num_batched_tokens is None:
        return None
    if not is_int(max_num_batched_tokens) or max_num_batched_tokens < 1:  # type: ignore[operator]
        raise AtlasError(f"max_num_batched_tokens must be a positive integer (prompt tokens per pass), "
                         f"got {max_num_batched_tokens!r}")
    return min(int(max_num_batched_tokens), PREFILL_CHUNK)  # type: ignore[call-overload]


def chat_variables(template_kwargs: object, chat_template_kwargs: object, tools: object) -> dict[str, Any] | None:
    """LLM.chat's template variables: template_kwargs or vLLM's chat_template_kwargs (one of
    them), with `tools` among them when given."""
    if template_kwargs is not None and chat_template_kwargs is not None:
        raise AtlasError("template_kwargs and chat_template_kwargs are one option under two names; give one")
    variables = template_kwargs if template_kwargs is not None else chat_template_kwargs
    if tools is None:
        return variables  # type: ignore[return-value]  # encode_chat says what is wrong with it
    if not isinstance(tools, list) or not all(isinstance(tool, dict) for tool in tools):
        raise AtlasError("tools must be a list of OpenAI tool dicts ({'type': 'function', 'function': {...}})")
    if not isinstance(variables, (dict, type(None))):
        raise AtlasError(f"template_kwargs must be a dict of template variables by name, got {variables!r:.60}")
    return {**(variables or {}), "tools": tools}


def check_stop_token_ids(opts: GenerateOptions, vocab: int) -> None:
    from .sampling import is_int

    check_bools(ignore_eos=opts.ignore_eos)
    if not isinstance(opts.stop_token_ids, tuple) or not all(is_int(t) and 0 <= t < vocab for t in opts.stop_token_ids):
        raise AtlasError(f"stop_token_ids must be a list of token ids in [0, {vocab}), got {opts.stop_token_ids!r:.80}")


def check_bools(**flags: object) -> None:
    """Each keyword a bool, else one line naming it (a truthy string is not True)."""
    for name, flag in flags.items():
        if not isinstance(flag, bool):
            raise AtlasError(f"{name} must be True or False, got {flag!r:.60}")


def check_prompt_cache(checkpoints: object) -> None:
    from .sampling import is_int

    if not is_int(checkpoints) or not 0 <= checkpoints <= MAX_PROMPT_CACHE:  # type: ignore[operator]
        raise AtlasError(f"prompt_cache must be an integer in 0..{MAX_PROMPT_CACHE} (checkpoints; 0 = off), got {checkpoints!r}")


def check_options(opts: GenerateOptions) -> None:
    from .sampling import check_logprobs, check_sampling, is_int, is_real
    from .thinking_budget import check_budget

    check_logprobs(opts.logprobs)
    check_logprobs(opts.prompt_logprobs)
    max_tokens = opts.max_tokens
    least = 0 if opts.prompt_logprobs is not None else 1  # scoring a prompt needs no new token
    if max_tokens is not None and (not is_int(max_tokens) or max_tokens < least):
        raise AtlasError(f"max_tokens must be an integer >= {least} (or None: as many as the context holds), "
                         f"got {max_tokens!r}")
    seed = opts.seed
    if seed is not None and (not is_int(seed) or seed < 0):
        raise AtlasError(f"seed must be a non-negative integer, got {seed!r}")
    reals = {"temperature": opts.temperature, "top_p": opts.top_p, **asdict(opts.extras)}
    for name in NOT_REAL:  # integers, pairs, texts: check_sampling checks them
        del reals[name]
    check_breakers(opts.extras.dry_sequence_breakers)
    for name, value in reals.items():
        if not is_real(value):
            raise AtlasError(f"{name} must be a number, got {value!r:.60}")
    if not is_int(opts.top_k):
        raise AtlasError(f"top_k must be an integer, got {opts.top_k!r}")
    for name in ("chat", "skip_special_tokens", "include_stop_str_in_output"):
        if not isinstance(getattr(opts, name), bool):
            raise AtlasError(f"{name} must be True or False, got {getattr(opts, name)!r}")
    keep = opts.truncate_prompt_tokens
    if keep is not None and (not is_int(keep) or (keep < 1 and keep != -1)):
        raise AtlasError(f"truncate_prompt_tokens must be an integer >= 1 (or -1: as many as the context holds), got {keep!r}")
    if opts.output is not None:
        opts.output.shape()  # compiled (and kept) now: a format generation cannot follow fails here
    check_budget(opts.thinking_token_budget)
    check_sampling(sampling_params(opts))
    if max_tokens is not None and opts.extras.min_tokens > max_tokens:  # as vLLM: it could never be honoured
        raise AtlasError(f"min_tokens ({opts.extras.min_tokens}) must be <= max_tokens ({max_tokens})")


NOT_REAL = ("min_tokens", "logit_bias", "dry_allowed_length", "dry_penalty_last_n", "dry_sequence_breakers", "mirostat")


def check_breakers(breakers: object) -> None:
    if not isinstance(breakers, tuple) or not all(isinstance(b, str) and b for b in breakers):
        raise AtlasError(f"dry_sequence_breakers must be a list of non-empty strings, got {breakers!r:.60}")


def sampling_params(opts: GenerateOptions, dry_breakers: Breakers = ()) -> SamplingParams:
    """opts' SamplingParams; dry_breakers: LLM.dry_breakers(opts), DRY's breakers as token ids."""
    from .backends.base import SamplingParams

    extras = opts.extras
    extra = {name: float(value) for name, value in asdict(extras).items() if name not in NOT_REAL}
    return SamplingParams(temperature=float(opts.temperature), top_k=int(opts.top_k), top_p=float(opts.top_p),
                          min_tokens=extras.min_tokens, logit_bias=extras.logit_bias,
                          structured=opts.output is not None or opts.allowed_token_ids is not None or bool(opts.bad_words),
                          dry_allowed_length=extras.dry_allowed_length, dry_penalty_last_n=extras.dry_penalty_last_n,
                          dry_breakers=dry_breakers, mirostat=extras.mirostat, **extra)


def check_length(spec: ModelSpec, capacity: int, prompt_tokens: int, max_tokens: int | None) -> None:
    """Positions used: the prompt, then every new token but the last (it is never fed back);
    capacity: context_capacity's; max_tokens None (the rest of the context) needs room for one."""
    max_tokens = 1 if max_tokens is None else max_tokens
    positions = prompt_tokens + max_tokens - 1
    if positions > capacity:
        raise AtlasError(
            f"prompt ({prompt_tokens} tokens) + max_tokens ({max_tokens}) needs {positions} "
            f"positions but this model holds {capacity}; shorten the prompt or lower max_tokens"
            + raise_hint(spec, capacity)
        )


def raise_hint(spec: ModelSpec, capacity: int) -> str:
    """How to hold more, when the KV cache, not the model, sets the limit."""
    if capacity >= spec.context_length:
        return ""
    return f", or load it with a larger max_seq_len (--max-seq-len, up to {spec.context_length})"


def context_capacity(spec: ModelSpec, engine: EngineLike) -> int:
    """Positions one generation may use: the model's context, capped by the engine's caches."""
    return min(spec.context_length, getattr(engine, "max_seq_len", spec.context_length))


def rate(tokens: int, seconds: float) -> float:
    return tokens / seconds if seconds > 0 else 0.0
