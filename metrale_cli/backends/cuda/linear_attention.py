"""The "linear_attention" mixer kind (engine/linear_attention.py: Gated DeltaNet) on the CUDA engine: its state,
the conv and recurrent states of the engine's linear-attention layers in rings of slots on the device, and its ops
for each pass type, the launches of kernels/gated_delta.cu (fp32 throughout, the NumPy reference's order).

State. Each layer keeps a ring of `RING` = MAX_ROWS + 1 slots of its conv state [conv_dim, kernel - 1] and its
recurrent state [v_heads, k_head_dim, v_head_dim] (fp32); slot p % RING holds the state at position p. A pass
reads the slot of its first position and writes the slot of each next one, so:
- a decode step reads the state once and writes it once (into the next slot: no copy);
- verify (and a prompt of <= MAX_ROWS tokens, on the rows path) writes the state after every row, so accepting
  n of k rows, or a trim to any of the last RING - 1 positions, is a change of the engine's length and nothing
  else (`trim` checks on the host which positions the slots hold; another position is refused by name);
- a longer prefill writes only its last row's state.
A pass never writes the slot it reads (at most MAX_ROWS < RING rows), so running it twice gives the same slots:
graphs.RowsGraphs runs a pass eagerly before capturing it, then launches the capture. The cost is RING copies of
the state per layer (`nbytes`; `sequence_nbytes` is one sequence's state): for
qwen3-next-80b (36 linear layers, 32 value heads of 128 x 128) 2.1 MiB a layer, 1.3 GiB in all.

Ops, the same four launches on every pass type (conv + SiLU, gates, the recurrent rule, the gated norm):
- `RowsLinear` (RowsPass and FusedRowsPass: decode, verify, short prompts; graph-capturable: no host reads, no
  allocations, the positions read on the device) writes into the state's preallocated row buffers;
- `PrefillLinear` (PrefillPass: long prompts, eager) runs the conv and the q / k l2 norms parallel over the
  prompt's tokens, then the rule. From CHUNKED_MIN_ROWS tokens on, by chunks of 64 (`recurrent_chunked`: the form
  of the NumPy engine's chunked rule, backends/numpy/gated_delta.chunked): gdn_chunk_prep solves each chunk's
  unit lower-triangular system, one block per (chunk, value head), all in parallel, into a work area allocated per
  layer (4 (dk + dv + 65) bytes per token and value head); then gdn_chunk_state carries each (value head, 32 state
  columns) slice of the state through the chunks in order, each chunk a few 64-row fp32 products in shared
  memory instead of 64 dependent steps. Its numbers are the rule's to fp32 rounding, not the rows path's bit for
  bit (tests/gpu/test_gated_delta_cuda.py prints the differences). A shorter prefill runs the sequential kernel
  (`recurrent(prenormed=True)`: each thread reads its q and k itself, the next token's while it computes the
  current one), exact and equal to the rows path's numbers, its cost linear in the tokens: on an H100, 115 ms of
  qwen3.5-27b's 302 ms prefill of 2048 tokens (48 linear layers) before the chunked rule.
  benchmarks/bench_gated_delta.py times the two on that model's layer shape (docs/CUDA_ENGINE.md 4b: the figures).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from ...errors import DeviceError, InputError
from .buffers import MAX_ROWS
from .kernels.gated_delta import KEY_HEAD_DIMS, MAX_KERNEL, GatedDeltaKernels, chunk_work_shapes, column_maps

# The weights of a linear-attention sublayer the CUDA kernels compute with (engine/linear_attention.py's keys).
WEIGHT_KEYS = frozenset({"input_norm", "lin_in", "conv", "dt_bias", "A_log", "lin_norm", "lin_out", "attn_out_norm"})
RING = MAX_ROWS + 1  # slots per layer: a pass of MAX_ROWS rows keeps the state it started from
CHUNKED_MIN_ROWS = 64  # a prefill of at least this many tokens runs the chunked rule, a shorter one the sequential


def unsupported(spec: Any) -> list[str]:
    """What the kernels do not take in a layer of this spec (loading.unsupported_features names it)."""
    found = [f"linear-attention key head dim {spec.k_head_dim}"] if spec.k_head_dim not in KEY_HEAD_DIMS else []
    return found + ([f"linear-attention conv kernel {spec.conv_kernel}"] if spec.conv_kernel > MAX_KERNEL else [])


class RowBuffers:
    """The rows path's activations of a linear-attention layer, [MAX_ROWS, ...] each (a captured graph writes the
    same addresses on every replay): the fused projection, the conv output, beta and g, the rule's output o, and
    the gated norm's output y."""

    def __init__(self, cp: Any, spec: Any) -> None:
        R, f = MAX_ROWS, cp.float32
        self.lin_in = cp.zeros((R, spec.in_size), f)
        self.conv = cp.zeros((R, spec.conv_dim), f)
        self.beta = cp.zeros((R, spec.num_v_heads), f)
        self.g = cp.zeros((R, spec.num_v_heads), f)
        self.o = cp.zeros((R, spec.num_v_heads, spec.v_head_dim), f)
        self.y = cp.zeros((R, spec.v_dim), f)


