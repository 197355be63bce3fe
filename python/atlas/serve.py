"""`python -m atlas.serve`: an OpenAI-compatible HTTP server for one model.

Routes: /v1/models, /v1/completions, /v1/chat/completions (`stream: true` as server-sent events),
/v1/responses (OpenAI's Responses API, server/responses_api.py), /health, /metrics, /tokenize,
/detokenize. The engine flags (--device, --spec-k / --no-spec, --kv-cache-dtype,
--kv-high-precision-layers, --chat-template, --chat-template-kwargs, --hf-overrides, --max-seq-len,
--check-weights) are atlas.run's (engine_flags.py); --prompt-cache (atlas.prompt_cache),
--max-waiting (the queue's bound: server/app.py check_room), --response-store
(server/response_store.py), the CORS flags (server/cors.py) and HTTPS's (server/tls.py) are
the server's. Bad flags, models or addresses print one line on stderr and exit with code 2.
"""

from __future__ import annotations

import os
import random
import socket
import sys
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

import click

from .cli import run_command
from .engine_flags import EngineFlags, engine_options
from .vllm_flags import VllmFlags, vllm_options
from .errors import AtlasError
from .embed import POOLINGS
from .llm import DEFAULT_PROMPT_CACHE, MAX_PROMPT_CACHE
from .run import MODEL_HELP
from .server.reasoning import PARSERS
from .server.cors import CorsPolicy, cors_policy
from .server.response_store import DEFAULT_RESPONSE_STORE, ResponseStore
from .server.tls import TlsFiles
from .server.tools import PARSERS as TOOL_PARSERS

if TYPE_CHECKING:
    from .llm import LLM

GRACEFUL_SHUTDOWN_S = 5
LISTEN_BACKLOG = 2048  # uvicorn's default
API_KEY_ENV = ("ATLAS_API_KEY", "VLLM_API_KEY")  # vLLM's variable too: a vLLM deployment's key keeps guarding
DEFAULT_MAX_WAITING = 64  # the next request waiting gets a 503: at batch 1 the queue drains one by one


@dataclass(frozen=True)
class ServeArgs:
    model: str | None
    host: str
    port: int
    served_model_name: tuple[str, ...]  # the names requests may give; the first names the answers
    log_level: str
    reasoning_parser: str | None
    tool_call_parser: str | None
    api_key: str | None
    generation_config: str  # "auto": requests' sampling defaults from generation_config.json; "vllm": none; a folder's
    override_generation_config: str | None  # JSON object: sampling defaults over those (vLLM's flag)
    max_waiting: int  # generation requests queued behind the running one before a 503 (0: no limit)
    response_store: int  # /v1/responses kept for previous_response_id and GET (0: none)
    reasoning_budget: int  # a request's thinking_token_budget when it gives none (-1: no cap)
    cors: CorsPolicy  # browsers' cross-origin requests (server/cors.py)
    tls: TlsFiles  # HTTPS when it holds a certificate (server/tls.py)
    seed: int | None  # requests without a seed draw theirs from a stream seeded by it (vLLM's --seed)
    disable_uvicorn_access_log: bool  # no log line per request (vLLM's flag)
    enable_request_id_headers: bool  # every response carries X-Request-Id (vLLM's flag)
    root_path: str  # the prefix a path-routing proxy serves the app under and strips (vLLM's --root-path)
    pooling: str  # how /v1/embeddings and /embedding pool a prompt's hidden states (atlas.embed)
    slot_save_path: str | None  # POST /slots/0?action=save|restore files go here (llama.cpp's flag; None: off)
    engine: EngineFlags


def served_name(model_arg: str | None, model_dir: Path) -> str:
    """The demo's registry name, else the --model argument as given (a repo id or a path)."""
    from .demo import DEMO_DIR, DEMO_NAME

    if model_arg is None or model_dir.resolve() == DEMO_DIR.resolve():
        return DEMO_NAME
    return model_arg


def engine_summary(llm: LLM) -> str:
    from .server.app import engine_settings

    settings = engine_settings(llm)
    return f"speculation {settings['speculation']}; kv cache {settings['kv_cache']}; prompt cache {settings['prompt_cache']}"


