"""compare pairs rows by position: a forward dump against a decode dump (real dumps written by the commands)
compares the positions both hold and names the others; --positions selects; rows that ran different tokens
are refused; without positions rows pair by index."""

from __future__ import annotations

import json

import numpy as np
import pytest

from metrale_cli.align import align_rows, describe, parse_positions
from metrale_cli.errors import InputError, UsageError

LLAMA = "tests/fixtures/models/llama"
PROMPT = [1, 2, 3, 4, 5]
STEPS = 16


@pytest.fixture
def dumps(run_cli, tmp_path):
    """(forward dump of prompt + every decoded token, decode dump): logits .npy and layer .safetensors."""
    dec = run_cli("decode", "-m", LLAMA, "-t", " ".join(map(str, PROMPT)), "--steps", STEPS, "--ignore-eos",
                  "--logits-dtype", "fp32", "--device", "cpu", "-f", "json", "--dump-logits", tmp_path / "dec.npy",
                  "--dump-layers", tmp_path / "dec.safetensors")
    assert dec.exit_code == 0, dec.stderr
    tokens = PROMPT + [s["token"] for s in json.loads(dec.stdout)["steps"]]
    fwd = run_cli("forward", "-m", LLAMA, "-t", " ".join(map(str, tokens)), "--rows", "all", "--logits-dtype",
                  "fp32", "--device", "cpu", "-f", "json", "--dump-logits", tmp_path / "fwd.npy",
                  "--dump-layers", tmp_path / "fwd.safetensors")
    assert fwd.exit_code == 0, fwd.stderr
    return tmp_path, tokens


def _json(r):
    assert r.exit_code == 0, r.stderr
    return json.loads(r.stdout)


def test_forward_against_decode_logits_compares_the_common_positions(run_cli, dumps):
    d, tokens = dumps
    doc = _json(run_cli("compare", d / "fwd.npy", d / "dec.npy", "--rows", "--max-rel-err", "1e-4", "-f", "json"))
    n = len(tokens)  # forward rows at 0..n-1; decode rows at 4..19 (the last token is never fed back)
    assert doc["rows"] == STEPS and doc["passed"] is True and doc["top1"]["agree"] == STEPS
    assert [s["position"] for s in doc["row_stats"]] == list(range(4, 4 + STEPS))
    assert doc["only_a_positions"] == [0, 1, 2, 3, n - 1] and doc["only_b_positions"] == []
    plain = run_cli("compare", d / "fwd.npy", d / "dec.npy", "-f", "plain")
    assert plain.exit_code == 0
    assert f"alignment: compared 4..19 (16); only in A: 0..3, {n - 1}; only in B: none\n" in plain.stdout
    rich = run_cli("compare", d / "dec.npy", d / "fwd.npy", "-f", "rich")
    assert rich.exit_code == 0 and "only in B: 0..3, 20" in rich.stdout


def test_positions_select_and_unknown_positions_are_named(run_cli, dumps):
    d, _ = dumps
    doc = _json(run_cli("compare", d / "fwd.npy", d / "dec.npy", "--positions", "5..7,19", "--rows", "-f", "json"))
    assert [s["position"] for s in doc["row_stats"]] == [5, 6, 7, 19] and doc["positions_selected"] is True
    r = run_cli("compare", d / "fwd.npy", d / "dec.npy", "--positions", "2,30")
    assert r.exit_code == 5 and "--positions [2, 30] are not on both sides (positions on both: 4..19)" in r.stderr
    r = run_cli("compare", d / "fwd.npy", d / "dec.npy", "--positions", "7..5")
    assert r.exit_code == 2 and "'7..5' is not a position or a range" in r.stderr


def test_forward_against_decode_layer_dumps(run_cli, dumps):
    d, tokens = dumps
    doc = _json(run_cli("compare", d / "fwd.safetensors", d / "dec.safetensors", "--rtol", "1e-4", "-f", "json"))
    # decode's layer dump holds the rows its logits dump holds: the row that chose each token, positions P-1..
    p = len(PROMPT)
    assert doc["kind"] == "layers" and doc["positions"] == list(range(p - 1, len(tokens) - 1))
    assert doc["only_a_positions"] == list(range(p - 1)) + [len(tokens) - 1] and doc["passed"] is True
    doc = _json(run_cli("compare", d / "fwd.safetensors", d / "dec.safetensors", "--positions", f"{p}..{p + 2}",
                        "-f", "json"))
    assert doc["positions"] == [p, p + 1, p + 2] and all(t["shape"][0] == 3 for t in doc["tensors"])


def test_rows_that_ran_other_tokens_are_refused(run_cli, dumps):
    d, tokens = dumps
    other = tokens[:10] + [(tokens[10] + 1) % 300] + tokens[11:]
    r = run_cli("forward", "-m", LLAMA, "-t", " ".join(map(str, other)), "--rows", "all", "--logits-dtype", "fp32",
                "--device", "cpu", "--dump-logits", d / "other.npy")
    assert r.exit_code == 0, r.stderr
    r = run_cli("compare", d / "other.npy", d / "dec.npy")
    assert r.exit_code == 5 and "A and B ran different tokens from position 10" in r.stderr, r.stderr


def test_rows_without_positions_pair_by_index(tmp_path, run_cli):
    a = np.random.default_rng(0).standard_normal((3, 40)).astype(np.float32)
    np.save(tmp_path / "a.npy", a)
    np.save(tmp_path / "b.npy", a[:2])
    r = run_cli("compare", tmp_path / "a.npy", tmp_path / "a.npy", "-f", "json")
    assert r.exit_code == 0 and json.loads(r.stdout)["only_a_positions"] == []
    r = run_cli("compare", tmp_path / "a.npy", tmp_path / "b.npy")
    assert r.exit_code == 5 and "neither side says which position each row is for" in r.stderr


def test_align_rows_and_parse_positions():
    al = align_rows(5, 3, [0, 1, 2, 3, 4], [3, 4, 9])
    assert (al.rows_a, al.rows_b, al.positions, al.only_a, al.only_b) == ([3, 4], [0, 1], [3, 4], [0, 1, 2], [9])
    assert describe(al) == "compared 3..4 (2); only in A: 0..2; only in B: 9"
    # token ids alone (one per row) number the rows 0..n-1
    al = align_rows(3, 2, None, [1, 2], [7, 8, 9], None)
    assert al.positions == [1, 2] and al.only_a == [0]
    with pytest.raises(InputError, match="no position in common"):
        align_rows(2, 2, [0, 1], [2, 3])
    assert parse_positions("5..7, 2") == [2, 5, 6, 7] and parse_positions(None) is None
    with pytest.raises(UsageError):
        parse_positions("a")
