"""MTP speculative decoding: greedy output with speculation equals greedy output without, for
K = 1, 2, 3, on the demo model and on random tiny checkpoints extended with a random MTP head;
sampled output (penalties, logit_bias, min_tokens, structured output) equals plain decoding's with
the same seed; the rollback under every acceptance pattern; loading, --no-spec and the CLI flags."""

from __future__ import annotations

import os
import re
import shutil
from collections.abc import Callable
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest
import torch

from _checkpoints import TinyModel, random_value, write_checkpoint
from _conditioning import MAX_DRAWS, well_conditioned
from _demo_copy import demo_copy
from atlas.backends.base import SamplingParams
from atlas.backends.numpy_backend import NumpyBackend
from atlas.config import ModelSpec, load_spec
from atlas.demo import DEMO_PROMPT
from atlas.engine import Engine, GenerationStats
from atlas.errors import AtlasError
from atlas.layers.step import Step
from atlas.safetensors import Checkpoint
from atlas.speculative import Cursor, SpeculativeEngine, SpecStats, build_engine
from atlas.tokenizer import Tokenizer

GREEDY = SamplingParams()
NO_EOS: set[int] = set()


def mtp_shapes(spec: ModelSpec, fused: bool) -> dict[str, tuple[int, ...]]:
    """The MTP tensors of a Qwen3.5 checkpoint (names as the released checkpoints store them)."""
    h, q = spec.hidden_size, spec.num_attention_heads * spec.head_dim
    kv, e = spec.num_key_value_heads * spec.head_dim, spec.num_experts
    i, si = spec.moe_intermediate_size, spec.shared_expert_intermediate_size
    layer = "mtp.layers.0."
    shapes = {
        "mtp.fc.weight": (h, 2 * h), "mtp.pre_fc_norm_embedding.weight": (h,),
        "mtp.pre_fc_norm_hidden.weight": (h,), "mtp.norm.weight": (h,),
        f"{layer}input_layernorm.weight": (h,), f"{layer}post_attention_layernorm.weight": (h,),
        f"{layer}self_attn.q_proj.weight": (2 * q, h), f"{layer}self_attn.k_proj.weight": (kv, h),
        f"{layer}self_attn.v_proj.weight": (kv, h), f"{layer}self_attn.o_proj.weight": (h, q),
        f"{layer}self_attn.q_norm.weight": (spec.head_dim,), f"{layer}self_attn.k_norm.weight": (spec.head_dim,),
        f"{layer}mlp.gate.weight": (e, h), f"{layer}mlp.shared_expert_gate.weight": (1, h),
        f"{layer}mlp.shared_expert.gate_proj.weight": (si, h), f"{layer}mlp.shared_expert.up_proj.weight": (si, h),
        f"{layer}mlp.shared_expert.down_proj.weight": (h, si),
    }  # fmt: skip
    if fused:
        shapes[f"{layer}mlp.experts.gate_up_proj"] = (e, 2 * i, h)
        shapes[f"{layer}mlp.experts.down_proj"] = (e, h, i)
    else:
        for x in range(e):
            shapes[f"{layer}mlp.experts.{x}.gate_proj.weight"] = (i, h)
            shapes[f"{layer}mlp.experts.{x}.up_proj.weight"] = (i, h)
            shapes[f"{layer}mlp.experts.{x}.down_proj.weight"] = (h, i)
    return shapes


def add_mtp_head(model_dir: Path, seed: int, fused: bool, bad: str | None = None) -> None:
    """Add random mtp.* tensors (float32, drawn as the tiny checkpoints' are) to
    model_dir/model.safetensors; `bad` names a tensor written with a wrong shape."""
    from safetensors.torch import load_file, save_file

    path = model_dir / "model.safetensors"
    tensors = load_file(path)
    gen = torch.Generator().manual_seed(seed)
    for name, shape in mtp_shapes(load_spec(model_dir), fused).items():
        shape = (shape[0] + 1, *shape[1:]) if name == bad else shape
        tensors[name] = random_value(name, torch.Size(shape), gen).contiguous()
    save_file(tensors, path, metadata={"format": "pt"})


def new_seed() -> int:
    seed = int.from_bytes(os.urandom(4), "little")
    print(f"seed: {seed}")
    return seed


