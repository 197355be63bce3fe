"""vLLM's `vllm serve` command line, accepted by atlas.serve so a deployment's flags carry over:
the model as a positional argument, --enable-auto-tool-choice, --speculative-config (MTP: as
--spec-k), --no-enable-prefix-caching (as --prompt-cache 0), --max-num-batched-tokens (prompt
tokens per pass), and flags that have no work to do on one GPU at batch 1 (--tensor-parallel-size
/ --data-parallel-size 1, --gpu-memory-utilization, --max-num-seqs, --trust-remote-code,
--language-model-only, --dtype auto / bfloat16, --enable-chunked-prefill, --enable-expert-parallel,
--async-scheduling, the multimodal --mm-encoder-tp-mode / --mm-processor-cache-type); --kv-cache-dtype
auto / fp8_e4m3 are engine_flags' aliases; --max-model-len, --chat-template and --hf-overrides are
engine flags. What atlas cannot honour (several GPUs, another draft method) is one line, exit 2,
before the model loads."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, fields, replace
from typing import Any, TypeVar

import click

from .engine_flags import EngineFlags
from .errors import AtlasError
from . import json_text

F = TypeVar("F", bound=Callable[..., Any])
MTP_METHODS = ("mtp", "qwen3_next_mtp", "qwen3_5_mtp")  # vLLM's names for a checkpoint's own MTP head
MAX_DRAFTS = 3  # --spec-k's range


@dataclass(frozen=True)
class VllmFlags:
    model_path: str | None = None  # `vllm serve MODEL`
    enable_auto_tool_choice: bool = False
    speculative_config: str | None = None
    tensor_parallel_size: int = 1
    data_parallel_size: int = 1
    gpu_memory_utilization: float | None = None
    trust_remote_code: bool = False
    dtype: str = "auto"
    enable_prefix_caching: bool | None = None  # False: --prompt-cache 0
    language_model_only: bool = False
    max_num_seqs: int | None = None
    log_requests: bool | None = None  # atlas logs no request contents either way
    max_num_batched_tokens: int | None = None  # prompt tokens per pass (at most PREFILL_CHUNK)
    enable_chunked_prefill: bool | None = None  # prompts always run in passes
    enable_expert_parallel: bool = False  # one GPU holds every expert
    async_scheduling: bool = False
    mm_encoder_tp_mode: str | None = None  # no vision encoder here
    mm_processor_cache_type: str | None = None

    @classmethod
    def pop_from(cls, kwargs: dict[str, Any]) -> VllmFlags:
        return cls(**{f.name: kwargs.pop(f.name) for f in fields(cls) if f.name in kwargs})

    def model(self, model: str | None) -> str | None:
        """--model, or vLLM's positional MODEL (both only when they agree)."""
        if self.model_path is not None and model is not None and model != self.model_path:
            raise AtlasError(f"the model is given twice ({self.model_path!r} and --model {model!r}); give it once")
        return model if model is not None else self.model_path

    def check(self, tool_call_parser: str | None) -> None:
        for flag, size in (("--tensor-parallel-size", self.tensor_parallel_size), ("--data-parallel-size", self.data_parallel_size)):
            if size != 1:
                raise AtlasError(f"{flag} {size}: atlas runs a model on one GPU; leave it out or give 1")
        if self.enable_auto_tool_choice and tool_call_parser is None:
            raise AtlasError("--enable-auto-tool-choice needs --tool-call-parser (qwen3_coder for Qwen3.5 / 3.6), "
                             "as in vLLM")

    def engine(self, flags: EngineFlags) -> EngineFlags:
        """The engine flags with --speculative-config's draft count as --spec-k and
        --max-num-batched-tokens as the prompt tokens per pass."""
        flags = replace(flags, max_num_batched_tokens=self.max_num_batched_tokens)
        drafts = spec_drafts(self.speculative_config)
        if drafts is None:
            return flags
        if flags.spec_k is not None or flags.no_spec:
            raise AtlasError("--speculative-config and --spec-k / --no-spec exclude each other; give one of them")
        return replace(flags, spec_k=drafts)

    def prompt_cache(self, checkpoints: int) -> int:
        """--prompt-cache, 0 under --no-enable-prefix-caching (the prompt cache is atlas's prefix cache)."""
        return 0 if self.enable_prefix_caching is False else checkpoints

    def notes(self) -> list[str]:
        """What the accepted flags do not change, said once at start."""
        notes = []
        if self.gpu_memory_utilization is not None:
            notes.append(f"--gpu-memory-utilization {self.gpu_memory_utilization:g} is not used: the KV cache holds "
                         "--max-model-len positions (default 4096, or the model's context if shorter; give it for "
                         "more), and the memory check says before loading if they do not fit")
        if self.trust_remote_code:
            notes.append("--trust-remote-code changes nothing: atlas runs no code from a checkpoint")
        if self.max_num_seqs is not None:
            notes.append(f"--max-num-seqs {self.max_num_seqs} is not used: requests run one at a time "
                         "(--max-waiting bounds the queue)")
        unused = sorted(set(spec_config(self.speculative_config) or {}) - {"method", "num_speculative_tokens"})
        if unused:
            notes.append(f"--speculative-config: {', '.join(unused)} not used (the checkpoint's MTP head drafts)")
        return notes + self.batching_notes()

    def batching_notes(self) -> list[str]:
        """The scheduling and multimodal flags: what atlas does instead."""
        from .engine import PREFILL_CHUNK

        notes = []
        passes = min(self.max_num_batched_tokens or PREFILL_CHUNK, PREFILL_CHUNK)
        if self.max_num_batched_tokens is not None and self.max_num_batched_tokens > PREFILL_CHUNK:
            notes.append(f"--max-num-batched-tokens {self.max_num_batched_tokens}: prompts run in passes of at most "
                         f"{PREFILL_CHUNK} tokens (the memory checks assume that much)")
        if self.enable_chunked_prefill is not None:
            notes.append(f"--{'' if self.enable_chunked_prefill else 'no-'}enable-chunked-prefill: prompts always run "
                         f"in passes of {passes} tokens (--max-num-batched-tokens sets fewer)")
        if self.enable_expert_parallel:
            notes.append("--enable-expert-parallel changes nothing: one GPU holds every expert")
        if self.async_scheduling:
            notes.append("--async-scheduling changes nothing: one request runs at a time")
        for flag, value in (("--mm-encoder-tp-mode", self.mm_encoder_tp_mode),
                            ("--mm-processor-cache-type", self.mm_processor_cache_type)):
            if value is not None:
                notes.append(f"{flag} {value} is not used: atlas runs the text model (no vision encoder)")
        return notes


