"""The gated delta rule (Gated DeltaNet's token mixer) and its causal conv, plain fp32 NumPy: the reference
the linear_attention kind's NumPy module runs and the tests compare with transformers' torch versions.

Per value head, with a state S [k_dim, v_dim], l2-normalised q and k (q also scaled by k_dim ** -0.5), a
decay g <= 0 and a write strength beta in (0, 1), each token t does

    S   = exp(g_t) S
    S  += k_t (beta_t (v_t - S^T k_t))^T        (the delta rule: write only what S does not predict)
    o_t = S^T q_t

`recurrent` runs exactly that, one token at a time (decode, verify); `chunked` computes the same outputs
and final state chunk by chunk (prefill), as transformers' torch_chunk_gated_delta_rule does: within a
chunk the writes are condensed by the UT transform (a unit lower-triangular solve) into a few matmuls,
and the state is carried across chunks. The two agree to fp32 rounding (tests/test_gated_delta.py).
"""

from __future__ import annotations

import numpy as np

from .ops import silu


def l2norm(x: np.ndarray, eps: float = 1e-6) -> np.ndarray:
    """x / sqrt(sum(x^2) + eps) over the last axis (transformers' l2norm, as the FLA kernels compute it)."""
    return x / np.sqrt(np.sum(x * x, axis=-1, keepdims=True) + np.float32(eps))


def prepare(q: np.ndarray, k: np.ndarray, rep: int) -> tuple[np.ndarray, np.ndarray]:
    """q, k [T, k_heads, dk] -> l2-normalised, repeated to the value heads (head h reads key head h // rep),
    q scaled by dk ** -0.5: [T, v_heads, dk] each."""
    q, k = l2norm(q), l2norm(k)
    q = q * np.float32(q.shape[-1] ** -0.5)
    if rep > 1:
        q, k = np.repeat(q, rep, axis=1), np.repeat(k, rep, axis=1)
    return q, k


def recurrent(q: np.ndarray, k: np.ndarray, v: np.ndarray, g: np.ndarray, beta: np.ndarray, state: np.ndarray,
              keep: list | None = None) -> tuple[np.ndarray, np.ndarray]:
    """The rule one token at a time. q, k [T, H, dk] (prepared), v [T, H, dv], g, beta [T, H], state
    [H, dk, dv] (not modified). Returns o [T, H, dv] and the final state; with `keep` a list, the state
    after every token is appended to it (a copy each)."""
    s = np.array(state, np.float32)
    out = np.empty(v.shape, np.float32)
    for t in range(q.shape[0]):
        s *= np.exp(g[t])[:, None, None]
        mem = (k[t][:, None, :] @ s)[:, 0]  # [H, dv] = S^T k
        delta = (v[t] - mem) * beta[t][:, None]
        s += k[t][:, :, None] * delta[:, None, :]
        out[t] = (q[t][:, None, :] @ s)[:, 0]
        if keep is not None:
            keep.append(s.copy())
    return out, s


def chunked(q: np.ndarray, k: np.ndarray, v: np.ndarray, g: np.ndarray, beta: np.ndarray, state: np.ndarray,
            chunk: int = 64) -> tuple[np.ndarray, np.ndarray]:
    """The rule by chunks of `chunk` tokens (same arguments and results as `recurrent`)."""
    t, h, dk = q.shape
    dv = v.shape[-1]
    pad = (-t) % chunk
    n = (t + pad) // chunk

    def heads_chunks(x: np.ndarray) -> np.ndarray:  # [T, H, ...] -> [H, N, C, ...], zero-padded at the end
        x = np.moveaxis(x, 0, 1)
        x = np.concatenate([x, np.zeros((h, pad) + x.shape[2:], np.float32)], axis=1)
        return x.reshape((h, n, chunk) + x.shape[2:])

    q, k, v, g, beta = (heads_chunks(np.asarray(x, np.float32)) for x in (q, k, v, g, beta))
    k_beta, v_beta = k * beta[..., None], v * beta[..., None]
    cum = np.cumsum(g, axis=-1)  # [H, N, C]: log of the decay from the chunk's start to each position
    upper = np.triu(np.ones((chunk, chunk), bool), 1)
    # decay[i, j] = exp(cum_i - cum_j) for j <= i (0 above the diagonal)
    decay = np.exp(np.where(upper, -np.inf, cum[..., :, None] - cum[..., None, :]))
    lower = np.tril((k_beta @ np.swapaxes(k, -1, -2)) * decay, -1)
    intra = (q @ np.swapaxes(k, -1, -2)) * decay
    # the UT transform: (I + lower)^-1 applied to beta v and to the decayed beta k
    new_values = _unit_lower_solve(lower, v_beta)
    k_cumdecay = _unit_lower_solve(lower, k_beta * np.exp(cum)[..., None])
    q_decayed = q * np.exp(cum)[..., None]
    k_decayed = k * np.exp(cum[..., -1:] - cum)[..., None]
    chunk_decay = np.exp(cum[..., -1])  # [H, N]
    s = np.array(state, np.float32)
    out = np.empty((h, n, chunk, dv), np.float32)
    for i in range(n):
        v_new = new_values[:, i] - k_cumdecay[:, i] @ s
        out[:, i] = q_decayed[:, i] @ s + intra[:, i] @ v_new
        s = s * chunk_decay[:, i, None, None] + np.swapaxes(k_decayed[:, i], -1, -2) @ v_new
    return np.moveaxis(out.reshape(h, n * chunk, dv)[:, :t], 0, 1), s


def _unit_lower_solve(lower: np.ndarray, b: np.ndarray) -> np.ndarray:
    """x with (I + lower) x = b, by forward substitution over the chunk's rows (lower strictly lower
    triangular [..., C, C], b [..., C, d])."""
    x = np.array(b, np.float32)
    for i in range(1, lower.shape[-1]):
        x[..., i, :] -= (lower[..., i:i + 1, :i] @ x[..., :i, :])[..., 0, :]
    return x


def causal_conv(x: np.ndarray, weight: np.ndarray, state: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The depthwise causal conv with SiLU: x [T, C] after the K - 1 earlier inputs `state` [C, K - 1]
    (oldest first; zeros before the first token), weight [C, K]. Returns silu(conv) [T, C] and the new state."""
    kernel = weight.shape[-1]
    full = np.concatenate([state.T, x], axis=0)  # [K - 1 + T, C]
    t = x.shape[0]
    out = full[0:t] * weight[:, 0]
    for j in range(1, kernel):
        out = out + full[j:j + t] * weight[:, j]
    return silu(out), np.ascontiguousarray(full[t:].T) if kernel > 1 else state


def gated_rms_norm(x: np.ndarray, z: np.ndarray, weight: np.ndarray, eps: float) -> np.ndarray:
    """RMSNormGated over the last axis: weight * x / sqrt(mean(x^2) + eps) * silu(z)."""
    var = np.mean(np.square(x), axis=-1, keepdims=True)
    return weight * (x / np.sqrt(var + np.float32(eps))) * silu(z)
