"""Lloyd-Max levels for a unit Gaussian, as printed by `python -m atlas.kvcache.lloyd_max`.

The turbo4 / turbo3 levels divide each WHT-rotated group by its RMS (so it is close to N(0, 1))
and store the index of the nearest level. tests/test_kvcache.py checks these are the Lloyd-Max
fixed point and agree with Max (1960), table I.
"""

from __future__ import annotations

import numpy as np

LLOYD_MAX_3BIT = np.array(
    (-2.151945705, -1.343909279, -0.756005281, -0.245094179, 0.245094179, 0.756005281, 1.343909279,
     2.151945705),
    dtype=np.float32,
)  # MSE 0.034548
LLOYD_MAX_4BIT = np.array(
    (-2.732589571, -2.069017227, -1.618046386, -1.256231197, -0.942340456, -0.656759119,
     -0.388048299, -0.128395030, 0.128395030, 0.388048299, 0.656759119, 0.942340456, 1.256231197,
     1.618046386, 2.069017227, 2.732589571),
    dtype=np.float32,
)  # MSE 0.009501

CODEBOOKS = {3: LLOYD_MAX_3BIT, 4: LLOYD_MAX_4BIT}
