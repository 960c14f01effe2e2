"""A corpus of bad CLI inputs: each fails with its documented exit code, one line on stderr that names the
culprit, no traceback, and no output file."""

from __future__ import annotations

import errno
import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import numpy as np
import pytest


LLAMA = "tests/fixtures/models/llama"  # relative: the CLI tests run in the repository root
PASS_COMMANDS = ("decode", "verify", "forward")


@dataclass
class Case:
    id: str
    args: list  # may hold "{tmp}", "{out}", "{model}", "{tok}" placeholders
    code: int
    culprit: str  # must appear in the one-line message
    setup: Callable[[Path, Any], None] | None = None  # (tmp, helpers): builds {model} under tmp
    patch: Callable[[pytest.MonkeyPatch, Path], None] | None = None
    env: dict = field(default_factory=dict)
    input: str | None = None
    dump: bool = True  # append --dump-logits {out}/logits.safetensors to pass commands


def _config(**changes):
    def setup(tmp: Path, h) -> None:
        h.copy_model(tmp / "model", config=changes)
    return setup


def _config_text(text: str):
    def setup(tmp: Path, h) -> None:
        h.copy_model(tmp / "model")
        (tmp / "model" / "config.json").write_text(text)
    return setup


def _tensors(edit):
    def setup(tmp: Path, h) -> None:
        h.copy_model(tmp / "model")
        h.edit_tensors(tmp / "model", edit)
    return setup


def _set(name: str, value: np.ndarray):
    def edit(t):
        t[name] = value
    return edit


def _nan_in_lm_head(t):
    t["lm_head.weight"] = t["lm_head.weight"].copy()
    t["lm_head.weight"][7, 3] = np.nan


def _draft_vocab(tmp: Path, h) -> None:
    h.copy_model(tmp / "model", config={"vocab_size": 301})
    h.edit_tensors(tmp / "model", lambda t: t.update(
        {n: np.zeros((301, 64), np.float32) for n in ("model.embed_tokens.weight", "lm_head.weight")}))


def _draft_tokenizer(tmp: Path, h) -> None:
    for name in ("target", "model"):
        h.copy_model(tmp / name)
        tok = h.byte_level_tokenizer()
        if name == "model":
            tok.add_special_tokens(["<|extra|>"])  # a different tokenizer.json
        tok.save(str(tmp / name / "tokenizer.json"))


def _unwritable(mp: pytest.MonkeyPatch, tmp: Path) -> None:
    locked = tmp / "locked"
    locked.mkdir()
    os.chmod(locked, 0o500)
    if os.access(locked, os.W_OK):  # root ignores the mode: make os.access say what a user would see
        real = os.access
        mp.setattr(os, "access", lambda p, mode, **kw: False if Path(p) == locked else real(p, mode, **kw))


def _disk_full(mp: pytest.MonkeyPatch, tmp: Path) -> None:
    real = os.write

    def write(fd, data):
        if fd > 2:
            raise OSError(errno.ENOSPC, "No space left on device")
        return real(fd, data)

    mp.setattr(os, "write", write)


def _permission_denied(mp: pytest.MonkeyPatch, tmp: Path) -> None:
    import tempfile

    def mkstemp(*a, **k):
        raise PermissionError(errno.EACCES, "Permission denied")

    mp.setattr(tempfile, "mkstemp", mkstemp)


M = ["-m", LLAMA]
T = ["-t", "1 2 3"]

