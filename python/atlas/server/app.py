"""The starlette application: routes, the generation flow, and OpenAI-style error answers."""

from __future__ import annotations

import logging
import random
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, TypeVar

import anyio

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route
from starlette.types import Receive, Scope, Send

from ..errors import AtlasError
from ..llm import LLM, GenerateOptions, context_capacity, truncate_prompt
from .answer import AnswerShaper
from .auth import ApiKeyGate
from .cors import CorsPolicy
from .request_ids import RequestIdHeaders
from .choices import ChoiceRun, collect_choices, stream_choices
from .errors import RequestError, error_body, request_error_body
from .paths import route_path
from .protocol import (GenerationBody, Prompt, TokenizeBody, parse_body, parse_detokenize, parse_json_body, parse_sampling,
                       parse_tokenize, with_defaults)
from .reasoning import END as REASONING_END
from .reasoning import START as REASONING_START
from .reasoning import ReasoningSplitter, prompt_opens_reasoning
from .responses import Reply
from . import embeddings, infill, llama_api, messages_api, slot_files
from .background import BackgroundRuns, resume_after
from .beams import SharedSearch
from .response_store import ResponseStore, StoredResponse, item_page, not_found
from .responses_api import (ResponseMeta, ResponseStream, chat_request, input_items, renamed, replayed, stream_response,
                            whole_response)
from .tools import ForcedCallStream, ToolCallStream
from .worker import EngineWorker, Returns

log = logging.getLogger("atlas.serve")
REASONING_TAIL_TOKENS = 32  # of the prompt, where a generation prompt would open a <think> block
MAX_BODY_BYTES = 64 << 20  # a full Qwen3.6 context (262144 ids) in JSON is ~2.1 MB; a batch of 16, ~34 MB
PARSE_INLINE_BYTES = 1 << 18  # larger bodies are parsed in a worker thread
T = TypeVar("T")
Handler = Callable[[Request, "ServerState"], Awaitable[Response]]  # a route's endpoint, given the server's state
COMPLETION_MAX_TOKENS = 16  # /v1/completions without max_tokens: OpenAI's and vLLM's default


@dataclass(frozen=True)
class ServerState:
    model_name: str
    worker: EngineWorker
    llm: LLM
    reasoning_parser: str | None = None  # "qwen3": chat answers' <think> block goes to reasoning_content
    tool_call_parser: str | None = None  # "qwen3_coder": chat requests may carry tools; calls parsed
    api_key: str | None = None  # /v1/* requests must send "Authorization: Bearer <api_key>"
    sampling_defaults: dict[str, float] = field(default_factory=dict)  # for fields a request leaves out (and
    # --reasoning-budget's thinking_token_budget)
    max_waiting: int = 0  # a generation request finding this many waiting gets a 503 (0: no limit)
    responses: ResponseStore = field(default_factory=ResponseStore)  # /v1/responses kept for previous_response_id
    background: BackgroundRuns = field(default_factory=BackgroundRuns)  # /v1/responses generating beside their requests
    cors: CorsPolicy | None = None  # cross-origin requests from browsers (None: no CORS headers)
    seeds: random.Random | None = None  # --seed: a request that gives no seed samples with the next one drawn here
    request_id_headers: bool = False  # --enable-request-id-headers: every response carries X-Request-Id
    aliases: tuple[str, ...] = ()  # further --served-model-name names a request may give (answers say model_name)
    pooling: str = "last"  # --pooling: how an embedding pools the prompt's hidden states (atlas.embed)
    slot_dir: Path | None = None  # --slot-save-path: where POST /slots/0?action=save|restore files go (None: off)

    def served_names(self) -> tuple[str, ...]:
        return (self.model_name, *self.aliases)


