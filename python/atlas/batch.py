"""`python -m atlas.batch -i requests.jsonl -o results.jsonl`: OpenAI's batch file format run offline,
as vLLM's run-batch runs it. Each input line is {"custom_id", "method": "POST", "url", "body"} for
/v1/chat/completions, /v1/completions or /v1/responses; each output line, in the input's order,
is {"id", "custom_id", "response": {"status_code", "request_id", "body"}, "error": null}, the body
what atlas.serve answers the same request (the server's app runs in this process, no socket: the
same parsers, defaults and checks). A request the server refuses keeps its 4xx status and error
body; a line that is not a request (not JSON, a missing custom_id, another url or method, a
stream) gets "response": null and "error": {"code", "message"}, and the batch goes on.

The output is written to a scratch file beside it and renamed at the end: an interrupted or failed
run leaves no partial file. A missing or unreadable input, an output directory that does not exist
or an input with no lines is one line, exit 2."""

from __future__ import annotations

import json
import sys
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import click

from .cli import run_command
from .dump import atomic_path, check_writable
from .engine_flags import EngineFlags, engine_options
from .errors import AtlasError
from .run import MODEL_HELP
from .json_text import utf8_clean
from .server.reasoning import PARSERS
from .server.tools import PARSERS as TOOL_PARSERS
from . import json_text

URLS = ("/v1/chat/completions", "/v1/completions", "/v1/responses")
NOT_IN_A_BATCH = ("stream", "background")  # fields a batch line must leave out (or false)


@dataclass(frozen=True)
class BatchArgs:
    input_file: str
    output_file: str
    model: str | None
    served_model_name: str | None
    reasoning_parser: str | None
    tool_call_parser: str | None
    generation_config: str  # as atlas.serve's: auto, vllm or a folder
    override_generation_config: str | None
    seed: int | None  # requests without a seed draw theirs from a stream seeded by it (as atlas.serve's)
    engine: EngineFlags


class LineError(Exception):
    """A line that is not a batch request: (code, message) in its output's error."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code


def read_lines(path: str) -> list[str]:
    """The input's non-blank lines ('-': stdin), split at line feeds only (JSON strings may hold
    U+2028 and the like raw)."""
    try:
        text = sys.stdin.read() if path == "-" else Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as err:
        raise AtlasError(f"--input-file {path} cannot be read as UTF-8 text ({err})") from None
    lines = [line.rstrip("\r") for line in text.split("\n") if line.strip()]
    if not lines:
        raise AtlasError(f"--input-file {path} holds no requests: give one JSON request a line")
    return lines


def parse_line(line: str, seen: set[str], out: dict[str, Any]) -> tuple[str, bytes]:
    """(url, body as JSON bytes) of a request line, its custom_id put in `out` as soon as read
    (seen: the earlier lines' custom_ids, which it must not repeat); or LineError."""
    try:
        request = json_text.loads(line)
    except ValueError as err:
        raise LineError("invalid_json", f"the line is not JSON ({err})") from None
    if not isinstance(request, dict):
        raise LineError("invalid_request", "the line must be a JSON object with custom_id, method, url and body")
    custom_id = request.get("custom_id")
    if not isinstance(custom_id, str) or not custom_id:
        raise LineError("missing_custom_id", "the request needs a non-empty string custom_id")
    if not utf8_clean(custom_id):
        raise LineError("missing_custom_id", "custom_id holds an unpaired UTF-16 surrogate; send UTF-8 text")
    out["custom_id"] = custom_id
    if custom_id in seen:
        raise LineError("duplicate_custom_id", f"custom_id {custom_id!r} was used by an earlier line")
    seen.add(custom_id)
    if str(request.get("method", "POST")).upper() != "POST":
        raise LineError("invalid_method", f"method must be POST, got {request.get('method')!r}")
    url = request.get("url")
    if url not in URLS:
        raise LineError("invalid_url", f"url must be one of {', '.join(URLS)}, got {url!r}")
    body = request.get("body")
    if not isinstance(body, dict):
        raise LineError("invalid_body", "body must be a JSON object: the request as it would be sent to url")
    for name in NOT_IN_A_BATCH:
        if body.get(name) not in (None, False):
            raise LineError("invalid_body", f"'{name}' is not available in a batch: leave it out")
    return url, json.dumps(body).encode()


async def post(app: Any, path: str, body: bytes) -> tuple[int, bytes]:
    """One POST through the ASGI app, in this process: (status, response body)."""
    import anyio

    delivered = False

    async def receive() -> dict[str, Any]:
        nonlocal delivered
        if not delivered:
            delivered = True
            return {"type": "http.request", "body": body, "more_body": False}
        await anyio.sleep_forever()  # the client never goes away
        raise AssertionError("unreachable")

    status, chunks = 500, []

    async def send(message: dict[str, Any]) -> None:
        nonlocal status
        if message["type"] == "http.response.start":
            status = message["status"]
        elif message["type"] == "http.response.body":
            chunks.append(message.get("body", b""))

    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "POST", "scheme": "http",
             "path": path, "raw_path": path.encode(), "query_string": b"", "root_path": "", "headers": headers,
             "client": ("atlas.batch", 0), "server": ("atlas.batch", 0)}
    try:
        await app(scope, receive, send)
    except Exception as err:  # noqa: BLE001 - Starlette re-raises after its 500 answer: one line's fault
        if not chunks:
            return 500, json.dumps({"error": {"message": f"internal error: {type(err).__name__}: {err}"}}).encode()
    return status, b"".join(chunks)


