"""The fused attention prep (ATLAS_ATTENTION_PREP=fused, issue 4's decode launches) on the CPU: the
form switch, and the launches of one demo decode step on the emulated driver: one
atlas_attention_prep in place of two atlas_head_norm_rope and an atlas_kv_cache_write per
full-attention layer, and the output gate inside atlas_attention_combine (no atlas_sigmoid_mul);
with a dump attached the prep kernel serves (the dump has no .q / .k) and the gate stays apart (the
dump has .core and .gated); a quantized KV cache keeps the separate ops. The numerics are
tests/test_gpu_attention_prep.py's."""

from __future__ import annotations

from collections import Counter
from typing import Any

import numpy as np
import pytest

from atlas.backends.cuda import ops_dense
from atlas.backends.cuda.backend import CudaBackend
from atlas.config import load_spec
from atlas.demo import DEMO_DIR
from atlas.engine import Engine
from atlas.errors import AtlasError
from atlas.kvcache import KVCacheOptions
from atlas.safetensors import Checkpoint
from test_cuda_select import make_runtime

SEPARATE = ("atlas_head_norm_rope", "atlas_kv_cache_write")
FUSED = "atlas_attention_prep"
GATE = "atlas_sigmoid_mul"  # the attention output gate (the MoE's shared-expert gate is another kernel)


def decode_launches(form: str, *, dump: dict[str, Any] | None = None, kv: KVCacheOptions | None = None) -> Counter[str]:
    """The kernels of one decode step after a 5-token prompt on the demo, counted."""
    rt, driver = make_runtime(arena_bytes=8 << 20)
    backend = CudaBackend(rt, use_graphs=False, attention_prep=form)
    engine = Engine(load_spec(DEMO_DIR), Checkpoint.open(DEMO_DIR), backend, max_seq_len=64, kv_cache=kv)
    if dump is not None:
        engine.dump = lambda name, tensor: dump.setdefault(name, tensor)
    engine.prefill([1, 2, 3, 4, 5])
    first = len(driver.launches)
    engine.decode(6, 5)
    return Counter(name for name, *_ in driver.launches[first:])


def other_kernels(launched: Counter[str]) -> dict[str, int]:
    return {name: n for name, n in launched.items() if name not in (*SEPARATE, FUSED, GATE)}


def full_attention_layers() -> int:
    return load_spec(DEMO_DIR).layer_types.count("full_attention")


@pytest.mark.parametrize("dumped", [False, True])
def test_fused_prep_is_one_launch_per_full_attention_layer(dumped: bool) -> None:
    layers = full_attention_layers()
    names: dict[str, Any] = {}
    separate, fused = decode_launches("separate"), decode_launches("fused", dump=names if dumped else None)
    assert layers > 0 and (separate[SEPARATE[0]], separate[SEPARATE[1]], separate[FUSED]) == (2 * layers, layers, 0)
    assert (fused[SEPARATE[0]], fused[SEPARATE[1]], fused[FUSED]) == (0, 0, layers)
    assert separate[GATE] == layers and fused[GATE] == (layers if dumped else 0)
    if not dumped:
        assert sum(separate.values()) - sum(fused.values()) == 3 * layers
        assert other_kernels(separate) == other_kernels(fused)
    else:
        attention = {name.rsplit(".", 1)[1] for name in names if ".attn." in name and name.startswith("layer.")}
        assert {"v", "core", "gated"} <= attention and not {"q", "k"} & attention


def test_a_quantized_kv_cache_keeps_the_separate_ops() -> None:
    launched = decode_launches("fused", kv=KVCacheOptions("fp8", high_precision_layers=0))
    layers = full_attention_layers()
    assert launched[FUSED] == 0 and launched["atlas_head_norm_rope"] == 2 * layers and launched[GATE] == layers


def test_attention_prep_form_is_checked(monkeypatch: pytest.MonkeyPatch) -> None:
    rt, _ = make_runtime(arena_bytes=1 << 20)
    monkeypatch.setenv(ops_dense.ATTENTION_PREP_ENV, "fused")
    assert CudaBackend(rt, use_graphs=False).attention_prep_form == "fused"
    assert "fused attention prep" in CudaBackend(rt, use_graphs=False).describe()
    monkeypatch.setenv(ops_dense.ATTENTION_PREP_ENV, "")
    assert CudaBackend(rt, use_graphs=False).attention_prep_form == "separate"
    monkeypatch.setenv(ops_dense.ATTENTION_PREP_ENV, "fuse")
    with pytest.raises(AtlasError, match="^ATLAS_ATTENTION_PREP='fuse' is not a attention prep form; use 'separate'"):
        CudaBackend(rt, use_graphs=False)


def test_numpy_backend_composes_the_same_ops(rng: np.random.Generator) -> None:
    """full_attention is head_norm_rope of q and k, then attention, then the output gate, on the reference."""
    from atlas.backends.base import AttentionInputs, AttentionOperands, KVCache
    from atlas.backends.numpy_backend import NumpyBackend
    from atlas.layers.rotary import default_inv_freq

    be, (t, hq, hkv, d) = NumpyBackend(), (3, 4, 2, 32)
    q, k, v = (rng.standard_normal((t, h, d), dtype=np.float32) for h in (hq, hkv, hkv))
    q_norm, k_norm = rng.standard_normal(d, dtype=np.float32), rng.standard_normal(d, dtype=np.float32)
    positions, inv_freq = np.arange(7, 7 + t, dtype=np.int32), default_inv_freq(16, 1e4)
    caches = [KVCache(np.zeros((16, hkv, d), np.float32), np.zeros((16, hkv, d), np.float32)) for _ in range(2)]
    gate = rng.standard_normal((t, hq, d), dtype=np.float32)
    fused = be.full_attention(AttentionInputs(q, k, v, positions, gate),
                              AttentionOperands(q_norm, k_norm, 1e-6, 0.5, inv_freq, 1.25, caches[0], 0.2))
    apart = be.attention(be.head_norm_rope(q, q_norm, positions, inv_freq, 1.25, 1e-6),
                         be.head_norm_rope(k, k_norm, positions, inv_freq, 1.25, 0.5), v, caches[1], positions, 0.2)
    np.testing.assert_array_equal(fused, be.sigmoid_mul(apart, gate))
    np.testing.assert_array_equal(caches[0].k, caches[1].k)
    assert not be.fuses_full_attention(caches[0])
