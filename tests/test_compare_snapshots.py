"""Snapshots (syrupy) of the plain and JSON output of `metrale compare` and `metrale score`.

Format tests, not numeric goldens (tests/test_compare.py and tests/test_scoring.py check the numbers):
compare runs on seeded synthetic rows written to a temporary directory (its path is masked), score on
the fixture model. Update after an intended change with
`pytest tests/test_compare_snapshots.py --snapshot-update` and review the diff.
"""

from __future__ import annotations

import numpy as np
import pytest

from metrale_cli import layer_dumps as ld

LLAMA = "tests/fixtures/models/llama"
FORMATS = ["plain", "json"]


def masked(r, tmp_path, code=0) -> str:
    assert r.exit_code == code, r.stderr
    return r.stdout.replace(str(tmp_path), "<tmp>")


@pytest.fixture
def logits_pair(tmp_path):
    rng = np.random.default_rng(20261203)  # fixed: the snapshot holds the numbers it gives
    a = (rng.standard_normal((6, 50)) * 3).astype(np.float32)
    b = (a + 0.01 * rng.standard_normal(a.shape)).astype(np.float32)
    top2 = np.argsort(a[4])[-2:]
    b[4, top2] = a[4, top2[::-1]]  # row 4: B prefers A's second choice
    np.save(tmp_path / "a.npy", a)
    np.save(tmp_path / "b.npy", b)
    return tmp_path / "a.npy", tmp_path / "b.npy"


@pytest.mark.parametrize("fmt", FORMATS)
def test_compare_logits(run_cli, snapshot, tmp_path, logits_pair, fmt):
    r = run_cli("compare", *logits_pair, "--rows", "--max-kl", "0.1", "--min-top1", "0.9", "-f", fmt)
    assert masked(r, tmp_path, 9) == snapshot


@pytest.mark.parametrize("fmt", FORMATS)
def test_compare_layers(run_cli, snapshot, tmp_path, fmt):
    rng = np.random.default_rng(20261204)
    names = ld.layer_tap_names(range(2))
    a = {n: rng.standard_normal((3, 8)).astype(np.float32) for n in names}
    b = {n: (v * np.float32(1.02 if i >= 5 else 1.0)).astype(np.float32) for i, (n, v) in enumerate(a.items())}
    info = ld.LayerDumpInfo("forward", LLAMA, [1, 2, 3], [0, 1])
    ld.write_layer_dump(tmp_path / "a.safetensors", a, [0, 1, 2], info)
    ld.write_layer_dump(tmp_path / "b.npz", b, [0, 1, 2], info)
    r = run_cli("compare", tmp_path / "a.safetensors", tmp_path / "b.npz", "-f", fmt)
    assert masked(r, tmp_path) == snapshot


@pytest.mark.parametrize("fmt", FORMATS)
def test_score(run_cli, snapshot, tmp_path, fmt):
    r = run_cli("score", "-m", LLAMA, "-t", "1 2 3 4 5 6", "--top-k", 2, "--device", "cpu", "-f", fmt)
    assert masked(r, tmp_path) == snapshot
