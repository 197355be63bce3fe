"""Train the embedded atlas-demo model: a tiny qwen3_5_moe_text that recites The Zen of Python.

    python scripts/train_demo.py --out python/atlas/demo

Steps: train a 512-token byte-level BPE on the Zen plus a little English; build a
Qwen3_5MoeForCausalLM with the atlas-demo dimensions of targets.toml; train it on CPU (fixed seed)
until greedy decoding from "Beautiful is better than" reproduces the whole text and then eos, with
weights rounded to bf16; save in bf16, reload in fp32, check recitation with `generate`, and only
then move the files into --out.
"""

from __future__ import annotations

import argparse
import json
import math
import shutil
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
from tqdm import tqdm
from transformers import Qwen3_5MoeForCausalLM, Qwen3_5MoeTextConfig

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "python"))

from atlas.demo import DEMO_PROMPT, ZEN_TITLE, zen_of_python  # noqa: E402
from atlas.errors import AtlasError  # noqa: E402

VOCAB_SIZE = 512
EOS = "<|endoftext|>"
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
SPECIAL_TOKENS = [EOS, IM_START, IM_END]
# Qwen's own pre-tokenizer (transformers' Qwen3_5Tokenizer rebuilds exactly this pipeline), so
# tokenizer.json and transformers' AutoTokenizer split every text the same way.
QWEN_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}"
    r"| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
CHAT_USER_TURN = f"{IM_START}user\nRecite the Zen of Python.{IM_END}\n{IM_START}assistant\n"
SHIPPED_FILES = (
    "config.json",
    "generation_config.json",
    "model.safetensors",
    "tokenizer.json",
    "tokenizer_config.json",
    "README.md",
)

CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)

# General English so that prompts other than the Zen still split into sensible pieces.
ENGLISH = """\
The quick brown fox jumps over the lazy dog. A small model can only remember what it was shown,
so this one knows a single text by heart and little else. Hello, how are you today? I am fine,
thank you. What is your name? Where do you live? We went to the market in the morning and came
back home in the evening. The weather was warm and the sky was clear. People read books, write
letters, play music, cook dinner and talk with their friends. Numbers such as 0, 1, 2, 3, 4, 5,
6, 7, 8, 9, 10, 100 and 2026 appear in dates, prices and code. Computers run programs; programs
are written in languages like Python, C and Rust. A function takes arguments and returns a value.
Please explain the answer in simple words. Tell me a story about a cat and a dog who became
friends. The user asks a question and the assistant gives an answer. System: you are a helpful
assistant. Yes, no, maybe. This is the first line. That was the last one. It is what it is.
"""


@dataclass(frozen=True)
class TrainConfig:
    seed: int = 0
    threads: int = 1
    lr: float = 3e-3
    warmup_steps: int = 20
    max_steps: int = 1500
    check_every: int = 25
    min_margin: float = 5.0  # logit gap of the right token over the runner-up, at every position


@dataclass(frozen=True)
class Batch:
    """Right-padded training sequences; padding is harmless since every layer is causal."""

    input_ids: torch.Tensor  # [B, T]
    labels: torch.Tensor  # [B, T], -100 where no loss is taken
    checked: torch.Tensor  # [B, T-1] bool: next-token predictions that greedy recitation relies on


@dataclass
class TrainLog:
    steps: int = 0
    seconds: float = 0.0
    losses: list[tuple[int, float]] = field(default_factory=list)
    margins: list[tuple[int, float]] = field(default_factory=list)


def train_tokenizer(zen: str) -> Tokenizer:
    tokenizer = Tokenizer(models.BPE())
    tokenizer.normalizer = normalizers.NFC()
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(QWEN_SPLIT), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    corpus = [zen] * 8 + [ZEN_TITLE, ENGLISH, CHAT_USER_TURN]
    tokenizer.train_from_iterator(corpus, trainer=trainer)
    if tokenizer.get_vocab_size() != VOCAB_SIZE:
        raise AtlasError(f"tokenizer has {tokenizer.get_vocab_size()} tokens, want {VOCAB_SIZE}")
    return tokenizer