@pytest.fixture(scope="module")
def demo_mtp(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = demo_copy(tmp_path_factory.mktemp("demo") / "demo-mtp")
    add_mtp_head(path, new_seed(), fused=True)
    return path


TINY_VARIANTS = {
    "fused-nested": (TinyModel(vocab_size=128, nested=True, layout="fused"), True),
    "per-expert": (TinyModel(vocab_size=128, num_experts=4), False),
}


@pytest.fixture(scope="module", params=sorted(TINY_VARIANTS))
def tiny_mtp(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    tiny, fused = TINY_VARIANTS[request.param]
    path = tmp_path_factory.mktemp(request.param)
    write_checkpoint(path, tiny, new_seed())
    add_mtp_head(path, new_seed(), fused=fused)
    return path


HEAD_TOLERANCE = 2e-2  # the GPU head's logits against numpy's (its bf16 roundings: ~3e-3)
# A row whose router logits have a k-th to (k+1)-th gap below this may pick another expert under the
# GPU's bf16 roundings (~1e-2 on a logit): not an error, so such rows are left out of the comparison.
NEAR_TIE = 0.05


def plain_engine(model_dir: Path, max_seq_len: int = 256) -> Engine:
    return Engine(load_spec(model_dir), Checkpoint.open(model_dir), NumpyBackend(), max_seq_len=max_seq_len)


def spec_engine(model_dir: Path, k: int, **kwargs: object) -> SpeculativeEngine:
    spec, checkpoint = load_spec(model_dir), Checkpoint.open(model_dir)
    return SpeculativeEngine(spec, checkpoint, NumpyBackend(), k, max_seq_len=256, **kwargs)  # type: ignore[arg-type]


def greedy(engine: Engine, prompt: list[int], max_tokens: int) -> GenerationStats:
    return engine.generate(prompt, max_tokens, GREEDY, None, NO_EOS)


def check_rounds(stats: SpecStats, max_tokens: int) -> None:
    """Every verify pass emits its accepted drafts plus one token; the first token is the prefill's."""
    assert len(stats.token_ids) == max_tokens
    assert 1 + stats.rounds + stats.accepted >= max_tokens  # the last round may overshoot the limit
    assert 0 <= stats.accepted <= stats.drafted <= stats.rounds * stats.spec_k


# --- the invariant ----------------------------------------------------------------------------------
@pytest.mark.parametrize("k", [1, 2, 3])
def test_demo_greedy_unchanged(demo_mtp: Path, k: int) -> None:
    prompt = Tokenizer.open(demo_mtp).encode(DEMO_PROMPT)
    expected = greedy(plain_engine(demo_mtp), prompt, 40).token_ids
    stats = greedy(spec_engine(demo_mtp, k), prompt, 40)
    assert isinstance(stats, SpecStats) and stats.drafted > 0
    assert stats.token_ids == expected
    check_rounds(stats, 40)


@pytest.mark.parametrize("k", [1, 2, 3])
def test_tiny_greedy_unchanged(tiny_mtp: Path, k: int, rng: np.random.Generator) -> None:
    vocab = load_spec(tiny_mtp).vocab_size
    for _ in range(MAX_DRAWS):
        prompt = rng.integers(0, vocab, int(rng.integers(1, 12))).tolist()
        max_tokens = int(rng.integers(12, 30))
        expected = greedy(plain_engine(tiny_mtp), prompt, max_tokens).token_ids
        if well_conditioned(tiny_mtp, prompt, expected):
            break
    else:
        pytest.fail(f"no well-conditioned prompt in {MAX_DRAWS} draws")
    stats = greedy(spec_engine(tiny_mtp, k), prompt, max_tokens)
    assert stats.token_ids == expected
    check_rounds(stats, max_tokens)


def test_prompt_in_passes_speculates_as_in_one(demo_mtp: Path, rng: np.random.Generator) -> None:
    """A prompt prefilled in several passes: the head takes each pass's rows, so after the first
    draft its KV cache holds what one pass leaves there; the output is plain greedy's."""
    from atlas.demo import zen_of_python

    prompt = Tokenizer.open(demo_mtp).encode(zen_of_python()[: int(rng.integers(120, 300))])
    expected = greedy(plain_engine(demo_mtp), prompt, 30).token_ids
    caches = []
    for chunk in (len(prompt), int(rng.integers(2, len(prompt) // 2))):
        engine = spec_engine(demo_mtp, 2)
        engine.prefill_chunk = chunk
        assert greedy(engine, prompt, 30).token_ids == expected
        engine._draft(engine._prefill(prompt), 1)
        caches.append(np.concatenate([engine.mtp_cache.k[: len(prompt)], engine.mtp_cache.v[: len(prompt)]]))
    whole, passes = caches
    assert np.abs(whole).max() > 0
    assert np.linalg.norm(passes - whole) <= 1e-4 * np.linalg.norm(whole), np.abs(passes - whole).max()


# --- rollback under chosen acceptance patterns --------------------------------------------------------
def corrupted_drafts(expected: list[int], prompt_len: int, vocab: int, p_wrong: float,
                     rng: np.random.Generator) -> tuple[Callable[[Cursor, int], list[int]], dict[str, int]]:
    """A stand-in for SpeculativeEngine._draft: the true continuation `expected` with each draft
    corrupted with probability p_wrong; and the drafts made and those the engine must accept
    (the ones before the first corrupted one in each pass), counted as it drafts."""
    want = {"drafted": 0, "accepted": 0}

    def draft(cursor: Cursor, k: int) -> list[int]:
        emitted = cursor.position - prompt_len + 1
        truth = expected[emitted : emitted + k]
        wrong = (rng.random(k) < p_wrong).tolist()
        want["drafted"] += k
        want["accepted"] += wrong.index(True) if True in wrong else k
        return [(t + 1) % vocab if w else t for t, w in zip(truth, wrong, strict=True)]

    return draft, want


@pytest.mark.parametrize("p_wrong", [0.0, 0.35, 1.0])
def test_rollback_under_every_acceptance_pattern(demo_mtp: Path, p_wrong: float, rng: np.random.Generator) -> None:
    """Drafts taken from the true greedy continuation with chosen tokens corrupted: the output
    stays the plain greedy one and exactly the drafts before the first corrupted one are accepted."""
    prompt = Tokenizer.open(demo_mtp).encode(DEMO_PROMPT)
    vocab, max_tokens = load_spec(demo_mtp).vocab_size, 33
    expected = greedy(plain_engine(demo_mtp), prompt, max_tokens).token_ids
    engine = spec_engine(demo_mtp, 3)
    engine._draft, want = corrupted_drafts(expected, len(prompt), vocab, p_wrong, rng)  # type: ignore[method-assign]
    passes: list[int] = []  # tokens of every main-model forward
    forward = engine.forward

    def counting_forward(ids: np.ndarray, positions: np.ndarray) -> np.ndarray:
        passes.append(len(ids))
        return forward(ids, positions)

    engine.forward = counting_forward  # type: ignore[method-assign]
    stats = greedy(engine, prompt, max_tokens)
    assert stats.token_ids == expected
    assert (stats.drafted, stats.accepted) == (want["drafted"], want["accepted"])
    if p_wrong == 0.0:
        assert stats.rounds == 8 and len(passes) == 9  # prefill, then 4 tokens per pass and no re-run
    assert max(passes[1:]) <= 2 * (3 + 1)  # replayed tokens are bounded by K+1
    check_rounds(stats, max_tokens)


def test_quantized_kv_cache(demo_mtp: Path) -> None:
    """Rows past the accepted prefix are simply overwritten, in a quantized cache too."""
    from atlas.kvcache import KVCacheOptions

    options = KVCacheOptions("turbo4", 0)
    prompt = Tokenizer.open(demo_mtp).encode(DEMO_PROMPT)
    spec, checkpoint = load_spec(demo_mtp), Checkpoint.open(demo_mtp)
    plain = Engine(spec, checkpoint, NumpyBackend(), max_seq_len=256, kv_cache=options)
    engine = SpeculativeEngine(spec, checkpoint, NumpyBackend(), 3, max_seq_len=256, kv_cache=options)
    assert greedy(engine, prompt, 30).token_ids == greedy(plain, prompt, 30).token_ids


def test_pre_norm_hidden_source(demo_mtp: Path) -> None:
    prompt = Tokenizer.open(demo_mtp).encode(DEMO_PROMPT)
    expected = greedy(plain_engine(demo_mtp), prompt, 24).token_ids
    assert greedy(spec_engine(demo_mtp, 2, hidden_source="pre_norm"), prompt, 24).token_ids == expected


SAMPLED = [
    SamplingParams(temperature=0.9, top_k=20),
    SamplingParams(temperature=1.0, top_p=0.9),
    SamplingParams(temperature=0.6, top_k=20, top_p=0.95, presence_penalty=1.5),
    SamplingParams(temperature=1.2, min_p=0.05, repetition_penalty=1.3, frequency_penalty=0.5),
    SamplingParams(presence_penalty=2.0),  # penalized greedy
    SamplingParams(temperature=1.0, typical_p=0.7, top_n_sigma=2.0, xtc_probability=0.5),  # picked on the host
    SamplingParams(dry_multiplier=2.0, dry_allowed_length=1),  # greedy less DRY's penalties, on the host
    SamplingParams(temperature=1.0, mirostat=2, mirostat_tau=3.0),  # its mu moves with each emitted pick alone
    SamplingParams(temperature=0.8, top_k=40, dynatemp_range=0.5),
]


@pytest.mark.parametrize("k", [1, 2, 3])
@pytest.mark.parametrize("sampling", SAMPLED, ids=range(len(SAMPLED)))
def test_sampled_output_unchanged(demo_mtp: Path, k: int, sampling: SamplingParams, rng: np.random.Generator) -> None:
    """Each emitted token is the main model's pick with plain decoding's random draw: the same
    seed gives plain decoding's tokens (the random head's drafts are mostly rejected; accepted
    ones: test_sampled_rollback_under_chosen_acceptance)."""
    prompt, seed = Tokenizer.open(demo_mtp).encode(DEMO_PROMPT), int(rng.integers(1 << 30))
    expected = plain_engine(demo_mtp).generate(prompt, 40, sampling, seed, NO_EOS).token_ids
    stats = spec_engine(demo_mtp, k).generate(prompt, 40, sampling, seed, NO_EOS)
    assert isinstance(stats, SpecStats) and stats.drafted > 0
    assert stats.token_ids == expected
    check_rounds(stats, 40)


def test_sampled_min_tokens_and_logit_bias(demo_mtp: Path, rng: np.random.Generator) -> None:
    """The ending ids masked before min_tokens counts the emitted tokens, not the drafts; a banned
    token is never emitted although the head (which sees no logit_bias) may draft it."""
    prompt, seed = Tokenizer.open(demo_mtp).encode(DEMO_PROMPT), int(rng.integers(1 << 30))
    free = plain_engine(demo_mtp).generate(prompt, 30, SamplingParams(temperature=0.7), seed, NO_EOS).token_ids
    end, banned = free[5], free[2]  # a token that would end it early, one it would pick
    sampling = SamplingParams(temperature=0.7, min_tokens=12, logit_bias=((banned, -100.0),))
    expected = plain_engine(demo_mtp).generate(prompt, 30, sampling, seed, {end}).token_ids
    stats = spec_engine(demo_mtp, 3).generate(prompt, 30, sampling, seed, {end})
    assert stats.token_ids == expected and stats.drafted > 0
    assert banned not in stats.token_ids and end not in stats.token_ids[:11]


@pytest.mark.parametrize("p_wrong", [0.35, 1.0])
def test_sampled_rollback_under_chosen_acceptance(demo_mtp: Path, p_wrong: float, rng: np.random.Generator) -> None:
    """Drafts from the plain sampled continuation with chosen tokens corrupted: the output stays
    plain decoding's and exactly the drafts before the first corrupted one are accepted (a
    rejected row's pick is the plain one: its draw was not spent on the draft)."""
    prompt, seed = Tokenizer.open(demo_mtp).encode(DEMO_PROMPT), int(rng.integers(1 << 30))
    vocab, max_tokens = load_spec(demo_mtp).vocab_size, 33
    sampling = SamplingParams(temperature=1.0, top_k=40, presence_penalty=0.5)
    expected = plain_engine(demo_mtp).generate(prompt, max_tokens, sampling, seed, NO_EOS).token_ids
    engine = spec_engine(demo_mtp, 3)
    engine._draft, want = corrupted_drafts(expected, len(prompt), vocab, p_wrong, rng)  # type: ignore[method-assign]
    stats = engine.generate(prompt, max_tokens, sampling, seed, NO_EOS)
    assert stats.token_ids == expected
    assert (stats.drafted, stats.accepted) == (want["drafted"], want["accepted"])
    check_rounds(stats, max_tokens)


def test_prompt_logprobs_decode_without_speculation(demo_mtp: Path, rng: np.random.Generator) -> None:
    from atlas.engine import GenerationRequest

    prompt, seed = Tokenizer.open(demo_mtp).encode(DEMO_PROMPT), int(rng.integers(1 << 30))
    request = GenerationRequest(prompt, 20, SamplingParams(temperature=0.9, top_k=20), seed, NO_EOS, prompt_logprobs=2)
    expected = plain_engine(demo_mtp).run(request)
    stats = spec_engine(demo_mtp, 2).run(request)
    assert stats.token_ids == expected.token_ids and getattr(stats, "drafted", 0) == 0
    assert [s and s.logprob for s in stats.prompt_logprobs] == pytest.approx([s and s.logprob for s in expected.prompt_logprobs])


def test_stops_at_eos(demo_mtp: Path) -> None:
    prompt = Tokenizer.open(demo_mtp).encode(DEMO_PROMPT)
    plain = greedy(plain_engine(demo_mtp), prompt, 30).token_ids
    eos = {plain[9]}
    stats = spec_engine(demo_mtp, 3).generate(prompt, 30, GREEDY, None, eos)
    assert stats.token_ids == plain[: plain.index(plain[9]) + 1]


# --- loading -------------------------------------------------------------------------------------------
def test_head_weights_are_bf16_and_split_embedding_first(demo_mtp: Path) -> None:
    from safetensors.numpy import load_file

    engine = spec_engine(demo_mtp, 1)
    fc = load_file(str(demo_mtp / "model.safetensors"))["mtp.fc.weight"]  # [H, 2H] float32
    h = fc.shape[0]
    for half, stored in ((engine.head.fc_embed, fc[:, :h]), (engine.head.fc_hidden, fc[:, h:])):
        rounded = stored.astype(ml_dtypes.bfloat16).astype(np.float32)
        np.testing.assert_array_equal(half, rounded)
        assert not np.array_equal(half, stored)  # the file held values bf16 cannot


@pytest.fixture(scope="module")
def tiny_plain(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("plain")
    write_checkpoint(path, TinyModel(vocab_size=64, num_experts=4, num_hidden_layers=2), new_seed())
    return path


def test_no_spec_reads_no_mtp_tensor(tiny_plain: Path, tmp_path: Path) -> None:
    model_dir = tmp_path / "bad-head"
    shutil.copytree(tiny_plain, model_dir)
    add_mtp_head(model_dir, new_seed(), fused=True, bad="mtp.fc.weight")
    spec, checkpoint = load_spec(model_dir), Checkpoint.open(model_dir)
    with pytest.raises(AtlasError, match=r"'mtp.fc.weight'.*shape"):
        build_engine(spec, checkpoint, NumpyBackend(), 2)
    engine, speculation = build_engine(spec, checkpoint, NumpyBackend(), 0)
    assert type(engine) is Engine and speculation == "off (--no-spec)"


def test_checkpoint_without_head_runs_plain(tiny_plain: Path) -> None:
    spec, checkpoint = load_spec(tiny_plain), Checkpoint.open(tiny_plain)
    engine, speculation = build_engine(spec, checkpoint, NumpyBackend(), 3)
    assert type(engine) is Engine and "no MTP head" in speculation and "--spec-k 3 is ignored" in speculation
    engine, speculation = build_engine(spec, checkpoint, NumpyBackend(), None)
    assert type(engine) is Engine and "no MTP head" in speculation and "ignored" not in speculation


@pytest.mark.parametrize("bad_k", [0, 4, -1, True, 2.0])
def test_bad_spec_k(demo_mtp: Path, bad_k: object) -> None:
    with pytest.raises(AtlasError, match="spec_k must be an integer in 1..3"):
        spec, checkpoint = load_spec(demo_mtp), Checkpoint.open(demo_mtp)
        SpeculativeEngine(spec, checkpoint, NumpyBackend(), bad_k)  # type: ignore[arg-type]


# --- API and CLI ---------------------------------------------------------------------------------------
def test_stream_speculates_and_equals_generate(demo_mtp: Path) -> None:
    from atlas.llm import LLM

    llm = LLM(str(demo_mtp), "cpu", spec_k=2)
    assert llm.speculation.startswith("MTP k=2")
    result = llm.generate(DEMO_PROMPT, max_tokens=25)
    assert result.spec_drafted > 0 and result.spec_rounds > 0
    assert "".join(llm.stream(DEMO_PROMPT, max_tokens=25)) == result.text
    assert LLM(str(demo_mtp), "cpu", spec_k=0).generate(DEMO_PROMPT, max_tokens=25).text == result.text


def test_sampled_structured_stream_speculates_and_equals_plain(demo_mtp: Path, rng: np.random.Generator) -> None:
    """JSON mode, sampled with a seed: stream() and generate() speculate (the constraint advances
    by the emitted tokens only) and give the plain engine's text."""
    from atlas.llm import LLM

    seed = int(rng.integers(1 << 30))
    opts = {"max_tokens": 30, "temperature": 0.8, "top_k": 30, "seed": seed, "json_object": True}
    spec, plain = LLM(str(demo_mtp), "cpu", spec_k=3), LLM(str(demo_mtp), "cpu", spec_k=0)
    result = spec.generate(DEMO_PROMPT, **opts)
    assert result.spec_drafted > 0
    assert result.text == plain.generate(DEMO_PROMPT, **opts).text
    assert "".join(spec.stream(DEMO_PROMPT, **opts)) == result.text


@pytest.mark.parametrize("rule", ["bad_words", "allowed_token_ids"])
def test_token_rules_speculate_and_equal_plain(demo_mtp: Path, rng: np.random.Generator, rule: str) -> None:
    """vLLM's bad_words / allowed_token_ids pick on the host like structured output: speculation
    keeps them and gives the plain engine's text, greedy or sampled."""
    from atlas.llm import LLM

    spec, plain = LLM(str(demo_mtp), "cpu", spec_k=2), LLM(str(demo_mtp), "cpu", spec_k=0)
    free = plain.generate(DEMO_PROMPT, max_tokens=20)
    fields = {"bad_words": free.text.split()[1:3]} if rule == "bad_words" else \
        {"allowed_token_ids": sorted({int(t) for t in free.token_ids[:6]} | {int(rng.integers(3, 400))})}
    opts = {"max_tokens": 20, "temperature": float(rng.choice([0.0, 0.8])), "seed": int(rng.integers(1 << 30)), **fields}
    result = spec.generate(DEMO_PROMPT, **opts)
    assert result.spec_rounds > 0 and result.text == plain.generate(DEMO_PROMPT, **opts).text


@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_thinking_budget_speculates_and_equals_plain(demo_mtp: Path, rng: np.random.Generator, temperature: float) -> None:
    """A thinking budget's closing tokens are forced, not picked: they take their verify rows'
    places (greedy: in the one argmax over the rows), and speculation gives the plain engine's
    tokens, the closing among them."""
    from atlas.llm import LLM
    from atlas.thinking_budget import CLOSING

    spec, plain = LLM(str(demo_mtp), "cpu", spec_k=int(rng.integers(1, 4))), LLM(str(demo_mtp), "cpu", spec_k=0)
    tokenizer = Tokenizer.open(demo_mtp)
    prompt = tokenizer.encode(DEMO_PROMPT + "<think>\n")
    # ignore_eos: a sampled end of text inside the budget would end the answer before its closing
    opts = {"max_tokens": 30, "temperature": temperature, "seed": int(rng.integers(1 << 30)),
            "thinking_token_budget": int(rng.integers(0, 12)), "ignore_eos": True}
    result = spec.generate(prompt, **opts)
    assert result.spec_rounds > 0 and result.token_ids == plain.generate(prompt, **opts).token_ids
    assert tokenizer.decode(tokenizer.encode(CLOSING, add_special_tokens=False)) in result.text
    assert "".join(spec.stream(prompt, **opts)) == result.text


def test_iter_tokens_counts_the_speculation_it_runs(demo_mtp: Path, rng: np.random.Generator) -> None:
    """The server's loop (llm.iter_tokens) reports verify passes and drafts in the SpecStats it is
    given (what /metrics counts), with generate()'s tokens."""
    from atlas.llm import LLM, GenerateOptions, iter_tokens

    llm = LLM(str(demo_mtp), "cpu", spec_k=3)
    prompt = Tokenizer.open(demo_mtp).encode(DEMO_PROMPT)
    opts = GenerateOptions(max_tokens=20, temperature=0.8, seed=int(rng.integers(1 << 30)))
    stats = SpecStats()
    tokens = list(iter_tokens(llm.parts.engine, prompt, opts, set(), spec_stats=stats))
    result = llm.generate(prompt, max_tokens=20, temperature=0.8, seed=opts.seed)
    assert tokens == result.token_ids
    assert (stats.rounds, stats.drafted, stats.accepted) == (result.spec_rounds, result.spec_drafted, result.spec_accepted)
    assert stats.rounds > 0 and stats.drafted > 0


def test_stream_with_logprobs_speculates_and_equals_plain(demo_mtp: Path, rng: np.random.Generator) -> None:
    """stream() with logprobs on a speculative engine: each token's score is there before the
    token, equal to the plain engine's."""
    from atlas.llm import LLM, GenerateOptions, iter_tokens

    spec, plain = LLM(str(demo_mtp), "cpu", spec_k=2), LLM(str(demo_mtp), "cpu", spec_k=0)
    prompt = Tokenizer.open(demo_mtp).encode(DEMO_PROMPT)
    opts = GenerateOptions(max_tokens=16, temperature=0.7, seed=int(rng.integers(1 << 30)), logprobs=3)
    runs = []
    for llm in (spec, plain):
        scores: list = []
        tokens = []
        for token in iter_tokens(llm.parts.engine, prompt, opts, set(), scores=scores):
            tokens.append(token)
            assert len(scores) == len(tokens) and scores[-1].token == token
        runs.append((tokens, [s.logprob for s in scores]))
    assert runs[0][0] == runs[1][0] and len(runs[0][0]) == 16
    assert runs[0][1] == pytest.approx(runs[1][1], abs=1e-5)


def run_cli(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    from atlas.run import main

    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def test_cli_spec_flags(demo_mtp: Path, capsys: pytest.CaptureFixture[str]) -> None:
    common = ("--model", str(demo_mtp), "--prompt", DEMO_PROMPT, "--max-tokens", "20", "--device", "cpu")
    code, spec_out, err = run_cli(capsys, *common, "--spec-k", "3")
    assert code == 0 and "speculation MTP k=3" in err, err
    assert re.search(r"MTP acceptance \d+% \(\d+/\d+ drafts, [\d.]+ tokens/pass\)", err.splitlines()[-1])
    code, plain_out, err = run_cli(capsys, *common, "--no-spec")
    assert code == 0 and plain_out == spec_out and "acceptance" not in err
    for bad in (("--spec-k", "4"), ("--spec-k", "2", "--no-spec")):
        code, _, err = run_cli(capsys, *common, *bad)
        assert code == 2 and len(err.strip().splitlines()) == 1 and "--spec-k" in err


# --- the head against transformers' layers --------------------------------------------------------------
def test_head_matches_transformers_layers(tmp_path: Path, rng: np.random.Generator) -> None:
    from safetensors.torch import load_file

    from atlas.oracle_mtp import TorchMtpHead

    reference = write_checkpoint(tmp_path, TinyModel(vocab_size=96, layout="fused", num_hidden_layers=2), new_seed())
    add_mtp_head(tmp_path, new_seed(), fused=True)
    stored = load_file(tmp_path / "model.safetensors")
    head_weights = {
        k.removeprefix("mtp."): v.to(torch.bfloat16).float() for k, v in stored.items() if k.startswith("mtp.")
    }  # rounded to bf16 as atlas keeps the head
    torch_head = TorchMtpHead(tmp_path)
    torch_head.load_state_dict(head_weights, strict=True)  # the checkpoint names are the module's

    engine = spec_engine(tmp_path, 1)
    tokens, h = 9, reference.config.hidden_size
    ids = rng.integers(0, 96, tokens).astype(np.int32)
    hidden = rng.standard_normal((tokens, h)).astype(np.float32)
    backend = engine.backend
    step = Step(backend, np.arange(tokens, dtype=np.int32))
    got = engine.head.logits(step, engine.head.forward(step, ids, hidden, engine.head.new_state(backend, 16)))
    with torch.no_grad():
        embedded = reference.model.embed_tokens(torch.from_numpy(ids).long())
        want = reference.lm_head(torch_head(embedded, torch.from_numpy(hidden))).numpy()
    np.testing.assert_allclose(got, want, rtol=2e-4, atol=2e-4 * np.abs(want).max())


# --- on the GPU -------------------------------------------------------------------------------------------
def cuda_llm(model_dir: Path, spec_k: int) -> object:
    from atlas.llm import LLM

    try:
        return LLM(str(model_dir), "cuda", spec_k=spec_k)
    except (AtlasError, ImportError) as err:
        if os.environ.get("ATLAS_REQUIRE_GPU") == "1":
            raise
        pytest.skip(f"no CUDA backend here: {err}")


def well_conditioned_prompt(model_dir: Path, rng: np.random.Generator, max_tokens: int) -> list[int]:
    """A random-id prompt whose numpy greedy path has no router top-k or greedy near-tie: a GPU's
    K + 1 verify pass may sum in another order than its single steps, as the CPU's does
    (test_tiny_greedy_unchanged redraws such prompts for that reason)."""
    vocab = load_spec(model_dir).vocab_size
    for _ in range(MAX_DRAWS):
        prompt = rng.integers(0, vocab, int(rng.integers(2, 30))).tolist()
        if well_conditioned(model_dir, prompt, greedy(plain_engine(model_dir), prompt, max_tokens).token_ids):
            return prompt
    pytest.fail(f"no well-conditioned prompt in {MAX_DRAWS} draws")


@pytest.mark.gpu
@pytest.mark.parametrize("k", [1, 2, 3])
def test_gpu_greedy_unchanged(demo_mtp: Path, k: int, rng: np.random.Generator) -> None:
    """On the CUDA backend too: speculation (snapshots, device copies, head in bf16) leaves the
    greedy output as plain greedy decoding on the same GPU."""
    plain, spec = cuda_llm(demo_mtp, 0), cuda_llm(demo_mtp, k)
    for prompt in (DEMO_PROMPT, well_conditioned_prompt(demo_mtp, rng, 48)):
        want = plain.generate(prompt, max_tokens=48).token_ids  # type: ignore[attr-defined]
        result = spec.generate(prompt, max_tokens=48)  # type: ignore[attr-defined]
        # a random prompt whose first token ends the text (the prefill's pick) leaves nothing to draft
        assert result.token_ids == want and (result.spec_drafted > 0 or len(want) == 1)


@pytest.mark.gpu
@pytest.mark.parametrize("k", [1, 3])
def test_gpu_sampled_unchanged(demo_mtp: Path, k: int, rng: np.random.Generator) -> None:
    """Sampled with penalties and logprobs on the CUDA backend: the verify pass's rows (copied
    out of the [K+1, V] logits) are penalized, sampled and counted on the device one by one, and
    scored; a seed gives plain decoding's tokens and scores on the same GPU."""
    plain, spec = cuda_llm(demo_mtp, 0), cuda_llm(demo_mtp, k)
    opts = {"max_tokens": 48, "temperature": 0.8, "top_k": 20, "presence_penalty": 0.5,
            "seed": int(rng.integers(1 << 30)), "logprobs": 2}
    want = plain.generate(DEMO_PROMPT, **opts)  # type: ignore[attr-defined]
    result = spec.generate(DEMO_PROMPT, **opts)  # type: ignore[attr-defined]
    assert result.token_ids == want.token_ids and result.spec_drafted > 0
    got_scores, want_scores = ([s.logprob for s in r.logprobs] for r in (result, want))
    assert got_scores == pytest.approx(want_scores, abs=1e-2)  # bf16 steps of 1 and K + 1 rows


@pytest.mark.gpu
def test_gpu_speculation_resumes_from_the_prompt_cache(demo_mtp: Path, rng: np.random.Generator) -> None:
    """A greedy turn, then a prompt that extends it: the speculative engine resumes at the first
    prompt's end checkpoint (DeltaNet states and the head's input row copied on the device) and
    still gives plain greedy's tokens."""
    from atlas.demo import zen_of_python

    plain, spec = cuda_llm(demo_mtp, 0), cuda_llm(demo_mtp, 2)
    text = Tokenizer.open(demo_mtp).encode(zen_of_python(), add_special_tokens=False)
    cut = int(rng.integers(140, min(len(text) - 40, 260)))
    first, second = text[:cut], text[:cut] + text[cut + 3 : cut + 13]  # three tokens left out: no live reuse
    spec.generate(first, max_tokens=8)  # type: ignore[attr-defined]
    result = spec.generate(second, max_tokens=24)  # type: ignore[attr-defined]
    assert result.cached_tokens == len(first) and result.spec_drafted > 0
    assert result.token_ids == plain.generate(second, max_tokens=24).token_ids  # type: ignore[attr-defined]


@pytest.mark.gpu
def test_gpu_verify_passes_replay_a_graph(demo_mtp: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Each verify pass replays the CUDA graph of its token count (captured at first use) instead
    of launching the main model's kernels one by one from the host; the output stays plain greedy's."""
    from atlas.backends.cuda.memory import StepArena

    plain, spec = cuda_llm(demo_mtp, 0), cuda_llm(demo_mtp, 2)
    engine = spec.parts.engine  # type: ignore[attr-defined]
    if not engine.backend.use_graphs:
        pytest.skip(f"{engine.backend.rt.driver.binding} cannot capture CUDA graphs")
    prompt = Tokenizer.open(demo_mtp).encode(DEMO_PROMPT)
    driver = engine.backend.rt.driver
    launches: list[int] = []
    graph_launch = driver.graph_launch
    monkeypatch.setattr(driver, "graph_launch", lambda graph, stream: (launches.append(1), graph_launch(graph, stream)))
    stats = greedy(engine, prompt, 32)
    assert stats.token_ids == greedy(plain.parts.engine, prompt, 32).token_ids  # type: ignore[attr-defined]
    assert len(launches) == stats.rounds > 0
    assert {type(step).__name__ for step in engine._verify_steps.values()} == {"GraphedDecodeStep"}
    captures = sum(step.captures for step in engine._verify_steps.values())
    # The device's bump arena moves (and a graph is captured again) only when a step outgrows it.
    # The host emulator's guarded arena moves whenever a step's k-th allocation changes size, as
    # the MTP head's eager steps between verify passes do, so there a pass may capture every round.
    if isinstance(engine.backend.rt.arena, StepArena):
        assert captures < stats.rounds


@pytest.mark.gpu
def test_gpu_rollback_under_chosen_acceptance(demo_mtp: Path, rng: np.random.Generator) -> None:
    plain, spec = cuda_llm(demo_mtp, 0), cuda_llm(demo_mtp, 3)
    prompt = Tokenizer.open(demo_mtp).encode(DEMO_PROMPT)
    vocab, max_tokens = load_spec(demo_mtp).vocab_size, 40
    expected = greedy(plain.parts.engine, prompt, max_tokens).token_ids  # type: ignore[attr-defined]
    engine = spec.parts.engine  # type: ignore[attr-defined]

    def draft(cursor: Cursor, k: int) -> list[int]:
        emitted = cursor.position - len(prompt) + 1
        return [(t + 1) % vocab if rng.random() < 0.4 else t for t in expected[emitted : emitted + k]]

    engine._draft = draft
    stats = greedy(engine, prompt, max_tokens)
    assert stats.token_ids == expected and 0 < stats.accepted < stats.drafted


@pytest.mark.gpu
@pytest.mark.parametrize("tokens", [1, 3, 12])
def test_gpu_head_matches_numpy(demo_mtp: Path, tokens: int, rng: np.random.Generator) -> None:
    """The MTP head on the GPU (its own layer, fc over [embedding, hidden], lm_head) against the
    numpy backend's head on the same fresh inputs: a wrong head never changes the output, only the
    acceptance, so only this test sees it. One token is a draft step (GEMVs), more a replay (GEMMs)."""
    gpu = cuda_llm(demo_mtp, 1).parts.engine  # type: ignore[attr-defined]
    cpu = spec_engine(demo_mtp, 1)
    for _ in range(MAX_DRAWS):
        ids = rng.integers(0, load_spec(demo_mtp).vocab_size, tokens).astype(np.int32)  # [T]
        hidden = rng.standard_normal((tokens, cpu.spec.hidden_size)).astype(np.float32)  # [T, H]
        routed = head_router_gaps(cpu, ids, hidden) >= NEAR_TIE  # [T]: rows compared
        if 2 * int(routed.sum()) >= tokens:
            break
    else:
        pytest.fail(f"{MAX_DRAWS} draws of {tokens} rows, most of them near a routing tie each time")
    logits = []
    for engine in (cpu, gpu):
        be = engine.backend
        step = Step(be, be.upload(np.arange(tokens, dtype=np.int32), "i32"))
        out = engine.head.forward(step, be.upload(ids, "i32"), be.upload(hidden, "f32"), engine.head.new_state(be, 16))
        logits.append(be.to_numpy(engine.head.logits(step, out)).astype(np.float64))  # [T, V]
    want, got = logits
    assert np.isfinite(got).all()
    error = float(np.linalg.norm(got[routed] - want[routed]) / np.linalg.norm(want[routed]))
    print(f"head logits relative error {error:.3e} on {int(routed.sum())} of {tokens} tokens")
    assert error < HEAD_TOLERANCE, f"head logits relative error {error:.3e} on {int(routed.sum())} of {tokens} tokens"


def head_router_gaps(engine: SpeculativeEngine, ids: np.ndarray, hidden: np.ndarray) -> np.ndarray:
    """Each row's gap between the k-th and (k+1)-th router logit of the head's MoE, on the numpy
    backend (inf where k covers every expert). A row's MoE output reaches no other row of the
    head, so a row near a tie can be left out of a comparison alone."""
    be, k = engine.backend, engine.spec.num_experts_per_tok
    seen: dict[str, np.ndarray] = {}
    step = Step(be, be.upload(np.arange(len(ids), dtype=np.int32), "i32"),
                dump=lambda name, tensor: seen.__setitem__(name, be.to_numpy(tensor)))
    engine.head.forward(step, be.upload(ids, "i32"), be.upload(hidden, "f32"), engine.head.new_state(be, 16))
    logits = -np.sort(-seen["mtp.mlp.router_logits"], axis=-1)  # [T, E], descending
    return logits[:, k - 1] - logits[:, k] if k < logits.shape[-1] else np.full(len(ids), np.inf)


def test_an_embedding_between_generations_keeps_speculation_exact(demo_mtp: Path, rng: np.random.Generator) -> None:
    """An embedding resumes the main model from the prompt cache but writes none of the head's rows
    (its checkpoints have no head input): a speculative generation after it, on a prompt that
    extends both, still gives the plain tokens."""
    from atlas.llm import LLM

    spec, plain = LLM(str(demo_mtp), "cpu", spec_k=int(rng.integers(1, 4))), LLM(str(demo_mtp), "cpu", spec_k=0)
    first = spec.generate(DEMO_PROMPT, max_tokens=int(rng.integers(2, 8)))
    longer = spec.tokenizer.encode(DEMO_PROMPT) + first.token_ids + spec.tokenizer.encode(" Flat is")
    spec.embed([longer])
    assert spec.parts.engine.prompt_cache.last_hit > 0  # the embedding resumed after the first generation
    opts = {"max_tokens": 16, "temperature": float(rng.choice([0.0, 0.8])), "seed": int(rng.integers(1 << 30))}
    prompt = longer + spec.tokenizer.encode(" is")
    result = spec.generate(prompt, **opts)
    assert result.spec_rounds > 0
    assert result.token_ids == plain.generate(prompt, **opts).token_ids
