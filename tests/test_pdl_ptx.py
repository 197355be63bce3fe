"""Programmatic dependent launch (ATLAS_LAUNCH=pdl) is safe only if no kernel touches global
memory before griddepcontrol.wait: its predecessor may still be running. Checked on every kernel
instance (the entry's first statement is atlas::pdl_enter(), or a weight prefetch into L2 and then
pdl_enter) and in the PTX nvcc makes here for Hopper (every entry waits before its first global
load, store, atomic or async copy, and lets its dependents launch only after that wait), while
the sm80 PTX, whose arch has no griddepcontrol, holds none of it. The one access allowed before the
wait is an L2 prefetch (cp.async.bulk.prefetch.L2): L2 is where global memory is coherent, so a
line it brings in early is never stale, whatever the predecessor writes."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from _abi import PtxBuild, compile_ptx

REPO = Path(__file__).resolve().parents[1]
ENTRY = re.compile(r'^extern "C" __global__ void[^\n]*\{\n(?P<first>[^\n]*)\n(?P<second>[^\n]*)', re.MULTILINE)
PREFETCH_CALL = re.compile(r"atlas::\w+_prefetch(?:<[\w:]+>)?\(p\);")
MEMORY = re.compile(r"^\s*(?:@!?%p\d+\s+)?(?:ld\.global|st\.global|atom\.global|red\.global|cp\.async(?!\.bulk\.prefetch\.L2)"
                    r"|ld\.volatile\.global)")
MODEL = "qwen3.6-35b-a3b"


def test_every_kernel_instance_enters_through_pdl_enter() -> None:
    sources = sorted(REPO.glob("kernels/*/*/*/*.cu"))
    assert sources
    entries = [(path, m["first"].strip(), m["second"].strip()) for path in sources for m in ENTRY.finditer(path.read_text())]
    assert len(entries) > 200, len(entries)  # every hw x model x quant instance
    late = [f"{path.relative_to(REPO)}: {first}" for path, first, second in entries
            if first != "atlas::pdl_enter();" and not (PREFETCH_CALL.fullmatch(first) and second == "atlas::pdl_enter();")]
    assert not late, late[:5]
    prefetching = {first for _, first, _ in entries if PREFETCH_CALL.fullmatch(first)}
    assert prefetching == {"atlas::gemv_prefetch<atlas::kGemvWideRows>(p);", "atlas::gemv_prefetch<atlas::kGemvNarrowRows>(p);"}


def entry_bodies(ptx: str) -> dict[str, str]:
    return {m[1]: ptx[m.end():ptx.index("\n}\n", m.end())] for m in re.finditer(r"\.entry (\w+)\(", ptx)}


def check_waits_first(name: str, body: str) -> None:
    lines = body.splitlines()
    wait = next((i for i, line in enumerate(lines) if "griddepcontrol.wait" in line), None)
    assert wait is not None, f"{name}: no griddepcontrol.wait"
    first_memory = next((i for i, line in enumerate(lines) if MEMORY.match(line)), len(lines))
    assert wait < first_memory, f"{name}: {lines[first_memory].strip()} before griddepcontrol.wait"
    trigger = next((i for i, line in enumerate(lines) if "griddepcontrol.launch_dependents" in line), None)
    assert trigger is not None and trigger > wait, f"{name}: dependents launched before the wait"


@pytest.fixture(scope="module")
def hopper_ptx(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    sources = tuple(str(p.relative_to(REPO)) for p in sorted((REPO / f"kernels/h200/{MODEL}/bf16").glob("*.cu")))
    return entry_bodies(compile_ptx(PtxBuild("h200", MODEL, "bf16", "compute_90a", sources), tmp_path_factory.mktemp("pdl")))


def test_hopper_entries_wait_before_touching_memory(hopper_ptx: dict[str, str]) -> None:
    assert len(hopper_ptx) > 40, sorted(hopper_ptx)
    for name, body in hopper_ptx.items():
        check_waits_first(name, body)


def test_the_check_sees_a_load_before_the_wait(hopper_ptx: dict[str, str]) -> None:
    name, body = next(iter(hopper_ptx.items()))
    lines = body.splitlines()
    wait = next(i for i, line in enumerate(lines) if "griddepcontrol.wait" in line)
    moved = [*lines[:wait], "\tld.global.f32 \t%f1, [%rd1];", *lines[wait:]]
    with pytest.raises(AssertionError, match="before griddepcontrol.wait"):
        check_waits_first(name, "\n".join(moved))


def test_decode_gemvs_prefetch_their_weights_before_the_wait(hopper_ptx: dict[str, str]) -> None:
    """The bf16 decode GEMVs issue their L2 prefetch ahead of griddepcontrol.wait (the prologue
    a programmatic launch overlaps with the previous kernel); the MoE gate_up GEMV prefetches the
    down rows after it, once the router's expert ids are visible; no other entry prefetches."""
    gemvs = {name for name in hopper_ptx if name.startswith("atlas_gemv_")}
    assert len(gemvs) == 16, sorted(gemvs)
    for name, body in hopper_ptx.items():
        lines = body.splitlines()
        prefetch = next((i for i, line in enumerate(lines) if "cp.async.bulk.prefetch.L2.global" in line), None)
        if name not in gemvs and name != "atlas_moe_gate_up_gemv":
            assert prefetch is None, name
            continue
        wait = next(i for i, line in enumerate(lines) if "griddepcontrol.wait" in line)
        assert prefetch is not None and (prefetch < wait) == (name in gemvs), name


def test_sm80_ptx_has_no_griddepcontrol(tmp_path: Path) -> None:
    ptx = compile_ptx(PtxBuild("sm80", MODEL, "bf16", "compute_80", (f"kernels/sm80/{MODEL}/bf16/linear.cu",)), tmp_path)
    assert ".entry atlas_gemv_t1(" in ptx and "griddepcontrol" not in ptx and "prefetch.L2" not in ptx
