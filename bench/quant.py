"""Quantized-target benchmark on the GPU (issue 5, point 7): the full 40-layer Qwen3.6-35B-A3B
dimensions with synthetic fp8-block / nvfp4 weights written on the device (no checkpoint).

    python bench/quant.py --out results.json [--budget-s 150] [--parts moe,fp8,nvfp4] [--layers 40]
    python bench/quant.py --out quant-memory.json --cpu-only   # the CPU numbers alone

Reports, per part (the JSON is rewritten after each, so a timeout keeps what finished):
- moe: the MoE grouped GEMM (one launch over all experts) against a per-expert GEMM loop on
  800 tokens x 256 experts, for bf16, fp8 and nvfp4, with the experts' device bytes;
- fp8, nvfp4: decode tok/s over 256 tokens at 1K context, bytes read per token on the quantized
  byte count, achieved GB/s and its share of the device-to-device copy bandwidth (bench/decode.py);
- always (CPU): weight memory per format (atlas.quant.memory, for the demo and qwen3.6), the
  device-layout bytes and the decode bytes per token.
Without a GPU it computes the CPU part, then prints one line "no GPU: ..." and exits 2 (--cpu-only:
writes the CPU part and exits 0).
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
import tempfile
import time
import traceback
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
import decode  # noqa: E402
import launch_settings  # noqa: E402
import synthetic  # noqa: E402
from bench_cli import gpu_missing  # noqa: E402
from provenance import git_commit  # noqa: E402

PARTS = ("moe", "fp8", "nvfp4")
MOE_TOKENS = 800
USAGE_EXIT = 2
NO_GPU_EXIT = 2


def log(message: str) -> None:
    print(f"[quant bench {time.strftime('%H:%M:%S')}] {message}", flush=True)


def expert_share(name: str, spec: Any) -> float:
    """Share of a planned tensor one decode token reads: top_k of E routed experts, one row of the
    embedding table, all of anything else."""
    if ".mlp.experts." in name:
        return spec.num_experts_per_tok / spec.num_experts
    if name.endswith("embed_tokens.weight"):
        return 1.0 / spec.vocab_size
    return 1.0


def device_bytes(name: str, shape: tuple[int, ...], fmt: str) -> int:
    """Bytes of one planned tensor on the GPU, as the runtime's memory check counts them
    (atlas.backends.cuda.footprint): converted matrices in the kernels' layout, other matrices
    bf16, vectors f32."""
    from atlas.backends.cuda.footprint import float_bytes, quantized_bytes
    from atlas.quant.exclusions import converts

    if fmt != "bf16" and converts(name, shape, fmt):
        return quantized_bytes(fmt, *shape)
    return float_bytes(shape)


def weight_read_bytes(spec: Any, fmt: str) -> int:
    """Weight bytes one decode token reads in `fmt`."""
    plan = synthetic.quant_plan(spec)
    return round(sum(device_bytes(n, s, fmt) * expert_share(n, spec) for n, s in plan.items()))


def decode_bytes(spec: Any, fmt: str, context: int) -> dict[str, int]:
    """bench/decode.py's bytes per decode token with the weights counted in `fmt`."""
    parts = dict(decode.decode_bytes_per_token(spec, context))
    weights = weight_read_bytes(spec, fmt)
    state = parts["kv_cache"] + parts["deltanet_states_read_and_written"]
    return {"weights": weights, "kv_cache": parts["kv_cache"],
            "deltanet_states_read_and_written": parts["deltanet_states_read_and_written"], "total": weights + state}


def memory_by_model() -> dict[str, Any]:
    """atlas.quant.memory's numbers (its table too) for the demo and Qwen3.6-35B-A3B."""
    from atlas.config import load_spec
    from atlas.quant.memory import FORMATS, qwen3_6_spec, table, weight_bytes
    from atlas.resolve import resolve_model

    specs = {"atlas-demo": load_spec(resolve_model(None)), "qwen3.6-35b-a3b": qwen3_6_spec()}
    return {"table": table(specs), **{m: {f: weight_bytes(s, f) for f in FORMATS} for m, s in specs.items()}}


