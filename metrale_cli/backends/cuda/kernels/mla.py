"""Python wrappers of the latent-attention kernels (mla.cu), a CuPy RawModule of their own, built from common.cu +
mla.cu only when a model has latent-attention layers.  Launches go through the engine's `Kernels` (its PDL
setting); every method checks its operands (ValueError with a clear message) and launches without host reads or
syncs, so a rows pass stays capturable in a CUDA graph.

Dims (`MlaDims`, from models/spec.MlaSpec): H heads, NOPE + P query/key dims per head, V value dims, R the
kv_lora_rank, D = R + P floats per cached position."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from .nvrtc import joined_source

MLA_HG = 16  # heads per attention block (one warp each): must match mla.cu
MLA_TK = 16  # cached rows per tile
MLA_MAX_D = 768  # kv_lora_rank + qk_rope_head_dim at most
MLA_LOADS = 3  # a tile's 16-byte chunks per thread: MLA_TK * MLA_MAX_D / 8 / (MLA_HG * 32)
MLA_MAX_R = 512
MLA_MAX_NOPE = 256
MLA_Q_COLS = 64  # q_cat columns per mla_q_kernel block
MLA_Q_WARPS = 4
MLA_OUT_THREADS = 128
MLA_OUT_V = 32  # value dims per mla_out_kernel block
MLA_MAX_SPLITS = 64  # key splits at most (mla_out_kernel weighs each with one of its threads)
SMEM_LIMIT = 48 * 1024  # dynamic shared memory without an opt-in
PLAIN = ("mla_append_kernel", "mla_q_kernel", "mla_attend_kernel", "mla_out_kernel")


@dataclass(frozen=True)
class MlaDims:
    heads: int
    nope: int
    rope: int
    v: int
    rank: int

    @staticmethod
    def of(spec: Any) -> MlaDims:
        return MlaDims(spec.num_heads, spec.qk_nope_head_dim, spec.qk_rope_head_dim, spec.v_head_dim,
                       spec.kv_lora_rank)

    @property
    def latent(self) -> int:
        return self.rank + self.rope

    def attend_smem(self) -> int:
        """mla_attend_kernel's dynamic shared memory: one tile of MLA_TK cached rows in fp32."""
        return MLA_TK * self.latent * 4


def check_sizes(d: MlaDims) -> str | None:
    """Why the kernels cannot take these dims (None when they can); needs no CuPy."""
    if d.rank > MLA_MAX_R:
        return f"kv_lora_rank {d.rank} (the latent-attention kernels take at most {MLA_MAX_R})"
    if d.nope > MLA_MAX_NOPE:
        return f"qk_nope_head_dim {d.nope} (at most {MLA_MAX_NOPE})"
    if d.rank % 8 or d.rope % 8:
        return (f"kv_lora_rank {d.rank} and qk_rope_head_dim {d.rope} (the kernels read 16-byte chunks: multiples "
                "of 8)")
    if d.latent > MLA_MAX_D:
        return f"a latent row of {d.latent} values (kv_lora_rank + qk_rope_head_dim; at most {MLA_MAX_D})"
    return None


