"""llama.cpp's typical-p, top-n-sigma, XTC, DRY, mirostat and dynatemp on the GPU backend (demo
model): no kernel has them, so each pick reads its (penalized) row back from the device and the
host picks (Engine._host_pick). A row of fresh logits on the device is picked exactly as the host
reference picks it, draw for draw; and a greedy DRY generation charges each repeat (the device's
prefill and decode round bf16 differently: a margin in the logit)."""

from __future__ import annotations

import os

import numpy as np
import pytest

from atlas.backends.base import SamplingParams
from atlas.errors import AtlasError
from atlas.sampling import Penalties, choose_token, draw_uniform, host_argmax
from atlas.sampling_filters import Mirostat, dry_penalties
from test_gpu_model import ATLAS_DEVICE

pytestmark = pytest.mark.gpu

MARGIN = 0.25
FORMS = {  # settings drawn per run: each a pick on the host
    "typical": lambda rng: {"temperature": float(rng.uniform(0.5, 1.5)), "typical_p": float(rng.uniform(0.2, 0.9))},
    "top_n_sigma": lambda rng: {"temperature": float(rng.uniform(0.5, 1.5)), "top_n_sigma": float(rng.uniform(0.3, 2))},
    "xtc": lambda rng: {"temperature": float(rng.uniform(0.5, 1.5)), "xtc_probability": float(rng.uniform(0.3, 1)),
                        "xtc_threshold": float(rng.uniform(0.0, 0.2))},
    "dry": lambda rng: {"dry_multiplier": float(rng.uniform(0.5, 3)), "dry_allowed_length": int(rng.integers(1, 3))},
    "mirostat": lambda rng: {"temperature": float(rng.uniform(0.5, 1.5)), "mirostat": int(rng.integers(1, 3)),
                             "mirostat_tau": float(rng.uniform(1, 5))},
    "dynatemp": lambda rng: {"temperature": float(rng.uniform(0.5, 1.5)), "top_k": 40,
                             "dynatemp_range": float(rng.uniform(0.2, 1))},
}


@pytest.fixture(scope="module")
def gpu_llm():  # type: ignore[no-untyped-def]
    from atlas import LLM

    try:
        return LLM(device=ATLAS_DEVICE, spec_k=0, max_seq_len=256)
    except (AtlasError, ImportError) as err:
        if os.environ.get("ATLAS_REQUIRE_GPU") == "1":
            raise
        pytest.skip(f"no CUDA backend here: {err}")


def host_reference(row: np.ndarray, params: SamplingParams, history: list[int], seed: int, steps: int) -> list[int]:
    """The host's picks of `row` [V], `steps` times with one generator, as Engine.pick_tensor draws."""
    rng, picks, mirostat = np.random.default_rng(seed), [], Mirostat(2 * params.mirostat_tau)
    for _ in range(steps):
        uniform = draw_uniform(rng) if params.temperature else 0.0
        chance = draw_uniform(rng) if params.xtc_draws else None
        charged = row - dry_penalties(history + picks, params, row.size) if params.dry else row  # [V]
        if params.mirostat_on:
            picks.append(mirostat.pick(charged, params, uniform))
        else:
            picks.append(choose_token(charged, params, uniform, chance) if params.temperature else host_argmax(charged))
    return picks


@pytest.mark.parametrize("form", sorted(FORMS))
def test_a_device_row_is_picked_as_the_host_picks_it(form: str, gpu_llm, rng: np.random.Generator) -> None:  # type: ignore[no-untyped-def]
    engine = gpu_llm.parts.engine
    assert engine.backend.name != "numpy"
    vocab = gpu_llm.parts.spec.vocab_size
    params = SamplingParams(**FORMS[form](rng))
    assert params.on_host
    row = (rng.standard_normal(vocab) * rng.uniform(1, 4)).astype(np.float32)  # [V]
    history = rng.integers(0, 8, size=40).tolist()  # few ids: repeats for DRY
    seed, steps = int(rng.integers(1 << 30)), 6
    want = host_reference(row, params, history, seed, steps)
    penalties, draws = Penalties(history), np.random.default_rng(seed)
    logits = engine.backend.upload(row[None], "f32")  # [1, V] on the device
    got = [engine.pick_tensor(logits, params, draws, penalties)[0] for _ in range(steps)]
    assert got == want


def test_dry_on_the_gpu_charges_each_repeat(gpu_llm, rng: np.random.Generator) -> None:  # type: ignore[no-untyped-def]
    """Greedy with DRY over a generation: the device's row read back, DRY's penalties taken off."""
    from test_sampling_filters import ZEN_TWICE, dry_check

    prompt = gpu_llm.tokenizer.encode(ZEN_TWICE)
    params = SamplingParams(dry_multiplier=float(rng.uniform(1, 4)), dry_base=float(rng.uniform(1.2, 2)),
                            dry_allowed_length=int(rng.integers(1, 4)))
    tokens = gpu_llm.parts.engine.generate(prompt, 12, params, None, set()).token_ids
    assert tokens != gpu_llm.parts.engine.generate(prompt, 12, SamplingParams(), None, set()).token_ids
    dry_check(gpu_llm.parts.engine, prompt, tokens, params, MARGIN)