def cpu_numbers(spec: Any) -> dict[str, Any]:
    from atlas.quant.memory import FORMATS, weight_bytes

    context = decode.DECODE_CONTEXT + decode.DECODE_TOKENS // 2
    memory = {f: weight_bytes(spec, f) for f in FORMATS}
    return {
        "atlas_quant_memory": memory_by_model(),
        "weight_memory_bytes": memory,
        "weight_memory_ratio_vs_bf16": {f: memory["bf16"] / memory[f] for f in FORMATS},
        "device_weight_bytes": {f: sum(device_bytes(n, s, f) for n, s in synthetic.quant_plan(spec).items()) for f in FORMATS},
        "decode_bytes_per_token": {f: decode_bytes(spec, f, context) for f in FORMATS},
    }


def make_quant_backend(checkpoint: synthetic.SyntheticQuantCheckpoint) -> Any:
    """bench/decode.py's backend on the checkpoint's quant tuple; its quantized uploads write the
    synthetic device layout instead of converting the (placeholder) checkpoint parts."""
    from quant_moe import upload_synthetic_quant

    backend = decode.make_bench_backend(checkpoint, checkpoint.fmt)
    rt, fmt = backend.rt, checkpoint.fmt

    def upload_quantized(weight: Any) -> Any:
        return upload_synthetic_quant(rt, fmt, weight.shape[0], weight.shape[1])

    def upload_quantized_rows(weights: list[Any], rows: np.ndarray | None, experts: int) -> Any:
        count = len(rows) if rows is not None else sum(w.shape[0] for w in weights)
        return upload_synthetic_quant(rt, fmt, count, weights[0].shape[1], experts)

    backend.upload_quantized = upload_quantized  # type: ignore[method-assign]
    backend.upload_quantized_rows = upload_quantized_rows  # type: ignore[method-assign]
    return backend


def release(backend: Any) -> None:
    backend.rt.synchronize()
    gc.collect()
    backend.rt.pool.trim()
    backend.rt.arena.release()


