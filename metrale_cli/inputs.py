"""What the user asked the model to read: token ids or a prompt, checked before any weight is loaded.

Everything here reads only config.json and tokenizer.json, so a wrong id, an empty prompt or a job
longer than the model's context fails in milliseconds with a one-line InputError that names the value,
not after gigabytes of weights were converted.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Sequence

from .chat import format_chat
from .config import ModelConfig, load_config
from .errors import InputError, UsageError
from .model import model_dir, model_path
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

    @property
    def checkpoint_path(self) -> Path:
        """What Checkpoint.open reads: the .safetensors or index.json file --model named, else the directory."""
        p = model_path(self.path)
        return p if p.is_file() else self.directory

    def tokenizer_sha256(self) -> str | None:
        import hashlib  # loads OpenSSL (~8 ms): only for the commands that report this hash

        p = self.tokenizer_path
        return hashlib.sha256(p.read_bytes()).hexdigest() if p is not None else None


def read_model_spec(path: str | None) -> ModelSpec:
    """Resolve --model (default: the embedded model; an embedded model's name; a path) and read its config.json."""
    directory = model_dir(path)
    return ModelSpec(path, directory, load_config(directory))


# -- token ids ---------------------------------------------------------------------------------------------

_SEPARATORS = re.compile(r"[\s,]+")


def parse_token_ids(text: str, option: str = "--tokens") -> list[int]:
    """'1 2 3', '1,2,3', '1, 2, 3' or the JSON array '[1, 2, 3]' (what Python and JSON print) -> [1, 2, 3].

    Text that is not a list of integers is a UsageError: it is wrong whatever the model (exit 2); whether
    the ids fit the model's vocabulary is check_ids_in_vocab's question (an InputError, exit 5).
    """
    stripped = text.strip()
    ids = _json_ids(stripped, option) if stripped.startswith("[") else _separated_ids(stripped, option)
    if not ids:
        raise UsageError(f"{option} is empty: give token ids such as '1 2 3' or '[1, 2, 3]'")
    return ids


def _separated_ids(text: str, option: str) -> list[int]:
    ids = []
    for p in (p for p in _SEPARATORS.split(text) if p):
        try:
            ids.append(int(p, 10))
        except ValueError:
            raise UsageError(f"{option}: {_shown(p)!r} is not a token id (an integer)") from None
    return ids


def _json_ids(text: str, option: str) -> list[int]:
    try:
        value = json.loads(text)
    except ValueError as e:
        raise UsageError(f"{option}: {_shown(text)!r} is not a JSON array of token ids ({e}); "
                         "give '[1, 2, 3]' or '1 2 3'") from None
    for i, item in enumerate(value):
        # bool is an int subclass in Python: true/false are not token ids; neither are 2.0 or "2".
        if type(item) is not int:
            raise UsageError(f"{option}: item {i + 1} of the JSON array, {_shown(json.dumps(item))}, "
                             "is not a token id (an integer)")
    return value


def _shown(text: str) -> str:
    return text if len(text) <= 40 else text[:40] + "..."


def check_ids_in_vocab(ids: Sequence[int], vocab: int, option: str = "--tokens") -> None:
    for i, t in enumerate(ids):
        if not 0 <= t < vocab:
            raise InputError(f"{option}: token id {t} (item {i + 1}) is outside the vocabulary [0, {vocab})")


@dataclass(frozen=True)
class PromptFormat:
    """How --prompt text becomes token ids: through the chat template (--chat, --system) or the tokenizer's
    own encoding, with or without its special tokens (--no-special-tokens)."""

    chat: bool = False
    system: str | None = None
    special_tokens: bool = True


def check_prompt_format(prompt: str | None, tokens: str | None, fmt: PromptFormat) -> None:
    """The --chat/--system/--no-special-tokens combinations that cannot mean anything (usage errors)."""
    if fmt.system is not None and not fmt.chat:
        raise UsageError("--system needs --chat: the system message is formatted by the chat template")
    if fmt.chat and tokens is not None:
        raise UsageError("--chat formats --prompt text with the chat template, and --tokens are ids already: "
                         "give --prompt TEXT, or drop --chat")
    if fmt.chat and prompt is None:
        raise UsageError("--chat needs --prompt TEXT: the user message the chat template formats")
    if not fmt.special_tokens and tokens is not None:
        raise UsageError("--no-special-tokens changes how --prompt text is encoded, and --tokens are ids already")
    if not fmt.special_tokens and fmt.chat:
        raise UsageError("--chat already encodes without the tokenizer's special tokens (the chat template "
                         "writes them): drop --no-special-tokens")


def resolve_prompt(spec: ModelSpec, prompt: str | None, tokens: str | None,
                   read_stdin: Callable[[], str], fmt: PromptFormat = PromptFormat()) -> tuple[list[int], str | None]:
    """The prompt's token ids and its text (None when ids were given): exactly one of --prompt/--tokens;
    neither means the default prompt, which needs a tokenizer.

    With --chat the text is what the chat template rendered (what the model reads), encoded like
    transformers' apply_chat_template(..., tokenize=True): without the tokenizer's special tokens, since the
    template writes BOS and the role markers itself."""
    if prompt is not None and tokens is not None:
        raise UsageError("--prompt and --tokens are exclusive: give one of them")
    check_prompt_format(prompt, tokens, fmt)
    if tokens is not None:
        text = read_stdin() if tokens == "-" else tokens
        ids = parse_token_ids(text, "--tokens" if tokens != "-" else "--tokens - (stdin)")
        check_ids_in_vocab(ids, spec.config.vocab_size)
        return ids, None
    tok_path = spec.tokenizer_path
    if prompt is None:
        if tok_path is None:  # this model cannot take text: an input error (5), like --prompt below
            raise InputError(
                f"give --tokens '1 2 3' or --prompt TEXT: {spec.label} has no {TOKENIZER_NAME} "
                "to encode the default prompt"
            )
        prompt = DEFAULT_PROMPT
    if tok_path is None:
        raise InputError(f"--prompt needs {TOKENIZER_NAME}, and {spec.directory} has none: pass --tokens instead")
    if not prompt.strip():
        raise UsageError("--prompt is empty")
    text = format_chat(spec.directory, prompt, fmt.system) if fmt.chat else prompt
    ids = Tokenizer.from_file(tok_path).encode(text, add_special_tokens=fmt.special_tokens and not fmt.chat)
    if not ids:
        raise InputError(f"--prompt {prompt!r} encodes to no tokens")
    check_ids_in_vocab(ids, spec.config.vocab_size, "--prompt")
    return ids, text


# -- lengths -----------------------------------------------------------------------------------------------------


def check_positive(value: int, option: str, hint: str = "") -> None:
    """An option that counts something (steps, drafts, candidates, positions) must be >= 1: wrong whatever
    the model, so a UsageError (exit 2), like a malformed option value."""
    if value <= 0:
        raise UsageError(f"{option} must be at least 1, got {value}{hint}")


def limit_of(cfg: ModelConfig) -> str:
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
