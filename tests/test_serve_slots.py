"""llama.cpp's POST /slots/{id}?action=save|restore|erase over HTTP (demo model): a chat saved on
one server and restored on another (a restart) continues there as on the first, from the saved
tokens; erase forgets them; bad requests are one 400 naming the fix and change nothing; without
--slot-save-path the actions are a 501."""

from __future__ import annotations

import json
from collections.abc import Iterator
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pytest

pytest.importorskip("starlette", reason="the server's stack is an atlas dependency: pip install .")

from atlas import LLM
from atlas.demo import DEMO_NAME
from atlas.server.app import ServerState, create_app
from atlas.server.worker import EngineWorker
from _engine_app import serving
from test_serve import TIMEOUT_S, post

NEW_TOKENS = 6


@dataclass
class Servers:
    first: int  # ports
    second: int
    off: int  # started without --slot-save-path
    directory: Path


@pytest.fixture(scope="module")
def servers(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Servers]:
    directory = tmp_path_factory.mktemp("slots")
    with ExitStack() as stack:
        ports = []
        for slot_dir in (directory, directory, None):
            worker = EngineWorker(lambda: LLM(device="cpu"))
            llm = worker.start()
            stack.callback(worker.stop)
            app = create_app(ServerState(DEMO_NAME, worker, llm, slot_dir=slot_dir))
            ports.append(stack.enter_context(serving(app, TIMEOUT_S)))
        yield Servers(*ports, directory)


def complete(port: int, prompt: list[int]) -> dict[str, Any]:
    """NEW_TOKENS greedy tokens: an eos would end the answer early (about one random prompt in 30)."""
    status, body = post(port, "/completion", json.dumps({"prompt": prompt, "n_predict": NEW_TOKENS, "temperature": 0,
                                                         "ignore_eos": True, "return_tokens": True, "n_probs": 2}))
    assert status == 200, body
    return body


def action(port: int, name: str, body: object = None, slot: str = "0") -> tuple[int, dict[str, Any]]:
    return post(port, f"/slots/{slot}?action={name}", json.dumps(body) if body is not None else "")


def test_a_chat_saved_on_one_server_continues_on_another(servers: Servers, rng: np.random.Generator) -> None:
    prompt = rng.integers(0, 512, size=int(rng.integers(40, 90))).tolist()
    first = complete(servers.first, prompt)
    name = f"chat-{rng.integers(1 << 30)}.bin"
    status, saved = action(servers.first, "save", {"filename": name})
    assert status == 200, saved
    assert saved["id_slot"] == 0 and saved["filename"] == name
    assert saved["n_saved"] == len(prompt) + NEW_TOKENS - 1  # the last generated token was not fed
    assert saved["n_written"] == (servers.directory / name).stat().st_size and saved["timings"]["save_ms"] >= 0

    status, restored = action(servers.second, "restore", {"filename": name})
    assert status == 200, restored
    assert (restored["n_restored"], restored["n_read"]) == (saved["n_saved"], saved["n_written"])
    second = prompt + first["tokens"] + rng.integers(0, 512, size=4).tolist()
    want, got = complete(servers.first, second), complete(servers.second, second)
    assert got["tokens"] == want["tokens"] and got["completion_probabilities"] == want["completion_probabilities"]
    assert got["timings"]["cache_n"] == want["timings"]["cache_n"] == saved["n_saved"]

    status, erased = action(servers.second, "erase")
    assert status == 200 and erased == {"id_slot": 0, "n_erased": len(second) + NEW_TOKENS - 1}
    assert complete(servers.second, second)["timings"]["cache_n"] == 0


BAD = {
    "a path": ({"filename": "../outside.bin"}, "0", "save", "filename"),
    "a separator": ({"filename": "a/b.bin"}, "0", "save", "filename"),
    "no filename": ({"name": "x.bin"}, "0", "save", "filename"),
    "not text": ({"filename": 7}, "0", "restore", "filename"),
    "another slot": ({"filename": "x.bin"}, "1", "save", "slot"),
    "another action": ({"filename": "x.bin"}, "0", "load", "action"),
    "a missing file": ({"filename": "never-saved.bin"}, "0", "restore", "does not exist"),
    "a foreign file": ({"filename": "foreign.bin"}, "0", "restore", "not a saved sequence"),
}


@pytest.mark.parametrize("case", sorted(BAD))
def test_a_bad_request_is_one_400_and_changes_nothing(case: str, servers: Servers, rng: np.random.Generator) -> None:
    body, slot, name, named = BAD[case]
    (servers.directory / "foreign.bin").write_bytes(rng.bytes(200))
    prompt = rng.integers(0, 512, size=30).tolist()
    first = complete(servers.first, prompt)
    status, answer = action(servers.first, name, body, slot)
    assert status == 400, answer
    message = answer["error"]["message"]
    assert named in message and "\n" not in message
    assert not (servers.directory.parent / "outside.bin").exists() and not (servers.directory / "a").exists()
    again = complete(servers.first, prompt + first["tokens"] + [7])  # resumes from the live state, as it was
    assert again["timings"]["cache_n"] == len(prompt) + NEW_TOKENS - 1


def test_without_a_slot_directory_the_actions_are_a_501(servers: Servers) -> None:
    status, answer = action(servers.off, "save", {"filename": "x.bin"})
    assert status == 501 and "--slot-save-path" in answer["error"]["message"]
