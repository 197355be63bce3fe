"""The engine-level GPU tests' own logic on the CPU: LLM(device="cuda" / "auto"), create_backend("cuda")
and open_backend_for_model give the numpy backend with the CUDA kernels' bf16 roundings
(tests/_cuda_stand_in.py). Each test must pass on it in every draw; a GPU test that fails here
would fail on a correct GPU and cost a device session.

Found here: test_greedy_gpu_equals_greedy_numpy_on_the_demo's random-id prompt diverged from numpy
in 1 of 100 draws, and in 4 of 300 more when redrawn away from greedy near-ties (at the first token,
far from a tie: random ids take the demo off its text, where the bf16-rounded prefill GEMMs move the
logits by up to ~30 %); its random prompt is now an excerpt of the demo's text (0 of 150 draws
diverged). test_prompt_in_passes_on_the_gpu's random-id prompt failed 2 of 450 draws (passes - one
pass 2.8e-3 over a 1e-3 floor; passes 0.55 off, one pass 3.5e-3); with an excerpt of the demo's
text and a 5e-3 floor 0 of 250 fail, and a 5 % error in later passes' attention fails 16 of 20. These tests compare whole greedy paths: an op 5 % off passes them (even
decode attention at half its output does); the op tests (tests/test_gpu_harness.py) and the
model's op-by-op cross-check (test_cross_check.py: every intermediate within 2 % of numpy's, each
layer isolated) are the ones that catch it, and a greedy difference names the first intermediate off.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

import test_compare
import test_cross_check
import test_dump
import test_gpu_chain
import test_gpu_kv
import test_gpu_model
import test_gpu_prompt_cache
import test_gpu_quant
import test_llm
import test_speculative
from _cuda_stand_in import CudaRounding, stand_in_cuda
from test_speculative import demo_mtp as demo_mtp  # noqa: F401  (the module-scoped fixture)

SLOW_DRAWS = 30


@pytest.fixture
def stand_in(monkeypatch: pytest.MonkeyPatch) -> None:
    stand_in_cuda(monkeypatch)


def test_backend_is_the_stand_in(stand_in: None) -> None:
    llm = test_gpu_model.gpu_llm()
    assert llm.device.startswith("cuda") and isinstance(llm.parts.engine.backend, CudaRounding)


def test_demo_model_tests_pass(stand_in: None, rng: np.random.Generator) -> None:
    demo_gpu = test_gpu_model.gpu_llm()
    test_gpu_model.test_demo_recites_on_the_gpu(demo_gpu)
    test_gpu_model.test_greedy_gpu_equals_greedy_numpy_on_the_demo(demo_gpu, rng)
    test_gpu_model.test_graph_replay_equals_eager_decode(demo_gpu, rng)
    test_gpu_model.test_graph_replay_logits_equal_eager(demo_gpu, rng)
    test_gpu_model.test_prompt_in_passes_on_the_gpu(demo_gpu, rng)
    test_gpu_model.test_embeddings_on_the_gpu_match_numpy(demo_gpu, rng)


@pytest.mark.slow
def test_demo_greedy_and_passes_every_draw(stand_in: None, rng: np.random.Generator) -> None:
    demo_gpu = test_gpu_model.gpu_llm()
    for _ in range(SLOW_DRAWS):
        test_gpu_model.test_greedy_gpu_equals_greedy_numpy_on_the_demo(demo_gpu, rng)
        test_gpu_model.test_prompt_in_passes_on_the_gpu(demo_gpu, rng)


def test_penalized_picks_gpu_test_passes(stand_in: None, rng: np.random.Generator) -> None:
    demo_gpu = test_gpu_model.gpu_llm()
    for _ in range(3):
        test_gpu_chain.test_penalized_picks_stay_on_the_device(demo_gpu, rng)


def test_logprobs_gpu_test_passes(stand_in: None, rng: np.random.Generator) -> None:
    demo_gpu = test_gpu_model.gpu_llm()
    for _ in range(10):
        test_gpu_chain.test_logprobs_and_prompt_logprobs_on_the_gpu(demo_gpu, rng)


def test_sampled_json_gpu_test_passes(stand_in: None, rng: np.random.Generator) -> None:
    demo_gpu = test_gpu_model.gpu_llm()
    for _ in range(5):
        test_gpu_chain.test_sampled_json_picks_from_the_device_summary(demo_gpu, rng)


@pytest.mark.parametrize("cut", ["end", "tail"])
def test_prompt_cache_gpu_test_passes(stand_in: None, rng: np.random.Generator, cut: str) -> None:
    demo_gpu = test_gpu_model.gpu_llm()
    for _ in range(3):
        test_gpu_prompt_cache.test_resume_on_the_gpu_matches_a_fresh_prefill(demo_gpu, rng, cut)


@pytest.mark.slow
def test_prompt_cache_gpu_test_passes_every_draw(stand_in: None, rng: np.random.Generator) -> None:
    demo_gpu = test_gpu_model.gpu_llm()
    for draw in range(SLOW_DRAWS):
        test_gpu_prompt_cache.test_resume_on_the_gpu_matches_a_fresh_prefill(demo_gpu, rng, ["end", "tail"][draw % 2])


def test_auto_device_and_dump_pass(stand_in: None, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    test_llm.test_auto_picks_cuda_and_agrees_with_cpu()
    test_dump.test_cuda_dump_matches_numpy_on_the_demo(tmp_path, monkeypatch)


@pytest.mark.slow
def test_compare_passes(stand_in: None, capsys: pytest.CaptureFixture[str]) -> None:
    test_compare.test_demo_passes_on_the_gpu(capsys)


@pytest.mark.parametrize("level", ["fp8", "turbo8"])
def test_demo_recites_with_a_quantized_cache(stand_in: None, level: str) -> None:
    test_gpu_kv.test_demo_recites_with_a_quantized_cache(level)


@pytest.mark.parametrize("k", [1, 3])
def test_speculative_gpu_tests_pass(stand_in: None, demo_mtp: Path, k: int, rng: np.random.Generator) -> None:  # noqa: F811
    test_speculative.test_gpu_greedy_unchanged(demo_mtp, k, rng)
    test_speculative.test_gpu_sampled_unchanged(demo_mtp, k, rng)
    test_speculative.test_gpu_rollback_under_chosen_acceptance(demo_mtp, rng)
    test_speculative.test_gpu_speculation_resumes_from_the_prompt_cache(demo_mtp, rng)


@pytest.mark.slow
@pytest.mark.parametrize("fmt", ["fp8", "nvfp4"])
def test_quantized_demo_follows_numpy(stand_in: None, fmt: str, tmp_path: Path) -> None:
    test_gpu_quant.test_quantized_demo_on_the_gpu_follows_numpy(fmt, tmp_path)


@pytest.mark.parametrize("passes", [[], ["--prefill-chunk", "7"]])
def test_cross_check_gpu_test_passes(stand_in: None, passes: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    test_cross_check.test_the_gpu_matches_numpy_op_by_op(passes, capsys)


class NegatedDecodeAttention(CudaRounding):
    """Full attention's one-token (decode) output negated; prefill is right."""

    def attention(self, q, k, v, cache, positions, scale):  # type: ignore[no-untyped-def]
        out = super().attention(q, k, v, cache, positions, scale)
        return -out if q.shape[0] == 1 else out


