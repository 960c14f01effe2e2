"""Python wrappers of the Gated DeltaNet kernels (gated_delta.cu), a CuPy RawModule of their own: one layer of
the linear_attention kind over T rows (decode, verify) in fp32, the order of backends/numpy/gated_delta.py.

    conv(proj, ...)        the causal conv + SiLU over q | k | v, its state moving on in a ring of slots
    gates(proj, ...)       beta = sigmoid(b), g = -exp(A_log) softplus(a + dt_bias)
    recurrent(conv, ...)   the gated delta rule, the state read once and written once per kept row
    gated_norm(o, ...)     RMSNormGated, w * norm(o) * silu(z)
and for the prefill path (many rows, eager), the same numbers with less of the rows' chain in sequence:
    conv_rows(proj, ...)   the conv parallel over the rows, then the state after the last row
    qk_norm(conv, ...)     q and k l2-normalised in place (recurrent(..., prenormed=True) reads them)
    recurrent_chunked(conv, ..., work)  the rule by chunks of CHUNK rows (backends/numpy/gated_delta.chunked):
                           the chunks' triangular solves in parallel, then one pass over the chunks per state slice

The states are rings of R slots (gated_delta.cu's header): slot p % R holds the state at position p; a pass at
positions pos (int32, on the device) reads the slot of pos[0] and writes the slot of each next position (every
row, or with every=False only the last). The projection's layout (qwen3_next's head-grouped one, qwen3_5's flat
one) is read through `column_maps`, int32 maps built once per spec on the host. The engine's module is
backends/cuda/linear_attention.py; tests/gpu/test_gated_delta_cuda.py checks the kernels against the NumPy
reference.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from .nvrtc import joined_source

PLAIN = ("gdn_conv_kernel", "gdn_gates_kernel", "gdn_gated_norm_kernel", "gdn_recurrent_64_kernel",
         "gdn_recurrent_128_kernel", "gdn_recurrent_256_kernel", "gdn_conv_rows_kernel", "gdn_conv_tail_kernel",
         "gdn_qk_norm_kernel", "gdn_recurrent_pre_64_kernel", "gdn_recurrent_pre_128_kernel",
         "gdn_recurrent_pre_256_kernel", "gdn_chunk_prep_64_kernel", "gdn_chunk_prep_128_kernel",
         "gdn_chunk_prep_256_kernel", "gdn_chunk_state_64_kernel", "gdn_chunk_state_128_kernel",
         "gdn_chunk_state_256_kernel")
KEY_HEAD_DIMS = (64, 128, 256)
MAX_KERNEL = 8  # GDN_MAX_KERNEL
THREADS = 128
CHUNK = 64  # GDN_CHUNK: rows per chunk of recurrent_chunked
CHUNK_THREADS = 256  # GDN_CHUNK_THREADS
CHUNK_BV = 32  # GDN_CHUNK_BV: state columns per block of gdn_chunk_state


def chunk_state_smem(dk: int) -> int:
    """Dynamic shared memory of a gdn_chunk_state block: S [dk, BV], two [CHUNK, dk], intra [CHUNK, CHUNK] and
    v' [CHUNK, BV] in fp32 (104 KiB at dk = 128)."""
    return 4 * (dk * CHUNK_BV + 2 * CHUNK * dk + CHUNK * CHUNK + CHUNK * CHUNK_BV)


