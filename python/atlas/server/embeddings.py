"""Embeddings over HTTP (atlas.embed): OpenAI's and vLLM's POST /v1/embeddings, and llama.cpp's own
POST /embedding (alias /embeddings). Each input is one engine job, queued with the generations; its
vector is the prompt's final hidden state pooled as `atlas serve --pooling` says (last, the default,
or mean), then normalised: L2 on /v1/embeddings (vLLM's `normalize: false` leaves it raw), llama.cpp's
`embd_normalize` on /embedding. `encoding_format: "base64"` (what the openai client asks for by
default) sends each vector as its little-endian float32 bytes in base64. vLLM's chat form, `messages`
instead of `input`, embeds the conversation as the chat template renders it (no generation prompt
unless `add_generation_prompt`)."""

from __future__ import annotations

import base64
import time
import uuid
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import anyio
import numpy as np

from ..embed import Normalise, fitting, p_norm
from ..errors import AtlasError
from ..llm import generate_options
from .errors import RequestError
from .protocol import (
    Message, Prompt, check_unsupported, optional_bool, optional_int, optional_model, parse_messages, parse_prompts, parse_template_kwargs,
    parse_truncation,
)
from .worker import Failed, Pooled

if TYPE_CHECKING:
    from .app import ServerState

MAX_INPUTS = 256  # inputs of one request, embedded one after another
ENCODINGS = ("float", "base64")
UNSUPPORTED = {"add_special_tokens": (None, True)}  # vLLM's, with the values that change nothing


@dataclass(frozen=True)
class ChatInput:
    """vLLM's chat embedding request: a conversation through the chat template."""

    messages: list[Message]
    add_generation_prompt: bool = False
    continue_final: bool = False
    template_kwargs: dict[str, Any] | None = None


@dataclass(frozen=True)
class EmbeddingAsk:
    model: str
    prompts: list[Prompt | ChatInput]
    normalise: Normalise
    truncate: int | None = None  # vLLM's truncate_prompt_tokens
    base64: bool = False


def openai_request(raw: Any, hidden_size: int) -> EmbeddingAsk:
    if not isinstance(raw, dict):
        raise RequestError("the request body must be a JSON object")
    check_unsupported(raw, UNSUPPORTED)
    if raw.get("encoding_format", "float") not in ENCODINGS:
        raise RequestError(f"'encoding_format' must be one of {', '.join(ENCODINGS)}, got {raw['encoding_format']!r:.40}",
                           "encoding_format")
    model = optional_model(raw)
    dimensions = optional_int(raw, "dimensions", minimum=1)
    if dimensions is not None and dimensions != hidden_size:
        raise RequestError(f"'dimensions' {dimensions}: this model embeds in its hidden size, {hidden_size}, and was not "
                           "trained for shorter vectors; leave it out", "dimensions")
    keep = parse_truncation(raw)
    raw_vectors = optional_bool(raw, "normalize") is False
    return EmbeddingAsk(model, openai_inputs(raw), p_norm(-1 if raw_vectors else 2), keep,
                        raw.get("encoding_format") == "base64")


def openai_inputs(raw: dict[str, Any]) -> list[Prompt | ChatInput]:
    """`input` (texts or token ids), or vLLM's `messages` with its template fields."""
    if "messages" not in raw:
        return list(parse_prompts(raw.get("input"), "input", MAX_INPUTS))
    if "input" in raw:
        raise RequestError("give 'input' (texts or token ids) or 'messages' (a conversation), not both", "input")
    add, final = optional_bool(raw, "add_generation_prompt"), optional_bool(raw, "continue_final_message")
    if add and final:
        raise RequestError("'continue_final_message' needs 'add_generation_prompt' left false (both would open a new "
                           "turn and continue the last one)", "continue_final_message")
    return [ChatInput(parse_messages(raw["messages"]), bool(add), bool(final),
                      parse_template_kwargs(raw.get("chat_template_kwargs")))]


def llama_request(raw: Any) -> EmbeddingAsk:
    """llama.cpp's body: `content` (or `input`) and `embd_normalize`."""
    if not isinstance(raw, dict):
        raise RequestError("the request body must be a JSON object")
    field = "content" if "content" in raw or "input" not in raw else "input"
    norm = optional_int(raw, "embd_normalize", minimum=-1)
    model = optional_model(raw)
    return EmbeddingAsk(model, parse_prompts(raw.get(field), field, MAX_INPUTS), p_norm(2 if norm is None else norm))


async def embedded(state: ServerState, ask: EmbeddingAsk) -> tuple[list[np.ndarray], int]:
    """Every input encoded and checked first, then each pooled by the engine in turn -> (the
    normalised vectors, the prompt tokens in all)."""
    from .app import check_model, check_room

    check_model(state, ask.model)
    check_room(state)
    prompts = await anyio.to_thread.run_sync(prepared, state, ask)
    vectors = []
    for ids in prompts:
        async for event in state.worker.events(ids, generate_options(max_tokens=1), pooling=state.pooling):
            if isinstance(event, Failed):
                raise RequestError(event.message, None, "server_error" if event.status >= 500 else None, event.status)
            if isinstance(event, Pooled):
                vectors.append(ask.normalise(np.asarray(event.vector, np.float64)))
    return vectors, sum(len(ids) for ids in prompts)


def prepared(state: ServerState, ask: EmbeddingAsk) -> list[list[int]]:
    try:
        return [state.llm.prepare(encoded(state, prompt), fitting(ask.truncate)) for prompt in ask.prompts]
    except AtlasError as err:
        raise RequestError(str(err), "messages" if isinstance(ask.prompts[0], ChatInput) else "input") from None


def encoded(state: ServerState, prompt: Prompt | ChatInput) -> Prompt:
    if not isinstance(prompt, ChatInput):
        return prompt
    return state.llm.tokenizer.encode_chat(prompt.messages, prompt.add_generation_prompt, prompt.template_kwargs,
                                           prompt.continue_final)


def openai_answer(ask: EmbeddingAsk, vectors: list[np.ndarray], tokens: int, model: str) -> dict[str, Any]:
    def encoded(vector: np.ndarray) -> list[float] | str:
        as_f32 = vector.astype("<f4")
        return base64.b64encode(as_f32.tobytes()).decode("ascii") if ask.base64 else as_f32.tolist()

    data = [{"object": "embedding", "index": i, "embedding": encoded(v)} for i, v in enumerate(vectors)]
    return {"id": f"embd-{uuid.uuid4().hex}", "object": "list", "created": int(time.time()), "model": model,
            "data": data, "usage": {"prompt_tokens": tokens, "total_tokens": tokens}}


def llama_answer(vectors: list[np.ndarray]) -> list[dict[str, Any]]:
    """llama-server's: per input its index and, with a pooling, the one pooled vector in a list."""
    return [{"index": i, "embedding": [v.astype(np.float32).tolist()]} for i, v in enumerate(vectors)]