def splits_for(rows: int, heads: int, num_sms: int) -> int:
    """Key splits of the attention for a pass of `rows` rows: about two blocks per SM for one row, one for more, at
    most 64 (fixed per row count, so a captured graph keeps it; each split takes an equal part of the row's own
    length). Measured on deepseek-v2-lite (benchmarks/bench_mla_splits.py, H100): decode is fastest at 64 splits
    (1024 and 8192 positions; fewer cost up to 2x at 8192), verify k=4 at 32 (7.42 ms against 7.72 at 64, 12.6
    against 13.9 at 8192 positions)."""
    blocks = rows * -(-heads // MLA_HG)
    per_sm = 2 if rows == 1 else 1
    return max(1, min(MLA_MAX_SPLITS, -(-per_sm * num_sms // blocks)))


def module_source() -> str:
    """common.cu followed by mla.cu."""
    return joined_source('mla.cu')


class MlaKernels:
    """The latent-attention kernels, launched through `kern` (a cuda.kernels.Kernels) for its checks and PDL."""

    def __init__(self, kern: Any) -> None:
        cp = kern._cp
        self.k, self._cp, self._np = kern, cp, kern._np
        try:
            module = cp.RawModule(code=module_source(), options=("-std=c++17",))
            self._fn = {n: module.get_function(n) for n in PLAIN}
        except Exception as e:  # an NVRTC or driver failure: one clear line
            from ....errors import DeviceError

            raise DeviceError(f"cannot compile the latent-attention kernels ({type(e).__name__}: "
                              f"{str(e).splitlines()[0] if str(e) else ''})") from None

    def _launch(self, name: str, grid: tuple, block: tuple, args: tuple, stream: Any, shared_mem: int = 0) -> None:
        k = self.k
        if k.pdl:
            if k._pdl_launcher is None:
                from .pdl import PdlLauncher

                k._pdl_launcher = PdlLauncher(self._cp)
            k._pdl_launcher.launch(self._fn[name], grid, block, args, stream, shared_mem)
        else:
            self._fn[name](grid, block, args, stream=stream, shared_mem=shared_mem)

    def _rows(self, a: Any, name: str, m: int, width: int, exact: bool = True) -> None:
        """a f32 [m, width] (contiguous; wider rows too when not `exact`: the kernel takes their stride)."""
        k = self.k
        k._f32(a, name, 2)
        if a.shape[0] != m or a.shape[1] < width or (exact and a.shape[1] != width):
            raise ValueError(f"mla: {name} {tuple(a.shape)}, want [{m}, {'' if exact else '>= '}{width}]")

    def _positions(self, positions: Any) -> int:
        self.k._i32(positions, "positions", 1)
        return positions.shape[0]

    def _cache(self, cache: Any, d: MlaDims) -> None:
        self.k._bf16(cache, "cache", 2)
        self.k._aligned(cache, "cache")  # 16-byte chunks of its rows
        if cache.shape[1] != d.latent:
            raise ValueError(f"mla: cache rows of {cache.shape[1]}, want {d.latent}")

    # ------------------------------------------------------------------ launches
    def append(self, kv: Any, positions: Any, norm_w: Any, eps: float, inv_freq: Any, d: MlaDims, cache: Any,
               latent: Any, *, attention_scaling: float = 1.0, interleave: bool = True, stream: Any = None) -> None:
        """cache[positions[m]] = bf16 [RMSNorm(kv[m, :R]) ; rope(kv[m, R:D])], latent f32 [M, R] = the normed part.
        kv f32 [M, >= D] (contiguous rows), norm_w bf16 [R], inv_freq f32 [P/2], cache bf16 [max_context, D]."""
        np = self._np
        m = self._positions(positions)
        self._rows(kv, "kv", m, d.latent, exact=False)
        self._rows(latent, "latent", m, d.rank)
        self.k._bf16(norm_w, "norm_w", 1)
        self.k._shape(norm_w, "norm_w", (d.rank,))
        self.k._f32(inv_freq, "inv_freq", 1)
        self.k._shape(inv_freq, "inv_freq", (d.rope // 2,))
        self._cache(cache, d)
        if m == 0:
            return
        args = (kv, np.int32(kv.shape[1]), positions, norm_w, np.float32(eps), inv_freq,
                np.float32(attention_scaling), np.int32(interleave), np.int32(d.rank), np.int32(d.rope), cache, latent)
        self._launch("mla_append_kernel", (m,), (256,), args, stream)

    def absorb_q(self, q: Any, kv_b: Any, positions: Any, inv_freq: Any, d: MlaDims, q_cat: Any, *,
                 attention_scaling: float = 1.0, interleave: bool = True, stream: Any = None) -> None:
        """q_cat f32 [M, H, D] = per head [q_nope W_k ; rope(q_pe)] from q f32 [M, H (NOPE + P)] and kv_b bf16
        [H (NOPE + V), R]."""
        np = self._np
        m = self._positions(positions)
        self._rows(q, "q", m, d.heads * (d.nope + d.rope))
        self._kv_b(kv_b, d)
        self.k._f32(inv_freq, "inv_freq", 1)
        self.k._f32(q_cat, "q_cat", 3)
        self.k._shape(q_cat, "q_cat", (m, d.heads, d.latent))
        if m == 0:
            return
        args = (q, np.int32(m), np.int32(d.heads), np.int32(d.nope), np.int32(d.rope), np.int32(d.v),
                np.int32(d.rank), kv_b, positions, inv_freq, np.float32(attention_scaling), np.int32(interleave),
                q_cat)
        self._launch("mla_q_kernel", (-(-d.rank // MLA_Q_COLS), d.heads), (MLA_Q_WARPS * 32,), args, stream)

    def attend(self, q_cat: Any, cache: Any, positions: Any, d: MlaDims, scale: float, splits: int, ws_o: Any,
               ws_ml: Any, *, stream: Any = None) -> None:
        """Row m attends over cache positions 0..positions[m]: the partials of `splits` key splits, ws_o f32
        [>= M splits H R] (unnormalised o_lat) and ws_ml f32 [>= M splits H 2] (max, sum)."""
        np = self._np
        m = self._positions(positions)
        self.k._f32(q_cat, "q_cat", 3)
        self.k._shape(q_cat, "q_cat", (m, d.heads, d.latent))
        self._cache(cache, d)
        self._workspace(ws_o, ws_ml, m, splits, d)
        if m == 0:
            return
        args = (q_cat, cache, positions, np.int32(d.heads), np.int32(d.rank), np.int32(d.rope), np.int32(splits),
                np.float32(scale), ws_o, ws_ml)
        self._launch("mla_attend_kernel", (splits, -(-d.heads // MLA_HG), m), (MLA_HG * 32,), args, stream,
                     shared_mem=d.attend_smem())

    def out(self, ws_o: Any, ws_ml: Any, kv_b: Any, d: MlaDims, splits: int, out: Any, *, stream: Any = None) -> None:
        """out f32 [M, H V]: the splits combined, normalised and mapped through kv_b's value rows per head."""
        np = self._np
        self.k._f32(out, "out", 2)
        m = out.shape[0]
        self.k._shape(out, "out", (m, d.heads * d.v))
        self._kv_b(kv_b, d)
        self._workspace(ws_o, ws_ml, m, splits, d)
        if m == 0:
            return
        args = (ws_o, ws_ml, np.int32(d.heads), np.int32(d.rank), np.int32(d.nope), np.int32(d.v), np.int32(splits),
                kv_b, out)
        self._launch("mla_out_kernel", (d.heads, -(-d.v // MLA_OUT_V), m), (MLA_OUT_THREADS,), args, stream)

    def _kv_b(self, kv_b: Any, d: MlaDims) -> None:
        self.k._bf16(kv_b, "kv_b", 2)
        self.k._shape(kv_b, "kv_b", (d.heads * (d.nope + d.v), d.rank))

    def _workspace(self, ws_o: Any, ws_ml: Any, m: int, splits: int, d: MlaDims) -> None:
        k = self.k
        k._f32(ws_o, "ws_o", 1)
        k._f32(ws_ml, "ws_ml", 1)
        if not 1 <= splits <= MLA_MAX_SPLITS:
            raise ValueError(f"mla: {splits} key splits (1..{MLA_MAX_SPLITS})")
        if ws_o.size < m * splits * d.heads * d.rank or ws_ml.size < m * splits * d.heads * 2:
            raise ValueError(f"mla: workspace of {ws_o.size} / {ws_ml.size} floats for {m} rows x {splits} splits")


__all__ = ["MlaDims", "MlaKernels", "check_sizes", "module_source", "splits_for"]
