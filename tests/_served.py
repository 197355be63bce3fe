"""A server command run as a client would: started on a free port, used once it says where it
listens, and stopped after."""

from __future__ import annotations

import re
import ssl
import subprocess
import threading
import time
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

STARTUP_S = 300


@contextmanager
def serving(command: list[str], cwd: Path, env: dict[str, str]) -> Iterator[tuple[subprocess.Popen[str], str]]:
    """`command --port 0` -> (the process, the base URL its 'listening on' line names) once it
    answers /health (a Ctrl-C between the line and uvicorn's start was seen lost on a loaded
    machine); killed at the end if still running. A server that ends (or stays silent STARTUP_S)
    before it listens is an AssertionError with what it said."""
    process = subprocess.Popen([*command, "--port", "0"], cwd=cwd, env=env, stderr=subprocess.PIPE, text=True)
    said: list[str] = []
    watchdog = threading.Timer(STARTUP_S, process.kill)
    watchdog.start()
    try:
        url = None
        for line in process.stderr:  # type: ignore[union-attr]
            said.append(line)
            if found := re.search(r"listening on (\S+)", line):
                url = found.group(1)
                break
        watchdog.cancel()
        assert url is not None, f"{command[2]} ended before it listened: {''.join(said)[-2000:]}"
        threading.Thread(target=lambda: said.extend(process.stderr), daemon=True).start()  # type: ignore[arg-type]
        wait_for_health(url.removesuffix("/v1"), time.monotonic() + STARTUP_S)
        yield process, url
    finally:
        watchdog.cancel()
        if process.poll() is None:
            process.kill()
        process.wait()


def wait_for_health(origin: str, deadline: float) -> None:
    """Until GET /health answers 200 (an https server's certificate unchecked: only readiness)."""
    context = ssl.create_default_context()
    context.check_hostname, context.verify_mode = False, ssl.CERT_NONE
    while True:
        try:
            with urllib.request.urlopen(f"{origin}/health", timeout=5, context=context) as answer:
                if answer.status == 200:
                    return
        except OSError:
            pass
        assert time.monotonic() < deadline, f"{origin} never answered /health"
        time.sleep(0.1)
