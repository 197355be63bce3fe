"""The embedded atlas-demo checkpoint: shipped files, targets.toml dims, recitation of the Zen.

Recitation is checked with transformers (the oracle, fp32 compute over the bf16 weights) and
through atlas' own `LLM` on the CPU.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import numpy as np
import pytest

from atlas.demo import DEMO_DIR, DEMO_PROMPT, zen_of_python

REPO = Path(__file__).resolve().parent.parent
SHIPPED = ("config.json", "generation_config.json", "model.safetensors", "tokenizer.json",
           "tokenizer_config.json", "README.md")
RECITED_CHARS = 300
SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")


def demo_config() -> dict:
    return json.loads((DEMO_DIR / "config.json").read_text())


def zen_lines() -> list[str]:
    return zen_of_python().split("\n")


@pytest.fixture(scope="module")
def oracle() -> tuple[object, object]:
    """transformers' tokenizer and model for the demo, fp32 compute."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    torch.set_num_threads(1)
    tokenizer = transformers.AutoTokenizer.from_pretrained(DEMO_DIR)
    model = transformers.AutoModelForCausalLM.from_pretrained(DEMO_DIR, dtype=torch.float32)
    return tokenizer, model.eval()


def greedy_continuation(oracle: tuple[object, object], prompt_ids: list[int]) -> tuple[str, int]:
    """(text, last token id) of transformers' greedy generation after the prompt."""
    import torch

    tokenizer, model = oracle
    budget = len(tokenizer(zen_of_python())["input_ids"]) + 8
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt_ids]), max_new_tokens=budget, do_sample=False)
    new_ids = out[0, len(prompt_ids) :].tolist()
    return tokenizer.decode(new_ids, skip_special_tokens=True), new_ids[-1]


def test_shipped_files_are_small_and_complete() -> None:
    sizes = {name: (DEMO_DIR / name).stat().st_size for name in SHIPPED}
    assert sum(sizes.values()) < 5 * 2**20, sizes
    assert (REPO / "scripts" / "train_demo.py").is_file()


def test_config_matches_targets_toml() -> None:
    with open(REPO / "targets.toml", "rb") as f:
        constants = tomllib.load(f)["models"]["atlas-demo"]["constants"]
    config = demo_config()
    assert config["model_type"] == "qwen3_5_moe_text"
    assert config["tie_word_embeddings"] is False
    for name, value in constants.items():
        if name == "rotary_dim":
            actual = int(config["head_dim"] * config["rope_parameters"]["partial_rotary_factor"])
        elif name == "full_attention_interval":
            expected = ["full_attention" if (i + 1) % value == 0 else "linear_attention"
                        for i in range(config["num_hidden_layers"])]
            assert config["layer_types"] == expected
            continue
        else:
            actual = config[name]
        assert actual == value, name
    for name in constants:
        assert name in config or name in ("rotary_dim", "full_attention_interval"), name


def test_weights_are_bf16_with_checked_dims() -> None:
    header = safetensors_header(DEMO_DIR / "model.safetensors")
    config = demo_config()
    assert {entry["dtype"] for entry in header.values()} == {"BF16"}
    assert header["model.embed_tokens.weight"]["shape"] == [config["vocab_size"], config["hidden_size"]]
    assert header["lm_head.weight"]["shape"] == [config["vocab_size"], config["hidden_size"]]
    assert header["model.layers.3.self_attn.q_proj.weight"]["shape"] == [2 * 4 * 64, 128]
    assert header["model.layers.0.linear_attn.in_proj_qkv.weight"]["shape"] == [2 * 2 * 64 + 4 * 64, 128]
    assert header["model.layers.0.mlp.gate.weight"]["shape"] == [8, 128]


def safetensors_header(path: Path) -> dict[str, dict]:
    with open(path, "rb") as f:
        length = int.from_bytes(f.read(8), "little")
        header = json.loads(f.read(length))
    header.pop("__metadata__", None)
    return header


def test_tokenizer_has_512_tokens_and_chatml(rng: np.random.Generator) -> None:
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(DEMO_DIR / "tokenizer.json"))
    assert tokenizer.get_vocab_size() == 512
    assert all(tokenizer.token_to_id(t) is not None for t in SPECIAL_TOKENS)
    settings = json.loads((DEMO_DIR / "tokenizer_config.json").read_text())
    assert settings["eos_token"] == "<|endoftext|>"
    assert "<|im_start|>" in settings["chat_template"]
    eos_ids = json.loads((DEMO_DIR / "generation_config.json").read_text())["eos_token_id"]
    assert tokenizer.token_to_id("<|endoftext|>") in eos_ids
    assert tokenizer.token_to_id("<|im_end|>") in eos_ids
    text = random_text(rng)
    assert tokenizer.decode(tokenizer.encode(text).ids) == text