CASES = [
    # token ids and prompts
    Case("negative-id", ["decode", *M, "--tokens=-1 2"], 5, "-1"),
    Case("id-at-vocab", ["decode", *M, "-t", "1 300"], 5, "300"),
    Case("id-far-beyond-vocab", ["forward", *M, "-t", "5,99999999999"], 5, "99999999999"),
    # Exit 2 when the command line is wrong whatever the model (not a list of integers, a count below 1,
    # options that disagree); exit 5 when this model cannot take it (ids beyond its vocabulary, no
    # tokenizer for text, lengths beyond its context).
    Case("non-numeric-id", ["decode", *M, "-t", "1 two 3"], 2, "'two'"),
    Case("float-id", ["forward", *M, "-t", "1 2.5"], 2, "'2.5'"),
    Case("empty-tokens", ["decode", *M, "-t", ""], 2, "--tokens is empty"),
    Case("only-separators", ["verify", *M, "-t", " , ,"], 2, "--tokens is empty"),
    Case("empty-stdin", ["forward", *M, "-t", "-"], 2, "--tokens - (stdin) is empty", input=""),
    Case("non-numeric-stdin", ["forward", *M, "-t", "-"], 2, "--tokens - (stdin): 'x'", input="1 x\n"),
    Case("json-array-float", ["decode", *M, "-t", "[1, 2.5]"], 2, "item 2 of the JSON array, 2.5,"),
    Case("json-array-bool", ["decode", *M, "-t", "[1, true]"], 2, "item 2 of the JSON array, true,"),
    Case("json-array-string", ["forward", *M, "-t", "-"], 2, 'item 1 of the JSON array, "1",', input='["1"]'),
    Case("json-array-nested", ["forward", *M, "-t", "[[1, 2]]"], 2, "item 1 of the JSON array, [1, 2],"),
    Case("json-array-empty", ["verify", *M, "-t", "[]"], 2, "--tokens is empty"),
    Case("json-array-malformed", ["forward", *M, "-t", "[1, 2"], 2, "not a JSON array of token ids"),
    Case("json-array-numpy-form", ["forward", *M, "-t", "[1 2 3]"], 2, "give '[1, 2, 3]' or '1 2 3'"),
    Case("json-array-trailing", ["forward", *M, "-t", "[1, 2] 3"], 2, "not a JSON array of token ids"),
    Case("json-array-id-at-vocab", ["forward", *M, "-t", "[1, 300]"], 5, "token id 300 (item 2)"),
    Case("empty-prompt", ["decode", "-m", "{tok}", "-p", "  "], 2, "--prompt is empty"),
    Case("prompt-without-tokenizer", ["decode", *M, "-p", "hello"], 5, "tokenizer.json"),
    Case("no-prompt-no-tokenizer", ["forward", *M], 5, "--tokens"),
    # lengths and counts
    Case("steps-beyond-max-positions", ["decode", *M, *T, "--steps", "255"], 5, "max_position_embeddings 256"),
    Case("k-beyond-max-positions", ["verify", *M, *T, "--k", "254"], 5, "max_position_embeddings 256"),
    Case("max-context-too-small", ["decode", *M, *T, "--steps", "8", "--max-context", "9"], 5, "--max-context 9"),
    Case("max-context-beyond-model", ["forward", *M, *T, "--max-context", "1000"], 5, "--max-context 1000"),
    Case("steps-zero", ["decode", *M, *T, "--steps", "0"], 2, "--steps must be at least 1, got 0"),
    Case("steps-negative", ["decode", *M, *T, "--steps=-3"], 2, "--steps must be at least 1, got -3"),
    Case("top-k-zero", ["decode", *M, *T, "--top-k", "0"], 2, "--top-k must be at least 1, got 0"),
    Case("top-k-negative", ["decode", *M, *T, "--top-k=-1"], 2, "--top-k must be at least 1, got -1"),
    Case("top-k-short-option-gone", ["decode", *M, *T, "-k", "2"], 2, "-k"),
    Case("k-zero", ["verify", *M, *T, "--k", "0"], 2, "--k must be at least 1, got 0"),
    Case("k-zero-speculative", ["decode", *M, *T, "--draft", "ngram", "--k", "0"], 2, "--k must be at least 1"),
    Case("k-negative-speculative", ["decode", *M, *T, "--draft", "ngram", "--k=-2"], 2, "got -2"),
    Case("max-context-zero", ["forward", *M, *T, "--max-context", "0"], 2, "--max-context must be at least 1"),
    Case("draft-count-not-k", ["verify", *M, *T, "--k", "3", "--draft", "4 5"], 2, "2 token ids"),
    Case("draft-id-beyond-vocab", ["verify", *M, *T, "--draft", "4 500"], 5, "500"),
    Case("draft-not-ids", ["verify", *M, *T, "--draft", "ngram"], 2, "'ngram'"),
    Case("draft-json-float", ["verify", *M, *T, "--draft", "[4, 5.0]"], 2, "item 2 of the JSON array, 5.0,"),
    Case("draft-model-vocab-differs", ["decode", *M, *T, "--draft-model", "{model}"], 5, "vocab_size 301",
         setup=_draft_vocab),
    Case("draft-model-tokenizer-differs", ["decode", "-m", "{tmp}/target", *T, "--draft-model", "{model}"], 5,
         "tokenizer.json", setup=_draft_tokenizer),
    # conflicting or unknown options
    Case("prompt-and-tokens", ["decode", *M, *T, "-p", "hi"], 2, "--prompt and --tokens"),
    Case("ngram-and-draft-model", ["decode", *M, *T, "--draft", "ngram", "--draft-model", LLAMA], 2,
         "--draft-model"),
    Case("verify-draft-and-draft-model", ["verify", *M, *T, "--draft", "1 2", "--draft-model", LLAMA], 2,
         "--draft-model"),
    Case("decode-unknown-draft", ["decode", *M, *T, "--draft", "medusa"], 2, "'medusa'"),
    Case("k-without-draft", ["decode", *M, *T, "--k", "3"], 2, "--k 3"),
    Case("bad-format", ["forward", *M, *T, "--format", "xml"], 2, "'xml'"),
    Case("bad-logits-dtype", ["forward", *M, *T, "--logits-dtype", "fp16"], 2, "'fp16'"),
    Case("bad-device", ["forward", *M, *T, "--device", "tpu"], 2, "'tpu'"),
    Case("bad-rows", ["forward", *M, *T, "--rows", "first"], 2, "'first'"),
    Case("steps-not-a-number", ["decode", *M, *T, "--steps", "many"], 2, "--steps"),
    Case("unknown-option", ["decode", *M, *T, "--temperature", "0.7"], 2, "--temperature"),
    Case("unknown-command", ["generate", *M], 2, "generate", dump=False),
    # dump paths
    Case("unknown-dump-extension", ["forward", *M, *T, "--dump-logits", "{out}/logits.txt"], 2, "logits.txt",
         dump=False),
    Case("hidden-dump-extension", ["forward", *M, *T, "--dump-hidden", "{out}/h.txt"], 2, "h.txt"),
    Case("same-dump-paths", ["forward", *M, *T, "--dump-logits", "{out}/x.npy", "--dump-hidden", "{out}/x.npy"], 2,
         "x.npy", dump=False),
    Case("dump-is-directory", ["forward", *M, *T, "--dump-logits", "{out}"], 7, "is a directory", dump=False),
    Case("dump-parent-missing", ["decode", *M, *T, "--dump-logits", "{out}/no/such/l.npy"], 7, "does not exist",
         dump=False),
    Case("dump-parent-unwritable", ["verify", *M, *T, "--dump-logits", "{tmp}/locked/l.bin"], 7, "not writable",
         patch=_unwritable, dump=False),
    Case("disk-full", ["decode", *M, *T], 7, "no space left on device", patch=_disk_full),
    Case("permission-denied-at-write", ["forward", *M, *T], 7, "permission denied", patch=_permission_denied),
    # device
    Case("cuda-without-cupy", ["forward", *M, *T, "--device", "cuda"], 8, "--device cuda",
         env={"METRALE_DISABLE_CUDA": "1"}),
    # checkpoints and configs
    Case("model-dir-missing", ["decode", "-m", "{tmp}/nowhere", *T], 3, "nowhere"),
    Case("default-format-model-missing-inspect", ["inspect", "{tmp}/nowhere"], 3, "nowhere", dump=False),
    Case("config-invalid-json", ["forward", "-m", "{model}", *T], 4, "invalid JSON", setup=_config_text("{oops")),
    Case("config-missing-field", ["forward", "-m", "{model}", *T], 4, "'hidden_size'",
         setup=_config(hidden_size=None)),
    Case("config-unsupported-model-type", ["decode", "-m", "{model}", *T], 4, '"gpt2"',
         setup=_config(model_type="gpt2")),
    Case("config-hidden-not-divisible-by-heads", ["forward", "-m", "{model}", *T], 4, "not divisible",
         setup=_config(head_dim=None, num_attention_heads=5, num_key_value_heads=5)),
    Case("config-heads-not-divisible-by-kv-heads", ["forward", "-m", "{model}", *T], 4, "num_key_value_heads 3",
         setup=_config(num_key_value_heads=3)),
    Case("config-vocab-differs-from-embedding", ["forward", "-m", "{model}", *T], 4, "vocab_size 310",
         setup=_config(vocab_size=310)),
    Case("tensor-missing", ["decode", "-m", "{model}", *T], 3, "model.norm.weight",
         setup=_tensors(lambda t: t.pop("model.norm.weight"))),
    Case("tensor-misshaped", ["verify", "-m", "{model}", *T], 3, "model.layers.1.mlp.up_proj.weight [80, 63]",
         setup=_tensors(_set("model.layers.1.mlp.up_proj.weight", np.ones((80, 63), np.float32)))),
    Case("tensor-unsupported-dtype", ["forward", "-m", "{model}", *T], 3, "model.norm.weight F64",
         setup=_tensors(_set("model.norm.weight", np.ones(64, np.float64)))),
    Case("inspect-invalid-checkpoint", ["inspect", "{model}"], 3, "model.norm.weight",
         setup=_tensors(lambda t: t.pop("model.norm.weight")), dump=False),
    # numerics (without dumps: with them the rows are written before exit 6, see test_nonfinite.py)
    Case("nan-in-weight", ["decode", "-m", "{model}", *T], 6, "position 2", setup=_tensors(_nan_in_lm_head),
         dump=False),
    Case("nan-in-weight-forward-all", ["forward", "-m", "{model}", *T, "--rows", "all"], 6, "position 0",
         setup=_tensors(_nan_in_lm_head), dump=False),
]


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_bad_input(case: Case, run_cli, tmp_path, tok_model, monkeypatch, helpers):
    out = tmp_path / "out"
    out.mkdir()
    if case.setup is not None:
        case.setup(tmp_path, helpers)
    if case.patch is not None:
        case.patch(monkeypatch, tmp_path)
    subs = {"{tmp}": str(tmp_path), "{out}": str(out), "{model}": str(tmp_path / "model"), "{tok}": str(tok_model)}
    args = []
    for a in case.args:
        for key, value in subs.items():
            a = a.replace(key, value)
        args.append(a)
    if case.dump and args[0] in PASS_COMMANDS:
        args += ["--dump-logits", str(out / "logits.safetensors")]
    before = sorted(p.name for p in tmp_path.iterdir())
    r = run_cli(*args, input=case.input, env=case.env)
    assert r.exit_code == case.code, (r.stdout, r.stderr)
    lines = r.stderr.splitlines()
    assert len(lines) == 1, r.stderr
    assert lines[0].startswith("metrale: ")
    assert case.culprit in lines[0], lines[0]
    assert "Traceback" not in r.stdout + r.stderr
    assert list(out.iterdir()) == []  # no dump, no temp file
    assert sorted(p.name for p in tmp_path.iterdir()) == before


def test_corpus_is_large_enough():
    assert len(CASES) >= 25
    assert {c.code for c in CASES} >= {2, 3, 4, 5, 6, 7, 8}


def test_dump_error_leaves_existing_destination_untouched(run_cli, tmp_path, monkeypatch):
    dest = tmp_path / "logits.npy"
    dest.write_bytes(b"previous run")
    _disk_full(monkeypatch, tmp_path)
    r = run_cli("forward", "-m", LLAMA, "-t", "1 2 3", "--dump-logits", dest)
    assert r.exit_code == 7 and str(dest) in r.stderr
    assert dest.read_bytes() == b"previous run"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["logits.npy"]


def test_config_json_error_names_the_file(run_cli, tmp_path, helpers):
    helpers.copy_model(tmp_path / "model")
    (tmp_path / "model" / "config.json").write_text(json.dumps([1, 2]))
    r = run_cli("forward", "-m", tmp_path / "model", "-t", "1")
    assert r.exit_code == 4 and "config.json" in r.stderr
