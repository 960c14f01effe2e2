"""The "mla" mixer kind (engine/mla.py) on the CUDA engine: its state, the bf16 latent cache of the engine's
latent-attention layers, and its ops for each pass type, the launches of kernels/mla.cu in the absorbed form
(kv_b_proj's key rows folded into the query, its value rows into the output, the attention over the cached latents
themselves, each cached row read once per group of MLA_HG = 16 heads):

- `RowsMla` (RowsPass and FusedRowsPass: decode, verify, short prefills; graph-capturable): append (norm + rope
  of the latent, written to the cache), absorb_q, attend (key splits fixed per row count), out; every buffer
  preallocated here, the projections' outputs (q_a, q, kv_a) given to the pass (`rows_buffers`);
- `PrefillMla` (PrefillPass: long prompts, eager): the naive form (kv_b decompressing the cached latents by one
  cuBLAS GEMM, the keys and values zero-padded to a head_dim of the flash prefill kernel), or, for head dims it
  lacks, the rows path's four launches over the chunk's rows (the attention in groups of PREFILL_ROWS rows, one key
  split per row).

The NumPy engine's default is the naive form (transformers' algebra); both are the same sums in another order, and
the latent cache is bf16 here as the KV cache is for attention (tests/gpu/test_mla_cuda.py measures the
difference)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from ...errors import DeviceError, InputError
from .kernels.mla import MlaDims, MlaKernels, check_sizes, splits_for

if TYPE_CHECKING:
    from ...models.spec import MlaSpec

# The weights of a latent-attention sublayer the CUDA kernels compute with (engine/mla.py's keys).
WEIGHT_KEYS = frozenset({"input_norm", "q", "q_a", "q_a_norm", "q_b", "kv_a", "kv_a_norm", "kv_b", "o"})
PREFILL_ROWS = 256  # rows per attention launch of a long prefill (bounds its workspace)
MAX_ROWS = 16  # the rows path's rows (buffers.MAX_ROWS)


def sizes_refused(cfg: Any) -> str | None:
    """Why the latent-attention kernels cannot take this model (None when they can); needs no CuPy."""
    for layer in cfg.definition.layers:
        if layer.mixer.kind == "mla":
            m = layer.mixer
            if m.latent_norm.offset:
                return "a (1 + w) latent norm"
            why = check_sizes(MlaDims.of(m))
            if why is not None:
                return why
    return None


class LatentCache:
    """The bf16 latent rows [layers, max_context, kv_lora_rank + qk_rope_head_dim] of the engine's latent-attention
    layers (`layer(i)`: one layer's contiguous view), every position kept (a trim only moves the engine's length),
    and the rows path's preallocated buffers."""

    def __init__(self, engine: Any, layers: list[int]) -> None:
        cp, cfg = engine.cp, engine.cfg
        specs = [cfg.definition.layers[i].mixer for i in layers]
        self.spec: MlaSpec = specs[0]
        if any(s != self.spec for s in specs):
            raise DeviceError("the CUDA latent attention takes one MlaSpec for every layer")
        self.dims = d = MlaDims.of(self.spec)
        self.slot = {layer: i for i, layer in enumerate(layers)}
        self.max_context = engine.max_context
        self.kern = MlaKernels(engine.kern)  # compiled now: never during a graph capture
        self.rows = cp.zeros((len(layers), engine.max_context, d.latent), cp.uint16)
        R = MAX_ROWS
        q_lora = self.spec.q_lora_rank
        self.bufs = {"kv_a": cp.zeros((R, d.latent), cp.float32),
                     "q": cp.zeros((R, d.heads * (d.nope + d.rope)), cp.float32)}
        if q_lora is not None:
            self.bufs["q_a"] = cp.zeros((R, q_lora), cp.float32)
        self.latent = cp.zeros((R, d.rank), cp.float32)  # the normed latent (the kv_a_layernorm tap)
        self.q_cat = cp.zeros((R, d.heads, d.latent), cp.float32)
        self.attn = cp.zeros((R, d.heads * d.v), cp.float32)
        sms = int(getattr(engine.kern, "num_sms", 132))
        self.splits = {m: splits_for(m, d.heads, sms) for m in range(1, R + 1)}
        most = max(m * s for m, s in self.splits.items())
        self.ws_o = cp.zeros((most * d.heads * d.rank,), cp.float32)
        self.ws_ml = cp.zeros((most * d.heads * 2,), cp.float32)

    @property
    def nbytes(self) -> int:
        return int(self.rows.nbytes)

    def layer(self, i: int) -> Any:
        return self.rows[self.slot[i]]

    def rows_buffers(self, m: int) -> dict[str, Any]:
        """The rows path's outputs of this kind's projections (engine/mla.py's out= names) for m rows."""
        return {name: b[:m] for name, b in self.bufs.items()}

    def reset(self) -> None:
        """Nothing to clear: positions past the engine's length are never read."""

    def trim(self, length: int) -> None:
        if not 0 <= length <= self.max_context:
            raise InputError(f"cannot trim the latent cache to {length} positions (it holds {self.max_context})")


