"""render on its own: token text escaping, number formats, the JSON layout, format choice."""

from __future__ import annotations

import io
import json
import re
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st
from rich.cells import cell_len
from rich.console import Console

from metrale_cli import render
from metrale_cli.decoding.results import (DecodeResult, DecodeStep, ForwardResult, ForwardRow, HiddenSummary,
                                          SpecDecodeResult, SpecStats, Timings, TopK, VerifyResult, VerifyRow,
                                          summarize_hidden)
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
    from metrale_cli.render.common import counted

    assert counted(1, "row") == "1 row" and counted(0, "row") == "0 rows" and counted(2, "token") == "2 tokens"


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
    pkg = Path(render.__file__).parent.parent
    files = [pkg / "dumps.py", pkg / "inputs.py", *sorted((pkg / "cli").glob("*.py")),
             *sorted((pkg / "decoding").glob("*.py"))]
    for path in files:
        src = path.read_text()
        assert not re.search(r"(?<![\w.])print\(|\.echo\(|sys\.std(out|err)\.write", src), path.name


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


# -- rich tables fit the terminal (80 and 120 columns): no line wider, nothing split over two lines --------------

LONG = "\u2581a_very_long_token_text_that_goes_on_and_on"
WORST_HIDDEN = np.array([-1.23456e-05, -123456.0, 1.5e-38, -9.87654e-10, 3.0, -0.000123456, 7.77777e+18,
                         -4.4444e-07, 0.5], dtype=np.float32)


def _worst_decode(top_k: int, spec: bool = False) -> DecodeResult:
    steps = []
    for i in range(4):
        cands = [TopK(151935 - r, LONG if r % 2 == 0 else "\n", -123.4567 + r, 0.9876 / (r + 1)) for r in range(top_k)]
        steps.append(DecodeStep(99990 + i, cands[0].token if cands else 151935, LONG, -123.4567, cands))
    hidden = summarize_hidden(WORST_HIDDEN)
    timings = Timings(load_s=12.5, prefill_s=1.25, step_s=[0.5, 0.25, 0.125])
    if spec:
        stats = SpecStats(8, "model", 3, 24, 20, [3] * 8, [3, 3, 3, 3, 2, 2, 2, 1])
        return SpecDecodeResult(list(range(99990)), steps, True, None, hidden, timings, "x", stats=stats,
                                plain_tokens_per_s=1234.5, spec_tokens_per_s=2345.6)
    return DecodeResult([1, 2, 3], steps, True, None, hidden, timings, LONG * 3)


def _rendered(width: int, draw) -> list[str]:
    out = io.StringIO()
    draw(Console(file=out, width=width, color_system=None))
    return out.getvalue().splitlines()


def _fits(lines: list[str], width: int) -> None:
    too_wide = [line for line in lines if cell_len(line) > width]
    assert not too_wide, too_wide


@pytest.mark.parametrize("width", [80, 120])
@pytest.mark.parametrize("top_k", [0, 5])
def test_rich_decode_fits_and_keeps_each_candidate_on_one_line(width, top_k):
    meta = render.Meta("decode", "a/" * 50 + "model", "cpu", "bf16", "rich", prompt=LONG, has_tokenizer=True,
                       top_k=top_k, timings=True, draft_model="d/" * 40)
    for spec in (False, True):
        result = _worst_decode(top_k, spec)
        lines = _rendered(width, lambda c: render.DecodeReport(c, meta).finish(result, True))
        _fits(lines, width)
        for s in result.steps:
            for cand in s.top_k:  # token, text, logit, probability and the whole bar on one line
                pattern = (rf"^\u2502 +(?:{s.position})? +\u2502 +{cand.token} \u2502 .+ \u2502 +"
                           rf"{render.f4(cand.logit)} \u2502 {render.f4(cand.prob)} \u2502 [\u2588\u00b7]{{10,20}} +\u2502$")
                assert sum(bool(re.match(pattern, line)) for line in lines) >= 1, (cand, lines)
            if not top_k:
                assert any(re.match(rf"^\u2502 +{s.position} \u2502 +{s.token} \u2502 .+ \u2502 +"
                                    rf"{render.f4(s.logit)} \u2502$", line) for line in lines)
        _hidden_values_whole(lines, result.hidden)


def _hidden_values_whole(lines: list[str], h) -> None:
    """Every statistic whole, and the first values on lines of their own (four each, none wrapped)."""
    words = {w for line in lines for w in line.split()}
    first = [line.split() for line in lines if line.startswith("first[")]
    assert [w for line in first for w in line[1:]] == [f"{x:.6g}" for x in h.first]
    for x in (h.norm, h.mean, h.std, h.min, h.max):
        assert f"{x:.6g}" in words
    assert h.sha256 in words


