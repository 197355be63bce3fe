"""Decode benchmark on the GPU: the full 40-layer Qwen3.6-35B-A3B dimensions with synthetic
weights made on the device (no checkpoint), batch 1, against transformers bf16 with the same
weights on the same GPU.

    python bench/decode.py --out results.json [--budget-s 150] [--skip-transformers] [--prefill-only]
                           [--decode-only] [--marginal-only] [--spec-only] [--layers 40]
    python bench/decode.py --transformers-only --against results.json --out hf.json

Reports prefill tok/s (512 and 2048 prompt tokens), decode tok/s (256 tokens after a 1024-token
prompt, greedy, the token id read back every step as a real generation does), bytes read per
decode token, achieved GB/s and its share of the device-to-device copy bandwidth measured here,
where a decode step's time goes (bench/step_profile.py: device time by kernel beside the
replayed step's), each token-pick kernel alone (bench/pick_ops.py), greedy decode under each
setting of the step and sampled decode under each draw form (bench/launch_settings.py: the
default or fused forms, plain or programmatic dependent launch, with or without the L2 weight
prefetch; ATLAS_SAMPLE block or split), in interleaved rounds on the one loaded model.
--prefill-only: prefill tok/s alone, once per prefill attention form (ATLAS_PREFILL_ATTENTION's
first, then the others on the same loaded model) and once per gated delta rule form, and one layer's prefill attention per KV cache
level and form (bench/kv_prefill.py); no decode and no transformers.
--decode-only: decode alone (no prefill timing, no transformers), e.g. to time other kernel forms
than the defaults quickly.
--marginal-only: each decode kernel's cost inside the replayed graph (bench/step_marginal.py: the
step with one kernel's launches doubled, against the plain one) and each weight-streaming kernel's
GB/s alone (bench/weight_bandwidth.py), nothing else; the kernels past --budget-s are listed as
not doubled and the JSON is written.
--spec-only: the checkpoint with an MTP head too; plain decode tok/s and, per K drafts, MTP
speculation's tok/s, verify-pass time and the tokens per pass it needs to beat plain decode
(bench/spec_cost.py), nothing else.
--transformers-only [--against RESULTS]: the transformers half alone, in its own process (the
device check's hf stage: the comparison neither waits on the atlas timings' share of one stage's
time nor shares the GPU's memory with atlas's weights, which an H100 cannot hold twice); with
--against, an atlas results JSON of the same model from the same GPU, the speedups over it.
"""

from __future__ import annotations

import argparse
import gc
import importlib.util
import json
import math
import os
import platform
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_cli  # noqa: E402
import kv_prefill  # noqa: E402
import launch_settings  # noqa: E402
import pick_ops  # noqa: E402
import spec_cost  # noqa: E402
import step_marginal  # noqa: E402
import step_profile  # noqa: E402
import synthetic  # noqa: E402
import weight_bandwidth  # noqa: E402
from provenance import git_commit  # noqa: E402

PREFILL_LENGTHS = (512, 2048)
DECODE_CONTEXT = 1024
DECODE_TOKENS = 256
HF_DECODE_TOKENS = 32
SAMPLED_TOKENS = 64
RECOMMENDED_SAMPLING = {"temperature": 1.0, "top_k": 20, "top_p": 0.95, "presence_penalty": 1.5}  # Qwen3.6's card
WARMUP_TOKENS = 64  # the warm-up generation's prompt: loads the modules, captures the graph
COPY_BYTES = 2 << 30
SIDE_MIN_S = 30.0  # of --budget-s left for a side measure to start (estimated from the settings' capture and decode count)
ALONE_S = 15.0  # of --budget-s the marginal run keeps for weight_bandwidth (estimated: 4 GEMV shapes and the MoE step, 6 graphs)
PROG = "bench/decode.py"


def log(message: str) -> None:
    print(f"[decode bench {time.strftime('%H:%M:%S')}] {message}", flush=True)


def make_bench_backend(checkpoint: synthetic.SyntheticCheckpoint, quant: str = "bf16") -> Any:
    """The qwen3.6 CUDA backend (the `quant` tuple) whose uploads of the checkpoint's lazy arrays
    are filled on the device with their repeated tile."""
    from atlas.backends.cuda.select import open_backend_for_model
    from atlas.backends.cuda.tensor import DeviceTensor
    from atlas.backends.cuda.upload import to_storage

    backend = open_backend_for_model("qwen3.6-35b-a3b", quant)
    plain_upload = backend.upload

    def upload(array: np.ndarray, dtype: str) -> DeviceTensor:
        entry = checkpoint.lazy.pop(id(array), None)
        if entry is None or entry[1] is not array:
            return plain_upload(array, dtype)
        name, _ = entry
        out = backend.rt.persistent(tuple(array.shape), dtype)
        pattern = to_storage(synthetic.tile(name, tuple(array.shape)), dtype)
        fill_repeating(backend.rt, out, pattern)
        return out

    backend.upload = upload  # type: ignore[method-assign]
    return backend


