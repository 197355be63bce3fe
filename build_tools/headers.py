"""Render the per-tuple generated headers: atlas_tuple.cuh (targets.toml) and atlas_params.cuh.

    python -m build_tools.headers --hw h200 --model atlas-demo --quant bf16 --out DIR
"""

from __future__ import annotations

import argparse
import ctypes
import re
import sys
from dataclasses import dataclass
from pathlib import Path

from atlas.errors import AtlasError
from atlas.targets import Registry, load_registry

from . import run_tool
from .render import environment, write_if_changed

_CTYPES: dict[type, str] = {
    ctypes.c_void_p: "void*",
    ctypes.c_int32: "int32_t",
    ctypes.c_uint32: "uint32_t",
    ctypes.c_int64: "int64_t",
    ctypes.c_float: "float",
}


@dataclass(frozen=True)
class TupleNames:
    hw: str
    model: str
    quant: str


def macro_name(name: str) -> str:
    """qwen3.6-35b-a3b -> QWEN3_6_35B_A3B."""
    return re.sub(r"[^A-Za-z0-9]", "_", name).upper()


def _struct_context(struct: type[ctypes.Structure]) -> dict[str, object]:
    fields = []
    for name, ftype, *_ in struct._fields_:
        if isinstance(ftype, type) and issubclass(ftype, ctypes.Structure):  # another params struct, rendered before
            fields.append({"name": name, "ctype": ftype.__name__})
            continue
        if ftype not in _CTYPES:
            allowed = ", ".join(t.__name__ for t in _CTYPES)
            raise AtlasError(f"kernel_params: {struct.__name__}.{name} has type {ftype.__name__}; use one of "
                             f"{allowed} or a params struct")
        fields.append({"name": name, "ctype": _CTYPES[ftype]})
    return {"name": struct.__name__, "fields": fields, "size": ctypes.sizeof(struct)}


def render_params() -> str:
    from atlas.kernel_params import ALL_PARAMS

    env = environment()
    return env.get_template("atlas_params.cuh.j2").render(structs=[_struct_context(s) for s in ALL_PARAMS])


def render_tuple(registry: Registry, names: TupleNames) -> str:
    env = environment()
    env.filters["macro"] = macro_name
    return env.get_template("atlas_tuple.cuh.j2").render(
        hw=registry.hardware[names.hw].to_dict(),
        model=registry.models[names.model].to_dict(),
        quant=registry.quants[names.quant].to_dict(),
    )


def write_headers(registry: Registry, names: TupleNames, include_dir: Path) -> list[Path]:
    """Write both headers into include_dir (untouched when unchanged, so caches stay valid)."""
    outputs = {include_dir / "atlas_tuple.cuh": render_tuple(registry, names),
               include_dir / "atlas_params.cuh": render_params()}
    for path, text in outputs.items():
        write_if_changed(path, text)
    return list(outputs)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hw", required=True)
    parser.add_argument("--model", required=True)
    parser.add_argument("--quant", required=True)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    return run_tool(lambda: _write(TupleNames(args.hw, args.model, args.quant), args.out))


def _write(names: TupleNames, out: Path) -> int:
    registry = load_registry()
    for kind, name, known in (("hw", names.hw, registry.hardware), ("model", names.model, registry.models),
                              ("quant", names.quant, registry.quants)):
        if name not in known:
            raise AtlasError(f"--{kind} {name!r}: not in targets.toml; valid: {', '.join(known)}")
    for path in write_headers(registry, names, out):
        print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
