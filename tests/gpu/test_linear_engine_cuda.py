"""The hybrid Gated DeltaNet families (qwen3_next, qwen3_5) on the CUDA engine against the NumPy engine, on fresh
random bf16 checkpoints with GPU-sized heads (linear key head dims 128 and 64, full-attention head_dim 256 with the
output gate and partial rotary, (1 + w) norms, a sparse MLP with the sigmoid-gated shared expert): prefill on the
rows path and the prefill path (the sequential rule over 40 tokens, the chunked one over 65, 130 and 300), 32
greedy steps, verify == sequential decode for k = 1, 4, 15 and trim to every accepted count then decode == a fresh
run, graph replay == eager bit for bit, and the dumped states against the NumPy engine's. The sparse checkpoints
route every expert (top_k = the expert count) so that a near tie of the router cannot swap an expert between fp32
and bf16: the routing near ties are tests/gpu/test_moe_cuda.py's."""

from __future__ import annotations

import numpy as np
import pytest

from metrale_cli import decoding
from metrale_cli.model import open_model

from gpu_helpers import random_checkpoints, rel, rows, tokens_agree

pytestmark = pytest.mark.gpu

TOL = 2e-2  # logits, as tests/gpu/test_cuda_engine.py
L, F = "linear_attention", "full_attention"
BASE = dict(vocab_size=1003, hidden_size=256, intermediate_size=344, num_hidden_layers=4, max_position_embeddings=512,
            rms_norm_eps=1e-5, dtype="bfloat16", num_attention_heads=4, num_key_value_heads=2, head_dim=256,
            layer_types=[L, L, L, F], linear_conv_kernel_dim=4, linear_num_key_heads=2, linear_num_value_heads=4,
            linear_key_head_dim=128, linear_value_head_dim=128, tie_word_embeddings=False,
            rope_parameters={"rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 0.25})
SPARSE = dict(num_experts=4, num_experts_per_tok=4, moe_intermediate_size=128, norm_topk_prob=True)
ARCHS = {
    "qwen3_next": dict(model_type="qwen3_next", decoder_sparse_step=1, mlp_only_layers=[1],
                       shared_expert_intermediate_size=128, **SPARSE),
    "qwen3_5_text": dict(model_type="qwen3_5_text"),
    "qwen3_5_text_64": dict(model_type="qwen3_5_text", linear_key_head_dim=64, linear_value_head_dim=96,
                            layer_types=[L, F, L, L]),
    "qwen3_5_moe_text": dict(model_type="qwen3_5_moe_text", shared_expert_intermediate_size=128, **SPARSE),
}
MODELS = list(ARCHS)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    seed = int(np.random.default_rng().integers(2**31))
    print(f"linear-attention checkpoints drawn with seed {seed}")
    return random_checkpoints(tmp_path_factory.mktemp("linear"), BASE, ARCHS, seed)


def pair(path, ctx: int = 256):
    cpu = open_model(path, device="cpu", max_context=ctx, fp32_logits=True).engine
    gpu = open_model(path, device="cuda", max_context=ctx, fp32_logits=True).engine
    return cpu, gpu


def _tokens(rng, engine, n):
    return [int(t) for t in rng.integers(0, engine.vocab_size(), n)]


@pytest.mark.parametrize("name", MODELS)
@pytest.mark.parametrize("plen", [5, 40, 65, 130, 300])  # the rows (graph) path, the prefill path's sequential rule
def test_prefill_parity_and_state(cp, checkpoints, name, plen, rng):  # (40), its chunked rule (2, 3 and 5 chunks)
    from metrale_cli.backends.cuda.linear_attention import CHUNKED_MIN_ROWS

    cpu, gpu = pair(checkpoints[name], ctx=512)
    kernels, chunked = gpu.states["linear_attention"].kernels, []
    real = kernels.recurrent_chunked
    kernels.recurrent_chunked = lambda *a, **kw: (chunked.append(a[0].shape[0]), real(*a, **kw))
    prompt = _tokens(rng, cpu, plen)
    assert cpu.prefill(prompt, all_logits=True) == gpu.prefill(prompt, all_logits=True) == plen
    err = rel(rows(gpu, gpu.logits_buffer_ptr(), plen), rows(cpu, cpu.logits_buffer_ptr(), plen))
    want = cpu.states["linear_attention"].tensors()
    got = gpu.states["linear_attention"].tensors()
    serr = max(rel(got[n], want[n]) for n in want)
    print(f"{name} prefill T={plen} ({'chunked' if chunked else 'sequential'} rule): logits rel err {err:.2e}, "
          f"states {serr:.2e}")
    assert err <= TOL and serr <= TOL
    layers = sum(1 for layer in gpu.cfg.definition.layers if layer.mixer.kind == "linear_attention")
    assert chunked == ([plen] * layers if plen >= CHUNKED_MIN_ROWS else [])


@pytest.mark.parametrize("name", MODELS)
def test_greedy_32_steps(cp, checkpoints, name, rng):
    cpu, gpu = pair(checkpoints[name])
    prompt = _tokens(rng, cpu, 30)
    a = decoding.run_decode(cpu, prompt, 32, keep_rows=True)
    b = decoding.run_decode(gpu, prompt, 32, keep_rows=True)
    ta, tb = [s.token for s in a.steps], [s.token for s in b.steps]
    ra, rb = a.rows.array(), b.rows.array()
    n = tokens_agree(ta, tb, ra, name)
    err = rel(rb[:n], ra[:n])
    print(f"{name} decode: rel err over {n} rows {err:.2e}")
    assert err <= TOL


@pytest.mark.parametrize("name", ["qwen3_next", "qwen3_5_text_64"])
@pytest.mark.parametrize("k", [1, 4, 15])
@pytest.mark.parametrize("path", ["rows", "fused"])
@pytest.mark.parametrize("graphs", [True, False])
def test_verify_equals_sequential_and_trim(cp, checkpoints, name, k, path, graphs, rng):
    """verify k rows == k decode steps (the GEMV rows are independent of the row count: 1e-3 covers the ring
    GEMV of one row against gemv / gemv_tc of k); a trim to each accepted count (the state from that position's
    ring slot: the states themselves, then the next decode) == a fresh run that decoded to there; the NumPy
    engine's verify agrees. With graphs off, the engine under test also launches without PDL."""
    path_ = checkpoints[name]
    cpu, gpu = pair(path_)
    gpu.set_path(path)
    if not graphs:
        gpu.use_graphs, gpu.graphs.use_pdl = False, False
    prompt, drafts = _tokens(rng, gpu, 70), _tokens(rng, gpu, k)
    seq_engine = open_model(path_, device="cuda", max_context=256, fp32_logits=True).engine
    seq_engine.set_path(path)
    seq_engine.prefill(prompt)
    seq = []
    for t in drafts:
        seq_engine.decode(t)
        seq.append(rows(seq_engine, seq_engine.decode_logits_ptr(), 1)[0])
    gpu.prefill(prompt)
    gpu.verify(drafts)
    ver = rows(gpu, gpu.logits_buffer_ptr(), k)
    print(f"{name} {path} graphs={graphs} verify {k} against {k} decode steps: rel err {rel(ver, np.stack(seq)):.1e}")
    assert rel(ver, np.stack(seq)) <= TOL
    cpu.prefill(prompt)
    cpu.verify(drafts)
    assert rel(ver, rows(cpu, cpu.logits_buffer_ptr(), k)) <= TOL
    for keep in sorted({0, k // 2, k}):
        gpu.trim(len(prompt))
        gpu.verify(drafts)
        gpu.trim(len(prompt) + keep)
        kept = gpu.states["linear_attention"].tensors()
        gpu.decode(3)
        got = rows(gpu, gpu.decode_logits_ptr(), 1)
        fresh = open_model(path_, device="cuda", max_context=256, fp32_logits=True).engine
        fresh.set_path(path)
        fresh.prefill(prompt)
        for t in drafts[:keep]:
            fresh.decode(t)
        want = fresh.states["linear_attention"].tensors()
        cpu.reset()
        cpu.prefill(prompt)
        for t in drafts[:keep]:
            cpu.decode(t)
        ref = {n: np.array(v) for n, v in cpu.states["linear_attention"].tensors().items()}
        serr = {n: rel(kept[n], want[n]) for n in want}
        worst = max(serr, key=serr.get)
        kerr = max(rel(kept[n], ref[n]) for n in ref)  # the trimmed engine's states against the NumPy engine's
        ferr = max(rel(want[n], ref[n]) for n in ref)  # the fresh engine's
        fresh.decode(3)
        err = rel(got, rows(fresh, fresh.decode_logits_ptr(), 1))
        print(f"{name} {path} graphs={graphs} verify {k}, trim to {keep}: next logits rel err {err:.1e}; states "
              f"rel err max {serr[worst]:.1e} ({worst}), {sum(v > 1e-3 for v in serr.values())} of {len(serr)} > 1e-3; "
              f"against the NumPy engine: trimmed {kerr:.1e}, fresh {ferr:.1e}")
        assert kerr <= TOL and ferr <= TOL and serr[worst] <= 1e-3 and err <= 1e-3, f"trim to {keep} of {k}"


@pytest.mark.parametrize("name", ["qwen3_next", "qwen3_5_text_64"])
def test_verify_keeps_the_state_after_every_row(cp, checkpoints, name, rng):
    """After a verify of k rows, the ring slot of each position the verify passed holds the state the NumPy engine
    has after decoding the drafts to there (each layer's conv and recurrent state); and the slots as the layer's own
    kernels left them (read from a tap right after the layer's mixer, eagerly) are the slots at the end of the pass."""
    from metrale_cli.backends.cuda.linear_attention import RING
    from metrale_cli.engine.observe import tapping

    cpu, gpu = pair(checkpoints[name])
    prompt, drafts = _tokens(rng, cpu, 70), _tokens(rng, cpu, 6)
    cpu.prefill(prompt)
    want = []
    for t in drafts:
        cpu.decode(t)
        want.append({n: np.array(v) for n, v in cpu.states["linear_attention"].tensors().items()})
    st = gpu.states["linear_attention"]
    snap = {}

    def tap(tname, x):
        if tname.endswith(".linear_attn"):
            i = int(tname.split(".")[2])
            st.stream.synchronize()
            snap[i] = (st.conv[i].get(), st.recurrent[i].get())

    for mode in ("graphs", "tapped"):
        gpu.reset()
        gpu.prefill(prompt)
        if mode == "tapped":
            with tapping(gpu, tap):
                gpu.verify(drafts)
        else:
            gpu.verify(drafts)
        st.stream.synchronize()
        worst = []
        for j in range(1, len(drafts) + 1):
            s = (len(prompt) + j) % RING
            errs = {}
            for i in st.layers:
                errs[f"{i}.conv"] = rel(st.conv[i][s].get(), want[j - 1][f"model.layers.{i}.linear_attn.conv_state"])
                errs[f"{i}.rec"] = rel(st.recurrent[i][s].get(),
                                       want[j - 1][f"model.layers.{i}.linear_attn.recurrent_state"])
                if mode == "tapped":
                    errs[f"{i}.conv@tap"] = rel(snap[i][0][s], want[j - 1][f"model.layers.{i}.linear_attn.conv_state"])
                    errs[f"{i}.rec@tap"] = rel(snap[i][1][s],
                                               want[j - 1][f"model.layers.{i}.linear_attn.recurrent_state"])
            w = max(errs, key=errs.get)
            worst.append(errs[w])
            print(f"{name} {mode} verify 6, row {j} (slot {s}): state rel err max {errs[w]:.1e} ({w}); "
                  + " ".join(f"{k} {v:.0e}" for k, v in errs.items()))
        assert max(worst) <= TOL


@pytest.mark.parametrize("name", ["qwen3_next", "qwen3_5_text"])
@pytest.mark.parametrize("path", ["rows", "fused"])
def test_graph_replay_equals_eager(cp, checkpoints, name, path, rng):
    g = open_model(checkpoints[name], device="cuda", max_context=256, fp32_logits=True).engine
    e = open_model(checkpoints[name], device="cuda", max_context=256, fp32_logits=True).engine
    e.use_graphs = False
    prompt, drafts = _tokens(rng, g, 44), _tokens(rng, g, 4)
    out = []
    for eng in (g, e):
        eng.set_path(path)
        eng.prefill(prompt)
        r = []
        for t in drafts[:3]:  # replays with moving positions: the ring slots read and written move with them
            eng.decode(t)
            r.append(rows(eng, eng.decode_logits_ptr(), 1).tobytes())
        eng.verify(drafts)
        r.append(rows(eng, eng.logits_buffer_ptr(), 4).tobytes())
        eng.trim(eng.length - 2)
        eng.decode(drafts[0])
        r.append(rows(eng, eng.decode_logits_ptr(), 1).tobytes())
        out.append(r)
    assert len(g.graphs) >= 2 and not len(e.graphs)
    assert out[0] == out[1]


def test_preset_shapes_load_and_decode(cp):
    """The dense Qwen3.5 preset builds with random weights and decodes finite logits (small context)."""
    from metrale_cli.bench import build_engine, preset_path
    from metrale_cli.config import load_config

    cfg = load_config(preset_path("qwen3.5-27b"))
    cp.get_default_memory_pool().free_all_blocks()  # 54 GB in bf16: what earlier tests left cached goes back first
    eng = build_engine(cfg, "cuda", 64)
    eng.prefill(list(range(20)))
    eng.decode(5)
    amax = eng.argmax_on_device(eng.decode_logits_ptr())
    assert 0 <= int(amax) < cfg.vocab_size  # -1 would mean a NaN or Inf in the row
    del eng
    cp.get_default_memory_pool().free_all_blocks()