def fill_repeating(rt: Any, out: Any, pattern: np.ndarray) -> None:
    """out's bytes = pattern's bytes repeated (device copies doubling the filled prefix)."""
    from atlas.backends.cuda.tensor import DeviceTensor

    head = DeviceTensor(out.ptr, pattern.shape, out.dtype, out.owner)
    rt.write(head, pattern)
    filled, total = pattern.nbytes, out.nbytes
    while filled < total:
        count = min(filled, total - filled)
        rt.driver.memcpy_dtod(out.ptr + filled, out.ptr, count, rt.stream)
        filled += count
    rt.synchronize()


def decode_bytes_per_token(spec: Any, context: int) -> dict[str, int]:
    """Bytes a decode step must read: active weights (bf16 matrices, f32 vectors), the KV cache
    of the context, the DeltaNet states (read and written back), one embedding row."""
    h, e, k = spec.hidden_size, spec.num_experts, spec.num_experts_per_tok
    q = spec.num_attention_heads * spec.head_dim
    kv = spec.num_key_value_heads * spec.head_dim
    conv = 2 * spec.linear_num_key_heads * spec.linear_key_head_dim + spec.linear_num_value_heads * spec.linear_value_head_dim
    values = spec.linear_num_value_heads * spec.linear_value_head_dim
    attn = (2 * q * h + 2 * kv * h + h * q) * 2 + 2 * spec.head_dim * 4
    delta = (conv * h + values * h + 2 * spec.linear_num_value_heads * h + h * values) * 2 + conv * 4 * 2
    expert = 3 * spec.moe_intermediate_size * h * 2
    shared = 3 * spec.shared_expert_intermediate_size * h * 2 + h * 2
    moe = e * h * 2 + k * expert + shared
    full_layers = sum(1 for t in spec.layer_types if t == "full_attention")
    linear_layers = spec.num_hidden_layers - full_layers
    state = spec.linear_num_value_heads * spec.linear_key_head_dim * spec.linear_value_head_dim * 4
    conv_state = conv * (spec.linear_conv_kernel_dim - 1) * 4
    parts = {
        "attention_weights": full_layers * attn,
        "deltanet_weights": linear_layers * delta,
        "moe_weights": spec.num_hidden_layers * (moe + 2 * h * 4),
        "lm_head_and_embedding_row": spec.vocab_size * h * 2 + h * 2 + h * 4,
        "kv_cache": full_layers * 2 * context * kv * 2,
        "deltanet_states_read_and_written": linear_layers * 2 * (state + conv_state),
    }
    parts["total"] = sum(parts.values())
    return parts


