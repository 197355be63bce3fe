"""The server under load, as vLLM's `vllm bench serve` measures one: time to first token (TTFT),
time per output token after the first (TPOT), inter-token latency (ITL), end-to-end latency and
throughput, for N requests sent by C concurrent clients over the streaming completions API.

    python bench/serve.py --model atlas-demo [--requests 32] [--concurrency 4] [--input-tokens 128]
        [--output-tokens 64] [--device auto] [--out bench/results/serve-<device>-<date>.json]
    python bench/serve.py --url http://127.0.0.1:8000/v1 ...     # a server already running

Prompts are --input-tokens ids of random words (the server's /tokenize turns them into ids, so
they are the model's own tokens, as vLLM's "random" dataset), fresh per run unless --seed; each
asks for exactly --output-tokens (ignore_eos), so every run writes the same number of tokens. With --model
the script starts `python -m atlas.serve` on a free port (--prompt-cache 0: every prompt is new
anyway) and stops it after. Standard library HTTP only (the device has no openai client). The
JSON has each statistic's mean, p50 (median), p90 and p99 in milliseconds (ITL: between streamed
chunks, a token each unless a character spans tokens), and the server's /health.
"""

from __future__ import annotations

import json
import os
import queue
import re
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import click
import numpy as np

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "bench"))
sys.path.insert(0, str(REPO / "python"))

from atlas.dump import check_writable, write_json  # noqa: E402
from atlas.errors import AtlasError  # noqa: E402
from bench_cli import run_click  # noqa: E402
from provenance import git_commit  # noqa: E402


STARTUP_S = 600.0  # a real model's weights load first
REQUEST_TIMEOUT_S = 600.0
PERCENTILES = (50, 90, 99)


@dataclass
class RequestResult:
    """One streamed request (seconds after it went out): when its first text chunk came, when each
    chunk with choices came after that (ITL's gaps, as vLLM counts them), when the stream ended."""

    ttft: float = 0.0
    arrivals: list[float] = field(default_factory=list)
    latency: float = 0.0
    tokens: int = 0  # completion tokens the usage counts
    error: str | None = None

    @property
    def tpot(self) -> float | None:
        """(latency - TTFT) / (tokens - 1): vLLM's TPOT."""
        return (self.latency - self.ttft) / (self.tokens - 1) if self.tokens > 1 else None


