"""The server app over a real engine on the embedded demo model, for tests that drive it through a
client (the Responses and Messages APIs)."""

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
