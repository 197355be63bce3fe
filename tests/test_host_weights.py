"""The numpy backend's compact host weights (bf16 as stored, quantized packed) and the host-memory
check: same logits, bit for bit, as float32 weights; ~2 bytes per parameter; one line and exit 2
when the run does not fit in MemAvailable."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from atlas.backends import check_numpy_fits
from atlas.backends import host_weights
from atlas.backends.host_memory import GIB, available_bytes, host_footprint
from atlas.backends.host_weights import HostMatrix, HostQuantized, matmul_t, resident_bytes
from atlas.backends.numpy_backend import NumpyBackend
from atlas.backends.run_plan import RunPlan, context_length
from atlas.config import load_spec
from atlas.demo import DEMO_DIR
from atlas.engine import Engine
from atlas.errors import AtlasError
from atlas.kvcache.options import KVCacheOptions
from atlas.safetensors import Checkpoint

WEIGHT_TYPES = (np.ndarray, HostMatrix, HostQuantized)


class Float32Backend:
    """The numpy backend as it stored weights before: every float as float32, quantized weights
    dequantized by the loader (no upload_quantized hooks, no stored floats)."""

    name = "numpy"

    def __init__(self) -> None:
        self._ops = NumpyBackend()

    def upload(self, array: np.ndarray, dtype: str) -> np.ndarray:
        return np.array(array, dtype=np.int32 if dtype == "i32" else np.float32, order="C")

    def __getattr__(self, name: str) -> Any:
        if name in ("upload_quantized", "upload_quantized_rows", "keeps_stored_floats"):
            raise AttributeError(name)
        return getattr(self._ops, name)


def weights_of(tree: object, seen: dict[int, object] | None = None) -> dict[int, object]:
    """Every uploaded weight reachable from a model's dataclasses (shared ones once)."""
    seen = {} if seen is None else seen
    if isinstance(tree, WEIGHT_TYPES):
        seen[id(tree)] = tree
    elif dataclasses.is_dataclass(tree):
        for f in dataclasses.fields(tree):
            weights_of(getattr(tree, f.name), seen)
    elif isinstance(tree, (tuple, list)):
        for item in tree:
            weights_of(item, seen)
    return seen


def engine(model_dir: Path, backend: object) -> Engine:
    return Engine(load_spec(model_dir), Checkpoint.open(model_dir), backend, max_seq_len=64)  # type: ignore[arg-type]


def logits_of(model: Engine, prompt: list[int]) -> np.ndarray:
    model.reset()
    return model.backend.to_numpy(model.prefill(prompt))  # [1, V] or [T, V]


def assert_same_logits(model_dir: Path, rng: np.random.Generator) -> Engine:
    compact, reference = engine(model_dir, NumpyBackend()), engine(model_dir, Float32Backend())
    vocab = load_spec(model_dir).vocab_size
    for length in (1, int(rng.integers(2, 40))):
        prompt = rng.integers(0, vocab, length).tolist()
        np.testing.assert_array_equal(logits_of(compact, prompt), logits_of(reference, prompt))
    return compact


def test_bf16_demo_is_held_in_bf16_with_the_same_logits(rng: np.random.Generator) -> None:
    model = assert_same_logits(DEMO_DIR, rng)
    weights = weights_of(model.model).values()
    matrices = [w for w in weights if len(w.shape) >= 2]
    assert matrices and all(isinstance(w, HostMatrix) and w.stored.dtype.itemsize == 2 for w in matrices)
    params = sum(int(np.prod(w.shape)) for w in weights)
    held = sum(resident_bytes(w) for w in weights)
    assert held < 2.02 * params, f"{held / params:.3f} bytes per parameter"
    spec = load_spec(DEMO_DIR)
    run = RunPlan(64, KVCacheOptions(), load_mtp=False)
    assert host_footprint(spec, Checkpoint.open(DEMO_DIR), run).weights == held


