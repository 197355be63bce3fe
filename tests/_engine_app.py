"""The server app over a real engine on the embedded demo model, for tests that drive it through a
client (the Responses and Messages APIs), and any app on a real uvicorn server."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from atlas import LLM
from atlas.demo import DEMO_NAME


@contextmanager
def engine_app() -> Iterator[tuple[Any, LLM]]:
    """(the app, a second demo model in-process for the expected answers); the engine thread stops
    on exit. No prompt cache, so each answer runs from its prompt alone."""
    from atlas.server.app import ServerState, create_app
    from atlas.server.worker import EngineWorker

    worker = EngineWorker(lambda: LLM(device="cpu", prompt_cache=0))
    llm = worker.start()
    try:
        yield create_app(ServerState(DEMO_NAME, worker, llm)), LLM(device="cpu", prompt_cache=0)  # type: ignore[arg-type]
    finally:
        worker.stop()


@contextmanager
def serving(app: Any, timeout_s: float = 30.0) -> Iterator[int]:
    """`app` on a real uvicorn server on 127.0.0.1 (a free port, yielded) in a thread; stopped,
    its lifespan's shutdown run, on exit."""
    import socket
    import threading
    import time

    import uvicorn

    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", timeout_graceful_shutdown=2))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + timeout_s
    while not server.started and thread.is_alive() and time.monotonic() < deadline:
        time.sleep(0.02)
    assert server.started, "uvicorn did not start"
    try:
        yield sock.getsockname()[1]
    finally:
        server.should_exit = True
        thread.join(timeout_s)
        sock.close()
    assert not thread.is_alive(), "uvicorn did not stop"