def test_a_greedy_difference_names_the_op(monkeypatch: pytest.MonkeyPatch, rng: np.random.Generator) -> None:
    """The greedy test's failure says which intermediate left numpy's first (test_gpu_model.first_op_off)."""
    import atlas.backends as backends

    monkeypatch.setattr(backends, "open_cuda_backend", lambda model_dir, spec, run: NegatedDecodeAttention())
    monkeypatch.delenv("ATLAS_REQUIRE_GPU", raising=False)
    with pytest.raises(pytest.fail.Exception) as failed:
        test_gpu_model.test_greedy_gpu_equals_greedy_numpy_on_the_demo(test_gpu_model.gpu_llm(), rng)
    assert "first intermediate off numpy's: layer.3.attn.core: relative error" in str(failed.value)


@pytest.mark.parametrize("fmt", ["fp8", "nvfp4"])
def test_quantized_demo_op_by_op_passes(stand_in: None, fmt: str, tmp_path: Path, rng: np.random.Generator) -> None:
    test_gpu_quant.test_quantized_demo_on_the_gpu_op_by_op(fmt, tmp_path, rng)


@pytest.mark.parametrize("level", ["nvfp4", "turbo3"])
def test_quantized_cache_op_by_op_passes(stand_in: None, level: str, rng: np.random.Generator) -> None:
    test_gpu_kv.test_demo_op_by_op_with_a_quantized_cache(level, rng)


@pytest.mark.parametrize("tokens", [1, 12])
def test_head_gpu_test_passes(stand_in: None, demo_mtp: Path, tokens: int, rng: np.random.Generator) -> None:  # noqa: F811
    test_speculative.test_gpu_head_matches_numpy(demo_mtp, tokens, rng)
