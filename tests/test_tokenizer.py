"""Tokenizer: round trips, streaming detokenisation of split UTF-8 characters, and chat templates
rendered exactly as transformers renders them."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from atlas.errors import AtlasError
from atlas.tokenizer import Tokenizer
from runtime_checkpoint import CHATML_TEMPLATE, train_tokenizer

ALPHABET = list("abcdefghij KLMNOP.,!?\n") + list("äöüßé你好世界こんにちは🙂🚀Ωλ")


def random_text(rng: np.random.Generator, length: int) -> str:
    return "".join(rng.choice(ALPHABET, size=length))


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("tok")
    train_tokenizer(path)
    return path


def test_round_trip(model_dir: Path, rng: np.random.Generator) -> None:
    tokenizer = Tokenizer.open(model_dir)
    for _ in range(20):
        text = random_text(rng, int(rng.integers(1, 60)))
        ids = tokenizer.encode(text)
        assert all(0 <= i < tokenizer.vocab_size for i in ids)
        assert tokenizer.decode(ids) == text


def test_stream_decoder_matches_full_decode(model_dir: Path, rng: np.random.Generator) -> None:
    tokenizer = Tokenizer.open(model_dir)
    for _ in range(20):
        text = random_text(rng, int(rng.integers(1, 80)))
        ids = tokenizer.encode(text)
        decoder = tokenizer.stream_decoder()
        pieces = [decoder.push(i) for i in ids]
        assert "".join(pieces) + decoder.flush() == text
        assert not any("\ufffd" in piece for piece in pieces)


def test_stream_decoder_holds_back_partial_characters(model_dir: Path) -> None:
    tokenizer = Tokenizer.open(model_dir)
    emoji_bytes = [tokenizer.backend.token_to_id(t) for t in tokenizer.backend.encode("🙂").tokens]
    byte_level = tokenizer.backend.encode("\U0001fab8").ids  # a character absent from training
    assert len(byte_level) > 1, "expected a rare character to split into byte tokens"
    decoder = tokenizer.stream_decoder()
    assert [decoder.push(i) for i in byte_level[:-1]] == [""] * (len(byte_level) - 1)
    assert decoder.push(byte_level[-1]) == "\U0001fab8"
    assert "".join(decoder.push(i) for i in emoji_bytes) == "🙂"
    truncated = tokenizer.stream_decoder()
    truncated.push(byte_level[0])
    assert truncated.flush() == "\ufffd"  # what is left at the end still comes out


def test_special_tokens_from_config(model_dir: Path) -> None:
    tokenizer = Tokenizer.open(model_dir)
    assert tokenizer.eos_token_id == tokenizer.backend.token_to_id("<|im_end|>")
    assert tokenizer.special_tokens["pad_token"] == "<|endoftext|>"  # {"content": ...} form
    assert tokenizer.bos_token_id is None


@pytest.mark.oracle
def test_chat_template_matches_transformers(model_dir: Path, rng: np.random.Generator) -> None:
    from transformers import AutoTokenizer

    reference = AutoTokenizer.from_pretrained(model_dir)
    tokenizer = Tokenizer.open(model_dir)
    for turns in (1, 3):
        roles = ["user", "assistant"] * 2
        messages = [{"role": roles[i], "content": random_text(rng, 12)} for i in range(turns)]
        for add in (True, False):
            want = reference.apply_chat_template(messages, tokenize=False, add_generation_prompt=add)
            assert tokenizer.apply_chat_template(messages, add_generation_prompt=add) == want
        encoded = reference.apply_chat_template(messages, tokenize=True, add_generation_prompt=True)
        assert tokenizer.encode_chat(messages) == list(encoded["input_ids"])


def test_chat_template_jinja_file_wins(tmp_path: Path, rng: np.random.Generator) -> None:
    train_tokenizer(tmp_path)
    marker = random_text(rng, 6)
    (tmp_path / "chat_template.jinja").write_text(
        marker + "{% for m in messages %}[{{ m.role }}]{{ m.content | tojson }}{% endfor %}"
        "{% if add_generation_prompt %}<|im_start|>{% endif %}",
        encoding="utf-8",
    )
    tokenizer = Tokenizer.open(tmp_path)
    text = tokenizer.apply_chat_template([{"role": "user", "content": "é"}])
    assert text == marker + '[user]"é"<|im_start|>'
    assert tokenizer.encode_chat([{"role": "user", "content": "é"}])[-1] == tokenizer.backend.token_to_id("<|im_start|>")


def test_chat_template_errors(tmp_path: Path) -> None:
    train_tokenizer(tmp_path, chat_template=None)
    with pytest.raises(AtlasError, match="no chat template"):
        Tokenizer.open(tmp_path).apply_chat_template([{"role": "user", "content": "hi"}])
    (tmp_path / "chat_template.jinja").write_text(
        "{% if messages[0].role != 'system' %}{{ raise_exception('System message must be first') }}{% endif %}",
        encoding="utf-8",
    )
    with pytest.raises(AtlasError, match="System message must be first"):
        Tokenizer.open(tmp_path).apply_chat_template([{"role": "user", "content": "hi"}])



CONCAT_TEMPLATE = "{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] }}{% endfor %}"
BROKEN_TEMPLATES: list[tuple[str, str | None, list[dict[str, object]], str]] = [
    # (chat_template in tokenizer_config.json, chat_template.jinja, messages, expected in the line)
    (CONCAT_TEMPLATE, None, [{"role": "user", "content": 5}], "TypeError"),
    (CONCAT_TEMPLATE, None, [{"role": "user"}], "UndefinedError"),
    ("{% for m in messages %}{{ m.content }}", None, [{"role": "user", "content": "hi"}], "not valid jinja (line 1"),
    (CHATML_TEMPLATE, "{{ messages[3].content.strip() }}", [{"role": "user", "content": "hi"}], "UndefinedError"),
    (CHATML_TEMPLATE, "{{ messages | length / 0 }}", [{"role": "user", "content": "hi"}], "ZeroDivisionError"),
    (CHATML_TEMPLATE, "{{ messages[0].content | int + [] }}", [{"role": "user", "content": "hi"}], "TypeError"),
]


@pytest.mark.parametrize(("config_template", "jinja_file", "messages", "needle"), BROKEN_TEMPLATES,
                         ids=["int content", "no content", "syntax", "undefined", "zero division", "int plus list"])
def test_failing_template_is_one_line_naming_its_file(
    tmp_path: Path, config_template: str, jinja_file: str | None, messages: list[dict[str, object]], needle: str
) -> None:
    train_tokenizer(tmp_path, chat_template=config_template)
    source = tmp_path / "tokenizer_config.json"
    if jinja_file is not None:
        source = tmp_path / "chat_template.jinja"
        source.write_text(jinja_file, encoding="utf-8")
    tokenizer = Tokenizer.open(tmp_path)
    for call in (tokenizer.apply_chat_template, tokenizer.encode_chat):
        with pytest.raises(AtlasError) as err:
            call(messages)  # type: ignore[arg-type]
        line = str(err.value)
        assert "\n" not in line and str(source) in line and needle in line, line


def test_missing_or_broken_files(tmp_path: Path) -> None:
    with pytest.raises(AtlasError, match="tokenizer.json not found"):
        Tokenizer.open(tmp_path)
    (tmp_path / "tokenizer.json").write_text("{broken", encoding="utf-8")
    with pytest.raises(AtlasError, match="cannot be loaded"):
        Tokenizer.open(tmp_path)
    train_tokenizer(tmp_path)
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"eos_token": 5}), encoding="utf-8")
    with pytest.raises(AtlasError, match="'eos_token' must be a string"):
        Tokenizer.open(tmp_path)
    (tmp_path / "tokenizer_config.json").unlink()
    (tmp_path / "chat_template.jinja").write_bytes(b"{{ messages }}\xff\xfe")
    with pytest.raises(AtlasError, match="chat_template.jinja cannot be read"):
        Tokenizer.open(tmp_path)


def test_a_tokenizer_that_cannot_encode_is_one_line(tmp_path: Path, rng: np.random.Generator) -> None:
    """A Unigram tokenizer.json without an unk id loads, then fails on a character it lacks: one
    line naming the file, not the library's exception."""
    pieces = [["a", -1.0], ["b", -2.0]]
    (tmp_path / "tokenizer.json").write_text(json.dumps({"model": {"type": "Unigram", "vocab": pieces}}), encoding="utf-8")
    tokenizer = Tokenizer.open(tmp_path)
    assert tokenizer.encode("".join(rng.choice(["a", "b"], 5))) != []
    with pytest.raises(AtlasError, match="tokenizer.json cannot encode the text") as caught:
        tokenizer.encode("abz")
    assert "\n" not in str(caught.value) and str(tmp_path) in str(caught.value)


