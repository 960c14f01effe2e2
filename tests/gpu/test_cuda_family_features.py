"""Issue 13 on the GPU: Gemma 2 / 3, Phi-3 / Phi-4-mini and sliding windows, kernels and engine.

Kernels against float64 NumPy references on fresh random data: windowed and softcapped attention
(decode / verify and prefill, head_dim 64 / 96 / 128 / 256; cache rows that a kernel must skip hold NaN,
so reading one shows), partial rotary with the (1 + w) q/k norm, the gelu_tanh gated GEMVs with the
(1 + w) fused norm, the post-norm add, the embedding scale and the logit softcap.  The engine against the
NumPy engine on fresh random checkpoints of each new family, with windows the prompts and decoding cross
(tolerances as tests/gpu/test_cuda_engine.py), verify == sequential decode, trim, graph replay == eager,
longrope across its switch.  And the window is not just masked: a 512-window decode at a long context
costs about what a 512-context decode costs.
"""

from __future__ import annotations

import json
import math
import time
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest
from safetensors.numpy import save_file

from metrale_cli import decoding
from metrale_cli.config import parse_config
from metrale_cli.model import open_model
from metrale_cli.random_weights import RandomTensors

from gpu_helpers import (assert_close, bf16_bits, bits_f32, decoded_and_verified, gelu_tanh, rand_bf16, rel, rows,
                         tokens_agree)

pytestmark = pytest.mark.gpu

LOG2E = 1.4426950408889634


# -- references ---------------------------------------------------------------------------------------------


def ref_attention_ext(q, kf, vf, positions, scale, window=None, softcap=None):
    """float64: row m sees keys (p - window, p] (p = positions[m]), scores softcapped before the mask."""
    M, nh, hd = q.shape
    n_kv = kf.shape[0]
    G = nh // n_kv
    out = np.zeros((M, nh, hd))
    for m in range(M):
        p = int(positions[m])
        lo = 0 if window is None else max(0, p - window + 1)
        K = kf[:, lo:p + 1].astype(np.float64)
        V = vf[:, lo:p + 1].astype(np.float64)
        s = np.einsum("kgd,kld->kgl", q[m].astype(np.float64).reshape(n_kv, G, hd), K) * scale
        if softcap is not None:
            s = softcap * np.tanh(s / softcap)
        s -= s.max(axis=-1, keepdims=True)
        e = np.exp(s)
        out[m] = (np.einsum("kgl,kld->kgd", e, V) / e.sum(axis=-1, keepdims=True)).reshape(nh, hd)
    return out


def random_cache(rng, n_kv, max_ctx, hd, valid_from, valid_to):
    """bf16 K/V bits: finite in rows valid_from..valid_to-1, NaN elsewhere (rows a kernel must not read)."""
    kb = bf16_bits(rng.standard_normal((n_kv, max_ctx, hd), dtype=np.float32))
    vb = bf16_bits(rng.standard_normal((n_kv, max_ctx, hd), dtype=np.float32))
    for b in (kb, vb):
        b[:, :valid_from] = 0x7FC0
        b[:, valid_to:] = 0x7FC0
    return kb, vb


# -- attention kernels -------------------------------------------------------------------------------------