def stream_request(url: str, model: str, prompt: list[int], max_tokens: int) -> RequestResult:
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
            "stream": True, "stream_options": {"include_usage": True}}
    request = urllib.request.Request(f"{url}/completions", data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"}, method="POST")
    result, started = RequestResult(), time.perf_counter()
    try:
        with urllib.request.urlopen(request, timeout=REQUEST_TIMEOUT_S) as answer:
            for raw in answer:
                line = raw.decode("utf-8").strip()
                if line.startswith("data: {"):
                    take_chunk(result, json.loads(line[6:]), time.perf_counter() - started)
        result.latency = time.perf_counter() - started
    except urllib.error.HTTPError as err:
        result.error = f"HTTP {err.code}: {err.read()[:200].decode(errors='replace')}"
    except Exception as err:  # noqa: BLE001 - a dropped stream is this request's failure, not the run's
        result.error = f"{type(err).__name__}: {err}"
    if result.error is None and (not result.arrivals or result.tokens != max_tokens):
        result.error = f"{result.tokens} of {max_tokens} tokens, {len(result.arrivals)} chunks"
    return result


def take_chunk(result: RequestResult, chunk: dict[str, Any], at: float) -> None:
    if "error" in chunk:
        result.error = f"the server: {chunk['error'].get('message')}"
    if chunk.get("choices"):
        if not result.arrivals and chunk["choices"][0].get("text"):
            result.ttft = at
        if result.arrivals or chunk["choices"][0].get("text"):
            result.arrivals.append(at)
    if chunk.get("usage"):
        result.tokens = int(chunk["usage"]["completion_tokens"])


def run_load(url: str, model: str, prompts: list[list[int]], max_tokens: int, concurrency: int) -> tuple[list[RequestResult], float]:
    """Every prompt, `concurrency` at a time -> (results in prompt order, seconds for all)."""
    todo: queue.Queue[int] = queue.Queue()
    for i in range(len(prompts)):
        todo.put(i)
    results: list[RequestResult | None] = [None] * len(prompts)

    def client() -> None:
        while True:
            try:
                i = todo.get_nowait()
            except queue.Empty:
                return
            try:
                results[i] = stream_request(url, model, prompts[i], max_tokens)
            except Exception as err:  # noqa: BLE001 - counted as failed, the client goes on
                results[i] = RequestResult(error=f"{type(err).__name__}: {err}")

    started = time.perf_counter()
    threads = [threading.Thread(target=client) for _ in range(concurrency)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return [r if r is not None else RequestResult(error="never sent") for r in results], time.perf_counter() - started


def summary_ms(values: list[float]) -> dict[str, float]:
    if not values:
        return {}
    ms = np.array(values) * 1000
    return {"mean": round(float(ms.mean()), 2), **{f"p{p}": round(float(np.percentile(ms, p)), 2) for p in PERCENTILES}}


def report(results: list[RequestResult], seconds: float) -> dict[str, Any]:
    done = [r for r in results if r.error is None]
    tokens = sum(r.tokens for r in done)
    itl = [b - a for r in done for a, b in zip(r.arrivals, r.arrivals[1:])]
    return {
        "completed": len(done), "failed": len(results) - len(done), "errors": sorted({r.error for r in results if r.error})[:5],
        "duration_s": round(seconds, 3), "request_throughput": round(len(done) / seconds, 3),
        "output_tok_s": round(tokens / seconds, 2), "output_tokens": tokens,
        "ttft_ms": summary_ms([r.ttft for r in done]), "tpot_ms": summary_ms([t for r in done if (t := r.tpot) is not None]),
        "itl_ms": summary_ms(itl), "e2e_ms": summary_ms([r.latency for r in done]),
    }


@contextmanager
def started_server(model: str, device: str) -> Iterator[str]:
    """`python -m atlas.serve` on a free port -> its base URL; stopped (Ctrl-C) on exit."""
    cmd = [sys.executable, "-m", "atlas.serve", "--model", model, "--device", device, "--host", "127.0.0.1",
           "--port", "0", "--prompt-cache", "0", "--max-waiting", "0", "--log-level", "warning"]
    process = subprocess.Popen(cmd, stderr=subprocess.PIPE, text=True, cwd=REPO,
                               env={**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO / "python"), os.environ.get("PYTHONPATH", "")])})
    lines: queue.Queue[str] = queue.Queue()
    threading.Thread(target=lambda: [lines.put(line) for line in process.stderr], daemon=True).start()  # type: ignore[union-attr]
    try:
        deadline, said = time.monotonic() + STARTUP_S, []
        while True:
            if time.monotonic() > deadline or process.poll() is not None:
                raise AtlasError("atlas.serve did not start: " + " | ".join(said[-3:]))
            try:
                said.append(lines.get(timeout=1).strip())
            except queue.Empty:
                continue
            if found := re.search(r"listening on (http://\S+/v1)", said[-1]):
                yield found.group(1)
                return
    finally:
        process.send_signal(signal.SIGINT)
        try:
            process.wait(30)
        except subprocess.TimeoutExpired:
            process.kill()


def get_json(url: str, body: dict[str, Any] | None = None) -> dict[str, Any]:
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=30) as answer:
        return json.loads(answer.read())


def random_prompts(base: str, model: str, rng: np.random.Generator, count: int, length: int) -> list[list[int]]:
    """`count` prompts of `length` token ids: random lower-case words, tokenized by the server."""
    root = base.removesuffix("/v1")
    prompts = []
    for _ in range(count):
        ids: list[int] = []
        while len(ids) < length:
            words = ["".join(chr(97 + c) for c in rng.integers(0, 26, int(rng.integers(2, 9)))) for _ in range(length)]
            ids += get_json(f"{root}/tokenize", {"model": model, "prompt": " ".join(words)})["tokens"]
        prompts.append(ids[:length])
    return prompts


