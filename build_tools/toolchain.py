"""The real toolchain behind an nvcc path, and a content fingerprint of it for the kernel cache key.

The nvcc the build is given is often a wrapper script (a PATH shim such as /usr/local/bin/nvcc,
the tests' logging wrapper): its bytes stay the same when a new nvidia-cuda-nvcc wheel, ptxas or
cicc is installed behind it. So the key is taken from what nvcc really runs, found without running
it (a no-op rebuild runs no nvcc):
  - symlinks and wrapper scripts are followed to the nvcc they exec (the first absolute path to an
    executable `nvcc` in a `#!` script; a script that names none, e.g. one that finds its nvcc at
    run time, is taken as the compiler itself, and the build log then shows no `->` target);
  - that binary's nvcc.profile is read the way nvcc reads it (TOP, CICC_PATH, NVVMIR_LIBRARY_DIR,
    PATH, INCLUDES, SYSTEM_INCLUDES) to find cicc, ptxas, cudafe++, libdevice and the CUDA header
    trees (crt/ included); the host compiler is `gcc` (or NVCC_CCBIN) on that PATH;
  - nvcc's own environment variables (NVCC_PREPEND_FLAGS, NVCC_APPEND_FLAGS, NVCC_CCBIN) count too.
Hashing it all is ~180 MB (~0.4 s), so the content digest is remembered under a signature of every
file's (path, size, mtime, ctime, inode): an unchanged toolchain costs one stat per file (~10 ms),
and the digest itself holds no paths, so isolated builds (pip's temporary environments) share a cache.
"""

from __future__ import annotations

import hashlib
import os
import platform
import re
import shlex
import shutil
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

WRAPPER_DEPTH = 8
WRAPPER_READ_BYTES = 1 << 16
NVCC_ENV = ("NVCC_PREPEND_FLAGS", "NVCC_APPEND_FLAGS", "NVCC_CCBIN")
PATH_TOOLS = ("ptxas", "cudafe++")  # nvcc runs these by name on the profile's PATH
TARGET_DIRS = {"x86_64": "x86_64-linux", "aarch64": "sbsa-linux"}
_NVCC_IN_SCRIPT = re.compile(r"""(/[^\s"'`;|&()<>$]*/nvcc)(?![\w.+-])""")
_PROFILE_LINE = re.compile(r"^\s*([A-Za-z_][A-Za-z0-9_]*)\s*(\+=|=\+|=)\s*(.*?)\s*$")
_VARIABLE = re.compile(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)")


@dataclass(frozen=True)
class Toolchain:
    nvcc: Path  # the binary the given path ends up running
    tools: dict[str, Path]  # label -> file: nvcc, nvcc.profile, cicc, ptxas, cudafe++, host compiler
    trees: tuple[Path, ...]  # header and libdevice directories
    env: tuple[tuple[str, str], ...]  # nvcc's own environment variables that are set

    def files(self) -> list[tuple[str, Path]]:
        """(path-independent label, file) of everything the fingerprint covers; a tree inside
        another (cccl inside include) is covered by the outer one."""
        out = sorted(self.tools.items())
        roots = [t.resolve() for t in self.trees]
        for index, (tree, root) in enumerate(zip(self.trees, roots)):
            if root in roots[:index] or any(root != other and root.is_relative_to(other) for other in roots):
                continue
            out.extend((f"tree{index}/{p.relative_to(tree).as_posix()}", p) for p in _tree_files(tree))
        return out


def _tree_files(root: Path) -> list[Path]:
    files = []
    for folder, dirs, names in os.walk(root):
        dirs.sort()
        files.extend(Path(folder) / n for n in sorted(names) if (Path(folder) / n).is_file())
    return files


def _executable(path: Path) -> bool:
    return path.is_file() and os.access(path, os.X_OK)


def wrapped_nvcc(script: Path) -> Path | None:
    """The nvcc a `#!` wrapper script execs (its first absolute path to another executable nvcc)."""
    with script.open("rb") as f:
        head = f.read(WRAPPER_READ_BYTES)
    if not head.startswith(b"#!"):
        return None
    for match in _NVCC_IN_SCRIPT.finditer(head.decode("utf-8", errors="replace")):
        candidate = Path(match.group(1))
        if _executable(candidate) and candidate.resolve() != script:
            return candidate
    return None


def real_nvcc(path: Path) -> Path:
    """Follow symlinks and wrapper scripts from `path` to the nvcc that runs (a script that names
    no other nvcc is itself the end)."""
    current = path.resolve()
    for _ in range(WRAPPER_DEPTH):
        target = wrapped_nvcc(current)
        if target is None:
            break
        current = target.resolve()
    return current