@pytest.mark.parametrize("fmt", ["fp8", "nvfp4"])
def test_quantized_weights_stay_packed_with_the_same_logits(fmt: str, tmp_path: Path, rng: np.random.Generator) -> None:
    from atlas.quantize import QuantizeArgs, quantize

    model_dir = quantize(QuantizeArgs(str(DEMO_DIR), fmt, tmp_path / fmt, 1 << 30))
    model = assert_same_logits(model_dir, rng)
    weights = weights_of(model.model).values()
    packed = [w for w in weights if isinstance(w, HostQuantized)]
    assert packed and any(w.experts for w in packed)
    held = sum(resident_bytes(w) for w in weights)
    run = RunPlan(64, KVCacheOptions(), load_mtp=False)
    assert host_footprint(load_spec(model_dir), Checkpoint.open(model_dir), run).weights == held


def test_big_matrices_run_a_block_of_rows_at_a_time(monkeypatch: pytest.MonkeyPatch, rng: np.random.Generator) -> None:
    import ml_dtypes

    rows, width = int(rng.integers(700, 1200)), int(rng.integers(16, 80))
    stored = rng.standard_normal((rows, width)).astype(ml_dtypes.bfloat16)  # [N, K]
    weight, f32 = HostMatrix(stored), stored.astype(np.float32)
    x = rng.standard_normal((3, width)).astype(np.float32)
    monkeypatch.setattr(host_weights, "ROW_BLOCK_BYTES", 300 * 4 * width)
    assert host_weights.row_block(rows, width) == 256
    np.testing.assert_allclose(matmul_t(x, weight), x @ f32.T, rtol=1e-5, atol=1e-5)
    ids = rng.integers(0, rows, 5).astype(np.int32)
    np.testing.assert_array_equal(NumpyBackend().embedding(weight, ids), f32[ids])
    widths = [rows // 2, rows - rows // 2]
    for got, want in zip(NumpyBackend().linear_split(x, weight, widths), (f32[: widths[0]], f32[widths[0] :])):
        np.testing.assert_allclose(got, x @ want.T, rtol=1e-5, atol=1e-5)


def test_float32_uploads_stay_float32_unless_exact_in_bf16(rng: np.random.Generator) -> None:
    backend = NumpyBackend()
    values = rng.standard_normal((6, 5)).astype(np.float32)
    kept = backend.upload(values, "bf16")
    assert isinstance(kept, np.ndarray) and kept.dtype == np.float32 and np.array_equal(kept, values)
    rounded = values.view(np.uint32) & np.uint32(0xFFFF0000)
    compacted = backend.upload(rounded.view(np.float32), "bf16")
    assert isinstance(compacted, HostMatrix) and np.array_equal(compacted.dense(), rounded.view(np.float32))
    assert backend.upload(values[0], "bf16").dtype == np.float32  # vectors stay float32


def write_meminfo(path: Path, available_kib: int) -> Path:
    path.write_text(f"MemTotal:       99999999 kB\nMemFree:        1 kB\nMemAvailable:   {available_kib} kB\n")
    return path


def test_host_memory_check_names_both_sizes_and_the_fix(tmp_path: Path) -> None:
    spec = load_spec(DEMO_DIR)
    assert available_bytes(write_meminfo(tmp_path / "big", 64 << 20)) == 64 << 30
    check_numpy_fits(DEMO_DIR, spec, RunPlan(), tmp_path / "big")
    with pytest.raises(AtlasError) as err:
        check_numpy_fits(DEMO_DIR, spec, RunPlan(), write_meminfo(tmp_path / "small", 1024))
    line = str(err.value)
    assert "\n" not in line and "0.0 GiB is available" in line and "GiB of host memory" in line
    assert "--device cuda" in line and "atlas.quantize" in line
    assert "--kv-cache-dtype" in line  # the demo's 4096-token cache outweighs its weights
    assert available_bytes(tmp_path / "missing") is None
    check_numpy_fits(DEMO_DIR, spec, RunPlan(), tmp_path / "missing")  # not Linux: no check


def test_cli_exits_2_with_one_line_when_the_model_does_not_fit(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from atlas.backends import host_memory
    from atlas.run import main

    monkeypatch.setattr(host_memory, "MEMINFO", write_meminfo(tmp_path / "meminfo", 2048))
    code = main(["--prompt", "hello", "--device", "cpu"])
    lines = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(lines) == 1 and "host memory" in lines[0] and "Traceback" not in lines[0]


def test_footprint_counts_kv_cache_levels() -> None:
    spec, checkpoint = load_spec(DEMO_DIR), Checkpoint.open(DEMO_DIR)
    full = host_footprint(spec, checkpoint, RunPlan(4096, KVCacheOptions("bf16", 0), False))
    turbo = host_footprint(spec, checkpoint, RunPlan(4096, KVCacheOptions("turbo4", 0), False))
    layers = spec.layer_types.count("full_attention")
    assert full.kv_cache == layers * 2 * 4096 * spec.num_key_value_heads * spec.head_dim * 4
    assert 0 < turbo.kv_cache < full.kv_cache / 4 and full.total < 4 * GIB


def sparse_qwen36(model_dir: Path) -> Path:
    """A Qwen3.6-35B-A3B-shaped bf16 checkpoint (fused experts) whose data is a sparse file:
    headers are real, nothing is read before the memory check."""
    import json
    import shutil
    import struct

    from atlas.models.qwen3_5_moe import Layout, model_plan
    from atlas.targets import load_registry

    constants = dict(load_registry().models["qwen3.6-35b-a3b"].constants)
    config = json.loads((DEMO_DIR / "config.json").read_text())
    config.update({k: v for k, v in constants.items() if k != "rotary_dim"})
    layers, interval = constants["num_hidden_layers"], constants["full_attention_interval"]
    config["layer_types"] = ["full_attention" if (i + 1) % interval == 0 else "linear_attention" for i in range(layers)]
    model_dir.mkdir()
    (model_dir / "config.json").write_text(json.dumps(config))
    for name in ("generation_config.json", "tokenizer.json", "tokenizer_config.json"):
        shutil.copy(DEMO_DIR / name, model_dir / name)
    header, offset = {}, 0
    for name, shape in model_plan(Layout("model.", True, load_spec(model_dir))).items():
        size = 2 * int(np.prod(shape))
        header[name] = {"dtype": "BF16", "shape": list(shape), "data_offsets": [offset, offset + size]}
        offset += size
    blob = json.dumps(header).encode()
    path = model_dir / "model.safetensors"
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(blob)) + blob)
        f.truncate(8 + len(blob) + offset)
    return model_dir