def spec_config(config: str | None) -> dict[str, Any] | None:
    """vLLM's --speculative-config JSON, parsed (None: not given)."""
    if config is None:
        return None
    value = json_text.flag_value(config, "--speculative-config",
                                 "give e.g. '{\"method\": \"mtp\", \"num_speculative_tokens\": 2}'")
    if not isinstance(value, dict) or value.get("method") not in MTP_METHODS:
        raise AtlasError("--speculative-config: only the checkpoint's MTP head drafts here: "
                         "{\"method\": \"mtp\", \"num_speculative_tokens\": 1..3} (or qwen3_next_mtp)")
    return value


def spec_drafts(config: str | None) -> int | None:
    """vLLM's --speculative-config JSON -> the MTP draft count (None: not given)."""
    value = spec_config(config)
    if value is None:
        return None
    drafts = value.get("num_speculative_tokens", 1)  # vLLM's default: the head's own depth, 1 for Qwen3.5 / 3.6
    if not isinstance(drafts, int) or isinstance(drafts, bool) or not 1 <= drafts <= MAX_DRAFTS:
        raise AtlasError(f"--speculative-config: num_speculative_tokens must be 1..{MAX_DRAFTS}, got {drafts!r}")
    return drafts


VLLM_OPTIONS = (
    click.argument("model_path", required=False, metavar="[MODEL]"),
    click.option("--enable-auto-tool-choice", is_flag=True,
                 help="vLLM's: accepted (tools are on with --tool-call-parser, which it needs)."),
    click.option("--speculative-config", default=None,
                 help="""vLLM's JSON: '{"method": "mtp", "num_speculative_tokens": 2}' is --spec-k 2."""),
    click.option("--tensor-parallel-size", "-tp", type=click.IntRange(min=1), default=1, show_default=True,
                 help="vLLM's: 1 (atlas runs a model on one GPU)."),
    click.option("--data-parallel-size", "-dp", type=click.IntRange(min=1), default=1, show_default=True,
                 help="vLLM's: 1 (one engine)."),
    click.option("--enable-prefix-caching/--no-enable-prefix-caching", default=None,
                 help="vLLM's: the prompt cache is atlas's prefix cache (--no-enable-prefix-caching: --prompt-cache 0)."),
    click.option("--language-model-only", is_flag=True, help="vLLM's: accepted; atlas runs the text model only."),
    click.option("--max-num-seqs", type=click.IntRange(min=1), default=None,
                 help="vLLM's: accepted, not used (requests run one at a time)."),
    click.option("--enable-log-requests/--disable-log-requests", "log_requests", default=None,
                 help="vLLM's: accepted; atlas logs no request contents."),
    click.option("--gpu-memory-utilization", type=click.FloatRange(0, 1, min_open=True), default=None,
                 help="vLLM's: accepted, not used (the KV cache holds --max-model-len positions)."),
    click.option("--trust-remote-code", is_flag=True, help="vLLM's: accepted; atlas runs no checkpoint code."),
    click.option("--dtype", type=click.Choice(["auto", "bfloat16"]), default="auto", show_default=True,
                 help="vLLM's: the checkpoint's own (bf16, or its quantized format)."),
    click.option("--max-num-batched-tokens", type=click.IntRange(min=1), default=None,
                 help="vLLM's: prompt tokens per forward pass (default and most: 4096)."),
    click.option("--enable-chunked-prefill/--no-enable-chunked-prefill", default=None,
                 help="vLLM's: accepted; prompts always run in passes (--max-num-batched-tokens tokens)."),
    click.option("--enable-expert-parallel", is_flag=True, help="vLLM's: accepted; one GPU holds every expert."),
    click.option("--async-scheduling", is_flag=True, help="vLLM's: accepted; one request runs at a time."),
    click.option("--mm-encoder-tp-mode", type=click.Choice(["weights", "data"]), default=None,
                 help="vLLM's: accepted, not used (the text model only)."),
    click.option("--mm-processor-cache-type", type=click.Choice(["lru", "shm"]), default=None,
                 help="vLLM's: accepted, not used (the text model only)."),
)


def vllm_options(command: F) -> F:
    for option in reversed(VLLM_OPTIONS):
        command = option(command)
    return command
