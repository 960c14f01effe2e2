"""`metrale compare`: its statistics against an independent computation on fresh random rows, planted
differences (the first row / first tensor that exceeds is the planted one), every input format read
bit for bit, and the exit codes 0, 9, 5 and 2."""

from __future__ import annotations

import json
import math
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest

from metrale_cli import layer_dumps as ld
from metrale_cli.compare import Tolerances, compare_layers, compare_logits, run_compare
from metrale_cli.compare_inputs import Matrix, ReadOptions, read_input
from metrale_cli.errors import InputError, UsageError

LLAMA = "tests/fixtures/models/llama"


def fresh(rows=40, vocab=301, noise=0.05):
    seed = int(np.random.default_rng().integers(2**31))
    rng = np.random.default_rng(seed)
    a = (rng.standard_normal((rows, vocab)) * rng.uniform(1, 4)).astype(np.float32)
    b = (a + noise * rng.standard_normal(a.shape)).astype(np.float32)
    return a, b, seed, rng


def matrices(a, b, positions=None):
    return (Matrix("A", Path("a.npy"), "npy array", "fp32", a, positions),
            Matrix("B", Path("b.npy"), "npy array", "fp32", b, positions))


# -- an independent computation: plain float64 loops, softmax by explicit probabilities ----------------------------


def llama_cpp_percentile(values, fraction):
    """perplexity.cpp's percentile(): linear interpolation between the sorted values."""
    v = sorted(values)
    if fraction <= 0:
        return v[0]
    if fraction >= 1:
        return v[-1]
    p = fraction * (len(v) - 1)
    ip = int(p)
    p -= ip
    return (1 - p) * v[ip] + p * v[min(ip + 1, len(v) - 1)]


def reference_rows(a, b):
    out = []
    for x, y in zip(a.astype(np.float64), b.astype(np.float64)):
        p = np.exp(x - x.max())
        p /= p.sum()
        q = np.exp(y - y.max())
        q /= q.sum()
        t = int(np.argmax(x))
        d = x - y
        out.append({
            "kl": float(np.sum(p * np.log(p / q))), "dp": float(q[t] - p[t]), "argmax_a": t,
            "argmax_b": int(np.argmax(y)),
            "max_abs_diff": float(np.max(np.abs(d))), "rel_err": float(np.max(np.abs(d)) / np.max(np.abs(x))),
            "nmse": float(np.mean(d ** 2) / np.var(x)), "cosine": float(x @ y / math.sqrt((x @ x) * (y @ y))),
            "rel_diff": float(1 - 2 * (x @ y) / (x @ x + y @ y)),
            **{f"top{k}": len(set(np.argsort(-x, kind="stable")[:k]) & set(np.argsort(-y, kind="stable")[:k])) / k
               for k in (5, 10)},
        })
    return out


