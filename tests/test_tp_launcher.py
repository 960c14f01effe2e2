"""`--tp N` on the CPU: the launcher, the command protocol and the rank engines that the GPUs run, with
NumPy engines as the ranks and a shared-memory all-reduce (parallel/comm.HostCommunicator).

The same TensorParallelEngine, RankServer, worker loop and watchdog as on the GPUs: one rank equals the
plain engine bit for bit (an identity all-reduce), N ranks equal it within fp32 rounding and give the
same tokens; the CLI, its errors and its help; a killed worker is noticed; workers leave with rank 0.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import numpy as np
import pytest

from metrale_cli.errors import DeviceError, InputError, UsageError
from metrale_cli.model import open_model
from metrale_cli.parallel import launcher
from metrale_cli.parallel.comm import assemble_rows, pick_argmax

FAMILIES = ["llama", "llama_tied", "qwen2", "qwen3", "gemma2", "gemma3_text", "phi3", "mistral_window",
            "qwen3_moe", "qwen2_moe", "mixtral", "glm4_moe"]


def _rows(e, ptr) -> np.ndarray:
    out = []
    for i in range(ptr.rows):
        buf = bytearray(e.row_nbytes(ptr))
        e.copy_logits_to_host(ptr.row_ptr(i), buf)
        out.append(np.frombuffer(bytes(buf), np.float32 if e.logits_ptr_is_fp32(ptr) else np.uint16))
    return np.stack(out)


def _script(e) -> list:
    """What a run reads: prefill rows, 8 greedy decode steps, verify k=4 after a trim, their argmaxes and
    hidden rows."""
    got = []
    e.prefill([3, 17, 42, 7, 9], all_logits=True)
    p = e.logits_buffer_ptr()
    got += [_rows(e, p), e.argmax_batch(p, p.rows), e.copy_hidden_rows_to_host()]
    token = got[1][-1]
    for _ in range(8):
        e.decode(token)
        token = e.argmax_on_device(e.decode_logits_ptr())
        got += [token, _rows(e, e.decode_logits_ptr())]
    e.trim(7)
    e.verify([5, 6, 8, 10])
    p = e.logits_buffer_ptr()
    got += [_rows(e, p), e.argmax_batch(p, 4), e.copy_hidden_rows_to_host(), e.length]
    return got


def _models(helpers, name, n, fp32=True):
    path = helpers.REPO / "tests/fixtures/models" / name
    return (open_model(path, device="cpu", max_context=32, fp32_logits=fp32),
            open_model(path, device="cpu", max_context=32, fp32_logits=fp32, tp=n))


@pytest.mark.parametrize("name", FAMILIES)
def test_one_rank_equals_the_plain_engine_bit_for_bit(helpers, name):
    plain, tp = _models(helpers, name, 1)
    try:
        for want, got in zip(_script(plain.engine), _script(tp.engine)):
            np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    finally:
        plain.close()
        tp.close()


@pytest.mark.parametrize("name", ["llama", "qwen2", "gemma2", "mistral_window", "qwen3_moe", "qwen2_moe",
                                  "mixtral", "glm4_moe"])
def test_two_ranks_give_the_same_tokens_and_close_logits(helpers, name):
    plain, tp = _models(helpers, name, 2)
    try:
        for want, got in zip(_script(plain.engine), _script(tp.engine)):
            want, got = np.asarray(want), np.asarray(got)
            if want.dtype.kind == "f":
                np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4 * np.abs(want).max())
            else:  # token ids and argmaxes: the same
                np.testing.assert_array_equal(got, want)
    finally:
        plain.close()
        tp.close()


def test_bf16_rows_gathered_across_uneven_vocab_ranges(tmp_path, helpers):
    """A vocabulary of 301 over 4 ranks (76, 76, 76, 73 rows) and more ranks than KV heads."""
    path = helpers.random_llama(tmp_path / "wide", hidden=128, heads=8, kv_heads=2, intermediate=96, vocab=301)
    plain = open_model(path, device="cpu", max_context=32, fp32_logits=False)
    tp = open_model(path, device="cpu", max_context=32, tp=4, fp32_logits=False)
    try:
        want, got = _script(plain.engine), _script(tp.engine)
        assert got[1] == want[1]  # prefill argmaxes
        assert [got[i] for i in range(3, 19, 2)] == [want[i] for i in range(3, 19, 2)]  # greedy tokens
        assert np.mean(got[0] == want[0]) > 0.95  # bf16 rows: at most a rounding step apart
    finally:
        plain.close()
        tp.close()


def test_observed_passes_run_on_every_rank(helpers):
    """A tap observer on rank 0 (--dump-layers) makes every rank run the observed pass, in step."""
    from metrale_cli.engine.observe import tapping

    plain, tp = _models(helpers, "llama", 2)
    seen = {}
    try:
        for key, m in (("plain", plain), ("tp", tp)):
            taps = seen[key] = {}
            with tapping(m.engine, lambda name, x, taps=taps: taps.setdefault(name, np.array(x))):
                m.engine.prefill([1, 2, 3])
                m.engine.decode(4)
        assert seen["tp"].keys() == seen["plain"].keys()
        for name, want in seen["plain"].items():
            np.testing.assert_allclose(seen["tp"][name], want, rtol=1e-4, atol=1e-5, err_msg=name)
        assert tp.engine.argmax_on_device(tp.engine.decode_logits_ptr()) == \
            plain.engine.argmax_on_device(plain.engine.decode_logits_ptr())
    finally:
        plain.close()
        tp.close()


def test_input_errors_are_raised_on_rank_0_before_any_rank_is_told(helpers):
    _, tp = _models(helpers, "llama", 2)
    try:
        e = tp.engine
        with pytest.raises(InputError):
            e.prefill([999999])
        with pytest.raises(InputError):
            e.trim(3)
        e.prefill([1, 2])
        e.decode(3)  # the group is still in step
        assert e.argmax_on_device(e.decode_logits_ptr()) >= 0
    finally:
        tp.close()


def test_a_killed_worker_is_noticed(helpers):
    _, tp = _models(helpers, "llama", 2)
    try:
        e = tp.engine
        e.prefill([1, 2])
        proc = e.workers.procs[0]
        proc.kill()
        proc.join(5)
        t0 = time.monotonic()
        with pytest.raises(DeviceError, match="rank 1"):
            for _ in range(50):  # the next command (or the collective it reaches) fails
                e.decode(3)
                e.argmax_on_device(e.decode_logits_ptr())
        assert time.monotonic() - t0 < launcher.GRACE_S
    finally:
        tp.close()


def test_workers_exit_with_rank_0(helpers):
    """close() ends the workers; and a rank 0 that dies without closing takes them along."""
    _, tp = _models(helpers, "llama", 2)
    procs = list(tp.engine.workers.procs)
    tp.close()
    assert not any(p.is_alive() for p in procs)
    code = ("import os, sys\n"
            "from metrale_cli.model import open_model\n"
            "if __name__ == '__main__':\n"
            f"    m = open_model({str(helpers.REPO / helpers.LLAMA)!r}, device='cpu', max_context=16, tp=4)\n"
            "    print(' '.join(str(p.pid) for p in m.engine.workers.procs), flush=True)\n"
            "    os._exit(0)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                         env={**os.environ, "PYTHONPATH": str(helpers.REPO)}, cwd=helpers.REPO)
    pids = [int(p) for p in out.stdout.split()]
    assert len(pids) == 3, out.stderr
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and any(_alive(p) for p in pids):
        time.sleep(0.1)
    assert not any(_alive(p) for p in pids)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with open(f"/proc/{pid}/stat") as f:  # a zombie (exited, not yet reaped by init) counts as gone
        return f.read().split()[2] != "Z"


# -- the CLI ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("command", [["forward", "--rows", "all"], ["decode", "--steps", "6", "--top-k", "3"],
                                     ["verify", "--k", "3"]])
def test_cli_tp_2_reports_what_the_plain_engine_reports(run_cli, helpers, command):
    # bf16 rows: the ranks sum in another order, which moves fp32 logits in their last bits
    args = [*command, "-m", helpers.LLAMA, "--tokens", "5 6 7 8", "--device", "cpu", "--format", "json",
            "--logits-dtype", "bf16"]
    plain, tp = run_cli(*args), run_cli(*args, "--tp", "2")
    assert plain.exit_code == 0 and tp.exit_code == 0, tp.stderr
    a, b = json.loads(plain.stdout), json.loads(tp.stdout)
    a.pop("timings", None), b.pop("timings", None)
    assert a == b


def test_cli_tp_1_dumps_the_plain_logits_bit_for_bit(run_cli, helpers, tmp_path):
    for tp, out in ((None, "plain.npy"), ("1", "tp.npy")):
        args = ["decode", "-m", helpers.LLAMA, "--tokens", "1 2 3", "--steps", "4", "--device", "cpu",
                "--dump-logits", tmp_path / out] + (["--tp", tp] if tp else [])
        assert run_cli(*args).exit_code == 0
    np.testing.assert_array_equal(np.load(tmp_path / "tp.npy"), np.load(tmp_path / "plain.npy"))


@pytest.mark.parametrize("args,code,culprit", [
    (["--tp", "3"], 2, "--tp 3 does not divide num_attention_heads 4"),
    (["--tp", "0"], 2, "--tp must be at least 1"),
    (["--tp", "3", "-m", "tests/fixtures/models/qwen2_moe"], 2, "--tp 3 does not divide num_attention_heads 4"),
])
def test_cli_tp_usage_errors(run_cli, helpers, args, code, culprit):
    base = ["decode", "-m", helpers.LLAMA, "--tokens", "1 2", "--device", "cpu"]
    r = run_cli(*base, *args)
    assert r.exit_code == code
    assert culprit in r.stderr and len(r.stderr.strip().splitlines()) == 1


def test_cli_tp_more_than_the_visible_gpus_is_a_device_error(run_cli, helpers, monkeypatch):
    from metrale_cli.cli import job

    monkeypatch.setattr(job, "resolve_device", lambda d: "cuda")
    monkeypatch.setattr(launcher, "gpu_status", lambda: (1, None))
    r = run_cli("forward", "-m", helpers.LLAMA, "--tokens", "1 2", "--device", "cuda", "--tp", "2")
    assert r.exit_code == 8 and "--tp 2 needs 2 CUDA devices, 1 visible" in r.stderr
    monkeypatch.setattr(launcher, "gpu_status", lambda: (0, "--tp with --device cuda needs NCCL, which CuPy "
                                                            "does not find"))
    r = run_cli("forward", "-m", helpers.LLAMA, "--tokens", "1 2", "--device", "cuda", "--tp", "1")
    assert r.exit_code == 8 and "needs NCCL" in r.stderr


@pytest.mark.parametrize("name", ["qwen2_moe", "mixtral"])
def test_cli_tp_2_splits_the_experts_with_the_tokens_of_tp_1(run_cli, helpers, name):
    args = ["decode", "-m", f"tests/fixtures/models/{name}", "--tokens", "5 6 7 8", "--steps", "6",
            "--device", "cpu", "--format", "json"]
    one, two = run_cli(*args, "--tp", "1"), run_cli(*args, "--tp", "2")
    assert one.exit_code == 0 and two.exit_code == 0, two.stderr
    tokens = [[step["token"] for step in json.loads(r.stdout)["steps"]] for r in (one, two)]
    assert tokens[0] == tokens[1] and len(tokens[0]) == 6


def test_check_devices_no_longer_refuses_experts_on_cuda(monkeypatch):
    """The CUDA ranks split mixture-of-experts layers (each rank's experts, its partial sum all-reduced:
    tests/gpu/test_tp_threads.py): only the GPU count and NCCL are checked before any process starts."""
    monkeypatch.setattr(launcher, "gpu_status", lambda: (8, None))
    launcher.check_devices("cuda", 2)  # no error, whatever the model
    monkeypatch.setattr(launcher, "gpu_status", lambda: (1, None))
    with pytest.raises(DeviceError, match="needs 2 CUDA devices, 1 visible"):
        launcher.check_devices("cuda", 2)


@pytest.mark.parametrize("command", ["decode", "verify", "forward", "bench"])
def test_help_documents_tp(run_cli, command):
    r = run_cli(command, "--help")
    assert "--tp" in r.stdout and "NCCL" in r.stdout


def test_bench_tp_runs_on_the_cpu(run_cli):
    r = run_cli("bench", "--device", "cpu", "--preset", "tiny-llama", "--context", "32", "--prefill", "32",
                "--repeats", "2", "--ks", "1", "--tp", "2", "--format", "json")
    assert r.exit_code == 0, r.stderr
    notes = json.loads(r.stdout)["notes"]
    assert any("--tp 2" in n for n in notes)


# -- the pieces ---------------------------------------------------------------------------------------------


def test_distributed_argmax_is_the_argmax_of_the_whole_row():
    rng = np.random.default_rng(0)
    rows = rng.integers(-3, 3, (6, 301)).astype(np.float32)  # many ties, across range boundaries too
    rows[4, 200] = np.nan
    for size in (1, 2, 4, 8):
        per = -(-301 // size)
        pairs = np.zeros((size, 6, 2), np.float32)
        for r in range(size):
            part = rows[:, r * per:(r + 1) * per]
            idx = np.argmax(part, axis=1)
            pairs[r, :, 0] = part[np.arange(6), idx]
            pairs[r, :, 1] = idx + r * per
            pairs[r, ~np.isfinite(part).all(axis=1), 1] = -1
        want = np.argmax(rows, axis=1)
        want[4] = -1
        np.testing.assert_array_equal(pick_argmax(pairs), want)


def test_assemble_rows_drops_the_padding():
    gathered = np.arange(3 * 2 * 4).reshape(3, 2, 4)  # vocab 10 over 3 ranks: 4, 4, 2 rows
    got = assemble_rows(gathered, 10)
    assert got.shape == (2, 10)
    np.testing.assert_array_equal(got[0], [0, 1, 2, 3, 8, 9, 10, 11, 16, 17])


def test_unknown_command_is_refused():
    from metrale_cli.parallel.protocol import RankServer

    with pytest.raises(ValueError, match="unknown"):
        RankServer(object(), None).run("launch_missiles", ())


def test_usage_error_class_survives_the_pipe():
    err = launcher._error(("error", UsageError.exit_code, "bad"), 3, None)
    assert isinstance(err, UsageError) and str(err) == "rank 3: bad"
