"""Block FP8 (Qwen / DeepSeek "fp8" quant_method): e4m3 weight [N, K] and one scale per block.

`weight_scale_inv` [ceil(N/bn), ceil(K/bk)] multiplies the decoded weight despite its name; edge
blocks are ragged (the format rounds the block count up).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .codes import E4M3_MAX, decode_e4m3, encode_e4m3

Block = tuple[int, int]


@dataclass(frozen=True)
class Fp8BlockWeight:
    weight: np.ndarray  # [N, K] uint8 e4m3 codes
    scale_inv: np.ndarray  # [ceil(N/bn), ceil(K/bk)] float32
    block: Block


def block_grid(shape: tuple[int, ...], block: Block) -> tuple[int, int]:
    """Blocks per dimension of an [N, K] weight (ceil)."""
    return -(-shape[0] // block[0]), -(-shape[1] // block[1])


def expand_blocks(per_block: np.ndarray, shape: tuple[int, int], block: Block) -> np.ndarray:
    """[nb, kb] -> [N, K]: every element gets its block's value."""
    rows = np.repeat(per_block, block[0], axis=0)[: shape[0]]  # [N, kb]
    return np.repeat(rows, block[1], axis=1)[:, : shape[1]]  # [N, K]


def block_amax(w: np.ndarray, block: Block) -> np.ndarray:
    """max |w| of each block, [nb, kb] (ragged edge blocks padded with zeros)."""
    nb, kb = block_grid(w.shape, block)
    padded = np.zeros((nb * block[0], kb * block[1]), dtype=np.float32)
    padded[: w.shape[0], : w.shape[1]] = np.abs(w)
    return padded.reshape(nb, block[0], kb, block[1]).max(axis=(1, 3))  # [nb, kb]


def quantize_fp8_block(w: np.ndarray, block: Block = (128, 128)) -> Fp8BlockWeight:
    """w [N, K] float -> e4m3 codes with scale = amax / 448 per block."""
    w = np.asarray(w, dtype=np.float32)
    scale = (block_amax(w, block) / np.float32(E4M3_MAX)).astype(np.float32)  # [nb, kb]
    per_element = expand_blocks(scale, w.shape, block)  # [N, K]
    safe = np.where(per_element > 0, per_element, np.float32(1.0))
    return Fp8BlockWeight(encode_e4m3(w / safe), scale, block)


def dequantize_fp8_block(weight: np.ndarray, scale_inv: np.ndarray, block: Block) -> np.ndarray:
    """e4m3 [N, K] (bytes or float8 storage) x block scales (any float dtype) -> float32 [N, K]."""
    scale = np.asarray(scale_inv).astype(np.float32)
    expected = block_grid(weight.shape, block)
    if scale.shape != expected:
        raise ValueError(f"scale grid {scale.shape} does not match weight {weight.shape} in {block} blocks")
    return decode_e4m3(weight) * expand_blocks(scale, weight.shape, block)
