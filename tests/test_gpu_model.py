"""Whole-model checks on the GPU: the demo recites, greedy GPU == greedy numpy on the demo, and a
4-layer model with the real Qwen3.6-35B-A3B dimensions agrees with transformers fp32 on the same
GPU (teacher-forced next token >= 99 % over the 256 positions without a near-tie, a tied token at
the others, every layer's hidden-state norm within 2 %)."""

from __future__ import annotations

import math
import os
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from _gpu import assert_no_op_off
from atlas.errors import AtlasError

pytestmark = pytest.mark.gpu

QWEN_LAYERS = 4
TORCH_DEVICE = "cuda"  # transformers fp32 runs on the same GPU
ATLAS_DEVICE = "cuda"
POSITIONS = 256
DEMO_PROMPTS = ("Beautiful is better than", "Errors should never", "Now is better")
GREEDY_TOKENS = 96
# The random prompt is an excerpt of the text the demo was trained on. Random token ids took the demo
# off its distribution, where a correct GPU's bf16 rounding (prefill GEMMs on bf16 activations)
# can move the logits far: on the CPU stand-in of the CUDA backend (tests/test_gpu_engine_stand_in.py)
# 1 of 100 random-id prompts diverged from numpy (a near-tie, top-2 gap 5.5e-4 of the largest logit),
# and 4 of 300 more even when redrawn below NEAR_TIE, at their first token (one examined: numpy's
# top-2 gap 11 % of the largest logit, the stand-in's logits 29 % off: no near-tie).
# A greedy choice whose numpy top-2 gap is under NEAR_TIE of the step's largest |logit| is redrawn.
NEAR_TIE = 2e-2
MAX_DRAWS = 20
PASSES_FLOOR = 5e-3
# test_qwen_dims_match_transformers: a next token whose transformers top-2 gap is under QWEN_NEAR_TIE
# of the position's largest |logit| may go the other way on a correct GPU. At these dims the kernels'
# bf16 roundings (prefill GEMM activations, grouped MoE x and act, the KV cache) move the logits ~1 %:
# on a CPU stand-in (numpy with those roundings; a 4-layer checkpoint of _random_value's weights) 1-5
# of the 256 next tokens flipped for each of 9 prompts, at gaps up to 1.0e-2, and 4 of the 9 fell
# under the former 99 % agreement over all positions. ~15 % of positions lie under 3e-2.
QWEN_NEAR_TIE = 3e-2
# test_embeddings_on_the_gpu_match_numpy: on the CPU stand-in (the kernels' bf16 roundings) the last
# row's relative error was 7.7e-4 median, 2.1e-2 at most over 40 excerpts (a row after bf16 prefill
# GEMMs can move far, as the logits do: test_prompt_in_passes_on_the_gpu); the mean's 4.4e-3 at most.
# A wrong row or count is off by ~1: the bound checks the pooling, the op tests the kernels' accuracy.
EMBED_RTOL = 5e-2
GRAPH_STEPS = 24
GRAPH_RTOL = 1e-5  # graph replay against eager decoding, per step's logits
CROSS_CHECK_TOKENS = 28  # test_qwen_dims_each_op_matches_numpy: 24 prefilled (GEMMs), 4 decode steps
CROSS_CHECK_DECODE_STEPS = 4


def gpu_llm() -> Any:
    from atlas import LLM

    try:
        return LLM(device=ATLAS_DEVICE)
    except (AtlasError, ImportError) as err:
        if os.environ.get("ATLAS_REQUIRE_GPU") == "1":
            raise
        pytest.skip(f"no CUDA backend here: {err}")


@pytest.fixture(scope="module")
def demo_gpu() -> Any:
    return gpu_llm()


def test_demo_recites_on_the_gpu(demo_gpu: Any) -> None:
    from atlas.demo import DEMO_PROMPT, zen_of_python

    zen = zen_of_python()
    result = demo_gpu.generate(DEMO_PROMPT, max_tokens=400, temperature=0.0)
    recited = DEMO_PROMPT + result.text
    assert recited[:300] == zen[:300]


def test_greedy_gpu_equals_greedy_numpy_on_the_demo(demo_gpu: Any, rng: np.random.Generator) -> None:
    from atlas import LLM

    cpu = LLM(device="cpu")
    for prompt in (*DEMO_PROMPTS, well_separated_prompt(cpu, rng)):
        want = cpu.generate(prompt, max_tokens=GREEDY_TOKENS, temperature=0.0).token_ids
        got = demo_gpu.generate(prompt, max_tokens=GREEDY_TOKENS, temperature=0.0).token_ids
        if got != want:
            at = _first_difference(got, want)
            pytest.fail(f"prompt {prompt!r}: first difference at {at}; {first_op_off(cpu, prompt, want[:at])}")


