"""Every malformed safetensors file and broken checkpoint of the loader corpus, through the CLI.

Each case: the documented exit code (3), one line on stderr that names the culprit and the problem, no
traceback, and no dump file left behind.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
from test_checkpoint import FAILURES
from test_safetensors_file import MALFORMED

CONFIG = Path(__file__).parent / "fixtures" / "models" / "llama" / "config.json"
# Where the CLI words a case itself (before the loader sees it), its wording.
CLI_WORDING = {"path-missing": "no such file or directory"}


def assert_clean_failure(result, code: int, needle: str, culprit: str, dump: Path) -> None:
    assert result.exit_code == code, result.stderr
    err = result.stderr
    assert err.count("\n") == 1 and err.startswith("metrale: checkpoint error: ")
    assert needle in err and culprit in err
    assert "Traceback" not in err + result.stdout
    assert not dump.exists()
    assert not [p for p in dump.parent.iterdir() if p.name.startswith(".") or p.name.endswith(".tmp")]


@pytest.mark.parametrize("case", list(MALFORMED), ids=list(MALFORMED))
def test_malformed_safetensors_through_the_cli(run_cli, tmp_path, case):
    content, needle, _ = MALFORMED[case]
    model = tmp_path / "model"
    model.mkdir()
    shutil.copy(CONFIG, model / "config.json")
    (model / "model.safetensors").write_bytes(content)
    out = tmp_path / "out" / "rows.npy"
    out.parent.mkdir()
    r = run_cli("forward", "--model", model, "--tokens", "1 2", "--dump-logits", out)
    assert_clean_failure(r, 3, needle, "model.safetensors", out)


@pytest.mark.parametrize("case", list(FAILURES), ids=list(FAILURES))
def test_broken_checkpoint_through_the_cli(run_cli, tmp_path, case):
    build, needle, culprit = FAILURES[case]
    needle = CLI_WORDING.get(case, needle)
    path = build(tmp_path)
    directory = path if path.is_dir() else path.parent
    if directory.exists():  # a valid config, so the case is about the weights alone
        shutil.copy(CONFIG, directory / "config.json")
    out = tmp_path / "out" / "rows.safetensors"
    out.parent.mkdir()
    r = run_cli("decode", "--model", path, "--tokens", "1 2", "--steps", "2", "--dump-logits", out)
    assert_clean_failure(r, 3, needle, culprit, out)