def test_statistics_match_an_independent_computation():
    a, b, seed, rng = fresh()
    b[3] += 3 * rng.standard_normal(a.shape[1]).astype(np.float32)  # a few rows far apart, for the tails
    b[17] = a[17][::-1]
    r = compare_logits(*matrices(a, b), keep_rows=True)
    ref = reference_rows(a, b)
    msg = f"seed {seed}"
    for row, want in zip(r.row_stats, ref):
        assert row.kl == pytest.approx(want["kl"], rel=1e-9, abs=1e-15), msg
        assert row.dp == pytest.approx(want["dp"], rel=1e-9, abs=1e-15), msg
        assert (row.argmax_a, row.argmax_b) == (want["argmax_a"], want["argmax_b"]), msg
        for key in ("max_abs_diff", "rel_err", "nmse", "cosine", "rel_diff"):
            assert getattr(row.errors, key) == pytest.approx(want[key], rel=1e-9, abs=1e-15), (key, msg)
        assert row.top_overlap == {5: want["top5"], 10: want["top10"]}, msg
    kl = [w["kl"] for w in ref]
    dp = [w["dp"] for w in ref]
    sm = r.softmax
    assert sm.kl_mean == pytest.approx(sum(kl) / len(kl), rel=1e-9) and sm.kl_max == pytest.approx(max(kl))
    assert sm.kl_min == pytest.approx(min(kl), rel=1e-9)
    for q in (99.9, 99, 95, 90, 50, 10, 5, 1, 0.1):
        assert sm.kl_percentiles[f"{q:g}"] == pytest.approx(llama_cpp_percentile(kl, q / 100), rel=1e-9), (q, msg)
    for q in (99.9, 99, 95, 90, 75, 50, 25, 10, 5, 1, 0.1):
        assert sm.dp_percentiles[f"{q:g}"] == pytest.approx(llama_cpp_percentile(dp, q / 100), rel=1e-9, abs=1e-15)
    assert sm.dp_mean == pytest.approx(sum(dp) / len(dp), rel=1e-9, abs=1e-15)
    assert sm.dp_rms == pytest.approx(math.sqrt(sum(x * x for x in dp) / len(dp)), rel=1e-9)
    agree = sum(w["argmax_a"] == w["argmax_b"] for w in ref)
    assert r.top1_agree == agree and sm.same_top_p_pct == pytest.approx(100 * agree / len(ref))
    assert r.top_overlap[5] == pytest.approx(np.mean([w["top5"] for w in ref]))
    # overall: one pool of every value, not a mean of rows
    x, y = a.astype(np.float64).ravel(), b.astype(np.float64).ravel()
    o = r.overall
    assert o.max_abs_diff == pytest.approx(np.max(np.abs(x - y))) and o.max_abs_a == np.max(np.abs(x))
    assert o.rel_err == pytest.approx(np.max(np.abs(x - y)) / np.max(np.abs(x)), rel=1e-12)
    assert o.nmse == pytest.approx(np.mean((x - y) ** 2) / np.var(x), rel=1e-9), msg
    assert o.cosine == pytest.approx(x @ y / math.sqrt((x @ x) * (y @ y)), rel=1e-12)
    assert o.rel_diff == pytest.approx(1 - 2 * (x @ y) / (x @ x + y @ y), rel=1e-9)
    mism = {m.row: m for m in r.mismatches}
    assert sorted(mism) == [i for i, w in enumerate(ref) if w["argmax_a"] != w["argmax_b"]] and 17 in mism
    m = mism[17]
    assert (m.a_token, m.b_token) == (ref[17]["argmax_a"], ref[17]["argmax_b"])
    assert (m.a_logit, m.b_logit_at_a, m.a_logit_at_b, m.b_logit) == (
        a[17, m.a_token], b[17, m.a_token], a[17, m.b_token], b[17, m.b_token])
    assert m.margin_a == pytest.approx(float(a[17, m.a_token]) - float(a[17, m.b_token])) and m.margin_a > 0


def test_statistics_agree_with_torch():
    torch = pytest.importorskip("torch")
    a, b, seed, _ = fresh(rows=16, vocab=1000, noise=0.3)
    r = compare_logits(*matrices(a, b), keep_rows=True)
    la = torch.log_softmax(torch.from_numpy(a).double(), -1)
    lb = torch.log_softmax(torch.from_numpy(b).double(), -1)
    kl = torch.nn.functional.kl_div(lb, la, log_target=True, reduction="none").sum(-1).numpy()
    assert np.allclose([s.kl for s in r.row_stats], kl, rtol=1e-9, atol=0), f"seed {seed}"
    cos = torch.nn.functional.cosine_similarity(torch.from_numpy(a).double(), torch.from_numpy(b).double(), -1)
    assert np.allclose([s.errors.cosine for s in r.row_stats], cos.numpy(), rtol=1e-12)


def test_identical_inputs_agree_exactly():
    a, _, seed, _ = fresh()
    r = compare_logits(*matrices(a, a.copy()), Tolerances(max_kl=0, max_rel_err=0, min_top1=1))
    assert r.overall.max_abs_diff == 0 and r.overall.rel_err == 0 and r.overall.nmse == 0
    assert r.overall.rel_diff == pytest.approx(0, abs=1e-15) and r.softmax.kl_max == pytest.approx(0, abs=1e-15)
    assert r.top1_agree == r.rows and r.mismatches == [] and r.passed is True and r.failures == []


