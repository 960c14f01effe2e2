"""Layer dumps: layer selection, forward order, both formats written and read back bit for bit (and by
the reference readers: the safetensors library and np.load), --dump-stats against an independent
computation, and the atomic writes."""

from __future__ import annotations

import hashlib
import json
import os

import numpy as np
import pytest

from metrale_cli import dumps, layer_dumps as ld
from metrale_cli.errors import InputError, OutputError, UsageError


def fresh_taps(layers, rows=5, width=24, seed=None):
    seed = int(np.random.default_rng().integers(2**31)) if seed is None else seed
    rng = np.random.default_rng(seed)
    names = ld.layer_tap_names(layers)
    taps = {n: (rng.standard_normal((rows, width)) * rng.uniform(0.1, 10)).astype(np.float32) for n in names}
    taps["model.layers.0.mlp.gate"] = rng.standard_normal((rows, 4)).astype(np.float32)  # a family extra, another width
    taps = {n: taps[n] for n in ld.forward_order(list(taps))}
    positions = list(range(3, 3 + rows))
    tokens = list(rng.integers(0, 300, 3 + rows))
    info = ld.LayerDumpInfo("forward", "tests/fixtures/models/llama", tokens, list(layers))
    return taps, positions, info, seed


# -- --layers ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("spec, expected", [
    ("0,5,-1", [0, 5, 11]), ("-1", [11]), ("-12", [0]), ("3 1 3", [1, 3]), ("all", list(range(12))),
    (None, list(range(12))), ("0, -1", [0, 11]), ("11,-1", [11]),
])
def test_parse_layers(spec, expected):
    assert ld.parse_layers(spec, 12) == expected


@pytest.mark.parametrize("spec, error, words", [
    ("12", InputError, ["layer 12", "12 layers"]), ("-13", InputError, ["layer -13"]),
    ("1,x", UsageError, ["'x'"]), ("", UsageError, ["empty"]), (" , ", UsageError, ["empty"]),
    ("1.5", UsageError, ["'1.5'"]),
])
def test_parse_layers_rejects(spec, error, words):
    with pytest.raises(error) as e:
        ld.parse_layers(spec, 12)
    assert all(w in str(e.value) for w in words), str(e.value)


def test_forward_order_is_the_order_of_the_forward():
    expected = ["model.embed_tokens",
                "model.layers.2.input_layernorm", "model.layers.2.self_attn", "model.layers.2.post_attention_layernorm",
                "model.layers.2.pre_feedforward_layernorm", "model.layers.2.mlp.gate", "model.layers.2.mlp",
                "model.layers.2.post_feedforward_layernorm", "model.layers.2",
                "model.layers.10.self_attn", "model.layers.10.mlp", "model.layers.10", "model.norm", "lm_head"]
    shuffled = list(np.random.default_rng().permutation(expected))
    assert ld.forward_order(shuffled) == expected
    fine = [f"model.layers.0.{s}" for s in (
        "input_layernorm", "self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.q_rope",
        "self_attn.k_rope", "self_attn.o_proj.input", "self_attn", "post_attention_layernorm", "mlp.gate_proj",
        "mlp.up_proj", "mlp.down_proj.input", "mlp")] + ["model.layers.0"]
    assert ld.forward_order(list(np.random.default_rng().permutation(fine))) == fine
    latent = [f"model.layers.0.{s}" for s in (  # latent attention with DeepSeek-V3.2's indexer, a sparse MLP
        "input_layernorm", "self_attn.kv_a_layernorm", "self_attn.indexer", "self_attn", "post_attention_layernorm",
        "mlp.gate", "mlp.gate.top_k_index", "mlp.gate.top_k_weights", "mlp")]
    assert ld.forward_order(list(np.random.default_rng().permutation(latent))) == latent
    assert ld.layer_tap_names([10, 2]) == ["model.embed_tokens", "model.layers.2.self_attn", "model.layers.2.mlp",
                                           "model.layers.2", "model.layers.10.self_attn", "model.layers.10.mlp",
                                           "model.layers.10", "model.norm"]


