"""Shared helpers of the GPU tests: bf16 bit conversions, random bf16 data, float64 references of the
kernels' maths, the relative-error check (NaN never passes), and reading an engine's logits rows (tests/engine_rows.py,
shared with the CPU plumbing tests)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import ml_dtypes
import numpy as np

from engine_rows import decoded_and_verified, rel, rows  # noqa: F401 (handed on to the GPU tests)

TOL = 1e-2  # bf16 operands, fp32 accumulation
BF16 = np.dtype(ml_dtypes.bfloat16)


def bf16_bits(x) -> np.ndarray:
    """float -> bf16 bits (round to nearest even) as uint16 (finite inputs)."""
    return np.asarray(x, dtype=np.float32).astype(BF16).view(np.uint16)


def bits_f32(b) -> np.ndarray:
    return (np.asarray(b, dtype=np.uint16).astype(np.uint32) << 16).view(np.float32)


def rand_bf16(rng, shape, scale=1.0):
    """Random bf16 bits and their exact float32 values."""
    b = bf16_bits(rng.standard_normal(shape, dtype=np.float32) * np.float32(scale))
    return b, bits_f32(b)


def torch_bf16_bits(x: np.ndarray) -> np.ndarray:
    """torch CPU `.to(torch.bfloat16)`: round to nearest even; every NaN -> 0x7FC0."""
    u = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32).astype(np.uint64)
    r = ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype(np.uint16)
    r[np.isnan(x)] = 0x7FC0
    return r


def rel_err(out, ref, seed) -> float:
    out = np.asarray(out, dtype=np.float64)
    ref = np.asarray(ref, dtype=np.float64)
    assert out.shape == ref.shape, (out.shape, ref.shape)
    bad = ~np.isfinite(out)
    assert not bad.any(), f"seed={seed}: {int(bad.sum())} non-finite (unwritten?) outputs, first at {np.argwhere(bad)[0]}"
    return float(np.linalg.norm(out - ref) / max(np.linalg.norm(ref), 1e-30))


def assert_close(out, ref, seed, tol=TOL):
    e = rel_err(out, ref, seed)
    assert e <= tol, f"seed={seed}: relative error {e:.3e} > {tol:g}"


def verify_against_decode(gpu, prompt: list[int], drafts: list[int]) -> float:
    """The relative difference between a verify of `drafts` after `prompt` and the same tokens decoded one by one
    (rows path, graphs on), on a reset engine."""
    gpu.reset()
    gpu.prefill(prompt)
    gpu.verify(drafts)
    v = rows(gpu, gpu.logits_buffer_ptr(), len(drafts))
    gpu.trim(len(prompt))
    seq = []
    for t in drafts:
        gpu.decode(t)
        seq.append(rows(gpu, gpu.decode_logits_ptr(), 1)[0])
    return rel(v, np.stack(seq))


def graph_and_eager_decodes(path, prompt: list[int], steps: int = 8) -> tuple[np.ndarray, np.ndarray]:
    """The logits rows of `steps` greedy decode steps after `prompt` of the checkpoint at `path` on a CUDA engine
    with graphs, then on one without (the same values expected bit for bit)."""
    from metrale_cli import decoding
    from metrale_cli.backends.cuda.loading import load_cuda_engine
    from metrale_cli.checkpoint import Checkpoint
    from metrale_cli.config import load_config

    out = []
    for graphs in (True, False):
        with Checkpoint.open(path) as ckpt:
            e = load_cuda_engine(load_config(path), ckpt, 64, fp32_logits=True, use_graphs=graphs)
        out.append(decoding.run_decode(e, prompt, steps, keep_rows=True).rows.array())
    return out[0], out[1]


def nan_like(cp, shape):
    return cp.full(shape, np.nan, dtype=cp.float32)


def inv_freq_default(head_dim: int, theta: float) -> np.ndarray:
    exps = np.arange(0, head_dim, 2, dtype=np.int64).astype(np.float32) / np.float32(head_dim)
    return (np.float32(1.0) / (np.float32(theta) ** exps)).astype(np.float32)


def ref_rmsnorm(h32: np.ndarray, w: np.ndarray, eps: float) -> np.ndarray:
    h = h32.astype(np.float64)
    var = np.mean(h * h, axis=-1, keepdims=True)
    return w.astype(np.float64) * (h / np.sqrt(var + eps))


def ref_rope(x, positions, inv_freq, norm_w=None, eps=1e-6, scaling=1.0):
    x = x.astype(np.float64)
    M, nh, hd = x.shape
    if norm_w is not None:
        x = ref_rmsnorm(x, norm_w, eps)
    ang = positions.astype(np.float32)[:, None] * inv_freq[None, :]  # fp32 product, as HF
    c = np.cos(ang.astype(np.float64))[:, None, :] * scaling
    s = np.sin(ang.astype(np.float64))[:, None, :] * scaling
    a, b = x[..., : hd // 2], x[..., hd // 2 :]
    return np.concatenate([a * c - b * s, b * c + a * s], axis=-1)


def silu(g):
    return g / (1.0 + np.exp(-g))


def gelu_tanh(g):
    return 0.5 * g * (1.0 + np.tanh(math.sqrt(2.0 / math.pi) * (g + 0.044715 * g ** 3)))


def fused_gemv_case(rng, x: np.ndarray, w: np.ndarray, swiglu: bool, norm: bool, activation: str):
    """(kwargs, want) of a quantized GEMV with its fused options (qgemv.cu) over the dequantized weight w (float64
    [N, K]): a fresh bf16 norm weight with Gemma's offset and the float64 RMSNorm of x first when `norm`, then x @
    w.T, with swiglu act(gate) * up of its halves."""
    kw, xs = {"swiglu": swiglu, "activation": activation}, x.astype(np.float64)
    if norm:
        bits, nw = rand_bf16(rng, (x.shape[1],), 0.5)
        kw.update(norm_weight=bits, eps=1e-5, norm_offset=1.0)  # bits: the caller puts them on the device
        xs = ref_rmsnorm(x, nw.astype(np.float64) + 1.0, 1e-5)
    y = xs @ w.T
    if swiglu:
        g, u = np.split(y, 2, axis=1)
        y = (silu(g) if activation == "silu" else gelu_tanh(g)) * u
    return kw, y


def ref_attention(q, kf, vf, positions, scale):
    """q [M, nh, hd]; kf, vf [n_kv, max_ctx, hd]; row m sees keys 0..min(positions[m], max_ctx-1);
    a row with a negative position is NaN."""
    M, nh, hd = q.shape
    n_kv, max_ctx = kf.shape[:2]
    G = nh // n_kv
    out = np.full((M, nh, hd), np.nan)
    for m in range(M):
        p = min(int(positions[m]), max_ctx - 1)
        if p < 0:
            continue
        K = kf[:, : p + 1].astype(np.float64)
        V = vf[:, : p + 1].astype(np.float64)
        qq = q[m].astype(np.float64).reshape(n_kv, G, hd)
        s = np.einsum("kgd,kld->kgl", qq, K) * scale
        s -= s.max(axis=-1, keepdims=True)
        e = np.exp(s)
        out[m] = (np.einsum("kgl,kld->kgd", e, V) / e.sum(axis=-1, keepdims=True)).reshape(nh, hd)
    return out


def make_cache(rng, n_kv, max_ctx, hd, valid):
    """Random bf16 K/V bits for rows < valid; rows >= valid hold NaN."""
    kb = bf16_bits(rng.standard_normal((n_kv, max_ctx, hd), dtype=np.float32))
    vb = bf16_bits(rng.standard_normal((n_kv, max_ctx, hd), dtype=np.float32))
    kb[:, valid:] = 0x7FC0
    vb[:, valid:] = 0x7FC0
    return kb, vb


def assert_near_tie(row, what: str) -> None:
    """A reference logits row whose argmax another engine may pick differently: its top-1 / top-2 margin
    must be below one bf16 ulp at the top logit's magnitude (the GPU's bf16 rounding can flip it)."""
    top = np.sort(np.asarray(row, np.float64))[-2:]
    resolution = abs(top[1]) * 2.0 ** -8
    print(f"{what}: margin {top[1] - top[0]:.3g}, bf16 resolution {resolution:.3g}")
    assert top[1] - top[0] < resolution, f"{what} differs with margin {top[1] - top[0]:.3g} >= {resolution:.3g}"


def tokens_agree(ta, tb, ref_rows, what: str = "greedy") -> int:
    """How many leading steps two greedy runs share the rows of: all when the tokens are equal, else up to
    and including the first differing token, which must be a near tie of the reference rows."""
    if list(ta) == list(tb):
        return len(ta)
    i = next(j for j, (x, y) in enumerate(zip(ta, tb)) if x != y)
    assert_near_tie(ref_rows[i], f"{what} token {i}")
    return i + 1


def untied_logits(rng, m: int, experts: int, k: int, extra: int = 0, corr=None) -> np.ndarray:
    """Fresh router logits [m, experts + extra] (standard normal times 2; `extra` columns after the experts', a
    shared expert's gate logit) whose choice scores (the logits, or sigmoid + corr with a choice correction) have no
    near tie among each row's 2k best: an fp32 rounding (NumPy's and the kernels' exp differ by an ulp) cannot
    reorder the choice."""
    for _ in range(100):
        logits = (rng.standard_normal((m, experts + extra)) * 2).astype(np.float32)
        score = logits[:, :experts].astype(np.float64)
        if corr is not None:
            score = 1 / (1 + np.exp(-score)) + corr
        top = -np.sort(-score, axis=1)[:, :2 * k]
        if np.all(top[:, :-1] - top[:, 1:] > 1e-5):
            return logits
    raise AssertionError("100 draws of router logits with a near tie")


def assert_union(b, idx, seed, held: range | None = None) -> None:
    """The route kernel's union in RouteBuffers b for the rows' choices idx [M, k]: every chosen expert of `held`
    (None: all) once, in increasing order, with the mask of the rows that chose it and each row's slot (-1 for the
    rows that did not, up to the buffers' 16 rows)."""
    m = len(idx)
    n = int(b.n_union.get()[0])
    ue, um, us = b.union_e.get()[:n], b.union_mask.get()[:n], b.union_slot.get()[:n]
    assert list(ue) == sorted(e for e in set(idx.ravel().tolist()) if held is None or e in held), f"seed={seed}"
    for e, mask, slots in zip(ue, um, us):
        for r in range(b.union_slot.shape[1]):
            chose = r < m and e in idx[r]
            assert bool((int(mask) >> r) & 1) == chose, f"seed={seed}: expert {e} row {r}"
            assert slots[r] == (list(idx[r]).index(e) if chose else -1), f"seed={seed}: expert {e} row {r}"


def random_checkpoints(root: Path, base: dict, archs: dict, seed: int) -> dict:
    """One fresh random bf16 checkpoint per entry of archs ({name: config fields over base}) under root, drawn
    with metrale's RandomTensors from seed: {name: its folder}."""
    from safetensors.numpy import save_file

    from metrale_cli.config import parse_config
    from metrale_cli.random_weights import RandomTensors

    out = {}
    for name, extra in archs.items():
        raw = {**base, **extra}
        src = RandomTensors(parse_config(raw), seed=seed)
        d = Path(root) / name
        d.mkdir()
        save_file({n: np.asarray(src.array(n), np.float32).astype(ml_dtypes.bfloat16) for n in src.tensor_names()},
                  str(d / "model.safetensors"))
        (d / "config.json").write_text(json.dumps(raw))
        out[name] = d
    return out