def run_decode(fmt: str, layers: int, rng: np.random.Generator, copy_bps: float | None) -> tuple[dict[str, Any], float]:
    """Decode tok/s of the `layers`-layer model in `fmt`; (result, copy bandwidth measured once)."""
    from atlas.backends.base import SamplingParams
    from atlas.config import load_spec
    from atlas.engine import Engine

    with tempfile.TemporaryDirectory() as tmp:
        synthetic.write_quant_config(Path(tmp), fmt, layers)
        spec = load_spec(Path(tmp))
        checkpoint = synthetic.SyntheticQuantCheckpoint(synthetic.quant_plan(spec), source=tmp, fmt=fmt)
        backend = make_quant_backend(checkpoint)
        log(f"{fmt}: atlas on {backend.describe()}; loading {layers} synthetic layers")
        t0 = time.perf_counter()
        engine = Engine(spec, checkpoint, backend, max_seq_len=decode.DECODE_CONTEXT + decode.DECODE_TOKENS + 8)
        backend.rt.synchronize()
        load_s = time.perf_counter() - t0
    allocated = backend.rt.pool.allocated_bytes
    log(f"{fmt}: loaded in {load_s:.1f}s ({allocated / 2**30:.1f} GiB on the device)")
    if copy_bps is None:
        copy_bps = decode.copy_bandwidth(backend.rt)
    prompt = rng.integers(0, spec.vocab_size, size=decode.DECODE_CONTEXT).tolist()
    engine.generate(prompt[:decode.WARMUP_TOKENS], 4, SamplingParams(), None, set())  # warm-up: module, graph capture
    stats = engine.generate(prompt, 1, SamplingParams(), None, set())
    tok_s, steps = decode.time_decode(engine, prompt, decode.DECODE_TOKENS)
    per_token = decode_bytes(spec, fmt, decode.DECODE_CONTEXT + decode.DECODE_TOKENS // 2)
    achieved = per_token["total"] * tok_s
    log(f"{fmt}: decode {tok_s:.1f} tok/s over {steps} steps, {100 * achieved / copy_bps:.1f}% of copy bandwidth")
    result = {"device": backend.describe(), "load_s": load_s, "device_bytes_allocated": allocated,
              "prefill_tok_s_1024": decode.DECODE_CONTEXT / stats.prefill_seconds,
              "decode_tok_s": tok_s, "decode_tokens": steps, "decode_context": decode.DECODE_CONTEXT,
              "decode_bytes_per_token": per_token, "decode_gb_s": achieved / 1e9,
              "roofline_pct": 100 * achieved / copy_bps, "roofline_tok_s": copy_bps / per_token["total"],
              "decode_tok_s_by_norm": decode.side_measure(f"{fmt} decode tok/s by norm form", partial(
                  time_norm_forms, engine, prompt), json.dumps)}
    del engine
    release(backend)
    return result, copy_bps


def time_norm_forms(engine: Any, prompt: list[int]) -> dict[str, Any]:
    """Greedy decode tok/s with the norms launched apart and taken into their readers
    (ATLAS_NORM=fused: the quantized in_proj / qkv GEMVs and the router), the median of
    launch_settings.ROUNDS interleaved rounds, and whether their first tokens agree."""
    from atlas.backends.cuda.norm_fusion import NORM_FORMS

    backend = engine.backend
    own = backend.norm_form

    def use(form: str) -> None:
        backend.use_decode_forms(norm=form)
        engine.reset()  # the decode graph is captured again

    try:
        tokens = {}
        for form in NORM_FORMS:
            use(form)
            tokens[form] = decode.greedy_tokens(engine, prompt, launch_settings.CHECK_TOKENS)
        rates = launch_settings.interleaved_medians(list(NORM_FORMS), use,
                                                    lambda: decode.time_decode(engine, prompt, launch_settings.TOKENS)[0])
    finally:
        use(own)
    return {**rates, "tokens_equal": tokens["separate"] == tokens["fused"], "rounds": launch_settings.ROUNDS}


def run_moe(spec: Any, rng: np.random.Generator) -> dict[str, Any]:
    """Grouped vs per-expert loop for bf16 and fp8 (on the fp8 tuple, which holds every bf16
    kernel), then nvfp4 (its own tuple)."""
    from atlas.backends.cuda.select import open_backend_for_model
    from quant_moe import MoeShape, bench_moe

    shape = MoeShape(MOE_TOKENS, spec.num_experts, spec.num_experts_per_tok, spec.hidden_size,
                     spec.moe_intermediate_size)
    result: dict[str, Any] = {"tokens": shape.tokens, "experts": shape.experts, "top_k": shape.top_k,
                              "hidden": shape.hidden, "inter": shape.inter}
    for tuple_quant, formats in (("fp8", ("bf16", "fp8")), ("nvfp4", ("nvfp4",))):
        backend = open_backend_for_model("qwen3.6-35b-a3b", tuple_quant)
        for fmt in formats:
            result[fmt] = bench_moe(backend, fmt, shape, rng)
            log(f"moe {fmt}: {json.dumps({k: result[fmt][k] for k in ('eager', 'graph')})}")
            gc.collect()
        release(backend)
    bf16_bytes = result["bf16"]["expert_weight_bytes"]
    result["memory_ratio_vs_bf16"] = {f: bf16_bytes / result[f]["expert_weight_bytes"] for f in ("fp8", "nvfp4")}
    return result


PART_ESTIMATE_S = {"moe": 30.0, "fp8": 50.0, "nvfp4": 45.0}  # H200 guesses; a part that would overrun is skipped


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    from atlas.errors import AtlasError

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True, help="result JSON (its directory must exist)")
    parser.add_argument("--budget-s", type=float, default=150.0, help="skip parts that would end past this")
    parser.add_argument("--parts", default=",".join(PARTS), help=f"comma-separated subset of {','.join(PARTS)}")
    parser.add_argument("--layers", type=int, default=synthetic.QWEN_LAYERS,
                        help="decoder layers of the decode parts (every 4th full attention); fewer for a quick run")
    parser.add_argument("--cpu-only", action="store_true", help="write the CPU numbers only (no GPU needed)")
    args = parser.parse_args(argv)
    parts = [p.strip() for p in args.parts.split(",") if p.strip()]
    unknown = [p for p in parts if p not in PARTS]
    if unknown or not parts:
        raise AtlasError(f"--parts {args.parts!r}: unknown part {unknown[0] if unknown else '(none)'}; choose from {','.join(PARTS)}")
    if args.layers < 1:
        raise AtlasError(f"--layers {args.layers}: give at least 1 layer")
    if not args.budget_s > 0:
        raise AtlasError(f"--budget-s {args.budget_s}: must be a positive number of seconds")
    if not args.out.parent.is_dir():
        raise AtlasError(f"--out {args.out}: directory {args.out.parent} does not exist; create it first")
    if args.out.is_dir():
        raise AtlasError(f"--out {args.out} is a directory; give a file path for the JSON")
    args.parts = parts
    return args


