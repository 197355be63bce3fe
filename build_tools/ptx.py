"""Facts read from compiler output: PTX entry points (the manifest) and ptxas -v resources."""

from __future__ import annotations

import re
from dataclasses import asdict, dataclass

_ENTRY = re.compile(r"^\s*(?:\.visible\s+|\.weak\s+)?\.entry\s+([A-Za-z_$][\w$]*)\s*\((.*?)\)", re.M | re.S)
_PARAM = re.compile(r"\.param\s+(?:\.align\s+(\d+)\s+)?\.(\w+)\s+[\w$]+(?:\[(\d+)\])?")


@dataclass(frozen=True)
class EntryParam:
    type: str  # PTX type: b8, u32, u64, f32 ...
    align: int  # 0 when not given
    count: int  # array length (bytes of a by-value struct for .b8), 1 for scalars


@dataclass(frozen=True)
class Entry:
    name: str
    params: tuple[EntryParam, ...]

    def to_dict(self) -> dict[str, object]:
        return {"name": self.name, "params": [asdict(p) for p in self.params]}


def parse_entries(ptx: str) -> list[Entry]:
    """Every `.entry` of a PTX module with its parameter types, in file order."""
    entries = []
    for match in _ENTRY.finditer(ptx):
        params = tuple(EntryParam(m.group(2), int(m.group(1) or 0), int(m.group(3) or 1))
                       for m in _PARAM.finditer(match.group(2)))
        entries.append(Entry(match.group(1), params))
    return entries


@dataclass
class Resources:
    entry: str
    registers: int = 0
    shared_bytes: int = 0
    stack_bytes: int = 0
    spill_stores: int = 0
    spill_loads: int = 0


def parse_ptxas(log: str) -> list[Resources]:
    """Per-function resources from `ptxas -v` output."""
    table: dict[str, Resources] = {}
    current: Resources | None = None
    for line in log.splitlines():
        if m := re.search(r"(?:Compiling entry function|Function properties for) '?([\w$]+)'?", line):
            current = table.setdefault(m.group(1), Resources(m.group(1)))
        if current is None:
            continue
        if m := re.search(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads", line):
            current.stack_bytes, current.spill_stores, current.spill_loads = map(int, m.groups())
        if m := re.search(r"Used (\d+) registers", line):
            current.registers = int(m.group(1))
        if m := re.search(r"(\d+) bytes smem", line):
            current.shared_bytes = int(m.group(1))
    return list(table.values())