@click.command()
@click.option("--model", default=None, help="Start atlas.serve with this model (a name, repo id or directory).")
@click.option("--url", default=None, help="A running server's base URL, e.g. http://127.0.0.1:8000/v1.")
@click.option("--device", default="auto", show_default=True, help="--model: atlas.serve's --device.")
@click.option("--requests", "count", type=click.IntRange(min=1), default=32, show_default=True)
@click.option("--concurrency", type=click.IntRange(min=1), default=4, show_default=True)
@click.option("--input-tokens", type=click.IntRange(min=1), default=128, show_default=True)
@click.option("--output-tokens", type=click.IntRange(min=1), default=64, show_default=True)
@click.option("--seed", type=int, default=None, help="Prompts' seed (default: fresh each run).")
@click.option("--out", type=click.Path(dir_okay=False, path_type=Path), default=None, help="Write the JSON here too.")
def main(model: str | None, url: str | None, device: str, count: int, concurrency: int, input_tokens: int,
         output_tokens: int, seed: int | None, out: Path | None) -> None:
    """Load the server with streamed completions and print the latency and throughput JSON."""
    if (model is None) == (url is None):
        raise click.UsageError("give --model (the script starts atlas.serve) or --url (a running server), not both")
    if out is not None:
        check_writable(out, "--out")  # before the server starts
    if url is not None:
        check_url(url)
    with started_server(model, device) if model is not None else _given(url) as base:  # type: ignore[arg-type]
        try:
            name = get_json(f"{base}/models")["data"][0]["id"]
            prompts = random_prompts(base, name, np.random.default_rng(seed), count, input_tokens)
            stream_request(base, name, prompts[0][:8], 2)  # warm-up: the first request pays for lazy setup
            results, seconds = run_load(base, name, prompts, output_tokens, concurrency)
            health = get_json(base.removesuffix("/v1") + "/health")
        except (OSError, ValueError, LookupError, TypeError) as err:  # URLError and HTTPError are OSErrors
            raise AtlasError(f"talking to the server at {base} failed ({server_failure(err)}); check that an "
                             "OpenAI-compatible server is running there") from None
    now = datetime.now(timezone.utc)
    document = {"date": now.isoformat(timespec="seconds"), "commit": git_commit(), "model": name,
                "device": health.get("device"), "requests": count, "concurrency": concurrency,
                "input_tokens": input_tokens, "output_tokens": output_tokens, "seed": seed,
                "results": report(results, seconds), "health": health}
    text = json.dumps(document, indent=1)
    click.echo(text)
    if out is not None:
        write_json(out, document)
    if document["results"]["failed"]:
        sys.exit(1)


def check_url(url: str) -> None:
    """--url is an http(s) URL with a host (urllib's own error for one that is not is a traceback)."""
    try:
        parts = urllib.parse.urlsplit(url)
        usable = parts.scheme in ("http", "https") and bool(parts.hostname) and parts.port != 0
    except ValueError as err:  # a port out of range, a bad IPv6 address
        raise AtlasError(f"--url {url}: {err}; give the server's base URL, e.g. http://127.0.0.1:8000/v1") from None
    if not usable:
        raise AtlasError(f"--url {url}: not the http:// or https:// URL of a server; give its base URL, "
                         "e.g. http://127.0.0.1:8000/v1")


def server_failure(err: BaseException) -> str:
    """What went wrong talking to the server, on one line."""
    if isinstance(err, urllib.error.HTTPError):
        return f"HTTP {err.code} {err.reason}"
    if isinstance(err, urllib.error.URLError):
        return str(err.reason)
    return " ".join(f"{type(err).__name__}: {err}".split())[:200]


@contextmanager
def _given(url: str) -> Iterator[str]:
    """A running server's base URL, with or without its /v1."""
    base = url.rstrip("/")
    yield base if base.endswith("/v1") else f"{base}/v1"


if __name__ == "__main__":
    sys.exit(run_click(main, "bench/serve.py"))
