"""Fused input projections: `linear_split` (numpy reference, and the CUDA backend's views and row
views over the emulated driver of test_cuda_select.py), `SplitLinear`, the loader's grouping by
storage, and the launch count of the demo's decode-step mixers."""

from __future__ import annotations

import ctypes
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from atlas.backends.cuda.backend import CudaBackend
from atlas.backends.cuda.quant_weights import HostQuantWeight, QuantWeight, from_fp8_block, from_nvfp4, upload
from atlas.backends.cuda.tensor import DeviceTensor
from atlas.backends.cuda.upload import from_storage, to_storage
from atlas.backends.numpy_backend import NumpyBackend
from atlas.kernel_params import dense as dense_params
from atlas.kernel_params import quant as quant_params
from atlas.layers.split_linear import SplitLinear, WeightGroup
from atlas.quant.fp8_block import quantize_fp8_block
from atlas.quant.nvfp4 import quantize_nvfp4
from test_cuda_select import make_runtime


def random_widths(rng: np.random.Generator, parts: int) -> tuple[int, ...]:
    return tuple(int(w) for w in rng.integers(1, 70, size=parts))


# --- numpy reference ------------------------------------------------------------------------------
@pytest.mark.parametrize("tokens", [1, 6])
def test_numpy_linear_split_is_each_parts_linear(rng: np.random.Generator, tokens: int) -> None:
    widths = random_widths(rng, 4)
    weight = rng.standard_normal((sum(widths), 48)).astype(np.float32)  # [N, K]
    x = rng.standard_normal((tokens, 48)).astype(np.float32)  # [T, K]
    parts = NumpyBackend().linear_split(x, weight, widths)
    bounds = np.cumsum([0, *widths])
    assert [p.shape for p in parts] == [(tokens, w) for w in widths]
    for part, a, b in zip(parts, bounds, bounds[1:]):
        assert part.flags.c_contiguous
        np.testing.assert_allclose(part, x @ weight[a:b].T, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("widths", [(), (3, 0, 5), (3, 4)])
def test_widths_that_do_not_split_the_weight_are_refused(widths: tuple[int, ...]) -> None:
    with pytest.raises(ValueError, match="linear_split: widths"):
        NumpyBackend().linear_split(np.ones((1, 8), np.float32), np.ones((8, 8), np.float32), widths)


def test_split_linear_returns_parts_in_their_order_across_groups(rng: np.random.Generator) -> None:
    x = rng.standard_normal((3, 16)).astype(np.float32)  # [T, K]
    mats = [rng.standard_normal((int(n), 16)).astype(np.float32) for n in rng.integers(1, 9, size=4)]
    fused = SplitLinear((
        WeightGroup(np.concatenate([mats[3], mats[0]]), (len(mats[3]), len(mats[0])), (3, 0)),
        WeightGroup(np.concatenate([mats[1], mats[2]]), (len(mats[1]), len(mats[2])), (1, 2)),
    ))  # fmt: skip
    assert fused.widths == tuple(len(m) for m in mats)
    for got, mat in zip(fused(NumpyBackend(), x), mats):
        np.testing.assert_allclose(got, x @ mat.T, rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="do not cover"):
        SplitLinear((WeightGroup(mats[0], (len(mats[0]),), (1,)),))


# --- CUDA backend on the emulated driver ----------------------------------------------------------
def device_bytes(ptr: int, nbytes: int) -> np.ndarray:
    return np.frombuffer(ctypes.string_at(ptr, nbytes), dtype=np.uint8)


def launched(driver: Any, since: int, params_type: type[ctypes.Structure], prefix: str = "") -> list[tuple[str, Any]]:
    """The launches since `since` whose kernel name starts with `prefix`, params decoded."""
    return [(name, params_type.from_buffer_copy(raw)) for name, _, raw, _ in driver.launches[since:]
            if name.startswith(prefix)]


def test_decode_split_is_one_gemv_cut_into_views(rng: np.random.Generator) -> None:
    """T == 1: one GEMV over the whole weight; each part views the right columns of its output."""
    rt, driver = make_runtime()
    be = CudaBackend(rt, use_graphs=False)
    widths, k = random_widths(rng, 4), 64
    weight = rng.standard_normal((sum(widths), k)).astype(np.float32)
    w, x = be.upload(weight, "bf16"), be.upload(rng.standard_normal((1, k)).astype(np.float32), "f32")
    rt.reset_step()
    before = len(driver.launches)
    parts = be.linear_split(x, w, widths)
    ((kernel, params),) = launched(driver, before, dense_params.LinearParams)
    assert kernel.startswith("atlas_gemv") and (params.weight, params.n, params.tokens) == (w.ptr, sum(widths), 1)
    full = rng.standard_normal((1, sum(widths))).astype(np.float32)  # what the GEMV would write
    ctypes.memmove(params.out, full.ctypes.data, full.nbytes)
    bounds = np.cumsum([0, *widths])
    for part, a, b in zip(parts, bounds, bounds[1:]):
        assert part.shape == (1, b - a) and part.dtype == "f32"
        np.testing.assert_array_equal(be.to_numpy(part), full[:, a:b])


def test_prefill_split_runs_each_part_on_a_row_view(rng: np.random.Generator) -> None:
    """T > 1: one linear per part, each on the bf16 rows of its part, writing its own [T, w]."""
    rt, driver = make_runtime()
    be = CudaBackend(rt, use_graphs=False)
    widths, k, tokens = random_widths(rng, 3), 32, 5
    weight = rng.standard_normal((sum(widths), k)).astype(np.float32)
    w, x = be.upload(weight, "bf16"), be.upload(rng.standard_normal((tokens, k)).astype(np.float32), "f32")
    rt.reset_step()
    before = len(driver.launches)
    parts = be.linear_split(x, w, widths)
    calls = launched(driver, before, dense_params.LinearParams)
    assert len(calls) == len(widths) == len(parts)
    bounds = np.cumsum([0, *widths])
    for (_, params), part, a, b in zip(calls, parts, bounds, bounds[1:]):
        assert (params.n, params.k, params.tokens, params.out) == (b - a, k, tokens, part.ptr)
        rows = from_storage(device_bytes(params.weight, (b - a) * k * 2).view(np.uint16), "bf16").reshape(b - a, k)
        np.testing.assert_array_equal(rows, from_storage(to_storage(weight[a:b], "bf16"), "bf16").reshape(b - a, k))
        assert part.shape == (tokens, b - a)


def quantized(fmt: str, weight: np.ndarray) -> HostQuantWeight:
    if fmt == "fp8":
        q = quantize_fp8_block(weight)
        return from_fp8_block(q.weight, q.scale_inv, q.block)
    q4 = quantize_nvfp4(weight)
    return from_nvfp4(q4.weight, q4.weight_scale, q4.weight_scale_2)


def read_quant_weight(fmt: str, params: Any, rows: int, k: int) -> HostQuantWeight:
    """The weight a quantized linear launch addresses, read back from its params' pointers."""
    q_row, scale_row = (k, ((k + 127) // 128) * 4) if fmt == "fp8" else (k // 2, k // 16)
    q = device_bytes(params.weight, rows * q_row).reshape(rows, q_row)
    scale = device_bytes(params.scale, rows * scale_row).reshape(rows, scale_row)
    if fmt == "fp8":
        return HostQuantWeight(fmt, q, scale.view(np.float32), None, k)
    row_scale = device_bytes(params.row_scale, rows * 4).view(np.float32)
    return HostQuantWeight(fmt, q, scale, row_scale, k)


@pytest.mark.parametrize("fmt", ["fp8", "nvfp4"])
def test_quantized_row_views_address_each_parts_codes_and_scales(fmt: str, rng: np.random.Generator) -> None:
    """Part boundaries off the 128-row fp8 scale blocks are exact: the device layout holds every
    scale per row, so a row view is the rows' codes and scales."""
    rt, driver = make_runtime()
    be = CudaBackend(rt, use_graphs=False)
    widths, k = (130, 37, 3, 86), 256
    host = quantized(fmt, rng.standard_normal((sum(widths), k)).astype(np.float32) * 0.05)
    w = upload(be.uploader, host)
    dense = host.dequantize()  # [N, K]
    x = be.upload(rng.standard_normal((4, k)).astype(np.float32), "f32")
    rt.reset_step()
    before = len(driver.launches)
    be.linear_split(x, w, widths)
    calls = launched(driver, before, quant_params.QuantLinearParams)
    assert [name for name, _ in calls] == [f"atlas_qgemv_{fmt}_narrow_t4"] * len(widths)
    bounds = np.cumsum([0, *widths])
    for (_, params), a, b in zip(calls, bounds, bounds[1:]):
        assert (params.n, params.k) == (b - a, k)
        np.testing.assert_array_equal(read_quant_weight(fmt, params, int(b - a), k).dequantize(), dense[a:b])
    view = w.rows(int(bounds[1]), int(bounds[2]))
    assert isinstance(view, QuantWeight) and view.shape == (widths[1], k)
    with pytest.raises(ValueError, match="out of range"):
        w.rows(5, sum(widths) + 1)


@pytest.mark.parametrize("fmt", ["fp8", "nvfp4"])
def test_quantized_decode_split_is_one_launch(fmt: str, rng: np.random.Generator) -> None:
    rt, driver = make_runtime()
    be = CudaBackend(rt, use_graphs=False)
    widths, k = (40, 24, 8, 8), 128
    w = upload(be.uploader, quantized(fmt, rng.standard_normal((sum(widths), k)).astype(np.float32)))
    x = be.upload(rng.standard_normal((1, k)).astype(np.float32), "f32")
    rt.reset_step()
    before = len(driver.launches)
    parts = be.linear_split(x, w, widths)
    ((_, params),) = launched(driver, before, quant_params.QuantLinearParams)
    assert (params.weight, params.n) == (w.q.ptr, sum(widths))
    offsets = [p.ptr - params.out for p in parts]
    assert offsets == [4 * int(a) for a in np.cumsum([0, *widths[:-1]])]


def test_tensor_element_views() -> None:
    t = DeviceTensor(8192, (1, 10), "f32")
    assert t.elements(3, 7).ptr == 8192 + 12 and t.elements(3, 7).shape == (4,)
    with pytest.raises(ValueError):
        t.elements(4, 11)


# --- the demo model's decode step -----------------------------------------------------------------
def mixer_input_launches(model_dir: Path, rng: np.random.Generator) -> list[tuple[str, list[str]]]:
    """Over the emulated driver, one decode token through every layer's mixer: (layer type, the
    linear launches that read the mixer's normed input)."""
    from atlas.config import load_spec
    from atlas.layers.step import Step
    from atlas.models import load_model
    from atlas.safetensors import Checkpoint

    rt, driver = make_runtime(arena_bytes=8 << 20)
    be = CudaBackend(rt, use_graphs=False)
    spec = load_spec(model_dir)
    model = load_model(spec, Checkpoint.open(model_dir), be)
    found = []
    for i, layer in enumerate(model.layers):
        state = layer.mixer.new_state(be, 16)
        rt.reset_step()
        x = be.upload(rng.standard_normal((1, spec.hidden_size)).astype(np.float32), "f32")  # [1, H]
        step = Step(be, be.upload(np.array([0], dtype=np.int32), "i32"))
        before = len(driver.launches)
        layer.mixer(step, x, state, f"layer.{i}.attn")
        linears = launched(driver, before, dense_params.LinearParams, "atlas_gemv")
        linears += launched(driver, before, quant_params.QuantLinearParams, "atlas_qgemv")
        assert len(linears) == len([n for n, *_ in driver.launches[before:] if "gemv" in n])
        found.append((spec.layer_types[i], sorted(n for n, p in linears if p.x == x.ptr)))
    return found


def test_each_mixers_input_projections_are_one_decode_launch(rng: np.random.Generator) -> None:
    from atlas.demo import DEMO_DIR

    for kind, names in mixer_input_launches(DEMO_DIR, rng):
        assert len(names) == 1 and names[0].startswith("atlas_gemv"), (kind, names)


@pytest.mark.parametrize("fmt", ["fp8", "nvfp4"])
def test_quantized_mixers_launch_once_per_storage(fmt: str, tmp_path: Path, rng: np.random.Generator) -> None:
    """A quantized demo on the CUDA backend (emulated driver): attention's four parts are one packed
    GEMV; DeltaNet's in_proj_qkv + z one packed GEMV and its bf16 in_proj_b + a one bf16 GEMV."""
    from atlas.demo import DEMO_DIR
    from atlas.quantize import QuantizeArgs, quantize

    model_dir = quantize(QuantizeArgs(str(DEMO_DIR), fmt, tmp_path / fmt, 1 << 30))
    for kind, names in mixer_input_launches(model_dir, rng):
        prefixes = [n.split("_t")[0].removesuffix("_narrow") for n in names]
        expected = [f"atlas_qgemv_{fmt}"] if kind == "full_attention" else ["atlas_gemv", f"atlas_qgemv_{fmt}"]
        assert prefixes == expected, (kind, names)


# --- loader -------------------------------------------------------------------------------------
class RowPackingBackend(NumpyBackend):
    """Takes quantized matrices packed by rows (as the CUDA backend), evaluating the device layout."""

    def upload_quantized(self, weight: Any) -> np.ndarray:
        from atlas.backends.cuda.quant_weights import from_quantized_weight

        return from_quantized_weight(weight).dequantize()

    def upload_quantized_rows(self, weights: list[Any], rows: np.ndarray | None, experts: int) -> np.ndarray:
        from atlas.backends.cuda.quant_weights import from_quantized_weight, stack_rows

        host = stack_rows([from_quantized_weight(w) for w in weights])
        dense = (host if rows is None else host.take_rows(rows)).dequantize()
        return dense.reshape(experts, -1, host.k) if experts else dense


def loaded_with_bar(model_dir: Path, backend: NumpyBackend, monkeypatch: pytest.MonkeyPatch) -> tuple[Any, list[tuple[float, float]]]:
    from atlas.config import load_spec
    from atlas.loader import WeightReader
    from atlas.models import load_model
    from atlas.safetensors import Checkpoint

    bars: list[tuple[float, float]] = []
    close = WeightReader.close
    monkeypatch.setattr(WeightReader, "close", lambda self: (bars.append((self._bar.n, self._bar.total)), close(self)))
    return load_model(load_spec(model_dir), Checkpoint.open(model_dir), backend), bars


@pytest.mark.parametrize("fmt", ["fp8", "nvfp4"])
def test_loader_fuses_parts_of_the_same_storage(fmt: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A quantized checkpoint on a row-packing backend: attention's four parts in one packed weight,
    DeltaNet's in_proj_qkv + z packed and b + a (kept bf16) as float; the progress bar ends full."""
    from atlas.demo import DEMO_DIR
    from atlas.layers.attention import Attention
    from atlas.quantize import QuantizeArgs, quantize

    model_dir = quantize(QuantizeArgs(str(DEMO_DIR), fmt, tmp_path / fmt, 1 << 30))
    model, bars = loaded_with_bar(model_dir, RowPackingBackend(), monkeypatch)
    for layer in model.layers:
        if isinstance(layer.mixer, Attention):
            assert [g.parts for g in layer.mixer.weights.qgkv.groups] == [(0, 1, 2, 3)]
        else:
            assert [g.parts for g in layer.mixer.weights.in_proj.groups] == [(0, 1), (2, 3)]
    assert bars and all(n == total for n, total in bars)
    plain, _ = loaded_with_bar(model_dir, NumpyBackend(), monkeypatch)
    for ours, dequantized in zip(model.layers, plain.layers):
        fused = ours.mixer.weights.qgkv if isinstance(ours.mixer, Attention) else ours.mixer.weights.in_proj
        reference = dequantized.mixer.weights.qgkv if isinstance(ours.mixer, Attention) else dequantized.mixer.weights.in_proj
        assert [g.parts for g in reference.groups] == [g.parts for g in fused.groups]  # numpy packs rows too
        assert fused.widths == reference.widths
        x = np.random.default_rng(0).standard_normal((2, model.embed.table.shape[1])).astype(np.float32)
        for got, want in zip(fused(NumpyBackend(), x), reference(NumpyBackend(), x)):
            np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


def test_registry_models_parts_start_16_byte_aligned() -> None:
    """Decode views start at 4 * column offset bytes; consumers vector-load some parts (v), so every
    registry model's fused parts must start at multiples of 4 columns."""
    from atlas.targets import load_registry

    for name, model in load_registry().models.items():
        d = model.constants
        q, kv = d["num_attention_heads"] * d["head_dim"], d["num_key_value_heads"] * d["head_dim"]
        values, heads = d["linear_num_value_heads"] * d["linear_value_head_dim"], d["linear_num_value_heads"]
        conv = 2 * d["linear_num_key_heads"] * d["linear_key_head_dim"] + values
        for widths in ((q, q, kv, kv), (conv, values, heads, heads)):
            assert all(int(a) % 4 == 0 for a in np.cumsum(widths)), (name, widths)