class LinearStates:
    """The rings of the engine's linear-attention layers (module docstring), their f32 gate parameters, the
    projection's column maps, the row buffers and the kernels. `slot_pos[s]` (host) is the position slot s holds,
    -1 when none of the current sequence."""

    def __init__(self, engine: Any, layers: list[int]) -> None:
        cp, kern, d = engine.cp, engine.kern, engine.cfg.definition
        self.cp, self.stream, self.layers = cp, engine.stream, list(layers)
        self.specs = {i: d.layers[i].mixer for i in layers}
        specs = set(self.specs.values())
        if len(specs) != 1:
            raise DeviceError("the CUDA engine takes one linear-attention layer shape per model")
        self.spec = spec = specs.pop()
        self.kernels = GatedDeltaKernels(kern)  # compiled now: never during a graph capture
        self.maps = {n: cp.asarray(m) for n, m in column_maps(spec).items()}
        f = cp.float32
        self.conv = {i: cp.zeros((RING, spec.conv_dim, spec.conv_kernel - 1), f) for i in layers}
        self.recurrent = {i: cp.zeros((RING, spec.num_v_heads, spec.k_head_dim, spec.v_head_dim), f) for i in layers}
        # the gates' parameters in f32 (every weight is bf16 on the device; the gates kernel reads f32)
        self.a_log, self.dt_bias = {}, {}
        for i in layers:
            for name, out in (("A_log", self.a_log), ("dt_bias", self.dt_bias)):
                out[i] = cp.empty((spec.num_v_heads,), f)
                kern.bf16_to_f32(engine.w.layers[i][name], out[i])
        self.rows = RowBuffers(cp, spec)
        self.slot_pos = np.full(RING, -1, np.int64)
        self.slot_pos[0] = 0
        self.position = 0

    @property
    def sequence_nbytes(self) -> int:
        """One sequence's state: every linear layer's conv and recurrent state (what `inspect` reports)."""
        return sum(int(self.conv[i][0].nbytes + self.recurrent[i][0].nbytes) for i in self.layers)

    @property
    def nbytes(self) -> int:
        """What the rings hold on the device: RING states."""
        return RING * self.sequence_nbytes

    def rows_buffers(self, m: int) -> dict[str, Any]:
        """The rows path's output buffer of the layers' fused projection (RowsPass.linear(out="lin_in"))."""
        return {"lin_in": self.rows.lin_in[:m]}

    def advance(self, start: int, rows: int, every: bool) -> None:
        """Before a pass of `rows` tokens from position `start` (CudaEngine calls it on the host, so a replayed
        graph needs no Python): check that the slot of `start` holds it (a pass from 0 starts from a zeroed slot),
        then record the slots the pass writes: every row's (`every`, the rows path) or the last one's."""
        s = start % RING
        if self.slot_pos[s] != start:
            if start != 0:
                raise InputError(f"the linear-attention state holds no copy of position {start}")
            self._zero_slot(0)
        if every:
            for p in range(start + 1, start + rows + 1):
                self.slot_pos[p % RING] = p
        else:
            self.slot_pos[(start + rows) % RING] = start + rows
        self.position = start + rows

    def trim(self, length: int) -> None:
        if length == 0:
            self.reset()
            return
        if self.slot_pos[length % RING] != length:
            kept = ", ".join(str(p) for p in sorted(int(p) for p in self.slot_pos if 0 <= p <= self.position))
            raise InputError(
                f"cannot trim the linear-attention state to position {length}: a recurrent state cannot be cut back, "
                f"and the GPU keeps it only at the last {RING - 1} positions of decode and verify rows and at the "
                f"end of each prefill (positions {kept or 'none'})")
        self.slot_pos[self.slot_pos > length] = -1  # the rejected rows' states: overwritten before read again
        self.position = length

    def reset(self) -> None:
        self.slot_pos[:] = -1
        self._zero_slot(0)
        self.position = 0

    def _zero_slot(self, s: int) -> None:
        with self.stream:
            for i in self.layers:
                self.conv[i][s].fill(0)
                self.recurrent[i][s].fill(0)
        self.slot_pos[s] = 0 if s == 0 else -1

    def tensors(self) -> dict[str, np.ndarray]:
        """The states at the engine's position by name (--dump-state), copied to the host."""
        self.stream.synchronize()
        s, out = self.position % RING, {}
        for i in self.layers:
            out[f"model.layers.{i}.linear_attn.conv_state"] = np.asarray(self.conv[i][s].get())
            out[f"model.layers.{i}.linear_attn.recurrent_state"] = np.asarray(self.recurrent[i][s].get())
        return out