# -- the formats -----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("ext", ["safetensors", "npz"])
def test_write_then_read_is_bit_exact(tmp_path, ext):
    taps, positions, info, seed = fresh_taps([0, 1, 10])
    path = tmp_path / f"layers.{ext}"
    ld.write_layer_dump(path, taps, positions, info)
    back = ld.read_layer_dump(path)
    assert list(back.tensors) == list(taps), f"seed {seed}"
    for name, arr in taps.items():
        assert back.tensors[name].dtype == np.float32
        assert back.tensors[name].tobytes() == arr.tobytes(), f"{name}, seed {seed}"
    assert back.positions == positions and back.tokens == [int(t) for t in info.tokens]
    assert back.metadata["format"] == ld.FORMAT and back.source == "metrale layer dump"
    assert sorted(p.name for p in tmp_path.iterdir()) == [path.name]  # no temp file left


def test_safetensors_dump_reads_with_the_safetensors_library(tmp_path):
    from safetensors import safe_open

    taps, positions, info, seed = fresh_taps([0, 1])
    path = tmp_path / "layers.safetensors"
    ld.write_layer_dump(dumps.DumpTarget("--dump-layers", path, "safetensors"), taps, positions, info)
    with safe_open(str(path), "np") as f:
        meta = f.metadata()
        assert set(f.keys()) == set(taps) | {"positions", "tokens"}
        for name, arr in taps.items():
            assert np.array_equal(f.get_tensor(name), arr), f"seed {seed}"
        assert f.get_tensor("positions").dtype == np.int64 and f.get_tensor("positions").tolist() == positions
        assert f.get_tensor("tokens").tolist() == [int(t) for t in info.tokens]
    assert meta["command"] == "forward" and meta["model"] == info.model and meta["rows"] == str(len(positions))
    assert json.loads(meta["layers"]) == [0, 1] and json.loads(meta["order"]) == list(taps)


def test_npz_dump_reads_with_np_load(tmp_path):
    taps, positions, info, seed = fresh_taps([3])
    path = tmp_path / "layers.npz"
    ld.write_layer_dump(path, taps, positions, info)
    with np.load(path, allow_pickle=False) as z:
        assert z.files == list(taps) + ["positions", "tokens", "__metadata__"]  # members in forward order
        for name, arr in taps.items():
            assert z[name].dtype == np.float32 and np.array_equal(z[name], arr), f"seed {seed}"
        assert z["positions"].tolist() == positions
        meta = json.loads(str(z["__metadata__"]))
    assert meta["format"] == ld.FORMAT and json.loads(meta["order"]) == list(taps)


def test_foreign_dump_without_metadata_is_read_in_forward_order(tmp_path):
    """Another engine's dump: module-named tensors in any order and dtype, a batch dimension of one."""
    import ml_dtypes
    from safetensors.numpy import save_file

    rng = np.random.default_rng()
    names = ld.layer_tap_names([0, 1, 2])
    order = list(rng.permutation(names))
    arrays = {n: rng.standard_normal((1, 4, 16)).astype(np.float32) for n in order}
    arrays["model.layers.1.mlp"] = arrays["model.layers.1.mlp"].astype(ml_dtypes.bfloat16)
    save_file(arrays, str(tmp_path / "theirs.safetensors"))
    back = ld.read_layer_dump(tmp_path / "theirs.safetensors", "B")
    assert list(back.tensors) == names and back.positions is None and back.source == "layer tensors"
    assert np.array_equal(back.tensors["model.layers.1.mlp"], arrays["model.layers.1.mlp"][0].astype(np.float32))
    assert back.tensors["model.norm"].shape == (4, 16)


def test_read_rejects_what_is_not_a_layer_dump(tmp_path):
    bad = tmp_path / "bad.safetensors"
    bad.write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not json}      ")
    with pytest.raises(InputError, match="A: .*bad.safetensors: not a readable safetensors file"):
        ld.read_layer_dump(bad, "A")
    with pytest.raises(InputError, match="no such file"):
        ld.read_layer_dump(tmp_path / "missing.npz", "A")
    np.savez(tmp_path / "ints.npz", **{"model.norm": np.arange(6).reshape(2, 3)})
    with pytest.raises(InputError, match="dtype int64"):
        ld.read_layer_dump(tmp_path / "ints.npz")


def test_writer_rejects_wrong_shapes_and_reserved_names(tmp_path):
    taps, positions, info, _ = fresh_taps([0])
    with pytest.raises(ValueError, match="expected \\[4, width\\]"):
        ld.write_layer_dump(tmp_path / "x.npz", taps, positions[:4], info)
    with pytest.raises(ValueError, match="reserved"):
        ld.write_layer_dump(tmp_path / "x.npz", {"positions": np.zeros((5, 2), np.float32)}, positions, info)
    assert list(tmp_path.iterdir()) == []


