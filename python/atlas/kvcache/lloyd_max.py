"""Lloyd-Max codebooks for a unit Gaussian: derivation and the fixed-point check.

`python -m atlas.kvcache.lloyd_max` prints the constants shipped in codebooks.py. A Lloyd step
puts every threshold at the midpoint of its two levels and every level at the centroid (the
conditional mean of N(0, 1)) of its cell; the Lloyd-Max quantiser is the fixed point.
"""

from __future__ import annotations

import math

import numpy as np

TOLERANCE = 1e-14
MAX_STEPS = 200_000


def _pdf(t: np.ndarray) -> np.ndarray:
    return np.exp(-0.5 * t * t) / math.sqrt(2.0 * math.pi)


def _cdf(t: np.ndarray) -> np.ndarray:
    return np.array([0.5 * math.erfc(-v / math.sqrt(2.0)) for v in t])


def cell_edges(levels: np.ndarray) -> np.ndarray:
    """[L] levels -> [L+1] cell edges: -inf, the midpoints, +inf."""
    mid = (levels[1:] + levels[:-1]) / 2.0
    return np.concatenate([[-np.inf], mid, [np.inf]])


def lloyd_step(levels: np.ndarray) -> np.ndarray:
    """One Lloyd iteration for N(0, 1): each level -> the centroid of its nearest-neighbour cell."""
    edges = cell_edges(np.asarray(levels, dtype=np.float64))
    mass = np.diff(_cdf(edges))  # [L]
    return -np.diff(_pdf(edges)) / mass


def distortion(levels: np.ndarray) -> float:
    """E[(X - Q(X))^2] for X ~ N(0, 1) and nearest-level Q, in closed form per cell."""
    c = np.asarray(levels, dtype=np.float64)
    edges = cell_edges(c)
    a, b = edges[:-1], edges[1:]
    mass = np.diff(_cdf(edges))
    first = -np.diff(_pdf(edges))  # integral of x pdf over the cell
    tail = lambda t: np.where(np.isfinite(t), t * _pdf(np.where(np.isfinite(t), t, 0.0)), 0.0)
    second = mass + tail(a) - tail(b)  # integral of x^2 pdf over the cell
    return float(np.sum(second - 2.0 * c * first + c * c * mass))


def derive(bits: int) -> np.ndarray:
    """The 2^bits Lloyd-Max levels for N(0, 1), ascending, float64."""
    count = 2**bits
    levels = np.linspace(-2.0, 2.0, count)
    for _ in range(MAX_STEPS):
        updated = lloyd_step(levels)
        if np.max(np.abs(updated - levels)) < TOLERANCE:
            return updated
        levels = updated
    raise RuntimeError(f"Lloyd iterations for {bits} bits did not converge in {MAX_STEPS} steps")


def main() -> None:
    for bits in (3, 4):
        levels = derive(bits)
        body = ", ".join(f"{v:.9f}" for v in levels)
        print(f"LLOYD_MAX_{bits}BIT = ({body})  # MSE {distortion(levels):.6f}")


if __name__ == "__main__":
    main()
