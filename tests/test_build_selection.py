"""Build selection, version labels, generated headers, instances, PTX facts, embedding literals."""

from __future__ import annotations

import ctypes
import random
import subprocess
import sys
from pathlib import Path

import pytest

from atlas.errors import AtlasError
from atlas.targets import load_registry
from build_tools import embed, headers, instances, ptx, selection
from build_tools.selection import Target

REPO = Path(__file__).resolve().parent.parent


def _tree(root: Path, rels: list[str]) -> Path:
    for rel in rels:
        (root / rel).mkdir(parents=True)
        (root / rel / "k.cu").write_text("// kernel\n")
    (root / "h200" / "atlas-demo" / "fp8").mkdir(parents=True)  # a directory without .cu is no tuple
    return root


@pytest.fixture
def tree(tmp_path: Path) -> Path:
    return _tree(tmp_path, ["h200/atlas-demo/bf16", "gb10/atlas-demo/bf16", "sm80/qwen3.6-35b-a3b/bf16",
                            "h200/qwen3.6-35b-a3b/nvfp4"])


def _select(tree: Path, detect: list[str] | None = None, **env: str):
    return selection.select(load_registry(), env, tree, detect=lambda: detect or [])


def test_existing_and_wildcards(tree: Path) -> None:
    assert len(_select(tree, ATLAS_TARGET_HW="*").targets) == 4
    assert _select(tree, ATLAS_TARGET_HW="h100").targets == (Target("h200", "atlas-demo", "bf16"), Target("h200", "qwen3.6-35b-a3b", "nvfp4"))
    got = _select(tree, ATLAS_TARGET_HW="h200,gb10", ATLAS_TARGET_QUANT="bf16", ATLAS_TARGET_MODEL="*").targets
    assert got == (Target("gb10", "atlas-demo", "bf16"), Target("h200", "atlas-demo", "bf16"))


@pytest.mark.parametrize(("var", "valid"), [("ATLAS_TARGET_HW", "gb10, h100, h200, sm80"),
                                             ("ATLAS_TARGET_MODEL", "qwen3.6-35b-a3b, atlas-demo"),
                                             ("ATLAS_TARGET_QUANT", "nvfp4, fp8, bf16")])
def test_unknown_name_lists_valid(tree: Path, var: str, valid: str) -> None:
    bogus = f"bogus{random.randint(0, 999)}"
    env = {"ATLAS_TARGET_HW": "*", var: f"{bogus}"}
    with pytest.raises(AtlasError) as err:
        _select(tree, **env)
    assert bogus in str(err.value) and valid in str(err.value)


def test_no_matching_tuple_lists_existing(tree: Path) -> None:
    with pytest.raises(AtlasError, match="h200/atlas-demo/bf16") as err:
        _select(tree, ATLAS_TARGET_HW="sm80", ATLAS_TARGET_QUANT="fp8")
    assert "matches no kernel tuple" in str(err.value)


def test_unset_hw_uses_visible_gpus(tree: Path) -> None:
    assert _select(tree, detect=["9.0"]).targets[0].hw == "h200"
    assert {t.hw for t in _select(tree, detect=["8.6"]).targets} == {"sm80"}
    cpu = _select(tree, detect=[])
    assert cpu.cpu_only and "CPU-only" in cpu.notes[0]
    assert _select(tree, detect=["7.0"]).cpu_only


def test_version_labels() -> None:
    assert selection.version_for([Target("gb10", "qwen3.6-35b-a3b", "nvfp4")]) == "0.1.0+gb10.qwen3.6.35b.a3b.nvfp4"
    assert selection.version_for([]) == "0.1.0+cpu"
    n = random.randint(2, 5)
    multi = selection.version_for([Target("h200", "atlas-demo", "bf16")] * (n - 1) + [Target("sm80", "atlas-demo", "bf16")])
    assert multi == f"0.1.0+multi{n}.h200.sm80"


class _Demo(ctypes.Structure):
    _fields_ = [("x", ctypes.c_void_p), ("n", ctypes.c_int32), ("s", ctypes.c_int64),
                ("u", ctypes.c_uint32), ("eps", ctypes.c_float)]


