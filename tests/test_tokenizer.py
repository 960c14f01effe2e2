"""Token text: a token that is not valid UTF-8 on its own shows its bytes (<0xF0>), joined text decodes whole."""

from __future__ import annotations

from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from metrale_cli.model import DEFAULT_MODEL_DIR
from metrale_cli.tokenizer import Tokenizer

EMOJI = "\U0001f642"  # 🙂: F0 9F 99 82


def _save(tok, path: Path) -> Tokenizer:
    tok.save(str(path))
    return Tokenizer.from_file(path)


@pytest.fixture(scope="module")
def embedded() -> Tokenizer:
    return Tokenizer.from_file(DEFAULT_MODEL_DIR / "tokenizer.json")


@pytest.fixture(scope="module")
def byte_level(tmp_path_factory) -> Tokenizer:
    """GPT-2 style byte-level BPE with one merge that joins a space and the first byte of 🙂."""
    from tokenizers import Tokenizer as HF
    from tokenizers import decoders, models, pre_tokenizers

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    vocab = {ch: i for i, ch in enumerate(alphabet)}
    vocab["\u0120\u00f0"] = len(vocab)  # "Ġð" = b" \xf0"
    tok = HF(models.BPE(vocab=vocab, merges=[("\u0120", "\u00f0")]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    return _save(tok, tmp_path_factory.mktemp("bl") / "tokenizer.json")


@pytest.fixture(scope="module")
def sentencepiece(tmp_path_factory) -> Tokenizer:
    """A Llama-2 style tokenizer.json: sentencepiece pieces with `<0x..>` byte fallback."""
    from tokenizers import Tokenizer as HF
    from tokenizers import decoders, models, normalizers

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2}
    for b in range(256):
        vocab[f"<0x{b:02X}>"] = len(vocab)
    for piece in ("\u2581", "a", "h", "i", "\u2581a", "hi", "\u2581hi"):
        vocab[piece] = len(vocab)
    tok = HF(models.BPE(vocab=vocab, merges=[("\u2581", "a"), ("h", "i"), ("\u2581", "hi")], byte_fallback=True,
                        unk_token="<unk>", fuse_unk=True))
    tok.normalizer = normalizers.Sequence([normalizers.Prepend("\u2581"), normalizers.Replace(" ", "\u2581")])
    tok.decoder = decoders.Sequence([decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse(),
                                     decoders.Strip(" ", 1, 0)])
    return _save(tok, tmp_path_factory.mktemp("sp") / "tokenizer.json")


def test_embedded_byte_level_emoji_tokens_show_their_bytes(embedded):
    ids = embedded._inner.encode(EMOJI, add_special_tokens=False).ids
    assert [embedded.token_text(i) for i in ids] == ["<0xF0>", "<0x9F>", "<0x99>", "<0x82>"]
    assert all(embedded._inner.decode([i]) == "\ufffd" for i in ids)  # what the decoder alone gives
    assert embedded.decode(ids) == EMOJI


def test_valid_part_of_a_token_stays_text(byte_level):
    ids = byte_level._inner.encode(" " + EMOJI, add_special_tokens=False).ids
    assert [byte_level.token_text(i) for i in ids] == [" <0xF0>", "<0x9F>", "<0x99>", "<0x82>"]
    assert byte_level.decode(ids) == " " + EMOJI


def test_sentencepiece_byte_fallback_tokens(sentencepiece):
    enc = sentencepiece._inner.encode("hi " + EMOJI + " a", add_special_tokens=False)
    texts = [sentencepiece.token_text(i) for i in enc.ids]
    assert texts[2:6] == ["<0xF0>", "<0x9F>", "<0x99>", "<0x82>"]
    assert texts[0] == "hi" and texts[-1] == "a"  # ordinary pieces: the decoder's text, unchanged
    assert sentencepiece.decode(enc.ids) == "hi " + EMOJI + " a"
    newline = sentencepiece._inner.token_to_id("<0x0A>")
    assert sentencepiece.token_text(newline) == "\n"  # a byte that is a character on its own


def test_ordinary_tokens_are_the_decoders_text(embedded):
    for i in range(embedded.vocab_size()):
        text = embedded._inner.decode([i], skip_special_tokens=False)
        if "\ufffd" not in text:
            assert embedded.token_text(i) == text


@settings(max_examples=200, deadline=None)
@given(st.text(min_size=1, max_size=40))
def test_byte_level_token_bytes_spell_the_text(embedded, text):
    ids = embedded._inner.encode(text, add_special_tokens=False).ids
    assert b"".join(embedded.token_bytes(i) for i in ids) == text.encode("utf-8")
    shown = "".join(embedded.token_text(i) for i in ids)
    assert "\ufffd" not in shown or "\ufffd" in text


# -- joined text and streaming (decoding.continuation_text, TextStream) ---------------------------------------


def _streamed(tok: Tokenizer, prompt: list[int], generated: list[int]) -> str:
    from metrale_cli.decoding.rows import TextStream

    stream = TextStream(tok.decode, prompt)
    pieces = [stream.push(t) for t in generated]
    return "".join(pieces) + stream.flush()


def test_continuation_keeps_a_sentencepiece_leading_space(sentencepiece):
    from metrale_cli.decoding.rows import continuation_text

    prompt = sentencepiece._inner.encode("hi", add_special_tokens=False).ids
    generated = sentencepiece._inner.encode("hi a " + EMOJI, add_special_tokens=False).ids[1:]
    assert sentencepiece.decode(generated) == "a " + EMOJI  # the decoder strips the first piece's space
    assert continuation_text(sentencepiece.decode, prompt, generated) == " a " + EMOJI
    assert _streamed(sentencepiece, prompt, generated) == " a " + EMOJI


def test_stream_holds_an_incomplete_character_back(embedded):
    from metrale_cli.decoding.rows import TextStream

    prompt = embedded.encode("The")
    ids = embedded._inner.encode(" " + EMOJI + " x", add_special_tokens=False).ids
    stream = TextStream(embedded.decode, prompt)
    shown = [stream.push(t) for t in ids]
    assert "\ufffd" not in "".join(shown)
    assert EMOJI in shown  # the whole character at once, when its last byte came
    assert "".join(shown) + stream.flush() == " " + EMOJI + " x"


@settings(max_examples=100, deadline=None)
@given(st.text(min_size=1, max_size=30), st.text(min_size=1, max_size=30))
def test_streamed_text_equals_the_joined_text(embedded, head, tail):
    from metrale_cli.decoding.rows import continuation_text

    prompt = embedded.encode(head)
    generated = embedded._inner.encode(tail, add_special_tokens=False).ids
    assert continuation_text(embedded.decode, prompt, generated) == tail
    assert _streamed(embedded, prompt, generated) == tail
