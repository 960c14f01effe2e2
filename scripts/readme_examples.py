"""Regenerate the example outputs in README.md from what the commands print now.

Each README block between `<!-- example: NAME -->` and the closing fence of the ```text block after it is
the output of EXAMPLES[NAME]: every command run in a fresh temporary directory on the CPU (`$ command`,
then its stdout and stderr; `# exit N` after a command that exits N != 0). An example may abridge a long
report to the lines it names (the others become one `...` line per run of them).

    PYTHONPATH=. python scripts/readme_examples.py          # rewrite README.md
    PYTHONPATH=. python scripts/readme_examples.py --check  # exit 1 when README.md differs

tests/test_readme_examples.py checks that README.md holds exactly what this script writes.
Needs torch and transformers for the `reference` and `vllm` examples (pip install 'metrale[reference]').
"""

from __future__ import annotations

import argparse
import os
import re
import shlex
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
BLOCK = re.compile(r"(<!-- example: (?P<name>[\w-]+) -->\n```text\n)(?P<body>.*?)(```)", re.S)


@dataclass
class Command:
    line: str  # as the README shows it: `metrale ...` or `python scripts/...`
    keep: Callable[[str], bool] | None = None  # abridge: the output lines kept (None: all)


def _reference_line(line: str) -> bool:
    key = line.split(":", 1)[0]
    return key in {"reference", "metrale", "model", "prompt_tokens", "steps", "reference_tokens", "metrale_tokens",
                   "tokens_identical", "rel_err", "kl_max", "top1_agreement", "reference_check"} or \
        line.startswith(("no divergence", "first divergence", "metrale compare --reference", "kind:"))


def _engine_line(line: str) -> bool:
    return line.split(":", 1)[0] in {"a", "b", "kind", "positions", "check"} or line.startswith(
        ("first divergence", "metrale: outputs differ", "model.layers.1.mlp ", "position ", "vllm_run:")) or \
        re.match(r"\s+\d+\s+\d\.\d+e[-+]\d+", line) is not None


def _llamacpp_line(line: str) -> bool:
    return line.split(":", 1)[0] in {"kind", "check", "top1_agreement", "rel_err", "kl_max", "only_in_a"} or \
        line.startswith(("statistics comparison", "first divergence", "no divergence", "alignment"))


EXAMPLES: dict[str, list[Command]] = {
    "diverges": [
        Command('metrale forward --prompt "The for statement" --dump-layers a.safetensors --format plain'),
        Command("python scripts/perturb_layer_dump.py a.safetensors b.safetensors model.layers.2.mlp"),
        Command("metrale compare a.safetensors b.safetensors --rtol 1e-3 --format plain"),
    ],
    "vllm": [
        Command('metrale forward --prompt "The for statement" --rows all --dump-layers a.safetensors --taps fine '
                "--format plain", keep=lambda line: line.startswith("prompt_tokens")),
        Command('python scripts/engine_dumps.py vllm vllm_run --tokens "0 341 343 455" --tp 2 '
                "--perturb model.layers.1.mlp@2"),
        Command("metrale compare a.safetensors vllm_run --rtol 1e-4 --format plain", keep=_engine_line),
    ],
    "llamacpp": [
        Command('metrale forward --prompt "The for statement" --rows all --dump-layers a.safetensors '
                "--dump-logits a.npy --format plain", keep=lambda line: line.startswith("prompt_tokens")),
        Command("metrale compare a.safetensors tests/fixtures/llamacpp/eval-callback.txt --rtol 1e-3 --format plain",
                keep=_llamacpp_line),
        Command("metrale compare a.npy tests/fixtures/llamacpp/debug --max-kl 1e-6 --format plain", keep=_llamacpp_line),
    ],
    "reference": [
        Command('metrale compare --reference transformers --prompt "The for statement" --steps 4 --layers 0,-1 '
                "--format plain", keep=_reference_line),
    ],
}


def run(cmd: Command, cwd: Path) -> str:
    """`$ line`, then what it printed (stdout, then stderr), abridged as the command says."""
    argv = [str(ROOT / a) if a.startswith("tests/fixtures/") else a for a in shlex.split(cmd.line)]
    if argv[0] == "metrale":
        argv = [sys.executable, "-m", "metrale_cli", *argv[1:]]
    elif argv[0] == "python":
        argv = [sys.executable, str(ROOT / argv[1]), *argv[2:]]
    env = dict(os.environ, PYTHONPATH=str(ROOT), METRALE_DISABLE_CUDA="1", COLUMNS="100", NO_COLOR="1")
    out = subprocess.run(argv, cwd=cwd, env=env, capture_output=True, text=True, timeout=600)
    lines = (out.stdout + out.stderr).splitlines()
    if cmd.keep is not None:
        lines = _abridge(lines, cmd.keep)
    head = f"$ {cmd.line}" + (f"   # exit {out.returncode}" if out.returncode else "")
    return "\n".join([head, *lines]) + "\n"


def _abridge(lines: list[str], keep: Callable[[str], bool]) -> list[str]:
    out: list[str] = []
    for line in lines:
        if keep(line):
            out.append(line)
        elif not out or out[-1] != "...":
            out.append("...")
    return out


def example(name: str) -> str:
    with tempfile.TemporaryDirectory() as tmp:
        return "".join(run(c, Path(tmp)) for c in EXAMPLES[name])


def render(readme: str, names: list[str] | None = None) -> str:
    """README text with the named examples' blocks (default: all) regenerated."""
    def block(m: re.Match) -> str:
        name = m.group("name")
        if name not in EXAMPLES:
            raise SystemExit(f"README.md names example {name!r}, which {Path(__file__).name} does not have")
        if names is not None and name not in names:
            return m.group(0)
        return m.group(1) + example(name) + m.group(4)

    return BLOCK.sub(block, readme)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--check", action="store_true", help="exit 1 if README.md differs from what is printed now")
    args = ap.parse_args()
    text = README.read_text("utf-8")
    new = render(text)
    if args.check:
        sys.exit(0 if new == text else 1)
    if new != text:
        README.write_text(new, "utf-8")
        print(f"{README.name}: examples regenerated")


if __name__ == "__main__":
    main()
