"""The split argmax (argmax_split_*_kernel: several blocks per row, the last block of each row reduces)
against np.argmax and the one-block-per-row kernel it replaces for few rows, on fresh random data.

Vocabularies of 128256 (llama-3) and 262144 (gemma-3); row counts from 1 to just under the SM count (the
split kernel's range); planted ties of the row maximum in different blocks (including a block that takes
two chunks, so the earlier index can sit in the higher-numbered block), inside one block, and at +0 / -0;
NaN, +Inf and -Inf rows (-1); an all-equal row (0).  The workspace's counters must be back at zero after
every launch, and a captured graph must give fresh answers when the rows change under it.
"""

from __future__ import annotations

import numpy as np
import pytest

from gpu_helpers import bits_f32, torch_bf16_bits

pytestmark = pytest.mark.gpu


def planted_rows(rng, n, V, chunk, nb):
    """n rows of V fresh standard normals with ties and non-finite values planted; and which rows are bad."""
    x = rng.standard_normal((n, V), dtype=np.float32)
    bad = np.zeros(n, bool)
    for r in range(n):
        kind = r % 7
        top = np.float32(x[r].max() + 1.0)
        if kind == 0:  # tie between blocks: a later chunk of block 0 (chunk nb) and block nb - 1's first chunk
            a, b = (nb - 1) * chunk + int(rng.integers(chunk)), nb * chunk + int(rng.integers(chunk))
            if b >= V:  # every block takes one chunk: a tie between block 1 and the last block instead
                a, b = chunk + int(rng.integers(chunk)), (nb - 1) * chunk + int(rng.integers(V - (nb - 1) * chunk))
            x[r, a] = x[r, b] = top
        elif kind == 1:  # tie inside one chunk (two threads of one block), plus a lower value later
            c = int(rng.integers(V // chunk)) * chunk
            x[r, c + 300] = x[r, c + 7] = top
            x[r, V - 1] = top - 1
        elif kind == 2:  # +0 and -0 are equal maxima: the earlier (-0 here) wins
            x[r] = -np.abs(x[r]) - 1.0
            i, j = sorted(rng.choice(V, 2, replace=False))
            x[r, i], x[r, j] = np.float32(-0.0), np.float32(0.0)
        elif kind == 3:
            x[r, int(rng.integers(V))] = np.nan
            bad[r] = True
        elif kind == 4:
            x[r, V - 1] = np.inf
            bad[r] = True
        elif kind == 5:
            x[r, 0] = -np.inf
            bad[r] = True
        else:
            x[r, :] = np.float32(0.25) if r % 2 else x[r]  # all equal -> 0, or untouched random
    return x, bad


def reference(xv, bad):
    return np.where(bad, -1, np.argmax(np.where(np.isfinite(xv), xv, -np.inf), axis=1)).astype(np.int32)


@pytest.mark.parametrize("V", [128256, 262144])
@pytest.mark.parametrize("n", [1, 3, 16, 100])
@pytest.mark.parametrize("dtype", ["f32", "bf16"])
def test_split_argmax_matches_numpy_and_the_one_block_kernel(cp, kernels, rng, seed, V, n, dtype):
    from metrale_cli.backends.cuda.kernels.tuning import ARGMAX_CHUNK

    nb = kernels.argmax_blocks(n, V)
    assert nb >= 2, f"{n} rows of {V}: expected the split kernel"
    x, bad = planted_rows(rng, n, V, ARGMAX_CHUNK, nb)
    if dtype == "bf16":
        bits = torch_bf16_bits(x)  # bf16 rounding also makes many natural ties
        xv, rows = bits_f32(bits), cp.asarray(bits)
    else:
        xv, rows = x, cp.asarray(x)
    ref = reference(xv, bad)
    ws = cp.zeros((kernels.argmax_workspace_size(n, nb),), cp.int32)
    out = cp.full((n,), -777, dtype=cp.int32)
    kernels.argmax(rows, out, workspace=ws)
    got = cp.asnumpy(out)
    np.testing.assert_array_equal(got, ref, err_msg=f"seed={seed}")
    assert not cp.asnumpy(ws[:n]).any(), f"seed={seed}: counters left non-zero"
    kernels.argmax(rows, out)  # the internal workspace
    np.testing.assert_array_equal(cp.asnumpy(out), ref, err_msg=f"seed={seed}: internal workspace")
    old = cp.full((n,), -777, dtype=cp.int32)
    kernels._fn[f"argmax_{dtype}_kernel"]((n,), (1024,), (rows, old, np.int32(V)))
    np.testing.assert_array_equal(got, cp.asnumpy(old), err_msg=f"seed={seed}: vs the one-block kernel")


def test_split_argmax_graph_replay_reads_fresh_rows(cp, kernels, rng, seed):
    n, V = 2, 128256
    nb = kernels.argmax_blocks(n, V)
    ws = cp.zeros((kernels.argmax_workspace_size(n, nb),), cp.int32)
    rows = cp.zeros((n, V), cp.uint16)
    out = cp.zeros((n,), cp.int32)
    s = cp.cuda.Stream(non_blocking=True)
    kernels.argmax(rows, out, workspace=ws, stream=s)  # eager first
    s.synchronize()
    s.begin_capture()
    kernels.argmax(rows, out, workspace=ws, stream=s)
    g = s.end_capture()
    for _ in range(5):
        x = rng.standard_normal((n, V), dtype=np.float32)
        bits = torch_bf16_bits(x)
        rows.set(bits, stream=s)
        g.launch(stream=s)
        s.synchronize()
        np.testing.assert_array_equal(cp.asnumpy(out), np.argmax(bits_f32(bits), axis=1).astype(np.int32),
                                      err_msg=f"seed={seed}")
    assert not cp.asnumpy(ws[:n]).any()

def test_row_counts_in_turn_do_not_share_counters(cp, kernels, rng, seed):
    """Decode (1 row), verify (k + 1 rows), decode again: each row count has its own workspace, since n's
    counters (the first n elements) are where a smaller count's partials went (the first H200 run of the
    split argmax left rows 1..5 unwritten after a 1-row call, through the shared internal workspace)."""
    V = 128256
    for n in (1, 6, 1, 3, 16, 6):
        x = rng.standard_normal((n, V), dtype=np.float32)
        out = cp.full((n,), -777, dtype=cp.int32)
        kernels.argmax(cp.asarray(x), out)
        np.testing.assert_array_equal(cp.asnumpy(out), np.argmax(x, axis=1).astype(np.int32),
                                      err_msg=f"seed={seed}: {n} rows")


def test_engine_decode_then_verify_argmax(cp, rng, seed, tmp_path, helpers):
    """The engine's argmax of the decode row (inside the decode graph, 1 row) and of verify rows (k + 1
    rows, after it) equal the host argmax of the same rows, in turn over several steps."""
    from metrale_cli.model import open_model

    V = 40000  # the split kernel (more than two chunks)
    model = helpers.random_llama(tmp_path / "m", vocab=V)
    e = open_model(model, device="cuda", max_context=256, fp32_logits=True).engine

    def host(ptr, n):
        rows = []
        for i in range(n):
            buf = bytearray(e.row_nbytes(ptr.row_ptr(i)))
            e.copy_logits_to_host(ptr.row_ptr(i), buf)
            rows.append(np.frombuffer(buf, np.float32))
        return [int(j) for j in np.argmax(np.stack(rows), axis=1)]

    length = e.prefill([int(t) for t in rng.integers(0, V, 7)])
    for step in range(3):
        e.decode(int(rng.integers(0, V)))
        length += 1
        ptr = e.decode_logits_ptr()
        assert [e.argmax_on_device(ptr)] == host(ptr, 1), f"seed={seed}: decode step {step}"
        drafts = [int(t) for t in rng.integers(0, V, 5)]
        e.verify(drafts)
        vptr = e.logits_buffer_ptr()
        assert e.argmax_batch(vptr, len(drafts)) == host(vptr, len(drafts)), f"seed={seed}: verify step {step}"
        e.trim(length)