def first_op_off(cpu: Any, prompt: str | list[int], path: list[int]) -> str:
    """Where the GPU leaves numpy on the way to a differing token: the prompt prefilled and the
    common path decoded on the GPU, each intermediate against the numpy backend's (cross_check)."""
    from atlas.cross_check import DEFAULT_TOLERANCE, CheckedRun, check_backend, first_flagged
    from atlas.demo import DEMO_DIR
    from atlas.llm import encode_prompt

    ids = encode_prompt(cpu.tokenizer, prompt, False) + path
    reports, _ = check_backend(DEMO_DIR, ATLAS_DEVICE, cpu.parts.spec, ids, run=CheckedRun(len(path)))
    flagged = first_flagged(reports)
    if flagged is None:
        return "every intermediate on the way is within tolerance of numpy's (a near tie?)"
    return f"first intermediate off numpy's: {flagged.name}: {flagged.reason(DEFAULT_TOLERANCE)}"


def greedy_margin(cpu: Any, prompt: list[int]) -> float:
    """The smallest top-2 logit gap / largest |logit| along the numpy greedy path after `prompt`."""
    path = cpu.generate(prompt, max_tokens=GREEDY_TOKENS, temperature=0.0).token_ids
    logits = np.asarray(cpu.parts.engine.logits(prompt + path))[len(prompt) - 1 : -1]  # [N, V]
    top2 = np.sort(logits, axis=-1)[:, -2:]
    return float(((top2[:, 1] - top2[:, 0]) / np.abs(logits).max(axis=-1)).min())


def demo_text_excerpt(llm: Any, rng: np.random.Generator, shortest: int, longest: int) -> list[int]:
    """shortest..longest - 1 consecutive tokens of the demo's text, repeated once to give 300+ tokens."""
    from atlas.demo import zen_of_python

    text = llm.tokenizer.encode(zen_of_python(), add_special_tokens=False) * 2
    length = int(rng.integers(shortest, min(longest, len(text))))
    start = int(rng.integers(0, len(text) - length + 1))
    return text[start : start + length]


def well_separated_prompt(cpu: Any, rng: np.random.Generator) -> list[int]:
    """A random excerpt of the demo's text (3..39 tokens) whose numpy greedy path has no choice
    within NEAR_TIE of a tie."""
    for _ in range(MAX_DRAWS):
        prompt = demo_text_excerpt(cpu, rng, 3, 40)
        if greedy_margin(cpu, prompt) > NEAR_TIE:
            return prompt
    pytest.fail(f"no random prompt without a near-tie in {MAX_DRAWS} draws")


def test_graph_replay_equals_eager_decode(demo_gpu: Any, rng: np.random.Generator) -> None:
    backend = demo_gpu.parts.engine.backend
    prompt = rng.integers(0, demo_gpu.parts.spec.vocab_size, size=int(rng.integers(2, 30))).tolist()
    runs = {}
    for graphs in (True, False):
        backend.use_graphs = graphs
        try:
            runs[graphs] = demo_gpu.generate(prompt, max_tokens=64, temperature=0.0).token_ids
        finally:
            backend.use_graphs = True
    assert runs[True] == runs[False], f"first difference at {_first_difference(runs[True], runs[False])}"


def test_graph_replay_logits_equal_eager(demo_gpu: Any, rng: np.random.Generator) -> None:
    """Step by step, the logits of CUDA graph replay equal eager decoding's (the same kernels on the
    same inputs: only an atomic's summation order may move the last bits), so a stale buffer or a
    step captured with the wrong pointers shows at once, not only when it flips a greedy token."""
    engine = demo_gpu.parts.engine
    backend = engine.backend
    vocab = demo_gpu.parts.spec.vocab_size
    prompt = rng.integers(0, vocab, size=int(rng.integers(2, 30))).tolist()
    fed = rng.integers(0, vocab, size=GRAPH_STEPS).tolist()  # teacher-forced: both runs see the same tokens
    runs = {}
    try:
        for graphs in (True, False):
            backend.use_graphs = graphs
            engine.reset()  # a fresh decode step (captured again) and no prompt-cache checkpoint
            logits = [backend.to_numpy(engine.prefill(prompt))]
            logits += [backend.to_numpy(engine.decode(t, len(prompt) + i)) for i, t in enumerate(fed)]
            runs[graphs] = np.concatenate(logits).astype(np.float64)  # [1 + GRAPH_STEPS, V]
    finally:
        backend.use_graphs = True
    replayed, eager = runs[True], runs[False]
    errors = np.linalg.norm(replayed - eager, axis=-1) / np.linalg.norm(eager, axis=-1)  # [1 + GRAPH_STEPS]
    assert np.isfinite(replayed).all() and errors.max() <= GRAPH_RTOL, f"step errors {np.round(errors, 8).tolist()}"


