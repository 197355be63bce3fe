"""Weight bytes of a model's text weights per format, computed from its config (no checkpoint read).

    python -m atlas.quant.memory [--model M]    # default: the demo and Qwen3.6-35B-A3B dimensions
"""

from __future__ import annotations

import sys
from math import prod
from pathlib import Path

import click

from ..config import ModelSpec, spec_from_config
from .exclusions import converts
from .fp8_block import block_grid
from .nvfp4 import GROUP_SIZE
from .scheme import FP8_BLOCK

FORMATS = ("bf16", "fp8", "nvfp4")
BF16_BYTES = 2
FP32_BYTES = 4


def tensor_bytes(name: str, shape: tuple[int, ...], method: str) -> int:
    """Stored bytes of one checkpoint tensor in `method` (unconverted tensors stay bf16)."""
    if not converts(name, shape, method):
        return BF16_BYTES * prod(shape)
    n, k = shape
    if method == "fp8":
        return n * k + FP32_BYTES * prod(block_grid(shape, FP8_BLOCK))
    return n * k // 2 + n * k // GROUP_SIZE + 2 * FP32_BYTES  # codes, e4m3 scales, scale_2 + input_scale


def weight_bytes(spec: ModelSpec, method: str) -> int:
    """Bytes of every text weight the runtime reads, experts stored per expert."""
    from ..models.qwen3_5_moe import Layout, model_plan

    plan = model_plan(Layout("model.", False, spec))
    return sum(tensor_bytes(name, shape, method) for name, shape in plan.items())


def qwen3_6_spec() -> ModelSpec:
    """Qwen3.6-35B-A3B: the transformers defaults of qwen3_5_moe_text are its dimensions."""
    return spec_from_config({"model_type": "qwen3_5_moe_text"}, Path("Qwen3.6-35B-A3B/config.json"))


def table(specs: dict[str, ModelSpec]) -> str:
    lines = ["| model | " + " | ".join(FORMATS) + " |", "|---|" + "---:|" * len(FORMATS)]
    for label, spec in specs.items():
        sizes = [weight_bytes(spec, f) for f in FORMATS]
        cells = [f"{s / 1024**2:,.2f} MiB ({sizes[0] / s:.2f}x)" for s in sizes]
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


@click.command(context_settings={"help_option_names": ["-h", "--help"]})
@click.option("--model", default=None, help="A checkpoint (default: the demo and Qwen3.6-35B-A3B's dimensions).")
def command(model: str | None) -> None:
    """Print the weight memory of each format, computed from the config alone."""
    from ..config import load_spec
    from ..resolve import resolve_model

    if model is not None:
        specs = {model: load_spec(resolve_model(model))}
    else:
        specs = {"atlas-demo": load_spec(resolve_model(None)), "qwen3.6-35b-a3b": qwen3_6_spec()}
    click.echo(table(specs))


def main(argv: list[str] | None = None) -> int:
    """Entry point; returns the exit code."""
    from ..cli import run_command

    return run_command(command, argv, "atlas.quant.memory")


if __name__ == "__main__":
    sys.exit(main())
