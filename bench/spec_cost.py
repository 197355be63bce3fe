"""What MTP speculative decoding costs on the GPU at the Qwen3.6 dimensions, against the plain
decode loop (a replayed CUDA graph, a step ahead) on the same loaded model.

A checkpoint with the MTP head speculates by default (K = 2 drafts per verify pass). A pass runs
the head K times (launched kernel by kernel, each draft read back) and the main model over K + 1
tokens (a replayed CUDA graph per token count, from 2026-12-05), and yields 1..K + 1 tokens. The synthetic head's drafts are random, so its acceptance says
nothing of a real head's; the pass's cost does. Speculation decodes faster than the plain loop
only where a head's tokens per pass exceed `break_even_tokens_per_pass` = pass time / plain step
time: above K + 1 it cannot win at any acceptance."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

KS = (1, 2, 3)
TOKENS = 32  # decoded per configuration

TimeDecode = Callable[[Any, list[int], int], tuple[float, int]]  # bench/decode.py's time_decode


@contextmanager
def lazy_head_weights(lazy: dict[int, Any]) -> Iterator[None]:
    """The head's reader rounds each tensor to bf16 on the host as it reads it; the synthetic
    checkpoint's large tensors are placeholders (`lazy`, by id) that the bench backend fills on the
    device when they are uploaded, so they pass through unrounded (their tiles are bf16 anyway)."""
    from atlas.models import qwen3_5_moe_mtp

    rounded = qwen3_5_moe_mtp.round_to_bf16
    qwen3_5_moe_mtp.round_to_bf16 = lambda array: array if id(array) in lazy else rounded(array)
    try:
        yield
    finally:
        qwen3_5_moe_mtp.round_to_bf16 = rounded


def measure(engine: Any, prompt: list[int], time_decode: TimeDecode) -> dict[str, Any]:
    """Plain decode tok/s, then per K: speculative tok/s, verify passes, tokens per pass, the
    pass time and the break-even tokens per pass. engine: an atlas.speculative.SpeculativeEngine."""
    from atlas.backends.base import SamplingParams

    plain_tok_s, _ = time_decode(engine, prompt, TOKENS)
    by_k: dict[str, Any] = {}
    own = engine.spec_k
    try:
        for k in KS:
            engine.spec_k = k
            engine.generate(prompt, 2, SamplingParams(), None, set())  # warm-up: the T = K + 1 kernels
            stats = engine.generate(prompt, TOKENS, SamplingParams(), None, set())
            new = len(stats.token_ids) - 1  # the first comes from the prefill
            pass_us = 1e6 * stats.decode_seconds / stats.rounds
            by_k[str(k)] = {"tok_s": new / stats.decode_seconds, "passes": stats.rounds,
                            "tokens_per_pass": new / stats.rounds, "acceptance": stats.acceptance_rate,
                            "pass_us": pass_us, "break_even_tokens_per_pass": pass_us * plain_tok_s / 1e6}
    finally:
        engine.spec_k = own
    return {"plain_tok_s": plain_tok_s, "tokens": TOKENS, "by_k": by_k}


def summary_line(result: dict[str, Any]) -> str:
    parts = [f"K={k} {r['tok_s']:.1f} tok/s, pass {r['pass_us'] / 1e3:.2f} ms, break-even "
             f"{r['break_even_tokens_per_pass']:.2f} tokens/pass" for k, r in result["by_k"].items()]
    return f"MTP speculation (random head): plain {result['plain_tok_s']:.1f} tok/s; " + "; ".join(parts)