def test_programmatic_launches_equal_plain(demo_gpu: Any, rng: np.random.Generator) -> None:
    """ATLAS_LAUNCH=pdl: every kernel may start before the one before it ends and waits for it in
    griddepcontrol.wait; a kernel touching memory before that wait would race its predecessor. The
    logits of prefill and of replayed decode steps with programmatic launches equal plain ones."""
    from atlas.backends.cuda.runtime import PDL_CC

    engine = demo_gpu.parts.engine
    rt = engine.backend.rt
    if tuple(rt.cc) < PDL_CC or not rt.driver.programmatic:
        pytest.skip(f"programmatic dependent launch needs compute capability 9.0+ and cuda-bindings "
                    f"(this GPU: {rt.cc}, {rt.driver.binding})")
    vocab = demo_gpu.parts.spec.vocab_size
    prompt = rng.integers(0, vocab, size=int(rng.integers(2, 30))).tolist()
    fed = rng.integers(0, vocab, size=GRAPH_STEPS).tolist()
    runs = {}
    own = rt.programmatic
    try:
        for programmatic in (False, True):
            rt.programmatic = programmatic
            engine.reset()  # the decode step is captured again with these launches
            logits = [engine.backend.to_numpy(engine.prefill(prompt))]
            logits += [engine.backend.to_numpy(engine.decode(t, len(prompt) + i)) for i, t in enumerate(fed)]
            runs[programmatic] = np.concatenate(logits).astype(np.float64)  # [1 + GRAPH_STEPS, V]
    finally:
        rt.programmatic = own
        engine.reset()
    plain, pdl = runs[False], runs[True]
    errors = np.linalg.norm(pdl - plain, axis=-1) / np.linalg.norm(plain, axis=-1)  # [1 + GRAPH_STEPS]
    assert np.isfinite(pdl).all() and errors.max() <= GRAPH_RTOL, f"step errors {np.round(errors, 8).tolist()}"


