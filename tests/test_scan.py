"""`metrale inspect --scan`: NaN and Inf counted per tensor from the bit patterns (issue 11, item 2).

The reference counts come from numpy / ml_dtypes decoding the same values (np.isnan, np.isinf), on
fresh random tensors with NaN and Inf planted at random places.
"""

from __future__ import annotations

import json

import ml_dtypes
import numpy as np
import pytest

from metrale_cli.scan import count_nonfinite

# safetensors dtype -> the numpy type holding it, and whether the format has an Inf encoding
TYPES = {
    "F16": (np.float16, True), "BF16": (ml_dtypes.bfloat16, True), "F32": (np.float32, True),
    "F64": (np.float64, True), "F8_E5M2": (ml_dtypes.float8_e5m2, True),
    "F8_E4M3": (ml_dtypes.float8_e4m3fn, False), "F8_E4M3FNUZ": (ml_dtypes.float8_e4m3fnuz, False),
    "F8_E5M2FNUZ": (ml_dtypes.float8_e5m2fnuz, False),
}


def planted(rng, np_type, has_inf: bool, n: int = 5000) -> np.ndarray:
    x = rng.standard_normal(n).astype(np.float32)
    x[rng.choice(n, int(rng.integers(1, 40)), replace=False)] = np.nan
    if has_inf:
        x[rng.choice(n, int(rng.integers(1, 40)), replace=False)] = rng.choice([np.inf, -np.inf])
    with np.errstate(invalid="ignore", over="ignore"):
        return x.astype(np_type)


@pytest.mark.parametrize("dtype", sorted(TYPES))
@pytest.mark.parametrize("chunk", [7, 64, 1 << 20])  # chunk boundaries inside and across elements
def test_counts_match_numpy(dtype, chunk):
    np_type, has_inf = TYPES[dtype]
    x = planted(np.random.default_rng(), np_type, has_inf)
    as_f32 = x.astype(np.float32)
    want = (int(np.isnan(as_f32).sum()), int(np.isinf(as_f32).sum()))
    assert want[0] > 0 and (want[1] > 0) == has_inf
    assert count_nonfinite(x.view(np.uint8), dtype, chunk_bytes=chunk) == want


def test_finite_values_and_non_float_types_count_nothing():
    rng = np.random.default_rng()
    finite = rng.standard_normal(1000).astype(np.float32)
    assert count_nonfinite(finite.view(np.uint8), "F32") == (0, 0)
    ints = rng.integers(0, 2**31, 1000, dtype=np.int32)  # bit patterns of NaN among them: not floats
    ints[:10] = np.float32(np.nan).view(np.int32)
    assert count_nonfinite(ints.view(np.uint8), "I32") == (0, 0)


@pytest.fixture
def poisoned_bf16(tmp_path, helpers):
    """The bf16 fixture with NaN and Inf planted in two tensors; returns (dir, expected entries)."""
    d = helpers.copy_model(tmp_path / "bad", name="llama_bf16")
    rng = np.random.default_rng()
    expected = {}

    def plant(t):
        for name, nan, inf in (("model.norm.weight", int(rng.integers(1, 5)), 0),
                               ("model.layers.1.mlp.down_proj.weight", int(rng.integers(1, 9)),
                                int(rng.integers(1, 9)))):
            flat = t[name].reshape(-1)
            where = rng.choice(flat.size, nan + inf, replace=False)
            flat[where[:nan]] = np.nan
            flat[where[nan:]] = np.inf
            expected[name] = {"name": name, "dtype": "BF16", "nan": nan, "inf": inf}

    helpers.edit_tensors(d, plant)
    return d, expected


def test_inspect_scan_json_lists_the_tensors_with_their_counts(run_cli, poisoned_bf16):
    d, expected = poisoned_bf16
    r = run_cli("inspect", d, "--scan", "-f", "json")
    assert r.exit_code == 0, r.stderr
    doc = json.loads(r.stdout)
    assert doc["scanned"] is True
    assert sorted(doc["nonfinite"], key=lambda t: t["name"]) == sorted(expected.values(), key=lambda t: t["name"])


def test_inspect_scan_plain_and_rich(run_cli, poisoned_bf16):
    d, expected = poisoned_bf16
    plain = run_cli("inspect", d, "--scan", "-f", "plain").stdout
    assert "nonfinite: 2 tensors hold NaN or Inf" in plain
    for t in expected.values():
        assert f"  {t['name']}: BF16: {t['nan']} NaN, {t['inf']} Inf" in plain
    rich = run_cli("inspect", d, "--scan", "-f", "rich").stdout
    assert "2 tensors hold NaN or Inf" in rich and "model.layers.1.mlp.down_proj.weight" in rich


def test_without_scan_inspect_says_it_did_not_look(run_cli, poisoned_bf16):
    d, _ = poisoned_bf16
    doc = json.loads(run_cli("inspect", d, "-f", "json").stdout)
    assert doc["scanned"] is False and doc["nonfinite"] is None
    assert "nonfinite: not scanned (--scan reads every tensor)" in run_cli("inspect", d, "-f", "plain").stdout


def test_scan_of_a_clean_checkpoint_finds_none(run_cli, helpers):
    r = run_cli("inspect", helpers.LLAMA, "--scan", "-f", "json")
    doc = json.loads(r.stdout)
    assert r.exit_code == 0 and doc["scanned"] is True and doc["nonfinite"] == []
    assert "nonfinite: none" in run_cli("inspect", helpers.LLAMA, "--scan", "-f", "plain").stdout
