"""A request's choices (`n` of them, generated one after another on the engine, the later ones
from the prompt cache), collected into one body or streamed as chunks tagged with their index."""

from __future__ import annotations

from collections.abc import AsyncGenerator
from contextlib import aclosing
from dataclasses import dataclass
from typing import Any

from .answer import AnswerShaper
from .errors import RequestError, error_body
from .responses import (Reply, choice_body, chunk, full_body, logprobs_body, sse, text_delta, token_fields, usage_chunk,
                        usage_so_far)
from .worker import Event, Failed, Finished, TextPiece


@dataclass
class ChoiceRun:
    index: int
    events: AsyncGenerator[Event, None]  # not started: its job is queued when first iterated
    shaper: AnswerShaper | None = None
    prompt_ids: tuple[int, ...] = ()


async def collect_choices(reply: Reply, runs: list[ChoiceRun], n: int = 1) -> dict[str, Any]:
    """n: choices per prompt (the usage counts each prompt once); the first choice of a prompt
    carries its prompt_logprobs for the others (a completions choice each has them)."""
    choices, finished = [], []
    for run in runs:
        choice, done = await collect(reply, run)
        first = choices[run.index - run.index % n] if run.index % n else None
        if first is not None and "prompt_logprobs" in first:
            choice["prompt_logprobs"] = first["prompt_logprobs"]
        choices.append(choice)
        finished.append(done)
    return full_body(reply, choices, finished, n, runs[0].prompt_ids if runs else ())


async def collect(reply: Reply, run: ChoiceRun) -> tuple[dict[str, Any], Finished]:
    pieces, finished = await whole_pieces(run.events)
    return choice_body(reply, run.index, pieces, finished, run.shaper, run.prompt_ids), finished


async def whole_pieces(events: AsyncGenerator[Event, None]) -> tuple[list[TextPiece], Finished]:
    """A generation's pieces and its end; a failure is the request's error."""
    pieces: list[TextPiece] = []
    async with aclosing(events):
        async for event in events:
            if isinstance(event, TextPiece):
                pieces.append(event)
            elif isinstance(event, Finished):
                return pieces, event
            elif isinstance(event, Failed):
                raise RequestError(event.message, status=event.status)
    raise RequestError("the engine stopped before finishing", status=500)


async def whole_text(events: AsyncGenerator[Event, None]) -> tuple[str, Finished]:
    """A generation's whole text and its end (the Responses and Messages APIs' whole answers)."""
    pieces, finished = await whole_pieces(events)
    return "".join(p.text for p in pieces), finished


async def stream_choices(reply: Reply, runs: list[ChoiceRun], include_usage: bool, n: int = 1) -> AsyncGenerator[str, None]:
    """Each choice's chunks in turn; a choice that fails ends the stream after its error."""
    finished: list[Finished] = []
    for run in runs:
        async for line in stream_choice(reply, run, finished):
            yield line
        if len(finished) <= run.index:
            break
    if include_usage and finished:
        yield sse(usage_chunk(reply, finished, n))
    yield sse("[DONE]")


async def stream_choice(reply: Reply, run: ChoiceRun, finished: list[Finished]) -> AsyncGenerator[str, None]:
    offset = 0  # of the next token in the completion text (completions' logprobs.text_offset)
    prompt_ids: tuple[int, ...] | None = run.prompt_ids  # return_token_ids: sent with the first chunk
    generated = 0  # tokens so far (continuous_usage_stats)

    def line(body: dict[str, Any]) -> str:
        if reply.usage_each_chunk:
            body["usage"] = usage_so_far(len(run.prompt_ids), generated)
        return sse(body)

    async with aclosing(run.events):
        if reply.chat:
            first = chunk(reply, {"role": "assistant", "content": ""}, index=run.index)
            yield line(first | ({"prompt_token_ids": list(run.prompt_ids)} if reply.token_ids else {}))
        async for event in run.events:
            if isinstance(event, TextPiece):
                generated += event.tokens
                logprobs = logprobs_body(reply, event.scored, offset)
                ids = token_fields(reply, event.token_ids, prompt_ids) if reply.token_ids else None
                for delta in piece_deltas(reply, event.text, run.shaper, logprobs is not None or ids is not None):
                    yield line(chunk(reply, delta, logprobs=logprobs, index=run.index, ids=ids))
                    logprobs = logprobs_body(reply, (), 0)  # the piece's entries go with its first chunk
                    ids, prompt_ids = (token_fields(reply, (), None) if ids else None), None
                offset += sum(len(s.text) for s in event.scored)
            elif isinstance(event, Finished):
                generated = event.completion_tokens
                for body in finish_chunks(reply, run, event):
                    yield line(body)
                finished.append(event)
            elif isinstance(event, Failed):
                yield sse(error_body(event.message, "invalid_request_error" if event.status < 500 else "server_error"))


def finish_chunks(reply: Reply, run: ChoiceRun, event: Finished) -> list[dict[str, Any]]:
    """What the shaper held back, the tool calls in one delta, then the finish chunk (each with an
    empty token_ids under return_token_ids: the pieces carried them)."""
    parts, calls = run.shaper.finish() if run.shaper else ([], [])
    ids = token_fields(reply, (), None) if reply.token_ids else None
    bodies = [chunk(reply, {field: text}, index=run.index, ids=ids) for field, text in parts]
    if calls:
        wire = [call.wire(i) for i, call in enumerate(calls)]
        bodies.append(chunk(reply, {"tool_calls": wire}, index=run.index, ids=ids))
    finish_reason = run.shaper.calls_finish_reason if calls and run.shaper else event.finish_reason
    last = chunk(reply, {}, finish_reason, index=run.index, ids=ids)
    last["choices"][0]["stop_reason"] = event.stop_reason  # vLLM's, with the finish_reason
    bodies.append(last)
    return bodies


def piece_deltas(reply: Reply, text: str, shaper: AnswerShaper | None, scored: bool) -> list[dict[str, str]]:
    """A text piece's chunk deltas: one, or a chat piece shaped into reasoning and content; a piece
    whose text is all held back still gets one (empty) delta when it carries logprobs."""
    if shaper is None:
        return [text_delta(reply, text)]
    deltas: list[dict[str, str]] = [{field: part} for field, part in shaper.push(text)]
    return deltas or ([text_delta(reply, "")] if scored else [])