async def answer(app: Any, line: str, seen: set[str]) -> dict[str, Any]:
    """One output line for one input line (seen: the custom_ids before it, which must not repeat)."""
    out: dict[str, Any] = {"id": f"batch_req_{uuid.uuid4().hex}", "custom_id": None, "response": None, "error": None}
    try:
        url, body = parse_line(line, seen, out)
    except LineError as err:
        out["error"] = {"code": err.code, "message": str(err)}
        return out
    status, raw = await post(app, url, body)
    try:
        payload = json.loads(raw)
    except ValueError:
        payload = {"error": {"message": raw.decode("utf-8", "replace")}}
    out["response"] = {"status_code": status, "request_id": f"req_{uuid.uuid4().hex}", "body": payload}
    return out


def check_output(out: Path, input_file: str) -> None:
    """--output-file can be written, before the model loads."""
    check_writable(out, "--output-file")
    if input_file != "-" and out.resolve() == Path(input_file).resolve():
        raise AtlasError("--output-file is the input file; write the results elsewhere")


def batch(args: BatchArgs) -> tuple[int, int]:
    """Run every line; (requests answered 200, lines in all)."""
    import anyio
    from tqdm import tqdm

    from .generation_defaults import GenerationDefaults
    from .serve import seed_stream, served_name
    from .server.app import ServerState, create_app
    from .server.response_store import ResponseStore
    from .server.worker import EngineWorker

    args.engine.check()
    generation = GenerationDefaults(args.generation_config, args.override_generation_config)
    generation.check()
    lines = read_lines(args.input_file)
    out_path = Path(args.output_file)
    check_output(out_path, args.input_file)
    model_dir = args.engine.resolve(args.model)
    worker = EngineWorker(lambda: args.engine.load(str(model_dir)))
    try:
        llm = worker.start()
        name = args.served_model_name or served_name(args.model, model_dir)
        click.echo(f"atlas.batch: model {name} ({model_dir}), device {llm.device}; {len(lines)} requests", err=True)
        app = create_app(ServerState(name, worker, llm, reasoning_parser=args.reasoning_parser,
                                     tool_call_parser=args.tool_call_parser,
                                     sampling_defaults=generation.resolve(llm.parts.spec.sampling_defaults),
                                     responses=ResponseStore(0),  # lines are independent: nothing to keep
                                     seeds=seed_stream(args.seed)))

        async def run_all() -> list[dict[str, Any]]:
            seen = set[str]()
            return [await answer(app, line, seen)
                    for line in tqdm(lines, desc="requests", unit="req", file=sys.stderr, disable=len(lines) < 2)]

        results = anyio.run(run_all)
        with atomic_path(out_path) as scratch, scratch.open("w", encoding="utf-8") as out:
            out.writelines(json.dumps(result, ensure_ascii=False) + "\n" for result in results)
        ok = sum(r["response"] is not None and r["response"]["status_code"] == 200 for r in results)
    finally:
        worker.stop()
    return ok, len(lines)


@click.command(context_settings={"help_option_names": ["-h", "--help"]})
@click.option("--input-file", "-i", required=True, help="OpenAI batch requests, one JSON a line ('-': stdin).")
@click.option("--output-file", "-o", required=True, help="Where the results go, one JSON a line in the input's order.")
@click.option("--model", default=None, help=MODEL_HELP)
@click.option("--served-model-name", default=None, help="The model name the requests' bodies give (default: as atlas.serve's).")
@click.option("--reasoning-parser", type=click.Choice(PARSERS), default=None, help="As atlas.serve's.")
@click.option("--tool-call-parser", type=click.Choice(TOOL_PARSERS), default=None, help="As atlas.serve's.")
@click.option("--generation-config", default="auto", show_default=True,
              help="As atlas.serve's: auto takes the model's generation_config.json sampling defaults; vllm: none; "
              "a folder: its generation_config.json's.")
@click.option("--override-generation-config", default=None,
              help="As atlas.serve's: a JSON object of sampling defaults over those.")
@click.option("--seed", type=click.IntRange(min=0), default=None,
              help="As atlas.serve's: requests without a seed draw theirs from a stream seeded by this, so a batch "
              "run again gives the same results (vLLM's flag).")
@engine_options
def command(**kwargs: Any) -> None:
    """Run an OpenAI batch file (chat completions, completions, responses) through the model."""
    engine = EngineFlags.pop_from(kwargs)
    ok, total = batch(BatchArgs(**kwargs, engine=engine))
    click.echo(f"atlas.batch: {ok} of {total} requests answered 200; results in {kwargs['output_file']}", err=True)


def main(argv: list[str] | None = None, usage: str | None = None) -> int:
    return run_command(command, argv, "atlas.batch", usage=usage)


if __name__ == "__main__":
    sys.exit(main())