def test_failed_write_leaves_the_destination_as_it_was(tmp_path, monkeypatch):
    taps, positions, info, _ = fresh_taps([0, 1])
    path = tmp_path / "layers.npz"
    path.write_bytes(b"old")
    real_write = os.write
    calls = {"n": 0}

    def failing_write(fd, data):
        calls["n"] += 1
        if calls["n"] == 3:
            raise OSError(28, "No space left on device")
        return real_write(fd, data)

    monkeypatch.setattr(os, "write", failing_write)
    with pytest.raises(OutputError, match="no space left on device"):
        ld.write_layer_dump(path, taps, positions, info)
    assert path.read_bytes() == b"old" and sorted(p.name for p in tmp_path.iterdir()) == ["layers.npz"]


@pytest.mark.parametrize("stats", [False, True])
def test_write_layers_follows_the_checked_target(tmp_path, stats):
    taps, positions, info, _ = fresh_taps([0])
    target = ld.check_layer_dump_path(str(tmp_path / ("s.json" if stats else "d.npz")), stats=stats)
    ld.write_layers(target, taps, positions, info)
    if stats:
        assert json.loads(target.path.read_text())["format"] == ld.STATS_FORMAT
    else:
        assert list(ld.read_layer_dump(target.path).tensors) == list(taps)


def test_check_layer_dump_path(tmp_path):
    assert ld.check_layer_dump_path(str(tmp_path / "a.safetensors")).kind == "safetensors"
    assert ld.check_layer_dump_path(str(tmp_path / "a.npz")).kind == "npz"
    assert ld.check_layer_dump_path(str(tmp_path / "a.json"), stats=True).kind == "json"
    with pytest.raises(UsageError, match="unknown extension '.npy'"):
        ld.check_layer_dump_path(str(tmp_path / "a.npy"))
    with pytest.raises(UsageError, match="with --dump-stats"):
        ld.check_layer_dump_path(str(tmp_path / "a.npz"), stats=True)
    with pytest.raises(UsageError, match="stdout"):
        ld.check_layer_dump_path("-")
    with pytest.raises(OutputError, match="does not exist"):
        ld.check_layer_dump_path(str(tmp_path / "nope" / "a.npz"))


# -- --dump-stats -------------------------------------------------------------------------------------------------


def test_stats_match_an_independent_computation(tmp_path):
    taps, positions, info, seed = fresh_taps([0, 1, 2])
    taps["model.layers.1.mlp"][2, 3] = np.nan
    taps["model.layers.1.mlp"][0, 0] = -np.inf
    taps["model.layers.2"][:] = np.inf  # nothing finite
    path = tmp_path / "stats.json"
    ld.write_layer_stats(path, taps, positions, info)
    doc = json.loads(path.read_text())
    assert doc["format"] == ld.STATS_FORMAT and doc["positions"] == positions and doc["layers"] == [0, 1, 2]
    assert [t["name"] for t in doc["tensors"]] == list(taps)
    assert ld.is_stats_file(path)
    for t in doc["tensors"]:
        arr = taps[t["name"]]
        assert t["shape"] == list(arr.shape)
        assert t["sha256"] == hashlib.sha256(arr.astype("<f4").tobytes()).hexdigest()
        vals = [float(v) for v in arr.reshape(-1) if np.isfinite(v)]
        assert t["nan"] == sum(v != v for v in arr.reshape(-1).tolist())
        assert t["inf"] == sum(abs(v) == float("inf") for v in arr.reshape(-1).tolist())
        if not vals:
            assert t["min"] is None and t["mean"] is None and t["sum"] is None
            continue
        mean = sum(vals) / len(vals)
        assert t["min"] == min(vals) and t["max"] == max(vals) and t["abs_max"] == max(map(abs, vals))
        assert t["mean"] == pytest.approx(mean, rel=1e-12, abs=1e-12), f"seed {seed}"
        assert t["sum"] == pytest.approx(sum(vals), rel=1e-12, abs=1e-12)
        assert t["std"] == pytest.approx((sum((v - mean) ** 2 for v in vals) / len(vals)) ** 0.5, rel=1e-10)
