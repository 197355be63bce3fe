"""Compile the selected kernel tuples to PTX and cubin, in parallel, with a content-hash cache.

    python -m build_tools.compile [--hw H] [--model M] [--quant Q] [--out build/kernels] [--jobs N]

--hw/--model/--quant take what ATLAS_TARGET_* take (and default to those variables). Output per
tuple: <out>/<hw>/<model>/<quant>/{include/, <name>.ptx, <name>.cubin}; <out>/resources.{json,txt}
and <out>/build.json. Compiler errors are shown as file:line; any register spill fails.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path

from atlas.errors import AtlasError
from atlas.targets import Hardware, Registry, load_registry

from . import REPO
from .headers import TupleNames, write_headers
from .nvcc import Nvcc, find_nvcc
from .ptx import parse_entries, parse_ptxas
from .selection import ENV_HW, ENV_MODEL, ENV_QUANT, Selection, Target, select

COMMON_FLAGS = ("-std=c++17", "-O3", "-lineinfo")
PTXAS_FLAGS = ("-Xptxas", "-v,-warn-spills")
KERNELS = REPO / "kernels"


@dataclass(frozen=True)
class Job:
    target: Target
    source: Path
    out_dir: Path  # tuple output dir
    ptx_cmd: tuple[str, ...]
    cubin_cmd: tuple[str, ...]
    keep_cubin: bool  # False for PTX-only hardware: ptxas still checks registers and spills

    @property
    def stem(self) -> str:
        return self.source.name.removesuffix(".cu")


@dataclass
class JobResult:
    job: Job
    cached: bool
    error: str = ""
    resources: list[dict[str, object]] | None = None


def _rel(path: Path) -> str:
    """Repo-relative when possible, so PTX line info does not depend on where the tree lives."""
    try:
        return path.resolve().relative_to(REPO).as_posix()
    except ValueError:
        return str(path.resolve())


def make_job(nvcc: Nvcc, hw: Hardware, target: Target, source: Path, out: Path) -> Job:
    tuple_dir = out / target.rel
    includes = ("-I", _rel(tuple_dir / "include"), "-I", _rel(KERNELS / "include"))
    stem = source.name.removesuffix(".cu")
    ptx_cmd = (str(nvcc.path), "-ptx", *COMMON_FLAGS, *hw.gencode, *hw.extra_flags, *includes,
               _rel(source), "-o", str(tuple_dir / f"{stem}.ptx"))
    code = hw.gencode if hw.has_cubin else (f"-arch={hw.check_arch}",)
    cubin_cmd = (str(nvcc.path), "-cubin", *code, *PTXAS_FLAGS, *hw.extra_flags,
                 str(tuple_dir / f"{stem}.ptx"), "-o", str(tuple_dir / f"{stem}.cubin"))
    return Job(target, source, tuple_dir, ptx_cmd, cubin_cmd, hw.has_cubin)


def _hash_tree(digest: "hashlib._Hash", root: Path) -> None:
    for path in sorted(p for p in root.rglob("*") if p.is_file()):
        digest.update(path.relative_to(root).as_posix().encode() + b"\0" + path.read_bytes() + b"\0")


def cache_key(job: Job, compiler_id: str) -> str:
    """Source, every header on the include path, both commands (minus the nvcc path), compiler."""
    digest = hashlib.sha256(compiler_id.encode())
    for cmd in (job.ptx_cmd, job.cubin_cmd):
        digest.update("\0".join(cmd[1:]).encode())
    digest.update(job.source.read_bytes())
    _hash_tree(digest, job.out_dir / "include")
    _hash_tree(digest, KERNELS / "include")
    return digest.hexdigest()


def file_line(stderr: str) -> str:
    """nvcc's `path(12): error` -> `path:12: error` (clickable in editors and CI logs)."""
    return re.sub(r"^(.+?)\((\d+)\): ", r"\1:\2: ", stderr, flags=re.M)


