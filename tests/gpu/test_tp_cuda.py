"""Tensor parallelism on the GPU (issue 17): the NCCL rank engine against the plain CUDA engine.

- One H200: `--tp 1` runs the whole sharded path (vocab_embedding + all-reduce, every o/down projection
  all-reduced, argmax candidates gathered in the decode graph) through a one-rank NCCL communicator, and
  equals the plain engine bit for bit: logits of short (graph) and long (cuBLAS) prefills, 8 decode
  steps, verify k=4 after a trim, hidden rows, tapped layer values; graph replay equals the eager pass.
- Several GPUs: `--tp 2/4/8` equals `--tp 1`: the same greedy tokens (teacher-forced, so one near-tie
  does not derail the rest; a differing token is allowed only below the bf16 resolution of its margin)
  and logits within the bf16 tolerance. Skipped, with the reason, when fewer GPUs are visible.
The main checkpoint: 8 query heads and 2 KV heads (tp 4 and 8 replicate KV heads), a vocabulary of 1003
(the ranks' ranges are uneven), head_dim 64; beside it, families whose features cross the TP hooks:
gemma2 (sandwich norms: o/down into h, all-reduced, then the post-norm; embedding scale; softcaps; tied
embeddings; sliding windows), qwen2 (q/k/v bias, column-parallel) and a phi4-mini-like longrope model.
"""

from __future__ import annotations

import json

import ml_dtypes
import numpy as np
import pytest
from safetensors.numpy import save_file

from metrale_cli.config import parse_config
from metrale_cli.engine.observe import tapping
from metrale_cli.model import open_model
from metrale_cli.random_weights import RandomTensors

from gpu_helpers import assert_near_tie

pytestmark = pytest.mark.gpu

CONFIG = dict(model_type="mistral", vocab_size=1003, hidden_size=256, intermediate_size=1024, num_hidden_layers=3,
              num_attention_heads=8, num_key_value_heads=2, head_dim=64, max_position_embeddings=512,
              rms_norm_eps=1e-5, rope_theta=10000.0, dtype="bfloat16", sliding_window=None)
BASE = dict(vocab_size=1003, hidden_size=256, intermediate_size=512, num_hidden_layers=3,
            max_position_embeddings=512, rms_norm_eps=1e-5, dtype="bfloat16")
S, F = "sliding_attention", "full_attention"
FAMILIES = {
    "gemma2": dict(model_type="gemma2", num_attention_heads=4, num_key_value_heads=2, head_dim=256,
                   query_pre_attn_scalar=192, sliding_window=24, layer_types=[S, F, S],
                   attn_logit_softcapping=8.0, final_logit_softcapping=12.0, tie_word_embeddings=True),
    "qwen2": dict(model_type="qwen2", num_attention_heads=4, num_key_value_heads=2),
    "phi4_mini_like": dict(model_type="phi3", num_attention_heads=2, num_key_value_heads=1, tie_word_embeddings=True,
                           partial_rotary_factor=0.75, original_max_position_embeddings=50,
                           rope_scaling={"type": "longrope", "short_factor": [1.0 + 0.05 * i for i in range(48)],
                                         "long_factor": [2.0 + 0.1 * i for i in range(48)]}),
}
TOL = 2e-2


def _write(root, name: str, raw: dict, seed: int):
    src = RandomTensors(parse_config(raw), seed=seed)
    d = root / name
    d.mkdir()
    save_file({n: np.asarray(src.array(n), np.float32).astype(ml_dtypes.bfloat16) for n in src.tensor_names()},
              str(d / "model.safetensors"))
    (d / "config.json").write_text(json.dumps(raw))
    return d


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    seed = int(np.random.default_rng().integers(2**31))
    root = tmp_path_factory.mktemp("tp_ckpt")
    out = {"mistral": _write(root, "mistral", CONFIG, seed)}
    out.update({name: _write(root, name, {**BASE, **extra}, seed) for name, extra in FAMILIES.items()})
    print(f"tp checkpoints drawn with seed {seed}")
    return out


