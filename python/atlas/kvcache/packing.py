"""Bit packing of sub-byte codes along the last axis (little-endian within a byte / word)."""

from __future__ import annotations

import numpy as np


def pack_nibbles(codes: np.ndarray) -> np.ndarray:
    """[..., D] codes 0..15 -> [..., D/2] bytes: element 2i in the low nibble, 2i+1 in the high."""
    return (codes[..., 0::2] | (codes[..., 1::2] << 4)).astype(np.uint8)


def unpack_nibbles(packed: np.ndarray) -> np.ndarray:
    """[..., D/2] bytes -> [..., D] codes."""
    out = np.stack([packed & 0xF, packed >> 4], axis=-1)  # [..., D/2, 2]
    return out.reshape(*packed.shape[:-1], packed.shape[-1] * 2).astype(np.uint8)


def pack_triples(codes: np.ndarray) -> np.ndarray:
    """[..., D] codes 0..7 -> [..., 3D/8] bytes: each run of 8 codes is one 24-bit little-endian
    word, code j in bits 3j..3j+2."""
    runs = codes.reshape(*codes.shape[:-1], -1, 8).astype(np.uint32)  # [..., D/8, 8]
    word = np.bitwise_or.reduce(runs << (3 * np.arange(8, dtype=np.uint32)), axis=-1)  # [..., D/8]
    out = np.stack([(word >> shift) & 0xFF for shift in (0, 8, 16)], axis=-1)  # [..., D/8, 3]
    return out.reshape(*codes.shape[:-1], -1).astype(np.uint8)


def unpack_triples(packed: np.ndarray) -> np.ndarray:
    """[..., 3D/8] bytes -> [..., D] codes."""
    b = packed.reshape(*packed.shape[:-1], -1, 3).astype(np.uint32)  # [..., D/8, 3]
    word = b[..., 0] | (b[..., 1] << 8) | (b[..., 2] << 16)  # [..., D/8]
    out = (word[..., None] >> (3 * np.arange(8, dtype=np.uint32))) & 0x7  # [..., D/8, 8]
    return out.reshape(*packed.shape[:-1], -1).astype(np.uint8)
