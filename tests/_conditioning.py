"""Draws that rounding alone could decide, for tests comparing two computations of one greedy
path (speculation vs plain decoding, atlas vs transformers): such draws say nothing about
correctness, so a test draws again."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

import numpy as np
import pytest

from atlas.backends.numpy_backend import NumpyBackend
from atlas.config import load_spec
from atlas.engine import Engine
from atlas.safetensors import Checkpoint

Drawn = TypeVar("Drawn")

TIE_MARGIN = 1e-5  # router probability / relative logit gap below which rounding could decide
MAX_DRAWS = 20


class RouterMargins(NumpyBackend):
    """The numpy backend, noting each router call's gap at the top-k cut, per token."""

    def __init__(self) -> None:
        super().__init__()
        self.margins: list[np.ndarray] = []  # per call: [T]

    def router(self, x, weight, top_k, renormalize, *, shared_expert=False):  # type: ignore[no-untyped-def]
        dense = np.asarray(weight)  # [E (+ 1), H] float32, however the backend stores it
        logits = x @ dense[: dense.shape[0] - int(shared_expert)].T  # [T, E]
        probs = np.sort(np.exp(logits - logits.max(axis=-1, keepdims=True)), axis=-1)[:, ::-1]
        probs /= probs.sum(axis=-1, keepdims=True)
        if top_k < probs.shape[-1]:
            self.margins.append(probs[:, top_k - 1] - probs[:, top_k])
        return super().router(x, weight, top_k, renormalize, shared_expert=shared_expert)


def router_margins(model_dir: Path, ids: list[int]) -> np.ndarray:
    """Each token's smallest router gap at the top-k cut over the layers [T], on the numpy backend."""
    backend = RouterMargins()
    Engine(load_spec(model_dir), Checkpoint.open(model_dir), backend, max_seq_len=len(ids) + 1).logits(ids)
    return np.min(np.stack(backend.margins), axis=0) if backend.margins else np.ones(len(ids))


def well_conditioned(model_dir: Path, prompt: list[int], tokens: list[int]) -> bool:
    """False when float32 rounding alone could decide the greedy path `tokens` after `prompt`: a
    router top-k cut or the greedy choice within TIE_MARGIN of a tie, on the numpy backend."""
    backend = RouterMargins()
    engine = Engine(load_spec(model_dir), Checkpoint.open(model_dir), backend, max_seq_len=256)
    logits = engine.logits(prompt + tokens)[len(prompt) - 1 : -1]  # [N, V], the greedy choices
    top2 = np.sort(logits, axis=-1)[:, -2:]
    gap = float((top2[:, 1] - top2[:, 0]).min() / np.abs(logits).max())
    return min((float(m.min()) for m in backend.margins), default=1.0) > TIE_MARGIN and gap > TIE_MARGIN


def draw_conditioned(
    model_dir: Path, draw: Callable[[], tuple[Drawn, list[int]]], new_tokens: int
) -> tuple[Drawn, list[int]]:
    """(the drawn value, transformers' greedy ids after it) for the first draw (value, prompt ids)
    whose greedy path is well conditioned."""
    from runtime_checkpoint import transformers_greedy

    for _ in range(MAX_DRAWS):
        value, prompt_ids = draw()
        greedy_ids = transformers_greedy(model_dir, prompt_ids, new_tokens)
        if well_conditioned(model_dir, prompt_ids, greedy_ids):
            return value, greedy_ids
    pytest.fail(f"no well-conditioned prompt in {MAX_DRAWS} draws")
