"""A 2-layer model (one DeltaNet, one full-attention layer) at the real Qwen3.6 dimensions with random
weights: transformers fp32 on the CPU against atlas's CUDA backend on the emulated h200 kernels
(tests/_simt.py), the check of tests/test_gpu_model.py::test_qwen_dims_match_transformers at a size
this machine holds (~16 GB, ~20 minutes for 128 positions). Not part of the test suite.

    python tests/simt/qwen_vs_transformers.py          # POSITIONS=256 for more positions
"""

from __future__ import annotations

import gc
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

REPO = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(REPO / "python"), str(REPO / "tests"), str(REPO)]
LAYERS = ["linear_attention", "full_attention"]


def reference(model_dir: Path, positions: int) -> tuple[list[int], np.ndarray, list[np.ndarray]]:
    """Writes the random bf16 checkpoint; (ids, transformers logits [T, V], layer outputs [T, H])."""
    import torch
    from transformers import Qwen3_5MoeForCausalLM, Qwen3_5MoeTextConfig

    import test_gpu_model as tg

    tg.TORCH_DEVICE = "cpu"
    config = Qwen3_5MoeTextConfig(
        num_hidden_layers=len(LAYERS), layer_types=LAYERS, eos_token_id=[], max_position_embeddings=4096,
        rope_parameters={"rope_type": "default", "rope_theta": 10_000_000.0, "partial_rotary_factor": 0.25},
    )
    gen = torch.Generator().manual_seed(int.from_bytes(os.urandom(4), "little"))
    model = Qwen3_5MoeForCausalLM(config).float().eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            param.copy_(tg._random_value(name, tuple(param.shape), gen).bfloat16().float())
    state = {name: t.detach().to(torch.bfloat16) for name, t in model.state_dict().items()}
    model.config.dtype = torch.bfloat16
    model.save_pretrained(model_dir, state_dict=state)
    ids = np.random.default_rng().integers(0, config.vocab_size, size=positions).tolist()
    logits, layers = tg._transformers_run(model, ids)
    return ids, logits, layers


def emulated(model_dir: Path, ids: list[int]) -> tuple[np.ndarray, list[np.ndarray]]:
    """(atlas's greedy next tokens [T], layer outputs [T, H]) on the emulated h200 kernels."""
    import pytest

    from _simt import use_simt
    from atlas.backends import create_backend
    from atlas.config import load_spec
    from atlas.engine import Engine
    from atlas.safetensors import Checkpoint

    with pytest.MonkeyPatch.context() as monkeypatch:
        use_simt(monkeypatch, "h200")
        spec = load_spec(model_dir)
        backend, _ = create_backend("cuda", model_dir, spec)
        engine = Engine(spec, Checkpoint.open(model_dir), backend, max_seq_len=len(ids) + 8)
        layers: dict[str, Any] = {}
        engine.dump = lambda name, t: layers.__setitem__(name, backend.to_numpy(t)) if name.endswith(".out") else None
        chosen = engine.logits(ids).argmax(-1)
    return chosen, [layers[f"layer.{i}.out"] for i in range(len(LAYERS))]


def main() -> None:
    import test_gpu_model as tg

    positions = int(os.environ.get("POSITIONS", "128"))
    work = Path(tempfile.mkdtemp(prefix="atlas-qwen2-"))
    try:
        start = time.time()
        ids, hf_logits, hf_layers = reference(work / "checkpoint", positions)
        gc.collect()
        print(f"transformers: {time.time() - start:.0f} s", flush=True)
        start = time.time()
        chosen, layers = emulated(work / "checkpoint", ids)
        print(f"atlas on the emulated h200 kernels: {time.time() - start:.0f} s", flush=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    agreement, wild = tg.next_token_agreement(hf_logits, chosen)
    ratios = [float(np.linalg.norm(a) / np.linalg.norm(b)) for a, b in zip(layers, hf_layers)]
    errors = [float(np.linalg.norm(a - b) / np.linalg.norm(b)) for a, b in zip(layers, hf_layers)]
    plain = float((chosen == hf_logits.argmax(-1)).mean())
    print(f"agreement {agreement:.4f} off near-ties ({plain:.4f} over all {positions}), near-ties picking "
          f"another token {wild}, norm ratios {np.round(ratios, 5)}, rel errors {np.round(errors, 5)}")


if __name__ == "__main__":
    main()