@pytest.mark.parametrize("width", [80, 120])
def test_rich_verify_and_forward_fit_with_one_line_rows(width):
    meta = render.Meta("verify", "m", "cuda", "bf16", "rich", has_tokenizer=True, timings=True)
    rows = [VerifyRow(99990 + i, 151935, 151900 + i, [True, False, None, None][i], 123.4567, LONG, LONG)
            for i in range(4)]
    hidden = summarize_hidden(WORST_HIDDEN)
    r = VerifyResult(4, "model", [1, 2], rows, 1, 151936, LONG, 0.0625, None, hidden,
                     Timings(load_s=1.0, prefill_s=0.5, step_s=[0.25]), 1, 3)
    lines = _rendered(width, lambda c: render.render_verify(c, meta, r))
    _fits(lines, width)
    marks = {"accepted": "\u2713", "rejected": "\u2717", "unchecked": "\u00b7"}
    for row in rows:
        assert any(re.match(rf"^\u2502 +{row.position} \u2502 +{row.draft} \u2502 +{row.target} \u2502 "
                            rf"{marks[row.status]} \u2502 +{render.f4(row.margin)} \u2502 .+ \u2502 .+ \u2502$", line)
                   for line in lines), (row, lines)
    _hidden_values_whole(lines, hidden)
    fmeta = render.Meta("forward", "m", "cpu", "fp32", "rich", has_tokenizer=True)
    f = ForwardResult(list(range(99990, 99994)), [ForwardRow(i, 151935, LONG, -123.4567) for i in range(4)],
                      None, hidden, Timings(prefill_s=0.5))
    lines = _rendered(width, lambda c: render.render_forward(c, fmeta, f))
    _fits(lines, width)
    for i in range(4):
        assert any(re.match(rf"^\u2502 +{i} \u2502 +{99990 + i} \u2502 +151935 \u2502 .+ \u2502 +-123.4567 \u2502$",
                            line) for line in lines)


@pytest.mark.parametrize("width", [80, 120])
def test_rich_inspect_and_bench_fit(width):
    from metrale_cli.bench import BenchResult, Figure

    info = {"command": "inspect", "model": "p/" * 60, "architecture": "LlamaForCausalLM", "model_type": "llama",
            "layers": 32, "heads": 32, "kv_heads": 8, "head_dim": 128, "hidden": 4096, "intermediate": 14336,
            "vocab": 128256, "max_position_embeddings": 131072, "sliding_window": None, "parameters": 8030261248,
            "dtype": "bfloat16", "dtypes": {"BF16": 291}, "tensors": 291, "shards": 4,
            "files": [f"model-0000{i}-of-00004.safetensors" for i in range(1, 5)], "bytes": 16060522496,
            "tied_embeddings": False, "rope": {"theta": 500000.0, "type": "llama3", "scaling": {
                "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                "original_max_position_embeddings": 8192}, "rotary_fraction": 1.0},
            "sliding_layers": list(range(0, 32, 2)), "sliding_rope": {"theta": 10000.0, "type": "default",
                                                                     "scaling": None, "rotary_fraction": 0.75},
            "attn_logit_softcapping": 50.0, "final_logit_softcapping": 30.0, "attention_scale": 0.0625,
            "norm": "rmsnorm (1 + w)", "post_norms": True, "activation": "gelu_tanh", "embed_scale": 64.0,
            "tokenizer": True, "bos_token_id": 128000, "eos_token_ids": [128001, 128008, 128009], "valid": False,
            "problems": "tensor model.layers.0.self_attn.q_proj.weight has shape [4096, 4096], config.json needs "
                        "[4096, 4096] and more words to make it wrap"}
    _fits(_rendered(width, lambda c: render.render_inspect(c, "rich", info)), width)
    res = BenchResult("llama-3.1-8b", "cuda", 8192, 8030261248, 16060522496, 1073741824, notes=["n" * 150])
    res.figures = [Figure("decode + argmax (host wall)", 5.123, "ms", "tokens/s = 1000 / this"),
                   Figure("GEMM rate", 773.1, "TFLOP/s", "measured ceiling (bf16 on GPU, fp32 on CPU)"),
                   Figure("decode step", 4.94, "ms", "<= 1.15 x floor", 1.45, False)]
    _fits(_rendered(width, lambda c: render.render_bench(c, "rich", res)), width)
