"""tokenizer.json through the `tokenizers` library (the reference implementation of the format).

A token's text (`token_text`) is what the tokenizer decodes it to, except when the token alone is not
valid UTF-8 (a piece of a multi-byte character, which would decode to U+FFFD): then its bytes that do not
form a character are shown as `<0xF0><0x9F>`, as llama.cpp shows them. A token's bytes are known for the
two byte vocabularies in use: byte-level BPE (GPT-2's byte-to-character alphabet; the decoder is
ByteLevel) and sentencepiece-style byte fallback (tokens spelled `<0x..>`). Joined text (`decode`) is
always decoded from the ids together, so a character split over several tokens comes out whole.
"""

from __future__ import annotations

import codecs
import json
import re
from functools import cached_property
from pathlib import Path

from .errors import CheckpointError


class Tokenizer:
    def __init__(self, inner, path: Path) -> None:
        self._inner = inner
        self.path = path

    @classmethod
    def from_file(cls, path: Path) -> Tokenizer:
        from tokenizers import Tokenizer as HFTokenizer  # imported only when a prompt needs it

        try:
            return cls(HFTokenizer.from_file(str(path)), path)
        except Exception as e:  # the library raises plain Exceptions with long messages
            first = str(e).splitlines()[0] if str(e) else type(e).__name__
            raise CheckpointError(f"{path}: cannot read tokenizer ({first})") from None

    def encode(self, text: str) -> list[int]:
        return list(self._inner.encode(text, add_special_tokens=True).ids)

    def token_text(self, token: int) -> str:
        """The text of one token; bytes of it that are not valid UTF-8 on their own as `<0xXX>`."""
        text = self._inner.decode([token], skip_special_tokens=False)
        if "\ufffd" not in text:
            return text
        raw = self.token_bytes(token)
        if raw is None:  # a vocabulary whose bytes metrale cannot know: the decoder's text
            return text
        return raw.decode("utf-8", errors=_HEX_BYTES)

    def token_bytes(self, token: int) -> bytes | None:
        """The bytes a token stands for, for byte-level BPE and `<0x..>` byte-fallback tokens; None when
        the vocabulary is neither (or the id is unknown)."""
        piece = self._inner.id_to_token(token)
        if piece is None:
            return None
        m = _BYTE_TOKEN.fullmatch(piece)
        if m is not None and self._kind["byte_fallback"]:
            return bytes([int(m.group(1), 16)])
        if self._kind["byte_level"]:
            try:
                return bytes(_UNICODE_TO_BYTE[ch] for ch in piece)
            except KeyError:  # an added token spelled in plain text
                return piece.encode("utf-8")
        return None

    @cached_property
    def _kind(self) -> dict[str, bool]:
        """Which byte vocabulary tokenizer.json declares (read once, only when a token needs it)."""
        try:
            doc = json.loads(self.path.read_text("utf-8"))
        except (OSError, ValueError):
            doc = {}
        decoder = json.dumps(doc.get("decoder"))
        model = doc.get("model") if isinstance(doc.get("model"), dict) else {}
        return {"byte_level": '"ByteLevel"' in decoder,
                "byte_fallback": bool(model.get("byte_fallback")) or '"ByteFallback"' in decoder}

    def decode(self, tokens: list[int]) -> str:
        return self._inner.decode(tokens, skip_special_tokens=False)

    def vocab_size(self) -> int:
        return self._inner.get_vocab_size(with_added_tokens=True)


def _gpt2_byte_alphabet() -> dict[str, int]:
    """GPT-2's bytes_to_unicode, inverted: the character byte-level BPE spells each byte with."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("\xa1"), ord("\xac") + 1),
                 *range(ord("\xae"), ord("\xff") + 1)]
    chars = list(printable)
    extra = 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            chars.append(256 + extra)
            extra += 1
    return {chr(c): b for b, c in zip(printable, chars)}


_UNICODE_TO_BYTE = _gpt2_byte_alphabet()
_BYTE_TOKEN = re.compile(r"<0x([0-9A-Fa-f]{2})>")
_HEX_BYTES = "metrale-hex-bytes"


def _hex_bytes(err: UnicodeError) -> tuple[str, int]:
    assert isinstance(err, UnicodeDecodeError)
    return "".join(f"<0x{b:02X}>" for b in err.object[err.start:err.end]), err.end


codecs.register_error(_HEX_BYTES, _hex_bytes)
