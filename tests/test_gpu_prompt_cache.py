"""The prompt cache on the GPU (demo model): a prompt resumed from a checkpoint (DeltaNet states
copied back on the device, KV rows kept) gives logits as close to the numpy reference's as a fresh
prefill's, and the same greedy tokens through the device token chain and graph replay."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from atlas.backends.base import SamplingParams
from atlas.prompt_cache import CHECKPOINT_TAIL, MIN_TAIL_PROMPT
from test_gpu_model import PASSES_FLOOR, demo_text_excerpt, gpu_llm

pytestmark = pytest.mark.gpu

STEPS = 16
AFTER = 2  # prompt tokens after the resume point: the demo's DeltaNet layers forget a state in ~8 tokens


@pytest.fixture(scope="module")
def demo_gpu() -> Any:
    return gpu_llm()


def chain(engine: Any, logits: Any, position: int) -> list[int]:
    """STEPS greedy tokens through pick_tensor -> decode_tensor (the device id fed back)."""
    rng = np.random.default_rng(0)
    token, token_t = engine.pick_tensor(logits, SamplingParams(), rng)
    tokens = [token]
    for step in range(STEPS - 1):
        token, token_t = engine.pick_tensor(engine.decode_tensor(token_t, position + step, token), SamplingParams(), rng)
        tokens.append(token)
    return tokens


def delta_states(engine: Any) -> list[np.ndarray]:
    """Every DeltaNet layer's conv and recurrent state, float64."""
    from atlas.layers.linear_attention import DeltaNetState

    states = [s for s in engine.states if isinstance(s, DeltaNetState)]
    return [engine.backend.to_numpy(t).astype(np.float64) for s in states for t in (s.conv, s.recurrent)]


def relative_error(got: np.ndarray, want: np.ndarray) -> float:
    return float(np.linalg.norm(got - want) / np.linalg.norm(want))


@pytest.mark.parametrize("cut", ["end", "tail"])
def test_resume_on_the_gpu_matches_a_fresh_prefill(demo_gpu: Any, rng: np.random.Generator, cut: str) -> None:
    """The first prompt, STEPS decoded tokens (so the live state has moved past it), then a second
    prompt that leaves the first at its end or CHECKPOINT_TAIL tokens before: it resumes at a checkpoint. Its
    logits and DeltaNet states are as close to numpy's fresh prefill as the GPU's fresh prefill's
    are (within twice their error plus a floor), and its greedy tokens are the same."""
    from atlas import LLM

    engine = demo_gpu.parts.engine
    assert engine.prompt_cache.enabled, "LLM keeps prompt-cache checkpoints by default"
    text = demo_text_excerpt(demo_gpu, rng, MIN_TAIL_PROMPT + 40, 300)
    split = len(text) - 20
    resume_at = split if cut == "end" else split - CHECKPOINT_TAIL
    second = text[:resume_at] + text[resume_at + 1 : resume_at + 1 + AFTER]  # a token left out: no live reuse
    cpu = LLM(device="cpu").parts.engine
    want = np.asarray(cpu.prefill(second), dtype=np.float64)  # [1, V]
    want_states = delta_states(cpu)

    engine.reset()
    chain(engine, engine.prefill(text[:split]), split)
    resumed = engine.prefill(second)
    assert engine.prompt_cache.last_hit == resume_at
    runs = [(engine.backend.to_numpy(resumed).astype(np.float64), delta_states(engine), chain(engine, resumed, len(second)))]
    engine.reset()  # the same prompt from position 0
    fresh = engine.prefill(second)
    assert engine.prompt_cache.last_hit == 0
    runs.append((engine.backend.to_numpy(fresh).astype(np.float64), delta_states(engine), chain(engine, fresh, len(second))))

    (resumed_logits, resumed_states, resumed_tokens), (fresh_logits, fresh_states, fresh_tokens) = runs
    got, base = relative_error(resumed_logits, want), relative_error(fresh_logits, want)
    assert got <= 2 * base + PASSES_FLOOR, f"logits: resumed {got:.3e}, fresh {base:.3e}"
    for i, (r, f, w) in enumerate(zip(resumed_states, fresh_states, want_states, strict=True)):
        got, base = relative_error(r, w), relative_error(f, w)
        assert got <= 2 * base + PASSES_FLOOR, f"DeltaNet state {i}: resumed {got:.3e}, fresh {base:.3e}"
    assert resumed_tokens == fresh_tokens