def seed_stream(seed: int | None) -> random.Random | None:
    """--seed: the stream seedless requests draw their seeds from (None: each draws fresh entropy)."""
    return None if seed is None else random.Random(seed)


def listen_socket(host: str, port: int) -> socket.socket:
    """Bind and listen before the weights load, so a taken port fails at once and in one line, and
    a client told 'listening on' is not refused before uvicorn runs."""
    if not host.strip():
        raise AtlasError("--host is empty; give an address to listen on, e.g. 127.0.0.1 (0.0.0.0: every interface)")
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
        family, kind, proto, _, address = infos[0]
        sock = socket.socket(family, kind, proto)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(address)
        sock.listen(LISTEN_BACKLOG)  # connections wait in the backlog until uvicorn accepts them
    except OSError as err:
        raise AtlasError(f"cannot listen on {host}:{port} ({err.strerror or err}); pick another --host/--port") from None
    except (UnicodeError, ValueError) as err:  # a host name no resolver takes (a label past 63 bytes, "a..b")
        raise AtlasError(f"--host {host[:80]} is not a host name or address ({err}); give e.g. 127.0.0.1") from None
    return sock


def serve(args: ServeArgs) -> None:
    import uvicorn

    from .generation_defaults import GenerationDefaults
    from .server.app import ServerState, create_app
    from .server.slot_files import check_slot_dir
    from .server.worker import EngineWorker

    args.engine.check()
    # click takes an empty ATLAS_API_KEY for unset: `ATLAS_API_KEY=$UNSET` would serve with no key
    keys = [args.api_key] if args.api_key is not None else [os.environ.get(name) for name in API_KEY_ENV]
    if any(key is not None and not key.strip() for key in keys):
        raise AtlasError(f"--api-key (or {' / '.join(API_KEY_ENV)}) is empty; give a key or leave it out")
    if any(not name.strip() for name in args.served_model_name):
        raise AtlasError("--served-model-name is empty; give a name or leave the flag out")
    check_root_path(args.root_path)
    slot_dir = check_slot_dir(args.slot_save_path)
    args.tls.check()
    generation = GenerationDefaults(args.generation_config, args.override_generation_config)
    generation.check()
    model_dir = args.engine.resolve(args.model)
    sock = listen_socket(args.host, args.port)
    worker = EngineWorker(lambda: args.engine.load(str(model_dir)))
    try:
        llm = worker.start()
        name, *aliases = args.served_model_name or (served_name(args.model, model_dir),)
        click.echo(f"atlas.serve: model {name} ({model_dir}), device {llm.device}", err=True)
        click.echo(f"atlas.serve: {engine_summary(llm)}", err=True)
        parsers = {"reasoning_parser": args.reasoning_parser, "tool_call_parser": args.tool_call_parser}
        defaults = generation.resolve(llm.parts.spec.sampling_defaults)
        if defaults:
            listed = ", ".join(f"{k} {v:g}" for k, v in defaults.items())
            click.echo(f"atlas.serve: sampling defaults from {generation.describe()}: {listed} "
                       "(requests override them; --generation-config vllm: none)", err=True)
        if args.reasoning_budget >= 0:
            defaults["thinking_token_budget"] = args.reasoning_budget  # an int: parse_body checks it as a request's
            click.echo(f"atlas.serve: reasoning blocks closed after {args.reasoning_budget} tokens "
                       "(a request's thinking_token_budget or thinking.budget_tokens overrides it)", err=True)
        app = create_app(ServerState(name, worker, llm, **parsers, api_key=args.api_key, sampling_defaults=defaults,
                                     max_waiting=args.max_waiting, responses=ResponseStore(args.response_store),
                                     cors=args.cors, seeds=seed_stream(args.seed),
                                     request_id_headers=args.enable_request_id_headers, aliases=tuple(aliases),
                                     pooling=args.pooling, slot_dir=slot_dir))
        config = uvicorn.Config(app, log_level=args.log_level, timeout_graceful_shutdown=GRACEFUL_SHUTDOWN_S,
                                access_log=not args.disable_uvicorn_access_log, root_path=args.root_path.rstrip("/"),
                                **args.tls.uvicorn_options())
        host, port = sock.getsockname()[:2]
        scheme = "https" if args.tls.enabled else "http"
        click.echo(f"atlas.serve: listening on {scheme}://{host}:{port}/v1", err=True)
        uvicorn.Server(config).run(sockets=[sock])
    finally:
        worker.stop()
        sock.close()