@pytest.mark.parametrize("tolerance", ["max_kl", "max_rel_err", "min_top1"])
def test_one_planted_row_is_the_first_that_exceeds(tolerance):
    a, b, seed, rng = fresh(noise=1e-4)
    planted = int(rng.integers(5, a.shape[0]))
    if tolerance == "min_top1":  # only the argmax moves: swap A's top two tokens in B
        b = a.copy()
        top2 = np.argsort(a[planted])[-2:]
        b[planted, top2] = a[planted, top2[::-1]]
        tol = Tolerances(min_top1=1.0)
    else:
        b[planted] += rng.standard_normal(a.shape[1]).astype(np.float32)
        tol = Tolerances(max_kl=1e-3) if tolerance == "max_kl" else Tolerances(max_rel_err=1e-2)
    r = compare_logits(*matrices(a, b, list(range(10, 10 + a.shape[0]))), tol)
    assert r.passed is False and r.first_exceeding is not None, f"seed {seed}"
    assert r.first_exceeding.row == planted and r.first_exceeding.position == planted + 10, f"seed {seed}"
    assert r.exceeding_rows == 1 and len(r.failures) == 1
    loose = compare_logits(*matrices(a, b), Tolerances(max_kl=1e9, max_rel_err=1e9, min_top1=0))
    assert loose.passed is True and loose.first_exceeding is None


def test_nonfinite_rows_are_reported_and_fail_a_check():
    a, b, seed, _ = fresh(rows=6, noise=1e-5)
    b[4, 7] = np.nan
    r = compare_logits(*matrices(a, b))
    assert r.nonfinite_rows == [4] and r.passed is None and r.top1_agree == 5
    assert math.isfinite(r.overall.max_abs_diff) and math.isfinite(r.softmax.kl_max)
    checked = compare_logits(*matrices(a, b), Tolerances(max_kl=1.0))
    assert checked.passed is False and checked.first_exceeding.row == 4
    assert checked.first_exceeding.reasons == ["NaN/Inf in A or B"]


# -- layer dumps --------------------------------------------------------------------------------------------------


def layer_dump(taps, positions=None):
    return ld.LayerDump(Path("x.safetensors"), dict(taps), positions, None)


def test_planted_layer_perturbation_is_the_first_divergence():
    rng = np.random.default_rng(seed := int(np.random.default_rng().integers(2**31)))
    names = ld.layer_tap_names(range(12))
    a = {n: rng.standard_normal((4, 32)).astype(np.float32) for n in names}
    planted = names.index(str(rng.choice(names[5:-1])))
    b = {}
    for i, (n, v) in enumerate(a.items()):  # everything from the planted tensor on differs, as in a forward
        scale = 1e-6 if i < planted else 5e-2
        b[n] = (v + scale * rng.standard_normal(v.shape)).astype(np.float32)
    r = compare_layers(layer_dump(a), layer_dump(b), rtol=1e-3)
    assert r.first_divergence is not None and r.first_divergence.name == names[planted], f"seed {seed}"
    assert r.before_max_rel_err <= 1e-5 and r.passed is False
    assert [t.name for t in r.tensors] == names
    line = r.divergence_line()
    t = r.first_divergence
    first_row = next(k for k in range(4) if np.abs(a[names[planted]][k] - b[names[planted]][k]).max()
                     > 1e-3 * np.abs(a[names[planted]]).max())
    assert t.first_row == first_row and t.row_rel_err[first_row] > 1e-3
    assert line.startswith(f"first divergence: {names[planted]} at row {first_row}, rel err ")
    assert "everything before it <=" in line
    x, y = a[names[planted]].astype(np.float64), b[names[planted]].astype(np.float64)
    t = r.tensors[planted]
    assert t.errors.rel_err == pytest.approx(np.max(np.abs(x - y)) / np.max(np.abs(x)), rel=1e-12)
    assert t.errors.nmse == pytest.approx(np.mean((x - y) ** 2) / np.var(x), rel=1e-9)
    assert t.worst_row == int(np.unravel_index(np.argmax(np.abs(x - y)), x.shape)[0])
    assert compare_layers(layer_dump(a), layer_dump(b), rtol=1.0).passed is True


