"""Reconstruction error and bytes per token of every KV cache level (CPU, numpy reference).

    python bench/kv_mse.py [--out bench/results/kv-mse-<date>.json]

Relative MSE = sum((x - decode(encode(x)))^2) / sum(x^2) over every stored head vector, for keys
(after q/k-norm and RoPE, as cached) and values, from three sources:
  demo      atlas-demo's full-attention layer, teacher-forced over its whole Zen of Python text
            (captured with the engine's dump hook: layer.3.attn.k / .v);
  qwen3.6   one full-attention layer at Qwen3.6-35B-A3B dimensions (hidden 2048, 2 KV heads,
            head_dim 256, rotary 64, theta 1e7) with random weights (std 0.02, norm weights
            1 + N(0, 0.1)) on 1024 tokens of random RMS-normalised hidden states;
  gaussian  N(0, 1) vectors [4096, 2, 256], the distribution tests/test_kvcache.py draws afresh
            (its bounds come from this column, with margin).
Bytes per token: K and V of every full-attention layer, from each level's storage layout.
"""

from __future__ import annotations

import os

os.environ["OPENBLAS_NUM_THREADS"] = os.environ["OMP_NUM_THREADS"] = "1"  # before numpy loads

import json
import platform
import sys
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path

import click
import numpy as np

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "python"))

from atlas.backends.numpy_backend import NumpyBackend  # noqa: E402
from atlas.config import load_spec  # noqa: E402
from atlas.demo import DEMO_DIR, zen_of_python  # noqa: E402
from atlas.engine import Engine  # noqa: E402
from atlas.kvcache import LEVELS, bytes_per_vector, round_trip  # noqa: E402
from atlas.layers.attention import Attention, AttentionDims, AttentionWeights  # noqa: E402
from atlas.layers.norm import RMSNorm  # noqa: E402
from atlas.layers.rotary import Rotary, default_inv_freq  # noqa: E402
from atlas.layers.split_linear import SplitLinear  # noqa: E402
from atlas.layers.step import Step  # noqa: E402
from atlas.safetensors import Checkpoint  # noqa: E402
from atlas.tokenizer import Tokenizer  # noqa: E402
from provenance import git_commit  # noqa: E402

SEED = 20261129


@dataclass(frozen=True)
class QwenAttentionDims:
    hidden: int = 2048
    heads: int = 16
    kv_heads: int = 2
    head_dim: int = 256
    rotary_dim: int = 64
    theta: float = 1e7
    full_attention_layers: int = 10  # 40 layers, every 4th full attention
    tokens: int = 1024


QWEN = QwenAttentionDims()


def capture(dump_names: tuple[str, str]) -> tuple[dict[str, list[np.ndarray]], object]:
    seen: dict[str, list[np.ndarray]] = {name: [] for name in dump_names}

    def dump(name: str, tensor: object) -> None:
        if name in seen:
            seen[name].append(np.array(tensor, dtype=np.float32))

    return seen, dump


def demo_kv() -> tuple[np.ndarray, np.ndarray]:
    """Keys and values [T, Hkv, D] of the demo's full-attention layer over the Zen text."""
    spec = load_spec(DEMO_DIR)
    layer = spec.layer_types.index("full_attention")
    ids = Tokenizer.open(DEMO_DIR).encode(zen_of_python())
    engine = Engine(spec, Checkpoint.open(DEMO_DIR), NumpyBackend(), max_seq_len=len(ids))
    seen, engine.dump = capture((f"layer.{layer}.attn.k", f"layer.{layer}.attn.v"))
    engine.logits(ids)
    keys, values = (np.concatenate(v) for v in seen.values())
    return keys, values


