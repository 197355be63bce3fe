"""The engine's command-line flags, defined once for `atlas.run` and `atlas.serve`: --device,
--spec-k / --no-spec (MTP speculation), --kv-cache-dtype, --kv-high-precision-layers,
--chat-template, --chat-template-kwargs, --hf-overrides, --max-seq-len, --check-weights,
--revision, --download-dir and --enforce-eager.

Imports stay light (click and the level names): `--help` must not load numpy.
"""

from __future__ import annotations

from collections.abc import Callable
import math
from dataclasses import dataclass, fields, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

import click

from .backends import DEVICES
from .errors import AtlasError
from .kvcache.names import DEFAULT_LEVEL, LEVEL_NAMES, VLLM_KV_NAMES
from . import json_text
from .tokenizer import SERVER_TEMPLATE_NAMES

if TYPE_CHECKING:
    from .llm import LLM
    from .tokenizer import Tokenizer

F = TypeVar("F", bound=Callable[..., Any])


@dataclass(frozen=True)
class EngineFlags:
    device: str = "auto"
    kv_cache_dtype: str = DEFAULT_LEVEL
    kv_high_precision_layers: str = "auto"
    spec_k: int | None = None  # MTP speculation: None = on (k=2) when the checkpoint has the head
    no_spec: bool = False
    max_seq_len: int | None = None  # KV cache positions: None = 4096, capped by the model's context
    prompt_cache: int = 0  # prompt-cache checkpoints: atlas.serve's --prompt-cache (atlas.run runs one prompt)
    chat_template: str | None = None  # a jinja file used instead of the model's chat template
    chat_template_kwargs: str | None = None  # JSON object: default template variables (enable_thinking ...)
    hf_overrides: str | None = None  # JSON object merged into config.json (vLLM's --hf-overrides)
    check_weights: bool = False  # read every float tensor for NaN / infinity before loading
    enforce_eager: bool = False  # no CUDA graphs (vLLM's --enforce-eager)
    max_num_batched_tokens: int | None = None  # prompt tokens per pass (vLLM's flag, atlas.serve's; None: 4096)
    revision: str | None = None  # a repo id's snapshot: branch, tag or commit hash (vLLM's --revision)
    download_dir: str | None = None  # the Hugging Face cache repo ids are looked up in (vLLM's --download-dir)

    @classmethod
    def pop_from(cls, kwargs: dict[str, Any]) -> EngineFlags:
        """Take this dataclass's fields out of a click command's keyword arguments (a field the
        command has no option for keeps its default)."""
        return cls(**{f.name: kwargs.pop(f.name) for f in fields(cls) if f.name in kwargs})

    def spec_k_value(self) -> int | None:
        """--spec-k / --no-spec -> LLM's spec_k (None: the checkpoint decides, 0: off)."""
        from .speculative import spec_k_from_flags

        return spec_k_from_flags(self.spec_k, self.no_spec)

    def check(self) -> None:
        """Every flag problem, before a model loads or a port is bound."""
        from .kvcache.options import KVCacheOptions

        self.spec_k_value()
        KVCacheOptions(self.kv_cache_dtype, self.kv_high_precision_layers).check()
        if self.chat_template is not None:
            from .tokenizer import read_template_file

            read_template_file(Path(self.chat_template))
        self.template_defaults()
        self.config_overrides()

    def template_defaults(self) -> dict[str, Any]:
        """--chat-template-kwargs parsed: a JSON object of template variables, or one line."""
        if self.chat_template_kwargs is None:
            return {}
        value = json_text.flag_value(self.chat_template_kwargs, "--chat-template-kwargs",
                                     "give an object such as '{\"enable_thinking\": false}'")
        if not isinstance(value, dict) or SERVER_TEMPLATE_NAMES & set(value):
            raise AtlasError("--chat-template-kwargs must be a JSON object of template variables other than "
                             + ", ".join(sorted(SERVER_TEMPLATE_NAMES)))
        return value

    def config_overrides(self) -> dict[str, Any] | None:
        """--hf-overrides parsed: a JSON object of config.json fields, or one line."""
        if self.hf_overrides is None:
            return None
        example = "'{\"text_config\": {\"rope_parameters\": {\"rope_type\": \"yarn\", \"factor\": 4.0, ...}}}'"
        value = json_text.flag_value(self.hf_overrides, "--hf-overrides",
                                     f"give an object of config.json fields, such as {example}")
        if not isinstance(value, dict):
            raise AtlasError(f"--hf-overrides must be a JSON object of config.json fields, such as {example}")
        return value

    def tokenizer(self, model_dir: Path) -> Tokenizer:
        """The model's tokenizer as the flags dress it (--chat-template, --chat-template-kwargs)."""
        from .tokenizer import Tokenizer

        return self.dress(Tokenizer.open(model_dir))

    def dress(self, tokenizer: Tokenizer) -> Tokenizer:
        if self.chat_template is not None:
            tokenizer = tokenizer.with_chat_template(Path(self.chat_template))
        return replace(tokenizer, template_defaults=self.template_defaults())

    def resolve(self, model: str | None) -> Path:
        """--model as a checkpoint directory, a repo id's snapshot picked by --revision in --download-dir."""
        from .resolve import resolve_model

        return resolve_model(model, revision=self.revision, download_dir=self.download_dir)

    def load(self, model_dir: str) -> LLM:
        from .llm import LLM

        spec_k = self.spec_k_value()
        llm = LLM(model_dir, self.device, self.kv_cache_dtype, self.kv_high_precision_layers, spec_k,
                  self.max_seq_len, prompt_cache=self.prompt_cache, hf_overrides=self.config_overrides(),
                  check_weights=self.check_weights, enforce_eager=self.enforce_eager,
                  max_num_batched_tokens=self.max_num_batched_tokens)
        llm.parts.tokenizer = self.dress(llm.parts.tokenizer)
        return llm


