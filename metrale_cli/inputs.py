"""What the user asked the model to read: token ids or a prompt, checked before any weight is loaded.

Everything here reads only config.json and tokenizer.json, so a wrong id, an empty prompt or a job
longer than the model's context fails in milliseconds with a one-line InputError that names the value,
not after gigabytes of weights were converted.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Sequence

from .config import ModelConfig, load_config
from .errors import InputError, UsageError
from .model import DEFAULT_MODEL_DIR, model_dir
from .tokenizer import Tokenizer

DEFAULT_PROMPT = "The for statement"
TOKENIZER_NAME = "tokenizer.json"


@dataclass
class ModelSpec:
    """A checkpoint as far as it can be known without loading weights."""

    path: str | None  # what --model said (None: the embedded default)
    directory: Path
    config: ModelConfig

    @property
    def label(self) -> str:
        """How reports name the model: the path as given, or "default" for the embedded model."""
        return "default" if self.path is None else self.path

    @property
    def tokenizer_path(self) -> Path | None:
        p = self.directory / TOKENIZER_NAME
        return p if p.is_file() else None

    def tokenizer_sha256(self) -> str | None:
        import hashlib  # loads OpenSSL (~8 ms): only for the commands that report this hash

        p = self.tokenizer_path
        return hashlib.sha256(p.read_bytes()).hexdigest() if p is not None else None


def read_model_spec(path: str | None) -> ModelSpec:
    """Resolve --model (default: the embedded model) and read its config.json."""
    directory = model_dir(path) if path is not None else model_dir(DEFAULT_MODEL_DIR)
    return ModelSpec(path, directory, load_config(directory))


# -- token ids ---------------------------------------------------------------------------------------------

_SEPARATORS = re.compile(r"[\s,]+")


def parse_token_ids(text: str, option: str = "--tokens") -> list[int]:
    """'1 2 3', '1,2,3' or '1, 2, 3' -> [1, 2, 3]; anything that is not an integer is an InputError."""
    parts = [p for p in _SEPARATORS.split(text.strip()) if p]
    if not parts:
        raise InputError(f"{option} is empty: give token ids such as '1 2 3'")
    ids = []
    for p in parts:
        try:
            ids.append(int(p, 10))
        except ValueError:
            shown = p if len(p) <= 40 else p[:40] + "..."
            raise InputError(f"{option}: {shown!r} is not a token id (an integer)") from None
    return ids


def check_ids_in_vocab(ids: Sequence[int], vocab: int, option: str = "--tokens") -> None:
    for i, t in enumerate(ids):
        if not 0 <= t < vocab:
            raise InputError(f"{option}: token id {t} (item {i + 1}) is outside the vocabulary [0, {vocab})")


def resolve_prompt(spec: ModelSpec, prompt: str | None, tokens: str | None,
                   read_stdin: Callable[[], str]) -> tuple[list[int], str | None]:
    """The prompt's token ids and its text (None when ids were given): exactly one of --prompt/--tokens;
    neither means the default prompt, which needs a tokenizer."""
    if prompt is not None and tokens is not None:
        raise UsageError("--prompt and --tokens are exclusive: give one of them")
    if tokens is not None:
        text = read_stdin() if tokens == "-" else tokens
        ids = parse_token_ids(text, "--tokens" if tokens != "-" else "--tokens - (stdin)")
        check_ids_in_vocab(ids, spec.config.vocab_size)
        return ids, None
    tok_path = spec.tokenizer_path
    if prompt is None:
        if tok_path is None:
            raise UsageError(
                f"give --tokens '1 2 3' or --prompt TEXT: {spec.label} has no {TOKENIZER_NAME} "
                "to encode the default prompt"
            )
        prompt = DEFAULT_PROMPT
    if tok_path is None:
        raise InputError(f"--prompt needs {TOKENIZER_NAME}, and {spec.directory} has none: pass --tokens instead")
    if not prompt.strip():
        raise InputError("--prompt is empty")
    ids = Tokenizer.from_file(tok_path).encode(prompt)
    if not ids:
        raise InputError(f"--prompt {prompt!r} encodes to no tokens")
    check_ids_in_vocab(ids, spec.config.vocab_size, "--prompt")
    return ids, prompt


# -- lengths -----------------------------------------------------------------------------------------------------


def check_positive(value: int, option: str) -> None:
    if value <= 0:
        raise InputError(f"{option} must be at least 1, got {value}")


def limit_of(cfg: ModelConfig) -> str:
    if cfg.sliding_window is not None and cfg.sliding_window < cfg.max_position_embeddings:
        return f"sliding_window {cfg.sliding_window}"
    return f"max_position_embeddings {cfg.max_position_embeddings}"


def context_for(spec: ModelSpec, need: int, what: str, max_context: int | None,
                want: int | None = None) -> int:
    """The KV cache size for a job that must hold `need` positions (described by `what`).

    The default is `want` (>= need, e.g. need plus draft room) capped at the model's limit, so memory is
    sized to the job; --max-context must cover `need` and stay within the model's limit.
    """
    cfg = spec.config
    if need > cfg.max_context:
        raise InputError(f"{what} = {need} positions exceed {spec.label}'s {limit_of(cfg)}")
    if max_context is not None:
        if max_context > cfg.max_context:
            raise InputError(f"--max-context {max_context} exceeds {spec.label}'s {limit_of(cfg)}")
        if max_context < need:
            raise InputError(f"--max-context {max_context} is smaller than {what} = {need} positions")
        return max_context
    return min(max(want or need, need), cfg.max_context)


def check_draft_matches(target: ModelSpec, draft: ModelSpec) -> None:
    """A draft model must share the target's vocabulary and (when both have one) its tokenizer.json."""
    if draft.config.vocab_size != target.config.vocab_size:
        raise InputError(
            f"--draft-model {draft.label} has vocab_size {draft.config.vocab_size}, "
            f"the target {target.label} has {target.config.vocab_size}"
        )
    a, b = target.tokenizer_sha256(), draft.tokenizer_sha256()
    if a is not None and b is not None and a != b:
        raise InputError(
            f"--draft-model {draft.label} has a different {TOKENIZER_NAME} than {target.label} "
            f"(sha256 {b[:12]} vs {a[:12]})"
        )