class EventStreamResponse(StreamingResponse):
    """Server-sent events whose source is closed however the response ends, so a client that
    goes away mid-stream cancels its generation."""

    def __init__(self, content: AsyncGenerator[str, None]) -> None:
        super().__init__(content, media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
        self.events = content

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self.events.aclose()


def create_app(state: ServerState) -> Starlette:
    def bound(handler: Handler) -> Callable[[Request], Awaitable[Response]]:
        async def endpoint(request: Request) -> Response:
            return await handler(request, state)

        return endpoint

    routes = [Route(path, bound(handler), methods=list(methods)) for path, handler, methods in ROUTES]
    handlers = {RequestError: on_request_error, HTTPException: on_http_error, Exception: on_crash}
    middleware = [Middleware(RequestIdHeaders)] if state.request_id_headers else []  # outermost: every answer has it
    middleware += [state.cors.middleware()] if state.cors else []  # a preflight needs no key
    middleware += [Middleware(ApiKeyGate, key=state.api_key)] if state.api_key else []
    return Starlette(routes=routes, exception_handlers=handlers, middleware=middleware,  # type: ignore[arg-type]
                     lifespan=lambda app: stopping_background(state))


@asynccontextmanager
async def stopping_background(state: ServerState) -> AsyncIterator[None]:
    """At shutdown the background responses still generating stop (stored as cancelled)."""
    yield
    await state.background.cancel_all()


async def completions(request: Request, state: ServerState) -> Response:
    raw = await read_json(request)
    if isinstance(raw, dict) and raw.get("suffix") not in (None, ""):  # OpenAI's fill-in-the-middle (infill.py)
        capacity = context_capacity(state.llm.parts.spec, state.llm.parts.engine)
        tokenizer = state.llm.tokenizer
        raw = await anyio.to_thread.run_sync(
            lambda: infill.suffix_prompts(raw, tokenizer, infill.fim_tokens(tokenizer), capacity))
    return await generation(request, state, chat=False, raw=raw)


async def chat_completions(request: Request, state: ServerState) -> Response:
    return await generation(request, state, chat=True)


async def count_tokens(request: Request, state: ServerState) -> Response:
    """Anthropic's /v1/messages/count_tokens: the prompt a Messages request would run."""
    try:
        chat = messages_api.chat_request(await read_json(request), True, state.llm.tokenizer.template_defaults)
        body = await parsed_body(chat, True, state)
        check_model(state, body.model)
        ids = await anyio.to_thread.run_sync(encode, state.llm, body, None)
    except RequestError as err:
        return messages_api.error_response(err)
    return JSONResponse({"input_tokens": len(ids)})


async def stored_response(request: Request, state: ServerState) -> Response:
    """GET /v1/responses/{id}: a stored response as it was sent, a background one as it stands
    (with ?stream=true its events again); DELETE: forget it (a background one still running stops)."""
    response_id = request.path_params["response_id"]
    running = state.background.running(response_id)
    if request.method == "DELETE":
        if running is not None:
            await running.cancel()
        state.background.forget(response_id)
        if not state.responses.delete(response_id):
            raise not_found(response_id)
        return JSONResponse({"id": response_id, "object": "response", "deleted": True})
    if request.query_params.get("stream") == "true":
        return resumed_events(state, response_id, resume_after(request.query_params))
    if running is not None:
        return JSONResponse(running.snapshot())
    stored = state.responses.get(response_id)
    if stored is None:
        raise not_found(response_id)
    return JSONResponse(stored.body)


def resumed_events(state: ServerState, response_id: str, after: int) -> Response:
    if state.responses.get(response_id) is None:
        raise not_found(response_id)
    run = state.background.get(response_id)
    if run is None or not run.keep_events:
        raise RequestError(f"response {response_id!r} has no events kept: only those of a response created with "
                           f"'background' and 'stream' true are (the newest {state.background.capacity} once "
                           "finished)", "stream")
    return EventStreamResponse(run.follow(after))


async def cancel_response(request: Request, state: ServerState) -> Response:
    """POST /v1/responses/{id}/cancel: a background response still generating stops and is stored as
    cancelled; one already ended is answered as it is."""
    response_id = request.path_params["response_id"]
    running = state.background.running(response_id)
    if running is not None:
        await running.cancel()
    stored = state.responses.get(response_id)
    if stored is None:
        raise not_found(response_id)
    if not stored.body.get("background"):
        raise RequestError(f"response {response_id!r} was not created with 'background' true: only a background "
                           "response can be cancelled")
    return JSONResponse(stored.body)


async def stored_input_items(request: Request, state: ServerState) -> Response:
    """The openai client's responses.input_items.list(id): the items a stored response answered."""
    stored = state.responses.get(request.path_params["response_id"])
    if stored is None:
        raise not_found(request.path_params["response_id"])
    return JSONResponse(item_page(stored.input_items(), request.query_params))


async def models(request: Request, state: ServerState) -> Response:
    cards = [model_card(state, name) for name in state.served_names()]  # OpenAI's list, and Anthropic's page fields
    return JSONResponse({"object": "list", "data": cards, "has_more": False, "first_id": cards[0]["id"],
                         "last_id": cards[-1]["id"]})


async def model(request: Request, state: ServerState) -> Response:
    """The openai client's models.retrieve(id); another id is a 404 as OpenAI answers it."""
    check_model(state, request.path_params["name"])
    return JSONResponse(model_card(state, request.path_params["name"]))


async def health(request: Request, state: ServerState) -> Response:
    ok = state.worker.alive
    body = {"status": "ok" if ok else state.worker.lost or "engine stopped", **engine_settings(state.llm),
            "reasoning_parser": state.reasoning_parser or "off", "tool_call_parser": state.tool_call_parser or "off"}
    return JSONResponse(body, status_code=200 if ok else 503)


async def props(request: Request, state: ServerState) -> Response:
    """llama.cpp's GET /props: the context, the sampling a /completion request that sets none gets
    (the model's generation_config over the server's defaults, under llama.cpp's names), one slot,
    the chat template."""
    from .. import __version__

    capacity, params = llama_settings(state)
    return JSONResponse({"default_generation_settings": {"n_ctx": capacity, "params": params}, "total_slots": 1,
                         "model_alias": state.model_name, "model_path": str(state.llm.model_dir),
                         "chat_template": state.llm.tokenizer.chat_template or "",
                         "modalities": {"vision": False, "audio": False}, "build_info": f"atlas {__version__}"})


async def slots(request: Request, state: ServerState) -> Response:
    """llama.cpp's GET /slots: the one slot, processing while the engine runs a job (a generation,
    search or embedding); with ?fail_on_no_slot=1 a busy slot is a 503, as llama-server answers."""
    job = state.worker.running
    if job is not None and request.query_params.get("fail_on_no_slot") in ("1", "true"):
        raise RequestError("no slot available: the engine is running a request; retry later", None, "unavailable", 503)
    capacity, params = llama_settings(state)
    decoded = job.held_positions - len(job.prompt_ids) if job is not None else 0
    return JSONResponse([{
        "id": 0, "id_task": -1, "n_ctx": capacity, "speculative": not state.llm.speculation.startswith("off"),
        "is_processing": job is not None, "params": params,
        "next_token": {"has_next_token": job is not None, "has_new_line": False, "n_remain": -1,
                       "n_decoded": max(decoded, 0), "stopping_word": ""},
    }])


async def slot_action(request: Request, state: ServerState) -> Response:
    """llama.cpp's POST /slots/{id}?action=save|restore|erase (server/slot_files.py), in turn with
    the generations on the engine thread."""
    action = request.query_params.get("action")
    body = await read_json(request) if action in ("save", "restore") else None
    asked = slot_files.slot_request(request.path_params["slot"], action, state.slot_dir, body)
    directory = state.slot_dir
    assert directory is not None  # slot_request refused the request otherwise
    return JSONResponse(await state.worker.call(lambda llm: slot_files.slot_action(llm, directory, asked)))


def llama_settings(state: ServerState) -> tuple[int, dict[str, Any]]:
    """(the context, the sampling a request that sets none gets, under llama.cpp's names)."""
    capacity = context_capacity(state.llm.parts.spec, state.llm.parts.engine)
    return capacity, llama_api.default_params(parse_sampling(with_defaults({}, state.sampling_defaults)))


async def version(request: Request, state: ServerState) -> Response:
    """vLLM's GET /version: the server's own."""
    from .. import __version__

    return JSONResponse({"version": __version__})


async def metrics(request: Request, state: ServerState) -> Response:
    worker = state.worker
    text = worker.metrics.render(worker.waiting, state.model_name, worker.kv_cache_usage())
    return Response(text, media_type="text/plain; version=0.0.4; charset=utf-8")


async def tokenize(request: Request, state: ServerState) -> Response:
    body = parse_tokenize(await read_json(request))
    check_model(state, body.model)
    ids = await anyio.to_thread.run_sync(tokenize_body, state.llm, body)
    capacity = context_capacity(state.llm.parts.spec, state.llm.parts.engine)
    # the pieces off the event loop too: the first reads the whole vocabulary's bytes (cached after)
    tokens = await anyio.to_thread.run_sync(token_pieces, state.llm, ids) if body.with_pieces else ids
    return JSONResponse({"tokens": tokens, "count": len(ids), "max_model_len": capacity})


def token_pieces(llm: LLM, ids: list[int]) -> list[dict[str, Any]]:
    return [{"id": t, "piece": token_piece(llm, t)} for t in ids]


def token_piece(llm: LLM, token: int) -> str | list[int]:
    """llama.cpp's piece of a token: its text, or its bytes where they are not whole UTF-8."""
    raw = llm.tokenizer.token_bytes[token]
    if raw is None:  # a special token: its text
        return llm.tokenizer.decode([token], skip_special_tokens=False)
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError:
        return list(raw)


async def apply_template(request: Request, state: ServerState) -> Response:
    """llama.cpp's /apply-template: a chat's prompt text through the model's chat template (what
    /tokenize's messages encode), for a client that sends it on as a completions prompt."""
    body = parse_tokenize(await read_json(request))
    if body.messages is None:
        raise RequestError("/apply-template renders 'messages'; a prompt is already text", "messages")
    check_model(state, body.model)
    text = await anyio.to_thread.run_sync(rendered_chat, state.llm, body)
    return JSONResponse({"prompt": text})


async def openai_embeddings(request: Request, state: ServerState) -> Response:
    """OpenAI's and vLLM's /v1/embeddings (server/embeddings.py)."""
    ask = embeddings.openai_request(await read_json(request), state.llm.parts.spec.hidden_size)
    vectors, tokens = await embeddings.embedded(state, ask)
    return JSONResponse(embeddings.openai_answer(ask, vectors, tokens, state.model_name))


async def llama_embedding(request: Request, state: ServerState) -> Response:
    """llama.cpp's /embedding (server/embeddings.py)."""
    vectors, _ = await embeddings.embedded(state, embeddings.llama_request(await read_json(request)))
    return JSONResponse(embeddings.llama_answer(vectors))


async def detokenize(request: Request, state: ServerState) -> Response:
    model_name, tokens = parse_detokenize(await read_json(request), state.llm.parts.spec.vocab_size)
    check_model(state, model_name)
    text = state.llm.tokenizer.decode(tokens)
    return JSONResponse({"prompt": text, "content": text})  # vLLM's name, and llama.cpp's


def engine_settings(llm: LLM) -> dict[str, str]:
    """What the engine flags chose: backend, MTP speculation, KV cache level per full-attention layer,
    prompt cache, prompt tokens per prefill pass."""
    from ..kvcache.options import describe

    plan = getattr(llm.parts.engine, "kv_plan", None)
    cache = getattr(llm.parts.engine, "prompt_cache", None)
    checkpoints = f"{cache.capacity} checkpoints" if cache is not None and cache.enabled else "off"
    passes = getattr(llm.parts.engine, "prefill_chunk", None)
    return {"device": llm.device, "speculation": llm.speculation, "kv_cache": describe(plan) if plan else "default",
            "prompt_cache": checkpoints, "prefill_pass_tokens": str(passes) if passes else "default"}


def model_card(state: ServerState, name: str) -> dict[str, object]:
    """OpenAI's model object for one served name, with vLLM's max_model_len (the context a request
    may fill), and the fields of Anthropic's (the anthropic client's models.list / retrieve)."""
    capacity = context_capacity(state.llm.parts.spec, state.llm.parts.engine)
    return {"id": name, "object": "model", "created": 0, "owned_by": "atlas", "max_model_len": capacity,
            "type": "model", "display_name": name, "created_at": "1970-01-01T00:00:00Z", "max_input_tokens": capacity}


async def invocations(request: Request, state: ServerState) -> Response:
    """vLLM's /invocations (SageMaker's one route): a chat completions body (it has 'messages') or a
    completions body ('prompt'), answered as its own route answers it."""
    raw = await read_json(request)
    kind = [key for key in ("messages", "prompt") if isinstance(raw, dict) and key in raw]
    if len(kind) != 1:
        raise RequestError("/invocations takes a chat completions request (with 'messages') or a completions request "
                           "(with 'prompt'): give exactly one of the two")
    return await generation(request, state, chat=kind[0] == "messages", raw=raw)


async def generation(request: Request, state: ServerState, chat: bool, raw: object = None) -> Response:
    """raw: the body already read (else it is read here)."""
    body = await parsed_body(await read_json(request) if raw is None else raw, chat, state)
    runs = await checked_runs(state, body)
    named = request.headers.get("x-request-id") or body.request_id  # vLLM's: the header wins
    reply = Reply(chat=chat, model=state.model_name, logprobs=body.logprobs is not None,
                  token_ids=body.text.return_token_ids, tokens_as_ids=body.text.tokens_as_ids,
                  usage_each_chunk=body.usage_each_chunk, id=f"{'chatcmpl' if chat else 'cmpl'}-{named}" if named else "")
    if body.stream:
        return EventStreamResponse(stream_choices(reply, runs, body.include_usage, body.n))
    answer = await unless_disconnected(request, collect_choices(reply, runs, body.n))
    return JSONResponse(answer) if answer is not None else Response(status_code=499)


async def parsed_body(raw: Any, chat: bool, state: ServerState) -> GenerationBody:
    """parse_body off the event loop: it compiles the output format (a large schema or grammar
    takes up to a second), which would stall every other connection's stream."""
    return await anyio.to_thread.run_sync(parse_body, raw, chat, state.sampling_defaults)


async def checked_runs(state: ServerState, body: GenerationBody, report_start: bool = False) -> list[ChoiceRun]:
    """The request's choices, every prompt encoded and checked before any runs (report_start: their
    events begin with Started when the engine takes them)."""
    check_model(state, body.model)
    check_room(state)
    check_tools(state, body)
    check_stop_ids(state, body)
    check_logit_bias_ids(state, body)
    inputs = await anyio.to_thread.run_sync(prepare_inputs, state, body)  # templates take a while
    return choice_runs(state, body, inputs, report_start)


async def responses_generation(request: Request, state: ServerState) -> Response:
    """/v1/responses: the request as a chat request, its one answer as a response object."""
    raw = await read_json(request)
    try:
        earlier = state.responses.earlier_items(raw)
        body = await parsed_body(chat_request(raw, earlier), True, state)
        run = (await checked_runs(state, body, report_start=bool(raw.get("background"))))[0]
    except RequestError as err:
        raise renamed(err) from None
    assert isinstance(raw, dict)  # chat_request refused anything else
    meta = ResponseMeta(state.model_name, raw, keep=storing(state, raw, earlier))
    if raw.get("background"):
        return start_background(state, meta, run, body.stream)
    if body.stream:
        return EventStreamResponse(stream_response(ResponseStream(meta, run.shaper), run.events))
    answer = await unless_disconnected(request, whole_response(meta, run.events, run.shaper))
    return JSONResponse(answer) if answer is not None else Response(status_code=499)


async def llama_completion(request: Request, state: ServerState) -> Response:
    """llama.cpp's /completion: the request as a completions request, its one answer in llama-server's shape."""
    return await llama_answer(request, state, llama_api.completion_request(await read_json(request)))


async def llama_infill(request: Request, state: ServerState) -> Response:
    """llama.cpp's /infill: the fill-in-the-middle fields as one prompt of the model's FIM tokens
    (infill.py), cut to leave the answer its n_predict (or a quarter of the context), answered as /completion."""
    raw = await read_json(request)
    fim = infill.fim_tokens(state.llm.tokenizer)
    if fim is None:
        raise RequestError("/infill: this model's vocabulary has no fill-in-the-middle tokens (<|fim_prefix|>, "
                           "<|fim_suffix|>, <|fim_middle|>); use /completion", code="not_supported_error", status=501)
    ask = llama_api.completion_request(raw if not isinstance(raw, dict) else raw | {"prompt": ""})
    parts = infill.infill_parts(raw)
    capacity = context_capacity(state.llm.parts.spec, state.llm.parts.engine)
    room = capacity - (ask.body.get("max_tokens") or capacity // 4)
    built = await anyio.to_thread.run_sync(lambda: infill.infill_prompt(state.llm.tokenizer, fim, parts, room))
    return await llama_answer(request, state, replace(ask, body=ask.body | {"prompt": built.ids}), built.truncated)


async def llama_answer(request: Request, state: ServerState, ask: llama_api.CompletionAsk,
                       truncated: bool = False) -> Response:
    """A /completion-shaped request run, answered in llama-server's shape."""
    try:
        body = replace(await parsed_body(ask.body, False, state), until_context=ask.until_context)
        run = (await checked_runs(state, body))[0]
    except RequestError as err:
        raise llama_api.renamed(err) from None
    prompt = await anyio.to_thread.run_sync(lambda: state.llm.tokenizer.decode(list(run.prompt_ids), skip_special_tokens=False))
    meta = llama_api.CompletionMeta(state.model_name, prompt, len(run.prompt_ids), ask, truncated)
    if body.stream:
        return EventStreamResponse(llama_api.stream_completion(meta, run.events))
    answer = await unless_disconnected(request, llama_api.whole_completion(meta, run.events))
    return JSONResponse(answer) if answer is not None else Response(status_code=499)


async def messages_generation(request: Request, state: ServerState) -> Response:
    """/v1/messages: the request as a chat request, its one answer as an Anthropic message; every
    refusal in Anthropic's error shape."""
    try:
        chat = messages_api.chat_request(await read_json(request), template_defaults=state.llm.tokenizer.template_defaults)
        body = await parsed_body(chat, True, state)
        run = (await checked_runs(state, body))[0]
    except RequestError as err:
        return messages_api.error_response(err)
    meta = messages_api.MessageMeta(state.model_name, len(run.prompt_ids))
    if body.stream:
        return EventStreamResponse(messages_api.stream_message(meta, run.events, run.shaper))
    try:
        answer = await unless_disconnected(request, messages_api.whole_message(meta, run.events, run.shaper))
    except RequestError as err:
        return messages_api.error_response(err)
    return JSONResponse(answer) if answer is not None else Response(status_code=499)


def start_background(state: ServerState, meta: ResponseMeta, run: ChoiceRun, stream: bool) -> Response:
    """The response stored as queued and its generation started beside the request; the answer is
    the queued response, or its events (which go on if the client leaves)."""
    if meta.keep is None:
        raise RequestError("'background': this server stores no responses (--response-store 0), and a "
                           "background one is fetched by its id", "background")
    queued = meta.body("queued", [])
    meta.keep(queued)
    started = state.background.start(ResponseStream(meta, run.shaper, queued=True), run.events, keep_events=stream)
    return EventStreamResponse(started.follow(-1)) if stream else JSONResponse(queued)


def storing(state: ServerState, raw: dict[str, Any], earlier: list[dict[str, Any]]) -> Callable[[dict[str, Any]], None] | None:
    """What keeps a finished response in the store (None: the request says store false, or the
    server keeps none)."""
    if raw.get("store") is False or not state.responses.capacity:
        return None
    conversation = [*earlier, *map(replayed, input_items(raw["input"]))]
    return lambda final: state.responses.put(final["id"], StoredResponse(final, (*conversation, *map(replayed, final["output"]))))


def answer_shaper(state: ServerState, body: GenerationBody, opened: bool) -> AnswerShaper | None:
    """For chat answers under --reasoning-parser (opened: the prompt ends inside a block) and for
    chat requests with tools."""
    calling = bool(body.tools) and body.tool_choice.mode != "none"
    if body.messages is None or (state.reasoning_parser is None and not calling):
        return None
    splitter = ReasoningSplitter(opened) if state.reasoning_parser is not None else None
    calls = ForcedCallStream(body.tool_choice) if body.tool_choice.forced else \
        ToolCallStream(body.tools, body.parallel_tool_calls) if calling and body.tools else None
    return AnswerShaper(splitter, calls)


def opens_reasoning(state: ServerState, body: GenerationBody, prompt_ids: list[int]) -> bool:
    """A chat answer under --reasoning-parser that starts inside the block the prompt opened (the
    generation prompt's, or the continued final message's own unclosed one)."""
    if body.messages is None or state.reasoning_parser is None:
        return False
    if body.text.continue_final_message:
        final = body.messages[-1]["content"]
        return final.rfind(REASONING_START) > final.rfind(REASONING_END)
    tail = state.llm.tokenizer.decode(prompt_ids[-REASONING_TAIL_TOKENS:], skip_special_tokens=False)
    return prompt_opens_reasoning(tail)


@dataclass(frozen=True)
class PromptInput:
    """One prompt of a request, encoded and checked against the context."""

    ids: list[int]
    opts: GenerateOptions
    echo: str | None  # the text sent back under echo
    opened: bool  # the answer starts inside the reasoning block the prompt opened (opens_reasoning)


def prepare_inputs(state: ServerState, body: GenerationBody) -> list[PromptInput]:
    """Every prompt of the request (a chat's one, a completions batch) encoded and checked, so a
    bad one fails the request before any runs."""
    prompts: list[Prompt | None] = list(body.prompts) if body.prompts is not None else [None]
    inputs = []
    capacity = context_capacity(state.llm.parts.spec, state.llm.parts.engine)
    keep = body.text.truncate_prompt_tokens
    if keep is not None and keep > capacity:  # as vLLM: a cut the context cannot hold is a mistake
        raise RequestError(f"'truncate_prompt_tokens' {keep} is more than the context holds ({capacity}); lower it, "
                           "or -1 for as many as fit", "truncate_prompt_tokens")
    for prompt in prompts:
        encoded = encode(state.llm, body, prompt)
        ids = truncate_prompt(encoded, body.text.truncate_prompt_tokens, capacity)
        opened = opens_reasoning(state, body, ids)
        opts = generate_options(state, body, len(ids), opened)
        try:
            state.llm.prepare(ids, opts)
        except AtlasError as err:
            raise RequestError(str(err), "prompt" if prompt is not None else "messages") from None
        whole = isinstance(prompt, str) and len(ids) == len(encoded)  # the prompt as sent, not cut by truncation
        echo = (prompt if whole else state.llm.tokenizer.decode(ids)) if body.echo else None
        inputs.append(PromptInput(ids, opts, echo, opened))
    return inputs


def choice_runs(state: ServerState, body: GenerationBody, inputs: list[PromptInput], report_start: bool = False) -> list[ChoiceRun]:
    """n runs per prompt, in order; choice i (index prompt x n + j) samples with seed + i, so a
    seeded request stays reproducible (one without a seed takes the next of --seed's stream, so a
    server given --seed answers the same requests in the same order alike). The first of a
    prompt's runs scores it for prompt_logprobs (collect_choices hands the list to the others)."""
    if body.beam_search:
        return [run for p, prompt in enumerate(inputs) for run in beam_runs(state, body, prompt, p)]
    runs = []
    drawn = None if state.seeds is None else state.seeds.randrange(1 << 31)
    for p, prompt in enumerate(inputs):
        base = drawn if prompt.opts.seed is None else prompt.opts.seed
        for j in range(body.n):
            index = p * body.n + j
            seeded = replace(prompt.opts, seed=None if base is None else base + index)
            if j:
                seeded = replace(seeded, prompt_logprobs=echo_scores(body, seeded.max_tokens))
            returns = Returns(prompt.echo, None if j else body.prompt_logprobs, body.text.return_token_ids, report_start)
            events = state.worker.events(prompt.ids, seeded, returns)
            runs.append(ChoiceRun(index, events, answer_shaper(state, body, prompt.opened), tuple(prompt.ids)))
    return runs


def beam_runs(state: ServerState, body: GenerationBody, prompt: PromptInput, p: int) -> list[ChoiceRun]:
    """vLLM's use_beam_search: one search for the prompt, its n best beams the n choices."""
    from ..beam_search import BeamSearchParams

    opts = prompt.opts
    assert opts.max_tokens is not None  # generate_options always sets it
    params = BeamSearchParams(beam_width=body.n, max_tokens=opts.max_tokens, ignore_eos=opts.ignore_eos,
                              temperature=opts.temperature, length_penalty=body.length_penalty)
    search = SharedSearch(state.worker.events(prompt.ids, opts, beam=params), len(prompt.ids))
    return [ChoiceRun(p * body.n + j, search.choice(j), answer_shaper(state, body, prompt.opened), tuple(prompt.ids))
            for j in range(body.n)]


def check_room(state: ServerState) -> None:
    """A request that would wait behind --max-waiting others is turned away now, with a 503 and
    Retry-After (the openai client retries it), instead of waiting past every client's timeout."""
    if not state.max_waiting:
        return
    waiting = state.worker.waiting
    if waiting >= state.max_waiting:
        state.worker.metrics.rejected()
        raise RequestError(
            f"the server is busy: {waiting} requests are waiting (--max-waiting {state.max_waiting}); retry later",
            None, "server_busy", status=503,
        )


def check_model(state: ServerState, model: str) -> None:
    """A request that names no model ("") gets the served one, and another name is a 404, as
    vLLM and OpenAI answer."""
    if model and model not in state.served_names():
        raise RequestError(
            f"model {model!r} is not served here; use {' or '.join(map(repr, state.served_names()))} (see /v1/models)",
            "model", "model_not_found", 404,
        )


def template_extras(body: TokenizeBody | GenerationBody) -> dict[str, object]:
    """What the chat template sees beside the messages: chat_template_kwargs, and the tools."""
    return {**(body.template_kwargs or {}), **({"tools": body.tools} if body.tools else {})}


def rendered_chat(llm: LLM, body: TokenizeBody) -> str:
    assert body.messages is not None
    try:
        return llm.tokenizer.render_chat(body.messages, body.add_generation_prompt, template_extras(body),
                                         body.continue_final_message)
    except AtlasError as err:
        raise RequestError(str(err), "messages") from None


def tokenize_body(llm: LLM, body: TokenizeBody) -> list[int]:
    if body.messages is not None:  # the rendered chat holds its special tokens
        return llm.tokenizer.encode(rendered_chat(llm, body), add_special_tokens=False)
    assert body.prompt is not None
    try:
        return llm.tokenizer.encode(body.prompt, add_special_tokens=body.add_special_tokens)
    except AtlasError as err:
        raise RequestError(str(err), "prompt") from None


def check_stop_ids(state: ServerState, body: GenerationBody) -> None:
    vocab = state.llm.parts.spec.vocab_size
    for param, ids in (("stop_token_ids", body.sampling.stop_token_ids), ("allowed_token_ids", body.sampling.allowed_token_ids)):
        bad = [t for t in ids or () if t >= vocab]
        if bad:
            raise RequestError(f"token id {bad[0]} in '{param}' is outside the vocabulary (0..{vocab - 1})", param)


def check_logit_bias_ids(state: ServerState, body: GenerationBody) -> None:
    from ..backends.base import SamplingParams
    from ..sampling import check_logit_bias_ids as check_ids

    try:
        check_ids(SamplingParams(logit_bias=body.sampling.extras.logit_bias), state.llm.parts.spec.vocab_size)
    except AtlasError as err:
        raise RequestError(str(err), "logit_bias") from None


def check_tools(state: ServerState, body: GenerationBody) -> None:
    if body.tools and body.tool_choice.mode != "none" and state.tool_call_parser is None:
        raise RequestError("this server parses no tool calls; start it with --tool-call-parser qwen3_coder, "
                           "or leave 'tools' out", "tools")


async def read_json(request: Request) -> object:
    raw = await read_body(request)
    if len(raw) < PARSE_INLINE_BYTES:
        return parse_json_body(raw)
    return await anyio.to_thread.run_sync(parse_json_body, raw)  # seconds for tens of MiB: off the event loop


async def read_body(request: Request) -> bytes:
    """The body, refused with a 413 once it passes MAX_BODY_BYTES (by its Content-Length, or while
    it streams in), so no request can make the server hold gigabytes."""
    too_large = RequestError(f"the request body exceeds {MAX_BODY_BYTES / 2**20:g} MiB; send a shorter prompt",
                             code="request_too_large", status=413)
    declared = request.headers.get("content-length", "")
    if declared.isascii() and declared.isdigit() and int(declared) > MAX_BODY_BYTES:
        raise too_large
    chunks, size = [], 0
    try:
        async for chunk in request.stream():
            size += len(chunk)
            if size > MAX_BODY_BYTES:
                raise too_large
            chunks.append(chunk)
    except ClientDisconnect:  # gone while sending: nobody to answer, nothing to log as a fault
        raise RequestError("the client closed the connection while sending the body", status=499) from None
    return b"".join(chunks)


def encode(llm: LLM, body: GenerationBody, prompt: Prompt | None) -> list[int]:
    """A chat's messages (prompt None) or one completions prompt -> token ids."""
    param = "messages" if body.messages is not None else "prompt"
    try:
        if body.messages is not None:
            ids = llm.tokenizer.encode_chat(body.messages, body.text.add_generation_prompt, template_extras(body),
                                            body.text.continue_final_message)
        elif isinstance(prompt, str):
            ids = llm.tokenizer.encode(prompt)
        else:
            ids = list(prompt or [])
    except AtlasError as err:  # the chat template's failure, text that is not valid Unicode
        raise RequestError(str(err), param) from None
    if not ids:
        raise RequestError("the prompt encodes to no tokens; give some text", "prompt")
    return ids


def generate_options(state: ServerState, body: GenerationBody, prompt_tokens: int, opened: bool) -> GenerateOptions:
    """Every new token but the last takes a position after the prompt's. Structured output in an
    answer that starts inside a reasoning block (opened) starts after the block (as vLLM's
    structured output under a reasoning parser)."""
    capacity = context_capacity(state.llm.parts.spec, state.llm.parts.engine)
    room = capacity - prompt_tokens + 1  # the most new tokens that fit
    prompt_param = "prompt" if body.prompts is not None else "messages"
    if room < 1:
        raise RequestError(
            f"the prompt has {prompt_tokens} tokens but this model's context holds {capacity}; "
            "shorten it", prompt_param, "context_length_exceeded",
        )
    wanted = body.sampling.max_tokens
    if wanted is not None and wanted > room:
        raise RequestError(
            f"max_tokens {wanted} does not fit: the prompt has {prompt_tokens} tokens and the "
            f"context holds {capacity}, so at most {room} new tokens; lower max_tokens",
            "max_tokens", "context_length_exceeded",
        )
    s = body.sampling
    if s.extras.min_tokens > room:
        raise RequestError(
            f"min_tokens {s.extras.min_tokens} does not fit: the prompt has {prompt_tokens} tokens and the "
            f"context holds {capacity}, so at most {room} new tokens; lower min_tokens",
            "min_tokens", "context_length_exceeded",
        )
    # no max_tokens: as vLLM, the rest of the context for a chat (a thinking model's answer is not
    # cut at an arbitrary length), OpenAI's 16 for a completion; more where min_tokens asks for it
    default = room if body.messages is not None or body.until_context else COMPLETION_MAX_TOKENS
    max_tokens = wanted if wanted is not None else min(max(default, s.extras.min_tokens), room)
    scored = [body.prompt_logprobs, echo_scores(body, max_tokens)]
    prompt_logprobs = max((top for top in scored if top is not None), default=None)
    output = body.output
    if output is not None and opened:
        output = replace(output, after=REASONING_END)
    return GenerateOptions(max_tokens, s.temperature, s.top_k, s.top_p, s.seed, logprobs=body.logprobs,
                           prompt_logprobs=prompt_logprobs, extras=s.extras, output=output,
                           skip_special_tokens=body.text.skip_special_tokens,
                           include_stop_str_in_output=body.text.include_stop_str_in_output,
                           allowed_token_ids=s.allowed_token_ids, bad_words=s.bad_words,
                           thinking_token_budget=s.thinking_token_budget, ignore_eos=s.ignore_eos,
                           stop=s.stop, stop_token_ids=s.stop_token_ids)


def echo_scores(body: GenerationBody, max_tokens: int) -> int | None:
    """The alternatives echo lists for each prompt token: echo with logprobs scores the prompt;
    max_tokens 0 runs only the prompt."""
    return (body.logprobs or 0) if body.echo and (body.logprobs is not None or max_tokens == 0) else None


async def unless_disconnected(request: Request, work: Awaitable[T]) -> T | None:
    """Await work, cancelling it (and so its generation) if the client goes away first."""
    result: T | None = None
    error: Exception | None = None  # raised after the group, which would wrap it in a group
    async with anyio.create_task_group() as group:

        async def watch() -> None:
            while (await request.receive())["type"] != "http.disconnect":
                pass
            group.cancel_scope.cancel()

        group.start_soon(watch)
        try:
            result = await work
        except Exception as err:  # noqa: BLE001 - re-raised below
            error = err
        group.cancel_scope.cancel()
    if error is not None:
        raise error
    return result


async def on_request_error(request: Request, err: Exception) -> Response:
    assert isinstance(err, RequestError)
    return JSONResponse(request_error_body(err), status_code=err.status, headers=err.headers)


def shaped_error(request: Request, message: str, status: int) -> dict[str, Any]:
    """OpenAI's error body, or Anthropic's under /v1/messages (its clients read that shape)."""
    if messages_api.is_messages_path(route_path(request.scope)):
        return messages_api.error_body(message, status)
    return error_body(message, "invalid_request_error" if status < 500 else "server_error")


async def on_http_error(request: Request, err: Exception) -> Response:
    assert isinstance(err, HTTPException)
    message = f"{request.method} {request.url.path}: {err.detail}"
    return JSONResponse(shaped_error(request, message, err.status_code), status_code=err.status_code, headers=err.headers)


async def on_crash(request: Request, err: Exception) -> Response:
    log.error("internal error on %s %s: %r", request.method, request.url.path, err)
    return JSONResponse(shaped_error(request, f"internal server error: {type(err).__name__}", 500), 500)


ROUTES: tuple[tuple[str, Handler, tuple[str, ...]], ...] = (
    ("/health", health, ("GET",)),
    ("/ping", health, ("GET", "POST")),  # vLLM's (SageMaker's probe): /health's answer
    ("/tokenize", tokenize, ("POST",)),
    ("/detokenize", detokenize, ("POST",)),
    ("/apply-template", apply_template, ("POST",)),  # llama.cpp's
    ("/invocations", invocations, ("POST",)),  # vLLM's (SageMaker's): by the body, chat or text completions
    ("/completion", llama_completion, ("POST",)),  # llama.cpp's own API, and its alias
    ("/completions", llama_completion, ("POST",)),
    ("/infill", llama_infill, ("POST",)),  # llama.cpp's
    ("/props", props, ("GET",)),  # llama.cpp's
    ("/slots", slots, ("GET",)),  # llama.cpp's
    ("/slots/{slot}", slot_action, ("POST",)),  # llama.cpp's
    ("/embedding", llama_embedding, ("POST",)),  # llama.cpp's, and its alias
    ("/embeddings", llama_embedding, ("POST",)),
    ("/v1/embeddings", openai_embeddings, ("POST",)),
    ("/metrics", metrics, ("GET",)),
    ("/version", version, ("GET",)),
    ("/v1/models", models, ("GET",)),
    ("/v1/models/{name:path}", model, ("GET",)),
    ("/v1/completions", completions, ("POST",)),
    ("/v1/chat/completions", chat_completions, ("POST",)),
    ("/v1/responses", responses_generation, ("POST",)),
    ("/v1/responses/{response_id}", stored_response, ("GET", "DELETE")),
    ("/v1/responses/{response_id}/input_items", stored_input_items, ("GET",)),
    ("/v1/responses/{response_id}/cancel", cancel_response, ("POST",)),
    ("/v1/messages", messages_generation, ("POST",)),
    ("/v1/messages/count_tokens", count_tokens, ("POST",)),
)
