"""Generate the C++ of atlas._kernels from a compile output dir (<out>/build.json).

    python -m build_tools.embed --kernels build/kernels --out build/embed --version 0.1.0+...

Writes kernels_module.cpp, one kernels_blob_<n>.cpp per image, sources.cmake (the list) and
manifest.json. The manifest is what the PTX says: every .entry and its parameter types.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from . import REPO
from .render import environment, write_if_changed

_LINE = 96  # source characters per line of a generated string literal
_PLAIN = frozenset(b for b in range(0x20, 0x7F) if b not in b'"\\?')


def c_string(data: bytes) -> str:
    """Bytes as adjacent C string literals (compiles far faster than a brace list of numbers)."""
    parts, line, width = [], [], 0
    for b in data:
        piece = chr(b) if b in _PLAIN else f"\\{b:03o}"
        line.append(piece)
        width += len(piece)
        if width >= _LINE:
            parts.append('"' + "".join(line) + '"')
            line, width = [], 0
    if line or not parts:
        parts.append('"' + "".join(line) + '"')
    return "\n".join(parts)


def manifest_from(record: dict, version: str) -> dict:
    tuples = []
    for t in record["tuples"]:
        modules = [{"name": m["name"], "ptx_bytes": m["ptx_bytes"], "cubin_bytes": m["cubin_bytes"],
                    "entries": m["entries"], "resources": m["resources"]} for m in t["modules"]]
        tuples.append({"hw": t["hw"], "model": t["model"], "quant": t["quant"], "arch": t["arch"],
                       "gencode": t["gencode"], "modules": modules,
                       "kernels": [e["name"] for m in t["modules"] for e in m["entries"]]})
    return {"version": version, "nvcc": record["nvcc"], "flags": record["flags"], "tuples": tuples}


def _images(record: dict) -> list[tuple[str, Path]]:
    images = []
    for t in record["tuples"]:
        for m in t["modules"]:
            base = f"{t['hw']}/{t['model']}/{t['quant']}/{m['name']}"
            images.append((f"{base}.ptx", REPO / m["ptx"]))
            if m["cubin"]:
                images.append((f"{base}.cubin", REPO / m["cubin"]))
    return images


def generate(record: dict, version: str, out: Path) -> list[Path]:
    """Write the extension sources; returns them (module first)."""
    env = environment()
    manifest = manifest_from(record, version)
    text = json.dumps(manifest, sort_keys=True, separators=(",", ":"))
    blobs, sources = [], []
    for n, (key, path) in enumerate(_images(record)):
        data = path.read_bytes()
        blob = {"symbol": f"atlas_image_{n}", "key": key, "label": key}
        source = out / f"kernels_blob_{n}.cpp"
        write_if_changed(source, env.get_template("kernels_blob.cpp.j2").render(
            **blob, literal=c_string(data), size=len(data)))
        blobs.append(blob)
        sources.append(source)
    for stale in out.glob("kernels_blob_*.cpp"):
        if stale not in sources:
            stale.unlink()
    module = out / "kernels_module.cpp"
    write_if_changed(module, env.get_template("kernels_module.cpp.j2").render(
        blobs=blobs, manifest=text, tuples=manifest["tuples"]))
    write_if_changed(out / "manifest.json", json.dumps(manifest, indent=1, sort_keys=True) + "\n")
    all_sources = [module, *sources]
    write_if_changed(out / "sources.cmake", "set(ATLAS_KERNEL_SOURCES\n"
                     + "".join(f'  "{p.as_posix()}"\n' for p in all_sources) + ")\n")
    return all_sources


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--kernels", type=Path, required=True, help="compile output dir holding build.json")
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--version", required=True)
    args = parser.parse_args()
    record = json.loads((args.kernels / "build.json").read_text(encoding="utf-8"))
    for path in generate(record, args.version, args.out):
        print(path)


if __name__ == "__main__":
    main()