def read_profile(bindir: Path, env: Mapping[str, str]) -> dict[str, str]:
    """nvcc.profile's variables after expansion (`+=` prepends, `=+` appends, as nvcc does)."""
    top_default = str(bindir.parent)
    target_dir = "targets/" + TARGET_DIRS.get(platform.machine(), f"{platform.machine()}-linux")
    values = {"_HERE_": str(bindir), "_THERE_": str(bindir), "_SPACE_": " ", "_TARGET_SIZE_": "",
              "_NVVM_BRANCH_": "nvvm", "_CUDART_": "cudart", "PATH": env.get("PATH", ""),
              # nvcc leaves it empty where <TOP>/targets/<arch> does not exist (the PyPI wheels)
              "_TARGET_DIR_": target_dir if (bindir.parent / target_dir).is_dir() else "",
              "TOP": top_default, "CICC_PATH": f"{top_default}/nvvm/bin",
              "NVVMIR_LIBRARY_DIR": f"{top_default}/nvvm/libdevice", "INCLUDES": f'"-I{top_default}/include"'}
    profile = bindir / "nvcc.profile"
    lines = profile.read_text(encoding="utf-8", errors="replace").splitlines() if profile.is_file() else []
    if lines:
        values.update({"INCLUDES": "", "SYSTEM_INCLUDES": ""})
    for line in lines:
        match = _PROFILE_LINE.match(line)
        if not match:
            continue
        name, op, raw = match.groups()
        value = _VARIABLE.sub(lambda m: values.get(m.group(1), env.get(m.group(1), "")), raw)
        old = values.get(name, env.get(name, ""))
        values[name] = value + old if op == "+=" else old + value if op == "=+" else value
    return values


def include_dirs(values: Mapping[str, str]) -> list[Path]:
    """The -I / -isystem directories of the profile's INCLUDES and SYSTEM_INCLUDES that exist."""
    words = shlex.split(values.get("INCLUDES", "") + " " + values.get("SYSTEM_INCLUDES", ""))
    dirs = []
    for i, word in enumerate(words):
        if word.startswith("-I") and len(word) > 2:
            dirs.append(Path(word[2:]))
        elif word in ("-I", "-isystem") and i + 1 < len(words):
            dirs.append(Path(words[i + 1]))
    return [d for d in dict.fromkeys(dirs) if d.is_dir()]


def resolve_toolchain(path: Path, env: Mapping[str, str] = os.environ) -> Toolchain:
    nvcc = real_nvcc(path)
    values = read_profile(nvcc.parent, env)
    search = values["PATH"]
    tools = {"nvcc": nvcc, "nvcc.profile": nvcc.parent / "nvcc.profile",
             "cicc": Path(values["CICC_PATH"]) / "cicc"}
    for name in PATH_TOOLS:
        found = shutil.which(name, path=search)
        if found:
            tools[name] = Path(found)
    host = env.get("NVCC_CCBIN") or "gcc"
    host_path = shutil.which(host, path=search)
    if host_path:
        tools["host-compiler"] = Path(host_path)
    # <TOP>/include too: a pip-installed toolchain may have no targets/<arch>/include to point at
    trees = [*include_dirs(values), Path(values["TOP"]) / "include", Path(values["NVVMIR_LIBRARY_DIR"])]
    present = {label: p for label, p in tools.items() if p.is_file()}
    nvcc_env = tuple((name, env[name]) for name in NVCC_ENV if env.get(name))
    return Toolchain(nvcc, present, tuple(t for t in trees if t.is_dir()), nvcc_env)


def _stat_signature(files: list[tuple[str, Path]], env: tuple[tuple[str, str], ...]) -> str:
    digest = hashlib.sha256(repr(env).encode())
    for label, path in files:
        st = path.stat()
        digest.update(f"{label}\0{path}\0{st.st_size}\0{st.st_mtime_ns}\0{st.st_ctime_ns}\0{st.st_ino}\n".encode())
    return digest.hexdigest()


def content_digest(files: list[tuple[str, Path]], env: tuple[tuple[str, str], ...]) -> str:
    digest = hashlib.sha256(repr(env).encode())
    for label, path in files:
        digest.update(label.encode() + b"\0" + _file_sha256(path) + b"\n")
    return digest.hexdigest()


def _file_sha256(path: Path) -> bytes:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.digest()


def fingerprint(toolchain: Toolchain, memo_dir: Path) -> str:
    """Content hash of the toolchain, remembered per stat signature in memo_dir."""
    files = toolchain.files()
    memo = memo_dir / "toolchain" / f"{_stat_signature(files, toolchain.env)}.sha256"
    if memo.is_file():
        return memo.read_text(encoding="utf-8").strip()
    digest = content_digest(files, toolchain.env)
    memo.parent.mkdir(parents=True, exist_ok=True)
    tmp = memo.with_name(f"{memo.name}.{os.getpid()}.tmp")
    tmp.write_text(digest + "\n", encoding="utf-8")
    os.replace(tmp, memo)
    return digest
