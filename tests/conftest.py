"""Shared fixtures for the CLI tests: an in-process runner and tiny model directories built in tmp.

The CLI tests run with the repository root as the working directory and pass fixture models by their
relative path (tests/fixtures/models/llama), so the "model" every report prints is the same on every
machine and the snapshots stay stable. Test modules reach the helpers below through the `helpers`
fixture (not `import conftest`: tests/gpu has a conftest of its own, and the two would clash).
"""

from __future__ import annotations

import json
import shutil
from collections import Counter
from pathlib import Path
from types import SimpleNamespace
from typing import Callable

import numpy as np
import pytest

REPO = Path(__file__).resolve().parent.parent
FIXTURE_MODELS = REPO / "tests" / "fixtures" / "models"
LLAMA = "tests/fixtures/models/llama"  # relative to REPO: 2 layers, hidden 64, vocab 300, no tokenizer
LLAMA_VOCAB = 300


@pytest.fixture
def run_cli(monkeypatch, request) -> Callable:
    """run_cli(*args, input=None, env=None, obj=None) -> typer Result (exit_code, stdout, stderr).

    Outside tests marked `gpu`, `--device auto` resolves to the CPU even on a GPU machine, so the
    snapshots (which name the device and hold CPU numbers) are the same everywhere."""
    from typer.testing import CliRunner

    from metrale_cli.cli import app

    monkeypatch.chdir(REPO)
    if request.node.get_closest_marker("gpu") is None:
        monkeypatch.setenv("METRALE_DISABLE_CUDA", "1")
    runner = CliRunner()

    def run(*args, input=None, env=None, obj=None):
        extra = {"obj": obj} if obj is not None else {}
        return runner.invoke(app, [str(a) for a in args], input=input, env=env, catch_exceptions=False, **extra)

    return run


def copy_model(dest: Path, name: str = "llama", config: dict | None = None, drop: tuple[str, ...] = ()) -> Path:
    """A copy of fixture model `name` at dest, with config.json keys overridden (None deletes a key)."""
    shutil.copytree(FIXTURE_MODELS / name, dest)
    if config or drop:
        path = dest / "config.json"
        raw = json.loads(path.read_text())
        for key, value in (config or {}).items():
            if value is None:
                raw.pop(key, None)
            else:
                raw[key] = value
        for key in drop:
            raw.pop(key, None)
        path.write_text(json.dumps(raw, indent=2))
    return dest


def edit_tensors(model_dir: Path, edit: Callable[[dict[str, np.ndarray]], None]) -> None:
    """Rewrite model.safetensors after `edit` changed the name -> array dict in place."""
    from safetensors.numpy import load_file, save_file

    path = model_dir / "model.safetensors"
    tensors = load_file(str(path))
    edit(tensors)
    save_file(tensors, str(path))


def byte_level_tokenizer(vocab_size: int = LLAMA_VOCAB):
    """A deterministic byte-level BPE tokenizer with exactly `vocab_size` tokens: the 256 byte symbols
    plus merges spelling a few words (built, not trained, so it is the same with every tokenizers version)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    vocab = {ch: i for i, ch in enumerate(alphabet)}
    merges: list[tuple[str, str]] = []
    words = ["The", "\u0120for", "\u0120statement", "\u0120import", "\u0120class", "\u0120while", "\u010a",
             "\u0120return", "\u0120def", "\u0120if", "\u0120in", "\u0120the", "\u0120is"]
    for word in words:
        for end in range(2, len(word) + 1):
            piece, last = word[:end - 1], word[end - 1]
            if piece + last not in vocab and len(vocab) < vocab_size:
                merges.append((piece, last))
                vocab[piece + last] = len(vocab)
    pairs = iter((a, b) for a in "etaoinsrh" for b in "etaoinsrh")
    while len(vocab) < vocab_size:
        a, b = next(pairs)
        if a + b not in vocab:
            merges.append((a, b))
            vocab[a + b] = len(vocab)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    return tok


@pytest.fixture(scope="session")
def tok_model(tmp_path_factory) -> Path:
    """The llama fixture with a 300-token byte-level tokenizer.json beside it."""
    d = copy_model(tmp_path_factory.mktemp("tok") / "llama_tok")
    byte_level_tokenizer().save(str(d / "tokenizer.json"))
    return d


def random_llama(dest: Path, *, hidden: int = 128, layers: int = 2, heads: int = 4, kv_heads: int = 2,
                 intermediate: int = 256, vocab: int = 2048, max_positions: int = 32768, seed: int = 0) -> Path:
    """A random fp32 Llama checkpoint (no tokenizer)."""
    raw = {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "hidden_size": hidden,
           "num_hidden_layers": layers, "num_attention_heads": heads, "num_key_value_heads": kv_heads,
           "intermediate_size": intermediate, "vocab_size": vocab, "max_position_embeddings": max_positions,
           "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "tie_word_embeddings": False, "dtype": "float32"}
    return random_checkpoint(dest, raw, seed)


def random_checkpoint(dest: Path, raw: dict, seed: int = 0) -> Path:
    """A random fp32 checkpoint of any family's config.json `raw` (no tokenizer): vectors near 1, matrices
    scaled by 1/sqrt(fan-in)."""
    from safetensors.numpy import save_file

    from metrale_cli.config import parse_config
    from metrale_cli.models.weights import expected_tensors

    rng = np.random.default_rng(seed)
    tensors = {}
    for name, shape in expected_tensors(parse_config(raw).definition).items():
        scale = 1.0 if len(shape) == 1 else shape[-1] ** -0.5
        base = 1.0 if len(shape) == 1 else 0.0
        tensors[name] = (base + scale * rng.standard_normal(shape)).astype(np.float32)
    dest.mkdir(parents=True)
    (dest / "config.json").write_text(json.dumps(raw, indent=2))
    save_file(tensors, str(dest / "model.safetensors"))
    return dest


@pytest.fixture
def helpers() -> SimpleNamespace:
    return SimpleNamespace(copy_model=copy_model, edit_tensors=edit_tensors, random_llama=random_llama,
                           random_checkpoint=random_checkpoint,
                           byte_level_tokenizer=byte_level_tokenizer, REPO=REPO, LLAMA=LLAMA)


def pytest_terminal_summary(terminalreporter) -> None:
    """The skipped tests, in place of -r's "s" (pyproject's addopts leaves it out): one line per reason
    for the GPU tests (without CuPy or a GPU ~750 of them skip for one reason), one per test elsewhere.
    They stay in the totals line as skipped."""
    skipped = terminalreporter.stats.get("skipped", [])
    if not skipped:
        return
    gpu: Counter[str] = Counter()
    others: Counter[str] = Counter()
    for rep in skipped:
        if isinstance(rep.longrepr, tuple):
            path, line, reason = rep.longrepr
            if Path(path).is_absolute() and Path(path).is_relative_to(terminalreporter.config.rootpath):
                path = Path(path).relative_to(terminalreporter.config.rootpath)  # as pytest's -rs shows it
            where = f"{path}:{line if line is not None else ''}"
        else:
            where, reason = rep.nodeid, str(rep.longrepr)
        reason = reason.removeprefix("Skipped: ")
        if rep.nodeid.startswith("tests/gpu/"):
            gpu[reason] += 1
        else:
            others[f"{where}: {reason}"] += 1
    terminalreporter.write_sep("=", "skipped")
    for reason, n in gpu.most_common():
        terminalreporter.write_line(f"SKIPPED [{n}] tests/gpu (GPU tests): {reason}")
    for text, n in others.items():
        terminalreporter.write_line(f"SKIPPED [{n}] {text}")