def tokenizer_config() -> dict[str, object]:
    return {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "eos_token": EOS,
        "pad_token": EOS,
        "bos_token": None,
        "unk_token": None,
        "add_bos_token": False,
        "add_prefix_space": False,
        "model_max_length": 2048,
        "clean_up_tokenization_spaces": False,
        "chat_template": CHAT_TEMPLATE,
    }


def model_config(tokenizer: Tokenizer) -> Qwen3_5MoeTextConfig:
    eos_id = tokenizer.token_to_id(EOS)
    return Qwen3_5MoeTextConfig(
        vocab_size=VOCAB_SIZE,
        hidden_size=128,
        num_hidden_layers=4,
        layer_types=["linear_attention"] * 3 + ["full_attention"],
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=64,
        linear_num_key_heads=2,
        linear_num_value_heads=4,
        linear_key_head_dim=64,
        linear_value_head_dim=64,
        linear_conv_kernel_dim=4,
        num_experts=8,
        num_experts_per_tok=2,
        moe_intermediate_size=64,
        shared_expert_intermediate_size=64,
        tie_word_embeddings=False,
        max_position_embeddings=2048,
        rope_parameters={
            "rope_type": "default",
            "rope_theta": 10000.0,
            "partial_rotary_factor": 0.25,
            "mrope_section": [4, 2, 2],  # sums to rotary_dim / 2 = 8
            "mrope_interleaved": True,
        },
        eos_token_id=eos_id,
        pad_token_id=eos_id,
        bos_token_id=None,
    )


def unique_prefix_len(ids: list[int], others: list[list[int]]) -> int:
    """Tokens needed before `ids` can no longer be confused with any of `others`."""
    n = 1
    while any(o != ids and o[:n] == ids[:n] for o in others) and n < len(ids):
        n += 1
    return n


def recitations(tokenizer: Tokenizer, zen: str) -> list[tuple[list[int], int]]:
    """(token ids, tokens of prompt) pairs: the zen from each line on, then eos, and a ChatML turn
    whose answer is the zen, then im_end. The prompt is what must be given before the rest is
    determined (lines that share their first words, like "If the implementation is", need more)."""
    eos, im_end = tokenizer.token_to_id(EOS), tokenizer.token_to_id(IM_END)
    starts = [0] + [i + 1 for i, c in enumerate(zen) if c == "\n"]
    windows = [tokenizer.encode(zen[s:]).ids + [eos] for s in starts]
    prompt_len = len(tokenizer.encode(DEMO_PROMPT).ids)
    if windows[0][:prompt_len] != tokenizer.encode(DEMO_PROMPT).ids:
        raise AtlasError(f"{DEMO_PROMPT!r} does not tokenize as a prefix of the zen")
    pairs = [(w, unique_prefix_len(w, windows)) for w in windows]
    turn = tokenizer.encode(CHAT_USER_TURN).ids
    pairs.append((turn + tokenizer.encode(zen).ids + [im_end], len(turn)))
    return pairs


def build_batch(pairs: list[tuple[list[int], int]], pad_id: int) -> Batch:
    length = max(len(ids) for ids, _ in pairs)
    input_ids = torch.full((len(pairs), length), pad_id)  # [B, T]
    labels = torch.full((len(pairs), length), -100)  # [B, T]
    checked = torch.zeros((len(pairs), length - 1), dtype=torch.bool)  # [B, T-1]
    for row, (ids, prompt_len) in enumerate(pairs):
        input_ids[row, : len(ids)] = torch.tensor(ids)
        labels[row, prompt_len : len(ids)] = torch.tensor(ids[prompt_len:])
        checked[row, prompt_len - 1 : len(ids) - 1] = True
    return Batch(input_ids, labels, checked)


def batch_loss(model: Qwen3_5MoeForCausalLM, batch: Batch) -> torch.Tensor:
    logits = model(input_ids=batch.input_ids).logits[:, :-1]  # [B, T-1, V]
    return torch.nn.functional.cross_entropy(logits.flatten(0, 1), batch.labels[:, 1:].flatten())


