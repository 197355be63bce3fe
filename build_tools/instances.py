"""Render kernels/templates/<quant>/<name>.cu.j2 into kernels/<hw>/<model>/<quant>/<name>.cu.

    python -m build_tools.instances           # write every instance, remove stale generated ones
    python -m build_tools.instances --check   # exit 1 listing out-of-date files, write nothing

One instance per hardware (aliases excluded) x model in targets.toml. Template context: `hw`,
`model`, `quant` (registry dicts with `name`; model constants at top level and under `constants`),
`templates` ({quant directory: its template paths}, for `{% include %}` of another quant's
kernels). A template whose first line is `{#- atlas-hardware: h200, gb10 -#}` renders only for
the hardware it names.
"""

from __future__ import annotations

import argparse
import re
import sys
from dataclasses import dataclass
from pathlib import Path

from atlas.errors import AtlasError
from atlas.targets import Registry, load_registry

from . import kernels_dir, run_tool
from .render import environment, write_if_changed
from .selection import split_names

MARKER = "// generated from kernels/templates/"
_HARDWARE_LINE = re.compile(r"\{#-?\s*atlas-hardware:\s*([^#]*?)\s*-?#\}")


@dataclass(frozen=True)
class Instance:
    path: Path
    text: str


def _header(template: str) -> str:
    return f"{MARKER}{template} by build_tools/instances.py; do not edit\n"


def template_hardware(source: Path, registry: Registry) -> list[str]:
    """The hardware a template renders for: its `atlas-hardware` first line, else all."""
    with source.open(encoding="utf-8") as f:
        match = _HARDWARE_LINE.match(f.readline().strip())
    if match is None:
        return list(registry.hardware)
    names, unknown = split_names(match[1], registry.hardware)
    if unknown or not names:
        raise AtlasError(f"{source}: atlas-hardware names {unknown or 'nothing'}; hardware in targets.toml: "
                         f"{', '.join(registry.hardware)}")
    return names


def expected_instances(registry: Registry, kernels_dir: Path) -> list[Instance]:
    templates = kernels_dir / "templates"
    if not templates.is_dir():
        return []
    env = environment(templates)
    sources = sorted(templates.glob("*/*.cu.j2"))
    by_quant: dict[str, list[str]] = {}
    for source in sources:
        by_quant.setdefault(source.parent.name, []).append(source.relative_to(templates).as_posix())
    out = []
    for source in sources:
        quant = source.parent.name
        if quant not in registry.quants:
            raise AtlasError(f"{source}: directory '{quant}' is not a quant in targets.toml ({', '.join(registry.quants)})")
        rel = source.relative_to(templates).as_posix()
        template = env.get_template(rel)
        for hw_name in template_hardware(source, registry):
            hw = registry.hardware[hw_name]
            for model in registry.models.values():
                ctx = {"hw": hw.to_dict(), "model": model.to_dict(), "quant": registry.quants[quant].to_dict(),
                       "templates": by_quant}
                path = kernels_dir / hw.name / model.name / quant / source.name.removesuffix(".j2")
                out.append(Instance(path, _header(rel) + template.render(**ctx)))
    return out


def generated_files(kernels_dir: Path) -> list[Path]:
    """Existing .cu files carrying the generated marker (hand-written ones are never touched)."""
    found = []
    for path in sorted(kernels_dir.glob("*/*/*/*.cu")):
        with path.open(encoding="utf-8", errors="replace") as f:
            if f.readline().startswith(MARKER):
                found.append(path)
    return found


def out_of_date(registry: Registry, kernels_dir: Path) -> tuple[list[Instance], list[Path]]:
    """(instances to (re)write, stale generated files to remove)."""
    expected = expected_instances(registry, kernels_dir)
    wanted = {inst.path for inst in expected}
    changed = [i for i in expected if not i.path.is_file() or i.path.read_text(encoding="utf-8") != i.text]
    stale = [p for p in generated_files(kernels_dir) if p not in wanted]
    return changed, stale


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="list out-of-date files and exit 1 if any")
    parser.add_argument("--kernels", type=Path, default=None, help="default: kernels/ (or $ATLAS_KERNELS_DIR)")
    args = parser.parse_args(argv)
    return run_tool(lambda: _sync(args.check, args.kernels or kernels_dir()))


def _sync(check: bool, root: Path) -> int:
    changed, stale = out_of_date(load_registry(), root)
    if check:
        for inst in changed:
            print(f"out of date: {inst.path}")
        for path in stale:
            print(f"stale: {path}")
        if changed or stale:
            print("run `python -m build_tools.instances` and commit the result", file=sys.stderr)
        return 1 if changed or stale else 0
    for inst in changed:
        write_if_changed(inst.path, inst.text)
        print(f"wrote {inst.path}")
    for path in stale:
        path.unlink()
        print(f"removed {path}")
        for parent in (path.parent, path.parent.parent, path.parent.parent.parent):
            if parent.is_dir() and not any(parent.iterdir()):
                parent.rmdir()
    return 0


if __name__ == "__main__":
    sys.exit(main())