def test_continue_final_message_cuts_right_after_the_final_text(tmp_path: Path, rng: np.random.Generator) -> None:
    """The cut is where the template writes the final message's text, even when that text also
    ends what the template writes after it (">" of <|im_end|>) or stands in an earlier message."""
    train_tokenizer(tmp_path)
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"chat_template": CHATML_TEMPLATE}), encoding="utf-8")
    tokenizer = Tokenizer.open(tmp_path)
    for final in (">", "end", "hi", "a" * int(rng.integers(1, 6))):
        messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": final}]
        ids = tokenizer.encode_chat(messages, add_generation_prompt=False, continue_final=True)
        assert tokenizer.decode(ids, skip_special_tokens=False).endswith("<|im_start|>assistant\n" + final)
    with pytest.raises(AtlasError, match="exclude each other"):
        tokenizer.encode_chat(messages, continue_final=True)
    with pytest.raises(AtlasError, match="a final message with text"):
        tokenizer.encode_chat([{"role": "assistant", "content": ""}], add_generation_prompt=False, continue_final=True)
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"chat_template": "{{ 'fixed' }}"}), encoding="utf-8")
    with pytest.raises(AtlasError, match="does not write the final message's text"):
        Tokenizer.open(tmp_path).encode_chat(messages, add_generation_prompt=False, continue_final=True)


