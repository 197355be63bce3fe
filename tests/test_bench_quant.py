"""bench/quant.py on the CPU: the synthetic fp8 / nvfp4 weights it writes on the device are a valid
checkpoint of their format (atlas.quant's dequantization has the intended statistics), their device
layout is exactly quant_weights.py's conversion of that checkpoint, the loader takes the synthetic
quantized checkpoint and sends every quantized matrix packed, the byte counts agree with
bench/decode.py, and the CLI's errors are one line with exit code 2."""

from __future__ import annotations

import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import numpy as np
import pytest

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "bench"))

import quant as bench_quant  # noqa: E402
import synthetic  # noqa: E402

from atlas.backends.cuda.quant_weights import from_fp8_block, from_nvfp4  # noqa: E402
from atlas.quant.fp8_block import dequantize_fp8_block  # noqa: E402
from atlas.quant.nvfp4 import dequantize_nvfp4  # noqa: E402

FORMATS = ("fp8", "nvfp4")
REL_RMS_BOUND = {"fp8": 0.05, "nvfp4": 0.15}  # quantization noise of N(0, 1/k) values


def reference_dequantize(fmt: str, parts: dict[str, np.ndarray]) -> np.ndarray:
    if fmt == "fp8":
        return dequantize_fp8_block(parts["weight"], parts["weight_scale_inv"], (128, 128))
    return dequantize_nvfp4(parts["weight"], parts["weight_scale"], parts["weight_scale_2"])


def device_layout(fmt: str, parts: dict[str, np.ndarray]) -> Any:
    if fmt == "fp8":
        return from_fp8_block(parts["weight"], parts["weight_scale_inv"])
    return from_nvfp4(parts["weight"], parts["weight_scale"], parts["weight_scale_2"])


def repeat_rows(array: np.ndarray | None, rows: int) -> np.ndarray | None:
    """What bench/quant_moe.py's device fill makes of a tile array: its bytes repeated."""
    if array is None:
        return None
    return np.resize(array, (rows, *array.shape[1:]))


@pytest.fixture(scope="module")
def spec() -> Any:
    from atlas.config import load_spec

    with tempfile.TemporaryDirectory() as tmp:
        synthetic.write_config(Path(tmp), 4)
        return load_spec(Path(tmp))


