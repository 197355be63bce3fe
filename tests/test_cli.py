"""python -m atlas.run: end to end on a random tiny checkpoint (real engine, transformers as the
oracle), and exit code 2 with one stderr line for every bad flag or bad model."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from atlas.run import main
from _conditioning import draw_conditioned
from runtime_checkpoint import fresh_tiny_checkpoint, train_tokenizer

REPO = Path(__file__).resolve().parent.parent


def run_cli(*args: str, stdin: str = "") -> subprocess.CompletedProcess[str]:
    """atlas.run's exit code and output as written: decoded from bytes, since text mode would turn a
    generated "\r" into "\n" (a random model's tokens can decode to one)."""
    env = {**os.environ, "PYTHONPATH": str(REPO / "python"), "PYTHONIOENCODING": "utf-8"}
    done = subprocess.run([sys.executable, "-m", "atlas.run", *args], capture_output=True, env=env, timeout=300,
                          input=stdin.encode("utf-8"))
    return subprocess.CompletedProcess(done.args, done.returncode, done.stdout.decode("utf-8"), done.stderr.decode("utf-8"))


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return fresh_tiny_checkpoint(tmp_path_factory.mktemp("tiny"))


@pytest.mark.oracle
def test_streams_transformers_greedy_text(tiny_dir: Path, rng: np.random.Generator) -> None:
    from atlas.tokenizer import Tokenizer

    tokenizer = Tokenizer.open(tiny_dir)

    def draw() -> tuple[str, list[int]]:
        prompt = " ".join(rng.choice(["Simple", "is", "better", "than", "complex", "naïve", "世界"], size=4))
        return prompt, tokenizer.encode(prompt)

    prompt, greedy_ids = draw_conditioned(tiny_dir, draw, 12)
    prompt_ids = tokenizer.encode(prompt)
    done = run_cli("--model", str(tiny_dir), "--prompt", prompt, "--max-tokens", "12", "--device", "cpu")
    assert done.returncode == 0, done.stderr
    expected = tokenizer.decode(greedy_ids)
    assert done.stdout == expected + "\n"
    stats = done.stderr.strip().splitlines()[-1]
    assert f"prompt {len(prompt_ids)} tokens" in stats
    assert "prefill" in stats and "decode" in stats and "tok/s" in stats and "device cpu" in stats
    assert "Traceback" not in done.stderr


def test_sampling_flags_and_seed(tiny_dir: Path, rng: np.random.Generator) -> None:
    seed = str(int(rng.integers(0, 2**31)))
    args = ["--model", str(tiny_dir), "--prompt", "Flat is", "--max-tokens", "8", "--device", "cpu",
            "--temperature", "0.9", "--top-k", "20", "--top-p", "0.9", "--seed", seed]  # fmt: skip
    first, second = run_cli(*args), run_cli(*args)
    assert first.returncode == 0, first.stderr
    assert first.stdout == second.stdout


def test_top_k_minus_one_is_off_as_zero(capsys: pytest.CaptureFixture[str], rng: np.random.Generator) -> None:
    """vLLM's top_k -1 (off) is accepted beside 0 and samples exactly as 0 does with the same seed."""
    seed = str(int(rng.integers(0, 2**31)))
    capsys.readouterr()  # the rng fixture's seed line
    outputs = []
    for top_k in ("-1", "0"):
        assert main(["--prompt", "Flat is", "--max-tokens", "12", "--device", "cpu", "--temperature", "1.5",
                     "--seed", seed, "--top-k", top_k]) == 0
        outputs.append(capsys.readouterr().out)
    assert outputs[0] == outputs[1] and outputs[0].strip()


def test_logit_bias_flag(capsys: pytest.CaptureFixture[str], rng: np.random.Generator) -> None:
    """--logit-bias ID=BIAS, repeated: the last value of an id wins; the output is LLM.generate's."""
    from atlas.llm import LLM

    llm = LLM(device="cpu")
    ends = llm.eos_ids()  # a favoured end token would stop the text after one token
    token, banned = (int(t) for t in rng.choice([t for t in range(512) if t not in ends], 2, replace=False))
    flags = ["--logit-bias", f"{token}=-5", "--logit-bias", f"{banned}=-100", "--logit-bias", f"{token}=100"]
    capsys.readouterr()  # the rng fixture's seed line
    assert main(["--prompt", "Flat is", "--max-tokens", "4", "--device", "cpu", *flags]) == 0
    expected = llm.generate("Flat is", max_tokens=4, logit_bias={token: 100, banned: -100})
    assert expected.token_ids == [token] * 4
    assert capsys.readouterr().out == expected.text + "\n"


def test_llama_cpp_sampler_flags(capsys: pytest.CaptureFixture[str], rng: np.random.Generator) -> None:
    """--typical, --top-nsigma, --xtc-probability and --xtc-threshold: the text is LLM.generate's with
    the same settings; --top-nsigma near 0 leaves the most likely token alone: the greedy text."""
    from atlas.llm import LLM

    llm, seed = LLM(device="cpu"), int(rng.integers(0, 2**31))
    settings = {"typical_p": float(rng.uniform(0.3, 0.9)), "top_n_sigma": float(rng.uniform(1, 4)),
                "xtc_probability": 1.0, "xtc_threshold": float(rng.uniform(0.05, 0.3))}
    flags = ["--typical", str(settings["typical_p"]), "--top-nsigma", str(settings["top_n_sigma"]),
             "--xtc-probability", "1", "--xtc-threshold", str(settings["xtc_threshold"])]
    base = ["--prompt", "Flat is", "--max-tokens", "12", "--device", "cpu", "--temp", "1.3", "--seed", str(seed)]
    capsys.readouterr()  # the rng fixture's seed line
    assert main([*base, *flags]) == 0
    expected = llm.generate("Flat is", max_tokens=12, temperature=1.3, seed=seed, **settings)
    assert capsys.readouterr().out == expected.text + "\n"
    assert main([*base, "--top-nsigma", "1e-9"]) == 0
    assert capsys.readouterr().out == llm.generate("Flat is", max_tokens=12).text + "\n"
    assert main([*base, "--mirostat", "2", "--mirostat-ent", "3", "--mirostat-lr", "0.2"]) == 0
    want = llm.generate("Flat is", max_tokens=12, temperature=1.3, seed=seed, mirostat=2, mirostat_tau=3.0, mirostat_eta=0.2)
    assert capsys.readouterr().out == want.text + "\n"
    assert main([*base, "--dynatemp-range", "0.7", "--dynatemp-exp", "1.5"]) == 0
    want = llm.generate("Flat is", max_tokens=12, temperature=1.3, seed=seed, dynatemp_range=0.7, dynatemp_exponent=1.5)
    assert capsys.readouterr().out == want.text + "\n"
    from test_sampling_filters import ZEN_TWICE

    dry = {"dry_multiplier": 2.0, "dry_base": 1.5, "dry_allowed_length": int(rng.integers(1, 4)), "dry_penalty_last_n": 100}
    for breakers, flags in (((":",), ["--dry-sequence-breaker", ":"]), ((), ["--dry-sequence-breaker", "none"])):
        assert main(["--prompt", ZEN_TWICE, "--max-tokens", "10", "--device", "cpu", "--ignore-eos", *flags,
                     *[arg for name, value in dry.items() for arg in (f"--{name.replace('_', '-')}", str(value))]]) == 0
        expected = llm.generate(ZEN_TWICE, max_tokens=10, ignore_eos=True, dry_sequence_breakers=list(breakers), **dry)
        assert capsys.readouterr().out == expected.text + "\n"


def test_json_object_flag(capsys: pytest.CaptureFixture[str]) -> None:
    from atlas.llm import LLM

    capsys.readouterr()
    assert main(["--prompt", "Flat is", "--max-tokens", "30", "--device", "cpu", "--json-object", "--temperature", "1",
                 "--seed", "3"]) == 0
    expected = LLM(device="cpu").generate("Flat is", max_tokens=30, json_object=True, temperature=1.0, seed=3)
    assert expected.text.startswith("{")
    assert capsys.readouterr().out == expected.text + "\n"


@pytest.mark.parametrize("inline", [False, True])
def test_json_schema_flag(tmp_path: Path, capsys: pytest.CaptureFixture[str], inline: bool) -> None:
    """--json-schema takes a file or the schema's text; the output is what LLM gives with it."""
    from atlas.llm import LLM

    schema = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 9}}, "required": ["n"]}
    path = tmp_path / "schema.json"
    path.write_text(json.dumps(schema))
    capsys.readouterr()
    assert main(["--prompt", "Flat is", "--max-tokens", "30", "--device", "cpu",
                 "--json-schema", json.dumps(schema) if inline else str(path)]) == 0
    expected = LLM(device="cpu").generate("Flat is", max_tokens=30, json_schema=schema)
    assert expected.text.startswith('{"n"') or expected.text.startswith("{\n")
    assert capsys.readouterr().out == expected.text + "\n"