def test_layer_compare_names_missing_tensors_and_refuses_shape_mismatch():
    rng = np.random.default_rng()
    a = {n: rng.standard_normal((3, 8)).astype(np.float32) for n in ld.layer_tap_names([0, 1])}
    b = {n: v for n, v in a.items() if n != "model.layers.1.mlp"}
    b["model.layers.0.mlp.gate"] = rng.standard_normal((3, 2)).astype(np.float32)
    r = compare_layers(layer_dump(a), layer_dump(b))
    assert r.only_a == ["model.layers.1.mlp"] and r.only_b == ["model.layers.0.mlp.gate"]
    assert r.first_divergence is None and r.passed is None
    b["model.norm"] = rng.standard_normal((3, 9)).astype(np.float32)
    with pytest.raises(InputError, match=r"model.norm: A .* is \[3, 8\] and B .* is \[3, 9\]"):
        compare_layers(layer_dump(a), layer_dump(b))
    with pytest.raises(InputError, match="no position in common"):
        compare_layers(layer_dump(a, [0, 1, 2]), layer_dump(a, [5, 6, 7]))


@pytest.mark.reference
def test_hf_hook_dumps_find_the_perturbed_layer_of_a_checkpoint_copy(tmp_path):
    """One layer's MLP perturbed in a copy of a checkpoint: dumps written by transformers forward hooks
    (the module names are the HF ones), compared, name that layer's mlp as the first divergence."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    model = transformers.AutoModelForCausalLM.from_pretrained(LLAMA, dtype=torch.float32,
                                                              attn_implementation="eager").eval()
    ids = torch.from_numpy(np.random.default_rng().integers(0, 300, 9))[None]
    layer = 1

    def dump(m, path):
        taps, hooks = {}, []
        names = ld.layer_tap_names(range(m.config.num_hidden_layers))
        modules = dict(m.named_modules())
        for name in names:
            def hook(_mod, _inp, out, name=name):
                taps[name] = (out[0] if isinstance(out, tuple) else out)[0].detach().numpy()
            hooks.append(modules[name].register_forward_hook(hook))
        with torch.no_grad():
            m(ids)
        for h in hooks:
            h.remove()
        ld.write_layer_dump(path, {n: taps[n] for n in names}, list(range(ids.shape[1])),
                            ld.LayerDumpInfo("forward", LLAMA, ids[0].tolist(), list(range(2))))

    dump(model, tmp_path / "a.safetensors")
    with torch.no_grad():
        w = model.model.layers[layer].mlp.down_proj.weight
        w.add_(0.05 * torch.randn_like(w))
    dump(model, tmp_path / "b.npz")
    r = run_compare(str(tmp_path / "a.safetensors"), str(tmp_path / "b.npz"), ReadOptions(), Tolerances(rtol=1e-4))
    assert r.first_divergence.name == f"model.layers.{layer}.mlp"
    assert r.before_max_rel_err == 0.0  # the same weights before it: bit-identical
    assert r.positions == list(range(ids.shape[1]))


# -- reading every format bit for bit -----------------------------------------------------------------------------


def bf16_case(rng, rows=5, vocab=67):
    x = (rng.standard_normal((rows, vocab)) * 5).astype(np.float32).astype(ml_dtypes.bfloat16)
    return x.view(np.uint16), x.astype(np.float32)  # the bit patterns, and their exact float32 values


def test_plain_npy_in_every_dtype(tmp_path):
    rng = np.random.default_rng()
    f32 = rng.standard_normal((4, 50)).astype(np.float32)
    f16 = rng.standard_normal((4, 50)).astype(np.float16)
    f64 = rng.standard_normal((4, 50))
    bits, bf16 = bf16_case(rng)
    for name, arr in (("f32", f32), ("f16", f16), ("f64", f64), ("bits", bits), ("batch", f32[None])):
        np.save(tmp_path / f"{name}.npy", arr)
    opts = ReadOptions()
    assert read_input(tmp_path / "f32.npy", "A", opts).values.tobytes() == f32.tobytes()
    assert read_input(tmp_path / "batch.npy", "A", opts).values.tobytes() == f32.tobytes()
    assert np.array_equal(read_input(tmp_path / "f16.npy", "A", opts).values, f16.astype(np.float32))
    m = read_input(tmp_path / "f64.npy", "A", opts)
    assert m.values.dtype == np.float64 and m.values.tobytes() == f64.tobytes() and m.dtype == "f64"
    m = read_input(tmp_path / "bits.npy", "A", ReadOptions(dtype="bf16"))
    assert m.dtype == "bf16" and m.values.tobytes() == bf16.tobytes()
    m = read_input(tmp_path / "bits.npy", "A", ReadOptions(dtype="f16"))
    assert np.array_equal(m.values, bits.view(np.float16).astype(np.float32), equal_nan=True)
    with pytest.raises(InputError, match="pass --dtype bf16"):
        read_input(tmp_path / "bits.npy", "B", opts)


def test_raw_bin_needs_vocab_and_dtype(tmp_path):
    rng = np.random.default_rng()
    bits, bf16 = bf16_case(rng, rows=3, vocab=40)
    bits.astype("<u2").tofile(tmp_path / "x.bin")
    m = read_input(tmp_path / "x.bin", "B", ReadOptions(vocab=40, dtype="bf16"))
    assert m.shape == (3, 40) and m.values.tobytes() == bf16.tobytes() and m.source == "raw .bin"
    f32 = rng.standard_normal((6, 20)).astype("<f4")
    f32.tofile(tmp_path / "y.bin")
    assert read_input(tmp_path / "y.bin", "B", ReadOptions(vocab=20, dtype="f32")).values.tobytes() == f32.tobytes()
    f16 = rng.standard_normal((2, 10)).astype("<f2")
    f16.tofile(tmp_path / "z.bin")
    assert np.array_equal(read_input(tmp_path / "z.bin", "B", ReadOptions(vocab=10, dtype="f16")).values,
                          f16.astype(np.float32))
    with pytest.raises(InputError, match="needs --vocab N and --dtype"):
        read_input(tmp_path / "x.bin", "B", ReadOptions())
    with pytest.raises(InputError, match="not a whole number of bf16 rows of 41"):
        read_input(tmp_path / "x.bin", "B", ReadOptions(vocab=41, dtype="bf16"))


def test_safetensors_named_tensor(tmp_path):
    from safetensors.numpy import save_file

    rng = np.random.default_rng()
    _, bf16 = bf16_case(rng)
    f32 = rng.standard_normal((5, 67)).astype(np.float32)
    save_file({"out": bf16.astype(ml_dtypes.bfloat16), "other": f32, "ids": np.arange(3)},
              str(tmp_path / "t.safetensors"))
    m = read_input(tmp_path / "t.safetensors", "B", ReadOptions(tensor="out"))
    assert m.dtype == "bf16" and m.values.tobytes() == bf16.tobytes() and m.source == "safetensors tensor 'out'"
    m = read_input(tmp_path / "t.safetensors", "B", ReadOptions(tensor="x", tensor_b="other"))
    assert m.values.tobytes() == f32.tobytes()
    with pytest.raises(InputError, match="no tensor named 'nope'"):
        read_input(tmp_path / "t.safetensors", "B", ReadOptions(tensor="nope"))
    with pytest.raises(InputError, match="dtype I64"):
        read_input(tmp_path / "t.safetensors", "B", ReadOptions(tensor="ids"))
    np.savez(tmp_path / "t.npz", logits=f32)
    assert read_input(tmp_path / "t.npz", "A", ReadOptions(tensor="logits")).values.tobytes() == f32.tobytes()


@pytest.mark.parametrize("dtype", ["bf16", "fp32"])
@pytest.mark.parametrize("ext", ["safetensors", "npy", "bin"])
def test_metrale_logits_dumps_read_bit_for_bit(run_cli, tmp_path, ext, dtype):
    """Every one of metrale's own dump formats, read back with their positions, equals the rows the
    engine produced (the dump's bytes, decoded independently here)."""
    path = tmp_path / f"rows.{ext}"
    r = run_cli("decode", "-m", LLAMA, "-t", "5 6 7", "--steps", 4, "--logits-dtype", dtype, "--device", "cpu",
                "-f", "json", "--dump-logits", path)
    assert r.exit_code == 0, r.stderr
    m = read_input(path, "A", ReadOptions())
    raw = path.read_bytes()
    if ext == "safetensors":
        n = int.from_bytes(raw[:8], "little")
        raw = raw[8 + n:8 + n + 4 * 300 * (4 if dtype == "fp32" else 2)]
    elif ext == "npy":
        raw = np.load(path).tobytes()
    bits = np.frombuffer(raw, "<f4" if dtype == "fp32" else "<u2")
    want = bits if dtype == "fp32" else (bits.astype(np.uint32) << 16).view(np.float32)
    assert m.values.tobytes() == want.tobytes() and m.shape == (4, 300)
    assert m.dtype == dtype and m.source.startswith("metrale logits dump")
    assert m.positions == [2, 3, 4, 5]


# -- the command -----------------------------------------------------------------------------------------------


def as_json(r):
    assert r.exit_code in (0, 9), r.stderr
    return json.loads(r.stdout)


def test_cli_fp32_against_bf16_dump_of_the_same_pass(run_cli, tmp_path):
    a, b = tmp_path / "a.safetensors", tmp_path / "b.npy"
    for path, dtype in ((a, "fp32"), (b, "bf16")):
        r = run_cli("forward", "-m", LLAMA, "-t", "1 2 3 4 5 6", "--rows", "all", "--logits-dtype", dtype,
                    "--device", "cpu", "-f", "json", "--dump-logits", path)
        assert r.exit_code == 0, r.stderr
    doc = as_json(run_cli("compare", a, b, "-f", "json", "--rows", "--max-rel-err", "1e-2", "--min-top1", "0.5"))
    assert doc["kind"] == "logits" and doc["rows"] == 6 and doc["vocab"] == 300 and doc["passed"] is True
    assert doc["a"] == {"path": str(a), "source": "metrale logits dump (.safetensors)", "dtype": "fp32",
                        "shape": [6, 300]}
    assert doc["b"]["dtype"] == "bf16"
    # bf16 rounding: at most half a bf16 ulp (2^-8 relative) of each value
    assert 0 < doc["overall"]["rel_err"] <= 2 ** -8
    assert [row["position"] for row in doc["row_stats"]] == [0, 1, 2, 3, 4, 5]
    assert set(doc["softmax"]["kl_percentiles"]) == {"99.9", "99", "95", "90", "50", "10", "5", "1", "0.1"}
    plain = run_cli("compare", a, b, "-f", "plain")
    assert plain.exit_code == 0 and "check: not run" in plain.stdout and "kl_p99.9: " in plain.stdout
    rich = run_cli("compare", a, b, "-f", "rich", "--rows")
    assert rich.exit_code == 0 and "KL(P_A||P_B)" in rich.stdout


def test_cli_exit_9_names_the_first_row_exceeding(run_cli, tmp_path):
    a, b, seed, rng = fresh(rows=12, vocab=50, noise=1e-6)
    b[7] += rng.standard_normal(50).astype(np.float32)
    np.save(tmp_path / "a.npy", a)
    np.save(tmp_path / "b.npy", b)
    r = run_cli("compare", tmp_path / "a.npy", tmp_path / "b.npy", "--max-kl", "1e-4", "-f", "json")
    assert r.exit_code == 9, f"seed {seed}: {r.stderr}"
    doc = json.loads(r.stdout)  # the report is printed before the failure
    assert doc["passed"] is False and doc["first_exceeding"]["row"] == 7 and doc["exceeding_rows"] == 1
    line = r.stderr.strip()
    assert line.startswith("metrale: outputs differ: ") and "row 7" in line and "\n" not in line
    assert run_cli("compare", tmp_path / "a.npy", tmp_path / "b.npy", "--max-kl", "1e9").exit_code == 0


def test_cli_layer_dumps_exit_9_at_the_first_divergence(run_cli, tmp_path):
    rng = np.random.default_rng()
    names = ld.layer_tap_names(range(3))
    a = {n: rng.standard_normal((2, 16)).astype(np.float32) for n in names}
    b = dict(a)
    b["model.layers.1.self_attn"] = a["model.layers.1.self_attn"] * np.float32([[1.0], [1.01]])  # row 1 only
    info = ld.LayerDumpInfo("forward", "m", [1, 2], [0, 1, 2])
    ld.write_layer_dump(tmp_path / "a.safetensors", a, [0, 1], info)
    ld.write_layer_dump(tmp_path / "b.npz", b, [0, 1], info)
    r = run_cli("compare", tmp_path / "a.safetensors", tmp_path / "b.npz", "--rtol", "1e-3", "-f", "plain")
    assert r.exit_code == 9
    rel = np.abs(b["model.layers.1.self_attn"] - a["model.layers.1.self_attn"]).max() / \
        np.abs(a["model.layers.1.self_attn"]).max()
    assert f"first divergence: model.layers.1.self_attn at position 1, rel err {rel:.1e}" in r.stdout
    assert "everything before it <= 0.0e+00" in r.stdout and "check: FAILED" in r.stdout
    assert r.stderr.startswith("metrale: outputs differ: first divergence: model.layers.1.self_attn")
    doc = as_json(run_cli("compare", tmp_path / "a.safetensors", tmp_path / "b.npz", "-f", "json"))
    assert doc["kind"] == "layers" and doc["passed"] is None and doc["rtol"] == 1e-3
    assert doc["first_divergence"]["name"] == "model.layers.1.self_attn" and doc["first_divergence"]["position"] == 1
    assert [p["first_exceeding"] for p in doc["by_position"]] == [None, "model.layers.1.self_attn"]
    assert [t["name"] for t in doc["tensors"]] == names


@pytest.mark.parametrize("case, words", [
    ("vocab", ["[3, 40]", "[3, 41]", "vocabularies"]),
    ("rows", ["[3, 40]", "[4, 40]"]),
    ("kinds", ["logits matrix", "layer dump"]),
    ("missing", ["B: ", "no such file"]),
    ("stats", ["--dump-stats file"]),
])
def test_cli_input_errors_exit_5(run_cli, tmp_path, case, words):
    rng = np.random.default_rng()
    np.save(tmp_path / "a.npy", rng.standard_normal((3, 40)).astype(np.float32))
    b = tmp_path / "b.npy"
    if case == "vocab":
        np.save(b, rng.standard_normal((3, 41)).astype(np.float32))
    elif case == "rows":
        np.save(b, rng.standard_normal((4, 40)).astype(np.float32))
    elif case == "kinds":
        b = tmp_path / "b.npz"
        ld.write_layer_dump(b, {"model.norm": np.ones((1, 4), np.float32)}, [0], ld.LayerDumpInfo("f", "m", [1], []))
    elif case == "stats":
        b = tmp_path / "b.json"
        ld.write_layer_stats(b, {"model.norm": np.ones((1, 4), np.float32)}, [0], ld.LayerDumpInfo("f", "m", [1], []))
    r = run_cli("compare", tmp_path / "a.npy", b)
    assert r.exit_code == 5, r.stderr
    assert r.stderr.startswith("metrale: input error: ") and r.stderr.count("\n") == 1
    assert all(w in r.stderr for w in words), r.stderr


@pytest.mark.parametrize("args, words", [
    (["--rtol", "1e-3"], ["--rtol applies to layer dumps"]),
    (["--dtype", "f8"], ["--dtype must be one of"]),
    (["--min-top1", "2"], ["--min-top1"]),
    (["--max-kl", "-1"], ["--max-kl must be a number >= 0"]),
])
def test_cli_usage_errors_exit_2(run_cli, tmp_path, args, words):
    np.save(tmp_path / "a.npy", np.random.default_rng().standard_normal((2, 8)).astype(np.float32))
    r = run_cli("compare", tmp_path / "a.npy", tmp_path / "a.npy", *args)
    assert r.exit_code == 2 and all(w in r.stderr for w in words), r.stderr


def test_cli_needs_two_files(run_cli):
    r = run_cli("compare")
    assert r.exit_code == 2 and "compare needs two files" in r.stderr


def test_compare_help_has_examples(run_cli):
    r = run_cli("compare", "--help")
    assert r.exit_code == 0 and "metrale compare" in r.stdout.split("Examples:")[1]


def test_run_compare_rejects_logits_tolerances_for_layer_dumps(tmp_path):
    info = ld.LayerDumpInfo("f", "m", [1], [])
    ld.write_layer_dump(tmp_path / "a.npz", {"model.norm": np.ones((1, 4), np.float32)}, [0], info)
    with pytest.raises(UsageError, match="apply to logits"):
        run_compare(str(tmp_path / "a.npz"), str(tmp_path / "a.npz"), ReadOptions(), Tolerances(max_kl=1))
    with pytest.raises(UsageError, match="--rows lists logits rows"):
        run_compare(str(tmp_path / "a.npz"), str(tmp_path / "a.npz"), ReadOptions(), Tolerances(), keep_rows=True)
