"""`--check-weights` (llama.cpp's --check-tensors): every float tensor of the checkpoint read once
and checked for NaN and infinity before the model loads. A damaged download or a broken conversion
otherwise runs and writes garbage; reading a 70 GB checkpoint takes about a minute, so it is opt-in.

The test is on the stored bits (an all-ones exponent), so no tensor is converted to float32 and
the memory-mapped files are read in bounded slices.
"""

from __future__ import annotations

import math
import sys

import numpy as np

from .errors import AtlasError
from .safetensors import Checkpoint

# safetensors float dtype -> (its bits as an unsigned type, the exponent mask); a value is not
# finite when all its exponent bits are set (float8_e4m3fn has no infinity: its only such codes,
# S.1111.111, are NaN)
EXPONENT_BITS: dict[str, tuple[type[np.unsignedinteger], int]] = {
    "F64": (np.uint64, 0x7FF0_0000_0000_0000),
    "F32": (np.uint32, 0x7F80_0000),
    "F16": (np.uint16, 0x7C00),
    "BF16": (np.uint16, 0x7F80),
    "F8_E4M3": (np.uint8, 0x7F),
    "F8_E5M2": (np.uint8, 0x7C),
}
SLICE_BYTES = 64 << 20  # the temporaries of one slice stay this small on any tensor


def nonfinite_count(raw: np.ndarray, dtype: str) -> int:
    """How many of a stored tensor's values are NaN or infinite (`dtype`: its safetensors dtype)."""
    unsigned, mask = EXPONENT_BITS[dtype]
    bits = raw.reshape(-1).view(unsigned)  # [numel]
    exponent = unsigned(mask)
    step = max(1, SLICE_BYTES // bits.itemsize)
    return sum(int(np.count_nonzero((bits[i : i + step] & exponent) == exponent)) for i in range(0, bits.size, step))


def check_weights(checkpoint: Checkpoint) -> None:
    """AtlasError naming the first tensor (in name order) that holds a NaN or an infinity; a
    progress bar on stderr while it reads."""
    from tqdm import tqdm

    names = [n for n in checkpoint.names() if checkpoint.dtype(n) in EXPONENT_BITS]
    total = sum(checkpoint.info(n).nbytes for n in names)
    with tqdm(total=total, desc="checking weights", unit="B", unit_scale=True, file=sys.stderr, leave=False) as bar:
        for name in names:
            info = checkpoint.info(name)
            count = nonfinite_count(checkpoint.get_raw(name), info.dtype)
            if count:
                raise AtlasError(
                    f"tensor {name!r} in {info.path} holds {count} NaN or infinite value(s) of "
                    f"{math.prod(info.shape)}; the checkpoint is damaged: "
                    "fetch it again, or redo the conversion that wrote it"
                )
            bar.update(info.nbytes)