@pytest.mark.parametrize("flags", [["--choice", "better", "--choice", "worse"], ["--regex", "[a-z]{2,6}!"]])
def test_regex_and_choice_flags(capsys: pytest.CaptureFixture[str], flags: list[str]) -> None:
    import re

    from atlas.llm import LLM

    capsys.readouterr()
    assert main(["--prompt", "Flat is", "--max-tokens", "12", "--device", "cpu", *flags]) == 0
    option = {"choice": ["better", "worse"]} if flags[0] == "--choice" else {"regex": flags[1]}
    expected = LLM(device="cpu").generate("Flat is", max_tokens=12, **option)
    assert expected.text in ("better", "worse") or re.fullmatch("[a-z]{2,6}!", expected.text)
    assert capsys.readouterr().out == expected.text + "\n"


@pytest.mark.parametrize(("value", "needle"), [
    ('{"type": "string", "pattern": "(?=a)"}', "lookaround is not supported"),
    ("{not json", "is not JSON"),
    ("/nonexistent/schema.json", "cannot be read"),
])
def test_bad_json_schema_flag(capsys: pytest.CaptureFixture[str], value: str, needle: str) -> None:
    assert main(["--prompt", "Flat is", "--device", "cpu", "--json-schema", value]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and needle in err[0], err


@pytest.mark.parametrize(("flags", "needle"), [
    (["--regex", "(?=a)"], "lookaround is not supported"),
    (["--regex", "a", "--choice", "a"], "exclude each other"),
    (["--json-object", "--choice", "a"], "exclude each other"),
])
def test_bad_output_format_flags(capsys: pytest.CaptureFixture[str], flags: list[str], needle: str) -> None:
    assert main(["--prompt", "Flat is", "--device", "cpu", *flags]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and needle in err[0], err


def test_chat_flag_uses_the_template(tiny_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from atlas.llm import LLM

    assert main(["--model", str(tiny_dir), "--prompt", "hi", "--max-tokens", "5", "--chat", "--device", "cpu"]) == 0
    out = capsys.readouterr()
    expected = LLM(str(tiny_dir), device="cpu").generate("hi", max_tokens=5, chat=True)
    assert out.out == expected.text + "\n"
    assert f"prompt {expected.prompt_tokens} tokens" in out.err


def test_system_message_and_stop_strings(capsys: pytest.CaptureFixture[str], rng: np.random.Generator) -> None:
    """--system opens the chat before the prompt's user message; --stop strings end the text (not
    written); --system without a chat is one line."""
    from atlas.llm import LLM

    llm = LLM(device="cpu")
    messages = [{"role": "system", "content": "Zen only."}, {"role": "user", "content": "Flat is"}]
    capsys.readouterr()  # the fixtures' own lines
    assert main(["--prompt", "Flat is", "--max-tokens", "8", "--chat", "--system", "Zen only.", "--device", "cpu"]) == 0
    out = capsys.readouterr()
    want = llm.generate(llm.tokenizer.encode_chat(messages), max_tokens=8)
    assert out.out == want.text + "\n" and f"prompt {want.prompt_tokens} tokens" in out.err
    full = llm.generate("Beautiful is better than", max_tokens=20).text
    stop = full.split()[int(rng.integers(1, len(full.split())))]
    assert main(["--prompt", "Beautiful is better than", "--max-tokens", "20", "--stop", "\x01never", "--stop", stop,
                 "--device", "cpu"]) == 0
    assert capsys.readouterr().out == full[: full.index(stop)] + "\n"
    line = one_error_line(main(["--prompt", "x", "--system", "Zen.", "--device", "cpu"]), capsys.readouterr().err)
    assert "--system" in line and "--chat or --interactive" in line
    assert "--stop needs a non-empty string" in one_error_line(main(["--stop", "", "--device", "cpu"]), capsys.readouterr().err)


def one_error_line(code: int, err: str) -> str:
    assert code == 2
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1, err
    assert lines[0].startswith("atlas.run: error:")
    return lines[0]


@pytest.mark.parametrize(
    ("flags", "needle"),
    [
        (["--top-p", "0"], "--top-p"),
        (["--top-p", "1.5"], "--top-p"),
        (["--temperature", "-1"], "--temperature"),
        (["--max-tokens", "0"], "--max-tokens"),
        (["--top-k", "-3"], "--top-k"),
        (["--seed", "abc"], "--seed"),
        (["--seed", "-1", "--temperature", "0.5"], "--seed"),
        (["--device", "tpu"], "--device"),
        (["--no-such-flag"], "--no-such-flag"),
        (["--prompt"], "--prompt"),
        (["--prompt", "Flat \udcff", "--device", "cpu"], "--prompt: not UTF-8 text (byte 0xff"),  # argv bytes that are not UTF-8
        (["--spec-k", "2", "--no-spec"], "--no-spec"),
        (["--kv-high-precision-layers", "few"], "--kv-high-precision-layers"),
        (["--max-seq-len", "0"], "--max-seq-len"),
        (["--presence-penalty", "3"], "--presence-penalty"),
        (["--repetition-penalty", "0"], "--repetition-penalty"),
        (["--min-p", "1.5"], "--min-p"),
        (["--reasoning-budget", "-2"], "--reasoning-budget"),
        (["--typical", "0"], "--typical"),
        (["--dry-multiplier", "-1"], "--dry-multiplier"),
        (["--mirostat", "3"], "--mirostat"),
        (["--dynatemp-range", "-1"], "--dynatemp-range"),
        (["--mirostat-ent", "-1"], "--mirostat-ent"),
        (["--dry-base", "0.5"], "--dry-base"),
        (["--dry-allowed-length", "x"], "--dry-allowed-length"),
        (["--dry-penalty-last-n", "-3"], "--dry-penalty-last-n"),
        (["--dry-multiplier", "1", "--dry-sequence-breaker", "", "--device", "cpu"], "dry_sequence_breakers must be"),
        (["--xtc-probability", "2"], "--xtc-probability"),
        (["--xtc-threshold", "-0.5"], "--xtc-threshold"),
        (["--top-nsigma", "nan", "--temp", "1", "--device", "cpu"], "top_n_sigma must be a finite number"),
        (["--logit-bias", "7"], "--logit-bias"),
        (["--logit-bias", "7=1000", "--device", "cpu"], "logit_bias of token 7 must be a number in [-100, 100]"),
        (["--logit-bias", "600=1", "--device", "cpu"], "logit_bias token id 600 is outside the vocabulary"),
        (["--max-seq-len", "2049", "--device", "cpu"], "max_seq_len 2049 exceeds the model's context of 2048"),
        (["--prompt-cache-ro"], "go with --prompt-cache FILE"),
        (["--prompt-cache", "/no/such/dir/p.seq"], "--prompt-cache /no/such/dir/p.seq: not a file"),
        (["--prompt-cache", "p.seq", "--interactive"], "--interactive"),
        (["--prompt-cache", "p.seq", "--prompt-cache-all", "--prompt-cache-ro"], "--prompt-cache-all"),
        (["--hf-overrides", "{rope", "--device", "cpu"], "--hf-overrides is not JSON (Expecting property name"),
        (["--hf-overrides", "[1]", "--device", "cpu"], "--hf-overrides must be a JSON object"),
        (["--hf-overrides", '{"rope_parameters": {"rope_type": "longrope"}}', "--device", "cpu"],
         "config.json (with --hf-overrides): field 'rope_parameters.rope_type' is 'longrope'"),
    ],
)
def test_bad_flags(flags: list[str], needle: str, capsys: pytest.CaptureFixture[str]) -> None:
    code = main(flags)
    assert needle in one_error_line(code, capsys.readouterr().err)


def test_max_model_len_is_vllms_name_for_max_seq_len(capsys: pytest.CaptureFixture[str]) -> None:
    code = main(["--max-model-len", "8", "--max-tokens", "20", "--device", "cpu"])
    last = capsys.readouterr().err.strip().splitlines()[-1]
    assert code == 2 and "needs 23 positions but this model holds 8" in last, last


@pytest.mark.parametrize(("given", "held"), [("1k", 1000), ("1K", 1024), ("1.5k", 1500), ("auto", 2048), ("-1", 2048),
                                             ("2048", 2048)])
def test_max_model_len_as_vllm_writes_it(given: str, held: int, capsys: pytest.CaptureFixture[str]) -> None:
    """32k / 32K / -1 / auto, as vLLM reads --max-model-len (the demo's context is 2048)."""
    code = main(["--max-model-len", given, "--max-tokens", "5000", "--device", "cpu"])
    last = capsys.readouterr().err.strip().splitlines()[-1]
    assert code == 2 and f"this model holds {held}" in last, last
    for bad in ("12q", "infk", "nank", "0.0001k", "-2"):
        assert "not a context length" in one_error_line(main(["--max-model-len", bad]), capsys.readouterr().err), bad


YARN_OVERRIDES = '{"rope_parameters": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 2048}}'


def test_hf_overrides_stretch_the_context_with_yarn(capsys: pytest.CaptureFixture[str]) -> None:
    """vLLM's --hf-overrides merged into config.json: YaRN x4 on the demo's 2048 positions holds 8192."""
    code = main(["--hf-overrides", YARN_OVERRIDES, "--max-model-len", "auto", "--max-tokens", "9000", "--device", "cpu"])
    last = capsys.readouterr().err.strip().splitlines()[-1]
    assert code == 2 and "this model holds 8192" in last, last
    code = main(["--hf-overrides", YARN_OVERRIDES, "--max-seq-len", "3000", "--max-tokens", "4", "--device", "cpu"])
    assert code == 0, capsys.readouterr().err


def test_bad_models(tmp_path: Path, tiny_dir: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    assert "hf download Nobody/Nothing" in one_error_line(main(["--model", "Nobody/Nothing", "--prompt", "x"]), capsys.readouterr().err)
    assert "--prompt is required" in one_error_line(main(["--model", str(tiny_dir)]), capsys.readouterr().err)

    broken = tmp_path / "broken"
    broken.mkdir()
    config = json.loads((tiny_dir / "config.json").read_text())
    (broken / "config.json").write_text(json.dumps({**config, "num_experts": "eight"}))
    line = one_error_line(main(["--model", str(broken), "--prompt", "x"]), capsys.readouterr().err)
    assert "'num_experts'" in line and "config.json" in line

    no_template = tmp_path / "no_template"
    no_template.mkdir()
    for name in ("config.json", "generation_config.json", "model.safetensors"):
        (no_template / name).write_bytes((tiny_dir / name).read_bytes())
    train_tokenizer(no_template, chat_template=None)
    line = one_error_line(main(["--model", str(no_template), "--prompt", "x", "--chat", "--device", "cpu"]), capsys.readouterr().err)
    assert "no chat template" in line

    (no_template / "chat_template.jinja").write_text("{% for m in messages %}{{ m.content | int + [] }}{% endfor %}")
    line = one_error_line(main(["--model", str(no_template), "--prompt", "x", "--chat", "--device", "cpu"]), capsys.readouterr().err)
    assert "chat_template.jinja" in line and "TypeError" in line
    (no_template / "chat_template.jinja").write_text("{% for m in messages %}{{ m.content }}")
    line = one_error_line(main(["--model", str(no_template), "--prompt", "x", "--chat", "--device", "cpu"]), capsys.readouterr().err)
    assert "chat_template.jinja" in line and "not valid jinja" in line


def test_truncated_weights_exit_2_without_traceback(tmp_path: Path, tiny_dir: Path) -> None:
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        (tmp_path / name).write_bytes((tiny_dir / name).read_bytes())
    weights = (tiny_dir / "model.safetensors").read_bytes()
    (tmp_path / "model.safetensors").write_bytes(weights[: len(weights) // 2])
    done = run_cli("--model", str(tmp_path), "--prompt", "x", "--device", "cpu")
    line = one_error_line(done.returncode, done.stderr)
    assert "past the end" in line and "model.safetensors" in line
    assert done.stdout == ""


@pytest.mark.parametrize("damage", ["shape", "missing"])
def test_checkpoint_not_matching_config(tmp_path: Path, tiny_dir: Path, damage: str, rng: np.random.Generator, capsys: pytest.CaptureFixture[str]) -> None:
    from safetensors.numpy import load_file, save_file

    for name in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        (tmp_path / name).write_bytes((tiny_dir / name).read_bytes())
    tensors = load_file(str(tiny_dir / "model.safetensors"))
    victim = str(rng.choice(sorted(n for n in tensors if ".layers." in n)))
    if damage == "shape":
        tensors[victim] = np.zeros((*tensors[victim].shape, 2), dtype=tensors[victim].dtype)
    else:
        del tensors[victim]
    save_file(tensors, str(tmp_path / "model.safetensors"))
    line = one_error_line(main(["--model", str(tmp_path), "--prompt", "x", "--device", "cpu"]), capsys.readouterr().err)
    assert repr(victim) in line and "model.safetensors" in line


def test_interactive_conversation(rng: np.random.Generator) -> None:
    """Each stdin line is a turn of one conversation rendered by the chat template; the replies are
    what the Python API gives for the same conversation; later turns resume from the prompt cache;
    /reset forgets, /exit leaves."""
    from atlas import LLM
    from atlas.demo import zen_of_python

    lines = [line for line in zen_of_python().splitlines() if line.strip()]
    turns = [" ".join(lines[int(rng.integers(len(lines)))].split()[:3]) for _ in range(3)]
    system = rng.random() < 0.5
    done = run_cli("--interactive", "--max-tokens", "10", *(["--system", "Zen."] if system else []),
                   stdin=f"{turns[0]}\n{turns[1]}\n/reset\n{turns[2]}\n/exit\nnever\n")
    assert done.returncode == 0, done.stderr
    opening = [{"role": "system", "content": "Zen."}] if system else []  # --system stays through /reset
    llm, messages, want = LLM(device="cpu"), list(opening), []
    for i, turn in enumerate(turns):
        messages = list(opening) if i == 2 else messages  # /reset before the third
        messages.append({"role": "user", "content": turn})
        result = llm.generate(llm.tokenizer.encode_chat(messages), max_tokens=10)
        messages.append({"role": "assistant", "content": result.text})
        want.append(result.text)
    assert done.stdout == "".join(text + "\n" for text in want)
    stats = [line for line in done.stderr.splitlines() if "prefill" in line]
    assert len(stats) == 3 and "cached" in stats[1] and "never" not in done.stdout


@pytest.mark.parametrize("max_tokens", [10, None])
def test_interactive_conversation_drops_its_oldest_turns_to_fit(rng: np.random.Generator, capsys: pytest.CaptureFixture[str],
                                                                max_tokens: int | None) -> None:
    """In a 64-position context, turn after turn: each is answered (none refused), the oldest turns
    go first (the system message stays), each reply is what the model gives for the kept
    conversation, and stderr says how many turns were left out. max_tokens None (-n -1): room is
    kept for a reply of half the context, which may run to its end."""
    from atlas import LLM
    from atlas.chat import Conversation
    from atlas.demo import zen_of_python
    from atlas.errors import AtlasError
    from atlas.llm import generate_options

    lines = [line for line in zen_of_python().splitlines() if line.strip()]
    llm = LLM(device="cpu", max_seq_len=64)
    conversation = Conversation(llm, generate_options(max_tokens=max_tokens), [{"role": "system", "content": "Zen."}])
    reference = LLM(device="cpu")
    for _ in range(6):
        turn = " ".join(lines[int(rng.integers(len(lines)))].split()[:4])
        result = conversation.turn(turn, lambda text: None)
        kept = conversation.messages[:-1]
        assert kept[0] == {"role": "system", "content": "Zen."} and kept[-1] == {"role": "user", "content": turn}
        prompt = reference.tokenizer.encode_chat(kept)
        alone = sum(m["role"] == "user" for m in kept) == 1  # under None, a long turn alone gets what room is left
        assert len(prompt) + (max_tokens or 32) - 1 <= 64 or (max_tokens is None and alone and len(prompt) < 64)
        assert result.text == reference.generate(prompt, max_tokens=max_tokens or 64 - len(prompt) + 1).text
    assert sum(m["role"] == "user" for m in conversation.messages) < 6
    assert "turn(s) are left out" in capsys.readouterr().err
    before = list(conversation.messages)
    with pytest.raises(AtlasError, match="shorten the prompt"):  # a turn too long alone: refused, nothing left out
        conversation.turn(" ".join(lines), lambda text: None)
    assert conversation.messages == before and "left out" not in capsys.readouterr().err


def test_interactive_long_turn_under_no_max_tokens_drops_every_older_turn() -> None:
    """-n -1 keeps room for a reply of half the context; a new turn that leaves less (but fits)
    is answered alone, every older turn left out, instead of sent with them past the context."""
    from atlas import LLM
    from atlas.chat import Conversation
    from atlas.llm import generate_options

    llm = LLM(device="cpu", max_seq_len=64)
    conversation = Conversation(llm, generate_options(max_tokens=None), [{"role": "system", "content": "Zen."}])
    conversation.turn("Flat is", lambda text: None)
    long_turn = "Although practicality beats purity."
    alone = len(llm.tokenizer.encode_chat([*conversation.messages[:1], {"role": "user", "content": long_turn}]))
    assert 33 < alone < 64  # past the room for a 32-token reply, within the context
    result = conversation.turn(long_turn, lambda text: None)
    assert [m["role"] for m in conversation.messages] == ["system", "user", "assistant"]
    assert result.token_ids and alone + len(result.token_ids) <= 65


def test_interactive_needs_a_chat_template(tiny_dir: Path) -> None:
    import shutil

    plain = tiny_dir.parent / "no-template"
    if not plain.exists():
        shutil.copytree(tiny_dir, plain)
        config = json.loads((plain / "tokenizer_config.json").read_text())
        config.pop("chat_template", None)
        (plain / "tokenizer_config.json").write_text(json.dumps(config))
        (plain / "chat_template.jinja").unlink(missing_ok=True)
    done = run_cli("--model", str(plain), "--interactive")
    assert done.returncode == 2 and "no chat template" in done.stderr and len(done.stderr.strip().splitlines()) == 1


def test_chat_template_override(tmp_path: Path) -> None:
    """--chat-template replaces the model's template (the prompt it renders is what runs); a
    missing or broken file is one line, exit 2, before the weights load."""
    template = tmp_path / "plain.jinja"
    template.write_text("{% for m in messages %}{{ m.content }}{% endfor %}", encoding="utf-8")
    done = run_cli("--chat", "--prompt", "Beautiful is better than", "--chat-template", str(template), "--max-tokens", "8")
    assert done.returncode == 0, done.stderr
    from atlas import LLM

    assert done.stdout == LLM(device="cpu").generate("Beautiful is better than", max_tokens=8).text + "\n"
    broken = tmp_path / "broken.jinja"
    broken.write_text("{% for m in messages %}", encoding="utf-8")
    for path, needle in ((tmp_path / "missing.jinja", "cannot be read"), (broken, "not valid jinja")):
        done = run_cli("--chat", "--chat-template", str(path))
        assert done.returncode == 2 and needle in done.stderr and len(done.stderr.strip().splitlines()) == 1, done.stderr


def test_chat_template_kwargs(tmp_path: Path) -> None:
    """--chat-template-kwargs sets template variables for every chat prompt; bad JSON is one line."""
    template = tmp_path / "thinking.jinja"
    template.write_text("{% for m in messages %}{{ m.content }}{% endfor %}{% if shout %}!{% endif %}", encoding="utf-8")
    done = run_cli("--chat", "--prompt", "Flat is", "--chat-template", str(template), "--max-tokens", "6",
                   "--chat-template-kwargs", '{"shout": true}')
    assert done.returncode == 0, done.stderr
    from atlas import LLM

    assert done.stdout == LLM(device="cpu").generate("Flat is!", max_tokens=6).text + "\n"
    for bad in ("{shout", '["shout"]', '{"messages": []}', '{"self": 1}'):
        done = run_cli("--chat", "--chat-template-kwargs", bad)
        assert done.returncode == 2 and "--chat-template-kwargs" in done.stderr, done.stderr


def test_reasoning_budget_flag(capsys: pytest.CaptureFixture[str], rng: np.random.Generator) -> None:
    """--reasoning-budget N: a prompt that opens a reasoning block gets LLM's text with that budget
    (the block closed after N tokens); -1 (the default) caps nothing."""
    from atlas.llm import LLM

    budget = int(rng.integers(0, 6))
    capsys.readouterr()
    for flag, cap in ((budget, budget), (-1, None)):
        assert main(["--prompt", "Flat is<think>\n", "--max-tokens", "16", "--device", "cpu",
                     "--reasoning-budget", str(flag)]) == 0
        expected = LLM(device="cpu").generate("Flat is<think>\n", max_tokens=16, thinking_token_budget=cap)
        assert capsys.readouterr().out == expected.text + "\n"
        assert ("</think>" in expected.text) == (cap is not None)


def test_prompt_file(tmp_path: Path) -> None:
    """--prompt-file reads the prompt (a file, or '-' for stdin) as --prompt would give it."""
    from atlas import LLM

    want = LLM(device="cpu").generate("Beautiful is better than", max_tokens=8).text + "\n"
    path = tmp_path / "prompt.txt"
    path.write_text("Beautiful is better than", encoding="utf-8")
    assert run_cli("--prompt-file", str(path), "--max-tokens", "8").stdout == want
    assert run_cli("--prompt-file", "-", "--max-tokens", "8", stdin="Beautiful is better than").stdout == want
    for args, needle in ((["--prompt-file", str(tmp_path / "missing.txt")], "cannot be read"),
                         (["--prompt-file", str(path), "--prompt", "x"], "exclude each other")):
        done = run_cli(*args)
        assert done.returncode == 2 and needle in done.stderr and len(done.stderr.strip().splitlines()) == 1


def test_prompt_cache_file(tmp_path: Path, capsys: pytest.CaptureFixture[str], rng: np.random.Generator) -> None:
    """--prompt-cache FILE (llama.cpp's): a run restores the state an earlier run saved of its prompt, so
    that prompt needs no pass and a longer one runs only its new tokens, writing the text a run without
    the file writes; -ro leaves the file as it is, -all saves the generated tokens' state too."""
    from atlas import LLM

    session, words = tmp_path / "prompt.seq", "Beautiful is better than"
    longer = f"{words} {rng.choice(['ugly', 'implicit', 'complex'])}"
    reference = LLM(device="cpu", prompt_cache=0)
    prompt_tokens = len(reference.tokenizer.encode(words))
    capsys.readouterr()  # the rng fixture's seed line

    def run(prompt: str, *flags: str) -> tuple[str, str]:
        assert main(["-p", prompt, "-n", "8", "--device", "cpu", "--prompt-cache", str(session), *flags]) == 0
        out, err = capsys.readouterr()
        assert out == reference.generate(prompt, max_tokens=8).text + "\n"
        return out, err

    assert f"{prompt_tokens} tokens saved" in run(words)[1] and session.is_file()
    _, err = run(words)
    assert f"{prompt_tokens} tokens restored" in err and f"({prompt_tokens} cached)" in err
    saved = session.read_bytes()
    _, err = run(longer, "--prompt-cache-ro")
    assert f"({prompt_tokens} cached)" in err and "saved" not in err and session.read_bytes() == saved
    _, err = run(words, "--prompt-cache-all")
    assert f"{prompt_tokens + 7} tokens saved" in err  # the last generated token is never fed
    session.write_bytes(rng.bytes(100))
    assert main(["-p", words, "--device", "cpu", "--prompt-cache", str(session)]) == 2
    assert "is not a saved sequence" in one_error_line(2, capsys.readouterr().err)


def test_llama_cpp_flag_names(capsys: pytest.CaptureFixture[str], rng: np.random.Generator) -> None:
    """llama.cpp's -m / -p / -n / --temp / -s / -c / --repeat-penalty / -sys name the same settings."""
    seed = str(int(rng.integers(0, 2**31 - 1)))
    ours = ["--model", "atlas-demo", "--prompt", "Flat is", "--max-tokens", "12", "--temperature", "50", "--seed", seed,
            "--max-seq-len", "64", "--repetition-penalty", "1.3", "--device", "cpu"]
    llama = ["-m", "atlas-demo", "-p", "Flat is", "-n", "12", "--temp", "50", "-s", seed, "-c", "64",
             "--repeat-penalty", "1.3", "--device", "cpu"]
    capsys.readouterr()
    texts = []
    for argv in (ours, llama, [*llama[:9], str(int(seed) + 1), *llama[10:]]):
        assert main(argv) == 0
        texts.append(capsys.readouterr().out)
    assert texts[0] == texts[1] and texts[0] != texts[2]  # near-uniform draws: another seed, another text
    code = main(["-p", "Flat is", "-n", "100", "-c", "64", "--device", "cpu"])
    assert code == 2 and "this model holds 64" in capsys.readouterr().err.strip().splitlines()[-1]


@pytest.mark.parametrize("partial", ["Beautiful is", "Beautiful is\n"])
def test_an_error_mid_reply_starts_its_own_line(partial: str, capsys: pytest.CaptureFixture[str],
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    """Text already streamed and then an error (a full dump disk, a GPU fault): the text ends its
    line before the error line, in a one-shot run and in a conversation turn, and no blank line
    is added after text that ended one."""
    from atlas.chat import reply
    from atlas.errors import AtlasError
    from atlas.llm import LLM

    def cut_short(self: object, prompt_ids: list[int], opts: object, on_text: object) -> None:
        on_text(partial)  # type: ignore[operator]
        raise AtlasError("the dump disk is full")

    monkeypatch.setattr(LLM, "generate_with", cut_short)
    code = main(["--prompt", "x", "--device", "cpu", "--max-tokens", "4"])
    out = capsys.readouterr()
    assert code == 2 and out.out == partial.removesuffix("\n") + "\n"
    assert out.err.splitlines()[-1] == "atlas.run: error: the dump disk is full"

    class Turn:
        def turn(self, text: str, on_text: object) -> None:
            cut_short(self, [], None, on_text)

    reply(Turn(), "x", str)  # type: ignore[arg-type]
    out = capsys.readouterr()
    assert out.out == partial.removesuffix("\n") + "\n" and out.err == "atlas: the dump disk is full\n"
