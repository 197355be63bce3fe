"""Partial rotary embedding: the frequency table and the cos/sin scale of plain RoPE and YaRN
(mrope with equal text positions reduces to plain rope)."""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from ..backends.base import Backend, Tensor
from ..config import ModelSpec, Yarn


@dataclass(frozen=True)
class Rotary:
    inv_freq: Tensor  # [R/2] f32 on the backend: the angle of pair i at position p is p * inv_freq[i]
    scaling: float  # cos and sin are multiplied by it (YaRN's attention factor; 1 for plain RoPE)

    @property
    def rotary_dim(self) -> int:  # the leading dims of a head that rotate
        return 2 * self.inv_freq.shape[0]


def model_rotary(backend: Backend, spec: ModelSpec) -> Rotary:
    """The one table a model's attention layers share, on the backend."""
    inv_freq, scaling = rope_frequencies(spec)
    return Rotary(backend.upload(inv_freq, "f32"), scaling)


def rope_frequencies(spec: ModelSpec) -> tuple[np.ndarray, float]:
    """(inv_freq [R/2] f32, cos/sin scale) for the checkpoint's rope settings."""
    if spec.rope_yarn is None:
        return default_inv_freq(spec.rotary_dim, spec.rope_theta), 1.0
    return yarn_inv_freq(spec.rotary_dim, spec.rope_theta, spec.rope_yarn), spec.rope_yarn.attention_factor


def default_inv_freq(rotary_dim: int, theta: float) -> np.ndarray:
    """1 / theta^(2i/R) rounded to float32, as transformers computes it, with the power correctly
    rounded (numpy's float32 power is off by an ulp for some exponents, and so is torch's
    vectorised one on some CPUs for some theta and R: transformers' own table then differs by that ulp)."""
    return np.float32(1.0) / _powers(rotary_dim, theta)  # [R/2]


def yarn_inv_freq(rotary_dim: int, theta: float, yarn: Yarn) -> np.ndarray:
    """YaRN's blend of interpolated (inv_freq / factor) and original frequencies: pairs that turn
    fewer than beta_slow times over the original context are interpolated, those turning more than
    beta_fast times kept, a linear ramp between. Float32 step by step as transformers computes it
    (the powers as default_inv_freq's)."""
    powers = _powers(rotary_dim, theta)  # [R/2]
    extrapolation = np.float32(1.0) / powers
    interpolation = np.float32(1.0) / (np.float32(yarn.factor) * powers)
    low, high = _correction_range(rotary_dim, theta, yarn)
    if low == high:
        high += 0.001  # a step instead of a ramp, as transformers does
    ramp = (np.arange(rotary_dim // 2, dtype=np.float32) - np.float32(low)) / np.float32(high - low)
    keep = np.float32(1.0) - np.clip(ramp, np.float32(0.0), np.float32(1.0))  # 1: original frequency
    return interpolation * (np.float32(1.0) - keep) + extrapolation * keep


def _powers(rotary_dim: int, theta: float) -> np.ndarray:
    exponents = np.arange(0, rotary_dim, 2, dtype=np.float32) / np.float32(rotary_dim)  # [R/2]
    return np.power(np.float64(np.float32(theta)), exponents.astype(np.float64)).astype(np.float32)


def _correction_range(rotary_dim: int, theta: float, yarn: Yarn) -> tuple[float, float]:
    """The pair indices where the ramp starts and ends (YaRN's find_correction_range)."""

    def dim_turning(rotations: float) -> float:  # the pair that turns `rotations` times over the context
        wavelengths = yarn.original_max_position_embeddings / (rotations * 2 * math.pi)
        return rotary_dim * math.log(wavelengths) / (2 * math.log(theta))

    low, high = dim_turning(yarn.beta_fast), dim_turning(yarn.beta_slow)
    if yarn.truncate:
        low, high = math.floor(low), math.ceil(high)
    return max(low, 0), min(high, rotary_dim - 1)