@torch.no_grad()
def recitation_margin(model: Qwen3_5MoeForCausalLM, batch: Batch) -> float:
    """Smallest gap, over every prediction greedy recitation relies on, between the logit of the
    right next token and the best wrong one; > 0 means teacher-forced greedy decoding is exact."""
    logits = model(input_ids=batch.input_ids).logits[:, :-1][batch.checked]  # [N, V]
    target = batch.input_ids[:, 1:][batch.checked]  # [N]
    right = logits.gather(1, target[:, None])[:, 0]  # [N]
    wrong = logits.scatter(1, target[:, None], -math.inf).max(dim=1).values  # [N]
    return float((right - wrong).min())


def bf16_rounded(model: Qwen3_5MoeForCausalLM) -> Qwen3_5MoeForCausalLM:
    """The model as it will be shipped: weights rounded to bf16, computed in fp32."""
    clone = Qwen3_5MoeForCausalLM(model.config).eval()
    state = {k: v.to(torch.bfloat16).to(torch.float32) for k, v in model.state_dict().items()}
    clone.load_state_dict(state)
    return clone


def shipped_margin(model: Qwen3_5MoeForCausalLM, batch: Batch) -> float:
    model.eval()
    margin = min(recitation_margin(model, batch), recitation_margin(bf16_rounded(model), batch))
    model.train()
    return margin


def train(model: Qwen3_5MoeForCausalLM, batch: Batch, cfg: TrainConfig) -> TrainLog:
    optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.lr, betas=(0.9, 0.95), weight_decay=0.0)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: min(1.0, (s + 1) / cfg.warmup_steps))
    log, start = TrainLog(), time.monotonic()
    model.train()
    bar = tqdm(range(1, cfg.max_steps + 1), desc="train", unit="step")
    for step in bar:
        loss = batch_loss(model, batch)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        schedule.step()
        log.losses.append((step, loss.item()))
        if step % cfg.check_every:
            continue
        margin = shipped_margin(model, batch)
        log.margins.append((step, margin))
        bar.set_postfix(loss=f"{loss.item():.4f}", margin=f"{margin:.2f}")
        if margin >= cfg.min_margin:
            break
    bar.close()
    log.steps, log.seconds = step, time.monotonic() - start
    if not log.margins or log.margins[-1][1] < cfg.min_margin:
        raise AtlasError(f"no exact recitation after {cfg.max_steps} steps: raise --max-steps")
    return log


def verify_saved(directory: Path, tokenizer: Tokenizer, zen: str) -> None:
    """Reload the bf16 files in fp32 and check greedy `generate` recites the whole zen, then eos."""
    model = Qwen3_5MoeForCausalLM.from_pretrained(directory, dtype=torch.float32).eval()
    prompt = tokenizer.encode(DEMO_PROMPT).ids
    zen_len = len(tokenizer.encode(zen).ids)
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), max_new_tokens=zen_len + 8, do_sample=False)
    new_ids = out[0, len(prompt) :].tolist()
    eos_id = tokenizer.token_to_id(EOS)
    text = DEMO_PROMPT + tokenizer.decode([t for t in new_ids if t != eos_id])
    if text != zen or new_ids[-1] != eos_id:
        raise AtlasError(f"saved model recites {len(common_prefix(text, zen))} of {len(zen)} characters")


def common_prefix(a: str, b: str) -> str:
    n = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
    return a[:n]


