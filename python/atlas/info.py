"""`python -m atlas.info [--json]`: the version, the kernel tuples inside, nvcc version and flags."""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any, NoReturn

import atlas

from . import kernels
from .errors import refused_write_line, silence_stdout


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


class OneLineParser(argparse.ArgumentParser):
    """argparse whose usage errors are one line and exit 2, as the other tools' (cli.py); atlas.info
    keeps to the standard library so it runs in an install without the dependencies."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"atlas.info: error: {message} (see --help)\n")


def main(argv: list[str] | None = None, usage: str | None = None) -> int:
    parser = OneLineParser(prog=usage or "python -m atlas.info", description=__doc__.splitlines()[0])
    parser.add_argument("--json", action="store_true", help="print the same as JSON")
    try:
        args = parser.parse_args(argv)
    except SystemExit as done:  # --help, or a usage error already printed: the code, as the other tools return it
        return int(done.code or 0)
    info = collect()
    try:
        print(json.dumps(info, indent=1) if args.json else render_text(info), flush=True)
    except BrokenPipeError:  # `atlas.info | head`: the reader has what it wanted
        silence_stdout()
    except OSError as err:
        if (line := refused_write_line("atlas.info", err)) is None:
            raise
        print(line, file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
