"""Programmatic dependent launch (ATLAS_LAUNCH=pdl) is safe only if no kernel reads what its
predecessor writes before griddepcontrol.wait: that kernel may still be running. Checked on every
kernel instance (the entry's first statement is atlas::pdl_enter(), or a weight prefetch into L2
and then pdl_enter, or a call into a device function that enters itself: the bf16 and quantized
decode GEMVs and the router's logits) and in the PTX nvcc makes here for Hopper (every entry waits
before its first global load, store, atomic or async copy, and lets its dependents launch only
after that wait), while the sm80 PTX, whose arch has no griddepcontrol, holds none of it. Two
kinds of access may come before the wait: an L2 prefetch (cp.async.bulk.prefetch.L2: L2 is where
global memory is coherent, so a line it brings in early is never stale, whatever the predecessor
writes), and in those self-entering kernels their first weight loads (ld.global.nc): no kernel
writes weights; the MoE down GEMV also its slots' expert ids and routing weights, which the
kernel before gate_up wrote (moe.cuh: finished before this kernel launched)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from _abi import PtxBuild, compile_ptx, model_dims

REPO = Path(__file__).resolve().parents[1]
ENTRY = re.compile(r'^extern "C" __global__ void[^\n]*\{\n(?P<first>[^\n]*)\n(?P<second>[^\n]*)', re.MULTILINE)
PREFETCH_CALL = re.compile(r"atlas::\w+_prefetch(?:<[\w:]+>)?\(p(?:\.linear)?\);")
# Device functions that call pdl_enter themselves, after issuing weight loads: gemv.cuh's gemv and
# gemv_norm, gemv_quant.cuh's gemv_quant and gemv_quant_norm and router.cuh's store_block_logits
# (router_logits, router_fused and their _norm forms), and moe.cuh's moe_down_gemv.
SELF_ENTERING = re.compile(r"atlas::(?:gemv|gemv_norm|quant::gemv_quant(?:_norm)?|router::router_logits(?:_norm)?"
                           r"|router::router_fused(?:_norm)?|moe::moe_down_gemv)<[^;]+>\(p\);")
WEIGHTS_FIRST = ("atlas_gemv_", "atlas_qgemv_", "atlas_router_logits", "atlas_router_fused", "atlas_moe_down_gemv_k")  # PTX
# The MoE down GEMV also reads its slots' expert ids and routing weights before the wait (plain
# loads: a kernel wrote them, but one that finished before gate_up's wait, moe.cuh says why).
ROUTING_FIRST = ("atlas_moe_down_gemv_k",)
MEMORY = re.compile(r"^\s*(?:@!?%p\d+\s+)?(?:ld\.global|st\.global|atom\.global|red\.global|cp\.async(?!\.bulk\.prefetch\.L2)"
                    r"|ld\.volatile\.global)")
READ_ONLY = re.compile(r"^\s*(?:@!?%p\d+\s+)?ld\.global\.nc\.")
PLAIN_OR_READ_ONLY = re.compile(r"^\s*(?:@!?%p\d+\s+)?ld\.global\.(?:nc\.)?(?:v\d\.)?[usfb]\d+\s")
MODEL = "qwen3.6-35b-a3b"


def test_every_kernel_instance_enters_through_pdl_enter() -> None:
    sources = sorted(REPO.glob("kernels/*/*/*/*.cu"))
    assert sources
    entries = [(path, m["first"].strip(), m["second"].strip()) for path in sources for m in ENTRY.finditer(path.read_text())]
    assert len(entries) > 200, len(entries)  # every hw x model x quant instance
    late = [f"{path.relative_to(REPO)}: {first}" for path, first, second in entries
            if first != "atlas::pdl_enter();" and not SELF_ENTERING.fullmatch(first)
            and not (PREFETCH_CALL.fullmatch(first) and (second == "atlas::pdl_enter();" or SELF_ENTERING.fullmatch(second)))]
    assert not late, late[:5]
    prefetching = {first for _, first, _ in entries if PREFETCH_CALL.fullmatch(first)}
    assert prefetching == {"atlas::gemv_prefetch<atlas::kGemvWideRows>(p);", "atlas::gemv_prefetch<atlas::kGemvNarrowRows>(p);",
                           "atlas::gemv_prefetch<atlas::kGemvWideRows>(p.linear);"}


def entry_bodies(ptx: str) -> dict[str, str]:
    return {m[1]: ptx[m.end():ptx.index("\n}\n", m.end())] for m in re.finditer(r"\.entry (\w+)\(", ptx)}


LABEL = re.compile(r"^(\$\w+):")
BRANCH = re.compile(r"^\s*(@!?%p\d+\s+)?bra(?:\.uni)?\s+(\$\w+);")
STOP = re.compile(r"^\s*(?:ret|exit|trap);")


def before_wait(body: str) -> list[str]:
    """The lines of an entry's PTX that some path from its start reaches before executing
    griddepcontrol.wait: branches followed both ways when predicated (a block the layout puts
    early may run late, so text order alone proves nothing)."""
    lines = body.splitlines()
    labels = {m[1]: i for i, line in enumerate(lines) if (m := LABEL.match(line.strip()))}
    reached: set[int] = set()
    starts = [0]
    while starts:
        i = starts.pop()
        while i < len(lines) and i not in reached and "griddepcontrol.wait" not in lines[i]:
            reached.add(i)
            if STOP.match(lines[i]):
                break
            branch = BRANCH.match(lines[i])
            if branch:
                starts.append(labels[branch[2]])
                if not branch[1]:
                    break
            i += 1
    return [lines[i] for i in sorted(reached)]


def check_waits_first(name: str, body: str) -> None:
    """Also holds the accesses of a WEIGHTS_FIRST entry before the wait to read-only loads, and of
    a ROUTING_FIRST one to those and plain loads."""
    assert "griddepcontrol.wait" in body, f"{name}: no griddepcontrol.wait"
    weights_first = name.startswith(WEIGHTS_FIRST)
    allowed = PLAIN_OR_READ_ONLY if name.startswith(ROUTING_FIRST) else READ_ONLY
    early = before_wait(body)
    touching = [line.strip() for line in early if MEMORY.match(line) and not (weights_first and allowed.match(line))]
    assert not touching, f"{name}: {touching[0]} before griddepcontrol.wait"
    assert "griddepcontrol.launch_dependents" in body, f"{name}: no griddepcontrol.launch_dependents"
    assert not any("griddepcontrol.launch_dependents" in line for line in early), f"{name}: dependents launched before the wait"


def early_weight_loads(body: str) -> int:
    return sum(1 for line in before_wait(body) if READ_ONLY.match(line))


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
    assert len(gemvs) == 17, sorted(gemvs)  # t1..t8 wide and narrow, and norm_t1
    for name, body in hopper_ptx.items():
        lines = body.splitlines()
        prefetch = next((i for i, line in enumerate(lines) if "cp.async.bulk.prefetch.L2.global" in line), None)
        if name not in gemvs and name != "atlas_moe_gate_up_gemv":
            assert prefetch is None, name
            continue
        wait = next(i for i, line in enumerate(lines) if "griddepcontrol.wait" in line)
        assert prefetch is not None and (prefetch < wait) == (name in gemvs), name


def test_decode_gemvs_and_router_issue_weight_loads_before_the_wait(hopper_ptx: dict[str, str]) -> None:
    """Every bf16 GEMV issues its first weight batch (R x U loads per lane: 8, or 4 in the narrow
    shape above 4 tokens; the norm-taking GEMV too) ahead of the wait, and the router its whole
    weight row (H / 256 loads; its norm-taking entries too),
    and only weights: gemv.cuh's one __ldg is load_weight_batch's, and router.cuh loads through
    __ldg only in load_row (row_dot.cuh), so an x load moved before the wait would be a plain
    ld.global that check_waits_first refuses."""
    gemv_source = (REPO / "kernels/include/atlas/gemv.cuh").read_text()
    assert len(re.findall(r"__ldg\(", gemv_source)) == 1 and "__ldg(reinterpret_cast<const uint4*>(rows[r]" in gemv_source
    assert "__ldg(" not in (REPO / "kernels/include/atlas/router.cuh").read_text()
    early_loads = {name: 8 if "narrow" not in name or int(name.rsplit("_t", 1)[1]) <= 4 else 4
                   for name in hopper_ptx if name.startswith("atlas_gemv_")}
    assert len(early_loads) == 17, sorted(early_loads)
    hidden = model_dims(MODEL)["hidden_size"]
    early_loads |= {name: hidden // 256 for name in ("atlas_router_logits", "atlas_router_fused",
                                                     "atlas_router_logits_norm", "atlas_router_fused_norm")}
    for name, count in early_loads.items():
        assert early_weight_loads(hopper_ptx[name]) == count, name


def test_moe_down_gemv_loads_its_routing_and_rows_before_the_wait(hopper_ptx: dict[str, str]) -> None:
    """Each slot's expert id and routing weight (one plain load each) and its down row (I / 256
    16-byte loads per lane), all k slots ahead of the wait; act, gate_up's output, after it (its
    cp.async staging is refused before the wait by check_waits_first)."""
    inter = model_dims(MODEL)["moe_intermediate_size"]
    top_k = model_dims(MODEL)["num_experts_per_tok"]
    for slots in (top_k, top_k + 1):
        early = before_wait(hopper_ptx[f"atlas_moe_down_gemv_k{slots}"])
        assert sum(1 for line in early if READ_ONLY.match(line)) == slots * inter // 256, slots
        plain = [line for line in early if PLAIN_OR_READ_ONLY.match(line) and not READ_ONLY.match(line)]
        assert len(plain) == 2 * slots, (slots, plain)


@pytest.mark.parametrize("quant", ["fp8", "nvfp4"])
def test_quantized_decode_gemvs_issue_weight_loads_before_the_wait(quant: str, tmp_path: Path) -> None:
    """The fp8 / nvfp4 GEMVs issue their first batch of chunks (a weight load and a scale load per
    chunk, R x U chunks per lane) ahead of the wait, only read-only loads before it, and every
    other entry of the module waits first. Format::load (quant_common.cuh) is the one __ldg the
    GEMV path has before its staging of x, which loads plainly."""
    source = f"kernels/h200/{MODEL}/{quant}/linear_{quant}.cu"
    ptx = entry_bodies(compile_ptx(PtxBuild("h200", MODEL, quant, "compute_90a", (source,)), tmp_path))
    gemvs = {name for name in ptx if name.startswith("atlas_qgemv_")}
    assert len(gemvs) == 17, sorted(ptx)  # t1..t8 wide and narrow, and norm_t1 (wide)
    for name, body in ptx.items():
        check_waits_first(name, body)
        if name not in gemvs:
            continue
        tokens = int(name.rsplit("_t", 1)[1])
        chunks = (4 if tokens <= 4 else 2) if "narrow" in name else 8  # R x U: narrow 1 x (4 | 2), wide 4 x 2
        assert early_weight_loads(body) == 2 * chunks, name


def test_the_check_refuses_a_plain_gemv_load_before_the_wait(hopper_ptx: dict[str, str]) -> None:
    body = hopper_ptx["atlas_gemv_t1"]
    lines = body.splitlines()
    wait = next(i for i, line in enumerate(lines) if "griddepcontrol.wait" in line)
    check_waits_first("atlas_gemv_t1", body)
    moved = [*lines[:wait], "\tld.global.v4.f32 \t{%f1, %f2, %f3, %f4}, [%rd1];", *lines[wait:]]
    with pytest.raises(AssertionError, match="before griddepcontrol.wait"):
        check_waits_first("atlas_gemv_t1", "\n".join(moved))


def test_the_check_follows_branches_not_text_order() -> None:
    """A load laid out before the wait but reached only after it passes; a load laid out after the
    wait but reachable by a branch around it does not."""
    late_block_first = "\n".join(["\tbra.uni \t$L__BB0_1;", "$L__BB0_2:", "\tld.global.f32 \t%f1, [%rd1];", "\tret;",
                                  "$L__BB0_1:", "\tgriddepcontrol.wait;", "\tgriddepcontrol.launch_dependents;",
                                  "\tbra.uni \t$L__BB0_2;"])
    check_waits_first("atlas_layout", late_block_first)
    wait_skipped = "\n".join(["\t@%p1 bra \t$L__BB0_2;", "\tgriddepcontrol.wait;", "\tgriddepcontrol.launch_dependents;",
                               "\tret;", "$L__BB0_2:", "\tst.global.f32 \t[%rd1], %f1;", "\tret;"])
    with pytest.raises(AssertionError, match="before griddepcontrol.wait"):
        check_waits_first("atlas_skip", wait_skipped)


def test_sm80_ptx_has_no_griddepcontrol(tmp_path: Path) -> None:
    ptx = compile_ptx(PtxBuild("sm80", MODEL, "bf16", "compute_80", (f"kernels/sm80/{MODEL}/bf16/linear.cu",)), tmp_path)
    assert ".entry atlas_gemv_t1(" in ptx and "griddepcontrol" not in ptx and "prefetch.L2" not in ptx