@pytest.fixture
def ckpt(ckpts):
    return ckpts["mistral"]


def _gpus(cp, n: int) -> None:
    count = cp.cuda.runtime.getDeviceCount()
    if count < n:
        pytest.skip(f"--tp {n} needs {n} GPUs, {count} visible")


def _rows(e, ptr) -> np.ndarray:
    out = []
    for i in range(ptr.rows):
        buf = bytearray(e.row_nbytes(ptr))
        e.copy_logits_to_host(ptr.row_ptr(i), buf)
        out.append(np.frombuffer(bytes(buf), np.float32 if e.logits_ptr_is_fp32(ptr) else np.uint16))
    return np.stack(out)


def _script(e, prompt, long_prompt, feed=None) -> list:
    """prefill (rows path), 8 decode steps (fed `feed`, else greedy), trim, verify k=4, a long prefill
    (cuBLAS path); every logits row, argmax and hidden row read on the way."""
    got = []
    e.reset()
    e.prefill(prompt, all_logits=True)
    p = e.logits_buffer_ptr()
    got += [_rows(e, p), e.argmax_batch(p, p.rows), e.copy_hidden_rows_to_host()]
    token = got[1][-1]
    for i in range(8):
        e.decode(token if feed is None else feed[i])
        token = e.argmax_on_device(e.decode_logits_ptr())
        got += [token, _rows(e, e.decode_logits_ptr())]
    e.trim(len(prompt) + 3)
    e.verify([5, 6, 8, 10])
    p = e.logits_buffer_ptr()
    got += [_rows(e, p), e.argmax_batch(p, 4), e.copy_hidden_rows_to_host()]
    e.reset()
    e.prefill(long_prompt, all_logits=True)
    p = e.logits_buffer_ptr()
    got += [_rows(e, p), e.argmax_batch(p, p.rows)]
    return got


def _prompts(rng):
    return [int(t) for t in rng.integers(0, 1003, 7)], [int(t) for t in rng.integers(0, 1003, 40)]


@pytest.mark.parametrize("name", ["mistral", *FAMILIES])
def test_tp_1_through_nccl_equals_the_plain_engine_bit_for_bit(cp, ckpts, name, rng):
    ckpt = ckpts[name]
    prompt, long_prompt = _prompts(rng)
    plain = open_model(ckpt, device="cuda", max_context=96)
    tp = open_model(ckpt, device="cuda", max_context=96, tp=1)
    try:
        assert type(tp.engine).__name__ == "TensorParallelEngine" and tp.engine.local.tp is not None
        want, got = _script(plain.engine, prompt, long_prompt), _script(tp.engine, prompt, long_prompt)
        for i, (w, g) in enumerate(zip(want, got)):
            np.testing.assert_array_equal(np.asarray(g), np.asarray(w), err_msg=f"item {i}")
    finally:
        tp.close()
        plain.close()


def test_tp_1_fp32_logits_and_taps_equal_the_plain_engine(cp, ckpt, rng):
    prompt, _ = _prompts(rng)
    plain = open_model(ckpt, device="cuda", max_context=64, fp32_logits=True)
    tp = open_model(ckpt, device="cuda", max_context=64, fp32_logits=True, tp=1)
    seen = {}
    try:
        for key, m in (("plain", plain), ("tp", tp)):
            taps = seen[key] = {}
            with tapping(m.engine, lambda name, x, taps=taps: taps.setdefault(name, np.array(x))):
                m.engine.prefill(prompt)
                m.engine.decode(3)
            seen[key]["rows"] = _rows(m.engine, m.engine.decode_logits_ptr())
        assert seen["tp"].keys() == seen["plain"].keys()
        for name, w in seen["plain"].items():
            np.testing.assert_array_equal(seen["tp"][name], w, err_msg=name)
    finally:
        tp.close()
        plain.close()


