"""MTP speculative decoding: greedy output with speculation equals greedy output without, for
K = 1, 2, 3, on the demo model and on random tiny checkpoints extended with a random MTP head;
the rollback under every acceptance pattern; loading, --no-spec and the CLI flags."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest
import torch

from _checkpoints import TinyModel, random_value, write_checkpoint
from atlas.backends.base import SamplingParams
from atlas.backends.numpy_backend import NumpyBackend
from atlas.config import ModelSpec, load_spec
from atlas.demo import DEMO_DIR, DEMO_PROMPT
from atlas.engine import Engine, GenerationStats
from atlas.errors import AtlasError
from atlas.safetensors import Checkpoint
from atlas.speculative import Cursor, SpeculativeEngine, SpecStats, build_engine
from atlas.tokenizer import Tokenizer

GREEDY = SamplingParams()
NO_EOS: set[int] = set()


def mtp_shapes(spec: ModelSpec, fused: bool) -> dict[str, tuple[int, ...]]:
    """The MTP tensors of a Qwen3.5 checkpoint (names as the released checkpoints store them)."""
    h, q = spec.hidden_size, spec.num_attention_heads * spec.head_dim
    kv, e, i, si = spec.num_key_value_heads * spec.head_dim, spec.num_experts, spec.moe_intermediate_size, spec.shared_expert_intermediate_size
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
    path = tmp_path_factory.mktemp("demo") / "demo-mtp"
    shutil.copytree(DEMO_DIR, path, ignore=shutil.ignore_patterns("*.py", "__pycache__"))
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
    prompt = rng.integers(0, vocab, int(rng.integers(1, 12))).tolist()
    max_tokens = int(rng.integers(12, 30))
    expected = greedy(plain_engine(tiny_mtp), prompt, max_tokens).token_ids
    stats = greedy(spec_engine(tiny_mtp, k), prompt, max_tokens)
    assert stats.token_ids == expected
    check_rounds(stats, max_tokens)
