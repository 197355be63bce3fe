"""llama.cpp's own completion API (POST /completion, and its alias /completions), as llama-server
answers it: a request's fields (n_predict, repeat_penalty, n_probs, logit_bias as [id, bias] pairs,
grammar, json_schema, return_tokens, ...) become a /v1/completions request, and the answer comes back
in llama-server's shape (`content`, `tokens`, `stop`, `stop_type`, `stopping_word`, token counts,
`timings`, `completion_probabilities`), whole or as `data:` events, the last one with `stop: true`
(no [DONE]). typical_p, top_n_sigma, XTC, DRY, mirostat and dynatemp are atlas.sampling_filters';
sampler settings atlas does not implement (tfs_z, ...) are refused unless they hold their neutral
value; hints with no effect here (cache_prompt, id_slot, n_keep, samplers: atlas's order applies)
are accepted."""

from __future__ import annotations

import json
from collections.abc import AsyncGenerator
from contextlib import aclosing
from dataclasses import dataclass
from typing import Any

from ..sampling import is_int
from ..sampling_filters import DRY_COUNTS, NAMES as FILTER_NAMES
from .errors import RequestError, error_body
from .protocol import SamplingFields, check_unsupported
from .worker import Event, Failed, Finished, ScoredToken, TextPiece

PASSED_THROUGH = ("model", "prompt", "temperature", "top_k", "top_p", "min_p", "presence_penalty", "frequency_penalty",
                  "stop", "stream", "ignore_eos", "grammar", "json_schema", *FILTER_NAMES, *DRY_COUNTS,
                  "dry_sequence_breakers", "mirostat")
RENAMED = {"repeat_penalty": "repetition_penalty"}
NEUTRAL = {  # llama.cpp sampler settings atlas lacks: accepted only where they change nothing
    "tfs_z": (1,), "penalize_nl": (False,),
    "post_sampling_probs": (False,),
    "n_indent": (0,), "t_max_predict_ms": (0,), "n_cmpl": (1,), "lora": ([],), "image_data": ([],),
}
UNTIL_CONTEXT = (-1, -2)  # n_predict: no limit but the context (llama.cpp: -1 infinite, -2 until it is full)
MAX_PROBS = 20


@dataclass(frozen=True)
class CompletionAsk:
    """A /completion request as a /v1/completions body, and what shapes its answer."""

    body: dict[str, Any]
    until_context: bool  # no n_predict: as many tokens as the context holds
    n_probs: int
    return_tokens: bool


def completion_request(raw: Any) -> CompletionAsk:
    if not isinstance(raw, dict):
        raise RequestError("the request body must be a JSON object")
    check_unsupported(raw, NEUTRAL)
    body = {key: raw[key] for key in PASSED_THROUGH if key in raw}
    body |= {new: raw[old] for old, new in RENAMED.items() if old in raw}
    if repeat_window(raw) == 0:  # llama.cpp: a window of no tokens turns the penalty off
        body.pop("repetition_penalty", None)
    if isinstance(raw.get("prompt"), list) and raw["prompt"] and not all(is_int(t) for t in raw["prompt"]):
        raise RequestError("'prompt' must be text or a list of token ids: one prompt per request here "
                           "(/v1/completions takes a batch)", "prompt")
    if (seed := raw.get("seed")) is not None and seed != -1:  # -1: llama.cpp's random seed
        body["seed"] = seed
    if "logit_bias" in raw:
        body["logit_bias"] = logit_bias(raw["logit_bias"])
    n_predict = raw.get("n_predict", -1)
    if not (is_int(n_predict) and (n_predict >= 1 or n_predict in UNTIL_CONTEXT)):
        raise RequestError(f"'n_predict' must be -1 (until the context is full) or a count >= 1, got {n_predict!r:.40}",
                           "n_predict")
    if n_predict >= 1:
        body["max_tokens"] = n_predict
    n_probs = raw.get("n_probs", 0)
    if not is_int(n_probs) or not 0 <= n_probs <= MAX_PROBS:
        raise RequestError(f"'n_probs' must be an integer in 0..{MAX_PROBS}, got {n_probs!r:.40}", "n_probs")
    if n_probs:
        body["logprobs"] = n_probs
    return_tokens = raw.get("return_tokens", False)
    if not isinstance(return_tokens, bool):
        raise RequestError("'return_tokens' must be true or false", "return_tokens")
    return CompletionAsk(body | {"return_token_ids": True}, n_predict < 1, n_probs, return_tokens)


def default_params(sampling: SamplingFields) -> dict[str, Any]:
    """/props' default_generation_settings.params: what a request that sets nothing samples with."""
    extras = sampling.extras
    return {"n_predict": -1, "temperature": sampling.temperature, "top_k": sampling.top_k, "top_p": sampling.top_p,
            "min_p": extras.min_p, "repeat_penalty": extras.repetition_penalty, "repeat_last_n": -1,
            "presence_penalty": extras.presence_penalty, "frequency_penalty": extras.frequency_penalty,
            "seed": -1 if sampling.seed is None else sampling.seed, "ignore_eos": sampling.ignore_eos,
            **{name: getattr(extras, name) for name in (*FILTER_NAMES, *DRY_COUNTS)},
            "dry_sequence_breakers": list(extras.dry_sequence_breakers), "mirostat": extras.mirostat}


def renamed(err: RequestError) -> RequestError:
    """A completions request's error named with the llama.cpp field it came from."""
    message, param = err.message, err.param
    for ours, theirs in LLAMA_NAMES.items():
        message = message.replace(ours, theirs)
        param = theirs if param == ours else param
    return RequestError(message, param, err.code, err.status)


LLAMA_NAMES = {"max_tokens": "n_predict", "logprobs": "n_probs", "repetition_penalty": "repeat_penalty"}