def qwen_kv(rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    """Keys and values [T, Hkv, D] of one random-weight attention layer at Qwen3.6 dimensions."""
    d, be = QWEN, NumpyBackend()
    dims = AttentionDims(d.heads, d.kv_heads, d.head_dim)

    def mat(rows: int, cols: int) -> np.ndarray:
        return (rng.standard_normal((rows, cols)) * 0.02).astype(np.float32)

    def norm() -> RMSNorm:
        return RMSNorm((1.0 + 0.1 * rng.standard_normal(d.head_dim)).astype(np.float32), 1e-6)

    q_width, kv_width = d.heads * d.head_dim, d.kv_heads * d.head_dim
    widths = (q_width, q_width, kv_width, kv_width)  # q, gate, k, v
    qgkv = SplitLinear.single(np.concatenate([mat(w, d.hidden) for w in widths]), widths)
    weights = AttentionWeights(qgkv, mat(d.hidden, q_width), norm(), norm())
    attention = Attention(weights, dims, Rotary(default_inv_freq(d.rotary_dim, d.theta), 1.0))
    hidden = rng.standard_normal((d.tokens, d.hidden)).astype(np.float32)
    hidden /= np.sqrt(np.mean(hidden**2, axis=-1, keepdims=True))  # [T, H]
    seen, dump = capture(("attn.k", "attn.v"))
    positions = np.arange(d.tokens, dtype=np.int32)
    attention(Step(be, positions, dump), hidden, attention.new_state(be, d.tokens), "attn")
    keys, values = (np.concatenate(v) for v in seen.values())
    return keys, values


def relative_mse(level_name: str, x: np.ndarray) -> float:
    error = round_trip(LEVELS[level_name], x) - x
    return float(np.sum(np.square(error, dtype=np.float64)) / np.sum(np.square(x, dtype=np.float64)))


def bytes_table(kv_heads: int, head_dim: int, full_layers: int) -> dict[str, dict[str, int]]:
    """Per level: bytes per head vector, per token per full-attention layer (K + V), per token of
    the model with every full-attention layer at the level and with auto (first and last bf16)."""
    bf16_layer = 2 * kv_heads * bytes_per_vector(LEVELS["bf16"], head_dim)
    table = {}
    for name, level in LEVELS.items():
        layer = 2 * kv_heads * bytes_per_vector(level, head_dim)
        table[name] = {
            "bytes_per_vector": bytes_per_vector(level, head_dim),
            "bytes_per_token_per_layer": layer,
            "bytes_per_token_all_layers": layer * full_layers,
            "bytes_per_token_auto": layer * max(full_layers - 2, 0) + bf16_layer * min(full_layers, 2),
        }
    return table


def measure(sources: dict[str, tuple[np.ndarray, np.ndarray]]) -> dict[str, dict[str, dict[str, float]]]:
    return {
        source: {name: {"k": relative_mse(name, k), "v": relative_mse(name, v)} for name in LEVELS}
        for source, (k, v) in sources.items()
    }


def print_tables(mse: dict, sizes: dict) -> None:
    columns = "".join(f"{s + ' K':>13}{s + ' V':>13}" for s in mse)
    print(f"relative MSE\nlevel   {columns}   bytes/token/layer (qwen3.6)")
    for name in LEVELS:
        cells = "".join(f"{mse[s][name]['k']:13.3e}{mse[s][name]['v']:13.3e}" for s in mse)
        print(f"{name:8}{cells}   {sizes[name]['bytes_per_token_per_layer']}")


def claim(mse: dict) -> dict[str, object]:
    """The Atlas article: turbo4 has about 2x lower MSE than nvfp4."""
    ratios = {f"{s}.{kv}": mse[s]["nvfp4"][kv] / mse[s]["turbo4"][kv] for s in mse for kv in ("k", "v")}
    holds = all(r >= 1.6 for r in ratios.values())
    return {"nvfp4_over_turbo4_mse": ratios, "holds_2x_within_20pct": holds}


@click.command()
@click.option("--out", type=click.Path(dir_okay=False, path_type=Path), default=None)
def main(out: Path | None) -> None:
    rng = np.random.default_rng(SEED)
    sources = {
        "demo": demo_kv(),
        "qwen3.6": qwen_kv(rng),
        "gaussian": tuple(rng.standard_normal((4096, 2, 256)).astype(np.float32) for _ in range(2)),
    }
    mse = measure(sources)
    sizes = bytes_table(QWEN.kv_heads, QWEN.head_dim, QWEN.full_attention_layers)
    demo_spec = load_spec(DEMO_DIR)
    result = {
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "commit": git_commit(),
        "machine": platform.platform(),
        "seed": SEED,
        "vectors": {s: int(k.shape[0] * k.shape[1]) for s, (k, _) in sources.items()},
        "relative_mse": mse,
        "bytes_qwen3.6": sizes,
        "bytes_demo": bytes_table(demo_spec.num_key_value_heads, demo_spec.head_dim, 1),
        "article_claim": claim(mse),
    }
    print_tables(mse, sizes)
    print(json.dumps(result["article_claim"], indent=1))
    stamp = datetime.now(timezone.utc).strftime("%Y%m%d-%H%M")
    path = out or REPO / "bench" / "results" / f"kv-mse-{stamp}.json"
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(result, indent=1) + "\n")
    tmp.replace(path)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
