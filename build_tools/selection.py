"""Which (hardware, model, quant) tuples a build compiles.

ATLAS_TARGET_HW / ATLAS_TARGET_MODEL / ATLAS_TARGET_QUANT take a name, a comma list or `*`.
Unset MODEL or QUANT means `*`; unset HW means the GPUs nvidia-smi sees (none: a CPU-only build).
A tuple exists when kernels/<hw>/<model>/<quant>/ holds .cu files.
"""

from __future__ import annotations

import re
import shutil
import subprocess
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

from atlas.errors import AtlasError
from atlas.targets import Registry, hardware_for_compute_capability

from . import kernels_dir

VERSION = "0.1.0"
ENV_HW, ENV_MODEL, ENV_QUANT = "ATLAS_TARGET_HW", "ATLAS_TARGET_MODEL", "ATLAS_TARGET_QUANT"


@dataclass(frozen=True, order=True)
class Target:
    hw: str
    model: str
    quant: str

    @property
    def rel(self) -> str:
        return f"{self.hw}/{self.model}/{self.quant}"


@dataclass(frozen=True)
class Selection:
    targets: tuple[Target, ...]
    notes: tuple[str, ...] = field(default=())  # said plainly in the build log

    @property
    def cpu_only(self) -> bool:
        return not self.targets


def existing_targets(registry: Registry, root: Path | None = None) -> list[Target]:
    root = root or kernels_dir()
    found = []
    for hw in registry.hardware:
        for model in registry.models:
            for quant in registry.quants:
                if any((root / hw / model / quant).glob("*.cu")):
                    found.append(Target(hw, model, quant))
    return sorted(found)


def split_names(text: str, valid: Iterable[str]) -> tuple[list[str], list[str]]:
    """A comma list -> (its names, those of them not in `valid`)."""
    names = [n.strip() for n in text.split(",") if n.strip()]
    known = set(valid)
    return names, [n for n in names if n not in known]


def parse_names(var: str, value: str | None, valid: list[str]) -> list[str] | None:
    """Names listed in an env var value; None means all (`*` or unset)."""
    if value is None or value.strip() in ("", "*"):
        return None
    names, unknown = split_names(value, valid)
    if unknown or not names:
        raise AtlasError(f"{var}={value!r}: unknown name {', '.join(unknown) or value!r}; "
                         f"valid: {', '.join(valid)} or '*'")
    return names


def visible_compute_capabilities() -> list[str]:
    """Compute capabilities nvidia-smi reports; [] when it is absent or fails."""
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return []
    try:
        out = subprocess.run([smi, "--query-gpu=compute_cap", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=30, check=True).stdout
    except (OSError, subprocess.SubprocessError):
        return []
    return sorted({line.strip() for line in out.splitlines() if re.match(r"^\d+\.\d+$", line.strip())})


def _detected_hardware(registry: Registry, detect: Callable[[], list[str]]) -> tuple[list[str], list[str]]:
    ccs = detect()
    if not ccs:
        return [], [f"{ENV_HW} is unset and no GPU is visible (nvidia-smi absent or failing): "
                    "building a CPU-only wheel (+cpu) with no kernels"]
    names, notes = [], []
    for cc in ccs:
        hw = hardware_for_compute_capability(cc, registry=registry)
        notes.append(f"{ENV_HW} is unset: GPU of compute capability {cc} -> "
                     + (hw.name if hw else "no hardware target serves it"))
        if hw and hw.name not in names:
            names.append(hw.name)
    if not names:
        notes.append("no visible GPU is served by targets.toml: building a CPU-only wheel (+cpu)")
    return names, notes


def select(registry: Registry, env: Mapping[str, str], root: Path | None = None,
           detect: Callable[[], list[str]] = visible_compute_capabilities) -> Selection:
    """Validate the three variables (before any compile) and pick the existing tuples."""
    raw_hw = parse_names(ENV_HW, env.get(ENV_HW), registry.hardware_names())
    models = parse_names(ENV_MODEL, env.get(ENV_MODEL), list(registry.models))
    quants = parse_names(ENV_QUANT, env.get(ENV_QUANT), list(registry.quants))
    notes: list[str] = []
    if env.get(ENV_HW) is None:
        hws, notes = _detected_hardware(registry, detect)
        if not hws:
            return Selection((), tuple(notes))
    else:
        hws = None if raw_hw is None else [registry.resolve_hardware(n).name for n in raw_hw]  # type: ignore[union-attr]
    existing = existing_targets(registry, root)
    chosen = tuple(t for t in existing if (hws is None or t.hw in hws)
                   and (models is None or t.model in models) and (quants is None or t.quant in quants))
    if not chosen:
        wanted = f"{ENV_HW}={','.join(hws) if hws else '*'} {ENV_MODEL}={env.get(ENV_MODEL) or '*'} {ENV_QUANT}={env.get(ENV_QUANT) or '*'}"
        have = ", ".join(t.rel for t in existing) or "none (kernels/ holds no tuple directory with .cu files)"
        raise AtlasError(f"{wanted} matches no kernel tuple; tuples that exist: {have}")
    return Selection(chosen, tuple(notes))


def _label_part(name: str) -> str:
    return re.sub(r"[^A-Za-z0-9]+", ".", name).strip(".").lower()


def local_label(targets: tuple[Target, ...] | list[Target]) -> str:
    """gb10.qwen3.6.35b.a3b.nvfp4 for one tuple; multi<N>.<hws> for several; cpu for none."""
    if not targets:
        return "cpu"
    if len(targets) == 1:
        t = targets[0]
        return ".".join(_label_part(n) for n in (t.hw, t.model, t.quant))
    hws = sorted({t.hw for t in targets})
    return f"multi{len(targets)}." + ".".join(_label_part(h) for h in hws)


def version_for(targets: tuple[Target, ...] | list[Target]) -> str:
    return f"{VERSION}+{local_label(targets)}"
