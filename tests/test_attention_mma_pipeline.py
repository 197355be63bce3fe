"""The cp.async pipeline of atlas_attention_prefill_mma (attention_mma.cuh), checked on the CPU.

The kernel's own statements (tile issues, commits, wait_group, barriers, the reads of the Q, K and
V buffers) are read from the header in source order and run by a small interpreter of the PTX
rules: wait_group N completes all but the newest N committed groups of the thread, another
thread's copies are visible after a barrier that follows its wait, and a buffer may be refilled
only after a barrier that follows every warp's last read of it. For 1..6 key tiles every read
must see the tile it expects, landed and visible, no buffer may be refilled while a warp can still
read it, and nothing may be in flight at exit. Mutations of the parsed schedule (any barrier of
the loop removed, either wait count raised) must be caught, so the check can fail. (The final
wait_group 0 is redundant: the last group committed is empty; removing it is not a mutation.)
The quantized levels' source (kv_quant_mma.cuh) fills a tile with plain stores at its issue: a
schedule that is safe for a copy landing any time between issue and wait is safe for those too.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass, field

import pytest

from _abi import REPO

HEADER = REPO / "kernels/include/atlas/attention_mma.cuh"
MAX_TILES = 6


@dataclass(frozen=True)
class Op:
    kind: str  # issue | commit | wait | barrier | write_q | read
    buffer: str = ""  # q | k | v
    tile: str = ""  # issue: "0" or "next"; read: "current"
    count: int = 0  # wait: groups left pending
    only_with_next: bool = False  # under `if (next < key_end)`


_PATTERNS: tuple[tuple[re.Pattern[str], Callable[[re.Match[str]], list[Op]]], ...] = (
    # sm.k / sm.v must be filled from the cache of the same name: a mismatch does not parse
    (re.compile(r"kv\.issue\(p, p\.(k|v)_cache, (0|next), key_end, sm\.\1\)"),
     lambda m: [Op("issue", m[1], m[2])]),
    (re.compile(r"cp_async_commit\(\)"), lambda m: [Op("commit")]),
    (re.compile(r"cp_async_wait<(\d+)>\(\)"), lambda m: [Op("wait", count=int(m[1]))]),
    (re.compile(r"__syncthreads\(\)"), lambda m: [Op("barrier")]),
    (re.compile(r"kv\.load_q\("), lambda m: [Op("write_q", "q")]),
    (re.compile(r"mma_attn_scores<D>\(sm"), lambda m: [Op("read", "q"), Op("read", "k", "current")]),
    (re.compile(r"mma_attn_values<D>\(sm"), lambda m: [Op("read", "v", "current")]),
)


def _ops(text: str) -> list[Op]:
    ops: list[Op] = []
    for line in text.splitlines():
        code = line.split("//")[0]
        for pattern, make in _PATTERNS:
            if match := pattern.search(code):
                guarded = "if (next < key_end)" in code
                ops += [Op(op.kind, op.buffer, op.tile, op.count, guarded) for op in make(match)]
    return ops


@dataclass(frozen=True)
class Schedule:
    prologue: list[Op]
    loop: list[Op]
    epilogue: list[Op]


def parse_schedule() -> Schedule:
    text = HEADER.read_text()
    start = text.index("__device__ void attention_prefill_mma(")
    body = text[start:text.index("\n}\n", start)]
    loop_at = body.index("for (int key0 = 0; key0 < key_end; key0 += kMmaAttnKeys)")
    open_at = body.index("{", loop_at)
    depth, close_at = 0, open_at
    for close_at in range(open_at, len(body)):
        depth += {"{": 1, "}": -1}.get(body[close_at], 0)
        if depth == 0:
            break
    return Schedule(_ops(body[:loop_at]), _ops(body[open_at + 1:close_at]), _ops(body[close_at + 1:]))


@dataclass
class Buffer:
    tile: int | None = None
    state: str = "empty"  # empty | pending (copies in flight) | landed (own copies) | visible (to all warps)
    group: int | None = None
    read_since_barrier: bool = False


@dataclass
class Block:
    """The block's 128 threads in lock step (the schedule has no thread-dependent branch)."""

    buffers: dict[str, Buffer] = field(default_factory=lambda: {"q": Buffer(), "k": Buffer(), "v": Buffer()})
    uncommitted: list[str] = field(default_factory=list)
    committed: int = 0
    complete: int = 0  # groups [0, complete) have landed

    def run(self, op: Op, current: int, tiles: int) -> None:
        if op.only_with_next and current + 1 >= tiles:
            return
        getattr(self, f"_{op.kind}")(op, current)

    def _issue(self, op: Op, current: int) -> None:
        buf = self.buffers[op.buffer]
        assert not buf.read_since_barrier, f"tile {current}: sm.{op.buffer} refilled while a warp may still read it"
        assert buf.state != "pending", f"tile {current}: sm.{op.buffer} refilled with copies still in flight"
        buf.tile, buf.state, buf.group = (0 if op.tile == "0" else current + 1), "pending", None
        self.uncommitted.append(op.buffer)

    def _commit(self, op: Op, current: int) -> None:
        for name in self.uncommitted:
            self.buffers[name].group = self.committed
        self.uncommitted.clear()
        self.committed += 1

    def _wait(self, op: Op, current: int) -> None:
        self.complete = max(self.complete, self.committed - op.count)
        for buf in self.buffers.values():
            if buf.state == "pending" and buf.group is not None and buf.group < self.complete:
                buf.state = "landed"

    def _barrier(self, op: Op, current: int) -> None:
        for buf in self.buffers.values():
            buf.state = "visible" if buf.state == "landed" else buf.state
            buf.read_since_barrier = False

    def _write_q(self, op: Op, current: int) -> None:
        self.buffers["q"].state = "landed"  # plain stores: the thread's own, visible after a barrier

    def _read(self, op: Op, current: int) -> None:
        buf = self.buffers[op.buffer]
        assert buf.state == "visible", f"tile {current}: sm.{op.buffer} read while {buf.state}"
        if op.tile == "current":
            assert buf.tile == current, f"tile {current}: sm.{op.buffer} holds tile {buf.tile}"
        buf.read_since_barrier = True

    def finish(self) -> None:
        assert not self.uncommitted, "cp.async copies never committed"
        pending = [name for name, buf in self.buffers.items() if buf.state == "pending"]
        assert not pending, f"copies into {pending} still in flight at exit"