@pytest.mark.parametrize("hd,n_kv,G", [(64, 2, 2), (96, 4, 1), (128, 2, 4), (256, 2, 2)])
@pytest.mark.parametrize("M", [1, 5, 16])
@pytest.mark.parametrize("window,softcap", [(300, None), (97, 20.0), (None, 5.0), (1, None)])
def test_decode_window_and_softcap(cp, kernels, rng, seed, hd, n_kv, G, M, window, softcap):
    nh, ctx = n_kv * G, 1500
    positions = (ctx - M + np.arange(M)).astype(np.int32)
    rng.shuffle(positions)  # verify rows in any order
    # Rows before the first split the window needs (aligned down to 64 keys) are never read: NaN there.
    first = 0 if window is None else (max(0, int(positions.min()) - window + 1) // 64) * 64
    kb, vb = random_cache(rng, n_kv, ctx + 7, hd, first, ctx)
    q = rng.standard_normal((M, nh, hd), dtype=np.float32) * np.float32(2.0)  # scores large enough to cap
    out = cp.full((M, nh, hd), np.nan, dtype=cp.float32)
    scale = 1.0 / math.sqrt(hd)
    kernels.attention_decode(cp.asarray(q), cp.asarray(kb), cp.asarray(vb), cp.asarray(positions), out, scale,
                             window=window, softcap=softcap)
    ref = ref_attention_ext(q, bits_f32(kb), bits_f32(vb), positions, scale, window, softcap)
    assert_close(cp.asnumpy(out), ref, seed)


def test_decode_window_graph_replay_as_positions_move(cp, kernels, rng, seed):
    """One captured launch serves every step: the window's first split moves with the positions."""
    hd, n_kv, G, ctx, window = 128, 2, 4, 2000, 200
    nh = n_kv * G
    kb, vb = random_cache(rng, n_kv, ctx, hd, 0, ctx)
    q = cp.asarray(rng.standard_normal((1, nh, hd), dtype=np.float32))
    pos = cp.zeros(1, dtype=cp.int32)
    out = cp.zeros((1, nh, hd), dtype=cp.float32)
    ws = cp.zeros(kernels.decode_workspace_size(1, nh, hd, 33), dtype=cp.float32)
    k, v = cp.asarray(kb), cp.asarray(vb)
    s = cp.cuda.Stream(non_blocking=True)
    with s:
        kernels.attention_decode(q, k, v, pos, out, 0.1, n_splits=33, workspace=ws, window=window, stream=s)
    s.synchronize()
    s.begin_capture()
    kernels.attention_decode(q, k, v, pos, out, 0.1, n_splits=33, workspace=ws, window=window, stream=s)
    graph = s.end_capture()
    for p in (5, 199, 200, 777, 1999):
        pos.set(np.array([p], np.int32), stream=s)
        graph.launch(stream=s)
        s.synchronize()
        ref = ref_attention_ext(cp.asnumpy(q), bits_f32(kb), bits_f32(vb), np.array([p]), 0.1, window)
        assert_close(cp.asnumpy(out), ref, seed)


@pytest.mark.parametrize("hd,n_kv,G", [(64, 2, 2), (96, 2, 2), (128, 1, 4), (256, 2, 1)])
@pytest.mark.parametrize("start,T,window,softcap", [
    (0, 130, None, None), (0, 300, 37, None), (250, 129, 100, 30.0), (1000, 64, 512, None), (0, 70, None, 8.0)])
def test_prefill_window_softcap_and_new_head_dims(cp, kernels, rng, seed, hd, n_kv, G, start, T, window, softcap):
    from metrale_cli.backends.cuda.kernels import prefill_bk

    nh = n_kv * G
    bk = prefill_bk(hd)
    first = 0 if window is None else (max(0, start - window + 1) // bk) * bk  # the first tile read
    kb, vb = random_cache(rng, n_kv, start + T + 9, hd, first, start + T)
    q = rng.standard_normal((T, nh, hd), dtype=np.float32) * np.float32(2.0)
    out = cp.full((T, nh, hd), np.nan, dtype=cp.float32)
    scale = 1.0 / math.sqrt(hd)
    kernels.attention_prefill(cp.asarray(q), cp.asarray(kb), cp.asarray(vb), start, T, out, scale,
                              window=window, softcap=softcap)
    ref = ref_attention_ext(q, bits_f32(kb), bits_f32(vb), start + np.arange(T), scale, window, softcap)
    assert_close(cp.asnumpy(out), ref, seed)


def test_windowed_decode_reads_only_the_window(cp, kernels, rng):
    """A 512-window decode step at 64k context takes about what a 512-context step takes (the splits
    cover only the window), far less than the full 64k (which reads 0.5 GB of keys)."""
    hd, n_kv, G, nh = 256, 8, 2, 16
    def timed(ctx, window):
        kb = cp.asarray(bf16_bits(rng.standard_normal((n_kv, ctx, hd), dtype=np.float32)))
        vb = cp.asarray(bf16_bits(rng.standard_normal((n_kv, ctx, hd), dtype=np.float32)))
        q = cp.asarray(rng.standard_normal((1, nh, hd), dtype=np.float32))
        pos = cp.asarray(np.array([ctx - 1], np.int32))
        out = cp.zeros((1, nh, hd), dtype=cp.float32)
        n = kernels.decode_splits(ctx, n_kv, 1, nh, hd)
        ws = cp.empty(kernels.decode_workspace_size(1, nh, hd, n), dtype=cp.float32)
        cp.cuda.Device().synchronize()  # the inputs' copies (default stream) done before the kernels' stream reads
        s = cp.cuda.Stream(non_blocking=True)
        # GPU time, not the host's per-call overhead (~70 us, more than a 512-key step): 20 launches
        # captured in one graph, replayed back to back, timed by events on the stream
        with s:
            kernels.attention_decode(q, kb, vb, pos, out, 0.1, n_splits=n, window=window, workspace=ws, stream=s)
            eager = out.copy()
            s.begin_capture()
            for _ in range(20):
                kernels.attention_decode(q, kb, vb, pos, out, 0.1, n_splits=n, window=window, workspace=ws,
                                         stream=s)
            graph = s.end_capture()
            graph.launch(stream=s)
            out[...] = np.nan  # the replays below must write it again
            e0, e1 = cp.cuda.Event(), cp.cuda.Event()
            e0.record(s)
            for _ in range(10):
                graph.launch(stream=s)
            e1.record(s)
            s.synchronize()
        assert cp.array_equal(out, eager), "graph replay differs from the eager launch"
        return cp.cuda.get_elapsed_time(e0, e1) * 1e-3 / 200
    full, win, small = timed(65536, None), timed(65536, 512), timed(512, None)
    print(f"decode attention: 64k full {full * 1e6:.1f} us, 64k window 512 {win * 1e6:.1f} us, "
          f"512 context {small * 1e6:.1f} us")
    assert win < 0.35 * full and win < 2.5 * small


# -- rope, norms, GEMVs, elementwise -------------------------------------------------------------------------


@pytest.mark.parametrize("hd,rot", [(128, 96), (96, 96), (256, 256), (64, 32)])
@pytest.mark.parametrize("M", [1, 3])
def test_rope_kv_append_partial_rotary_and_offset_norm(cp, kernels, rng, seed, hd, rot, M):
    nh, n_kv, ctx = 4, 2, 64
    qkv = rng.standard_normal((M, (nh + 2 * n_kv) * hd), dtype=np.float32)
    positions = rng.choice(ctx, M, replace=False).astype(np.int32)  # distinct: each row's cache slot checked
    inv = (1.0 / 10000.0 ** (np.arange(0, rot, 2) / rot)).astype(np.float32)
    wq_b, wq = rand_bf16(rng, (hd,), 0.3)
    wk_b, wk = rand_bf16(rng, (hd,), 0.3)
    scaling = 1.3
    q_out = cp.zeros((M, nh, hd), dtype=cp.float32)
    kc = cp.zeros((n_kv, ctx, hd), dtype=cp.uint16)
    vc = cp.zeros((n_kv, ctx, hd), dtype=cp.uint16)
    kernels.rope_kv_append(cp.asarray(qkv), cp.asarray(positions), cp.asarray(inv), q_out, kc, vc,
                           cp.asarray(wq_b), cp.asarray(wk_b), 1e-6, attention_scaling=scaling, norm_offset=1.0,
                           rotary_dim=rot)

    def ref(x, w):  # x [M, heads, hd]: (1 + w) RMSNorm over the head, rotate the first rot dims
        x = x.astype(np.float64)
        x = (1.0 + w) * x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + 1e-6)
        ang = (positions.astype(np.float32)[:, None] * inv[None, :]).astype(np.float64)[:, None, :]
        c, s = np.cos(ang) * scaling, np.sin(ang) * scaling
        a, b = x[..., :rot // 2], x[..., rot // 2:rot]
        return np.concatenate([a * c - b * s, b * c + a * s, x[..., rot:]], axis=-1)

    qk = qkv.reshape(M, nh + 2 * n_kv, hd)
    assert_close(cp.asnumpy(q_out), ref(qk[:, :nh], wq), seed, 1e-5)
    kf = bits_f32(cp.asnumpy(kc))
    k_ref = ref(qk[:, nh:nh + n_kv], wk)  # [M, n_kv, hd]: each row at its own position
    for m in range(M):
        assert_close(kf[:, positions[m]], k_ref[m], seed, 1e-2)


@pytest.mark.parametrize("M,impl", [(1, "fma"), (2, "fma"), (1, "tc"), (2, "tc"), (5, "tc"), (16, "tc")])
def test_gelu_gated_gemv_with_offset_norm(cp, kernels, rng, seed, M, impl):
    K, inter = 256, 344
    x = rng.standard_normal((M, K), dtype=np.float32) * np.float32(3.0)
    wb, wf = rand_bf16(rng, (2 * inter, K), 1.0 / math.sqrt(K))
    nb, nf = rand_bf16(rng, (K,), 0.2)
    out = cp.zeros((M, inter), dtype=cp.float32)
    kw = dict(norm_weight=cp.asarray(nb), eps=1e-6, norm_offset=1.0, activation="gelu_tanh")
    if impl == "tc":
        kernels.gemv_tc(cp.asarray(x), cp.asarray(wb), out, swiglu=True, **kw)
    else:
        kernels.gemv_swiglu(cp.asarray(x), cp.asarray(wb), out, **kw)
    h = x.astype(np.float64)
    h = (1.0 + nf) * h / np.sqrt(np.mean(h * h, axis=-1, keepdims=True) + 1e-6)
    gu = h @ wf.astype(np.float64).T
    assert_close(cp.asnumpy(out), gelu_tanh(gu[:, :inter]) * gu[:, inter:], seed, 1e-3)


def test_prefill_gelu_and_norm_add_and_embedding_scale_and_softcap(cp, kernels, rng, seed):
    M, H, V = 7, 384, 50
    gu = rng.standard_normal((M, 2 * H), dtype=np.float32) * np.float32(3.0)
    act = cp.zeros((M, H), dtype=cp.float32)
    kernels.swiglu(cp.asarray(gu), act, activation="gelu_tanh")
    assert_close(cp.asnumpy(act), gelu_tanh(gu[:, :H].astype(np.float64)) * gu[:, H:], seed, 1e-6)

    x = rng.standard_normal((M, H), dtype=np.float32)
    res = rng.standard_normal((M, H), dtype=np.float32)
    wb, wf = rand_bf16(rng, (H,), 0.3)
    r = cp.asarray(res)
    kernels.rmsnorm_add(cp.asarray(x), cp.asarray(wb), 1e-6, r, offset=1.0)
    h = x.astype(np.float64)
    want = res + (1.0 + wf) * h / np.sqrt(np.mean(h * h, axis=-1, keepdims=True) + 1e-6)
    assert_close(cp.asnumpy(r), want, seed, 1e-6)
    out = cp.zeros((M, H), dtype=cp.float32)
    kernels.rmsnorm(cp.asarray(x), cp.asarray(wb), 1e-6, out, offset=1.0)
    assert_close(cp.asnumpy(out), want - res, seed, 1e-6)

    tb, tf = rand_bf16(rng, (V, H))
    ids = rng.integers(0, V, M).astype(np.int32)
    emb = cp.zeros((M, H), dtype=cp.float32)
    scale = float(np.float32(math.sqrt(H)))
    kernels.embedding(cp.asarray(ids), cp.asarray(tb), emb, scale=scale)
    assert np.array_equal(cp.asnumpy(emb), tf[ids] * np.float32(scale))  # one fp32 product: exact

    logits = rng.standard_normal((3, 1001), dtype=np.float32) * np.float32(40.0)
    d = cp.asarray(logits)
    kernels.softcap(d, 30.0)
    assert_close(cp.asnumpy(d), 30.0 * np.tanh(logits.astype(np.float64) / 30.0), seed, 1e-6)


# -- the engine against the NumPy engine -------------------------------------------------------------------

TOL = 2e-2
BASE = dict(vocab_size=1003, hidden_size=256, intermediate_size=344, num_hidden_layers=3,
            max_position_embeddings=512, rms_norm_eps=1e-5, dtype="bfloat16")
S, F = "sliding_attention", "full_attention"
ARCHS = {
    "gemma2": dict(model_type="gemma2", num_attention_heads=4, num_key_value_heads=2, head_dim=256,
                   query_pre_attn_scalar=192, sliding_window=24, layer_types=[S, F, S],
                   attn_logit_softcapping=8.0, final_logit_softcapping=12.0, tie_word_embeddings=True),
    "gemma3_text": dict(model_type="gemma3_text", num_attention_heads=4, num_key_value_heads=2, head_dim=128,
                        query_pre_attn_scalar=128, sliding_window=40, layer_types=[S, S, F],
                        rope_parameters={F: {"rope_type": "linear", "factor": 8.0, "rope_theta": 1e6},
                                         S: {"rope_type": "default", "rope_theta": 1e4}}),
    "gemma3_256_4x": dict(model_type="gemma3_text", num_attention_heads=2, num_key_value_heads=1, head_dim=256,
                          query_pre_attn_scalar=256, sliding_window=33, sliding_window_pattern=3,
                          rope_theta=1e6, rope_local_base_freq=1e4,
                          rope_scaling={"rope_type": "linear", "factor": 4.0}),
    "phi3_96": dict(model_type="phi3", hidden_size=384, num_attention_heads=4, num_key_value_heads=4,
                    sliding_window=47),
    "phi4_mini_like": dict(model_type="phi3", num_attention_heads=2, num_key_value_heads=1, tie_word_embeddings=True,
                           partial_rotary_factor=0.75, original_max_position_embeddings=50,
                           rope_scaling={"type": "longrope", "short_factor": [1.0 + 0.05 * i for i in range(48)],
                                         "long_factor": [2.0 + 0.1 * i for i in range(48)]}),
    "mistral_window": dict(model_type="mistral", num_attention_heads=8, num_key_value_heads=2, head_dim=64,
                           sliding_window=31),
    "qwen2_window": dict(model_type="qwen2", num_attention_heads=4, num_key_value_heads=2, use_sliding_window=True,
                         sliding_window=29, max_window_layers=1),
}
MODELS = list(ARCHS)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """One fresh random checkpoint per architecture (new weights every session)."""
    seed = int(np.random.default_rng().integers(2**31))
    root = tmp_path_factory.mktemp("ckpt13")
    out = {}
    for name, extra in ARCHS.items():
        raw = {**BASE, **extra}
        cfg = parse_config(raw)
        src = RandomTensors(cfg, seed=seed)
        d = root / name
        d.mkdir()
        save_file({n: np.asarray(src.array(n), dtype=np.float32).astype(ml_dtypes.bfloat16)
                   for n in src.tensor_names()}, str(d / "model.safetensors"))
        (d / "config.json").write_text(json.dumps(raw))
        out[name] = d
    print(f"issue-13 checkpoints drawn with seed {seed}")
    return out


def pair(path: Path, ctx: int = 256):
    cpu = open_model(path, device="cpu", max_context=ctx, fp32_logits=True).engine
    gpu = open_model(path, device="cuda", max_context=ctx, fp32_logits=True).engine
    return cpu, gpu


@pytest.mark.parametrize("name", MODELS)
@pytest.mark.parametrize("plen", [5, 40, 130])  # the rows (graph) path, the cuBLAS path, past 2 x 64 keys
def test_prefill_parity(cp, checkpoints, name, plen, rng):
    cpu, gpu = pair(checkpoints[name])
    prompt = [int(t) for t in rng.integers(0, cpu.vocab_size(), plen)]
    assert cpu.prefill(prompt, all_logits=True) == gpu.prefill(prompt, all_logits=True) == plen
    err = rel(rows(gpu, gpu.logits_buffer_ptr(), plen), rows(cpu, cpu.logits_buffer_ptr(), plen))
    print(f"{name} prefill T={plen}: rel err {err:.2e}")
    assert err <= TOL
    assert rel(gpu.copy_hidden_to_host(), cpu.copy_hidden_to_host()) <= TOL


@pytest.mark.parametrize("name", MODELS)
def test_greedy_32_steps_cross_the_window(cp, checkpoints, name, rng):
    cpu, gpu = pair(checkpoints[name])
    prompt = [int(t) for t in rng.integers(0, cpu.vocab_size(), 30)]  # 30..62: past every window here
    a = decoding.run_decode(cpu, prompt, 32, keep_rows=True)
    b = decoding.run_decode(gpu, prompt, 32, keep_rows=True)
    ta, tb = [s.token for s in a.steps], [s.token for s in b.steps]
    ra, rb = a.rows.array(), b.rows.array()
    n = tokens_agree(ta, tb, ra, name)
    err = rel(rb[:n], ra[:n])
    print(f"{name} decode: rel err over {n} rows {err:.2e}")
    assert err <= TOL


@pytest.mark.parametrize("name", ["gemma2", "gemma3_256_4x", "phi3_96", "mistral_window"])
@pytest.mark.parametrize("k", [1, 4, 15])
def test_verify_equals_sequential_and_trim(cp, checkpoints, name, k, rng):
    cpu, gpu = pair(checkpoints[name])
    prompt = [int(t) for t in rng.integers(0, gpu.vocab_size(), 70)]
    drafts = [int(t) for t in rng.integers(0, gpu.vocab_size(), k)]
    seq, ver = decoded_and_verified(gpu, prompt, drafts)
    assert rel(ver, seq) <= TOL
    cpu.prefill(prompt)
    cpu.verify(drafts)
    assert rel(ver, rows(cpu, cpu.logits_buffer_ptr(), k)) <= TOL
    keep = int(rng.integers(0, k + 1))
    gpu.trim(len(prompt) + keep)
    gpu.decode(3)
    fresh = open_model(checkpoints[name], device="cuda", max_context=256, fp32_logits=True).engine
    fresh.prefill(prompt)
    if keep:
        fresh.verify(drafts[:keep])
    fresh.decode(3)
    assert rel(rows(gpu, gpu.decode_logits_ptr(), 1), rows(fresh, fresh.decode_logits_ptr(), 1)) <= 1e-3


@pytest.mark.parametrize("name", ["gemma2", "phi4_mini_like"])
def test_graph_replay_equals_eager(cp, checkpoints, name, rng):
    path = checkpoints[name]
    g = open_model(path, device="cuda", max_context=256, fp32_logits=True).engine
    e = open_model(path, device="cuda", max_context=256, fp32_logits=True).engine
    e.use_graphs = False
    prompt = [int(t) for t in rng.integers(0, g.vocab_size(), 44)]
    drafts = [int(t) for t in rng.integers(0, g.vocab_size(), 4)]
    out = []
    for eng in (g, e):
        eng.prefill(prompt)
        r = []
        for t in drafts[:3]:  # replays with changing positions (phi4_mini_like crosses its switch at 50)
            eng.decode(t)
            r.append(rows(eng, eng.decode_logits_ptr(), 1).tobytes())
        eng.verify(drafts)
        r.append(rows(eng, eng.logits_buffer_ptr(), 4).tobytes())
        out.append(r)
    assert len(g.graphs) >= 2 and not len(e.graphs)
    assert out[0] == out[1]


def test_longrope_switch_on_the_gpu(cp, checkpoints, rng):
    """original_max_position_embeddings 50: a 40-token prompt runs short, decoding crosses to long
    (the cache recomputed), a verify that straddles the switch equals a fresh prefill of the whole
    sequence, and a trim back below it decodes as a fresh run; all close to the NumPy engine."""
    path = checkpoints["phi4_mini_like"]
    cpu, gpu = pair(path)
    prompt = [int(t) for t in rng.integers(0, gpu.vocab_size(), 40)]
    a = decoding.run_decode(cpu, prompt, 20, keep_rows=True)
    b = decoding.run_decode(gpu, prompt, 20, keep_rows=True)
    assert rel(b.rows.array(), a.rows.array()) <= TOL
    assert gpu._cache_long  # position 59 > 50
    drafts = [int(t) for t in rng.integers(0, gpu.vocab_size(), 15)]  # positions 40..54
    gpu.reset()
    gpu.prefill(prompt)
    gpu.verify(drafts)
    ver = rows(gpu, gpu.logits_buffer_ptr(), 15)
    whole = open_model(path, device="cuda", max_context=256, fp32_logits=True).engine
    whole.prefill(prompt + drafts, all_logits=True)
    assert rel(ver, rows(whole, whole.logits_buffer_ptr(), 55)[-15:]) <= TOL  # GEMV rows vs the cuBLAS path
    gpu.trim(45)
    gpu.decode(7)
    fresh = open_model(path, device="cuda", max_context=256, fp32_logits=True).engine
    fresh.prefill((prompt + drafts)[:45])
    fresh.decode(7)
    assert not gpu._cache_long
    assert rel(rows(gpu, gpu.decode_logits_ptr(), 1), rows(fresh, fresh.decode_logits_ptr(), 1)) <= 1e-3


def test_presets_load_on_the_gpu(cp):
    """The new presets build with random weights and decode finite logits (small context)."""
    from metrale_cli.bench import build_engine, preset_path
    from metrale_cli.config import load_config

    for preset in ("gemma-3-12b", "phi-3-mini"):
        cfg = load_config(preset_path(preset))
        eng = build_engine(cfg, "cuda", 64)
        eng.prefill(list(range(20)))
        eng.decode(5)
        amax = eng.argmax_on_device(eng.decode_logits_ptr())
        assert 0 <= int(amax) < cfg.vocab_size, preset  # -1 would mean a NaN or Inf in the row
        del eng
        cp.get_default_memory_pool().free_all_blocks()