def repeat_window(raw: dict[str, Any]) -> int:
    """llama.cpp's repeat_last_n: atlas's repeat penalty covers the whole prompt and output (vLLM's
    repetition_penalty), llama.cpp's -1; 0 turns it off; another window is refused where a penalty applies."""
    window, penalty = raw.get("repeat_last_n", -1), raw.get("repeat_penalty", 1)
    if not is_int(window) or (window not in (-1, 0) and penalty != 1):
        raise RequestError(f"'repeat_last_n' {window!r:.20}: the repeat penalty here covers the whole prompt and "
                           "output; give -1 (or 0: no penalty), or leave it out", "repeat_last_n")
    return int(window)


def logit_bias(value: Any) -> Any:
    """llama.cpp's [[id, bias], ...] (bias false: never) as OpenAI's {id: bias}; an object passes as it is."""
    if not isinstance(value, list):
        return value
    pairs: dict[str, Any] = {}
    for pair in value:
        if not (isinstance(pair, list) and len(pair) == 2 and is_int(pair[0])):
            raise RequestError("'logit_bias' must be [[token_id, bias], ...] (bias a number, or false: never) or "
                               "{\"token_id\": bias}; text keys are not taken here (/tokenize gives the ids)",
                               "logit_bias")
        pairs[str(pair[0])] = -100 if pair[1] is False else pair[1]
    return pairs


@dataclass(frozen=True)
class CompletionMeta:
    model: str
    prompt: str  # the prompt's text
    prompt_tokens: int
    ask: CompletionAsk
    truncated: bool = False  # /infill cut its prompt to fit


def piece_fields(meta: CompletionMeta, piece: TextPiece) -> dict[str, Any]:
    fields: dict[str, Any] = {"content": piece.text, "tokens": list(piece.token_ids) if meta.ask.return_tokens else []}
    if meta.ask.n_probs:
        fields["completion_probabilities"] = [probabilities(s) for s in piece.scored]
    return fields


def probabilities(scored: ScoredToken) -> dict[str, Any]:
    def entry(token: int, text: str, logprob: float) -> dict[str, Any]:
        return {"id": token, "token": text, "bytes": list(text.encode()), "logprob": logprob}

    top = [entry(t, text, lp) for t, (text, lp) in zip(scored.top_ids, scored.top, strict=True)]
    return entry(scored.token, scored.text, scored.logprob or 0.0) | {"top_logprobs": top}


def final_fields(meta: CompletionMeta, finished: Finished) -> dict[str, Any]:
    """The end of an answer: why it stopped, token counts, timings."""
    word = finished.stop_reason if isinstance(finished.stop_reason, str) else ""
    stop_type = "limit" if finished.finish_reason == "length" else "word" if word else "eos"
    return {"index": 0, "id_slot": 0, "stop": True, "model": meta.model, "tokens_predicted": finished.completion_tokens,
            "tokens_evaluated": finished.prompt_tokens, "prompt": meta.prompt, "truncated": meta.truncated,
            "stop_type": stop_type, "stopping_word": word,
            "tokens_cached": finished.prompt_tokens + finished.completion_tokens, "timings": timings(finished)}


def timings(finished: Finished) -> dict[str, Any]:
    prompt_n, predicted_n = finished.prompt_tokens - finished.cached_tokens, finished.completion_tokens
    prompt_ms, predicted_ms = 1000 * finished.prompt_seconds, 1000 * finished.generation_seconds
    return {"cache_n": finished.cached_tokens, "prompt_n": prompt_n, "prompt_ms": prompt_ms,
            "prompt_per_token_ms": prompt_ms / max(prompt_n, 1), "prompt_per_second": rate(prompt_n, prompt_ms),
            "predicted_n": predicted_n, "predicted_ms": predicted_ms,
            "predicted_per_token_ms": predicted_ms / max(predicted_n, 1),
            "predicted_per_second": rate(predicted_n, predicted_ms)}


def rate(tokens: int, ms: float) -> float:
    return 1000 * tokens / ms if ms > 0 else 0.0


async def whole_completion(meta: CompletionMeta, events: AsyncGenerator[Event, None]) -> dict[str, Any]:
    merged: dict[str, Any] = {"content": "", "tokens": []} | ({"completion_probabilities": []} if meta.ask.n_probs else {})
    async with aclosing(events):
        async for event in events:
            if isinstance(event, TextPiece):
                for key, value in piece_fields(meta, event).items():
                    merged[key] += value
            elif isinstance(event, Finished):
                return merged | {"has_new_line": "\n" in merged["content"]} | final_fields(meta, event)
            elif isinstance(event, Failed):
                raise RequestError(event.message, status=event.status)
    raise RequestError("the engine stopped before finishing", status=500)


async def stream_completion(meta: CompletionMeta, events: AsyncGenerator[Event, None]) -> AsyncGenerator[str, None]:
    """llama-server's events: one per text piece (stop false), then the end (stop true, content empty)."""
    predicted = 0
    async with aclosing(events):
        async for event in events:
            if isinstance(event, TextPiece):
                predicted += event.tokens
                yield data({"index": 0, **piece_fields(meta, event), "stop": False, "id_slot": 0,
                            "tokens_predicted": predicted, "tokens_evaluated": meta.prompt_tokens})
            elif isinstance(event, Finished):
                yield data({"content": "", "tokens": [], **final_fields(meta, event)})
            elif isinstance(event, Failed):
                kind = "invalid_request_error" if event.status < 500 else "server_error"
                yield data(error_body(event.message, kind))


def data(body: dict[str, Any]) -> str:
    return f"data: {json.dumps(body, ensure_ascii=False)}\n\n"
