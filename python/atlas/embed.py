"""Embeddings from the generative model, as vLLM's pooling runner and llama.cpp's `--embeddings`
give them for a decoder: `llm.embed(prompts)` returns one EmbeddingRequestOutput per prompt, its
`outputs.embedding` the prompt's final hidden state (after the model's final norm, transformers'
last_hidden_state) pooled over the prompt's tokens and L2-normalised. Pooling "last" (vLLM's LAST,
its default for decoder models: the last token has read the whole prompt) takes the last token's
row and resumes from the prompt cache; "mean" (llama.cpp's common --pooling mean) averages every
row from a fresh state.

`atlas embed` (llama.cpp's llama-embedding): `-p` / `-f` texts, one prompt per --embd-separator
(a line by default), printed as --embd-output-format says: a line of values per prompt, a JSON
array of them, OpenAI's JSON, or that with the prompts' cosine similarities (json+)."""

from __future__ import annotations

import json
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import click
import numpy as np

from .backends import DEVICES
from .cli import run_command
from .errors import AtlasError
from .run import MODEL_HELP
from .vllm_api import prompt_parts, single_prompt

if TYPE_CHECKING:
    from .llm import LLM, GenerateOptions

POOLINGS = ("last", "mean")
OUTPUT_FORMATS = ("", "array", "json", "json+")  # llama-embedding's --embd-output-format
Normalise = Callable[[np.ndarray], np.ndarray]  # a pooled vector [H] -> the one given out


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
    from .llm import progress_bar

    params = PoolingParams() if params is None else params
    if not isinstance(params, PoolingParams):
        raise AtlasError(f"pooling_params must be an atlas.PoolingParams, got {type(params).__name__}")
    params.check(llm.parts.spec.hidden_size)
    batch = [prompts] if single_prompt(prompts) else list(prompts)  # type: ignore[call-overload]
    prepared = [llm.prepare(prompt_parts(prompt)[1], fitting(truncate_prompt_tokens)) for prompt in batch]
    return [EmbeddingRequestOutput(llm.next_request_id(), EmbeddingOutput(embedding(llm, ids, params)), ids)
            for ids in progress_bar(prepared, progress)]


def fitting(truncate_prompt_tokens: int | None) -> GenerateOptions:
    """The options LLM.prepare checks an embedding's prompt under: max_tokens 0 (allowed beside
    prompt_logprobs, which nothing else reads here), so the prompt alone must fit the context."""
    from .llm import generate_options

    return generate_options(max_tokens=0, prompt_logprobs=0, truncate_prompt_tokens=truncate_prompt_tokens)


def embedding(llm: LLM, prompt_ids: list[int], params: PoolingParams) -> list[float]:
    """The pooled vector of prompt ids already checked by LLM.prepare (one turn of the engine)."""
    pooled = llm.parts.engine.pooled(prompt_ids, params.pooling).astype(np.float64)  # [H]
    return (p_norm(2) if params.normalize else p_norm(-1))(pooled).astype(np.float32).tolist()


def p_norm(p: int) -> Normalise:
    """llama.cpp's embd_normalize: -1 none, 0 max-abs scaled to int16 (32760), 1 taxicab, 2 L2 (vLLM's
    normalize), > 2 p-norm. A zero vector stays zero, as torch's normalize leaves it."""
    if p < 0:
        return lambda vector: vector
    if p == 0:
        return lambda vector: vector * (32760.0 / max(float(np.abs(vector).max()), 1e-12))
    return lambda vector: vector / max(norm_of(vector, p), 1e-12)


def norm_of(vector: np.ndarray, p: int) -> float:
    """The p-norm, summed over |v| / max |v| <= 1: |v| ** p itself overflows float64 for a large p
    (llama.cpp's sum does, and divides the vector down to zeros) where the norm is finite."""
    magnitude = np.abs(vector)
    largest = float(magnitude.max(initial=0.0))
    if largest == 0.0:
        return 0.0
    return largest * float(((magnitude / largest) ** p).sum() ** (1.0 / p))