def high_precision_value(ctx: click.Context, param: click.Parameter, value: str) -> str:
    """'auto' or a non-negative integer; otherwise parse_high_precision's one-line AtlasError,
    while the command line is parsed."""
    from .kvcache.options import parse_high_precision

    parse_high_precision(value)
    return value


class ContextLength(click.ParamType):
    """--max-seq-len / --max-model-len as vLLM reads it: a positive integer, with k / m (x1000,
    x1000000) or K / M (x1024, x1048576) after it, or -1 / auto (the model's whole context: -1)."""

    name = "integer"
    SCALES = {"k": 1000, "m": 1000**2, "K": 1024, "M": 1024**2}

    def convert(self, value: object, param: click.Parameter | None, ctx: click.Context | None) -> int:
        if isinstance(value, int):
            return value
        text = str(value).strip()
        if text in ("-1", "auto"):
            return -1
        scale = self.SCALES.get(text[-1:], 1)
        digits = text[:-1] if scale > 1 else text
        try:
            number = float(digits) * scale if scale > 1 else int(digits)
        except ValueError:
            number = 0
        if not math.isfinite(number) or number < 1 or number != int(number):
            self.fail(f"{value!r} is not a context length: give a positive integer such as 32768, 32k or 32K, "
                      "or -1 / auto for the model's whole context", param, ctx)
        return int(number)




def kv_level_value(ctx: click.Context, param: click.Parameter, value: str) -> str:
    return VLLM_KV_NAMES.get(value, value)


KV_CACHE_DTYPE = click.option(
    "--kv-cache-dtype", type=click.Choice([*LEVEL_NAMES, *VLLM_KV_NAMES]), default=DEFAULT_LEVEL, show_default=True,
    callback=kv_level_value,
    help="KV cache level of the full-attention layers (numpy and cuda backends); vLLM's auto is bf16, fp8_e4m3 fp8.",
)
KV_HIGH_PRECISION_LAYERS = click.option(
    "--kv-high-precision-layers", default="auto", show_default=True, callback=high_precision_value,
    help="Full-attention layers kept bf16 at each end: auto (= 1: the first and the last) or N.",
)
ENGINE_OPTIONS = (
    click.option("--device", type=click.Choice(DEVICES), default="auto", show_default=True),
    click.option(
        "--spec-k", type=click.IntRange(1, 3), default=None,
        help="MTP speculative decoding: draft this many tokens per pass (default 2 when the checkpoint has the MTP head).",
    ),
    click.option("--no-spec", is_flag=True, help="No speculative decoding; the MTP head is not loaded."),
    KV_CACHE_DTYPE,
    KV_HIGH_PRECISION_LAYERS,
    click.option(
        "--chat-template", type=click.Path(dir_okay=False), default=None,
        help="A jinja file used instead of the model's chat template (as vLLM's --chat-template).",
    ),
    click.option(
        "--chat-template-kwargs", default=None,
        help="""Default chat-template variables as a JSON object, e.g. '{"enable_thinking": false}' (a request's own win).""",
    ),
    click.option(
        "--hf-overrides", default=None,
        help="""A JSON object merged into the checkpoint's config.json before it is read (vLLM's flag), e.g. '{"text_config": {"rope_parameters": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 262144, "rope_theta": 10000000, "partial_rotary_factor": 0.25}}}' for YaRN.""",
    ),
    click.option(
        "--max-seq-len", "--max-model-len", "--ctx-size", "-c", "max_seq_len", type=ContextLength(), default=None,
        help="Context held in the KV cache: prompt + generated tokens (default 4096, at most the model's max_position_embeddings, or YaRN's stretched context; -1 or auto: all of it; 32k = 32000, 32K = 32768; --max-model-len is vLLM's name for it, -c / --ctx-size llama.cpp's).",
    ),
    click.option(
        "--check-weights", "--check-tensors", "check_weights", is_flag=True,
        help="Read every weight before loading and refuse a checkpoint holding NaN or infinity (about a minute for 70 GB; --check-tensors is llama.cpp's name).",
    ),
    click.option(
        "--revision", default=None,
        help="The snapshot of a Hugging Face repo id to run: a branch or tag the cache has, or a commit hash (vLLM's flag; pins what runs).",
    ),
    click.option(
        "--download-dir", default=None,
        help="The Hugging Face cache to find repo ids in (vLLM's flag; default: HF_HUB_CACHE, HF_HOME/hub or ~/.cache/huggingface/hub).",
    ),
    click.option(
        "--enforce-eager", is_flag=True,
        help="Decode without CUDA graphs, each kernel launched from Python (vLLM's flag; ATLAS_CUDA_GRAPHS=0 for this run).",
    ),
)  # fmt: skip


def engine_options(command: F) -> F:
    """Decorate a click command with ENGINE_OPTIONS (in their listed order in --help)."""
    for option in reversed(ENGINE_OPTIONS):
        command = option(command)
    return command
