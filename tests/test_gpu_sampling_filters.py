"""llama.cpp's typical-p, top-n-sigma and XTC on the GPU backend (demo model): no kernel has them,
so each sampled pick reads its penalized row back from the device and the host filters pick
(Engine._host_pick). Under a setting that leaves one token per step, every pick of a generation is
checked against the device's own teacher-forced logits (its prefill and decode round bf16
differently: a margin of 0.05 in the logit, or in the surprise's distance from the entropy)."""

from __future__ import annotations

import os

import numpy as np
import pytest

from atlas.backends.base import SamplingParams
from atlas.errors import AtlasError
from test_gpu_model import ATLAS_DEVICE
from test_sampling_filters import ONE_TOKEN_LEFT

pytestmark = pytest.mark.gpu

MARGIN = 0.05


@pytest.fixture(scope="module")
def gpu_llm():  # type: ignore[no-untyped-def]
    from atlas import LLM

    try:
        return LLM(device=ATLAS_DEVICE, spec_k=0, max_seq_len=256)
    except (AtlasError, ImportError) as err:
        if os.environ.get("ATLAS_REQUIRE_GPU") == "1":
            raise
        pytest.skip(f"no CUDA backend here: {err}")


@pytest.mark.parametrize("form", sorted(ONE_TOKEN_LEFT))
def test_each_pick_on_the_gpu_is_the_filters(form: str, gpu_llm, rng: np.random.Generator) -> None:  # type: ignore[no-untyped-def]
    engine, temperature = gpu_llm.parts.engine, float(rng.uniform(0.5, 1.5))
    assert engine.backend.name != "numpy"
    prompt = rng.integers(0, gpu_llm.parts.spec.vocab_size, size=int(rng.integers(4, 20))).tolist()
    params = SamplingParams(temperature=temperature, **ONE_TOKEN_LEFT[form])
    tokens = engine.generate(prompt, 8, params, int(rng.integers(1 << 30)), set()).token_ids
    rows = engine.logits(prompt + tokens[:-1])[len(prompt) - 1:].astype(np.float64)  # [8, V]
    assert np.isfinite(rows).all()
    for row, token in zip(rows, tokens, strict=True):
        z = row / temperature  # [V]
        logp = z - z.max() - np.log(np.exp(z - z.max()).sum())  # [V]
        if form == "typical":
            distance = np.abs(-logp - float(-np.sum(np.exp(logp) * logp)))  # [V]
            assert distance[token] <= distance.min() + MARGIN
        elif form == "top_n_sigma":
            assert row[token] >= row.max() - MARGIN
        else:
            assert row[token] <= row.min() + MARGIN


def test_dry_on_the_gpu_charges_each_repeat(gpu_llm, rng: np.random.Generator) -> None:  # type: ignore[no-untyped-def]
    """Greedy with DRY: the device's row read back, DRY's penalties taken off on the host."""
    from test_sampling_filters import ZEN_TWICE, dry_check

    prompt = gpu_llm.tokenizer.encode(ZEN_TWICE)
    params = SamplingParams(dry_multiplier=float(rng.uniform(1, 4)), dry_base=float(rng.uniform(1.2, 2)),
                            dry_allowed_length=int(rng.integers(1, 4)))
    tokens = gpu_llm.parts.engine.generate(prompt, 12, params, None, set()).token_ids
    assert tokens != gpu_llm.parts.engine.generate(prompt, 12, SamplingParams(), None, set()).token_ids
    dry_check(gpu_llm.parts.engine, prompt, tokens, params, MARGIN)
