"""atlas.serve over HTTPS (vLLM's --ssl-certfile / --ssl-keyfile / --ssl-ca-certs / --ssl-cert-reqs):
a real server with a certificate made here answers completions to a client that trusts it, keeps
/health open and the rest behind the API key, and every unusable TLS flag is one line before the
model loads. The standard library's HTTP client (the test extra's openai client brings its own)."""

from __future__ import annotations

import json
import os
import shutil
import signal
import ssl
import subprocess
import sys
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import pytest

from _served import serving

REPO = Path(__file__).resolve().parent.parent
needs_openssl = pytest.mark.skipif(shutil.which("openssl") is None, reason="openssl makes the test certificate")


def certificate(directory: Path, name: str, *key_flags: str) -> tuple[Path, Path]:
    """A self-signed certificate for 127.0.0.1 and its key (unencrypted unless `key_flags` give a
    passphrase): (cert.pem, key.pem)."""
    cert, key = directory / f"{name}-cert.pem", directory / f"{name}-key.pem"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", *(key_flags or ["-nodes"]), "-days", "1",
                    "-subj", "/CN=127.0.0.1", "-addext", "subjectAltName=IP:127.0.0.1", "-keyout", str(key),
                    "-out", str(cert)], check=True, capture_output=True)
    return cert, key


@needs_openssl
def test_https(tmp_path: Path) -> None:
    cert, key = certificate(tmp_path, "server")
    command = [sys.executable, "-m", "atlas.serve", "--device", "cpu", "--api-key", "s3cret",
               "--ssl-certfile", str(cert), "--ssl-keyfile", str(key)]
    env = {**os.environ, "PYTHONPATH": str(REPO / "python")}
    with serving(command, tmp_path, env) as (process, url):
        assert url.startswith("https://127.0.0.1:") and url.endswith("/v1"), url
        trusted = ssl.create_default_context(cafile=str(cert))
        assert fetch(url.removesuffix("/v1") + "/health", trusted)[0] == 200
        assert fetch(f"{url}/models", trusted)[0] == 401
        status, body = fetch(f"{url}/messages", trusted, {}, {"x-api-key": "wrong"})
        assert status == 401 and body["type"] == "error"  # Anthropic's shape
        request = {"model": "atlas-demo", "prompt": "Flat is", "max_tokens": 3}
        status, body = fetch(f"{url}/completions", trusted, request, {"Authorization": "Bearer s3cret"})
        assert status == 200 and body["choices"][0]["text"], body
        with pytest.raises(urllib.error.URLError, match="CERTIFICATE_VERIFY_FAILED"):  # not trusted by default
            fetch(f"{url}/models", ssl.create_default_context())
        process.send_signal(signal.SIGINT)
        assert process.wait(60) == 0


def fetch(url: str, context: ssl.SSLContext, body: dict[str, Any] | None = None,
          headers: dict[str, str] | None = None) -> tuple[int, Any]:
    """(status, JSON body) of a GET, or a POST of `body`; an HTTP error status is answered too."""
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(url, data, {"Content-Type": "application/json", **(headers or {})})
    try:
        with urllib.request.urlopen(request, timeout=60, context=context) as answer:
            return answer.status, json.loads(answer.read())
    except urllib.error.HTTPError as err:
        return err.code, json.loads(err.read())


@needs_openssl
@pytest.mark.parametrize(("flags", "needle"), [
    (["--ssl-keyfile", "{key}"], "--ssl-keyfile needs --ssl-certfile"),
    (["--ssl-cert-reqs", "2"], "--ssl-cert-reqs needs --ssl-certfile"),
    (["--ssl-certfile", "{cert}", "--ssl-keyfile", "{other_key}"], "cannot be used"),
    (["--ssl-certfile", "{cert}"], "cannot be used"),  # the key is in neither file
    (["--ssl-certfile", "{missing}", "--ssl-keyfile", "{key}"], "No such file or directory"),
    (["--ssl-certfile", "{cert}", "--ssl-keyfile", "{key}", "--ssl-cert-reqs", "2"], "give it"),
    (["--ssl-certfile", "{cert}", "--ssl-keyfile", "{key}", "--ssl-ca-certs", "{junk}"], "--ssl-ca-certs"),
    (["--ssl-certfile", "{cert}", "--ssl-keyfile", "{key}", "--ssl-cert-reqs", "3"], "--ssl-cert-reqs"),
    (["--ssl-certfile", "{encrypted_cert}", "--ssl-keyfile", "{encrypted_key}"], "the private key is encrypted"),
])
def test_unusable_tls_flags_are_one_line(flags: list[str], needle: str, tmp_path: Path,
                                         capsys: pytest.CaptureFixture[str]) -> None:
    from atlas.serve import main

    cert, key = certificate(tmp_path, "server")
    _, other_key = certificate(tmp_path, "other")
    encrypted_cert, encrypted_key = certificate(tmp_path, "encrypted", "-passout", "pass:secret")
    (tmp_path / "junk.pem").write_text("not a certificate\n")
    paths = {"cert": cert, "key": key, "other_key": other_key, "missing": tmp_path / "none.pem",
             "junk": tmp_path / "junk.pem", "encrypted_cert": encrypted_cert, "encrypted_key": encrypted_key}
    argv = [flag.format(**paths) for flag in flags]
    assert main([*argv, "--port", "0", "--device", "cpu"]) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("atlas.serve: error: ") and needle in lines[0], lines
