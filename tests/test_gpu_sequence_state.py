"""Saved sequences on the GPU (demo model): the KV rows come off the device as stored (bf16, or a
quantized level's packed fields) with the DeltaNet states, go back into a freshly loaded LLM's
device caches, and the restored LLM continues exactly as the one that saved it; saving it again
gives the same bytes."""

from __future__ import annotations

import os
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest

from atlas.errors import AtlasError
from atlas.safetensors import Checkpoint
from test_gpu_model import ATLAS_DEVICE

pytestmark = pytest.mark.gpu

LEVELS = ("bf16", "turbo4", "fp8")
NEW_TOKENS = 4


def gpu_llm(level: str):  # type: ignore[no-untyped-def]
    from atlas import LLM

    try:
        return LLM(device=ATLAS_DEVICE, kv_cache_dtype=level, kv_high_precision_layers=0, spec_k=0, max_seq_len=256)
    except (AtlasError, ImportError) as err:
        if os.environ.get("ATLAS_REQUIRE_GPU") == "1":
            raise
        pytest.skip(f"no CUDA backend here: {err}")


@pytest.mark.parametrize("level", LEVELS)
def test_a_sequence_restored_on_the_gpu_continues_as_the_saved_one(level: str, rng: np.random.Generator,
                                                                   tmp_path: Path) -> None:
    saver, restorer = gpu_llm(level), gpu_llm(level)
    prompt = rng.integers(0, 512, size=int(rng.integers(30, 60))).tolist()
    generated = saver.generate(prompt, max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True).token_ids
    saved = saver.save_state(tmp_path / "chat.seq")
    assert saved.tokens == len(prompt) + NEW_TOKENS - 1
    stored = Checkpoint.open_files(tmp_path / "chat.seq", [tmp_path / "chat.seq"])
    kv = [name for name in stored.names() if ".k." in name]
    assert kv and all(stored.get_raw(name).shape[0] == saved.tokens for name in kv)
    if level == "bf16":  # the device's bf16 rows, not a float32 copy
        assert all(stored.get_raw(name).dtype == ml_dtypes.bfloat16 for name in kv)
    stored.close()

    restorer.generate(rng.integers(0, 512, size=20).tolist(), max_tokens=2, temperature=0.0)
    assert restorer.load_state(tmp_path / "chat.seq") == saved
    restorer.save_state(tmp_path / "again.seq")
    assert (tmp_path / "again.seq").read_bytes() == (tmp_path / "chat.seq").read_bytes()

    second = prompt + generated + rng.integers(0, 512, size=5).tolist()
    want = saver.generate(second, max_tokens=NEW_TOKENS, temperature=0.0, logprobs=3)
    got = restorer.generate(second, max_tokens=NEW_TOKENS, temperature=0.0, logprobs=3)
    assert got.token_ids == want.token_ids
    # the same kernels on the same state; close rather than equal in case a kernel's reduction order varies
    np.testing.assert_allclose([s.logprob for s in got.logprobs], [s.logprob for s in want.logprobs], atol=1e-4)
    assert got.cached_tokens == want.cached_tokens == saved.tokens
