"""The "mla" mixer kind (engine/mla.py) on the CUDA engine: its state, the bf16 latent cache of the engine's
latent-attention layers, and its ops for each pass type, the launches of kernels/mla.cu in the absorbed form
(kv_b_proj's key rows folded into the query, its value rows into the output, the attention over the cached latents
themselves, each cached row read once per group of MLA_HG heads):

- `RowsMla` (RowsPass and FusedRowsPass: decode, verify, short prefills; graph-capturable): append (norm + rope
  of the latent, written to the cache), absorb_q, attend (key splits fixed per row count), out; every buffer
  preallocated here, the projections' outputs (q_a, q, kv_a) given to the pass (`rows_buffers`);
- `PrefillMla` (PrefillPass: long prompts, eager): the same four launches over the chunk's rows, the attention in
  groups of PREFILL_ROWS rows (its workspace bounded), one key split per row.

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

    def attention(self, q, layer: int, m: MlaSpec, kv_b):
        c, n = self.cache, self.p.m
        splits = c.splits[n]
        self._absorb(q, m, kv_b, self.p.pos, c.q_cat[:n])
        self.mk.attend(c.q_cat[:n], c.layer(layer), self.p.pos, self.d, m.scale, splits, c.ws_o, c.ws_ml,
                       stream=self.s)
        self.mk.out(c.ws_o, c.ws_ml, kv_b, self.d, splits, c.attn[:n], stream=self.s)
        return c.attn[:n]


class PrefillMla(_MlaOps):
    """The prefill path's latent attention for the pass `p` (p.t rows from p.start), eager: its own buffers."""

    def append_latent(self, kv, layer: int, m: MlaSpec, kv_norm):
        cp = self.e.cp
        return self._append(cp.ascontiguousarray(kv), layer, m, kv_norm, cp.empty((self.p.t, self.d.rank), cp.float32))

    def attention(self, q, layer: int, m: MlaSpec, kv_b):
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