def state(engine: Any, layers: list[int]) -> LinearStates:
    """The states of `engine`'s linear-attention layers (engine/mixers.py)."""
    return LinearStates(engine, layers)


class _Linear:
    every = True  # the state after every row is kept (the rows path)

    def __init__(self, p: Any, st: LinearStates) -> None:
        self.p, self.st, self.s = p, st, p.s

    def _buffers(self, t: int):  # conv, beta, g, o, y for t rows
        b = self.st.rows
        return b.conv[:t], b.beta[:t], b.g[:t], b.o[:t], b.y[:t]

    def mix(self, proj, layer: int, spec, lw):
        st, k, s, maps = self.st, self.st.kernels, self.s, self.st.maps
        pos = self.p.pos
        conv, beta, g, o, y = self._buffers(proj.shape[0])
        k.conv(proj, maps["src"], lw["conv"].reshape(spec.conv_dim, spec.conv_kernel), st.conv[layer], pos, conv,
               every=self.every, stream=s)
        k.gates(proj, maps["b"], maps["a"], st.a_log[layer], st.dt_bias[layer], beta, g, stream=s)
        k.recurrent(conv, beta, g, st.recurrent[layer], pos, o, spec, every=self.every, stream=s)
        k.gated_norm(o, proj, maps["z"], lw["lin_norm"], spec.eps, y, stream=s)
        return y


class RowsLinear(_Linear):
    """The rows paths' ops (RowsPass, FusedRowsPass): m rows at positions p.pos (device), into the row buffers."""


class PrefillLinear(_Linear):
    """The prefill path's ops (PrefillPass: p.t > MAX_ROWS tokens from p.start): fresh buffers, the last row's state
    kept; the conv and the q / k norms parallel over the rows, then the rule reading the normalised q and k: by
    chunks (recurrent_chunked, its work area allocated per layer) from CHUNKED_MIN_ROWS tokens, else the
    sequential kernel (the rows path's numbers: the same operations in the same order)."""

    every = False

    def mix(self, proj, layer: int, spec, lw):
        st, k, s, maps = self.st, self.st.kernels, self.s, self.st.maps
        pos = self.p.pos
        conv, beta, g, o, y = self._buffers(proj.shape[0])
        k.conv_rows(proj, maps["src"], lw["conv"].reshape(spec.conv_dim, spec.conv_kernel), st.conv[layer], pos,
                    conv, stream=s)
        k.qk_norm(conv, spec, stream=s)
        k.gates(proj, maps["b"], maps["a"], st.a_log[layer], st.dt_bias[layer], beta, g, stream=s)
        t = proj.shape[0]
        if t >= CHUNKED_MIN_ROWS:
            k.recurrent_chunked(conv, beta, g, st.recurrent[layer], pos, o, spec, self._work(t), stream=s)
        else:
            k.recurrent(conv, beta, g, st.recurrent[layer], pos, o, spec, every=False, prenormed=True, stream=s)
        k.gated_norm(o, proj, maps["z"], lw["lin_norm"], spec.eps, y, stream=s)
        return y

    def _work(self, t: int) -> dict:
        cp, shapes = self.st.cp, chunk_work_shapes(t, self.st.spec)
        try:
            return {n: cp.empty(shape, cp.float32) for n, shape in shapes.items()}
        except cp.cuda.memory.OutOfMemoryError:
            raise self.p.e.oom(f"prefilling {t} tokens through a linear-attention layer's chunked rule",
                               sum(4 * int(np.prod(shape)) for shape in shapes.values())) from None

    def _buffers(self, t: int):
        cp, sp, f = self.st.cp, self.st.spec, self.st.cp.float32
        try:
            return (cp.empty((t, sp.conv_dim), f), cp.empty((t, sp.num_v_heads), f), cp.empty((t, sp.num_v_heads), f),
                    cp.empty((t, sp.num_v_heads, sp.v_head_dim), f), cp.empty((t, sp.v_dim), f))
        except cp.cuda.memory.OutOfMemoryError:
            raise self.p.e.oom(f"prefilling {t} tokens through a linear-attention layer",
                               t * (sp.conv_dim + sp.v_dim * 2) * 4) from None


OPS = {"rows": RowsLinear, "fused": RowsLinear, "prefill": PrefillLinear}


def ops(p: Any, st: LinearStates) -> _Linear:
    """The linear-attention ops of pass `p` (its `kind`: "rows", "fused" or "prefill") over `st`."""
    return OPS[p.kind](p, st)