def run_schedule(schedule: Schedule, tiles: int) -> None:
    block = Block()
    for op in schedule.prologue:
        block.run(op, -1, tiles)
    for current in range(tiles):
        for op in schedule.loop:
            block.run(op, current, tiles)
    for op in schedule.epilogue:
        block.run(op, tiles, tiles)
    block.finish()


def test_the_schedule_is_parsed_from_the_kernel() -> None:
    s = parse_schedule()
    kinds = lambda ops: [op.kind for op in ops]  # noqa: E731
    assert kinds(s.prologue).count("issue") == 2 and kinds(s.prologue).count("commit") == 2
    assert "write_q" in kinds(s.prologue) and "barrier" in kinds(s.prologue)
    assert [op.buffer for op in s.loop if op.kind == "issue"] == ["k", "v"]
    assert all(op.only_with_next and op.tile == "next" for op in s.loop if op.kind == "issue")
    assert kinds(s.loop).count("wait") == 2 and kinds(s.loop).count("commit") == 2
    assert [op.buffer for op in s.loop if op.kind == "read"] == ["q", "k", "v"]
    assert kinds(s.epilogue) == ["wait"]


@pytest.mark.parametrize("tiles", range(1, MAX_TILES + 1))
def test_every_read_sees_its_tile_and_no_buffer_is_refilled_early(tiles: int) -> None:
    run_schedule(parse_schedule(), tiles)


def _without(ops: list[Op], index: int) -> list[Op]:
    return ops[:index] + ops[index + 1:]


def _mutations(s: Schedule) -> list[tuple[str, Schedule]]:
    out = []
    for i, op in enumerate(s.loop):
        if op.kind == "barrier":
            out.append((f"loop barrier {i} removed", Schedule(s.prologue, _without(s.loop, i), s.epilogue)))
        if op.kind == "wait":
            raised = s.loop[:i] + [Op("wait", count=op.count + 1)] + s.loop[i + 1:]
            out.append((f"loop wait {i} raised", Schedule(s.prologue, raised, s.epilogue)))
    return out


def test_the_check_catches_a_broken_schedule() -> None:
    mutations = _mutations(parse_schedule())
    assert len(mutations) >= 6
    for name, schedule in mutations:
        with pytest.raises(AssertionError):
            for tiles in range(1, MAX_TILES + 1):
                run_schedule(schedule, tiles)
            pytest.fail(f"{name}: not caught")  # raises Failed, not AssertionError