def test_prompt_in_passes_on_the_gpu(demo_gpu: Any, rng: np.random.Generator) -> None:
    """A prompt prefilled in several passes (prefill_chunk) on the GPU: its logits are as close to
    the numpy reference's as one pass's are (within twice their error plus a floor)."""
    from atlas import LLM
    from atlas.engine import PREFILL_CHUNK

    prompt = demo_text_excerpt(demo_gpu, rng, 40, 300)
    want = np.asarray(LLM(device="cpu").parts.engine.prefill(prompt), dtype=np.float64)  # [1, V]
    engine = demo_gpu.parts.engine
    errors = []
    try:
        for chunk in (PREFILL_CHUNK, int(rng.integers(5, len(prompt) // 2))):
            engine.prefill_chunk = chunk
            engine.reset()  # else the prompt cache answers the second prefill from the first's checkpoint
            got = engine.backend.to_numpy(engine.prefill(prompt)).astype(np.float64)
            errors.append(float(np.linalg.norm(got - want) / np.linalg.norm(want)))
    finally:
        engine.prefill_chunk = PREFILL_CHUNK
    whole, passes = errors
    # On the CPU stand-in (bf16-rounding GEMMs) random-id prompts failed: passes - one pass reached
    # 2.8e-3 in 200 draws (floor 1e-3 failed 1), and one of 250 more was 0.55 off in 81-token passes
    # (one pass 3.5e-3; numpy's own passes 1.6e-6): off the demo's text a bf16 rounding moves the
    # last row's logits far. The prompt is an excerpt of the demo's text and the floor 5e-3.
    assert passes <= 2 * whole + PASSES_FLOOR, f"passes err {passes:.3e} vs one pass {whole:.3e}"


def test_embeddings_on_the_gpu_match_numpy(demo_gpu: Any, rng: np.random.Generator) -> None:
    """LLM.embed on the GPU: each pooling's vector (the final hidden state, not normalised) within
    EMBED_RTOL of numpy's, and the "last" vector from a prompt-cache hit the fresh one's."""
    from atlas import LLM, PoolingParams

    prompt = demo_text_excerpt(demo_gpu, rng, 20, 200)
    cpu = LLM(device="cpu")
    got = {}
    for pooling in ("last", "mean"):  # mean runs fresh and leaves a checkpoint at the prompt's end
        params = PoolingParams(pooling=pooling, normalize=False)
        want = np.array(cpu.embed([prompt], params)[0].outputs.embedding, dtype=np.float64)  # [H]
        demo_gpu.reset_prefix_cache()
        got[pooling] = np.array(demo_gpu.embed([prompt], params)[0].outputs.embedding, dtype=np.float64)  # [H]
        error = float(np.linalg.norm(got[pooling] - want) / np.linalg.norm(want))
        assert error < EMBED_RTOL, f"{pooling}: {error:.3e}"
    hit = np.array(demo_gpu.embed([prompt], PoolingParams(normalize=False))[0].outputs.embedding)  # [H]
    assert demo_gpu.parts.engine.prompt_cache.last_hit == len(prompt)
    np.testing.assert_allclose(hit, got["last"], rtol=1e-4, atol=1e-5)


def test_qwen_dims_each_op_matches_numpy(qwen4: tuple[Path, Any], rng: np.random.Generator) -> None:
    """The 4-layer Qwen3.6-dims model on the GPU, a prompt prefilled (GEMMs) and decode steps
    (GEMVs), every intermediate against the numpy backend's, each op given the GPU's inputs."""
    from atlas.config import load_spec
    from atlas.cross_check import CheckedRun, check_backend

    model_dir, _ = qwen4
    spec = load_spec(model_dir)
    ids = rng.integers(0, spec.vocab_size, size=CROSS_CHECK_TOKENS).tolist()
    reports, line = check_backend(model_dir, ATLAS_DEVICE, spec, ids, run=CheckedRun(CROSS_CHECK_DECODE_STEPS))
    assert line.startswith(ATLAS_DEVICE)
    assert_no_op_off(reports)


def _first_difference(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


# --- the real dimensions against transformers ----------------------------------------------------
def qwen_text_config(layers: int) -> Any:
    from transformers import Qwen3_5MoeTextConfig

    return Qwen3_5MoeTextConfig(
        num_hidden_layers=layers,
        layer_types=["full_attention" if (i + 1) % 4 == 0 else "linear_attention" for i in range(layers)],
        rope_parameters={"rope_type": "default", "rope_theta": 10_000_000.0, "partial_rotary_factor": 0.25},
        eos_token_id=[], max_position_embeddings=4096,
    )


def _random_value(name: str, shape: tuple[int, ...], gen: Any) -> Any:
    """A random value for each parameter, on a scale that keeps activations O(1) and the logits
    peaked enough that bf16 rounding rarely flips the top token."""
    import torch

    def normal(std: float) -> Any:
        return torch.randn(shape, generator=gen, device=TORCH_DEVICE) * std

    if name.endswith("A_log"):
        return torch.log(torch.rand(shape, generator=gen, device=TORCH_DEVICE) * 15 + 1)
    if name.endswith("dt_bias"):
        return normal(0.5)
    if name.endswith("linear_attn.norm.weight"):
        return 1 + normal(0.1)
    if len(shape) == 1:
        return normal(0.1)  # zero-centred RMSNorm weights: the model multiplies by 1 + w
    if name.endswith("embed_tokens.weight"):
        return normal(1.0)
    if name == "lm_head.weight":
        row_scale = torch.exp(torch.randn((shape[0], 1), generator=gen, device=TORCH_DEVICE))
        return normal(1.0 / math.sqrt(shape[1])) * row_scale
    if name.endswith("mlp.gate.weight"):
        return normal(4.0 / math.sqrt(shape[-1]))
    return normal(1.0 / math.sqrt(shape[-1]))


@pytest.fixture(scope="module")
def qwen4(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Any]:
    """(checkpoint dir, transformers fp32 model on the GPU) with identical bf16-representable
    random weights, the checkpoint written by save_pretrained in bf16."""
    torch = pytest.importorskip("torch")
    if TORCH_DEVICE == "cuda" and not torch.cuda.is_available():
        if os.environ.get("ATLAS_REQUIRE_GPU") == "1":
            raise AssertionError("torch sees no GPU")
        pytest.skip("torch sees no GPU")
    from transformers import Qwen3_5MoeForCausalLM

    config = qwen_text_config(QWEN_LAYERS)
    gen = torch.Generator(device=TORCH_DEVICE)
    gen.manual_seed(int.from_bytes(os.urandom(4), "little"))
    with torch.device(TORCH_DEVICE):
        model = Qwen3_5MoeForCausalLM(config).float().eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            param.copy_(_random_value(name, tuple(param.shape), gen).bfloat16().float())
    model_dir = tmp_path_factory.mktemp("qwen4")
    bf16_state = {name: t.detach().to(torch.bfloat16).cpu() for name, t in model.state_dict().items()}
    model.config.dtype = torch.bfloat16
    model.save_pretrained(model_dir, state_dict=bf16_state)
    del bf16_state
    return model_dir, model


def _transformers_run(model: Any, ids: list[int]) -> tuple[np.ndarray, list[np.ndarray]]:
    """(next-token logits [T, V], each decoder layer's output [T, H]) from transformers in fp32."""
    import torch

    outputs: dict[int, np.ndarray] = {}
    hooks = [
        layer.register_forward_hook(
            lambda _m, _i, out, i=i: outputs.__setitem__(i, (out[0] if isinstance(out, tuple) else out)[0].float().cpu().numpy())
        )
        for i, layer in enumerate(model.model.layers)
    ]
    try:
        with torch.no_grad():
            logits = model(torch.tensor([ids], device=TORCH_DEVICE)).logits[0]  # [T, V]
    finally:
        for hook in hooks:
            hook.remove()
    return logits.float().cpu().numpy(), [outputs[i] for i in range(len(model.model.layers))]


def next_token_agreement(ref_logits: np.ndarray, chosen: np.ndarray) -> tuple[float, list[int]]:
    """(agreement of `chosen` [T] with the argmax of ref_logits [T, V] over the positions whose top-2
    gap is at least QWEN_NEAR_TIE of their largest |logit|; the near-tie positions where `chosen` is
    not within that gap of the top, i.e. not one of the tied tokens)."""
    scale = np.abs(ref_logits).max(-1)  # [T]
    top = ref_logits.max(-1)  # [T]
    second = np.partition(ref_logits, -2, axis=-1)[:, -2]  # [T]
    clear = top - second >= QWEN_NEAR_TIE * scale  # [T]
    picked = ref_logits[np.arange(chosen.shape[0]), chosen]  # [T]
    wild = np.nonzero(~clear & (top - picked > QWEN_NEAR_TIE * scale))[0].tolist()
    agreement = float((chosen[clear] == ref_logits[clear].argmax(-1)).mean()) if clear.any() else 1.0
    return agreement, wild


def test_qwen_dims_match_transformers(qwen4: tuple[Path, Any], rng: np.random.Generator) -> None:
    from atlas.backends import create_backend
    from atlas.config import load_spec
    from atlas.engine import Engine
    from atlas.safetensors import Checkpoint

    model_dir, hf_model = qwen4
    spec = load_spec(model_dir)
    ids = rng.integers(0, spec.vocab_size, size=POSITIONS).tolist()
    hf_logits, hf_layers = _transformers_run(hf_model, ids)  # [T, V], [T, H] per layer

    backend, reason = create_backend(ATLAS_DEVICE, model_dir, spec)
    assert reason.startswith(ATLAS_DEVICE)
    engine = Engine(spec, Checkpoint.open(model_dir), backend, max_seq_len=POSITIONS + 8)
    layers: dict[str, np.ndarray] = {}
    engine.dump = lambda name, t: layers.__setitem__(name, backend.to_numpy(t)) if name.endswith(".out") else None
    atlas_next = engine.logits(ids).argmax(-1)

    agreement, wild = next_token_agreement(hf_logits, atlas_next)
    ratios = [float(np.linalg.norm(layers[f"layer.{i}.out"]) / np.linalg.norm(hf_layers[i]))
              for i in range(spec.num_hidden_layers)]
    errors = [float(np.linalg.norm(layers[f"layer.{i}.out"] - hf_layers[i]) / np.linalg.norm(hf_layers[i]))
              for i in range(spec.num_hidden_layers)]
    plain = float((atlas_next == hf_logits.argmax(-1)).mean())  # the figure, near-ties included
    detail = (f"agreement {agreement:.4f} off near-ties ({plain:.4f} over all {len(ids)} positions), "
              f"near-tie positions picking another token {wild}, "
              f"norm ratios {np.round(ratios, 4)}, rel errors {np.round(errors, 4)}")
    print(detail)
    assert agreement >= 0.99 and not wild, detail
    assert all(0.98 <= r <= 1.02 for r in ratios), detail
