"""What a run holds beside its weights, decided before anything loads: the engine builds its
caches by it, and the device / host memory checks size the run by it."""

from __future__ import annotations

from dataclasses import dataclass, field

from ..errors import AtlasError
from ..kvcache.options import KVCacheOptions

DEFAULT_MAX_SEQ_LEN = 4096  # tokens of KV cache when the caller names no capacity


@dataclass(frozen=True)
class RunPlan:
    max_seq_len: int = DEFAULT_MAX_SEQ_LEN  # KV cache positions: prompt + generated tokens
    kv_cache: KVCacheOptions = field(default_factory=KVCacheOptions)
    load_mtp: bool = True  # build_engine loads the MTP head when the checkpoint has one
    prompt_cache: int = 0  # checkpoints the prompt cache keeps, each a copy of the DeltaNet states (0: off)
    eager: bool = False  # the CUDA backend decodes without graphs (vLLM's enforce_eager; ATLAS_CUDA_GRAPHS=0 for one run)
    prefill_chunk: int | None = None  # prompt tokens per forward pass (None: atlas.engine.PREFILL_CHUNK, also the most)

    def state_copies(self) -> int:
        """DeltaNet state sets held: the live one and one per prompt-cache checkpoint."""
        return 1 + self.prompt_cache


def context_length(requested: int | None, model_context: int) -> int:
    """--max-seq-len -> the KV cache capacity: the default (capped by the model's context) when
    not given, the whole context for -1 (vLLM's auto); one line when the request is not a positive
    integer or exceeds the context."""
    if requested is None:
        return min(DEFAULT_MAX_SEQ_LEN, model_context)
    if requested == -1 and not isinstance(requested, bool):
        return model_context
    if isinstance(requested, bool) or not isinstance(requested, int) or requested < 1:
        raise AtlasError(f"max_seq_len must be a positive integer (or -1: the model's whole context), got {requested!r}")
    if requested > model_context:
        raise AtlasError(
            f"max_seq_len {requested} exceeds the model's context of {model_context} positions "
            "(max_position_embeddings in config.json, or YaRN's stretched context); give at most that"
        )
    return requested