def copy_bandwidth(rt: Any) -> float:
    """Device-to-device copy bandwidth, bytes read + written per second (median of 5)."""
    src, dst = rt.persistent((COPY_BYTES // 4,), "f32"), rt.persistent((COPY_BYTES // 4,), "f32")
    rt.memset_zero(src)
    start, end = rt.driver.event_create(), rt.driver.event_create()
    times = []
    for _ in range(6):
        rt.driver.event_record(start, rt.stream)
        rt.driver.memcpy_dtod(dst.ptr, src.ptr, COPY_BYTES, rt.stream)
        rt.driver.event_record(end, rt.stream)
        rt.driver.event_synchronize(end)
        times.append(rt.driver.event_elapsed_ms(start, end) / 1e3)
    return 2 * COPY_BYTES / float(np.median(times[1:]))


@dataclass
class AtlasRun:
    prefill_tok_s: dict[str, float]
    decode_tok_s: float
    decode_tokens: int
    load_s: float
    decode_sampled_tok_s: float  # with RECOMMENDED_SAMPLING, over SAMPLED_TOKENS
    decode_profile: dict[str, Any]  # step_profile.profile_decode: device time by kernel
    decode_by_setting: dict[str, Any]  # launch_settings.time_settings: forms x launch form x weight prefetch
    decode_sampled_by_form: dict[str, Any]  # launch_settings.time_sample_forms: ATLAS_SAMPLE block vs split
    decode_by_run_ahead: dict[str, Any]  # launch_settings.time_run_ahead: the decode loop a step ahead or in turn
    pick_ops_us: dict[str, float]  # pick_ops.time_pick_ops: each pick kernel alone


def time_decode(engine: Any, prompt: list[int], tokens: int, sampling: Any = None) -> tuple[float, int]:
    """Decode tok/s after `prompt` (greedy, or `sampling` with its penalties) through the engine's
    decode loop, as streaming generation runs it (atlas.decode_loop: the picked id tensor feeds
    the next step on the device, every id is read back, and the loop runs a step ahead unless
    the backend's runs_ahead is off); the first step (the graph capture) is left out of the time."""
    from atlas.backends.base import SamplingParams
    from atlas.decode_loop import Picking, decoded_tokens
    from atlas.sampling import pick_state

    sampling, rng = sampling or SamplingParams(), np.random.default_rng(0)
    picking = Picking(sampling, rng, pick_state(prompt, set(), sampling, None))
    stream = decoded_tokens(engine, engine.prefill(prompt), len(prompt), tokens + 1, picking)
    next(stream)  # the prefill's pick
    next(stream)  # the first step's, captured
    started = time.perf_counter()
    steps = sum(1 for _ in stream)
    return steps / (time.perf_counter() - started), steps


def greedy_tokens(engine: Any, prompt: list[int], count: int) -> list[int]:
    from atlas.backends.base import SamplingParams

    tokens: list[int] = []
    engine.generate(prompt, count, SamplingParams(), None, set(), on_token=tokens.append)
    return tokens


def time_prefill(engine: Any, prompt: list[int]) -> dict[str, float]:
    """Best of two prefill tok/s per PREFILL_LENGTHS prompt length."""
    from atlas.backends.base import SamplingParams

    prefill = {}
    for length in PREFILL_LENGTHS:
        runs = []
        for _ in range(2):
            stats = engine.generate(prompt[:length], 1, SamplingParams(), None, set())
            runs.append(length / stats.prefill_seconds)
        prefill[str(length)] = float(max(runs))
        log(f"prefill {length}: {prefill[str(length)]:.0f} tok/s")
    return prefill


def load_engine(spec: Any, max_seq_len: int, mtp: bool = False) -> tuple[Any, Any, float]:
    """(backend, engine, seconds) for the synthetic checkpoint of `spec` on the GPU; with `mtp`
    the checkpoint has the MTP head too and the engine speculates with it."""
    from atlas.engine import Engine
    from atlas.models.qwen3_5_moe_mtp import mtp_plan
    from atlas.speculative import SpeculativeEngine

    plan = {**synthetic.text_plan(spec), **(mtp_plan(spec, fused=True) if mtp else {})}
    checkpoint = synthetic.SyntheticCheckpoint(plan)
    backend = make_bench_backend(checkpoint)
    log(f"atlas on {backend.describe()}; loading {spec.num_hidden_layers} synthetic layers{' and an MTP head' * mtp}")
    t0 = time.perf_counter()
    if mtp:
        with spec_cost.lazy_head_weights(checkpoint.lazy):
            engine = SpeculativeEngine(spec, checkpoint, backend, max_seq_len=max_seq_len)
    else:
        engine = Engine(spec, checkpoint, backend, max_seq_len=max_seq_len)
    backend.rt.synchronize()
    return backend, engine, time.perf_counter() - t0


def run_marginal(spec: Any, rng: np.random.Generator, until: float = math.inf) -> dict[str, Any]:
    """Each decode kernel's cost inside the replayed graph (bench/step_marginal.py), at the
    decode benchmark's context, and the weight-streaming kernels' GB/s alone, each inside the
    budget (`until`, perf_counter time): the kernels doubled leave ALONE_S seconds for the second."""
    from atlas.backends.base import SamplingParams

    backend, engine, load_s = load_engine(spec, DECODE_CONTEXT + step_marginal.STEPS + 8)
    prompt = rng.integers(0, spec.vocab_size, size=DECODE_CONTEXT).tolist()
    engine.generate(prompt[:WARMUP_TOKENS], 4, SamplingParams(), None, set())  # warm-up: module, graph capture
    token = backend.upload(np.array([prompt[0]], dtype=np.int32), "i32")
    marginal = step_marginal.marginal_costs(engine, prompt, token, time_decode, until=until - ALONE_S)
    log(step_marginal.summary_line(marginal))
    alone = side_measure("weights streamed alone", lambda: weight_bandwidth.measure(engine, token, DECODE_CONTEXT, rng),
                         weight_bandwidth.summary_line, until, min_s=ALONE_S)
    return {"device": backend.describe(), "load_s": load_s, "decode_context": DECODE_CONTEXT,
            "decode_marginal": marginal, "weights_streamed_alone": alone}


def run_spec(spec: Any, rng: np.random.Generator) -> dict[str, Any]:
    """MTP speculation's verify-pass cost against the plain loop at the decode benchmark's
    context (bench/spec_cost.py)."""
    from atlas.backends.base import SamplingParams

    backend, engine, load_s = load_engine(spec, DECODE_CONTEXT + spec_cost.TOKENS + 8, mtp=True)
    prompt = rng.integers(0, spec.vocab_size, size=DECODE_CONTEXT).tolist()
    engine.generate(prompt[:WARMUP_TOKENS], 4, SamplingParams(), None, set())  # warm-up: module, kernels
    result = spec_cost.measure(engine, prompt, time_decode)
    log(spec_cost.summary_line(result))
    return {"device": backend.describe(), "load_s": load_s, "decode_context": DECODE_CONTEXT, "decode_spec": result}


def time_delta_rule_forms(engine: Any, prompt: list[int]) -> dict[str, dict[str, float]]:
    """Prefill tok/s per gated delta rule form (ATLAS_DELTA_RULE, which the backend reads per
    prompt), with the backend's own attention form; the variable is restored afterwards."""
    from atlas.backends.base import SamplingParams
    from atlas.backends.cuda.ops_linear_moe import DELTA_RULE_ENV, DELTA_RULE_SWITCH

    own = os.environ.get(DELTA_RULE_ENV)
    rates = {}
    try:
        for form in DELTA_RULE_SWITCH.forms:
            os.environ[DELTA_RULE_ENV] = form
            log(f"delta rule {form}")
            engine.generate(prompt[:WARMUP_TOKENS], 1, SamplingParams(), None, set())  # warm-up: the form's kernels
            rates[form] = time_prefill(engine, prompt)
    finally:
        if own is None:
            os.environ.pop(DELTA_RULE_ENV, None)
        else:
            os.environ[DELTA_RULE_ENV] = own
    return rates


def run_prefill_forms(spec: Any, rng: np.random.Generator) -> dict[str, Any]:
    """Prefill tok/s with each prefill attention form on one loaded model (the backend's own form,
    from ATLAS_PREFILL_ATTENTION, first)."""
    from atlas.backends.base import SamplingParams
    from atlas.backends.cuda.ops_dense import PREFILL_ATTENTION_FORMS

    backend, engine, load_s = load_engine(spec, max(PREFILL_LENGTHS) + 8)
    result: dict[str, Any] = {"device": backend.describe(), "load_s": load_s,
                              "prefill_attention": backend.prefill_attention, "gemm": backend.gemm_form,
                              "prefill_tok_s_by_form": {}}
    prompt = rng.integers(0, spec.vocab_size, size=max(PREFILL_LENGTHS)).tolist()
    own = backend.prefill_attention
    for form in (own, *(f for f in PREFILL_ATTENTION_FORMS if f != own)):
        backend.prefill_attention = form
        log(f"prefill attention {form}")
        engine.generate(prompt[:WARMUP_TOKENS], 1, SamplingParams(), None, set())  # warm-up: the form's kernels
        result["prefill_tok_s_by_form"][form] = time_prefill(engine, prompt)
    backend.prefill_attention = own
    result["prefill_tok_s"] = result["prefill_tok_s_by_form"][own]
    result["prefill_tok_s_by_delta_rule"] = time_delta_rule_forms(engine, prompt)
    try:
        result["prefill_attention_by_level"] = kv_prefill.time_levels(backend, spec, rng)
        log(kv_prefill.summary_line(result["prefill_attention_by_level"]))
    except Exception as err:  # a measurement on the side: its failure is recorded, the prefill rates kept
        result["prefill_attention_by_level_error"] = f"{type(err).__name__}: {err}"[:400]
    return result


def side_measure(what: str, measure: Callable[[], dict[str, Any]], line: Callable[[dict[str, Any]], str],
                 until: float = math.inf, min_s: float = SIDE_MIN_S) -> dict[str, Any]:
    """measure()'s result, logged; its failure recorded as {"error": ...}: a comparison on the
    side must not cost the run's main numbers. Skipped (an "error" saying so) when fewer than
    min_s seconds are left before `until` (perf_counter time): a stage's time limit must not
    kill the run before it writes its JSON."""
    if (left := until - time.perf_counter()) < min_s:
        log(f"{what}: skipped, {max(left, 0.0):.0f} s of the budget left")
        return {"error": f"skipped: {max(left, 0.0):.0f} s of --budget-s left, this measure starts with {min_s:.0f}"}
    try:
        result = measure()
    except Exception as err:
        traceback.print_exc()
        return {"error": f"{type(err).__name__}: {err}"[:400]}
    log(f"{what}: {line(result)}")
    return result


def run_atlas(spec: Any, rng: np.random.Generator, timed_prefill: bool = True,
              until: float = math.inf) -> tuple[AtlasRun, float, str]:
    """The main numbers (prefill, greedy and sampled decode), then the side measures while the
    budget (`until`, perf_counter time) lasts."""
    from atlas.backends.base import SamplingParams

    backend, engine, load_s = load_engine(spec, max(PREFILL_LENGTHS) + DECODE_TOKENS + 8)
    device = backend.describe()
    log(f"loaded in {load_s:.1f}s; copy bandwidth")
    copy_bps = copy_bandwidth(backend.rt)
    prompt = rng.integers(0, spec.vocab_size, size=max(PREFILL_LENGTHS)).tolist()
    engine.generate(prompt[:WARMUP_TOKENS], 4, SamplingParams(), None, set())  # warm-up: module, graph capture
    prefill = time_prefill(engine, prompt) if timed_prefill else {}
    decode, steps = time_decode(engine, prompt[:DECODE_CONTEXT], DECODE_TOKENS)
    log(f"decode at {DECODE_CONTEXT} context: {decode:.1f} tok/s over {steps} steps")
    sampled, _ = time_decode(engine, prompt[:DECODE_CONTEXT], SAMPLED_TOKENS, SamplingParams(**RECOMMENDED_SAMPLING))
    log(f"sampled decode (Qwen's recommended settings, penalties on the device): {sampled:.1f} tok/s")
    pick_us = pick_ops.time_pick_ops(backend, spec.vocab_size, RECOMMENDED_SAMPLING, rng)
    log(pick_ops.summary_line(pick_us))
    by_setting = side_measure("settings", partial(launch_settings.time_settings, engine, prompt[:DECODE_CONTEXT],
                                                  time_decode, greedy_tokens), launch_settings.summary_line, until)
    sample_forms = side_measure("sampled decode tok/s by form", partial(
        launch_settings.time_sample_forms, engine, prompt[:DECODE_CONTEXT], time_decode,
        SamplingParams(**RECOMMENDED_SAMPLING)), json.dumps, until)
    run_ahead = side_measure("decode tok/s a step ahead or in turn", partial(
        launch_settings.time_run_ahead, engine, prompt[:DECODE_CONTEXT], time_decode),
        launch_settings.run_ahead_line, until)
    token = backend.upload(np.array([prompt[0]], dtype=np.int32), "i32")
    profile = side_measure("profile", partial(step_profile.profile_decode, engine, token, DECODE_CONTEXT + SAMPLED_TOKENS,
                                              1e6 / decode), step_profile.summary_line, until)
    del engine
    backend.rt.synchronize()
    gc.collect()
    backend.rt.pool.trim()
    backend.rt.arena.release()  # transformers needs the memory next
    return AtlasRun(prefill, decode, steps, load_s, sampled, profile, by_setting, sample_forms, run_ahead,
                    pick_us), copy_bps, device


def transformers_model(config: dict[str, Any], device: str) -> Any:
    """transformers' Qwen3.5-MoE in bf16 on `device`, holding the synthetic weights."""
    import torch
    from transformers import Qwen3_5MoeForCausalLM, Qwen3_5MoeTextConfig

    with torch.device(device):
        model = Qwen3_5MoeForCausalLM._from_config(Qwen3_5MoeTextConfig.from_dict(config), dtype=torch.bfloat16).eval()
    synthetic.fill_torch_model(model)
    # The synthetic config has no end-of-sequence token (eos_token_id []), which generate() reads
    # as a pad token and indexes: neither stops nor pads here.
    model.generation_config.eos_token_id, model.generation_config.pad_token_id = None, 0
    return model


def run_transformers(config: dict[str, Any], rng: np.random.Generator, vocab: int, device: str = "cuda") -> dict[str, Any]:
    """transformers bf16 with the same synthetic weights, on `device` (the GPU; "cpu" for tests)."""
    import torch
    import transformers

    def sync() -> None:
        if device == "cuda":
            torch.cuda.synchronize()

    t0 = time.perf_counter()
    model = transformers_model(config, device)
    sync()
    load_s = time.perf_counter() - t0
    log(f"transformers model ready in {load_s:.1f}s")
    prompt = torch.from_numpy(rng.integers(0, vocab, size=(1, max(PREFILL_LENGTHS)))).to(device)
    # what the comparison ran: the versions and the attention / experts code transformers picked
    result: dict[str, Any] = {"load_s": load_s, "prefill_tok_s": {},
                              "versions": {"torch": torch.__version__, "transformers": transformers.__version__},
                              "implementations": {kind: getattr(model.config, f"_{kind}_implementation", None)
                                                  for kind in ("attn", "experts")}}
    with torch.no_grad():
        model(prompt[:, :64])
        for length in PREFILL_LENGTHS:
            sync()
            t = time.perf_counter()
            model(prompt[:, :length])
            sync()
            result["prefill_tok_s"][str(length)] = length / (time.perf_counter() - t)
        t = time.perf_counter()
        out = model.generate(prompt[:, :DECODE_CONTEXT], max_new_tokens=1, do_sample=False)
        sync()
        first = time.perf_counter() - t
        t = time.perf_counter()
        out = model.generate(prompt[:, :DECODE_CONTEXT], max_new_tokens=HF_DECODE_TOKENS + 1,
                             min_new_tokens=HF_DECODE_TOKENS + 1, do_sample=False)
        sync()
        steps = out.shape[1] - DECODE_CONTEXT - 1
        result["decode_tok_s"] = steps / max(time.perf_counter() - t - first, 1e-9)
        result["decode_tokens"] = steps
    log(f"transformers decode {result['decode_tok_s']:.1f} tok/s over {result['decode_tokens']} steps")
    del model
    gc.collect()
    if device == "cuda":
        torch.cuda.empty_cache()
    return result


def machine() -> dict[str, Any]:
    info = {"python": platform.python_version(), "platform": platform.platform()}
    try:
        info["gpu"] = subprocess.run(
            ["nvidia-smi", "--query-gpu=name,driver_version,clocks.sm,clocks.mem", "--format=csv,noheader"],
            capture_output=True, text=True, timeout=20).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        info["gpu"] = "unknown"
    return info


def kernel_forms() -> dict[str, str]:
    """The kernel form or setting each ATLAS_* switch that changes a measured rate picks in this
    run (defaults included)."""
    from atlas.backends.cuda import norm_fusion, ops_delta_decode, ops_dense, ops_linear_moe
    from atlas.backends.cuda.runtime import GRAPHS_SWITCH, LAUNCH_SWITCH, PREFETCH_SWITCH, RUN_AHEAD_SWITCH

    switches = (ops_dense.GEMM_SWITCH, ops_dense.PREFILL_ATTENTION_SWITCH, ops_dense.ATTENTION_PREP_SWITCH,
                ops_linear_moe.ROUTER_SWITCH, ops_linear_moe.DELTA_RULE_SWITCH, ops_delta_decode.DECODE_SWITCH,
                norm_fusion.NORM_SWITCH, ops_dense.SAMPLE_SWITCH, LAUNCH_SWITCH, PREFETCH_SWITCH, GRAPHS_SWITCH,
                RUN_AHEAD_SWITCH)
    return {switch.env: switch.read() for switch in switches}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The flags, checked before any work (bad ones raise AtlasError)."""
    from atlas.dump import check_writable
    from atlas.errors import AtlasError

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True, help="result JSON (its directory must exist)")
    parser.add_argument("--budget-s", type=float, default=170.0)
    parser.add_argument("--layers", type=int, default=synthetic.QWEN_LAYERS,
                        help="decoder layers (every 4th full attention); fewer for a quick run")
    parser.add_argument("--skip-transformers", action="store_true")
    parser.add_argument("--decode-only", action="store_true",
                        help="decode tok/s only (no prefill timing, no transformers)")
    parser.add_argument("--prefill-only", action="store_true",
                        help="prefill tok/s per prefill attention form only (no decode, no transformers)")
    parser.add_argument("--marginal-only", action="store_true",
                        help="each decode kernel's cost inside the replayed graph only (bench/step_marginal.py)")
    parser.add_argument("--spec-only", action="store_true",
                        help="MTP speculation's verify-pass cost against plain decode only (bench/spec_cost.py)")
    parser.add_argument("--transformers-only", action="store_true",
                        help="transformers bf16 on the same synthetic weights only, no atlas")
    parser.add_argument("--against", type=Path,
                        help="with --transformers-only: atlas's results JSON of the same model, for the speedups")
    args = parser.parse_args(argv)
    modes = [flag for flag in ("decode_only", "prefill_only", "marginal_only", "spec_only", "transformers_only")
             if getattr(args, flag)]
    if len(modes) > 1:
        raise AtlasError(f"--{modes[0].replace('_', '-')} and --{modes[1].replace('_', '-')}: give one mode at a time")
    if args.against is not None and not args.transformers_only:
        raise AtlasError("--against: only with --transformers-only (a full run compares with its own numbers)")
    args.against_result = None if args.against is None else read_atlas_result(args.against,
                                                                               synthetic.model_label(args.layers))
    if args.layers < 1:
        raise AtlasError(f"--layers {args.layers}: give at least 1 layer")
    if not args.budget_s > 0:
        raise AtlasError(f"--budget-s {args.budget_s}: must be a positive number of seconds")
    check_writable(args.out, "--out")
    return args


def atlas_result(spec: Any, rng: np.random.Generator, decode_only: bool, until: float = math.inf) -> dict[str, Any]:
    """Prefill / decode tok/s, bytes per decode token and the roofline."""
    atlas_run, copy_bps, device = run_atlas(spec, rng, timed_prefill=not decode_only, until=until)
    bytes_per_token = decode_bytes_per_token(spec, DECODE_CONTEXT + DECODE_TOKENS // 2)
    achieved = bytes_per_token["total"] * atlas_run.decode_tok_s
    return {
        "device": device, "load_s": atlas_run.load_s,
        "prefill_tok_s": atlas_run.prefill_tok_s, "decode_tok_s": atlas_run.decode_tok_s,
        "decode_tokens": atlas_run.decode_tokens, "decode_context": DECODE_CONTEXT,
        "decode_sampled_tok_s": atlas_run.decode_sampled_tok_s, "decode_sampled": RECOMMENDED_SAMPLING,
        "pick_ops_us": atlas_run.pick_ops_us,
        "decode_profile": atlas_run.decode_profile, "decode_tok_s_by_setting": atlas_run.decode_by_setting,
        "decode_sampled_tok_s_by_form": atlas_run.decode_sampled_by_form,
        "decode_tok_s_by_run_ahead": atlas_run.decode_by_run_ahead,
        "decode_bytes_per_token": bytes_per_token, "decode_gb_s": achieved / 1e9,
        "copy_gb_s": copy_bps / 1e9, "roofline_pct": 100 * achieved / copy_bps,
        "roofline_tok_s": copy_bps / bytes_per_token["total"],
    }


def read_atlas_result(path: Path, model: str) -> dict[str, Any]:
    """--against's JSON: atlas's decode and prefill rates for `model`, or AtlasError in one line."""
    from atlas.errors import AtlasError

    try:
        result = json.loads(path.read_text())
    except (OSError, ValueError) as err:
        raise AtlasError(f"--against {path}: not a readable JSON file ({err}); give bench/decode.py's --out of an "
                         "atlas run") from None
    if not isinstance(result, dict) or not isinstance(result.get("decode_tok_s"), (int, float)):
        raise AtlasError(f"--against {path}: holds no decode_tok_s; give the --out of an atlas run that timed decode")
    if result.get("model") != model:
        raise AtlasError(f"--against {path}: its model is {result.get('model')!r}, this run's {model!r}; "
                         "pass the same --layers")
    return result


def speedups(atlas: dict[str, Any], hf: dict[str, Any]) -> dict[str, float]:
    """atlas's rate over transformers' for decode and each prefill length both timed."""
    prefill = atlas.get("prefill_tok_s") or {}
    return {"decode": atlas["decode_tok_s"] / hf["decode_tok_s"],
            **{f"prefill_{k}": prefill[k] / v for k, v in hf["prefill_tok_s"].items() if k in prefill}}


def compare_transformers(result: dict[str, Any], atlas: dict[str, Any] | None, config: dict[str, Any],
                         rng: np.random.Generator, vocab: int) -> None:
    """result["transformers"] and, given atlas's rates, result["speedup_vs_transformers"]; a failure
    is a note instead."""
    try:
        hf = run_transformers(config, rng, vocab)
    except Exception as err:  # the comparison is optional; record why it is missing
        result["notes"].append(f"transformers comparison failed: {type(err).__name__}: {err}"[:400])
        traceback.print_exc()  # where, in the log: the note has room for the message only
        return
    result["transformers"] = hf
    if atlas is not None:
        result["speedup_vs_transformers"] = speedups(atlas, hf)


def transformers_only(args: argparse.Namespace, result: dict[str, Any], config: dict[str, Any], vocab: int,
                      rng: np.random.Generator) -> int:
    """--transformers-only: result with transformers' rates (and the speedups over --against) to
    --out; exit code 1 when transformers failed (the note says why)."""
    from atlas.dump import write_json
    from atlas.errors import AtlasError

    missing = [name for name in ("torch", "transformers") if importlib.util.find_spec(name) is None]
    if missing:
        raise AtlasError(f"--transformers-only needs {' and '.join(missing)}: pip install 'atlas[oracle]'")
    import torch

    if not torch.cuda.is_available():
        raise bench_cli.NoGpu("torch sees no CUDA device: transformers runs on the GPU here")
    started = time.perf_counter()
    against = args.against_result
    if against is not None:
        result["against"] = {"path": str(args.against), **{k: against.get(k) for k in ("commit", "device", "date")}}
    compare_transformers(result, against, config, rng, vocab)
    result["seconds"] = time.perf_counter() - started
    write_json(args.out, result)
    log(json.dumps({k: result[k] for k in ("transformers", "speedup_vs_transformers", "notes") if k in result}))
    return 0 if "transformers" in result else 1


def main(argv: list[str] | None = None) -> int:
    """Bad flags, no GPU or an AtlasError from the run: one line on stderr, exit code 2, no JSON."""
    from atlas.errors import AtlasError

    try:
        args = parse_args(argv)
    except AtlasError as err:
        return bench_cli.fail(PROG, str(err))
    try:
        return run(args)
    except bench_cli.NoGpu as err:
        return bench_cli.no_gpu(str(err))
    except AtlasError as err:  # the device refused, or the JSON could not be written
        return bench_cli.fail(PROG, str(err))


def run(args: argparse.Namespace) -> int:
    from atlas.config import load_spec
    from atlas.dump import write_json
    from atlas.errors import AtlasError

    started = time.perf_counter()
    rng = np.random.default_rng(synthetic.SEED)
    with tempfile.TemporaryDirectory() as tmp:
        config = synthetic.write_config(Path(tmp), args.layers)
        spec = load_spec(Path(tmp))
    result: dict[str, Any] = {"date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "commit": git_commit(),
                              "machine": machine(), "model": synthetic.model_label(args.layers),
                              "batch": 1, "notes": [], "kernel_forms": kernel_forms()}
    if args.transformers_only:
        return transformers_only(args, result, config, spec.vocab_size, rng)
    try:
        if args.marginal_only:
            result.update(run_marginal(spec, rng, until=started + args.budget_s))
        elif args.spec_only:
            result.update(run_spec(spec, rng))
        else:
            result.update(run_prefill_forms(spec, rng) if args.prefill_only
                          else atlas_result(spec, rng, args.decode_only, until=started + args.budget_s))
    except (AtlasError, ImportError, OSError):
        if (missing := bench_cli.gpu_missing()) is not None:  # atlas finds no driver, binding or GPU
            raise bench_cli.NoGpu(missing) from None
        raise
    if args.marginal_only or args.spec_only:
        shown = ("decode_context",)
    elif args.prefill_only:
        shown = ("prefill_attention", "prefill_tok_s_by_form")
    else:
        spent = time.perf_counter() - started
        if args.skip_transformers or args.decode_only or spent > 0.5 * args.budget_s:
            why = "flag" if args.skip_transformers or args.decode_only else f"{spent:.0f}s spent"
            result["notes"].append(f"transformers comparison skipped ({why})")
        else:
            # atlas's numbers are on disk first: a transformers run the stage's time limit kills
            # leaves them, with this note, instead of no JSON at all
            write_json(args.out, {**result, "notes": [*result["notes"], "transformers comparison did not finish"]})
            compare_transformers(result, result, config, rng, spec.vocab_size)
        shown = ("prefill_tok_s", "decode_tok_s", "roofline_pct")
    result["seconds"] = time.perf_counter() - started
    write_json(args.out, result)  # atomic: a killed run leaves no half-written JSON
    log(json.dumps({k: result[k] for k in shown}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
