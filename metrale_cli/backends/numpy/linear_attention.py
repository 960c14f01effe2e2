"""The "linear_attention" mixer kind on the NumPy engine (engine/linear_attention.py): Gated DeltaNet in fp32,
the reference, over the kind's state (a conv state and a recurrent state per layer) with its rollback.

Which rule runs: a pass of one token (decode) and every verify pass run the recurrent rule (exact, one
token at a time; verify keeps the state after each row); a prefill of more tokens runs the chunked rule
(`LinearState.rule`, "chunked" as transformers; a test sets "recurrent" to compare the two on a model).

Rollback: a recurrent state cannot be cut back, so the state keeps copies. Every pass saves the state it
starts from, and a verify pass also saves the state after each of its rows; the copies of the last
`ROLLBACK` positions are kept (and all of the last verify pass's). `trim` to a kept position restores its
copy; `trim` to any other position (but the current one, or 0) is refused with an InputError naming the
kept ones. Each kept position costs `nbytes` (the conv and recurrent states of every linear layer): a
verify of k rows keeps k + 1 copies, a run of decode steps at most ROLLBACK.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from ...errors import InputError, UsageError
from . import gated_delta
from .ops import sigmoid

if TYPE_CHECKING:
    from ...models.spec import LinearAttentionSpec, ModelDefinition

States = dict[int, tuple[np.ndarray, np.ndarray]]  # layer -> (conv state, recurrent state)
ROLLBACK = 16  # positions back a trim can reach after decode steps (verify's own rows are always kept)


class LinearState:
    """The conv state [conv_dim, kernel - 1] and recurrent state [v_heads, k_head_dim, v_head_dim] of every
    linear-attention layer of one sequence, at `position` (the engine's length), and the saved copies."""

    def __init__(self, definition: ModelDefinition, layers: list[int]) -> None:
        self.specs: dict[int, LinearAttentionSpec] = {i: definition.layers[i].mixer for i in layers}
        self.conv = {i: np.zeros((s.conv_dim, s.conv_kernel - 1), np.float32) for i, s in self.specs.items()}
        self.recurrent = {i: np.zeros((s.num_v_heads, s.k_head_dim, s.v_head_dim), np.float32)
                          for i, s in self.specs.items()}
        self.position = 0
        self.saved: dict[int, States] = {}  # position -> the states there (this pass's start, verify rows)
        self.rule = "chunked"  # the rule of a multi-token prefill: "chunked" | "recurrent"

    @property
    def nbytes(self) -> int:
        """The state of one sequence (every linear layer's conv and recurrent states)."""
        return sum(c.nbytes + r.nbytes for c, r in zip(self.conv.values(), self.recurrent.values()))

    @property
    def saved_nbytes(self) -> int:
        return sum(c.nbytes + r.nbytes for states in self.saved.values() for c, r in states.values())

    def begin(self, start: int, rows: int, keep_rows: bool) -> None:
        """A pass of `rows` tokens from position `start`: save the states it starts from."""
        if start != self.position:  # a pass that stopped part-way (Ctrl-C), or a cache recomputed from 0
            if start == 0:
                self.reset()
            elif self._kept(start):
                self._restore(start)
            else:
                raise InputError(f"the linear-attention state is at position {self.position}, not {start}")
        oldest = start + rows - max(ROLLBACK, rows + 1 if keep_rows else 0)
        self.saved = {p: st for p, st in self.saved.items() if oldest <= p < start}
        self.saved[start] = self._copy()
        self.position = start + rows
        self.keep_rows = keep_rows
        if keep_rows:
            for j in range(1, rows + 1):
                self.saved[start + j] = {}

    def trim(self, length: int) -> None:
        if length == self.position:
            pass
        elif length == 0:
            self.reset()
            return
        elif self._kept(length):
            self._restore(length)
        else:
            kept = ", ".join(str(p) for p in sorted(self.saved)) or "none"
            raise InputError(
                f"cannot trim the linear-attention state to position {length}: a recurrent state cannot be cut "
                f"back, and copies are kept only at the last {ROLLBACK} positions and each row of the last verify "
                f"(positions {kept})")
        self.saved = {p: s for p, s in self.saved.items() if p <= length}

    def reset(self) -> None:
        for i in self.specs:
            self.conv[i][:] = 0
            self.recurrent[i][:] = 0
        self.position = 0
        self.saved = {}

    def tensors(self) -> dict[str, np.ndarray]:
        """The states by name (--dump-state): model.layers.{i}.linear_attn.conv_state / .recurrent_state."""
        out = {}
        for i in self.specs:
            out[f"model.layers.{i}.linear_attn.conv_state"] = self.conv[i]
            out[f"model.layers.{i}.linear_attn.recurrent_state"] = self.recurrent[i]
        return out

    def _kept(self, position: int) -> bool:
        return len(self.saved.get(position, {})) == len(self.specs)

    def _restore(self, position: int) -> None:
        for i, (c, r) in self.saved[position].items():
            self.conv[i], self.recurrent[i] = c.copy(), r.copy()
        self.position = position

    def _copy(self) -> States:
        return {i: (self.conv[i].copy(), self.recurrent[i].copy()) for i in self.specs}


# fp32 compute only: where a bf16 forward of transformers rounds inside Gated DeltaNet is not matched yet, so
# load_numpy_engine refuses --compute bf16 before reading any weight
COMPUTE = ("fp32",)


def state(engine, layers: list[int]) -> LinearState:
    """The state of `engine`'s linear-attention layers (engine/mixers.py)."""
    if getattr(engine, "compute", "fp32") not in COMPUTE:
        raise UsageError("--compute bf16 is not implemented for linear-attention layers yet (use --compute fp32)")
    return LinearState(engine.cfg.definition, layers)


def split(proj: np.ndarray, s: LinearAttentionSpec):
    """The fused projection [T, in_size] -> q, k [T, k_heads, dk], v, z [T, v_heads, dv], b, a [T, v_heads]."""
    t, hk, hv, dk, dv = proj.shape[0], s.num_k_heads, s.num_v_heads, s.k_head_dim, s.v_head_dim
    rep = hv // hk
    qkvz, ba = proj[:, :2 * s.k_dim + 2 * s.v_dim], proj[:, 2 * s.k_dim + 2 * s.v_dim:]
    if s.grouped:  # qwen3_next: per key head [q_h, k_h, its rep value heads' v, their z]; then [b.., a..]
        g = qkvz.reshape(t, hk, 2 * dk + 2 * rep * dv)
        q, k = g[..., :dk], g[..., dk:2 * dk]
        v = g[..., 2 * dk:2 * dk + rep * dv].reshape(t, hv, dv)
        z = g[..., 2 * dk + rep * dv:].reshape(t, hv, dv)
        gba = ba.reshape(t, hk, 2 * rep)
        b, a = gba[..., :rep].reshape(t, hv), gba[..., rep:].reshape(t, hv)
    else:  # qwen3_5: q | k | v | z | b | a
        kd, vd = s.k_dim, s.v_dim
        q, k = qkvz[:, :kd].reshape(t, hk, dk), qkvz[:, kd:2 * kd].reshape(t, hk, dk)
        v, z = qkvz[:, 2 * kd:2 * kd + vd].reshape(t, hv, dv), qkvz[:, 2 * kd + vd:].reshape(t, hv, dv)
        b, a = ba[:, :hv], ba[:, hv:]
    return q, k, v, z, b, a


def softplus(x: np.ndarray) -> np.ndarray:
    """torch's softplus (beta 1, threshold 20): log(1 + exp(x)), x itself above 20."""
    return np.where(x > 20, x, np.log1p(np.exp(np.minimum(x, np.float32(20))))).astype(np.float32)


class LinearAttentionOps:
    """engine/linear_attention.py's ops for one NumPy pass (`p`: a NumpyPass) over the state `state`."""

    def __init__(self, p, state: LinearState) -> None:
        self.p, self.state = p, state
        state.begin(p.start, p.t, keep_rows=getattr(p, "verify", False))

    def mix(self, proj, layer: int, s: LinearAttentionSpec, lw):
        t, st = self.p.t, self.state
        q, k, v, z, b, a = split(proj, s)
        mixed = np.concatenate([q.reshape(t, -1), k.reshape(t, -1), v.reshape(t, -1)], axis=1)  # [T, conv_dim]
        before = st.conv[layer]
        conv, st.conv[layer] = gated_delta.causal_conv(mixed, lw["conv"].reshape(s.conv_dim, s.conv_kernel), before)
        kd = s.k_dim
        q = conv[:, :kd].reshape(t, s.num_k_heads, s.k_head_dim)
        k = conv[:, kd:2 * kd].reshape(t, s.num_k_heads, s.k_head_dim)
        v = conv[:, 2 * kd:].reshape(t, s.num_v_heads, s.v_head_dim)
        beta = sigmoid(b)
        g = -np.exp(lw["A_log"]) * softplus(a + lw["dt_bias"])  # [T, v_heads], fp32
        q, k = gated_delta.prepare(q, k, s.num_v_heads // s.num_k_heads)
        if st.keep_rows or t == 1 or st.rule == "recurrent":
            rows: list | None = [] if st.keep_rows else None
            o, st.recurrent[layer] = gated_delta.recurrent(q, k, v, g, beta, st.recurrent[layer], rows)
            if rows is not None:  # the states after each verify row, for trim
                full = np.concatenate([before.T, mixed], axis=0)
                for j, rec in enumerate(rows, start=1):
                    st.saved[self.p.start + j][layer] = (np.ascontiguousarray(full[j:j + s.conv_kernel - 1].T), rec)
        else:
            o, st.recurrent[layer] = gated_delta.chunked(q, k, v, g, beta, st.recurrent[layer], s.chunk_size)
        y = gated_delta.gated_rms_norm(o, z, lw["lin_norm"], s.eps)  # [T, v_heads, dv]
        return y.reshape(t, s.v_dim)


def ops(p, state: LinearState) -> LinearAttentionOps:
    return LinearAttentionOps(p, state)
