"""render.py on its own: token text escaping, number formats, the JSON layout, format choice."""

from __future__ import annotations

import io
import json
import re
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st
from rich.console import Console

from metrale_cli import render
from metrale_cli.decoding import DecodeResult, DecodeStep, HiddenSummary, Timings, TopK
from metrale_cli.errors import UsageError


@pytest.mark.parametrize("text, shown", [
    (" for", "\u2423for"),
    ("a\nb\tc\rd", "a\\nb\\tc\\rd"),
    ("back\\slash", "back\\\\slash"),
    ("\x00\x1b[31m", "\\u0000\\u001b[31m"),
    ("\u00a0nbsp", "\\u00a0nbsp"),
    ("zero\u200bwidth", "zero\\u200bwidth"),
    ("\u2028", "\\u2028"),
    ("\ufffd", "\ufffd"),
    ("caf\u00e9 \u6f22\u5b57", "caf\u00e9\u2423\u6f22\u5b57"),
    ("\u2423", "\\u2423"),
    ("", ""),
    (None, ""),
])
def test_escape_text(text, shown):
    assert render.escape_text(text) == shown


@given(st.text())
def test_escaped_text_has_no_whitespace_or_controls(text):
    shown = render.escape_text(text)
    assert not re.search(r"[\s\x00-\x1f\x7f-\x9f]", shown)


@given(st.text(alphabet=st.characters(blacklist_characters="\\\u2423")))
def test_escaping_is_reversible(text):
    shown = render.escape_text(text)
    back = shown.replace("\u2423", " ")
    back = re.sub(r"\\U([0-9a-f]{8})|\\u([0-9a-f]{4})", lambda m: chr(int(m.group(1) or m.group(2), 16)), back)
    back = back.replace("\\n", "\n").replace("\\t", "\t").replace("\\r", "\r")
    assert back == text


def test_numbers():
    assert render.f4(6.0625) == "6.0625" and render.f4(7) == "7.0000"
    assert render.num(6.03125) == 6.0312  # the same rounding as %.4f
    assert render.num(float("nan")) is None and render.num(float("inf")) is None and render.num(None) is None
    assert render.num(0.00012344, ".3e") == 0.0001234


def test_json_layout_is_compact_where_readable():
    doc = {"a": [1, 2], "rows": [{"x": 1, "y": [1, 2]}, {"x": 2, "y": []}],
           "steps": [{"top_k": [{"t": 1}]}], "empty": {}}
    text = render.json_text(doc)
    assert json.loads(text) == doc
    assert '"a": [1, 2]' in text and '{"x": 1, "y": [1, 2]}' in text and '{"t": 1}' in text
    assert text.count("\n") == 14
    with pytest.raises(ValueError):
        render.json_text({"x": float("nan")})


def test_choose_format():
    assert render.choose_format(None, Console(file=io.StringIO())) == "plain"
    assert render.choose_format("json", Console(file=io.StringIO())) == "json"
    with pytest.raises(UsageError, match="'yaml'"):
        render.choose_format("yaml", Console(file=io.StringIO()))


def _result() -> DecodeResult:
    steps = [DecodeStep(3, 7, " x\n", 1.5, [TopK(7, " x\n", 1.5, 0.75), TopK(2, "[b]y", 0.25, 0.25)])]
    v = np.arange(4, dtype=np.float32)
    hidden = HiddenSummary(4, 3.7416575, 1.5, 1.118034, 0.0, 3.0, [0.0, 1.0, 2.0, 3.0], "ab" * 32, v)
    return DecodeResult([1, 2, 3], steps, False, None, hidden, Timings(load_s=0.5, prefill_s=0.002, step_s=[0.001]))


@pytest.mark.parametrize("fmt", ["plain", "json", "rich"])
def test_decode_report_escapes_text_and_never_reads_markup(fmt):
    out = io.StringIO()
    meta = render.Meta("decode", "m", "cpu", "bf16", fmt, has_tokenizer=True, top_k=2, timings=True)
    report = render.DecodeReport(Console(file=out, width=120), meta)
    result = _result()
    report.begin(result.prompt_tokens, 1)
    for s in result.steps:
        report.step(s)
    report.finish(result)
    text = out.getvalue()
    if fmt == "json":
        doc = json.loads(text)
        assert doc["steps"][0]["text"] == " x\n" and doc["timings"]["load_s"] == 0.5
        assert doc["hidden"]["first"] == [0.0, 1.0, 2.0, 3.0]
    else:
        assert "\u2423x\\n" in text and "[b]y" in text  # escaped, and Rich markup left alone
        assert "0.7500" in text


def test_plain_output_does_not_depend_on_width():
    outs = []
    for width in (40, 200):
        out = io.StringIO()
        meta = render.Meta("decode", "a/very/long/model/path/" * 4, "cpu", "bf16", "plain", has_tokenizer=True, top_k=2)
        report = render.DecodeReport(Console(file=out, width=width), meta)
        result = _result()
        report.begin(result.prompt_tokens, 1)
        report.step(result.steps[0])
        report.finish(result)
        outs.append(out.getvalue())
    assert outs[0] == outs[1]


def test_only_render_prints():
    pkg = Path(render.__file__).parent
    for name in ("cli.py", "dumps.py", "inputs.py", "decoding.py"):
        src = (pkg / name).read_text()
        assert not re.search(r"(?<![\w.])print\(|\.echo\(|sys\.std(out|err)\.write", src), name


@pytest.mark.parametrize("text, shown", [
    (' a "b"\n', '" a \\"b\\"\\n"'),
    ("x\ty\\z\r", '"x\\ty\\\\z\\r"'),
    ("\x1b[31m\u200b\u2028\x7f", '"\\u001b[31m\\u200b\\u2028\\u007f"'),
    ("caf\u00e9 \U0001f642", '"caf\u00e9 \U0001f642"'),
    ("\U000e0001", '"\\udb40\\udc01"'),  # an invisible character above U+FFFF: its surrogate pair
])
def test_quote_text(text, shown):
    assert render.quote_text(text) == shown


@given(st.text())
def test_quoted_text_is_one_json_line_without_invisible_characters(text):
    shown = render.quote_text(text)
    assert json.loads(shown) == text
    assert not re.search(r"[\x00-\x1f\x7f-\x9f\u2028\u2029\u200b]", shown)


def test_display_text_keeps_lines_and_hides_terminal_controls():
    assert render.display_text("a b\n\tc\x1b[2J\r") == "a b\n\tc\\u001b[2J\\r"
