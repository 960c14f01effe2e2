"""README.md's example outputs are what the commands print today: scripts/readme_examples.py runs each
example's commands (embedded default model, CPU) and the README block must hold exactly that output.

Two things are left out of the equality: transformers' version (the reference example names the one
installed), and, in that example, the vLLM-style one and the llama.cpp one, figures below 1e-4 (metrale against transformers in fp32 differ by
~1e-6, in the last bits of each BLAS's summation order, which differs between machines). Regenerate with
`PYTHONPATH=. python scripts/readme_examples.py`."""

from __future__ import annotations

import importlib.util
import re
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
README = (REPO / "README.md").read_text("utf-8")


def _script():
    spec = importlib.util.spec_from_file_location("readme_examples", REPO / "scripts" / "readme_examples.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


examples = _script()
BLOCKS = {m.group("name"): m.group("body") for m in examples.BLOCK.finditer(README)}
_VERSION = re.compile(r"transformers \d+\.\d+\S*")
_TINY = re.compile(r"\d\.\d+e-(0[5-9]|[1-9]\d)")


def _normal(text: str, mask_tiny: bool) -> str:
    text = _VERSION.sub("transformers VERSION", text)
    return _TINY.sub("TINY", text) if mask_tiny else text


def test_every_example_is_in_the_readme():
    assert set(BLOCKS) == set(examples.EXAMPLES), "README.md and scripts/readme_examples.py name other examples"


@pytest.mark.parametrize("name", sorted(examples.EXAMPLES))
def test_readme_holds_what_the_commands_print(name):
    if name in ("reference", "vllm"):
        pytest.importorskip("torch")
        pytest.importorskip("transformers")
    now = examples.example(name)
    mask = name in ("reference", "vllm", "llamacpp")  # transformers against metrale: figures below 1e-4 vary by machine
    assert _normal(BLOCKS[name], mask) == _normal(now, mask), (
        f"README.md's {name!r} example is stale: run PYTHONPATH=. python scripts/readme_examples.py")


def test_examples_need_no_unshipped_script_unsaid():
    """A README example running a script of scripts/ (not installed by pip) says it runs from a checkout."""
    for name, commands in examples.EXAMPLES.items():
        for c in commands:
            if c.line.startswith("python scripts/"):
                script = c.line.split()[1]
                assert f"`{script}` runs from a source checkout" in " ".join(README.split()), (name, script)


def test_readme_says_where_layers_equal_hidden_states():
    """model.layers.{i} is hidden_states[i + 1] only below the last layer (tests/test_layer_capture_reference.py
    checks both halves of the sentence on every family)."""
    text = " ".join(README.split())
    assert "`model.layers.{i}` equals transformers' `hidden_states[i + 1]` for i < L - 1" in text
    assert "transformers' last entry is after the final norm" in text
