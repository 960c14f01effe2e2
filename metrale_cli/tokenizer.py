"""tokenizer.json through the `tokenizers` library (the reference implementation of the format)."""

from __future__ import annotations

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

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of `text`. add_special_tokens=False skips the post-processor (the BOS or other template
        tokens tokenizer.json adds around a sequence); special tokens written in the text are still matched."""
        return list(self._inner.encode(text, add_special_tokens=add_special_tokens).ids)

    def token_text(self, token: int) -> str:
        """The text of one token; byte-level pieces of a multi-byte character come out as U+FFFD."""
        return self._inner.decode([token], skip_special_tokens=False)

    def decode(self, tokens: list[int]) -> str:
        return self._inner.decode(tokens, skip_special_tokens=False)

    def vocab_size(self) -> int:
        return self._inner.get_vocab_size(with_added_tokens=True)
