"""The CUDA engine against the NumPy engine (the reference) on every architecture metrale supports.

Each test writes fresh random checkpoints (bf16, f16 and f32; one per architecture) with head dims the
GPU kernels take (the transformers goldens in tests/fixtures use head_dim 16/24, which they do not).
Tolerances (bf16 weights and KV cache on the GPU, fp32 everywhere on the CPU): logits
||gpu - cpu|| / ||cpu|| <= 2e-2; greedy tokens identical, unless the CPU row that chose a differing
token has a top-1/top-2 margin below the bf16 resolution of its logits.
"""

from __future__ import annotations

import json
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest
from safetensors.numpy import save_file

from metrale_cli import decoding
from metrale_cli.config import parse_config
from metrale_cli.model import open_model
from metrale_cli.random_weights import RandomTensors

from gpu_helpers import decoded_and_verified, rel, rows, tokens_agree

pytestmark = pytest.mark.gpu

TOL = 2e-2
BASE = dict(vocab_size=1003, hidden_size=256, intermediate_size=344, num_hidden_layers=3,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
            rms_norm_eps=1e-5, rope_theta=10000.0)
ARCHS = {
    "llama": dict(model_type="llama", dtype="bfloat16"),
    "llama_tied_f32": dict(model_type="llama", tie_word_embeddings=True, dtype="float32"),
    "llama3_rope_f16": dict(model_type="llama", dtype="float16", rope_parameters={
        "rope_type": "llama3", "rope_theta": 50000.0, "factor": 8.0, "low_freq_factor": 1.0,
        "high_freq_factor": 4.0, "original_max_position_embeddings": 64}),
    "mistral": dict(model_type="mistral", head_dim=32, num_attention_heads=8, num_key_value_heads=2,
                    dtype="bfloat16"),
    "qwen2": dict(model_type="qwen2", dtype="bfloat16"),
    "qwen3": dict(model_type="qwen3", head_dim=128, dtype="bfloat16"),
}
MODELS = list(ARCHS)
NP_DTYPES = {"bfloat16": ml_dtypes.bfloat16, "float16": np.float16, "float32": np.float32}


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """One fresh random checkpoint per architecture (new weights every session)."""
    seed = int(np.random.default_rng().integers(2**31))
    root = tmp_path_factory.mktemp("ckpt")
    out = {}
    for name, extra in ARCHS.items():
        raw = {**BASE, **extra}
        cfg = parse_config(raw)
        src = RandomTensors(cfg, seed=seed)
        dt = NP_DTYPES[raw["dtype"]]
        d = root / name
        d.mkdir()
        save_file({n: np.asarray(src.array(n), dtype=np.float32).astype(dt) for n in src.tensor_names()},
                  str(d / "model.safetensors"))
        (d / "config.json").write_text(json.dumps(raw))
        out[name] = d
    print(f"checkpoints drawn with seed {seed}")
    return out


def pair(path: Path, ctx: int = 160, **kw):
    cpu = open_model(path, device="cpu", max_context=ctx, fp32_logits=True).engine
    gpu = open_model(path, device="cuda", max_context=ctx, fp32_logits=True, **kw).engine
    return cpu, gpu


@pytest.mark.parametrize("name", MODELS)
@pytest.mark.parametrize("plen", [5, 40])  # 5: the GEMV/graph path; 40: the cuBLAS prefill path
def test_prefill_parity(cp, checkpoints, name, plen, rng):
    cpu, gpu = pair(checkpoints[name])
    prompt = [int(t) for t in rng.integers(0, cpu.vocab_size(), plen)]
    n1 = cpu.prefill(prompt, all_logits=True)
    n2 = gpu.prefill(prompt, all_logits=True)
    assert n1 == n2 == plen
    err = rel(rows(gpu, gpu.logits_buffer_ptr(), n2), rows(cpu, cpu.logits_buffer_ptr(), n1))
    print(f"{name} prefill T={plen}: rel err {err:.2e}")
    assert err <= TOL
    assert rel(gpu.copy_hidden_to_host(), cpu.copy_hidden_to_host()) <= TOL


@pytest.mark.parametrize("name", MODELS)
def test_greedy_32_steps_and_decode_rows(cp, checkpoints, name, rng):
    cpu, gpu = pair(checkpoints[name])
    prompt = [int(t) for t in rng.integers(0, cpu.vocab_size(), 12)]
    a = decoding.run_decode(cpu, prompt, 32, keep_rows=True)
    b = decoding.run_decode(gpu, prompt, 32, keep_rows=True)
    ta, tb = [s.token for s in a.steps], [s.token for s in b.steps]
    ra, rb = a.rows.array(), b.rows.array()
    n = tokens_agree(ta, tb, ra, name)
    err = rel(rb[:n], ra[:n])
    print(f"{name} decode: rel err over {n} rows {err:.2e}")
    assert err <= TOL