# --- atlas embed ------------------------------------------------------------------------------
def texts(prompt: str | None, file: str | None, separator: str) -> list[str]:
    """The prompts: --prompt's or --file's text ('-': stdin) cut at each separator, empty pieces left out."""
    if (prompt is None) == (file is None):
        raise AtlasError("give the text to embed with --prompt or --file (one of them)")
    if file is not None:
        try:
            prompt = sys.stdin.read() if file == "-" else Path(file).read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as err:
            raise AtlasError(f"--file {file} cannot be read ({err}); give a UTF-8 text file") from None
    if not separator:
        raise AtlasError("--embd-separator is empty; give the text that separates prompts (default: a newline)")
    pieces = [piece for piece in prompt.split(separator) if piece.strip()]  # type: ignore[union-attr]
    if not pieces:
        raise AtlasError("the text to embed is empty; give some text")
    return pieces


def formatted(vectors: np.ndarray, output_format: str) -> str:
    """vectors [N, H] as llama-embedding prints them."""
    rows = vectors.astype(np.float32).tolist()
    if output_format == "":
        return "\n".join(f"embedding {i}: " + " ".join(f"{v:9.6f}" for v in row) for i, row in enumerate(rows))
    if output_format == "array":
        return json.dumps(rows)
    answer: dict[str, Any] = {"object": "list", "data": [{"object": "embedding", "index": i, "embedding": row}
                                                          for i, row in enumerate(rows)]}
    if output_format == "json+":
        unit = vectors / np.maximum(np.linalg.norm(vectors, axis=1, keepdims=True), 1e-12)  # [N, H]
        answer["cosineSimilarity"] = (unit @ unit.T).astype(np.float32).tolist()  # [N, N]
    return json.dumps(answer, indent=1)


@click.command(context_settings={"help_option_names": ["-h", "--help"]})
@click.option("--model", "-m", default=None, help=MODEL_HELP)
@click.option("--prompt", "-p", default=None, help="The text to embed: one prompt per --embd-separator.")
@click.option("--file", "-f", default=None, help="The text to embed from a UTF-8 file ('-': stdin).")
@click.option("--pooling", type=click.Choice(POOLINGS), default="last", show_default=True,
              help="The last token's final hidden state, or the mean over the prompt's tokens.")
@click.option("--embd-normalize", type=click.IntRange(min=-1), default=2, show_default=True,
              help="-1 none, 0 max-abs (int16 range), 1 taxicab, 2 L2, > 2 p-norm (llama.cpp's).")
@click.option("--embd-output-format", type=click.Choice(OUTPUT_FORMATS), default="", show_default=True,
              help="'': a line of values per prompt; array: a JSON array of them; json: OpenAI's; json+: with the "
              "prompts' cosine similarities.")
@click.option("--embd-separator", default="\\n", show_default=True,
              help="What separates the prompts in the text (\\n: a newline).")
@click.option("--device", type=click.Choice(DEVICES), default="auto", show_default=True)
def command(model: str | None, prompt: str | None, file: str | None, pooling: str, embd_normalize: int,
            embd_output_format: str, embd_separator: str, device: str) -> None:
    """Embed texts: each prompt's final hidden state pooled and normalised (llama.cpp's llama-embedding)."""
    from .llm import LLM

    prompts = texts(prompt, file, embd_separator.replace("\\n", "\n"))
    llm = LLM(model, device=device)
    raw = llm.embed(prompts, PoolingParams(pooling=pooling, normalize=False))
    normalise = p_norm(embd_normalize)
    vectors = np.stack([normalise(np.asarray(o.outputs.embedding, np.float64)) for o in raw])  # [N, H]
    click.echo(formatted(vectors, embd_output_format))


def main(argv: list[str] | None = None, usage: str | None = None) -> int:
    return run_command(command, argv, "atlas.embed", usage=usage)


if __name__ == "__main__":
    sys.exit(main())