def write(out: Path, result: dict[str, Any]) -> None:
    """Write atomically (a killed run leaves the previous complete JSON)."""
    partial = out.with_name(out.name + ".partial")
    partial.write_text(json.dumps(result, indent=1), encoding="utf-8")
    partial.replace(out)


def run_parts(args: argparse.Namespace, spec: Any, result: dict[str, Any], started: float) -> int:
    rng = np.random.default_rng(synthetic.SEED)
    copy_bps: float | None = None
    failed = 0
    for part in args.parts:
        spent = time.perf_counter() - started
        if spent + PART_ESTIMATE_S[part] > args.budget_s:
            result["notes"].append(f"{part} skipped: {spent:.0f}s spent of a {args.budget_s:.0f}s budget")
            continue
        try:
            if part == "moe":
                result["moe"] = run_moe(spec, rng)
            else:
                result[part], copy_bps = run_decode(part, args.layers, rng, copy_bps)
                result["copy_gb_s"] = copy_bps / 1e9
        except Exception as err:  # record and go on: one failing part must not hide the others
            failed += 1
            result["notes"].append(f"{part} failed: {type(err).__name__}: {err}"[:400])
            log(result["notes"][-1])
            traceback.print_exc()  # where, in the log: the note has room for the message only
        result["seconds"] = time.perf_counter() - started
        write(args.out, result)
    return 1 if failed else 0


def main(argv: list[str] | None = None) -> int:
    from atlas.config import load_spec
    from atlas.errors import AtlasError

    started = time.perf_counter()
    try:
        args = parse_args(argv)
    except AtlasError as err:
        print(f"bench/quant.py: error: {err}", file=sys.stderr)
        return USAGE_EXIT
    with tempfile.TemporaryDirectory() as tmp:
        synthetic.write_config(Path(tmp), args.layers)
        spec = load_spec(Path(tmp))
    result: dict[str, Any] = {"date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "commit": git_commit(),
                              "machine": decode.machine(), "model": synthetic.model_label(args.layers),
                              "batch": 1, "notes": [], **cpu_numbers(spec)}
    if args.cpu_only:
        result["notes"].append("--cpu-only: no GPU part run")
        write(args.out, result)
        return 0
    missing = gpu_missing()
    if missing is not None:
        print(f"no GPU: {missing}", file=sys.stderr)
        return NO_GPU_EXIT
    status = run_parts(args, spec, result, started)
    result["seconds"] = time.perf_counter() - started
    write(args.out, result)
    log(json.dumps({p: result[p].get("decode_tok_s") for p in ("fp8", "nvfp4") if p in result}))
    return status


if __name__ == "__main__":
    sys.exit(main())
