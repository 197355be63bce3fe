"""The memory ordering of the two last-arriving-block kernels, checked in the PTX nvcc makes here.

atlas_router_fused (router.cuh) and atlas_delta_net_decode (delta_decode.cuh) count their blocks in
on a counter in global memory; the block that arrives last reads what the others stored in this
launch. The CPU emulations (test_router_fused_abi.py, test_delta_decode_abi.py) model the protocol,
not the fences it rests on, so here, in the instruction order of each entry: one atomic add and
one exchange with 0 (the reset a graph replay needs); after the last global store before the add,
a membar.gl and then a barrier (threadFenceReduction: every storing thread fences before the
block counts itself in); after the add, a membar.gl and a barrier before the first load of the
others' data, and those loads bypass L1 (ld.global.cg). Mutations of the PTX (a fence dropped, the
reset dropped, a .cg load made plain) must fail the same check.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from _abi import PtxBuild, compile_ptx

KERNELS = ("atlas_router_fused", "atlas_delta_net_decode")
MODEL = "qwen3.6-35b-a3b"
_OP = re.compile(r"^\s*(?:@%p\d+\s+)?(st\.global|membar\.gl|fence\.\S+|bar\.sync|atom\.global\.add|atom\.global\.exch"
                 r"|ld\.global\.cg|ld\.global)\S*\s*(.*)$")

_FENCE_LINE = r"^\s*(?:membar\.gl|fence\.sc\.gpu|fence\.acq_rel\.gpu);\n"  # __threadfence, as nvcc versions write it


@pytest.fixture(scope="module")
def ptx(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    sources = tuple(f"kernels/sm80/{MODEL}/bf16/{name}.cu" for name in ("router", "delta_net_decode"))
    text = compile_ptx(PtxBuild("sm80", MODEL, "bf16", "compute_80", sources), Path(tmp_path_factory.mktemp("fences")))
    return {name: entry_body(text, name) for name in KERNELS}


def entry_body(text: str, name: str) -> str:
    start = text.index(f".entry {name}(")
    return text[start:text.index("\n}\n", start)]


def _ops(body: str) -> list[tuple[str, str]]:
    """(opcode class, operands) of the ordering-relevant instructions, in text order."""
    ops = []
    for line in body.splitlines():
        if match := _OP.match(line):
            kind = "fence" if match[1] == "membar.gl" or match[1].startswith("fence.") else match[1]
            ops.append((kind, match[2]))
    return ops


def check_arrival_order(body: str) -> None:
    ops = _ops(body)
    kinds = [kind for kind, _ in ops]
    assert kinds.count("atom.global.add") == 1, f"{kinds.count('atom.global.add')} arrival atomics"
    exch = [args for kind, args in ops if kind == "atom.global.exch"]
    assert len(exch) == 1 and re.search(r",\s*0;", exch[0]), f"counter reset to 0: {exch}"
    add = kinds.index("atom.global.add")
    last_store = max(i for i in range(add) if kinds[i] == "st.global")
    before = kinds[last_store:add]
    assert "fence" in before, "no membar.gl between the block's stores and its arrival"
    assert "bar.sync" in before[before.index("fence"):], "no barrier after the fence, before the arrival"
    reads = [i for i in range(add, len(kinds)) if kinds[i] == "ld.global.cg"]
    assert reads, "the last block reads the others' data through L1 (no ld.global.cg after the arrival)"
    after = kinds[add:reads[0]]
    assert "fence" in after and "bar.sync" in after, f"no fence and barrier between the arrival and the reads: {after}"
    assert "ld.global.cg" not in kinds[:add], "an L2 read before the arrival: of data no other block wrote yet"


@pytest.mark.parametrize("kernel", KERNELS)
def test_the_last_block_sees_every_blocks_stores(ptx: dict[str, str], kernel: str) -> None:
    check_arrival_order(ptx[kernel])


def _mutations(body: str) -> dict[str, str]:
    return {
        "fence before the arrival dropped": re.sub(rf"{_FENCE_LINE}(?=(?:(?!atom\.global\.add).)*atom\.global\.add)",
                                                   "", body, count=1, flags=re.M | re.S),
        "fences after the arrival dropped": body[:body.index("atom.global.add")]
        + re.sub(_FENCE_LINE, "", body[body.index("atom.global.add"):], flags=re.M),
        "counter reset dropped": re.sub(r"^.*atom\.global\.exch.*\n", "", body, flags=re.M),
        "L2 reads made plain": body.replace("ld.global.cg", "ld.global"),
    }


@pytest.mark.parametrize("kernel", KERNELS)
def test_the_check_catches_a_broken_order(ptx: dict[str, str], kernel: str) -> None:
    for name, mutated in _mutations(ptx[kernel]).items():
        assert mutated != ptx[kernel], f"{name}: the mutation did not apply"
        with pytest.raises(AssertionError):
            check_arrival_order(mutated)
