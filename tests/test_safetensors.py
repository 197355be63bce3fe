"""The memory-mapped safetensors reader: values against the safetensors library and torch, sharded
checkpoints, and one clear error per broken-file case (files written by hand)."""

from __future__ import annotations

import json
import struct
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from atlas.errors import AtlasError
from atlas.safetensors import Checkpoint


def random_shape(rng: np.random.Generator) -> tuple[int, ...]:
    return tuple(int(d) for d in rng.integers(1, 7, size=int(rng.integers(0, 4))))


def write_raw(path: Path, header: dict[str, Any], data: bytes, header_len: int | None = None) -> Path:
    """A safetensors file byte by byte; header_len overrides the stored length prefix."""
    blob = json.dumps(header).encode("utf-8")
    prefix = struct.pack("<Q", len(blob) if header_len is None else header_len)
    path.write_bytes(prefix + blob + data)
    return path


def f32_entry(shape: list[int], begin: int) -> dict[str, Any]:
    return {"dtype": "F32", "shape": shape, "data_offsets": [begin, begin + 4 * int(np.prod(shape))]}


def expect_error(model_dir: Path, *needles: str, tensor: str | None = None) -> str:
    with pytest.raises(AtlasError) as caught:
        checkpoint = Checkpoint.open(model_dir)
        if tensor is not None:
            checkpoint.get(tensor)
    message = str(caught.value)
    assert "\n" not in message
    for needle in needles:
        assert needle in message, message
    return message


def test_values_match_safetensors_library(tmp_path: Path, rng: np.random.Generator) -> None:
    from safetensors.numpy import save_file

    tensors = {
        "f32": rng.standard_normal(random_shape(rng)).astype(np.float32),
        "f16": rng.standard_normal(random_shape(rng)).astype(np.float16),
        "f64": rng.standard_normal(random_shape(rng)),
        "i32": rng.integers(-(2**31), 2**31 - 1, size=random_shape(rng), dtype=np.int32),
        "i64": rng.integers(-(2**62), 2**62, size=random_shape(rng), dtype=np.int64),
        "u8": rng.integers(0, 255, size=random_shape(rng), dtype=np.uint8),
        "flag": rng.random(random_shape(rng)) < 0.5,
        "empty": np.zeros((0, 3), dtype=np.float32),
    }
    tensors = {name: np.asarray(value) for name, value in tensors.items()}  # 0-d draws are scalars
    save_file(tensors, str(tmp_path / "model.safetensors"), metadata={"format": "np"})
    checkpoint = Checkpoint.open(tmp_path)
    assert checkpoint.names() == sorted(tensors)
    for name, expected in tensors.items():
        assert checkpoint.shape(name) == expected.shape
        raw = checkpoint.get_raw(name)
        assert raw.dtype == expected.dtype and np.array_equal(raw, expected)
        value = checkpoint.get(name)
        want = expected.astype(np.float32) if expected.dtype.kind == "f" else expected
        assert value.dtype == want.dtype and np.array_equal(value, want), name
    assert checkpoint.dtype("f16") == "F16" and checkpoint.dtype("flag") == "BOOL"
    assert "f32" in checkpoint and "nope" not in checkpoint


def test_bf16_and_fp8_exact_against_torch(tmp_path: Path, rng: np.random.Generator) -> None:
    import ml_dtypes
    import torch
    from safetensors.torch import save_file

    scale = float(10 ** rng.uniform(-30, 30))
    source = torch.from_numpy(rng.standard_normal((7, 33)).astype(np.float32) * scale)
    special = torch.tensor([0.0, -0.0, float("inf"), float("-inf"), 1e-40, 3.0e38])
    tensors = {
        "bf16": source.to(torch.bfloat16),
        "bf16_special": special.to(torch.bfloat16),
        "fp8": torch.from_numpy(rng.uniform(-400, 400, (5, 9)).astype(np.float32)).to(torch.float8_e4m3fn),
    }
    save_file(tensors, str(tmp_path / "model.safetensors"))
    checkpoint = Checkpoint.open(tmp_path)
    for name, tensor in tensors.items():
        expected = tensor.to(torch.float32).numpy()
        got = checkpoint.get(name)
        assert got.dtype == np.float32
        assert np.array_equal(got.view(np.uint32), expected.view(np.uint32)), name
    assert checkpoint.get_raw("bf16").dtype == np.dtype(ml_dtypes.bfloat16)
    assert checkpoint.dtype("fp8") == "F8_E4M3"


def write_sharded(model_dir: Path, rng: np.random.Generator, shards: int) -> dict[str, np.ndarray]:
    from safetensors.numpy import save_file

    model_dir.mkdir(parents=True, exist_ok=True)
    weight_map: dict[str, str] = {}
    everything: dict[str, np.ndarray] = {}
    for s in range(shards):
        file_name = f"model-{s + 1:05d}-of-{shards:05d}.safetensors"
        part = {f"layer.{s}.{j}": rng.standard_normal(random_shape(rng)).astype(np.float32) for j in range(3)}
        save_file(part, str(model_dir / file_name))
        weight_map.update({name: file_name for name in part})
        everything.update(part)
    index = {"metadata": {"total_size": 0}, "weight_map": weight_map}
    (model_dir / "model.safetensors.index.json").write_text(json.dumps(index), encoding="utf-8")
    return everything


