"""The CUDA engine's latent attention (backends/cuda/mla.py) on the CPU, with kernels/mla.cu replaced by NumPy
implementations of its documented contracts (bf16 latent cache, key splits, partials and their combination), each
call bound against the real `MlaKernels` method's signature, and the MoE kernels by tests/test_cuda_moe_plumbing's
stand-ins: the deepseek_v3 (q_lora, interleaved rope, YaRN), deepseek_v3_noq (q_proj, rotate_half rope),
deepseek_v2 (group-limited softmax routing) and glm4_moe_lite (a dense layer between sparse ones) fixtures against the NumPy engine in its naive form, on the rows, fused
and prefill paths; verify equals sequential decode; trim.  Not a test of a kernel: tests/gpu/test_mla_cuda.py is."""

from __future__ import annotations

import inspect
from contextlib import contextmanager

import numpy as np
import pytest

from test_cuda_moe_plumbing import cpu_engine, fake_moe, run_both
from engine_rows import decoded_and_verified
from test_cuda_plumbing import SAME_TOL, TOL, bf16, f32, fake_engine, rel, rows

mla_kernels = pytest.importorskip("metrale_cli.backends.cuda.kernels.mla")
from metrale_cli.backends.cuda import mla as cuda_mla  # noqa: E402

MODELS = ["deepseek_v3", "deepseek_v3_noq", "deepseek_v2", "glm4_moe_lite"]


def _rope(x, pos, inv_freq, scaling, interleave):
    """[..., P] rotated at pos: the rotated evens then odds when interleaved (mla.cu's mla_rope_pair)."""
    half = x.shape[-1] // 2
    x0, x1 = (x[..., 0::2], x[..., 1::2]) if interleave else (x[..., :half], x[..., half:])
    ang = np.float32(pos) * np.asarray(inv_freq, np.float32)
    c, s = np.cos(ang) * np.float32(scaling), np.sin(ang) * np.float32(scaling)
    return np.concatenate([x0 * c - x1 * s, x1 * c + x0 * s], axis=-1)


