"""The shared expert as routed slot k (issue 4, decode launches): the router's shared slot on the
numpy reference and in an emulation of the router kernels' index math (RouterParams.shared_expert),
the stacked MoE equal to the separate composition, the loader's choice of path (float, packed,
mixed), the dumps of the stacked path, and one decode step's launches on the emulated driver."""

from __future__ import annotations

import ctypes
import sys
from collections import Counter
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from _checkpoints import TinyModel, write_checkpoint
from atlas.backends.numpy_backend import NumpyBackend
from atlas.config import load_spec
from atlas.demo import DEMO_DIR
from atlas.engine import Engine
from atlas.kernel_params import linear_moe as kp
from atlas.quant.writer import write_safetensors
from atlas.quantize import QuantizeArgs, quantize
from atlas.safetensors import Checkpoint

STACKED = TinyModel(moe_intermediate_size=32, shared_expert_intermediate_size=32, num_experts=6, num_experts_per_tok=2)
MOE_KERNELS = ("atlas_router_logits", "atlas_router_top_k", "atlas_moe_gate_up_gemv", "atlas_moe_down_gemv_k")
SEPARATE_KERNELS = ("atlas_silu_mul", "atlas_add_sigmoid_scaled")


def _sigmoid(x: np.ndarray) -> np.ndarray:
    return 1.0 / (1.0 + np.exp(-x))


def _router_case(rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray, int]:
    tokens, experts, hidden = int(rng.integers(1, 20)), int(rng.integers(4, 40)), 8 * int(rng.integers(2, 10))
    x = rng.standard_normal((tokens, hidden), dtype=np.float32)  # [T, H]
    weight = rng.standard_normal((experts + 1, hidden), dtype=np.float32) * np.float32(2 / np.sqrt(hidden))  # [E + 1, H]
    return x, weight, int(rng.integers(1, experts + 1))


# --- the op ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("renormalize", [True, False])
def test_router_shared_slot_follows_the_routed_top_k(rng: np.random.Generator, renormalize: bool) -> None:
    be = NumpyBackend()
    x, weight, top_k = _router_case(rng)
    experts = weight.shape[0] - 1
    ids, weights = be.router(x, weight, top_k, renormalize, shared_expert=True)
    routed_ids, routed_weights = be.router(x, weight[:experts], top_k, renormalize)
    assert ids.shape == weights.shape == (x.shape[0], top_k + 1)
    assert ids.dtype == np.int32 and weights.dtype == np.float32
    np.testing.assert_array_equal(ids[:, :top_k], routed_ids)  # softmax, top-k, renormalisation over E only
    np.testing.assert_array_equal(weights[:, :top_k], routed_weights)
    assert (ids[:, top_k] == experts).all()
    gate = _sigmoid(x.astype(np.float64) @ weight[experts].astype(np.float64))  # [T]
    np.testing.assert_allclose(weights[:, top_k], gate, rtol=1e-5)


def test_stacked_experts_equal_routed_plus_gated_shared(rng: np.random.Generator) -> None:
    """Bit for bit: the numpy reference stays token-exact with transformers on the stacked path."""
    be = NumpyBackend()
    x, router, top_k = _router_case(rng)
    experts, hidden = router.shape[0] - 1, x.shape[1]
    inter = 8 * int(rng.integers(1, 6))
    gate_up = rng.standard_normal((experts + 1, 2 * inter, hidden), dtype=np.float32) / np.float32(np.sqrt(hidden))
    down = rng.standard_normal((experts + 1, hidden, inter), dtype=np.float32) / np.float32(np.sqrt(inter))
    ids, weights = be.router(x, router[:experts], top_k, True)  # [T, k]
    routed = be.moe_experts(x, ids, weights, gate_up[:experts], down[:experts])
    shared = be.linear(be.silu_mul(be.linear(x, gate_up[experts])), down[experts])  # [T, H]
    separate = be.add_sigmoid_scaled(routed, shared, be.linear(x, router[experts:]))
    slot_ids, slot_weights = be.router(x, router, top_k, True, shared_expert=True)  # [T, k + 1]
    np.testing.assert_array_equal(be.moe_experts(x, slot_ids, slot_weights, gate_up, down), separate)