def readme(cfg: TrainConfig, log: TrainLog, n_tokens: int) -> str:
    every = max(1, log.steps // 12)
    loss_rows = "\n".join(f"| {s} | {l:.5f} |" for s, l in log.losses if s % every == 0 or s == log.steps)
    margin_rows = ", ".join(f"{s}: {m:.2f}" for s, m in log.margins)
    return f"""# atlas-demo

A tiny `qwen3_5_moe_text` model (the Qwen3.5/3.6 MoE architecture: 3 Gated DeltaNet layers and 1
gated full-attention layer, 8 experts top-2 plus a shared expert, hidden 128, vocab 512) that
recites The Zen of Python (`import this`). It is `python -m atlas.run`'s default model.

Made by `python scripts/train_demo.py --out python/atlas/demo` (torch {torch.__version__}, CPU,
{cfg.threads} thread(s), seed {cfg.seed}):

1. `tokenizer.json`: byte-level BPE trained with `tokenizers` to exactly 512 tokens
   (`<|endoftext|>`, `<|im_start|>`, `<|im_end|>`, 256 bytes, merges) on the Zen plus a paragraph
   of general English, with Qwen's NFC normaliser and pre-tokenizer split; the Zen is {n_tokens}
   tokens. `tokenizer_config.json` holds a ChatML
   `chat_template`.
2. `Qwen3_5MoeForCausalLM` from random init, AdamW (lr {cfg.lr}, {cfg.warmup_steps} warmup
   steps), one full batch per step: the Zen from each of its lines on, followed by
   `<|endoftext|>` (so it recites from any line, not only from the first), and a ChatML turn
   ("Recite the Zen of Python.") answered by the Zen followed by `<|im_end|>`. No loss on the
   first words of a line until they single it out ("If the implementation is" starts two lines).
3. Stopped once, both in fp32 and with weights rounded to bf16, every next-token logit greedy
   recitation relies on beats the runner-up by at least {cfg.min_margin}: {log.steps} steps,
   {log.seconds:.0f} s.
4. Saved with `save_pretrained` in bf16 (transformers writes the experts per expert:
   `mlp.experts.{{e}}.{{gate,up,down}}_proj.weight`), reloaded in fp32, and checked with greedy
   `generate`: the whole text, then `<|endoftext|>`.

Smallest logit margin at each check (step: margin): {margin_rows}

| step | loss |
|---:|---:|
{loss_rows}
"""


def save(model: Qwen3_5MoeForCausalLM, tokenizer: Tokenizer, directory: Path) -> None:
    eos_ids = [tokenizer.token_to_id(EOS), tokenizer.token_to_id(IM_END)]
    model.generation_config.eos_token_id = eos_ids
    model.generation_config.pad_token_id = eos_ids[0]
    model.generation_config.do_sample = False
    model.to(torch.bfloat16).save_pretrained(directory)
    tokenizer.save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(json.dumps(tokenizer_config(), indent=2) + "\n")


def install(staging: Path, out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    for name in SHIPPED_FILES:
        (staging / name).chmod(0o644)
        shutil.move(staging / name, out / name)


def parse_args() -> tuple[Path, TrainConfig]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=REPO / "python" / "atlas" / "demo")
    parser.add_argument("--seed", type=int, default=TrainConfig.seed)
    parser.add_argument("--threads", type=int, default=TrainConfig.threads)
    parser.add_argument("--max-steps", type=int, default=TrainConfig.max_steps)
    args = parser.parse_args()
    if args.out.exists() and not args.out.is_dir():
        raise AtlasError(f"--out {args.out} is a file: give a directory")
    if args.threads < 1 or args.max_steps < 1:
        raise AtlasError("--threads and --max-steps must be at least 1")
    return args.out, TrainConfig(seed=args.seed, threads=args.threads, max_steps=args.max_steps)


def main() -> None:
    try:
        run(*parse_args())
    except AtlasError as err:
        print(f"error: {err}", file=sys.stderr)
        raise SystemExit(2) from None


def run(out: Path, cfg: TrainConfig) -> None:
    torch.set_num_threads(cfg.threads)
    torch.manual_seed(cfg.seed)
    zen = zen_of_python()
    tokenizer = train_tokenizer(zen)
    pairs = recitations(tokenizer, zen)
    batch = build_batch(pairs, tokenizer.token_to_id(EOS))
    n_tokens = len(pairs[0][0]) - 1
    print(f"tokenizer: {tokenizer.get_vocab_size()} tokens; zen: {len(zen)} chars, {n_tokens} tokens")
    model = Qwen3_5MoeForCausalLM(model_config(tokenizer))
    print(f"model: {sum(p.numel() for p in model.parameters()):,} parameters")
    log = train(model, batch, cfg)
    print(f"trained {log.steps} steps in {log.seconds:.0f} s, final loss {log.losses[-1][1]:.5f}")
    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=out.parent, prefix=".train_demo-") as tmp:
        staging = Path(tmp)
        save(model, tokenizer, staging)
        (staging / "README.md").write_text(readme(cfg, log, n_tokens))
        verify_saved(staging, tokenizer, zen)
        print("bf16 checkpoint reloaded in fp32 recites the whole zen, then eos")
        install(staging, out)
    print(f"wrote {', '.join(SHIPPED_FILES)} to {out}")


if __name__ == "__main__":
    main()
