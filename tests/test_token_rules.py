"""atlas.token_rules (vLLM's allowed_token_ids and bad_words) against plain searches: which
tokens each rule lets through after random histories, and the two combined with each other."""

from __future__ import annotations

import numpy as np
import pytest

from atlas.errors import AtlasError
from atlas.token_rules import AllConstraints, AllowedTokens, BadWords, bad_word_sequences, check_token_rules

VOCAB = 12


def completes_a_sequence(history: list[int], token: int, sequences: list[list[int]]) -> bool:
    text = [*history, token]
    return any(len(seq) <= len(text) and text[len(text) - len(seq):] == seq for seq in sequences)


def test_bad_words_rule_out_exactly_the_tokens_that_complete_a_sequence(rng: np.random.Generator) -> None:
    for _ in range(40):
        sequences = [[int(t) for t in rng.integers(0, VOCAB, int(rng.integers(1, 4)))] for _ in range(int(rng.integers(1, 4)))]
        rule, history = BadWords(sequences), []
        for _ in range(12):
            allowed = [t for t in range(VOCAB) if rule.allows(t)]
            assert allowed == [t for t in range(VOCAB) if not completes_a_sequence(history, t, sequences)]
            if not allowed:
                break
            token = int(rng.choice(allowed))
            rule.advance(token)
            history.append(token)


def test_combined_rules_allow_what_every_part_allows(rng: np.random.Generator) -> None:
    ids = {int(t) for t in rng.integers(0, VOCAB, 5)}
    sequences = [[int(t)] for t in rng.integers(0, VOCAB, 2)]
    both = AllConstraints([AllowedTokens(ids), BadWords(sequences)])
    assert not both.complete
    assert [t for t in range(VOCAB) if both.allows(t)] == sorted(ids - {s[0] for s in sequences})


def test_words_are_matched_alone_and_after_a_space() -> None:
    seen: list[str] = []
    sequences = bad_word_sequences(["ugly", " bad"], lambda text: seen.append(text) or [len(text)])
    assert seen == ["ugly", " ugly", " bad"] and sequences == [[4], [5], [4]]


@pytest.mark.parametrize(("allowed", "bad", "needle"), [
    ([], (), "allowed_token_ids must be a non-empty list"), ([VOCAB], (), "in 0..11"), ([True], (), "allowed_token_ids"),
    (None, "ugly", "bad_words must be a list"), (None, ["  "], "bad_words must be a list"),
])
def test_bad_rules_are_one_line(allowed: object, bad: object, needle: str) -> None:
    with pytest.raises(AtlasError, match=needle):
        check_token_rules(allowed, bad, VOCAB)