def _run(cmd: tuple[str, ...]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, check=False)


def _outputs(job: Job) -> dict[str, Path]:
    return {"ptx": job.out_dir / f"{job.stem}.ptx", "cubin": job.out_dir / f"{job.stem}.cubin",
            "res": job.out_dir / f"{job.stem}.resources.json"}


def run_job(job: Job, compiler_id: str, cache_dir: Path) -> JobResult:
    key = cache_key(job, compiler_id)
    entry = cache_dir / key[:2] / key
    outs = _outputs(job)
    if (entry / "res").is_file():
        for kind, path in outs.items():
            if (entry / kind).is_file():
                shutil.copyfile(entry / kind, path)
        outs["cubin"].unlink(missing_ok=True) if not job.keep_cubin else None
        return JobResult(job, True, resources=json.loads(outs["res"].read_text()))
    for cmd in (job.ptx_cmd, job.cubin_cmd):
        proc = _run(cmd)
        if proc.returncode != 0:
            return JobResult(job, False, error=file_line(proc.stderr + proc.stdout))
    log = proc.stderr + proc.stdout
    table = [asdict(r) for r in parse_ptxas(log)]
    spilled = [r for r in table if r["spill_stores"] or r["spill_loads"]] or ([{"entry": "?"}] if "spilled" in log else [])
    if spilled:
        names = ", ".join(f"{r['entry']} ({r.get('spill_stores', '?')} B stores, {r.get('spill_loads', '?')} B loads)" for r in spilled)
        return JobResult(job, False, error=f"{_rel(job.source)}: register spill in {names}; spills are not allowed\n{log}")
    if not job.keep_cubin:
        outs["cubin"].unlink(missing_ok=True)
    outs["res"].write_text(json.dumps(table, indent=1))
    _store(entry, outs)
    return JobResult(job, False, resources=table)


def _store(entry: Path, outs: dict[str, Path]) -> None:
    tmp = entry.with_name(f"{entry.name}.{os.getpid()}.tmp")
    tmp.mkdir(parents=True, exist_ok=True)
    for kind, path in outs.items():
        if path.is_file():
            shutil.copyfile(path, tmp / kind)
    shutil.rmtree(entry, ignore_errors=True)
    os.replace(tmp, entry)


def default_cache_dir() -> Path:
    return Path(os.environ.get("ATLAS_KERNEL_CACHE") or REPO / "build" / "kernel-cache")


def plan(registry: Registry, selection: Selection, nvcc: Nvcc, out: Path) -> list[Job]:
    """Write each tuple's generated headers and list its compile jobs."""
    jobs = []
    for target in selection.targets:
        tuple_dir = out / target.rel
        write_headers(registry, TupleNames(target.hw, target.model, target.quant), tuple_dir / "include")
        for source in sorted((KERNELS / target.rel).glob("*.cu")):
            jobs.append(make_job(nvcc, registry.hardware[target.hw], target, source, out))
    return jobs


def _module_record(result: JobResult) -> dict[str, object]:
    outs = _outputs(result.job)
    ptx = outs["ptx"].read_text(encoding="utf-8")
    cubin = outs["cubin"].stat().st_size if outs["cubin"].is_file() else 0
    return {"name": result.job.stem, "source": _rel(result.job.source),
            "ptx": _rel(outs["ptx"]), "cubin": _rel(outs["cubin"]) if cubin else "",
            "ptx_bytes": len(ptx.encode()), "cubin_bytes": cubin,
            "entries": [e.to_dict() for e in parse_entries(ptx)], "resources": result.resources or []}


def build_record(registry: Registry, selection: Selection, results: list[JobResult], nvcc_version: str) -> dict[str, object]:
    tuples = []
    for target in selection.targets:
        hw = registry.hardware[target.hw]
        modules = [_module_record(r) for r in results if r.job.target == target]
        tuples.append({"hw": target.hw, "model": target.model, "quant": target.quant, "arch": hw.arch,
                       "gencode": list(hw.gencode), "modules": modules})
    return {"nvcc": nvcc_version, "flags": [*COMMON_FLAGS, *PTXAS_FLAGS], "tuples": tuples}