def test_the_real_model_is_refused_in_one_line_where_it_does_not_fit(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from atlas.backends import host_memory
    from atlas.run import main

    model_dir = sparse_qwen36(tmp_path / "qwen3.6")
    spec = load_spec(model_dir)
    run = RunPlan(context_length(None, spec.context_length), KVCacheOptions(), True)  # atlas.run's
    footprint = host_footprint(spec, Checkpoint.open(model_dir), run)
    stored = Checkpoint.open(model_dir)
    params = sum(int(np.prod(stored.shape(n))) for n in stored.names())
    assert 34e9 < params < 36e9 and footprint.weights < 2.001 * params  # bf16 as stored, not 4 bytes
    monkeypatch.setattr(host_memory, "MEMINFO", write_meminfo(tmp_path / "meminfo", 24 << 20))  # a 24 GiB host
    code = main(["--model", str(model_dir), "--prompt", "hello", "--device", "cpu"])
    lines = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(lines) == 1, lines
    assert f"needs {footprint.total / GIB:.1f} GiB" in lines[0] and "only 24.0 GiB is available" in lines[0]
    assert "--kv-cache-dtype" not in lines[0]  # 0.2 GiB of cache beside 65 GiB of weights


def test_loader_stacks_are_kept_not_copied(tmp_path: Path) -> None:
    """The loader's own bf16 temporaries (expert stacks) reach the numpy backend read-only and are
    kept as they are; an array a caller uploads writable is still copied."""
    from atlas.loader import WeightReader

    checkpoint = Checkpoint.open(DEMO_DIR)
    name = next(n for n in checkpoint.names() if len(checkpoint.shape(n)) == 2)
    backend = NumpyBackend()
    reader = WeightReader(checkpoint, backend, {name: checkpoint.shape(name)})
    stack = np.stack([reader.array(name)] * 2)  # [2, N, K] bf16, writable
    kept = reader.upload(stack)
    assert isinstance(kept, HostMatrix) and np.shares_memory(kept.stored, stack)
    reader.close()
    copied = backend.upload(stack, "bf16")
    assert isinstance(copied, HostMatrix) and not np.shares_memory(copied.stored, stack)
    assert np.shares_memory(reader.upload(reader.array(name)).stored, checkpoint.get_raw(name))  # the map itself