def check_root_path(root_path: str) -> None:
    if root_path and (not root_path.startswith("/") or any(c in root_path for c in "?# \t\r\n")):
        raise AtlasError(f"--root-path {root_path[:80]!r} is not a URL path; give one such as /atlas (or leave it out)")


@click.command(context_settings={"help_option_names": ["-h", "--help"]})
@click.option("--model", default=None, help=MODEL_HELP)
@click.option("--host", default="127.0.0.1", show_default=True, help="Address to listen on.")
@click.option("--port", type=click.IntRange(0, 65535), default=8000, show_default=True)
@click.option("--served-model-name", multiple=True,
              help="The model id clients send (default: atlas-demo or --model); several (vLLM's `--served-model-name A B`): "
              "any of them is taken, the first names the answers.")
@click.option(
    "--log-level", "--uvicorn-log-level", "log_level", type=click.Choice(["critical", "error", "warning", "info", "debug"]),
    default="info", show_default=True, help="The server's log level (--uvicorn-log-level: vLLM's name).",
)
@click.option(
    "--reasoning-parser", type=click.Choice(PARSERS), default=None,
    help="Chat answers' <think> ... </think> block goes to message.reasoning_content (as vLLM's); default: left in content.",
)
@click.option(
    "--api-key", envvar=list(API_KEY_ENV), default=None,
    help="Require 'Authorization: Bearer KEY' (or 'x-api-key: KEY') on every route but /health, /ping, /metrics and /version "
    "(env ATLAS_API_KEY, or vLLM's VLLM_API_KEY).",
)
@click.option(
    "--tool-call-parser", type=click.Choice(TOOL_PARSERS), default=None,
    help="Chat requests may carry tools (tool_choice auto / none / required / a function); the answer's calls come "
    "back as tool_calls (qwen3_coder: the XML calls of Qwen3.5 / 3.6 and Qwen3-Coder).",
)
@click.option(
    "--generation-config", default="auto", show_default=True,
    help="auto: sampling fields a request leaves out (temperature, top_p, top_k, min_p, repetition_penalty) take the "
    "model's generation_config.json values, as vLLM's default; vllm: OpenAI's defaults; a folder: its "
    "generation_config.json's.",
)
@click.option(
    "--override-generation-config", default=None,
    help="""A JSON object of sampling defaults over --generation-config's, e.g. '{"temperature": 0.6}' (vLLM's flag).""",
)
@click.option(
    "--prompt-cache", "--ctx-checkpoints", "prompt_cache", type=click.IntRange(0, MAX_PROMPT_CACHE),
    default=DEFAULT_PROMPT_CACHE, show_default=True,
    help="Checkpoints of the prompt cache: a request whose prompt starts like an earlier one's (a chat's next turn) "
    "resumes after the shared tokens; each holds a copy of the DeltaNet states. 0: off. (--ctx-checkpoints is "
    "llama-server's name for these checkpoints of a recurrent model's state.)",
)
@click.option(
    "--max-waiting", type=click.IntRange(min=0), default=DEFAULT_MAX_WAITING, show_default=True,
    help="Generation requests that may wait behind the running one; one more gets a 503 with Retry-After "
    "(the openai client retries it). 0: no limit.",
)
@click.option(
    "--response-store", type=click.IntRange(min=0), default=DEFAULT_RESPONSE_STORE, show_default=True,
    help="/v1/responses answers kept in memory (the newest), for previous_response_id and GET /v1/responses/{id}; "
    "a request with store false is not kept. 0: none.",
)
@click.option(
    "--reasoning-budget", type=click.IntRange(min=-1), default=-1, show_default=True,
    help="A thinking model's reasoning block gets at most this many tokens, then is closed for it, in requests that "
    "set no thinking_token_budget (-1: no cap; llama.cpp's flag).",
)
@click.option("--allowed-origins", default='["*"]', show_default=True,
              help="CORS: origins whose web pages may call the server, a JSON list (vLLM's flag).")