def resource_table(record: dict[str, object]) -> str:
    header = ("tuple", "module", "entry", "regs", "smem", "stack", "spill", "ptx_B", "cubin_B")
    rows = [header]
    for t in record["tuples"]:  # type: ignore[attr-defined]
        for m in t["modules"]:
            by_name = {r["entry"]: r for r in m["resources"]}
            for e in m["entries"]:
                r = by_name.get(e["name"], {})
                rows.append((f"{t['hw']}/{t['model']}/{t['quant']}", m["name"], e["name"], str(r.get("registers", "?")),
                             str(r.get("shared_bytes", "?")), str(r.get("stack_bytes", "?")),
                             str(r.get("spill_stores", 0) + r.get("spill_loads", 0)), str(m["ptx_bytes"]), str(m["cubin_bytes"])))
    widths = [max(len(row[i]) for row in rows) for i in range(len(header))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip() for row in rows) + "\n"


def compile_selection(registry: Registry, selection: Selection, out: Path, jobs: int | None = None) -> dict[str, object]:
    """Compile everything selected; raise AtlasError after printing every failure."""
    nvcc = find_nvcc()
    cache_dir = default_cache_dir()
    out.mkdir(parents=True, exist_ok=True)
    work = plan(registry, selection, nvcc, out)
    compiler_id = nvcc.identity() + nvcc.version(cache_dir) if work else ""
    print(f"atlas: nvcc {nvcc.path} ({nvcc.source}); {len(work)} kernel files in {len(selection.targets)} tuples", flush=True)
    with ThreadPoolExecutor(max_workers=jobs or os.cpu_count() or 1) as pool:
        results = list(pool.map(lambda j: run_job(j, compiler_id, cache_dir), work))
    failed = [r for r in results if r.error]
    for r in failed:
        print(r.error.rstrip(), file=sys.stderr)
    if failed:
        raise AtlasError(f"{len(failed)} of {len(work)} kernel files failed to compile: "
                         + ", ".join(_rel(r.job.source) for r in failed) + "; fix the errors shown above")
    cached = sum(r.cached for r in results)
    print(f"atlas: {len(work) - cached} compiled, {cached} from cache ({cache_dir})", flush=True)
    record = build_record(registry, selection, results, nvcc.version(cache_dir) if work else "")
    table = resource_table(record)
    print(table, end="", flush=True)
    (out / "resources.txt").write_text(table, encoding="utf-8")
    (out / "resources.json").write_text(json.dumps(record["tuples"], indent=1), encoding="utf-8")
    (out / "build.json").write_text(json.dumps(record, indent=1), encoding="utf-8")
    return record


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hw", help=f"name, comma list or '*' (default: ${ENV_HW}, else visible GPUs)")
    parser.add_argument("--model", help=f"default: ${ENV_MODEL} or '*'")
    parser.add_argument("--quant", help=f"default: ${ENV_QUANT} or '*'")
    parser.add_argument("--out", type=Path, default=REPO / "build" / "kernels")
    parser.add_argument("--jobs", type=int, default=None, help="parallel nvcc jobs (default: one per core)")
    args = parser.parse_args(argv)
    env = dict(os.environ)
    for var, value in ((ENV_HW, args.hw), (ENV_MODEL, args.model), (ENV_QUANT, args.quant)):
        if value is not None:
            env[var] = value
    try:
        registry = load_registry()
        selection = select(registry, env)
        for note in selection.notes:
            print(f"atlas: {note}", flush=True)
        compile_selection(registry, selection, args.out.resolve(), args.jobs)
    except AtlasError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2 if "failed to compile" not in str(err) else 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