@pytest.mark.parametrize("name", ["llama", "qwen3", "mistral"])
@pytest.mark.parametrize("k", [1, 2, 4, 8, 15])
def test_verify_equals_sequential_on_gpu_and_trim(cp, checkpoints, name, k, rng):
    cpu, gpu = pair(checkpoints[name])
    prompt = [int(t) for t in rng.integers(0, gpu.vocab_size(), 9)]
    drafts = [int(t) for t in rng.integers(0, gpu.vocab_size(), k)]
    seq, ver = decoded_and_verified(gpu, prompt, drafts)
    assert rel(ver, seq) <= TOL
    cpu.prefill(prompt)
    cpu.verify(drafts)
    assert rel(ver, rows(cpu, cpu.logits_buffer_ptr(), k)) <= TOL
    keep = int(rng.integers(0, k + 1))
    gpu.trim(len(prompt) + keep)
    gpu.decode(3)
    fresh = open_model(checkpoints[name], device="cuda", max_context=64, fp32_logits=True).engine
    fresh.prefill(prompt)
    if keep:
        fresh.verify(drafts[:keep])
    fresh.decode(3)
    # Same kernels, only the GEMV row count differs: far tighter than the bf16 tolerance.
    assert rel(rows(gpu, gpu.decode_logits_ptr(), 1), rows(fresh, fresh.decode_logits_ptr(), 1)) <= 1e-3


@pytest.mark.parametrize("graphs", [True, False])
def test_decode_steps_queued_back_to_back_each_take_their_own_token(cp, checkpoints, graphs, rng):
    """Decode steps queued while the GPU is still busy (a long prefill before them, nothing read between them)
    give the logits of steps each waited for: each step's token and position reach the device as that step
    staged them (Buffers.stage_rows), not as a later step rewrote a shared pinned buffer."""
    path = checkpoints["llama"]
    prompt = [int(t) for t in rng.integers(0, 1003, 120)]
    steps = [int(t) for t in rng.integers(0, 1003, 12)]
    want = open_model(path, device="cuda", max_context=160, fp32_logits=True).engine
    want.prefill(prompt)
    for t in steps:
        want.decode(t)
        want.synchronize()
    got = open_model(path, device="cuda", max_context=160, fp32_logits=True).engine
    got.use_graphs = graphs
    got.prefill(prompt)
    for t in steps:
        got.decode(t)
    err = rel(rows(got, got.decode_logits_ptr(), 1), rows(want, want.decode_logits_ptr(), 1))
    print(f"back-to-back decode (graphs={graphs}) against steps each waited for: rel err {err:.1e}")
    assert err <= 1e-4  # the same kernels on the same inputs; a wrong token or position moves the row by ~1


@pytest.mark.parametrize("fp32,pdl", [(False, True), (True, True), (False, False)])
def test_graph_replay_equals_eager(cp, checkpoints, fp32, pdl, rng):
    """The captured graph (with programmatic dependent launch where the GPU has it, or without)
    gives bit-identical logits to eager launches without PDL: PDL only changes scheduling."""
    path = checkpoints["qwen2"]
    g = open_model(path, device="cuda", max_context=64, fp32_logits=fp32).engine
    e = open_model(path, device="cuda", max_context=64, fp32_logits=fp32).engine
    g.set_pdl(pdl)
    if pdl and int(cp.cuda.Device().compute_capability) >= 90:
        assert g.use_pdl
    e.use_graphs = False
    e.set_pdl(False)
    prompt = [int(t) for t in rng.integers(0, g.vocab_size(), 7)]
    drafts = [int(t) for t in rng.integers(0, g.vocab_size(), 4)]
    out = []
    for eng in (g, e):
        eng.prefill(prompt)
        r = []
        for t in drafts[:3]:  # several replays with changing positions
            eng.decode(t)
            r.append(bytes(rows_raw(eng, eng.decode_logits_ptr())))
        eng.verify(drafts)
        r += [bytes(rows_raw(eng, eng.logits_buffer_ptr().row_ptr(i))) for i in range(4)]
        out.append(r)
    assert len(g.graphs) >= 2 and not len(e.graphs)
    assert out[0] == out[1]  # bit-identical: the same kernels, replayed


def rows_raw(e, ptr):
    buf = bytearray(e.row_nbytes(ptr))
    e.copy_logits_to_host(ptr, buf)
    return buf