def state(engine: Any, layers: list[int]) -> LatentCache:
    """The latent cache of `engine`'s latent-attention layers (engine/mixers.py)."""
    return LatentCache(engine, layers)


class _MlaOps:
    """The four launches over `pos` (the pass's positions) shared by both pass types."""

    def __init__(self, p: Any, cache: LatentCache) -> None:
        self.p, self.cache = p, cache
        self.e, self.s, self.mk, self.d = p.e, p.s, cache.kern, cache.dims

    def _append(self, kv, layer: int, m: MlaSpec, kv_norm, latent):
        self.mk.append(kv, self.p.pos, kv_norm, m.latent_norm.eps, self.e.inv_freq(m.rope), self.d,
                       self.cache.layer(layer), latent, attention_scaling=m.rope.attention_scaling,
                       interleave=m.rope_interleave, stream=self.s)
        return latent

    def _absorb(self, q, m: MlaSpec, kv_b, pos, q_cat):
        self.mk.absorb_q(q, kv_b, pos, self.e.inv_freq(m.rope), self.d, q_cat,
                         attention_scaling=m.rope.attention_scaling, interleave=m.rope_interleave, stream=self.s)


class RowsMla(_MlaOps):
    """The rows paths' latent attention for the pass `p` (p.m rows at positions p.pos): preallocated buffers only."""

    def append_latent(self, kv, layer: int, m: MlaSpec, kv_norm):
        return self._append(kv, layer, m, kv_norm, self.cache.latent[:self.p.m])

    def attention(self, q, layer: int, m: MlaSpec, kv_b, chosen=None):  # no indexer here: loading refuses it
        c, n = self.cache, self.p.m
        splits = c.splits[n]
        self._absorb(q, m, kv_b, self.p.pos, c.q_cat[:n])
        self.mk.attend(c.q_cat[:n], c.layer(layer), self.p.pos, self.d, m.scale, splits, c.ws_o, c.ws_ml,
                       stream=self.s)
        self.mk.out(c.ws_o, c.ws_ml, kv_b, self.d, splits, c.attn[:n], stream=self.s)
        return c.attn[:n]


def naive_head_dim(d: MlaDims) -> int | None:
    """The flash prefill kernel's head_dim that holds a head's key [k_nope; k_pe] and its value zero-padded (the
    smallest of PREFILL_HEAD_DIMS that takes both), or None (the prefill then runs the absorbed kernels)."""
    from .kernels.tuning import PREFILL_HEAD_DIMS

    return next((h for h in sorted(PREFILL_HEAD_DIMS) if h >= max(d.nope + d.rope, d.v)), None)


