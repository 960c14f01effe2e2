"""The real process: `python -m metrale_cli`, and Ctrl-C (SIGINT) in the middle of a long decode."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
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


def test_sigint_during_decode_exits_130_and_leaves_no_file(tmp_path, helpers):
    model = helpers.random_llama(tmp_path / "model")  # 32k positions: far more steps than the test waits for
    out = tmp_path / "out"
    out.mkdir()
    cmd = [sys.executable, "-m", "metrale_cli", "decode", "--model", str(model), "--tokens", "1 2 3",
           "--steps", "20000", "--ignore-eos", "--device", "cpu", "--format", "plain",
           "--dump-logits", str(out / "out.safetensors")]
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
        stdout, stderr = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 130, stderr
    assert stderr.splitlines() == ["metrale: interrupted: stopped by Ctrl-C (no partial output file is left)"]
    assert "Traceback" not in stderr
    assert list(out.iterdir()) == []  # neither the dump nor a temp file
    assert stdout.count("\n") < 20000  # it really was interrupted