class FakeMlaKernels:
    """kernels/mla.MlaKernels' contracts in NumPy."""

    def __init__(self, kern):
        self.k = kern
        self.calls: list[tuple[str, dict]] = []

    def __getattribute__(self, name):
        real = getattr(mla_kernels.MlaKernels, name, None)
        attr = object.__getattribute__(self, name)
        if callable(real) and not name.startswith("_") and callable(attr):
            sig = inspect.signature(real)

            def checked(*args, **kwargs):
                bound = sig.bind(None, *args, **kwargs)
                object.__getattribute__(self, "calls").append((name, dict(bound.arguments)))
                return attr(*args, **kwargs)
            return checked
        return attr

    def append(self, kv, positions, norm_w, eps, inv_freq, d, cache, latent, *, attention_scaling=1.0,
               interleave=True, stream=None):
        kv = np.asarray(kv, np.float32)
        c = self.k._normed(kv[:, :d.rank], norm_w, eps, 0.0)
        latent[...] = c
        for m, p in enumerate(np.asarray(positions)):
            pe = _rope(kv[m, d.rank:d.latent], p, inv_freq, attention_scaling, interleave)
            cache[p] = bf16(np.concatenate([c[m], pe]))

    def absorb_q(self, q, kv_b, positions, inv_freq, d, q_cat, *, attention_scaling=1.0, interleave=True,
                 stream=None):
        q = np.asarray(q, np.float32).reshape(q.shape[0], d.heads, d.nope + d.rope)
        w = f32(kv_b).reshape(d.heads, d.nope + d.v, d.rank)
        for m, p in enumerate(np.asarray(positions)):
            lat = np.einsum("hn,hnr->hr", q[m, :, :d.nope], w[:, :d.nope])
            q_cat[m] = np.concatenate([lat, _rope(q[m, :, d.nope:], p, inv_freq, attention_scaling, interleave)], -1)

    def attend(self, q_cat, cache, positions, d, scale, splits, ws_o, ws_ml, *, stream=None):
        tk = mla_kernels.MLA_TK
        o = ws_o[:len(positions) * splits * d.heads * d.rank].reshape(len(positions), splits, d.heads, d.rank)
        ml = ws_ml[:len(positions) * splits * d.heads * 2].reshape(len(positions), splits, d.heads, 2)
        for m, p in enumerate(np.asarray(positions)):
            length = int(p) + 1
            chunk = -(-(-(-length // splits)) // tk) * tk
            for s in range(splits):
                k0, k1 = s * chunk, min(length, (s + 1) * chunk)
                if k0 >= k1:
                    o[m, s], ml[m, s, :, 0], ml[m, s, :, 1] = 0, -np.inf, 0
                    continue
                lat = f32(cache[k0:k1])  # [L, D]
                sc = (q_cat[m] @ lat.T) * np.float32(scale)  # [H, L]
                mx = sc.max(-1)
                e = np.exp(sc - mx[:, None])
                o[m, s], ml[m, s, :, 0], ml[m, s, :, 1] = e @ lat[:, :d.rank], mx, e.sum(-1)

    def out(self, ws_o, ws_ml, kv_b, d, splits, out, *, stream=None):
        n = out.shape[0]
        o = ws_o[:n * splits * d.heads * d.rank].reshape(n, splits, d.heads, d.rank)
        ml = ws_ml[:n * splits * d.heads * 2].reshape(n, splits, d.heads, 2)
        w = f32(kv_b).reshape(d.heads, d.nope + d.v, d.rank)[:, d.nope:]  # [H, V, R]
        g = ml[..., 0].max(1, keepdims=True)
        a = np.where(ml[..., 0] == -np.inf, 0, np.exp(ml[..., 0] - g))  # [n, S, H]
        lat = (a[..., None] * o).sum(1) / (a * ml[..., 1]).sum(1)[..., None]  # [n, H, R]
        out[...] = np.einsum("nhr,hvr->nhv", lat, w).reshape(n, d.heads * d.v)


@contextmanager
def fake_mla():
    orig = cuda_mla.MlaKernels
    cuda_mla.MlaKernels = FakeMlaKernels
    try:
        with fake_moe():
            yield
    finally:
        cuda_mla.MlaKernels = orig


@pytest.mark.parametrize("name", MODELS)
@pytest.mark.parametrize("plen", [12, 20])  # the rows path (<= 16 rows) and the prefill path
def test_latent_attention_matches_the_numpy_engine(name, plen):
    err, derr, calls = run_both(name, plen, fakes=fake_mla)
    print(f"{name} T={plen}: prefill {err:.2e}, decode {derr:.2e}")
    assert err < TOL and derr < TOL
    names = {n for n, _ in calls}
    assert "append" in names
    if plen <= 16:  # the rows path: the absorbed kernels
        assert {"absorb_q", "attend", "out", "route", "gate_up", "down"} <= names
    else:  # the prefill: the naive form through the flash prefill kernel (head dims 24 and 12 padded to 32)
        assert "attention_prefill" in names and "topk_rows" in names
    spec = cpu_engine(name).cfg.definition.layers[0].mixer
    appends = [a for n, a in calls if n == "append"]
    assert all(a["interleave"] == spec.rope_interleave and a["attention_scaling"] == spec.rope.attention_scaling
               for a in appends)
    assert all(a["scale"] == spec.scale for n, a in calls if n == "attend")


@pytest.mark.parametrize("name", ["deepseek_v3", "deepseek_v2"])
@pytest.mark.parametrize("path", ["rows", "fused"])
def test_verify_equals_decode_and_trim(name, path):
    rng = np.random.default_rng()
    prompt = [int(t) for t in rng.integers(0, 300, 10)]
    drafts = [int(t) for t in rng.integers(0, 300, 5)]
    with fake_mla(), fake_engine(name) as gpu:
        gpu.set_path(path)
        seq, ver = decoded_and_verified(gpu, prompt, drafts)
        assert rel(ver, seq) < SAME_TOL
        gpu.trim(12)
        gpu.decode(3)
        after = rows(gpu, gpu.decode_logits_ptr(), 1)
        assert gpu.states["mla"].nbytes == 3 * 64 * (32 + 8) * 2  # layers x context x latent, bf16
    with fake_mla(), fake_engine(name) as fresh:
        fresh.prefill(prompt + drafts[:2])
        fresh.decode(3)
        assert rel(after, rows(fresh, fresh.decode_logits_ptr(), 1)) < SAME_TOL


def test_the_kinds_weights_and_sizes_are_checked():
    from metrale_cli.backends.cuda.loading import mixer_weight_keys, unsupported_features
    from metrale_cli.config import load_config
    from test_cuda_plumbing import FIXTURES

    for name in MODELS:
        cfg = load_config(FIXTURES / name)
        assert unsupported_features(cfg.definition) == []
        assert cuda_mla.sizes_refused(cfg) is None
        assert mixer_weight_keys("mla", cfg.definition.layers[0].keys()) == cuda_mla.WEIGHT_KEYS
    d = mla_kernels.MlaDims(128, 128, 64, 128, 512)  # DeepSeek-V3's
    assert mla_kernels.check_sizes(d) is None and d.attend_smem() <= mla_kernels.SMEM_LIMIT
    assert "kv_lora_rank 1024" in mla_kernels.check_sizes(mla_kernels.MlaDims(16, 128, 64, 128, 1024))
    assert [mla_kernels.splits_for(m, 16, 132) for m in (1, 4, 16)] == [64, 33, 9]
    assert [mla_kernels.splits_for(m, 128, 132) for m in (1, 16)] == [33, 2]  # DeepSeek-V3's 8 head groups


@pytest.mark.parametrize("name", MODELS)
@pytest.mark.parametrize("plen", [12, 20])
def test_the_first_layers_taps_match_the_numpy_engine(name, plen):
    """The first layer's latent attention output and normed latent, whose inputs are the same on both engines up to
    bf16 rounding: a wrong rope pairing, scale or weight slice moves them by 0.1 and more, where the logits after the
    routed layers may hide it (a flipped rope pairing measured 0.46 here and 7e-3 on the logits)."""
    from metrale_cli.engine.observe import tapping

    rng = np.random.default_rng()
    prompt = [int(t) for t in rng.integers(0, 300, plen)]
    got: dict = {}
    cpu = cpu_engine(name)
    with fake_mla(), fake_engine(name) as gpu:
        for e, who in ((gpu, "gpu"), (cpu, "cpu")):
            with tapping(e, lambda n, x, who=who: got.setdefault((who, n), np.array(x))):
                e.prefill(prompt)
    for tap in ("model.layers.0.self_attn", "model.layers.0.self_attn.kv_a_layernorm"):
        err = rel(got[("gpu", tap)], got[("cpu", tap)])
        print(f"{name} T={plen} {tap}: {err:.2e}")
        assert err < 1e-2, tap


@pytest.mark.parametrize("name,params,latent_bytes", [("deepseek-v2-lite", 15.71, 27 * 576 * 2),
                                                      ("moonlight-16b-a3b", 15.96, 27 * 576 * 2),
                                                      ("glm-4.7-flash", 29.94, 47 * 576 * 2)])
def test_the_presets_parse_to_their_published_sizes_and_run_on_cuda(name, params, latent_bytes):
    """configs/deepseek-v2-lite.json, moonlight-16b-a3b.json and glm-4.7-flash.json (`metrale bench`): the real
    configs' shapes (GLM-4.7-Flash's 30B without its multi-token-prediction layer), nothing the CUDA engine refuses,
    the latent cache's bf16 bytes per token the bench's floor counts."""
    from metrale_cli.backends.cuda.loading import check_sizes, unsupported_features
    from metrale_cli.bench import preset_path
    from metrale_cli.floors import kv_bytes_read
    from metrale_cli.config import load_config

    cfg = load_config(preset_path(name))
    assert round(cfg.parameter_count() / 1e9, 2) == params
    assert unsupported_features(cfg.definition) == []
    check_sizes(cfg)
    assert kv_bytes_read(cfg, 1, 2) == latent_bytes


def test_the_absorbed_prefill_for_head_dims_the_flash_kernel_lacks(monkeypatch):
    """Where no flash prefill head_dim holds a head's key and value, the prefill runs the absorbed kernels over the
    chunk's rows: one key split per row, every row in one launch at 20 rows."""
    assert cuda_mla.naive_head_dim(mla_kernels.MlaDims(16, 128, 64, 128, 512)) == 256  # DeepSeek's 192 / 128
    assert cuda_mla.naive_head_dim(mla_kernels.MlaDims(16, 256, 64, 128, 512)) is None
    monkeypatch.setattr(cuda_mla, "naive_head_dim", lambda d: None)
    err, _, calls = run_both("deepseek_v3", 20, fakes=fake_mla)
    assert err < TOL
    assert any(a["splits"] == 1 and len(a["positions"]) == 20 for n, a in calls if n == "attend")
    assert "attention_prefill" not in {n for n, _ in calls}


def test_mla_absorbed_runs_the_absorbed_prefill_and_naive_is_refused_on_cuda():
    """`--mla absorbed --device cuda`: the prefill takes the absorbed kernels too; `--mla naive` is refused by name
    for a latent-attention model (before CuPy is looked for) and ignored for another."""
    from metrale_cli.backends.cuda.loading import load_cuda_engine
    from metrale_cli.config import load_config
    from metrale_cli.errors import DeviceError, UsageError
    from metrale_cli.random_weights import RandomTensors
    from test_cuda_plumbing import FIXTURES

    rng = np.random.default_rng()
    prompt = [int(t) for t in rng.integers(0, 300, 20)]
    with fake_mla(), fake_engine("deepseek_v2") as gpu:
        gpu.mla = "absorbed"
        gpu.prefill(prompt, all_logits=True)
        calls = gpu.states["mla"].kern.calls
        assert any(n == "attend" and len(a["positions"]) == 20 for n, a in calls)
        assert "attention_prefill" not in gpu.kern.calls
    cfg = load_config(FIXTURES / "deepseek_v2")
    with pytest.raises(UsageError, match="--mla naive: the CUDA engine decodes latent attention in the absorbed form"):
        load_cuda_engine(cfg, RandomTensors(cfg), 32, mla="naive")
    llama = load_config(FIXTURES / "llama")  # past the --mla check, to the next refusal (its head_dim 16)
    with pytest.raises(DeviceError, match="head_dim 16 is not supported"):
        load_cuda_engine(llama, RandomTensors(llama), 32, mla="naive")
