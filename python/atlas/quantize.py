"""`python -m atlas.quantize --model M --to fp8|nvfp4 --out DIR`: a bf16 checkpoint -> block FP8
or ModelOpt NVFP4, in the published formats.

The output is built in a temporary directory beside DIR and renamed to DIR at the end, so a
failure (or Ctrl-C) leaves nothing behind. Bad input prints one line and exits with code 2.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

import click

from .cli import run_command, termination_as_exit
from .errors import NO_ROOM_ERRNOS, AtlasError

METHODS = ("fp8", "nvfp4")
WEIGHT_FILES = (".safetensors",)
SKIPPED_FILES = frozenset({"config.json", "hf_quant_config.json", "model.safetensors.index.json"})


@dataclass(frozen=True)
class QuantizeArgs:
    model: str | None
    method: str  # "fp8" or "nvfp4"
    out: Path
    shard_bytes: int


QUANTIZED_SUFFIXES = (".weight_scale_inv", ".weight_scale", ".weight_scale_2", ".input_scale")  # what it writes


def check_out(out: Path) -> None:
    try:
        dangling, exists = out.is_symlink() and not out.exists(), out.exists()
        parent_exists, parent_is_dir = out.parent.exists(), out.parent.is_dir()
    except OSError as err:  # a name too long, a loop of links
        raise AtlasError(f"--out {str(out)[:80]}: {err.strerror or err}; choose another directory") from None
    if dangling:
        raise AtlasError(f"--out {out} is a link to a missing path; remove the link or choose another directory")
    if exists:
        raise AtlasError(f"--out {out} already exists; remove it or choose another directory")
    if parent_exists and not parent_is_dir:
        raise AtlasError(f"--out {out}: {out.parent} is a file, not a directory; choose another directory")
    if not parent_is_dir:
        raise AtlasError(f"--out {out}: the parent directory {out.parent} does not exist; create it first")
    if not os.access(out.parent, os.W_OK | os.X_OK):
        raise AtlasError(f"--out {out}: the directory {out.parent} is not writable; choose another directory")


def write_weights(source: Path, target: Path, args: QuantizeArgs) -> list[str]:
    """Quantize every tensor into target; returns the modules left unquantized."""
    from tqdm import tqdm

    from .quant.convert import converted_tensors, unconverted_modules
    from .quant.scheme import QuantScheme
    from .quant.writer import ShardWriter
    from .safetensors import Checkpoint

    checkpoint = Checkpoint.open(source)
    scheme = QuantScheme(args.method)  # type: ignore[arg-type]
    writer = ShardWriter(target, args.shard_bytes)
    kept: list[str] = []
    names = checkpoint.names()
    total = sum(checkpoint.info(n).nbytes for n in names)
    with tqdm(total=total, desc=f"quantizing to {args.method}", unit="B", unit_scale=True, file=sys.stderr) as bar:
        for name in names:
            for out_name, array, quantized in converted_tensors(checkpoint, name, scheme):
                writer.add(out_name, array)
                if not quantized:
                    kept.append(out_name)
            bar.update(checkpoint.info(name).nbytes)
    writer.finish()
    return unconverted_modules(kept)


def quant_configs(method: str, excluded: list[str]) -> tuple[dict[str, object], dict[str, object] | None]:
    """(config.json quantization_config, hf_quant_config.json or None) as the formats publish them."""
    from . import __version__
    from .quant.nvfp4 import GROUP_SIZE
    from .quant.scheme import FP8_BLOCK

    if method == "fp8":
        return {
            "quant_method": "fp8", "fmt": "e4m3", "weight_block_size": list(FP8_BLOCK),
            "activation_scheme": "dynamic", "modules_to_not_convert": excluded,
        }, None  # fmt: skip
    settings = {
        "quant_algo": "NVFP4", "kv_cache_quant_algo": None, "group_size": GROUP_SIZE, "exclude_modules": excluded,
    }  # fmt: skip
    producer = {"name": "atlas.quantize", "version": __version__}
    return {"quant_method": "modelopt", **settings}, {"producer": producer, "quantization": settings}


def write_configs(source: Path, target: Path, method: str, excluded: list[str]) -> None:
    from .config import read_json_object

    config = read_json_object(source / "config.json")
    quantization_config, hf_quant_config = quant_configs(method, excluded)
    config["quantization_config"] = quantization_config
    (target / "config.json").write_text(json.dumps(config, indent=2) + "\n", encoding="utf-8")
    if hf_quant_config is not None:
        (target / "hf_quant_config.json").write_text(json.dumps(hf_quant_config, indent=2) + "\n", encoding="utf-8")
    for path in sorted(source.iterdir()):
        if path.is_file() and path.name not in SKIPPED_FILES and path.suffix not in (*WEIGHT_FILES, ".py", ".pyc"):
            shutil.copyfile(path, target / path.name)


def check_source(source: Path) -> None:
    """What atlas.run would refuse in the source's config and weights refuses the conversion, before
    anything is written: the config, the tensors' names, shapes and dtypes. (The tokenizer files are
    copied as they are: a weights-only directory converts too.)"""
    from .config import load_spec
    from .models import check_checkpoint
    from .models.qwen3_5_moe_mtp import check_mtp_head
    from .quant.scheme import read_scheme
    from .safetensors import Checkpoint

    spec = load_spec(source)
    method = read_scheme(source).method
    if method != "bf16":
        raise AtlasError(f"{source} is already quantized ({method}); --model must be a bf16 checkpoint")
    checkpoint = Checkpoint.open(source)
    check_checkpoint(spec, checkpoint)
    check_mtp_head(spec, checkpoint)
    scales = [n for n in checkpoint.names() if n.endswith(QUANTIZED_SUFFIXES)]
    if scales:
        raise AtlasError(f"{source} holds {scales[0]!r}, a quantized checkpoint's scale, beside bf16 weights; "
                         "--model must be a plain bf16 checkpoint")


def quantize(args: QuantizeArgs) -> Path:
    """Write the quantized checkpoint to args.out atomically; returns it."""
    from .resolve import expand_user, resolve_model

    source = resolve_model(args.model)
    check_source(source)
    out = expand_user(str(args.out), "--out").absolute()
    check_out(out)
    try:
        staging = Path(tempfile.mkdtemp(prefix=f".{out.name}.", suffix=".partial", dir=out.parent))
    except OSError as err:
        raise write_error(out, err) from None
    try:
        with termination_as_exit():
            excluded = write_weights(source, staging, args)
            write_configs(source, staging, args.method, excluded)
            staging.chmod(0o755)
            os.rename(staging, out)
    except BaseException as err:
        shutil.rmtree(staging, ignore_errors=True)
        if isinstance(err, OSError):
            raise write_error(out, err) from None
        raise
    return out


def write_error(out: Path, err: OSError) -> AtlasError:
    """A full disk or a read-only place: one line, not a traceback."""
    full = err.errno in NO_ROOM_ERRNOS
    return AtlasError(f"cannot write --out {out} ({err.strerror or err}); "
                      f"{'free some space or ' if full else ''}choose another directory")


MODEL_HELP = "bf16 checkpoint: a directory, an HF repo id in the cache, a registry name (default: the demo)."


@click.command(context_settings={"help_option_names": ["-h", "--help"]})
@click.option("--model", default=None, help=MODEL_HELP)
@click.option("--to", "method", type=click.Choice(METHODS), required=True, help="Target format.")
@click.option("--out", required=True, help="Output directory (must not exist).")
@click.option("--shard-mb", type=click.IntRange(min=1), default=4096, show_default=True, help="Largest shard (MiB).")
def command(model: str | None, method: str, out: str, shard_mb: int) -> None:
    """Quantize a bf16 checkpoint to block FP8 or ModelOpt NVFP4."""
    if not out.strip():  # Path("") would be the current directory
        raise AtlasError("--out is empty; give the directory to write (it must not exist)")
    written = quantize(QuantizeArgs(model, method, Path(out), shard_mb * 1024**2))
    click.echo(f"atlas.quantize: wrote {written}", err=True)


def main(argv: list[str] | None = None, usage: str | None = None) -> int:
    """Entry point; returns the exit code."""
    return run_command(command, argv, "atlas.quantize", usage=usage)


if __name__ == "__main__":
    sys.exit(main())