def test_template_kwargs_reach_the_template(tmp_path: Path, rng: np.random.Generator) -> None:
    """Extra template variables (the server's chat_template_kwargs), as Qwen's enable_thinking."""
    train_tokenizer(tmp_path)
    (tmp_path / "chat_template.jinja").write_text(
        "{% for m in messages %}{{ m.content }}{% endfor %}"
        "{% if enable_thinking is defined and enable_thinking is false %}<no-think>{% else %}<think>{% endif %}",
        encoding="utf-8",
    )
    tokenizer = Tokenizer.open(tmp_path)
    text = random_text(rng, 8)
    messages = [{"role": "user", "content": text}]
    assert tokenizer.decode(tokenizer.encode_chat(messages)) == tokenizer.decode(tokenizer.encode(text + "<think>", add_special_tokens=False))
    off = tokenizer.encode_chat(messages, template_kwargs={"enable_thinking": False})
    assert off == tokenizer.encode(text + "<no-think>", add_special_tokens=False)


def test_template_defaults_sit_under_each_call(tmp_path: Path) -> None:
    from dataclasses import replace

    train_tokenizer(tmp_path)
    (tmp_path / "chat_template.jinja").write_text("{{ messages[0].content }}[{{ mode }}]", encoding="utf-8")
    tokenizer = replace(Tokenizer.open(tmp_path), template_defaults={"mode": "a"})
    messages = [{"role": "user", "content": "x"}]
    assert tokenizer.decode(tokenizer.encode_chat(messages)) == "x[a]"
    assert tokenizer.decode(tokenizer.encode_chat(messages, template_kwargs={"mode": "b"})) == "x[b]"
