"""test_qwen_dims_match_transformers' next-token rule (test_gpu_model.next_token_agreement), on the CPU.

The former rule asked 99 % of the 256 next tokens to equal transformers' fp32 argmax. At Qwen3.6 dims
a correct GPU's bf16 roundings move the logits ~1 %: a CPU stand-in of the kernels' roundings (numpy,
a 4-layer checkpoint of the test's weight distributions) flipped 1-5 next tokens per prompt, all at
top-2 gaps under 1.1e-2 of the largest |logit|, and 4 of 9 prompts fell under 99 %. Now positions
within QWEN_NEAR_TIE of a tie are left out of the agreement, and at those the chosen token must be one
of the tied ones. The checkpoint (8.7 GB) and its two forward passes are too heavy for CI, so the
rule is checked here on logits built to have the same structure.
"""

from __future__ import annotations

import numpy as np

from test_gpu_model import QWEN_NEAR_TIE, next_token_agreement

TOKENS, VOCAB = 256, 4096


def logits_with_near_ties(rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(logits [T, V] with clear winners, the positions made near-ties, their runner-up tokens)."""
    logits = rng.standard_normal((TOKENS, VOCAB)).astype(np.float32) * np.exp(rng.standard_normal(VOCAB)).astype(np.float32)
    top = logits.argmax(-1)
    scale = np.abs(logits).max(-1)
    logits[np.arange(TOKENS), top] += scale  # every position clear: gap >= its largest |logit| / 2
    ties = rng.choice(TOKENS, size=20, replace=False)
    runner = (top[ties] + 1 + rng.integers(0, VOCAB - 1, size=ties.size)) % VOCAB
    scale = np.abs(logits).max(-1)
    logits[ties, runner] = logits[ties, top[ties]] - np.float32(0.3 * QWEN_NEAR_TIE) * scale[ties]
    return logits, ties, runner


def test_exact_and_near_tie_flips_pass(rng: np.random.Generator) -> None:
    logits, ties, runner = logits_with_near_ties(rng)
    chosen = logits.argmax(-1)
    assert next_token_agreement(logits, chosen) == (1.0, [])
    chosen[ties] = runner  # rounding took the other token of each near-tie
    assert next_token_agreement(logits, chosen) == (1.0, [])


def test_flips_off_near_ties_fail(rng: np.random.Generator) -> None:
    logits, ties, _ = logits_with_near_ties(rng)
    chosen = logits.argmax(-1)
    clear = np.setdiff1d(np.arange(TOKENS), ties)
    flipped = rng.choice(clear, size=3, replace=False)
    chosen[flipped] = (chosen[flipped] + 1) % VOCAB
    agreement, wild = next_token_agreement(logits, chosen)
    assert agreement < 0.99 and wild == []


def test_another_token_at_a_near_tie_fails(rng: np.random.Generator) -> None:
    logits, ties, runner = logits_with_near_ties(rng)
    chosen = logits.argmax(-1)
    far = next(v for v in range(VOCAB) if v not in (chosen[ties[0]], runner[0]))
    chosen[ties[0]] = far
    assert next_token_agreement(logits, chosen) == (1.0, [int(ties[0])])