def random_text(rng: np.random.Generator) -> str:
    """Words of the Zen shuffled, with random ASCII and some non-ASCII characters in between."""
    words = zen_of_python().split()
    picked = [str(w) for w in rng.choice(words, size=40)]
    noise = "".join(chr(c) for c in rng.integers(32, 127, size=30)) + "éü日本 \n\t"
    return " ".join(picked) + noise


@pytest.mark.oracle
def test_transformers_tokenizer_agrees_with_tokenizer_json(oracle, rng: np.random.Generator) -> None:
    from tokenizers import Tokenizer

    raw = Tokenizer.from_file(str(DEMO_DIR / "tokenizer.json"))
    tokenizer, _ = oracle
    for text in (zen_of_python(), random_text(rng)):
        assert tokenizer(text)["input_ids"] == raw.encode(text).ids


@pytest.mark.oracle
def test_transformers_recites_the_zen(oracle) -> None:
    tokenizer, _ = oracle
    zen = zen_of_python()
    text, last = greedy_continuation(oracle, tokenizer(DEMO_PROMPT)["input_ids"])
    recited = DEMO_PROMPT + text
    assert recited[:RECITED_CHARS] == zen[:RECITED_CHARS]
    assert recited == zen
    assert last == tokenizer.convert_tokens_to_ids("<|endoftext|>")


@pytest.mark.oracle
def test_transformers_recites_from_a_random_line(oracle, rng: np.random.Generator) -> None:
    """From the first words of any line (enough to tell it from the others), the rest follows."""
    tokenizer, _ = oracle
    lines = zen_lines()
    index = int(rng.integers(len(lines)))
    prompt = distinguishing_start(lines, index)
    rest = "\n".join(lines[index:])
    text, _ = greedy_continuation(oracle, tokenizer(prompt)["input_ids"])
    assert prompt + text == rest, prompt


def distinguishing_start(lines: list[str], index: int) -> str:
    words = lines[index].split(" ")
    for n in range(1, len(words)):
        start = " ".join(words[:n])
        if not any(line.startswith(start + " ") for i, line in enumerate(lines) if i != index):
            return start
    return " ".join(words[:-1])


@pytest.mark.oracle
def test_transformers_recites_after_chat_template(oracle) -> None:
    tokenizer, _ = oracle
    messages = [{"role": "user", "content": "Recite the Zen of Python."}]
    prompt = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert prompt == "<|im_start|>user\nRecite the Zen of Python.<|im_end|>\n<|im_start|>assistant\n"
    text, last = greedy_continuation(oracle, tokenizer(prompt)["input_ids"])
    assert text == zen_of_python()
    assert last == tokenizer.convert_tokens_to_ids("<|im_end|>")


def test_atlas_llm_recites_the_zen(rng: np.random.Generator) -> None:
    """Through atlas' own runtime on the numpy backend: the default model is the demo."""
    from atlas import LLM

    llm = LLM(device="cpu")
    zen = zen_of_python()
    recited = DEMO_PROMPT + llm.generate(DEMO_PROMPT, max_tokens=240, temperature=0.0).text
    assert recited[:RECITED_CHARS] == zen[:RECITED_CHARS]
    assert recited.startswith(zen)
    lines = zen_lines()
    index = int(rng.integers(len(lines)))
    prompt = distinguishing_start(lines, index)
    recited = prompt + llm.generate(prompt, max_tokens=240).text
    assert recited.startswith("\n".join(lines[index:])), prompt


@pytest.mark.gpu
def test_cuda_recites_the_zen() -> None:
    """The CUDA backend (bf16 weights, kernels specialised on the demo dims) recites it too.
    Skips without a GPU, fails under ATLAS_REQUIRE_GPU=1 (set by the device check)."""
    from atlas import LLM
    from atlas.errors import AtlasError

    required = os.environ.get("ATLAS_REQUIRE_GPU") == "1"
    if shutil.which("nvidia-smi") is None and not required:
        pytest.skip("no NVIDIA GPU (nvidia-smi not found)")
    try:
        llm = LLM(device="cuda")
    except AtlasError as err:
        if required:
            raise
        pytest.skip(f"no CUDA backend here: {err}")
    zen = zen_of_python()
    recited = DEMO_PROMPT + llm.generate(DEMO_PROMPT, max_tokens=240).text
    matched = next((i for i, (a, b) in enumerate(zip(recited, zen)) if a != b), len(zen))
    assert recited[:RECITED_CHARS] == zen[:RECITED_CHARS], f"first {matched} characters match"


def test_train_script_fails_cleanly_without_partial_files(tmp_path: Path) -> None:
    """Too few steps to learn the text: one error line, exit code 2, nothing written."""
    out = tmp_path / "demo"
    proc = subprocess.run(
        [sys.executable, str(REPO / "scripts" / "train_demo.py"), "--out", str(out), "--max-steps", "2"],
        capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.strip().splitlines()[-1].startswith("error: no exact recitation after 2 steps")
    assert "Traceback" not in proc.stderr
    assert list(tmp_path.iterdir()) == []