def test_sharded_index(tmp_path: Path, rng: np.random.Generator) -> None:
    tensors = write_sharded(tmp_path, rng, shards=int(rng.integers(2, 5)))
    checkpoint = Checkpoint.open(tmp_path)
    assert checkpoint.names() == sorted(tensors)
    for name, expected in tensors.items():
        assert np.array_equal(checkpoint.get(name), expected)


def test_missing_shard(tmp_path: Path, rng: np.random.Generator) -> None:
    write_sharded(tmp_path, rng, shards=3)
    (tmp_path / "model-00002-of-00003.safetensors").unlink()
    expect_error(tmp_path, "model-00002-of-00003.safetensors", "missing", "model.safetensors.index.json")


def test_index_names_tensor_its_shard_lacks(tmp_path: Path, rng: np.random.Generator) -> None:
    write_sharded(tmp_path, rng, shards=2)
    index_path = tmp_path / "model.safetensors.index.json"
    index = json.loads(index_path.read_text())
    index["weight_map"]["ghost.weight"] = "model-00001-of-00002.safetensors"
    index_path.write_text(json.dumps(index))
    expect_error(tmp_path, "'ghost.weight'", "model-00001-of-00002.safetensors")


def test_missing_tensor_names_the_file(tmp_path: Path, rng: np.random.Generator) -> None:
    write_sharded(tmp_path, rng, shards=2)
    expect_error(tmp_path, "'model.norm.weight'", "model.safetensors.index.json", tensor="model.norm.weight")


def test_no_checkpoint_files(tmp_path: Path) -> None:
    expect_error(tmp_path, "model.safetensors", str(tmp_path))


def test_truncated_file(tmp_path: Path, rng: np.random.Generator) -> None:
    (tmp_path / "model.safetensors").write_bytes(bytes(rng.integers(0, 255, size=5, dtype=np.uint8)))
    expect_error(tmp_path, "truncated", "model.safetensors")


def test_header_length_larger_than_file(tmp_path: Path, rng: np.random.Generator) -> None:
    huge = int(rng.integers(2**40, 2**63))
    write_raw(tmp_path / "model.safetensors", {"w": f32_entry([2], 0)}, bytes(8), header_len=huge)
    expect_error(tmp_path, f"header length {huge}", "larger than the file")


def test_offsets_past_end(tmp_path: Path, rng: np.random.Generator) -> None:
    n = int(rng.integers(2, 50))
    header = {"a": f32_entry([n], 0), "b": f32_entry([n], 4 * n)}
    write_raw(tmp_path / "model.safetensors", header, bytes(4 * n + 4 * n - 4))  # cut short
    expect_error(tmp_path, "'b'", "past the end")


def test_wrong_size_for_shape(tmp_path: Path) -> None:
    header = {"w": {"dtype": "F32", "shape": [3, 4], "data_offsets": [0, 40]}}
    write_raw(tmp_path / "model.safetensors", header, bytes(48))
    expect_error(tmp_path, "'w'", "needs 48")


def test_overlapping_tensors(tmp_path: Path) -> None:
    header = {"a": f32_entry([4], 0), "b": f32_entry([4], 8)}
    write_raw(tmp_path / "model.safetensors", header, bytes(24))
    expect_error(tmp_path, "overlap", "'a'", "'b'")


def test_unknown_dtype(tmp_path: Path) -> None:
    header = {"w": {"dtype": "X9", "shape": [2], "data_offsets": [0, 8]}}
    write_raw(tmp_path / "model.safetensors", header, bytes(8))
    expect_error(tmp_path, "'w'", "unknown dtype 'X9'")


def test_header_not_json(tmp_path: Path) -> None:
    blob = b"{this is not json"
    (tmp_path / "model.safetensors").write_bytes(struct.pack("<Q", len(blob)) + blob)
    expect_error(tmp_path, "not valid JSON")


@pytest.mark.parametrize("text,needle", [("{broken", "not valid JSON"), ('{"weight_map": [1]}', "no valid 'weight_map'")])
def test_broken_index(tmp_path: Path, rng: np.random.Generator, text: str, needle: str) -> None:
    write_sharded(tmp_path, rng, shards=2)
    (tmp_path / "model.safetensors.index.json").write_text(text, encoding="utf-8")
    expect_error(tmp_path, "model.safetensors.index.json", needle)


def test_index_shard_outside_the_directory(tmp_path: Path, rng: np.random.Generator) -> None:
    write_sharded(tmp_path / "model", rng, shards=1)
    index_path = tmp_path / "model" / "model.safetensors.index.json"
    index = json.loads(index_path.read_text())
    index["weight_map"] = {name: "../stolen.safetensors" for name in index["weight_map"]}
    index_path.write_text(json.dumps(index))
    expect_error(tmp_path / "model", "'../stolen.safetensors'", "not a file name")
