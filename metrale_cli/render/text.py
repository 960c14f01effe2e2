"""Token text and generated text made visible: escaping for plain and rich, quoting for one line."""

from __future__ import annotations

import json
import unicodedata

_VISIBLE_ESCAPES = {" ": "\u2423", "\\": "\\\\", "\n": "\\n", "\t": "\\t", "\r": "\\r", "\u2423": "\\u2423"}
_INVISIBLE = {"Cc", "Cf", "Cs", "Co", "Cn", "Zl", "Zp", "Zs"}


def escape_text(s: str | None) -> str:
    """Token text with whitespace and control characters made visible (see the module docstring)."""
    if s is None:
        return ""
    out = []
    for ch in s:
        if ch in _VISIBLE_ESCAPES:
            out.append(_VISIBLE_ESCAPES[ch])
        elif ch != "\ufffd" and unicodedata.category(ch) in _INVISIBLE:
            out.append(f"\\u{ord(ch):04x}" if ord(ch) <= 0xFFFF else f"\\U{ord(ch):08x}")
        else:
            out.append(ch)
    return "".join(out)


def display_text(s: str) -> str:
    """Generated text for reading (rich): newlines, tabs and spaces kept; other control, format and
    separator characters as \\uXXXX (carriage return as \\r), so a model's output cannot move the
    cursor or colour the terminal."""
    out = []
    for ch in s:
        if ch in "\n\t " or ch == "\ufffd" or unicodedata.category(ch) not in _INVISIBLE:
            out.append(ch)
        elif ch == "\r":
            out.append("\\r")
        else:
            out.append(f"\\u{ord(ch):04x}" if ord(ch) <= 0xFFFF else f"\\U{ord(ch):08x}")
    return "".join(out)


def quote_text(s: str) -> str:
    """Generated text on one line (plain): a JSON string (json.loads gives the text back) that escapes
    every invisible character as \\uXXXX besides JSON's own \\n \\t \\r \\" \\\\; spaces stay spaces."""
    out = []
    for ch in json.dumps(s, ensure_ascii=False):
        if ch == " " or unicodedata.category(ch) not in _INVISIBLE:
            out.append(ch)
        elif ord(ch) <= 0xFFFF:
            out.append(f"\\u{ord(ch):04x}")
        else:  # JSON spells a character above U+FFFF as its UTF-16 surrogate pair
            high, low = divmod(ord(ch) - 0x10000, 0x400)
            out.append(f"\\u{0xD800 + high:04x}\\u{0xDC00 + low:04x}")
    return "".join(out)