@pytest.mark.parametrize("fmt", FORMATS)
def test_synthetic_checkpoint_dequantizes_to_intended_values(fmt: str, rng: np.random.Generator) -> None:
    k = int(rng.choice([512, 2048, 4096]))
    rows = 128 * int(rng.integers(1, 5))
    parts = synthetic.quant_checkpoint_parts(fmt, (rows, k))
    values = reference_dequantize(fmt, parts)  # [rows, k]
    intended = np.tile(synthetic.quant_tile_float(fmt, k), (rows // 128, 1))  # [rows, k]
    std = 1 / np.sqrt(k)
    assert abs(values.std() / std - 1) < 0.05
    assert abs(values.mean()) < 0.01 * std
    rel_rms = np.sqrt(np.mean((values - intended) ** 2)) / std
    assert 0 < rel_rms < REL_RMS_BOUND[fmt]
    expected_shapes = {name: shape for name, (_, shape) in synthetic.quant_stored(fmt, "m.weight", (rows, k)).items()}
    assert {f"m.{n}": p.shape for n, p in parts.items()} == expected_shapes


@pytest.mark.parametrize("fmt", FORMATS)
def test_device_fill_is_the_checkpoints_device_layout(fmt: str, rng: np.random.Generator) -> None:
    """The repeated device tile equals quant_weights' conversion of the whole synthetic matrix,
    and its numpy evaluation equals atlas.quant's dequantization bit for bit."""
    k = int(rng.choice([512, 2048]))
    rows = 128 * int(rng.integers(1, 6))
    parts = synthetic.quant_checkpoint_parts(fmt, (rows, k))
    converted = device_layout(fmt, parts)
    tile = synthetic.quant_device_tile(fmt, k)
    assert tile.rows == synthetic.QUANT_TILE_ROWS and tile.format == fmt
    np.testing.assert_array_equal(repeat_rows(tile.q, rows), converted.q)
    np.testing.assert_array_equal(repeat_rows(tile.scale, rows), converted.scale)
    if fmt == "nvfp4":
        np.testing.assert_array_equal(repeat_rows(tile.row_scale, rows), converted.row_scale)
    else:
        assert tile.row_scale is None and converted.row_scale is None
    np.testing.assert_array_equal(converted.dequantize(), reference_dequantize(fmt, parts))


@pytest.mark.parametrize("fmt", FORMATS)
def test_loader_sends_every_quantized_matrix_packed(fmt: str, spec: Any) -> None:
    """A 4-layer synthetic quantized checkpoint through the loader: the bench's upload hooks get
    every converted matrix (row counts multiples of the tile) and nothing else quantized."""
    from atlas.models.qwen3_5_moe import load_qwen3_5_moe
    from atlas.quant.exclusions import converts

    class RecordingBackend:
        name = "recording"

        def __init__(self) -> None:
            self.rows: list[tuple[int, int, int]] = []
            self.float_names: list[tuple[tuple[int, ...], str]] = []

        def upload(self, array: np.ndarray, dtype: str) -> tuple[str, tuple[int, ...]]:
            self.float_names.append((array.shape, dtype))
            return ("float", array.shape)

        def zeros(self, shape: tuple[int, ...], dtype: str) -> tuple[str, tuple[int, ...]]:
            return ("zeros", shape)

        def upload_quantized(self, weight: Any) -> tuple[str, tuple[int, ...]]:
            self.rows.append((weight.shape[0], weight.shape[1], 0))
            return ("quant", weight.shape)

        def upload_quantized_rows(self, weights: list[Any], rows: np.ndarray | None, experts: int) -> tuple[str, int]:
            count = len(rows) if rows is not None else sum(w.shape[0] for w in weights)
            self.rows.append((count, weights[0].shape[1], experts))
            return ("quant", count)

    with tempfile.TemporaryDirectory() as tmp:
        synthetic.write_quant_config(Path(tmp), fmt, 4)
        from atlas.config import load_spec

        quant_spec = load_spec(Path(tmp))
        plan = synthetic.quant_plan(quant_spec)
        checkpoint = synthetic.SyntheticQuantCheckpoint(plan, source=tmp, fmt=fmt)
        backend = RecordingBackend()
        load_qwen3_5_moe(quant_spec, checkpoint, backend)  # type: ignore[arg-type]
    converted = sum(int(np.prod(s)) for n, s in plan.items() if converts(n, s, fmt))
    assert sum(r * k for r, k, _ in backend.rows) == converted
    assert all(r % synthetic.QUANT_TILE_ROWS == 0 for r, _, _ in backend.rows)
    stacked = spec.num_experts + 1  # the shared expert (the routed size, packed alike) as expert E
    assert sum(1 for _, _, e in backend.rows if e == stacked) == 2 * quant_spec.num_hidden_layers


def test_byte_counts_agree_with_decode_bench(spec: Any) -> None:
    import decode

    per_token = decode.decode_bytes_per_token(spec, 1024)
    weights = per_token["total"] - per_token["kv_cache"] - per_token["deltanet_states_read_and_written"]
    # decode.py leaves out the tiny A_log / dt_bias / linear-attention norm vectors
    assert abs(bench_quant.weight_read_bytes(spec, "bf16") / weights - 1) < 1e-5
    fp8, nvfp4 = (bench_quant.weight_read_bytes(spec, f) for f in FORMATS)
    assert bench_quant.weight_read_bytes(spec, "bf16") > fp8 > nvfp4
    h, k = spec.hidden_size, spec.moe_intermediate_size
    one_expert_down = {"fp8": h * k + h * (k // 128) * 4, "nvfp4": h * k // 2 + h * k // 16 + h * 4}
    for fmt in FORMATS:
        assert bench_quant.device_bytes("model.layers.0.mlp.experts.3.down_proj.weight", (h, k), fmt) == one_expert_down[fmt]
        assert bench_quant.device_bytes("lm_head.weight", (spec.vocab_size, h), fmt) == 2 * spec.vocab_size * h


def run_bench(*args: str, tmp_path: Path) -> subprocess.CompletedProcess[str]:
    env = {"PATH": "/usr/bin:/bin", "PYTHONPATH": str(REPO / "python"), "HOME": str(tmp_path)}
    return subprocess.run([sys.executable, str(REPO / "bench" / "quant.py"), *args], capture_output=True,
                          text=True, timeout=120, env=env, cwd=tmp_path)


@pytest.mark.parametrize("args, fragment", [
    (("--out", "/nonexistent-dir/q.json"), "does not exist"),
    (("--out", "{tmp}/q.json", "--parts", "moe,int4"), "unknown part int4"),
    (("--out", "{tmp}/q.json", "--budget-s", "0"), "--budget-s"),
    (("--out", "{tmp}",), "is a directory"),
])  # fmt: skip
def test_cli_errors_are_one_line(args: tuple[str, ...], fragment: str, tmp_path: Path) -> None:
    done = run_bench(*(a.format(tmp=tmp_path) for a in args), tmp_path=tmp_path)
    assert done.returncode == 2
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and fragment in lines[0] and "Traceback" not in done.stderr
    assert not list(tmp_path.glob("q.json*"))


def test_without_gpu_exits_2_with_one_line(tmp_path: Path) -> None:
    from atlas.backends.cuda.driver import open_driver
    from atlas.errors import AtlasError

    try:
        open_driver()
    except (AtlasError, ImportError, OSError):
        pass
    else:
        pytest.skip("a GPU is present: the bench would run")
    done = run_bench("--out", str(tmp_path / "q.json"), "--parts", "moe", tmp_path=tmp_path)
    assert done.returncode == 2
    assert done.stderr.strip().startswith("no GPU") and len(done.stderr.strip().splitlines()) == 1
    assert not (tmp_path / "q.json").exists()


def test_cpu_only_writes_memory_numbers(tmp_path: Path) -> None:
    import json

    done = run_bench("--out", str(tmp_path / "q.json"), "--cpu-only", tmp_path=tmp_path)
    assert done.returncode == 0, done.stderr
    result = json.loads((tmp_path / "q.json").read_text())
    memory = result["atlas_quant_memory"]
    for model in ("atlas-demo", "qwen3.6-35b-a3b"):
        assert memory[model]["bf16"] > memory[model]["fp8"] > memory[model]["nvfp4"] > 0
        assert model in memory["table"]
    assert result["weight_memory_bytes"] == memory["qwen3.6-35b-a3b"]
    per_token = result["decode_bytes_per_token"]
    assert per_token["bf16"]["total"] > per_token["fp8"]["total"] > per_token["nvfp4"]["total"]


class FakeDriver:
    """Records the stream operations the bench issues; every event pair reads 1 ms."""

    graphs = True
    binding = "fake"

    def __init__(self) -> None:
        self.ops: list[str] = []

    def event_create(self) -> object:
        return object()

    def event_record(self, event: object, stream: object) -> None:
        self.ops.append("event")

    def event_synchronize(self, event: object) -> None:
        pass

    def event_elapsed_ms(self, start: object, end: object) -> float:
        return 1.0

    def memcpy_dtod(self, dst: int, src: int, nbytes: int, stream: object) -> None:
        assert nbytes > 0 and dst > src
        self.ops.append("dtod")

    def begin_capture(self, stream: object) -> None:
        self.ops.append("begin_capture")

    def end_capture(self, stream: object) -> str:
        self.ops.append("end_capture")
        return "graph"

    def graph_launch(self, graph: object, stream: object) -> None:
        self.ops.append("graph_launch")

    def graph_destroy(self, graph: object) -> None:
        self.ops.append("graph_destroy")


class FakeRuntime:
    """CudaRuntime's surface without a GPU: fresh addresses, host writes checked for size, launches
    recorded (grid limits checked), no allocation while capturing."""

    sm_count = 132
    prefetch = False  # ATLAS_PREFETCH: read by a decode GEMV (an expert with at most 8 tokens in the loop)

    def __init__(self) -> None:
        from itertools import count

        self.driver = FakeDriver()
        self.stream = "stream"
        self.capturing = False
        self._addresses = count(1 << 40, 1 << 34)
        self.launches: list[str] = []

    def _tensor(self, shape: tuple[int, ...], dtype: str, owner: object | None) -> Any:
        from atlas.backends.cuda.tensor import DeviceTensor

        return DeviceTensor(next(self._addresses), tuple(int(s) for s in shape), dtype, owner)  # type: ignore[arg-type]

    def persistent(self, shape: tuple[int, ...], dtype: str) -> Any:
        assert not self.capturing
        return self._tensor(shape, dtype, object())

    def empty(self, shape: tuple[int, ...], dtype: str) -> Any:
        return self._tensor(shape, dtype, None)

    def write(self, dst: Any, host: np.ndarray) -> None:
        assert not self.capturing and np.ascontiguousarray(host).nbytes == dst.nbytes

    def memset_zero(self, t: Any) -> None:
        self.driver.ops.append("memset")

    def synchronize(self) -> None:
        pass

    def reset_step(self) -> None:
        assert not self.capturing

    def launch(self, kernel: str, grid: tuple[int, int, int], block: tuple[int, int, int], params: Any,
               smem: int = 0) -> None:
        assert all(g >= 1 for g in grid) and grid[1] <= 65535 and grid[2] <= 65535, (kernel, grid)
        self.launches.append(kernel)

    def deferred_writing(self, t: Any) -> None:
        return None  # nothing here defers a launch (norm_fusion.py)


def test_moe_bench_launch_plan_through_the_op_wrappers(rng: np.random.Generator) -> None:
    """bench_moe on a recording runtime: the grouped op is one route + two grouped GEMMs + one
    combine per run, the loop three launches per expert with tokens, both eager and captured."""
    from atlas.backends.cuda.backend import CudaBackend

    import quant_moe

    rt = FakeRuntime()
    backend = CudaBackend(rt, use_graphs=False)  # type: ignore[arg-type]
    # 100 tokens over 64 experts (top-8: ~12 per expert) leave some experts 1..8: the loop takes the GEMV path too
    shape = quant_moe.MoeShape(int(rng.integers(100, 400)), 64, 8, 256, 128)
    runs = quant_moe.REPEATS + 1 + 2  # eager (warm-up + repeats), graph (warm-up + capture)
    grouped_kernel = {"bf16": "atlas_moe_grouped_gemm_gate_up", "fp8": "atlas_moe_qgemm_fp8_gate_up",
                      "nvfp4": "atlas_moe_qgemm_nvfp4_gate_up"}
    sizes = {}
    for fmt in ("bf16", "fp8", "nvfp4"):
        rt.launches.clear()
        result = quant_moe.bench_moe(backend, fmt, shape, rng)
        active = result["experts_with_tokens"]
        assert rt.launches.count("atlas_moe_route") == runs
        assert rt.launches.count(grouped_kernel[fmt]) == runs
        assert rt.launches.count("atlas_silu_mul") == runs * active
        assert len(rt.launches) == runs * (4 + 3 * active)
        assert result["graph"]["speedup"] == 1.0 and result["loop_launches"] == 3 * active
        sizes[fmt] = result["expert_weight_bytes"]
    assert sizes["bf16"] == 2 * 3 * shape.experts * shape.hidden * shape.inter
    assert 1.9 < sizes["bf16"] / sizes["fp8"] < 2.0 and 3.3 < sizes["bf16"] / sizes["nvfp4"] < 3.6


@pytest.mark.parametrize("mode", ["full", "--decode-only", "--prefill-only", "--marginal-only"])
def test_decode_bench_writes_its_json_in_every_mode(mode: str, tmp_path: Path, rng: np.random.Generator,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """bench/decode.py's plumbing without a GPU: the measurements are stand-ins, the JSON keys,
    ratios, kernel forms and notes are the script's own."""
    import json
    from types import SimpleNamespace

    import decode

    tok_s = float(rng.uniform(50, 500))
    profile = {"kernels": {"atlas_gemv_t1": {"launches": 90.0, "us": 900.0}}, "launches_per_step": 90.0,
               "kernel_us_per_step": 900.0, "graph_step_us": 1e6 / tok_s, "outside_kernels_us_per_step": 1e6 / tok_s - 900}
    by_setting = {"plain": tok_s, "pdl": 1.1 * tok_s, "tokens_differ": [], "tokens_compared": 32, "rounds": 2}
    pick_us = {"argmax": float(rng.uniform(5, 20)), "sample": float(rng.uniform(20, 3000))}
    run = SimpleNamespace(load_s=1.0, prefill_tok_s={"512": 3 * tok_s, "2048": 2 * tok_s}, decode_tok_s=tok_s,
                          decode_tokens=256, decode_sampled_tok_s=tok_s / 2, decode_profile=profile,
                          decode_by_setting=by_setting, decode_sampled_by_form={"error": "stand-in"}, pick_ops_us=pick_us,
                          decode_by_run_ahead={"ahead": 1.05 * tok_s, "in_turn": tok_s, "rounds": 2})
    marginal = {"step_us": 1e6 / tok_s, "kernels": {"atlas_gemv_t1": {"launches": 41, "us": 900.0}}}
    monkeypatch.setattr(decode, "run_atlas", lambda spec, rng, timed_prefill=True, until=0.0: (run, 4.0e12, "stand-in"))
    monkeypatch.setattr(decode, "run_prefill_forms", lambda spec, rng: {"prefill_attention": "simt", "prefill_tok_s_by_form": {"simt": tok_s}})
    monkeypatch.setattr(decode, "run_marginal", lambda spec, rng, until: {"decode_context": 1024, "decode_marginal": marginal})
    monkeypatch.setattr(decode, "run_transformers",
                        lambda config, rng, vocab: {"decode_tok_s": tok_s / 4, "prefill_tok_s": {"512": tok_s, "2048": tok_s}})
    monkeypatch.setenv("ATLAS_ROUTER", "fused")
    monkeypatch.setenv("ATLAS_NORM", "fused")
    monkeypatch.setenv("ATLAS_RUN_AHEAD", "0")
    for default in ("ATLAS_GEMM", "ATLAS_CUDA_GRAPHS"):
        monkeypatch.delenv(default, raising=False)
    out = tmp_path / "r.json"
    monkeypatch.setattr(sys, "argv", ["decode.py", "--out", str(out), *([] if mode == "full" else [mode])])
    assert decode.main() == 0
    result = json.loads(out.read_text())
    forms = result["kernel_forms"]
    assert (forms["ATLAS_ROUTER"], forms["ATLAS_NORM"], forms["ATLAS_RUN_AHEAD"]) == ("fused", "fused", "0")
    assert (forms["ATLAS_GEMM"], forms["ATLAS_CUDA_GRAPHS"]) == ("mma", "1")  # defaults
    if mode == "--prefill-only":
        assert result["prefill_tok_s_by_form"] == {"simt": tok_s} and "decode_tok_s" not in result
        return
    if mode == "--marginal-only":
        assert result["decode_marginal"] == marginal and "decode_tok_s" not in result
        return
    decode_spec = _decode_spec()
    assert decode_spec.num_hidden_layers == 40
    per_token = decode.decode_bytes_per_token(decode_spec, decode.DECODE_CONTEXT + decode.DECODE_TOKENS // 2)
    assert result["roofline_pct"] == pytest.approx(100 * per_token["total"] * tok_s / 4.0e12)
    assert result["decode_profile"] == profile and result["decode_tok_s_by_setting"] == by_setting
    assert result["pick_ops_us"] == pick_us and result["decode_sampled_tok_s_by_form"] == {"error": "stand-in"}
    assert result["decode_tok_s_by_run_ahead"] == run.decode_by_run_ahead
    if mode == "full":
        assert result["speedup_vs_transformers"] == {"decode": pytest.approx(4.0), "prefill_512": pytest.approx(3.0),
                                                     "prefill_2048": pytest.approx(2.0)}
    else:
        assert "transformers" not in result and any("skipped (flag)" in n for n in result["notes"])


def test_transformers_only_compares_with_the_atlas_file(tmp_path: Path, rng: np.random.Generator,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """--transformers-only --against: transformers' rates (a stand-in here) and atlas's over them,
    from the file the bench stage wrote."""
    import json

    torch = pytest.importorskip("torch")
    import decode

    tok_s = float(rng.uniform(50, 500))
    against = tmp_path / "results.json"
    against.write_text(json.dumps({"model": synthetic.model_label(40), "decode_tok_s": tok_s, "commit": "abc1234",
                                   "prefill_tok_s": {"512": 6 * tok_s, "2048": 8 * tok_s}}))
    calls = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(decode, "run_transformers", lambda config, rng, vocab: calls.append(config["num_hidden_layers"])
                        or {"decode_tok_s": tok_s / 5, "prefill_tok_s": {"512": 2 * tok_s, "2048": 2 * tok_s}})
    out = tmp_path / "hf.json"
    assert decode.main(["--transformers-only", "--against", str(against), "--out", str(out)]) == 0
    result = json.loads(out.read_text())
    assert calls == [40] and "decode_tok_s" not in result
    assert result["against"]["commit"] == "abc1234"
    assert result["speedup_vs_transformers"] == {"decode": pytest.approx(5.0), "prefill_512": pytest.approx(3.0),
                                                 "prefill_2048": pytest.approx(4.0)}

    def broken(config: dict[str, Any], rng: Any, vocab: int) -> dict[str, Any]:
        raise RuntimeError("CUDA out of memory")

    monkeypatch.setattr(decode, "run_transformers", broken)
    assert decode.main(["--transformers-only", "--out", str(out)]) == 1  # the stage shows FAIL, the note why
    result = json.loads(out.read_text())
    assert "transformers" not in result and any("CUDA out of memory" in n for n in result["notes"])


@pytest.mark.oracle
def test_run_transformers_times_a_small_model_on_the_cpu(rng: np.random.Generator, monkeypatch: pytest.MonkeyPatch) -> None:
    """The transformers half itself (only ever run on the device otherwise): a 2-layer model of the
    same family at small dims, filled with the synthetic weights, prefill and greedy decode timed."""
    pytest.importorskip("transformers")
    import decode

    for name, value in (("PREFILL_LENGTHS", (8, 16)), ("DECODE_CONTEXT", 12), ("HF_DECODE_TOKENS", 3)):
        monkeypatch.setattr(decode, name, value)
    config = synthetic.qwen_config(2)
    config.update(hidden_size=64, intermediate_size=128, moe_intermediate_size=32, shared_expert_intermediate_size=32,
                  num_experts=8, num_experts_per_tok=2, vocab_size=300, num_attention_heads=4, num_key_value_heads=2,
                  head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16,
                  linear_value_head_dim=16, layer_types=["linear_attention", "full_attention"])
    result = decode.run_transformers(config, rng, config["vocab_size"], device="cpu")
    assert set(result["prefill_tok_s"]) == {"8", "16"} and result["decode_tokens"] == 3
    assert int(result["versions"]["transformers"].split(".")[0]) >= 5 and set(result["implementations"]) == {"attn", "experts"}
    assert all(v > 0 for v in [*result["prefill_tok_s"].values(), result["decode_tok_s"], result["load_s"]]), result


def _decode_spec() -> Any:
    import synthetic

    from atlas.config import load_spec

    with tempfile.TemporaryDirectory() as tmp:
        synthetic.write_config(Path(tmp))
        return load_spec(Path(tmp))