class PrefillMla(_MlaOps):
    """The prefill path's latent attention for the pass `p` (p.t rows from p.start), eager: its own buffers.

    The naive form, as transformers computes it, where the flash prefill kernel takes the head dims (naive_head_dim):
    kv_b decompresses the cached latents of positions 0..start+t-1 (one cuBLAS GEMM) into per-head keys [k_nope; k_pe]
    and values, zero-padded to one head_dim (the zeros add nothing to a score or an output), in groups of
    NAIVE_HEADS heads, and flash_prefill.cu attends (tensor cores; q and P rounded to bf16 there).  Else, and with
    the engine's `mla` "absorbed" (`--mla absorbed`), the absorbed kernels of the rows path over the chunk's rows."""

    NAIVE_HEADS = 16  # heads per flash launch (bounds the decompressed keys and values)

    def append_latent(self, kv, layer: int, m: MlaSpec, kv_norm):
        cp = self.e.cp
        return self._append(cp.ascontiguousarray(kv), layer, m, kv_norm, cp.empty((self.p.t, self.d.rank), cp.float32))

    def attention(self, q, layer: int, m: MlaSpec, kv_b, chosen=None):  # no indexer here: loading refuses it
        hd = naive_head_dim(self.d)
        if hd is not None and getattr(self.e, "mla", None) != "absorbed":  # --mla absorbed: the absorbed kernels
            try:
                return self._naive(q, layer, m, kv_b, hd)
            except self.e.cp.cuda.memory.OutOfMemoryError:
                raise self.e.oom(f"prefilling {self.p.t} tokens' latent attention (naive form)", 0) from None
        return self._absorbed(q, layer, m, kv_b)

    def _rotated_q_pe(self, q_pe, m: MlaSpec):
        """q_pe [t, H, P] rotated at the pass's positions (mla.cu's mla_rope_pair, in CuPy)."""
        cp = self.e.cp
        ang = self.p.pos.astype(cp.float32)[:, None] * self.e.inv_freq(m.rope)[None, :]
        c = (cp.cos(ang) * cp.float32(m.rope.attention_scaling))[:, None, :]
        s = (cp.sin(ang) * cp.float32(m.rope.attention_scaling))[:, None, :]
        half = q_pe.shape[-1] // 2
        x0, x1 = (q_pe[..., 0::2], q_pe[..., 1::2]) if m.rope_interleave else (q_pe[..., :half], q_pe[..., half:])
        return x0 * c - x1 * s, x1 * c + x0 * s

    def _naive(self, q, layer: int, m: MlaSpec, kv_b, hd: int):
        cp, d, t, k, s = self.e.cp, self.d, self.p.t, self.e.kern, self.s
        end = self.p.start + t
        rows = cp.empty((end, d.latent), cp.float32)
        k.bf16_to_f32(self.cache.layer(layer)[:end], rows, stream=s)
        kv = self.e.proj.gemm(cp.ascontiguousarray(rows[:, :d.rank]), kv_b).reshape(end, d.heads, d.nope + d.v)
        q = q.reshape(t, d.heads, d.nope + d.rope)
        a, b = self._rotated_q_pe(q[..., d.nope:], m)
        out = cp.empty((t, d.heads, d.v), cp.float32)
        for h0 in range(0, d.heads, self.NAIVE_HEADS):
            h1 = min(d.heads, h0 + self.NAIVE_HEADS)
            n = h1 - h0
            keys = cp.zeros((n, end, hd), cp.float32)
            keys[:, :, :d.nope] = kv[:, h0:h1, :d.nope].transpose(1, 0, 2)
            keys[:, :, d.nope:d.nope + d.rope] = rows[None, :, d.rank:]
            values = cp.zeros((n, end, hd), cp.float32)
            values[:, :, :d.v] = kv[:, h0:h1, d.nope:].transpose(1, 0, 2)
            kb, vb = cp.empty(keys.shape, cp.uint16), cp.empty(values.shape, cp.uint16)
            k.f32_to_bf16(keys, kb, stream=s)
            k.f32_to_bf16(values, vb, stream=s)
            del keys, values
            qh = cp.zeros((t, n, hd), cp.float32)
            qh[:, :, :d.nope] = q[:, h0:h1, :d.nope]
            qh[:, :, d.nope:d.nope + d.rope // 2] = a[:, h0:h1]
            qh[:, :, d.nope + d.rope // 2:d.nope + d.rope] = b[:, h0:h1]
            oh = cp.empty((t, n, hd), cp.float32)
            k.attention_prefill(qh, kb, vb, self.p.start, t, oh, m.scale, stream=s)
            out[:, h0:h1] = oh[:, :, :d.v]
        return out.reshape(t, d.heads * d.v)

    def _absorbed(self, q, layer: int, m: MlaSpec, kv_b):
        cp, d, t = self.e.cp, self.d, self.p.t
        try:
            q_cat = cp.empty((t, d.heads, d.latent), cp.float32)
            out = cp.empty((t, d.heads * d.v), cp.float32)
            rows = min(t, PREFILL_ROWS)
            ws_o = cp.empty((rows * d.heads * d.rank,), cp.float32)
            ws_ml = cp.empty((rows * d.heads * 2,), cp.float32)
        except cp.cuda.memory.OutOfMemoryError:
            raise self.e.oom(f"prefilling {t} tokens' latent attention", t * d.heads * (d.latent + d.v) * 4) from None
        self._absorb(cp.ascontiguousarray(q), m, kv_b, self.p.pos, q_cat)
        for r0 in range(0, t, PREFILL_ROWS):
            r1 = min(t, r0 + PREFILL_ROWS)
            self.mk.attend(q_cat[r0:r1], self.cache.layer(layer), self.p.pos[r0:r1], d, m.scale, 1, ws_o, ws_ml,
                           stream=self.s)
            self.mk.out(ws_o, ws_ml, kv_b, d, 1, out[r0:r1], stream=self.s)
        return out


OPS = {"rows": RowsMla, "fused": RowsMla, "prefill": PrefillMla}


def ops(p: Any, cache: LatentCache) -> _MlaOps:
    """The latent-attention ops of pass `p` (its `kind`: "rows", "fused" or "prefill") over `cache`."""
    return OPS[p.kind](p, cache)
