#!/usr/bin/env python3
"""How long metrale takes to start, next to the time of `import numpy`, measured side by side.

Each command runs --runs times (default 10) as a fresh process, the commands taking turns so that a
busy machine slows them all alike; the medians are reported, with the ratio to `import numpy`.
`import metrale_cli.cli` is also timed inside the process with `python -X importtime` (the cumulative
microseconds of the metrale_cli.cli line: the import alone, without the interpreter's start-up).
Bytecode is cached as an installed package has it (pip compiles at install time): the children run with
PYTHONPYCACHEPREFIX set to a temp directory, filled by a warm-up run, whatever PYTHONDONTWRITEBYTECODE says.

Goals (issue 11, item 5): the in-process import of metrale_cli.cli <= 150 ms; `metrale --help` and
`metrale decode --steps 1` (embedded model) each <= 2.5 x the `import numpy` process.

    python scripts/startup_time.py            # from the repository root
    python scripts/startup_time.py --runs 20
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
PY = sys.executable
COMMANDS: dict[str, list[str]] = {
    "python -c 'import numpy'": [PY, "-c", "import numpy"],
    "python -c 'import metrale_cli.cli'": [PY, "-c", "import metrale_cli.cli"],
    "metrale --help": [PY, "-m", "metrale_cli", "--help"],
    "metrale decode --steps 1": [PY, "-m", "metrale_cli", "decode", "--steps", "1", "--format", "plain"],
}
GOALS = {"metrale --help": 2.5, "metrale decode --steps 1": 2.5}  # x the numpy import
IMPORT_GOAL_MS = 150.0


ENV = {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}


def wall(cmd: list[str]) -> float:
    t0 = time.perf_counter()
    r = subprocess.run(cmd, cwd=REPO, env=ENV, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    elapsed = time.perf_counter() - t0
    if r.returncode != 0:
        sys.exit(f"{' '.join(cmd)} failed ({r.returncode}): {r.stderr.decode()[-500:]}")
    return elapsed


def import_time_ms(module: str) -> float:
    """Cumulative import time of `module` as -X importtime reports it."""
    r = subprocess.run([PY, "-X", "importtime", "-c", f"import {module}"], cwd=REPO, env=ENV,
                       capture_output=True, text=True, check=True)
    for line in r.stderr.splitlines():
        fields = [f.strip() for f in line.removeprefix("import time:").split("|")]
        if len(fields) == 3 and fields[2] == module:
            return int(fields[1]) / 1000
    sys.exit(f"-X importtime printed no line for {module}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--runs", type=int, default=10)
    args = ap.parse_args()
    os.chdir(REPO)
    ENV["PYTHONPYCACHEPREFIX"] = tempfile.mkdtemp(prefix="metrale-pycache-")
    for cmd in COMMANDS.values():  # warm the page cache and the bytecode caches
        wall(cmd)
    times: dict[str, list[float]] = {name: [] for name in COMMANDS}
    imports: list[float] = []
    for _ in range(args.runs):
        for name, cmd in COMMANDS.items():
            times[name].append(wall(cmd))
        imports.append(import_time_ms("metrale_cli.cli"))
    med = {name: 1000 * statistics.median(ts) for name, ts in times.items()}
    base = med["python -c 'import numpy'"]
    print(f"{sys.version.split()[0]} on {os.cpu_count()} CPUs, medians of {args.runs} runs (ms)")
    for name, ms in med.items():
        goal = GOALS.get(name)
        verdict = f"  goal <= {goal} x: {'met' if ms <= goal * base else 'MISSED'}" if goal else ""
        print(f"  {name:<36} {ms:8.1f}  {ms / base:5.2f} x numpy{verdict}")
    imp = statistics.median(imports)
    print(f"  {'import metrale_cli.cli (-X importtime)':<36} {imp:8.1f}  goal <= {IMPORT_GOAL_MS:g} ms: "
          f"{'met' if imp <= IMPORT_GOAL_MS else 'MISSED'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
