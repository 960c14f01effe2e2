"""Start-up stays fast (issue 11, item 5): heavy modules are imported only by the code that uses them.

Timing is left to scripts/startup_time.py (a timing test would be flaky); these tests check the cause
instead: which modules a fresh interpreter has loaded after `import metrale_cli.cli`, after `--help`,
and after a decode step on the embedded model (ml_dtypes alone takes about a second to import).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
HEAVY = ("numpy", "ml_dtypes", "safetensors", "tokenizers", "jinja2", "torch", "cupy")

PROBE = """
import json, sys
{body}
print(json.dumps(sorted(m for m in {heavy!r} if m in sys.modules)))
"""

RUN_MAIN = """
from metrale_cli.cli import main
try:
    main({argv!r})
except SystemExit as e:
    assert e.code == 0, e.code
"""


def loaded_after(body: str) -> list[str]:
    """The HEAVY modules loaded once `body` has run in a fresh interpreter (stdout of body discarded)."""
    code = PROBE.format(body=f"import contextlib, io\nwith contextlib.redirect_stdout(io.StringIO()):\n"
                             + "".join(f"    {line}\n" for line in body.strip().splitlines()),
                        heavy=HEAVY)
    r = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120,
                       env={**os.environ, "METRALE_DISABLE_CUDA": "1"})
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout.strip().splitlines()[-1])


def test_importing_the_cli_loads_no_heavy_module():
    assert loaded_after("import metrale_cli.cli") == []


def test_help_loads_no_heavy_module():
    assert loaded_after(RUN_MAIN.format(argv=["--help"])) == []
    assert loaded_after(RUN_MAIN.format(argv=["decode", "--help"])) == []


def test_a_cpu_decode_needs_numpy_and_tokenizers_only():
    """bf16 weights and logits are handled as uint16 bit patterns on the CPU: no ml_dtypes."""
    loaded = loaded_after(RUN_MAIN.format(argv=["decode", "--steps", "2", "--format", "plain"]))
    assert loaded == ["numpy", "tokenizers"]


def test_inspect_loads_no_heavy_module():
    assert loaded_after(RUN_MAIN.format(argv=["inspect", "--format", "json"])) == []
