"""The GPU router tests' rule for the routed ids (test_gpu_moe_shared.routed_ids_agree), checked
on the CPU against ids computed as the router kernel computes them (f32 activations, bf16 weights;
the sums in float64 here, nearer to the kernel's f32 sums than any reference's rounding) at
Qwen3.6's E = 256, k = 8 and the GPU test's logit scale: a device session must not spend its
minutes on a test that fails for a near-tie between the references' roundings."""

from __future__ import annotations

import numpy as np

from atlas.backends.numpy_backend import NumpyBackend
from test_gpu_moe_shared import reference_ids, routed_ids_agree
from test_gpu_ops import bf16_round, normal, weight

EXPERTS, TOP_K, HIDDEN = 256, 8, 2048  # qwen3.6-35b-a3b
DRAWS, TOKENS = 12, 9  # test_gpu_moe_shared's case with the fewest tokens per allowed mismatch


def kernel_ids(x: np.ndarray, w: np.ndarray, renormalize: bool) -> np.ndarray:
    ids, _ = NumpyBackend().router(x.astype(np.float64), bf16_round(w).astype(np.float64), TOP_K, renormalize,
                                   shared_expert=True)
    return ids.astype(np.int32)  # [T, k + 1]


def test_rule_accepts_the_kernels_arithmetic(rng: np.random.Generator) -> None:
    for _ in range(DRAWS):
        x, w = normal(rng, TOKENS, HIDDEN), weight(rng, EXPERTS + 1, HIDDEN) * 4  # as test_router_shared_slot
        renormalize = bool(rng.integers(0, 2))
        same = routed_ids_agree(kernel_ids(x, w, renormalize), x, w, TOP_K, renormalize)
        assert same.mean() >= 0.9, f"{(~same).sum()} of {TOKENS} tokens rejected"


def test_rule_rejects_other_experts(rng: np.random.Generator) -> None:
    """Experts in the wrong slot order, or one expert replaced, are rejected, except on a token
    whose references themselves disagree there (a near-tie: once in ~30 runs of 9 tokens, seed
    2506145033 in CI, whose bf16 reference ordered the first two experts the other way)."""
    x, w = normal(rng, TOKENS, HIDDEN), weight(rng, EXPERTS + 1, HIDDEN) * 4
    ids = kernel_ids(x, w, True)
    refs = reference_ids(x, w, TOP_K, True)
    swapped = ids.copy()
    swapped[:, [0, 1]] = swapped[:, [1, 0]]  # the right experts in the wrong slot order
    settled = np.logical_and.reduce([(r[:, :2] == refs[0][:, :2]).all(-1) for r in refs])  # [T]
    assert not routed_ids_agree(swapped, x, w, TOP_K, True)[settled].any() and settled.mean() >= 0.5
    other = ids.copy()
    other[:, TOP_K - 1] = [next(e for e in range(EXPERTS) if e not in row) for row in ids]  # [T]
    listed = np.logical_or.reduce([(r[:, :TOP_K] == other[:, TOP_K - 1 : TOP_K]).any(-1) for r in refs])  # [T]
    assert not routed_ids_agree(other, x, w, TOP_K, True)[~listed].any() and (~listed).mean() >= 0.5
