"""`python -m atlas.info [--json]`: the version, the kernel tuples inside, nvcc version and flags."""

from __future__ import annotations

import json
import sys
from typing import Any

import click

import atlas

from . import kernels
from .cli import run_command


def collect() -> dict[str, Any]:
    man = kernels.manifest()
    tuples = []
    for t in man["tuples"]:
        tuples.append({
            "hw": t["hw"], "model": t["model"], "quant": t["quant"], "arch": t["arch"],
            "kernels": list(t["kernels"]),
            "resources": {r["entry"]: {k: v for k, v in r.items() if k != "entry"}
                          for m in t["modules"] for r in m.get("resources", []) if r["entry"] in t["kernels"]},
            "modules": [{"name": m["name"], "ptx_bytes": m["ptx_bytes"], "cubin_bytes": m["cubin_bytes"]}
                        for m in t["modules"]],
        })
    return {"version": atlas.__version__, "extension": kernels.available(), "nvcc": man["nvcc"],
            "flags": man["flags"], "tuples": tuples}


def render_text(info: dict[str, Any]) -> str:
    lines = [f"atlas {info['version']}"]
    if not info["extension"]:
        lines.append("kernels: none (atlas._kernels is not built: source tree or CPU-only install)")
    elif not info["tuples"]:
        lines.append("kernels: none (CPU-only wheel)")
    else:
        lines.append(f"nvcc: {info['nvcc']}")
        lines.append(f"flags: {' '.join(info['flags'])}")
    for t in info["tuples"]:
        sizes = ", ".join(f"{m['name']}: ptx {m['ptx_bytes']} B, cubin {m['cubin_bytes']} B" for m in t["modules"])
        lines.append(f"tuple {t['hw']}/{t['model']}/{t['quant']} ({t['arch']}; {sizes})")
        for name in t["kernels"]:
            r = t["resources"].get(name, {})
            lines.append(f"  {name:<32} {r.get('registers', '?'):>3} regs  {r.get('shared_bytes', '?'):>6} B smem")
    return "\n".join(lines)


@click.command(help=__doc__.splitlines()[0])
@click.option("--json", "as_json", is_flag=True, help="Print the same as JSON.")
def info_command(as_json: bool) -> None:
    info = collect()
    click.echo(json.dumps(info, indent=1) if as_json else render_text(info))


def main(argv: list[str] | None = None) -> int:
    return run_command(info_command, argv, "atlas.info")


if __name__ == "__main__":
    sys.exit(main())
