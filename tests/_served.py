"""A server command run as a client would: started on a free port, used once it says where it
listens, and stopped after."""

from __future__ import annotations

import re
import subprocess
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

STARTUP_S = 300


@contextmanager
def serving(command: list[str], cwd: Path, env: dict[str, str]) -> Iterator[tuple[subprocess.Popen[str], str]]:
    """`command --port 0` -> (the process, the base URL its 'listening on' line names); killed at
    the end if still running. A server that ends (or stays silent STARTUP_S) before it listens is an
    AssertionError with what it said."""
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
        yield process, url
    finally:
        watchdog.cancel()
        if process.poll() is None:
            process.kill()
        process.wait()
