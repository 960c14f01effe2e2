"""Reading an engine's logits rows back, and verify against sequential decoding: shared by the CPU plumbing tests
(the CUDA engine over stand-in kernels) and the GPU tests (tests/gpu/gpu_helpers.py hands these on)."""

from __future__ import annotations

import numpy as np


def rows(e, ptr, n):
    """The first n logits rows behind a ModelLogits pointer, through the engine's own copy-out, as float32."""
    out = []
    for i in range(n):
        buf = bytearray(e.row_nbytes(ptr.row_ptr(i)))
        e.copy_logits_to_host(ptr.row_ptr(i), buf)
        out.append(np.frombuffer(buf, np.float32))
    return np.stack(out)


def rel(a, b) -> float:
    """||a - b|| / ||b|| in float64 (engine-level comparisons of logits rows)."""
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


def decoded_and_verified(engine, prompt, drafts) -> tuple[np.ndarray, np.ndarray]:
    """(each draft's decode-step logits, one after another; the verify pass's rows over the same drafts), both after a
    fresh prefill of `prompt`: verify must equal sequential decoding."""
    engine.reset()
    engine.prefill(prompt)
    seq = []
    for t in drafts:
        engine.decode(t)
        seq.append(rows(engine, engine.decode_logits_ptr(), 1)[0])
    engine.reset()
    engine.prefill(prompt)
    engine.verify(drafts)
    return np.stack(seq), rows(engine, engine.logits_buffer_ptr(), len(drafts))
