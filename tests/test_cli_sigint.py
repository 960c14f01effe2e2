"""The real process: `python -m metrale_cli`, and Ctrl-C (SIGINT) in the middle of a long decode."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest


REPO = Path(__file__).resolve().parent.parent

pytestmark = pytest.mark.skipif(sys.platform == "win32", reason="POSIX signals")


def _env() -> dict:
    env = dict(os.environ, PYTHONPATH=str(REPO), PYTHONUNBUFFERED="1", METRALE_DISABLE_CUDA="1")
    env.pop("METRALE_DEBUG", None)
    return env


def test_python_dash_m_runs_the_cli():
    r = subprocess.run([sys.executable, "-m", "metrale_cli", "--help"], cwd=REPO, env=_env(),
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0 and "Exit codes" in r.stdout


@pytest.mark.parametrize("draft", [[], ["--draft", "ngram", "--k", "3"]], ids=["plain", "speculative"])
def test_sigint_during_decode_reports_the_tokens_so_far_exits_130_and_leaves_no_file(tmp_path, helpers, draft):
    model = helpers.random_llama(tmp_path / "model")  # 32k positions: far more steps than the test waits for
    out = tmp_path / "out"
    out.mkdir()
    cmd = [sys.executable, "-m", "metrale_cli", "decode", "--model", str(model), "--tokens", "1 2 3",
           "--steps", "20000", "--ignore-eos", "--device", "cpu", "--format", "plain",
           "--dump-logits", str(out / "out.safetensors"), "--dump-hidden", str(out / "hidden.npy"), *draft]
    proc = subprocess.Popen(cmd, cwd=REPO, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        # Plain decode prints a line per step: wait until steps are being produced, then interrupt.
        deadline = time.monotonic() + 60
        steps_seen = 0
        while steps_seen < 20:
            line = proc.stdout.readline()
            assert line, f"decode ended early: {proc.stderr.read()}"
            assert time.monotonic() < deadline
            if line.strip() and line.split()[0].isdigit():
                steps_seen += 1
        proc.send_signal(signal.SIGINT)
        # Read the rest through the same text wrapper: readline() may have buffered lines ahead, which
        # communicate() (reading the raw pipes) would miss. stderr is one line: it cannot fill its pipe.
        watchdog = threading.Timer(60, proc.kill)
        watchdog.start()
        try:
            rest, stderr = proc.stdout.read(), proc.stderr.read()
            proc.wait()
        finally:
            watchdog.cancel()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 130, stderr
    steps = steps_seen + sum(1 for line in rest.splitlines() if line.strip() and line.split()[0].isdigit())
    assert 20 <= steps < 20000  # it really was interrupted, and every step is in the report
    assert f"\nstopped: interrupted after {steps} tokens\n" in rest
    assert stderr.splitlines() == [f"metrale: interrupted: stopped by Ctrl-C after {steps} tokens "
                                   "(no dump file is written)"]
    assert "Traceback" not in stderr
    assert list(out.iterdir()) == []  # neither a dump nor a temp file