def chunk_work_shapes(t: int, spec: Any) -> dict[str, tuple[int, ...]]:
    """The shapes of recurrent_chunked's work area for t rows (fp32 each, rows padded to whole chunks): W
    [v_heads, N CHUNK, dk], U [.., dv], intra [.., CHUNK] and the cumulative decays cum [v_heads, N CHUNK]."""
    rows = -(-t // CHUNK) * CHUNK
    hv = spec.num_v_heads
    return {"w": (hv, rows, spec.k_head_dim), "u": (hv, rows, spec.v_head_dim), "intra": (hv, rows, CHUNK),
            "cum": (hv, rows)}


def module_source() -> str:
    return joined_source('gated_delta.cu')


def column_maps(spec: Any) -> dict[str, np.ndarray]:
    """Where each input of the layer sits in the fused projection's row (models/spec.LinearAttentionSpec):
    `src` [conv_dim] the conv channels q | k | v, `z` [v_dim], `b`, `a` [v_heads]."""
    hk, hv, dk, dv = spec.num_k_heads, spec.num_v_heads, spec.k_head_dim, spec.v_head_dim
    rep, kd, vd = hv // hk, spec.k_dim, spec.v_dim
    if spec.grouped:  # per key head [q_h, k_h, v of its rep value heads, their z], then per key head [b.., a..]
        group, base = 2 * dk + 2 * rep * dv, 2 * kd + 2 * vd
        head = np.arange(hk)[:, None] * group
        q = (head + np.arange(dk)).ravel()
        k = (head + dk + np.arange(dk)).ravel()
        v = (head + 2 * dk + np.arange(rep * dv)).ravel()
        z = (head + 2 * dk + rep * dv + np.arange(rep * dv)).ravel()
        ba = base + np.arange(hk)[:, None] * 2 * rep
        b, a = (ba + np.arange(rep)).ravel(), (ba + rep + np.arange(rep)).ravel()
    else:  # q | k | v | z | b | a
        q, k, v = np.arange(kd), kd + np.arange(kd), 2 * kd + np.arange(vd)
        z = 2 * kd + vd + np.arange(vd)
        b, a = 2 * kd + 2 * vd + np.arange(hv), 2 * kd + 2 * vd + hv + np.arange(hv)
    return {"src": np.concatenate([q, k, v]).astype(np.int32), "z": z.astype(np.int32),
            "b": b.astype(np.int32), "a": a.astype(np.int32)}


class GatedDeltaKernels:
    """The Gated DeltaNet kernels, launched through `kern` (a cuda.kernels.Kernels)."""

    def __init__(self, kern: Any) -> None:
        cp = kern._cp
        self.k, self._cp = kern, cp
        try:
            module = cp.RawModule(code=module_source(), options=("-std=c++17", "-DMETRALE_NVRTC"))
            self._fn = {n: module.get_function(n) for n in PLAIN}
        except Exception as e:  # an NVRTC or driver failure: one clear line
            from ....errors import DeviceError

            raise DeviceError(f"cannot compile the Gated DeltaNet kernels ({type(e).__name__}: "
                              f"{str(e).splitlines()[0]})") from None

    def _launch(self, name: str, grid: tuple, block: tuple, args: tuple, stream: Any) -> None:
        self._fn[name](grid, block, args, stream=stream)

    def conv(self, proj: Any, src: Any, weight: Any, ring: Any, positions: Any, out: Any, *, every: bool = True,
             stream: Any = None) -> None:
        """out f32 [T, C] = silu(causal conv) of the channels proj[:, src] (proj f32 [T, in], src int32 [C]),
        weight bf16 [C, K]; ring f32 [R, C, K - 1] (R > 1): read at the slot of positions[0], written at the
        next position's slot after every row (every) or the last; positions int32 [T], consecutive."""
        k = self.k
        k._f32(proj, "proj", 2)
        k._i32(src, "src", 1)
        k._bf16(weight, "weight", 2)
        k._f32(ring, "ring", 3)
        k._i32(positions, "positions", 1)
        (t, width), (c,), (_, kernel) = proj.shape, src.shape, weight.shape
        if not 1 <= kernel <= MAX_KERNEL:
            raise ValueError(f"conv: kernel size {kernel} outside 1..{MAX_KERNEL}")
        k._shape(weight, "weight", (c, kernel))
        k._shape(ring, "ring", (ring.shape[0], c, kernel - 1))
        k._shape(positions, "positions", (t,))
        k._shape(out, "out", (t, c))
        if ring.shape[0] < 2 or t == 0:
            raise ValueError(f"conv: {ring.shape[0]} ring slots for {t} rows (at least 2 slots, 1 row)")
        args = (proj, np.int32(width), src, weight, ring, np.int32(ring.shape[0]), positions, np.int32(bool(every)),
                out, np.int32(t), np.int32(c), np.int32(kernel))
        self._launch("gdn_conv_kernel", (-(-c // THREADS),), (THREADS,), args, stream)

    def conv_rows(self, proj: Any, src: Any, weight: Any, ring: Any, positions: Any, out: Any, *,
                  stream: Any = None) -> None:
        """conv(..., every=False) parallel over the rows: out f32 [T, C] (T >= kernel - 1), then the slot of
        positions[0] + T gets the state after the last row (a second launch)."""
        k = self.k
        k._f32(proj, "proj", 2)
        k._i32(src, "src", 1)
        k._bf16(weight, "weight", 2)
        k._f32(ring, "ring", 3)
        k._i32(positions, "positions", 1)
        (t, width), (c,), (_, kernel) = proj.shape, src.shape, weight.shape
        if not 1 <= kernel <= MAX_KERNEL:
            raise ValueError(f"conv_rows: kernel size {kernel} outside 1..{MAX_KERNEL}")
        k._shape(weight, "weight", (c, kernel))
        k._shape(ring, "ring", (ring.shape[0], c, kernel - 1))
        k._shape(positions, "positions", (t,))
        k._shape(out, "out", (t, c))
        if ring.shape[0] < 2 or t < max(1, kernel - 1):
            raise ValueError(f"conv_rows: {ring.shape[0]} ring slots for {t} rows (at least 2 slots, kernel - 1 rows)")
        args = (proj, np.int32(width), src, weight, ring, np.int32(ring.shape[0]), positions, out, np.int32(t),
                np.int32(c), np.int32(kernel))
        self._launch("gdn_conv_rows_kernel", (-(-(t * c) // THREADS),), (THREADS,), args, stream)
        args = (proj, np.int32(width), src, ring, np.int32(ring.shape[0]), positions, np.int32(t), np.int32(c),
                np.int32(kernel))
        self._launch("gdn_conv_tail_kernel", (-(-c // THREADS),), (THREADS,), args, stream)

    def qk_norm(self, conv: Any, spec: Any, *, stream: Any = None) -> None:
        """q and k of conv f32 [T, conv_dim] l2-normalised in place per row and key head, q also times
        k_head_dim ** -0.5 (as recurrent computes them), for recurrent(..., prenormed=True)."""
        k = self.k
        k._f32(conv, "conv", 2)
        t = conv.shape[0]
        k._shape(conv, "conv", (t, spec.conv_dim))
        if t == 0:
            return
        args = (conv, np.int32(spec.conv_dim), np.int32(spec.num_k_heads), np.int32(spec.k_head_dim))
        self._launch("gdn_qk_norm_kernel", (t, 2 * spec.num_k_heads), (THREADS,), args, stream)

    def gates(self, proj: Any, b_col: Any, a_col: Any, a_log: Any, dt_bias: Any, beta: Any, g: Any, *,
              stream: Any = None) -> None:
        """beta, g f32 [T, H] from proj f32 [T, in] at columns b_col, a_col (int32 [H]); a_log, dt_bias f32 [H]."""
        k = self.k
        k._f32(proj, "proj", 2)
        (t, width), (h,) = proj.shape, b_col.shape
        for name, arr, shape in (("a_col", a_col, (h,)), ("a_log", a_log, (h,)), ("dt_bias", dt_bias, (h,)),
                                 ("beta", beta, (t, h)), ("g", g, (t, h))):
            k._shape(arr, name, shape)
        args = (proj, np.int32(width), b_col, a_col, a_log, dt_bias, beta, g, np.int32(t), np.int32(h))
        self._launch("gdn_gates_kernel", (-(-(t * h) // THREADS),), (THREADS,), args, stream)

    def recurrent(self, conv: Any, beta: Any, g: Any, ring: Any, positions: Any, out: Any, spec: Any, *,
                  every: bool = True, prenormed: bool = False, stream: Any = None) -> None:
        """The gated delta rule over T rows: conv f32 [T, conv_dim] (q | k | v after the conv; with prenormed, q
        and k already through qk_norm), beta, g f32 [T, v_heads], out f32 [T, v_heads, dv]; ring f32
        [R, v_heads, dk, dv] (R > 1): read at the slot of positions[0], written at the next position's slot after
        every row (every) or the last; positions int32 [T], consecutive."""
        dk, dv, hk, hv = spec.k_head_dim, spec.v_head_dim, spec.num_k_heads, spec.num_v_heads
        t = self._check_rule("recurrent", conv, beta, g, ring, positions, out, spec)
        columns = THREADS // (dk // 32)
        args = (conv, np.int32(spec.conv_dim), beta, g, ring, np.int32(ring.shape[0]), positions,
                np.int32(bool(every)), out, np.int32(t), np.int32(hk), np.int32(hv), np.int32(dv))
        name = f"gdn_recurrent_pre_{dk}_kernel" if prenormed else f"gdn_recurrent_{dk}_kernel"
        self._launch(name, (hv, -(-dv // columns)), (THREADS,), args, stream)

    def _check_rule(self, op: str, conv, beta, g, ring, positions, out, spec) -> int:
        """The operands of the gated delta rule's kernels (recurrent, recurrent_chunked); returns T."""
        k = self.k
        dk, dv, hv = spec.k_head_dim, spec.v_head_dim, spec.num_v_heads
        if dk not in KEY_HEAD_DIMS:
            raise ValueError(f"{op}: key head dim {dk} not in {KEY_HEAD_DIMS}")
        t = conv.shape[0]
        k._f32(conv, "conv", 2)
        k._f32(ring, "ring", 4)
        k._i32(positions, "positions", 1)
        k._shape(conv, "conv", (t, spec.conv_dim))
        k._shape(beta, "beta", (t, hv))
        k._shape(g, "g", (t, hv))
        k._shape(ring, "ring", (ring.shape[0], hv, dk, dv))
        k._shape(positions, "positions", (t,))
        k._shape(out, "out", (t, hv, dv))
        if ring.shape[0] < 2 or t == 0:
            raise ValueError(f"{op}: {ring.shape[0]} ring slots for {t} rows (at least 2 slots, 1 row)")
        return t

    def recurrent_chunked(self, conv: Any, beta: Any, g: Any, ring: Any, positions: Any, out: Any, spec: Any,
                          work: dict[str, Any], *, stream: Any = None) -> None:
        """recurrent(conv, ..., every=False, prenormed=True) by chunks of CHUNK rows (the numbers of
        backends/numpy/gated_delta.chunked, not those of the sequential rule bit for bit): the same arguments, and
        `work`, f32 arrays of chunk_work_shapes(T, spec) by name (16-byte aligned, overwritten). Two launches:
        gdn_chunk_prep (grid chunks x v_heads) fills the work area, gdn_chunk_state (grid v_heads x dv / BV)
        reads the slot of positions[0], runs the chunks in order and writes the slot of positions[0] + T."""
        k = self.k
        dk, dv, hk, hv = spec.k_head_dim, spec.v_head_dim, spec.num_k_heads, spec.num_v_heads
        t = self._check_rule("recurrent_chunked", conv, beta, g, ring, positions, out, spec)
        for name, shape in chunk_work_shapes(t, spec).items():
            k._f32(work[name], name, len(shape))
            k._shape(work[name], name, shape)
            k._aligned(work[name], name)
        w, u, intra, cum = work["w"], work["u"], work["intra"], work["cum"]
        chunks = w.shape[1] // CHUNK
        args = (conv, np.int32(spec.conv_dim), beta, g, w, u, intra, cum, np.int32(t), np.int32(hk), np.int32(hv),
                np.int32(dv))
        self._launch(f"gdn_chunk_prep_{dk}_kernel", (chunks, hv), (CHUNK_THREADS,), args, stream)
        name, smem = f"gdn_chunk_state_{dk}_kernel", chunk_state_smem(dk)
        fn = self._fn[name]
        done = self.__dict__.setdefault("_smem_set", set())
        if name not in done:  # opt in to more than 48 KiB of dynamic shared memory, once
            fn.max_dynamic_shared_size_bytes = smem
            done.add(name)
        args = (conv, np.int32(spec.conv_dim), w, u, intra, cum, ring, np.int32(ring.shape[0]), positions, out,
                np.int32(t), np.int32(hk), np.int32(hv), np.int32(dv))
        fn((hv, -(-dv // CHUNK_BV)), (CHUNK_THREADS,), args, stream=stream, shared_mem=smem)

    def gated_norm(self, o: Any, proj: Any, z_col: Any, weight: Any, eps: float, y: Any, *,
                   stream: Any = None) -> None:
        """y f32 [T, v_heads * dv] = weight * rms_norm(o) * silu(proj[:, z_col]); o f32 [T, v_heads, dv],
        weight bf16 [dv]."""
        k = self.k
        t, hv, dv = o.shape
        k._shape(z_col, "z_col", (hv * dv,))
        k._shape(weight, "weight", (dv,))
        k._shape(y, "y", (t, hv * dv))
        args = (o, proj, np.int32(proj.shape[1]), z_col, weight, np.float32(eps), y, np.int32(hv), np.int32(dv))
        self._launch("gdn_gated_norm_kernel", (t, hv), (THREADS,), args, stream)