def test_bf16_logits_are_the_rounding_of_fp32(cp, checkpoints, rng):
    path = checkpoints["llama"]
    b = open_model(path, device="cuda", max_context=64).engine
    f = open_model(path, device="cuda", max_context=64, fp32_logits=True).engine
    prompt = [int(t) for t in rng.integers(0, b.vocab_size(), 6)]
    b.prefill(prompt, all_logits=True)
    f.prefill(prompt, all_logits=True)
    from metrale_cli.logits import bf16_bits, fp32_to_bf16

    for i in range(6):
        want = bf16_bits(fp32_to_bf16(np.frombuffer(rows_raw(f, f.logits_buffer_ptr().row_ptr(i)), np.float32)))
        assert np.array_equal(np.frombuffer(rows_raw(b, b.logits_buffer_ptr().row_ptr(i)), np.uint16), want)


def test_device_argmax_and_nan(cp, checkpoints, rng):
    from metrale_cli.errors import NonFiniteLogitsError

    e = open_model(checkpoints["llama"], device="cuda", max_context=64, fp32_logits=True).engine
    e.prefill([int(t) for t in rng.integers(0, e.vocab_size(), 6)], all_logits=True)
    host = rows(e, e.logits_buffer_ptr(), 6)
    assert e.argmax_batch(e.logits_buffer_ptr(), 6) == [int(i) for i in np.argmax(host, axis=1)]
    e._logits[3, 17] = cp.nan
    with pytest.raises(NonFiniteLogitsError):
        e.argmax_batch(e.logits_buffer_ptr(), 6)


def test_transformers_bf16_on_gpu_as_second_reference(cp, tmp_path, rng):
    """A 1B-class random Llama (llama-3.2-1b shape, 4 layers to keep the test short) in bf16."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")

    raw = json.loads((Path(__file__).parents[2] / "configs" / "llama-3.2-1b.json").read_text())
    raw.update(num_hidden_layers=4, dtype="bfloat16")
    cfg = transformers.LlamaConfig(**raw)  # 5.x layout: rope_parameters
    model = transformers.LlamaForCausalLM(cfg)
    with torch.no_grad():  # explicit seeded weights: no reliance on the library's initialiser
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                val = rng.uniform(0.8, 1.2, p.shape)
            elif "embed" in name:
                val = rng.normal(0, 0.02, p.shape)
            else:
                val = rng.normal(0, p.shape[-1] ** -0.5, p.shape)
            p.copy_(torch.from_numpy(val.astype(np.float32)))
    model = model.to(torch.bfloat16)
    model.save_pretrained(tmp_path)
    model = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.bfloat16).cuda().eval()
    prompt = [int(t) for t in rng.integers(0, cfg.vocab_size, 24)]
    with torch.no_grad():
        ref = model(torch.tensor([prompt]).cuda()).logits[0].float().cpu().numpy()
        ref32 = model.float()(torch.tensor([prompt]).cuda()).logits[0].cpu().numpy()
    e = open_model(tmp_path, device="cuda", max_context=64, fp32_logits=True).engine
    e.prefill(prompt, all_logits=True)
    ours = rows(e, e.logits_buffer_ptr(), len(prompt))
    err, err32 = rel(ours, ref), rel(ours, ref32)
    agree = float(np.mean(ours.argmax(1) == ref32.argmax(1)))
    print(f"llama-3.2-1b shape (4 layers): rel err vs transformers bf16 on GPU {err:.2e}, vs its fp32 "
          f"{err32:.2e} (transformers bf16 vs fp32: {rel(ref, ref32):.2e}), argmax agreement {agree:.2f}")
    assert err <= TOL and err32 <= TOL
    assert agree >= 0.9


@pytest.mark.parametrize("name", ["llama", "qwen3"])
@pytest.mark.parametrize("plen", [5, 40])  # the rows (graph) path and the cuBLAS prefill path
def test_hidden_rows_follow_the_logits_rows(cp, checkpoints, name, plen, rng):
    """hidden_rows_ptr(): one post-final-norm row per logits row of the last pass, on both engines."""
    cpu, gpu = pair(checkpoints[name])
    hidden = cpu.cfg.hidden_size
    prompt = [int(t) for t in rng.integers(0, cpu.vocab_size(), plen)]
    drafts = [int(t) for t in rng.integers(0, cpu.vocab_size(), 4)]

    def both(run):
        out = []
        for e in (cpu, gpu):
            run(e)
            out.append(e.copy_hidden_rows_to_host())
        return out

    a, b = both(lambda e: (e.reset(), e.prefill(prompt, all_logits=True)))
    assert a.shape == b.shape == (plen, hidden) and rel(b, a) <= TOL
    assert np.array_equal(b[-1], gpu.copy_hidden_to_host())
    last_a, last_b = both(lambda e: (e.reset(), e.prefill(prompt)))
    assert last_b.shape == (1, hidden) and rel(last_b, last_a) <= TOL and rel(last_b[0], b[-1]) <= TOL
    a, b = both(lambda e: e.verify(drafts))
    assert b.shape == (4, hidden) and rel(b, a) <= TOL
    a, b = both(lambda e: e.decode(drafts[0]))
    assert b.shape == (1, hidden) and rel(b, a) <= TOL
