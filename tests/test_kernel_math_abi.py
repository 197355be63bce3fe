"""CPU emulations of kernel arithmetic and index math (no GPU needed).

Each test re-states, in numpy, what a kernel computes, in the kernel's own order (its tiles,
splits, rounding recipe), and compares it with the float32 reference backend, so a wrong
recipe or tiling shows up here before the device runs.
"""

from __future__ import annotations

import numpy as np

from atlas.backends.numpy_backend import rope_cos_sin


def rope_angles_as_kernel(positions: np.ndarray, rotary_dim: int, theta: float) -> np.ndarray:
    """rope.cuh: exponent = f32(2i) / f32(R); power = f32(pow(double theta, double exponent));
    angle = f32(position) * (1 / power), each step rounded to float32."""
    i = np.arange(rotary_dim // 2)
    exponent = (2 * i).astype(np.float32) / np.float32(rotary_dim)  # [R/2]
    power = np.power(np.float64(np.float32(theta)), exponent.astype(np.float64)).astype(np.float32)
    inv_freq = np.float32(1.0) / power  # [R/2]
    return positions.astype(np.float32)[:, None] * inv_freq[None, :]  # [T, R/2]


def test_rope_angle_recipe_matches_the_reference_bit_for_bit(rng: np.random.Generator) -> None:
    positions = np.concatenate([rng.integers(0, 262_144, size=200), [0, 1, 262_143]]).astype(np.int32)
    for rotary_dim, theta in ((64, 10_000_000.0), (16, 10_000.0), (128, 1_000_000.0)):
        angles = rope_angles_as_kernel(positions, rotary_dim, theta)  # [T, R/2]
        cos, sin = rope_cos_sin(positions, rotary_dim, theta)  # [T, R]
        want = np.cos(np.concatenate([angles, angles], axis=-1))
        np.testing.assert_array_equal(cos, want)
        exact = positions.astype(np.float64)[:, None] * theta ** (-np.arange(0, rotary_dim, 2) / rotary_dim)
        # the f32 recipe is not the exact angle: the kernel must not "improve" on it
        assert np.abs(angles.astype(np.float64) - exact).max() > 1e-4
        assert sin.shape == cos.shape


def test_rope_angle_recipe_matches_transformers(rng: np.random.Generator) -> None:
    torch = __import__("pytest").importorskip("torch")
    positions = rng.integers(0, 262_144, size=300).astype(np.int32)
    for rotary_dim, theta in ((64, 10_000_000.0), (16, 10_000.0)):
        # transformers' default rope init and forward (float32 throughout)
        inv_freq = 1.0 / (theta ** (torch.arange(0, rotary_dim, 2, dtype=torch.int64).float() / rotary_dim))
        freqs = inv_freq[:, None].float() @ torch.from_numpy(positions)[None, :].float()  # [R/2, T]
        np.testing.assert_array_equal(rope_angles_as_kernel(positions, rotary_dim, theta), freqs.T.numpy())
