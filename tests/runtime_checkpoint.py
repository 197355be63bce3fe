"""Tiny random qwen3_5_moe checkpoints with a tokenizer, for the runtime (API/CLI) tests.

The model is made by transformers (save_pretrained), so it is the real on-disk layout; the
tokenizer is a byte-level BPE trained on the spot, so multi-byte characters split across tokens.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from _checkpoints import randomise

CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{% if loop.first and message['role'] != 'system' %}<|im_start|>system\nYou are terse.<|im_end|>\n{% endif %}"
    "<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
FIM_TOKENS = ["<|fim_prefix|>", "<|fim_middle|>", "<|fim_suffix|>", "<|fim_pad|>", "<|repo_name|>", "<|file_sep|>"]  # Qwen's
CORPUS = [
    "Beautiful is better than ugly. Explicit is better than implicit.",
    "Simple is better than complex. Complex is better than complicated.",
    "Flat is better than nested. Sparse is better than dense. Readability counts.",
    "Schöne Grüße, naïve café, 你好世界, こんにちは, emoji 🙂🚀 and Ελληνικά.",
    "system user assistant You are terse.",
]


def train_tokenizer(model_dir: Path, vocab_size: int = 320, chat_template: str | None = CHATML_TEMPLATE,
                    extra_special: tuple[str, ...] = ()) -> int:
    """Write tokenizer.json and tokenizer_config.json; return the vocabulary size. extra_special:
    special tokens after SPECIAL_TOKENS (FIM_TOKENS)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[*SPECIAL_TOKENS, *extra_special],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(CORPUS * 4, trainer)
    tokenizer.save(str(model_dir / "tokenizer.json"))
    config: dict[str, object] = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "eos_token": "<|im_end|>",
        "pad_token": {"__type": "AddedToken", "content": "<|endoftext|>", "special": True},
    }
    if chat_template is not None:
        config["chat_template"] = chat_template
    (model_dir / "tokenizer_config.json").write_text(json.dumps(config), encoding="utf-8")
    return tokenizer.get_vocab_size()


def make_tiny_checkpoint(model_dir: Path, seed: int, dtype: str = "float32", extra_special: tuple[str, ...] = ()) -> Path:
    """A random Qwen3.5-MoE text model (2 linear-attention + 2 full-attention layers) saved with
    transformers, plus a matching tokenizer (train_tokenizer's extra_special too). Returns model_dir."""
    import torch
    from transformers import Qwen3_5MoeForCausalLM, Qwen3_5MoeTextConfig

    model_dir.mkdir(parents=True, exist_ok=True)
    vocab_size = train_tokenizer(model_dir, extra_special=extra_special)
    eos_id = json.loads((model_dir / "tokenizer.json").read_text())["added_tokens"][2]["id"]
    config = Qwen3_5MoeTextConfig(
        vocab_size=vocab_size, hidden_size=64, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, head_dim=32, linear_num_key_heads=2, linear_num_value_heads=4,
        linear_key_head_dim=16, linear_value_head_dim=16, num_experts=4, num_experts_per_tok=2,
        moe_intermediate_size=32, shared_expert_intermediate_size=32, max_position_embeddings=512,
        layer_types=["linear_attention", "full_attention", "linear_attention", "full_attention"],
        eos_token_id=eos_id, rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                                              "partial_rotary_factor": 0.25},
    )  # fmt: skip
    torch.manual_seed(seed)
    model = Qwen3_5MoeForCausalLM(config).eval()
    randomise(model, seed)  # every parameter drawn afresh, scaled so greedy avoids near-ties
    model.to(getattr(torch, dtype)).save_pretrained(model_dir)
    return model_dir


def transformers_greedy(model_dir: Path, prompt_ids: list[int], max_new_tokens: int) -> list[int]:
    """The new token ids of transformers' greedy generate (the oracle)."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        out = model.generate(
            torch.tensor([prompt_ids]), max_new_tokens=max_new_tokens, do_sample=False,
            attention_mask=torch.ones(1, len(prompt_ids), dtype=torch.long),
        )  # fmt: skip
    return out[0, len(prompt_ids) :].tolist()


def fresh_tiny_checkpoint(parent: Path) -> Path:
    """make_tiny_checkpoint under parent with a fresh seed, printed (shown when a test fails), drawn
    again while the chat template's fixed opening has a router near-tie: every chat prompt starts
    with it, so no prompt a test draws could escape the tie."""
    while True:
        seed = int.from_bytes(os.urandom(4), "little")
        print(f"tiny checkpoint seed: {seed}")
        model_dir = make_tiny_checkpoint(parent, seed)
        if chat_opening_is_well_conditioned(model_dir):
            return model_dir


def chat_opening_is_well_conditioned(model_dir: Path) -> bool:
    """Whether every router top-k cut over the tokens all chat prompts share clears TIE_MARGIN."""
    from _conditioning import TIE_MARGIN, router_margins
    from atlas.tokenizer import Tokenizer

    tokenizer = Tokenizer.open(model_dir)
    first, second = (tokenizer.encode_chat([{"role": "user", "content": text}]) for text in ("a", "Z"))
    shared = next(i for i, (a, b) in enumerate(zip(first, second)) if a != b)
    return bool(router_margins(model_dir, first[:shared]).min() > TIE_MARGIN)