@click.option("--allowed-methods", default='["*"]', show_default=True, help="CORS: allowed methods, a JSON list.")
@click.option("--allowed-headers", default='["*"]', show_default=True, help="CORS: allowed headers, a JSON list.")
@click.option("--allowed-credentials", is_flag=True, help="CORS: allow cookies and credentials.")
@click.option("--ssl-certfile", default=None, help="HTTPS: the server's PEM certificate (it may hold the key too).")
@click.option("--ssl-keyfile", default=None, help="HTTPS: the certificate's PEM private key.")
@click.option("--ssl-ca-certs", default=None, help="HTTPS: PEM CA certificates that client certificates are checked against.")
@click.option("--ssl-cert-reqs", type=click.IntRange(0, 2), default=0, show_default=True,
              help="HTTPS: client certificates 0: not asked for, 1: optional, 2: required (vLLM's).")
@click.option("--seed", type=click.IntRange(min=0), default=None,
              help="Requests that give no seed sample with seeds drawn from a stream seeded by this, so the same "
              "requests in the same order get the same answers (vLLM's flag; default: fresh entropy).")
@click.option("--disable-uvicorn-access-log", is_flag=True, help="No log line per request (vLLM's flag).")
@click.option("--root-path", default="",
              help="The path prefix a proxy serves the server under and strips from requests, e.g. /atlas (vLLM's flag).")
@click.option("--enable-request-id-headers", is_flag=True,
              help="Every response carries X-Request-Id: the client's, else a new one that also names the answer "
              "(vLLM's flag).")
@click.option("--pooling", type=click.Choice(POOLINGS), default="last", show_default=True,
              help="How /v1/embeddings and /embedding pool a prompt's final hidden states: the last token's (vLLM's "
              "default for decoder models) or their mean (llama.cpp's flag).")
@click.option("--slot-save-path", default=None,
              help="A directory for POST /slots/0?action=save|restore: the slot's sequence (a chat so far: KV rows "
              "and DeltaNet states) saved to a file there and put back later, also by a restarted server "
              "(llama.cpp's flag; made when missing; default: slot actions off).")
@engine_options
@vllm_options
def command(**kwargs: Any) -> None:
    """Serve a model over the OpenAI HTTP API (and Anthropic's Messages API); vLLM's `vllm serve`
    flags are taken too."""
    vllm = VllmFlags.pop_from(kwargs)
    kwargs["model"] = vllm.model(kwargs["model"])
    vllm.check(kwargs["tool_call_parser"])
    engine = vllm.engine(EngineFlags.pop_from(kwargs))
    engine = replace(engine, prompt_cache=vllm.prompt_cache(engine.prompt_cache))
    for note in vllm.notes():
        click.echo(f"atlas.serve: {note}", err=True)
    cors = cors_policy(*(kwargs.pop(f"allowed_{name}") for name in ("origins", "methods", "headers", "credentials")))
    tls = TlsFiles(*(kwargs.pop(f"ssl_{name}") for name in ("keyfile", "certfile", "ca_certs", "cert_reqs")))
    serve(ServeArgs(**kwargs, cors=cors, tls=tls, engine=engine))


def main(argv: list[str] | None = None, usage: str | None = None) -> int:
    """Entry point; returns the exit code."""
    return run_command(command, spread_names(sys.argv[1:] if argv is None else argv), "atlas.serve", quiet_interrupt=True,
                       usage=usage)


def spread_names(argv: list[str]) -> list[str]:
    """vLLM's `--served-model-name A B ...` (argparse takes every word up to the next flag) as the
    option repeated, as click takes it."""
    out: list[str] = []
    taken: int | None = None  # names after the flag so far; None: not after it
    for arg in argv:
        if arg == "--served-model-name":
            taken = 0
        elif taken is not None and not arg.startswith("-"):
            out += ["--served-model-name"] if taken else []
            taken += 1
        else:
            taken = None
        out.append(arg)
    return out


if __name__ == "__main__":
    sys.exit(main())
