"""Snapshots (syrupy) of the plain and JSON output of every command.

Update after an intended change with `pytest tests/test_cli_snapshots.py --snapshot-update` and review the
diff of tests/__snapshots__/test_cli_snapshots.ambr. The embedded default model's snapshots are taken once
metrale_cli/assets/models/default exists (skipped before).
"""

from __future__ import annotations

import json
import re

import pytest

from metrale_cli.model import DEFAULT_MODEL_DIR

LLAMA = "tests/fixtures/models/llama"  # relative: the CLI tests run in the repository root
FORMATS = ["plain", "json"]
HAS_DEFAULT = (DEFAULT_MODEL_DIR / "config.json").is_file()
HAS_DEFAULT_DRAFT = (DEFAULT_MODEL_DIR.parent / "default-draft" / "config.json").is_file()
needs_default = pytest.mark.skipif(not HAS_DEFAULT, reason="the embedded default model is not built yet")


def output(run_cli, *args) -> str:
    r = run_cli(*args, "--device", "cpu")
    assert r.exit_code == 0, r.stderr
    assert r.stderr == ""
    return r.stdout


def without_diff(text: str, fmt: str) -> str:
    """The one-pass-vs-sequential figures depend on the CPU's summation order: check them, then mask them.
    bf16 rows differ by a step or a few; fp32 rows (the CPU default) by the same sums unrounded, ~1e-5."""
    fp32 = "logits_dtype: fp32" in text or '"logits_dtype": "fp32"' in text
    max_diff, max_ulps = (1e-3, 2048) if fp32 else (0.1, 8)
    if fmt == "json":
        doc = json.loads(text)
        diff, ulps, same = (doc[f"{key}_vs_sequential"] for key in ("max_abs_diff", "max_abs_diff_ulps",
                                                                    "rows_identical"))
        assert diff is not None and 0 <= diff < max_diff and 0 <= ulps <= max_ulps and 0 <= same <= doc["k"]
        assert (diff == 0) == (ulps == 0)
        for key in ("max_abs_diff", "max_abs_diff_ulps", "rows_identical"):
            doc[f"{key}_vs_sequential"] = "<masked>"
        return json.dumps(doc, indent=2, ensure_ascii=False)
    m = re.search(r"^max_abs_diff_vs_sequential: (\S+)\nmax_abs_diff_ulps_vs_sequential: (\d+)\n"
                  r"rows_identical_vs_sequential: (\d+)/(\d+)$", text, re.M)
    assert m is not None and 0 <= float(m.group(1)) < max_diff and 0 <= int(m.group(2)) <= max_ulps
    assert int(m.group(3)) <= int(m.group(4))
    return text.replace(m.group(0), "max_abs_diff_vs_sequential: <masked>\nmax_abs_diff_ulps_vs_sequential: "
                                     "<masked>\nrows_identical_vs_sequential: <masked>")


# -- fixture model (no tokenizer) ----------------------------------------------------------------------------------


@pytest.mark.parametrize("fmt", FORMATS)
def test_decode(run_cli, snapshot, fmt):
    assert output(run_cli, "decode", "-m", LLAMA, "-t", "1 2 3", "--steps", 8, "--top-k", 3, "-f", fmt) == snapshot


@pytest.mark.parametrize("fmt", FORMATS)
def test_decode_speculative_ngram(run_cli, snapshot, fmt):
    args = ["decode", "-m", LLAMA, "-t", "5 6 7 8 5 6 7 8 5 6 7", "--steps", 10, "--draft", "ngram", "--k", 3]
    assert output(run_cli, *args, "-f", fmt) == snapshot


@pytest.mark.parametrize("fmt", FORMATS)
def test_decode_speculative_draft_model(run_cli, snapshot, fmt):
    args = ["decode", "-m", LLAMA, "-t", "1 2 3", "--steps", 10, "--draft-model", "tests/fixtures/models/llama_bf16",
            "--k", 2]
    assert output(run_cli, *args, "-f", fmt) == snapshot


@pytest.mark.parametrize("fmt", FORMATS)
def test_verify_self(run_cli, snapshot, fmt):
    text = output(run_cli, "verify", "-m", LLAMA, "-t", "1 2 3", "--k", 4, "-f", fmt)
    assert without_diff(text, fmt) == snapshot


@pytest.mark.parametrize("fmt", FORMATS)
def test_verify_ids(run_cli, snapshot, fmt):
    assert output(run_cli, "verify", "-m", LLAMA, "-t", "1 2 3", "--draft", "270,157,5", "-f", fmt) == snapshot


@pytest.mark.parametrize("fmt", FORMATS)
def test_forward_all_rows(run_cli, snapshot, fmt):
    assert output(run_cli, "forward", "-m", LLAMA, "-t", "1 2 3 4 5", "--rows", "all", "-f", fmt) == snapshot


@pytest.mark.parametrize("fmt", FORMATS)
def test_inspect(run_cli, snapshot, fmt):
    r = run_cli("inspect", "tests/fixtures/models/llama3_rope", "-f", fmt)
    assert r.exit_code == 0 and r.stdout == snapshot


# -- with a tokenizer: token text escaping ---------------------------------------------------------------------------


@pytest.mark.parametrize("fmt", FORMATS)
def test_decode_with_tokenizer(run_cli, tok_model, snapshot, fmt):
    args = ["decode", "-m", tok_model, "-p", "The for statement\n", "--steps", 6, "--top-k", 2, "-f", fmt]
    text = output(run_cli, *args).replace(str(tok_model), "<tok_model>")
    assert text == snapshot


# -- the embedded default model ----------------------------------------------------------------------------------------


@needs_default
@pytest.mark.parametrize("fmt", FORMATS)
def test_default_decode(run_cli, snapshot, fmt):
    assert output(run_cli, "decode", "--steps", 16, "--top-k", 3, "-f", fmt) == snapshot


@needs_default
@pytest.mark.parametrize("fmt", FORMATS)
def test_default_verify(run_cli, snapshot, fmt):
    assert without_diff(output(run_cli, "verify", "--k", 4, "-f", fmt), fmt) == snapshot


@needs_default
@pytest.mark.parametrize("fmt", FORMATS)
def test_default_forward(run_cli, snapshot, fmt):
    assert output(run_cli, "forward", "--rows", "all", "-f", fmt) == snapshot


@needs_default
@pytest.mark.skipif(not HAS_DEFAULT_DRAFT, reason="the embedded draft model is not built yet")
@pytest.mark.parametrize("fmt", FORMATS)
def test_default_speculative(run_cli, snapshot, fmt):
    draft = str(DEFAULT_MODEL_DIR.parent / "default-draft")
    text = output(run_cli, "decode", "-p", "The while statement", "--steps", 24, "--draft-model", draft, "--k", 4,
                  "-f", fmt)
    assert text.replace(draft, "<default-draft>") == snapshot


@needs_default
@pytest.mark.parametrize("fmt", FORMATS)
def test_default_speculative_ngram(run_cli, snapshot, fmt):
    assert output(run_cli, "decode", "--steps", 24, "--draft", "ngram", "--k", 3, "-f", fmt) == snapshot


@needs_default
@pytest.mark.parametrize("fmt", FORMATS)
def test_default_inspect(run_cli, snapshot, fmt):
    r = run_cli("inspect", "-f", fmt)
    assert r.exit_code == 0 and r.stdout == snapshot
