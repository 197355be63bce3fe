"""Embeddings from the generative model, as vLLM's pooling runner and llama.cpp's `--embeddings`
give them for a decoder: `llm.embed(prompts)` returns one EmbeddingRequestOutput per prompt, its
`outputs.embedding` the prompt's final hidden state (after the model's final norm, transformers'
last_hidden_state) pooled over the prompt's tokens and L2-normalised. Pooling "last" (vLLM's LAST,
its default for decoder models: the last token has read the whole prompt) takes the last token's
row and resumes from the prompt cache; "mean" (llama.cpp's common --pooling mean) averages every
row from a fresh state."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from .errors import AtlasError
from .vllm_api import prompt_parts, single_prompt

if TYPE_CHECKING:
    from .llm import LLM

POOLINGS = ("last", "mean")


@dataclass(frozen=True)
class PoolingParams:
    """vLLM's PoolingParams for embeddings (`pooling` is atlas's: vLLM reads it from the model's
    pooler config)."""

    dimensions: int | None = None  # vLLM's: only models trained for shorter vectors (matryoshka) take another
    normalize: bool = True  # L2-normalise the pooled vector
    pooling: str = "last"

    def check(self, hidden_size: int) -> None:
        if self.pooling not in POOLINGS:
            raise AtlasError(f"PoolingParams.pooling must be one of {', '.join(POOLINGS)}, got {self.pooling!r}")
        if not isinstance(self.normalize, bool):
            raise AtlasError(f"PoolingParams.normalize must be True or False, got {self.normalize!r}")
        if self.dimensions is not None and self.dimensions != hidden_size:
            raise AtlasError(f"dimensions {self.dimensions!r}: this model embeds in its hidden size, {hidden_size}, and "
                             "was not trained for shorter vectors; leave dimensions out")


@dataclass(frozen=True)
class EmbeddingOutput:
    embedding: list[float]

    @property
    def hidden_size(self) -> int:
        return len(self.embedding)


@dataclass(frozen=True)
class EmbeddingRequestOutput:
    request_id: str
    outputs: EmbeddingOutput
    prompt_token_ids: list[int]
    finished: bool = True


def embed(llm: LLM, prompts: object, params: object, truncate_prompt_tokens: int | None,
          progress: bool) -> list[EmbeddingRequestOutput]:
    """LLM.embed: every prompt checked (encoded, truncated, within the context) before any runs."""
    from .llm import generate_options, progress_bar

    params = PoolingParams() if params is None else params
    if not isinstance(params, PoolingParams):
        raise AtlasError(f"pooling_params must be an atlas.PoolingParams, got {type(params).__name__}")
    params.check(llm.parts.spec.hidden_size)
    batch = [prompts] if single_prompt(prompts) else list(prompts)  # type: ignore[call-overload]
    # max_tokens 0 (allowed beside prompt_logprobs, which only prepare reads here): the prompt alone must fit
    fits = generate_options(max_tokens=0, prompt_logprobs=0, truncate_prompt_tokens=truncate_prompt_tokens)
    prepared = [llm.prepare(prompt_parts(prompt)[1], fits) for prompt in batch]
    return [EmbeddingRequestOutput(llm.next_request_id(), EmbeddingOutput(embedding(llm, ids, params)), ids)
            for ids in progress_bar(prepared, progress)]


def embedding(llm: LLM, prompt_ids: list[int], params: PoolingParams) -> list[float]:
    """The pooled vector of prompt ids already checked by LLM.prepare (one turn of the engine)."""
    pooled = llm.parts.engine.pooled(prompt_ids, params.pooling).astype(np.float64)  # [H]
    if params.normalize:
        pooled /= max(float(np.linalg.norm(pooled)), 1e-12)  # a zero vector stays zero, as torch's normalize
    return pooled.astype(np.float32).tolist()
