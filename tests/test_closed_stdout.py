"""A closed stdout (`metrale decode ... | head -1`): every command stops with the one documented exit code
(141, errors.StdoutClosed), nothing on stderr, and no partial file left behind."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from metrale_cli.errors import EXIT_CODES, StdoutClosed

REPO = Path(__file__).resolve().parent.parent
LLAMA = "tests/fixtures/models/llama"


def run_closed(*args: str, cwd: Path = REPO) -> subprocess.CompletedProcess:
    """`python -m metrale_cli ARGS` with stdout a pipe whose reader has already gone."""
    read, write = os.pipe()
    os.close(read)
    env = {**os.environ, "PYTHONPATH": str(REPO), "METRALE_DISABLE_CUDA": "1"}
    env.pop("METRALE_DEBUG", None)
    try:
        return subprocess.run([sys.executable, "-m", "metrale_cli", *args], stdout=write, stderr=subprocess.PIPE,
                              cwd=cwd, env=env, timeout=120)
    finally:
        os.close(write)


@pytest.fixture(scope="module")
def dumps(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("dumps")
    for name in ("a", "b"):
        r = subprocess.run([sys.executable, "-m", "metrale_cli", "forward", "-m", LLAMA, "-t", "1 2 3", "--rows",
                            "all", "--dump-logits", str(d / f"{name}.npy")], cwd=REPO, capture_output=True,
                           env={**os.environ, "PYTHONPATH": str(REPO), "METRALE_DISABLE_CUDA": "1"})
        assert r.returncode == 0, r.stderr
    return d


COMMANDS = {
    "decode": ["decode", "-m", LLAMA, "-t", "1 2 3", "--steps", "8"],
    "decode-json": ["decode", "-m", LLAMA, "-t", "1 2 3", "--steps", "8", "--format", "json"],
    "decode-speculative": ["decode", "-m", LLAMA, "-t", "1 2 3", "--draft", "ngram"],
    "forward": ["forward", "-m", LLAMA, "-t", "1 2 3", "--rows", "all"],
    "verify": ["verify", "-m", LLAMA, "-t", "1 2 3"],
    "score": ["score", "-m", LLAMA, "-t", "1 2 3 4"],
    "inspect": ["inspect", LLAMA],
    "help": ["decode", "--help"],
    "version": ["--version"],
}


@pytest.mark.parametrize("name", list(COMMANDS) + ["compare", "logits-to-stdout"])
def test_closed_stdout_exits_141_quietly(name, dumps):
    args = COMMANDS.get(name) or {
        "compare": ["compare", str(dumps / "a.npy"), str(dumps / "b.npy")],
        "logits-to-stdout": ["forward", "-m", LLAMA, "-t", "1 2 3", "--dump-logits", "-"],
    }[name]
    for _ in range(2):  # the same every time
        r = run_closed(*args)
        assert (r.returncode, r.stderr.decode()) == (StdoutClosed.exit_code, "")
    assert StdoutClosed.exit_code == 141 and "stdout closed" in EXIT_CODES[141]


def test_a_closed_stdout_leaves_no_dump(tmp_path):
    """decode prints as it goes: stdout closing stops it before the dumps, which are never half written."""
    r = run_closed("decode", "-m", str(REPO / LLAMA), "-t", "1 2 3", "--steps", "8", "--dump-logits", "rows.npy",
                   "--dump-hidden", "hidden.safetensors", cwd=tmp_path)
    assert (r.returncode, r.stderr.decode()) == (141, "")
    assert list(tmp_path.iterdir()) == []
