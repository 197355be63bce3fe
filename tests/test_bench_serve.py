"""bench/serve.py against the demo on the CPU: it starts atlas.serve, every request completes with
exactly the tokens asked for, the statistics are consistent with each other, and bad flags are a
usage error (exit 2)."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("uvicorn")

REPO = Path(__file__).resolve().parent.parent
BENCH = REPO / "bench" / "serve.py"


def test_load_on_the_demo(tmp_path: Path, rng: np.random.Generator) -> None:
    requests, concurrency = int(rng.integers(3, 7)), int(rng.integers(1, 4))
    inputs, outputs = int(rng.integers(8, 40)), int(rng.integers(2, 12))
    out = tmp_path / "serve.json"
    done = subprocess.run([sys.executable, str(BENCH), "--model", "atlas-demo", "--device", "cpu", "--requests", str(requests),
                           "--concurrency", str(concurrency), "--input-tokens", str(inputs), "--output-tokens", str(outputs),
                           "--out", str(out)], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    document = json.loads(out.read_text())
    result = document["results"]
    assert (result["completed"], result["failed"], result["output_tokens"]) == (requests, 0, requests * outputs)
    assert document["device"].startswith("cpu") and document["commit"]
    for name in ("ttft_ms", "e2e_ms", "itl_ms", "tpot_ms"):
        stats = result[name]
        assert 0 <= stats["p50"] <= stats["p90"] <= stats["p99"], (name, stats)
    assert result["ttft_ms"]["p99"] <= result["e2e_ms"]["p99"] + 1e-6
    assert result["output_tok_s"] == pytest.approx(requests * outputs / result["duration_s"], rel=0.02)


@pytest.mark.parametrize("flags", [[], ["--model", "atlas-demo", "--url", "http://127.0.0.1:1/v1"],
                                   ["--url", "http://x/v1", "--out", "/no/such/dir/x.json"]])
def test_bad_flags_are_usage_errors(flags: list[str]) -> None:
    done = subprocess.run([sys.executable, str(BENCH), *flags], capture_output=True, text=True, timeout=60)
    lines = done.stderr.splitlines()
    assert done.returncode == 2 and len(lines) == 1 and lines[0].startswith("bench/serve.py: error: "), done.stderr


class CuttingServer(BaseHTTPRequestHandler):
    """A stand-in server: streams `max_tokens` one-token chunks, but drops the connection midway
    through the CUT-th completion request."""

    CUT = 3
    protocol_version = "HTTP/1.1"
    served = 0
    lock = threading.Lock()

    def log_message(self, *args: object) -> None:
        pass

    def reply(self, payload: dict) -> None:
        data = json.dumps(payload).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self) -> None:  # noqa: N802 - http.server's name
        self.reply({"data": [{"id": "stand-in"}]} if self.path.endswith("/models") else {"device": "stand-in"})

    def do_POST(self) -> None:  # noqa: N802
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        if self.path == "/tokenize":
            return self.reply({"tokens": list(range(len(body["prompt"].split())))})
        with self.lock:
            type(self).served += 1
            number = self.served
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.send_header("Transfer-Encoding", "chunked")
        self.end_headers()
        for i in range(body["max_tokens"]):
            self.chunk("data: " + json.dumps({"choices": [{"text": "x"}]}) + "\n\n")
            if number == self.CUT and i == 1:
                self.wfile.write(b"100\r\ndata: {")  # a chunk cut short, then the connection goes
                self.wfile.flush()
                self.close_connection = True
                return
        self.chunk("data: " + json.dumps({"choices": [], "usage": {"completion_tokens": body["max_tokens"]}}) + "\n\n")
        self.chunk("data: [DONE]\n\n")
        self.wfile.write(b"0\r\n\r\n")

    def chunk(self, text: str) -> None:
        data = text.encode()
        self.wfile.write(b"%x\r\n%s\r\n" % (len(data), data))
        self.wfile.flush()


def test_a_dropped_stream_is_a_failed_request(tmp_path: Path) -> None:
    """A request whose stream breaks counts as failed (exit 1), and the others still complete."""
    server = ThreadingHTTPServer(("127.0.0.1", 0), CuttingServer)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        out = tmp_path / "serve.json"
        done = subprocess.run([sys.executable, str(BENCH), "--url", f"http://127.0.0.1:{server.server_port}", "--requests", "6",
                               "--concurrency", "2", "--input-tokens", "4", "--output-tokens", "4", "--out", str(out)],
                              capture_output=True, text=True, timeout=120)
    finally:
        server.shutdown()
    assert done.returncode == 1, done.stderr[-2000:]
    result = json.loads(out.read_text())["results"]
    assert (result["completed"], result["failed"], result["output_tokens"]) == (5, 1, 20), result