def test_params_header_layout_compiles(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import atlas.kernel_params as kp

    monkeypatch.setattr(kp, "ALL_PARAMS", (*kp.ALL_PARAMS, _Demo))
    text = headers.render_params()
    assert "struct _Demo {" in text and "int64_t s;" in text and "void* x;" in text
    assert f"static_assert(sizeof(_Demo) == {ctypes.sizeof(_Demo)}" in text
    (tmp_path / "p.cpp").write_text(text)
    subprocess.run(["g++", "-std=c++17", "-fsyntax-only", str(tmp_path / "p.cpp")], check=True)
    (tmp_path / "bad.cpp").write_text(text.replace(f"== {ctypes.sizeof(_Demo)}", f"== {ctypes.sizeof(_Demo) + 8}"))
    assert subprocess.run(["g++", "-std=c++17", "-fsyntax-only", str(tmp_path / "bad.cpp")], capture_output=True).returncode != 0


def test_tuple_header_has_every_constant() -> None:
    reg = load_registry()
    text = headers.render_tuple(reg, headers.TupleNames("gb10", "qwen3.6-35b-a3b", "nvfp4"))
    for key, value in reg.models["qwen3.6-35b-a3b"].constants.items():
        assert f"constexpr int {key} = {value};" in text
    assert "constexpr int sm = 121;" in text
    for macro in ("ATLAS_HW_GB10", "ATLAS_MODEL_QWEN3_6_35B_A3B", "ATLAS_QUANT_NVFP4"):
        assert f"#define {macro} 1" in text


def test_committed_instances_are_up_to_date() -> None:
    proc = subprocess.run([sys.executable, "-m", "build_tools.instances", "--check"], cwd=REPO, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_instances_render_and_remove_stale(tmp_path: Path) -> None:
    (tmp_path / "templates" / "fp8").mkdir(parents=True)
    (tmp_path / "templates" / "fp8" / "k.cu.j2").write_text("int h = {{ model.hidden_size }}; // {{ hw.name }} {{ quant.name }}\n")
    stale = tmp_path / "h200" / "atlas-demo" / "fp8" / "old.cu"
    stale.parent.mkdir(parents=True)
    stale.write_text(instances.MARKER + "fp8/old.cu.j2 ...\n")
    hand = stale.with_name("hand.cu")
    hand.write_text("// written by hand\n")
    run = lambda *a: subprocess.run([sys.executable, "-m", "build_tools.instances", "--kernels", str(tmp_path), *a],
                                    cwd=REPO, capture_output=True, text=True)
    assert run("--check").returncode == 1
    assert run().returncode == 0
    assert run("--check").returncode == 0
    assert not stale.exists() and hand.exists()
    text = (tmp_path / "gb10" / "qwen3.6-35b-a3b" / "fp8" / "k.cu").read_text()
    assert text.startswith(instances.MARKER) and "int h = 2048; // gb10 fp8" in text
    assert len(list(tmp_path.glob("*/*/fp8/k.cu"))) == 6



@pytest.mark.parametrize("rel, first_line", [("int4/k.cu.j2", ""), ("fp8/k.cu.j2", "{#- atlas-hardware: tpu9 -#}")])
def test_bad_templates_are_one_line_exit_2(tmp_path: Path, capsys: pytest.CaptureFixture[str], rel: str, first_line: str) -> None:
    template = tmp_path / "templates" / rel
    template.parent.mkdir(parents=True)
    template.write_text(f"{first_line}\nint x = {random.randint(1, 99)};\n")
    assert instances.main(["--kernels", str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"error: {template}") and "targets.toml" in err and "\n" not in err
    assert not list(tmp_path.glob("*/*/*/*.cu"))

PTX = """
.visible .entry atlas_a(
\t.param .align 8 .b8 atlas_a_param_0[40]
)
{ ret; }
.visible .entry atlas_b(
\t.param .u64 atlas_b_param_0,
\t.param .f32 atlas_b_param_1
)
{ ret; }
"""


def test_parse_entries_and_ptxas() -> None:
    entries = ptx.parse_entries(PTX)
    assert [e.name for e in entries] == ["atlas_a", "atlas_b"]
    assert entries[0].params == (ptx.EntryParam("b8", 8, 40),)
    assert [p.type for p in entries[1].params] == ["u64", "f32"]
    regs, spill = random.randint(8, 255), random.randint(1, 99)
    log = (f"ptxas info    : Compiling entry function 'atlas_a' for 'sm_90a'\n"
           f"ptxas info    : Function properties for atlas_a\n"
           f"    8 bytes stack frame, {spill} bytes spill stores, 4 bytes spill loads\n"
           f"ptxas info    : Used {regs} registers, used 1 barriers, 1024 bytes smem\n")
    (res,) = ptx.parse_ptxas(log)
    assert (res.entry, res.registers, res.shared_bytes, res.spill_stores, res.spill_loads) == ("atlas_a", regs, 1024, spill, 4)


def test_c_string_round_trip(tmp_path: Path) -> None:
    data = bytes(random.getrandbits(8) for _ in range(5000)) + b'"\\??=\n'
    src = tmp_path / "b.cpp"
    src.write_text(f"#include <cstdio>\nconst unsigned char d[{len(data) + 1}] =\n{embed.c_string(data)};\n"
                   f"int main() {{ fwrite(d, 1, {len(data)}, stdout); return d[{len(data)}]; }}\n")
    subprocess.run(["g++", "-std=c++17", str(src), "-o", str(tmp_path / "b")], check=True)
    assert subprocess.run([str(tmp_path / "b")], capture_output=True, check=True).stdout == data
