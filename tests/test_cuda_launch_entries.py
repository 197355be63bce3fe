"""Every kernel the CUDA backend launches for the demo model is an entry of its tuple's instance
files (kernels/<hw>/atlas-demo/<quant>/*.cu, plus the bf16 sibling's for a quantized tuple): the
emulated driver of test_cuda_select.py accepts any `atlas_` name, so a launch of an entry that
was never instantiated (a slot count, a format suffix) shows up here and not only on the device.
Covered: prefill (GEMV and GEMM sizes), decode, and both with a dump attached (ATLAS_DUMP runs the
stacked MoE's parts apart), with the default kernel forms and with every opt-in form."""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pytest

from atlas.backends.cuda.backend import CudaBackend
from atlas.config import load_spec
from atlas.demo import DEMO_DIR
from atlas.engine import Engine
from atlas.safetensors import Checkpoint
from test_cuda_select import make_runtime

REPO = Path(__file__).resolve().parent.parent
OPT_IN_FORMS = {"ATLAS_ROUTER": "fused", "ATLAS_DELTANET_DECODE": "fused", "ATLAS_PREFILL_ATTENTION": "simt",
                "ATLAS_DELTA_RULE": "chunked", "ATLAS_ATTENTION_PREP": "fused", "ATLAS_NORM": "fused"}
OPT_IN_KERNELS = {"atlas_router_fused", "atlas_delta_net_decode", "atlas_attention_prefill", "atlas_attention_prep",
                  "atlas_gated_delta_chunk_prep", "atlas_gated_delta_chunk_scan", "atlas_router_fused_norm"}
ENTRY = re.compile(r'extern "C" __global__ void(?: __launch_bounds__\([^)]*\))? (atlas_\w+)\(')


def instance_entries(hw: str, model: str, quant: str) -> set[str]:
    """Entry names of a tuple's module (a quantized tuple also compiles its bf16 sibling's files)."""
    quants = ("bf16",) if quant == "bf16" else ("bf16", quant)
    names = set()
    for q in quants:
        for source in (REPO / "kernels" / hw / model / q).glob("*.cu"):
            names.update(ENTRY.findall(source.read_text()))
    return names


def test_entry_pattern_reads_the_instance_files() -> None:
    entries = instance_entries("h200", "atlas-demo", "bf16")
    assert {"atlas_gemv_t1", "atlas_router_top_k", "atlas_moe_down_gemv_k2", "atlas_sample"} <= entries
    assert not any(name.startswith("atlas_qgemv_") for name in entries)
    assert "atlas_qgemv_fp8_t1" in instance_entries("h200", "atlas-demo", "fp8")


def launched_kernels(model_dir: Path, rng: np.random.Generator, dump: bool) -> set[str]:
    rt, driver = make_runtime(arena_bytes=8 << 20)
    spec = load_spec(model_dir)
    engine = Engine(spec, Checkpoint.open(model_dir), CudaBackend(rt, use_graphs=False), max_seq_len=64)
    if dump:
        engine.dump = lambda name, tensor: None
    start = len(driver.launches)
    for length in (3, 20):  # per-slot GEMVs (T <= 8) and the grouped GEMMs
        prompt = rng.integers(0, spec.vocab_size, length).tolist()
        engine.prefill(prompt)
        engine.decode(int(rng.integers(0, spec.vocab_size)), length)
    return {launch[0] for launch in driver.launches[start:]}


@pytest.fixture(params=["default", "opt-in"])
def forms(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """The kernel forms the backend picks from the environment: defaults, or every opt-in one."""
    for name, value in OPT_IN_FORMS.items():
        if request.param == "opt-in":
            monkeypatch.setenv(name, value)
        else:
            monkeypatch.delenv(name, raising=False)
    return request.param


@pytest.mark.parametrize("dump", [False, True])
def test_demo_launches_only_instantiated_entries(rng: np.random.Generator, dump: bool, forms: str) -> None:
    launched = launched_kernels(DEMO_DIR, rng, dump)
    opt_in = OPT_IN_KERNELS - ({"atlas_delta_net_decode"} if dump else set())  # a dump runs DeltaNet's three ops
    assert (opt_in <= launched) == (forms == "opt-in"), sorted(OPT_IN_KERNELS & launched)
    missing = launched - instance_entries("h200", "atlas-demo", "bf16")
    assert not missing, f"launched but never instantiated: {sorted(missing)}"


@pytest.mark.parametrize("fmt", ["fp8", "nvfp4"])
def test_quantized_demo_launches_only_instantiated_entries(fmt: str, tmp_path: Path, rng: np.random.Generator,
                                                           forms: str) -> None:
    from atlas.quantize import QuantizeArgs, quantize

    model_dir = quantize(QuantizeArgs(str(DEMO_DIR), fmt, tmp_path / fmt, 1 << 30))
    launched = launched_kernels(model_dir, rng, dump=True)
    assert any(name.startswith(f"atlas_moe_qgemv_{fmt}_down_k") for name in launched)
    missing = launched - instance_entries("h200", "atlas-demo", fmt)
    assert not missing, f"launched but never instantiated: {sorted(missing)}"