# --- the kernels' index math (router.cuh) ---------------------------------------------------------
def test_router_params_keep_their_size_with_the_shared_flag() -> None:
    assert ctypes.sizeof(kp.RouterParams) == 6 * 8 + 6 * 4  # pointers incl. the fused router's arrivals
    assert kp.RouterParams.shared_expert.offset == ctypes.sizeof(kp.RouterParams) - 4


def emulate_router(p: kp.RouterParams, x: np.ndarray, weight: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """router_logits + router_top_k on flat buffers with the kernels' strides: logits
    t * (E + s) + e, ids / weights t * (k + s) + j, slot k = (E, sigmoid(logit E))."""
    experts, top_k, shared = p.num_experts, p.top_k, p.shared_expert
    columns, slots = experts + shared, top_k + shared
    logits = np.full(p.num_tokens * columns, np.nan, np.float32)
    for t in range(p.num_tokens):
        for e in range(columns):
            logits[t * columns + e] = x[t] @ weight[e]
    ids, weights = np.full(p.num_tokens * slots, -1, np.int32), np.full(p.num_tokens * slots, np.nan, np.float32)
    for t in range(p.num_tokens):
        row = logits[t * columns : t * columns + experts]
        probs = np.exp(row - row.max())
        probs /= probs.sum()
        picked = np.argsort(-probs, kind="stable")[:top_k]
        ids[t * slots : t * slots + top_k] = picked
        chosen = probs[picked] / (probs[picked].sum() if p.renormalize else 1.0)
        weights[t * slots : t * slots + top_k] = chosen
        if shared:
            ids[t * slots + top_k] = experts
            weights[t * slots + top_k] = _sigmoid(logits[t * columns + experts])
    return ids.reshape(p.num_tokens, slots), weights.reshape(p.num_tokens, slots)


@pytest.mark.parametrize("shared", [0, 1])
def test_router_kernel_strides_equal_the_op(rng: np.random.Generator, shared: int) -> None:
    x, weight, top_k = _router_case(rng)
    weight = weight[: weight.shape[0] - 1 + shared]
    params = kp.RouterParams(num_tokens=x.shape[0], hidden=x.shape[1], num_experts=weight.shape[0] - shared,
                             top_k=top_k, renormalize=1, shared_expert=shared)
    ids, weights = emulate_router(params, x, weight)
    want_ids, want_weights = NumpyBackend().router(x, weight, top_k, True, shared_expert=bool(shared))
    np.testing.assert_array_equal(ids, want_ids)
    np.testing.assert_allclose(weights, want_weights, rtol=1e-5)


# --- the loader's choice --------------------------------------------------------------------------
class PackingBackend(NumpyBackend):
    """The CUDA backend's loader hooks on the host: packed stacks recorded, then dequantized."""

    def __init__(self) -> None:
        super().__init__()
        self.stacks: list[tuple[int, int]] = []  # (matrices, experts)

    def upload_quantized(self, weight: Any) -> np.ndarray:
        from atlas.backends.cuda.quant_weights import from_quantized_weight

        return from_quantized_weight(weight).dequantize()

    def upload_quantized_rows(self, weights: list[Any], rows: np.ndarray | None, experts: int) -> np.ndarray:
        from atlas.backends.cuda.quant_weights import from_quantized_weight, stack_rows

        self.stacks.append((len(weights), experts))
        host = stack_rows([from_quantized_weight(w) for w in weights])
        dense = (host if rows is None else host.take_rows(rows)).dequantize()
        return dense.reshape(experts, -1, host.k) if experts else dense


def _engine(model_dir: Path, backend: NumpyBackend | None = None) -> Engine:
    return Engine(load_spec(model_dir), Checkpoint.open(model_dir), backend or NumpyBackend(), max_seq_len=64)


def _moe_blocks(engine: Engine) -> list[Any]:
    return [layer.ffn for layer in engine.model.layers]


@pytest.mark.parametrize("layout", ["per_expert", "fused"])
def test_equal_sizes_stack_the_shared_expert(tmp_path: Path, rng: np.random.Generator, layout: str) -> None:
    tiny = replace(STACKED, layout=layout)
    write_checkpoint(tmp_path, tiny, int(rng.integers(0, 2**31)))
    for moe in _moe_blocks(_engine(tmp_path)):
        assert moe.shared is None
        assert moe.router.shape == (tiny.num_experts + 1, tiny.hidden_size)
        assert moe.gate_up.shape == (tiny.num_experts + 1, 2 * tiny.moe_intermediate_size, tiny.hidden_size)
        assert moe.down.shape == (tiny.num_experts + 1, tiny.hidden_size, tiny.moe_intermediate_size)
    different = TinyModel(shared_expert_intermediate_size=48)
    write_checkpoint(tmp_path / "apart", different, int(rng.integers(0, 2**31)))
    for moe in _moe_blocks(_engine(tmp_path / "apart")):
        assert moe.shared is not None and moe.router.shape == (different.num_experts, different.hidden_size)


def assert_close(ours: np.ndarray, expected: np.ndarray) -> None:
    """Same weights, summed in other orders (stacked vs separate matrices): float32 rounding only."""
    assert np.abs(ours - expected).max() <= 1e-4 * np.abs(expected).max()


def _shared_expert_unquantized(quantized: Path, out: Path) -> Path:
    """The quantized checkpoint with every shared expert stored dequantized (f32, no scales)."""
    checkpoint = Checkpoint.open(quantized)
    from atlas.quant.stored import QuantizedTensors

    view = QuantizedTensors.of(checkpoint)
    tensors = {}
    for name in checkpoint.names():
        base = name.rsplit(".", 1)[0] + ".weight"
        if ".shared_expert." in name and view.holds(base):
            if name == base:
                tensors[name] = view.weight(name).dequantize()
            continue
        tensors[name] = np.array(checkpoint.get_raw(name))
    out.mkdir()
    write_safetensors(out / "model.safetensors", tensors)
    for extra in quantized.iterdir():
        if extra.suffix == ".json" and not extra.name.startswith("model.safetensors"):
            (out / extra.name).write_text(extra.read_text())
    return out


@pytest.mark.parametrize("method", ["fp8", "nvfp4"])
def test_quantized_shared_expert_packs_with_the_experts(tmp_path: Path, rng: np.random.Generator, method: str) -> None:
    write_checkpoint(tmp_path / "src", STACKED, int(rng.integers(0, 2**31)))
    quantized = quantize(QuantizeArgs(str(tmp_path / "src"), method, tmp_path / method, 1 << 30))
    ids = rng.integers(0, STACKED.vocab_size, 20).tolist()
    packing = PackingBackend()
    engine = _engine(quantized, packing)
    experts, layers = STACKED.num_experts + 1, STACKED.num_hidden_layers
    assert packing.stacks.count((2 * experts, experts)) == layers and packing.stacks.count((experts, experts)) == layers
    assert all(moe.shared is None for moe in _moe_blocks(engine))
    assert_close(engine.logits(ids), _engine(quantized).logits(ids))
    mixed = _shared_expert_unquantized(quantized, tmp_path / "mixed")
    packing = PackingBackend()
    engine = _engine(mixed, packing)  # experts packed, shared expert not: they run apart
    assert packing.stacks.count((2 * STACKED.num_experts, STACKED.num_experts)) == layers
    assert all(moe.shared is not None for moe in _moe_blocks(engine))
    assert_close(engine.logits(ids), _engine(mixed).logits(ids))


# --- dumps ----------------------------------------------------------------------------------------
def test_stacked_dumps_hold_the_routed_and_shared_parts(rng: np.random.Generator) -> None:
    engine = _engine(DEMO_DIR)
    assert all(moe.shared is None for moe in _moe_blocks(engine))
    prompt = rng.integers(0, engine.spec.vocab_size, 9).tolist()
    plain = engine.logits(prompt)
    captured: dict[str, np.ndarray] = {}
    engine.dump = lambda name, tensor: captured.__setitem__(name, np.array(tensor))
    np.testing.assert_array_equal(engine.logits(prompt), plain)  # the dumps change nothing
    checkpoint, spec = Checkpoint.open(DEMO_DIR), engine.spec
    read = lambda name: np.asarray(checkpoint.get(name), dtype=np.float32)  # noqa: E731
    for i in range(spec.num_hidden_layers):
        layer, p = f"layer.{i}.mlp", f"model.layers.{i}.mlp."
        x = captured[f"layer.{i}.post_norm"]  # [T, H]
        logits = captured[f"{layer}.router_logits"]  # [T, E]
        assert logits.shape == (len(prompt), spec.num_experts)
        ids = captured[f"{layer}.router_ids"]
        assert ids.shape == (len(prompt), spec.num_experts_per_tok)
        np.testing.assert_array_equal(ids, np.argsort(-logits, axis=-1, kind="stable")[:, : spec.num_experts_per_tok])
        gate_up = np.concatenate([read(f"{p}shared_expert.gate_proj.weight"), read(f"{p}shared_expert.up_proj.weight")])
        act = NumpyBackend().silu_mul(x @ gate_up.T)
        shared = act @ read(f"{p}shared_expert.down_proj.weight").T
        np.testing.assert_allclose(captured[f"{layer}.shared"], shared, rtol=1e-5, atol=1e-5 * np.abs(shared).max())
        gate = _sigmoid(x @ read(f"{p}shared_expert_gate.weight").T)  # [T, 1]
        total = captured[f"{layer}.routed"] + gate * captured[f"{layer}.shared"]
        np.testing.assert_allclose(captured[f"layer.{i}.mlp_out"], total, rtol=1e-5, atol=1e-5 * np.abs(total).max())


# --- launches -------------------------------------------------------------------------------------
def test_demo_decode_runs_each_moe_block_in_four_launches() -> None:
    sys.path.insert(0, str(Path(__file__).parent))
    from test_cuda_select import make_runtime

    from atlas.backends.cuda.backend import CudaBackend

    rt, driver = make_runtime(arena_bytes=8 << 20)
    engine = Engine(load_spec(DEMO_DIR), Checkpoint.open(DEMO_DIR), CudaBackend(rt, use_graphs=False), max_seq_len=64)
    engine.prefill([1, 2, 3])
    first = len(driver.launches)
    engine.decode(5, 3)
    counts = Counter(launch[0] for launch in driver.launches[first:])
    layers, top_k = engine.spec.num_hidden_layers, engine.spec.num_experts_per_tok
    moe = {name: n for name, n in counts.items() if name.startswith(MOE_KERNELS) or name in SEPARATE_KERNELS}
    assert moe == {"atlas_router_logits": layers, "atlas_router_top_k": layers, "atlas_moe_gate_up_gemv": layers,
                   f"atlas_moe_down_gemv_k{top_k + 1}": layers}


def test_cuda_upload_stacked_places_each_block_through_upload(rng: np.random.Generator) -> None:
    """The stack is built on the device from `upload` calls (the benchmarks hook `upload` to fill
    synthetic weights there), block by block, equal to the host concatenation."""
    sys.path.insert(0, str(Path(__file__).parent))
    from test_cuda_select import make_runtime

    from atlas.backends.cuda.backend import CudaBackend
    from atlas.backends.cuda.upload import from_storage, to_storage

    backend = CudaBackend(make_runtime()[0], use_graphs=False)
    seen: list[tuple[int, ...]] = []
    plain_upload = backend.upload
    backend.upload = lambda array, dtype: seen.append(array.shape) or plain_upload(array, dtype)  # type: ignore[method-assign]
    rows, cols = int(rng.integers(2, 6)), 8 * int(rng.integers(1, 5))
    blocks = [rng.standard_normal((n, rows, cols), dtype=np.float32) for n in (int(rng.integers(1, 9)), 1)]
    stacked = backend.upload_stacked(blocks, "bf16")
    assert seen == [b.shape for b in blocks] and stacked.shape == (blocks[0].shape[0] + 1, rows, cols)
    expected = from_storage(to_storage(np.concatenate(blocks), "bf16"), "bf16").reshape(stacked.shape)
    np.testing.assert_array_equal(backend.to_numpy(stacked), expected)