def test_graph_replay_equals_eager_on_the_tp_path(cp, ckpt, rng):
    prompt, long_prompt = _prompts(rng)
    tp = open_model(ckpt, device="cuda", max_context=96, tp=1)
    try:
        e = tp.engine
        e.set_graphs(False)
        eager = _script(e, prompt, long_prompt)
        e.set_graphs(True)
        graphs = _script(e, prompt, long_prompt)
        assert len(e.local.graphs)  # the rows path did replay captured graphs
        for i, (a, b) in enumerate(zip(eager, graphs)):
            np.testing.assert_array_equal(np.asarray(b), np.asarray(a), err_msg=f"item {i}")
    finally:
        tp.close()


@pytest.mark.parametrize("name,n", [("mistral", 2), ("mistral", 4), ("mistral", 8), ("gemma2", 2), ("qwen2", 4)])
def test_tp_n_equals_tp_1(cp, ckpts, rng, name, n):
    _gpus(cp, n)
    ckpt = ckpts[name]
    prompt, long_prompt = _prompts(rng)
    one = open_model(ckpt, device="cuda", max_context=96, fp32_logits=True, tp=1)
    many = open_model(ckpt, device="cuda", max_context=96, fp32_logits=True, tp=n)
    try:
        want = _script(one.engine, prompt, long_prompt)
        feed = [want[3 + 2 * i - 2] if i else want[1][-1] for i in range(8)]  # tp 1's greedy tokens, teacher-forced
        got = _script(many.engine, prompt, long_prompt, feed=feed)
        for i, (w, g) in enumerate(zip(want, got)):
            w, g = np.asarray(w), np.asarray(g)
            if w.dtype == np.float32 and w.ndim == 2 and w.shape[1] == 1003:  # logits rows
                err = float(np.linalg.norm(g - w) / np.linalg.norm(w))
                print(f"tp {n} item {i}: rel err {err:.2e}")
                assert err <= TOL, f"item {i}"
                _same_argmax_unless_tied(w, g, f"item {i}")
            elif w.dtype == np.float32:  # hidden rows
                assert float(np.linalg.norm(g - w) / np.linalg.norm(w)) <= TOL, f"item {i}"
    finally:
        many.close()
        one.close()


def _same_argmax_unless_tied(want: np.ndarray, got: np.ndarray, what: str) -> None:
    for r, (w, g) in enumerate(zip(want, got)):
        if int(np.argmax(w)) != int(np.argmax(g)):
            assert_near_tie(w, f"{what} row {r}: argmax")


def test_cli_tp_1_reports_what_the_plain_engine_reports(cp, run_cli, ckpt, tmp_path):
    args = ["decode", "-m", ckpt, "--tokens", "5 6 7 8", "--steps", "8", "--device", "cuda", "--format", "json"]
    runs = []
    for extra, dump in (([], "plain.npy"), (["--tp", "1"], "tp.npy")):
        r = run_cli(*args, *extra, "--dump-logits", tmp_path / dump)
        assert r.exit_code == 0, r.stderr
        runs.append(json.loads(r.stdout))
        runs[-1].pop("timings", None)
    assert runs[0] == runs[1]
    np.testing.assert_array_equal(np.load(tmp_path / "tp.npy"), np.load(tmp_path / "plain.npy"))


def test_cli_tp_beyond_the_visible_gpus_is_a_device_error(cp, run_cli, ckpt):
    n = cp.cuda.runtime.getDeviceCount() * 2
    r = run_cli("forward", "-m", ckpt, "--tokens", "1 2", "--device", "cuda", "--tp", n)
    assert r.exit_code in (2, 8), r.stderr  # 2 when the model does not split n ways, else 8
    assert "--tp" in r.stderr and len(r.stderr.strip().splitlines()) == 1
