"""Every user-facing failure is one of these. The CLI prints `str(err)` on one line and exits with `err.exit_code`.

Exit codes (also in `metrale --help` and the README):

    0   success
    2   usage error: bad or conflicting options (typer/click also use 2)
    3   checkpoint error: a weights file, shard index or tensor set is missing, malformed or inconsistent
    4   config error: config.json is invalid, inconsistent, or asks for something metrale cannot run
    5   input error: token ids, prompt or lengths that the model cannot take; a compared file that cannot be
        read (a .pt file whose pickle names code is refused unrun: readers/torch_pickle.UnsafePickleError)
    6   non-finite logits: a produced logits row holds NaN or Inf
    7   output error: a dump path that cannot be written (directory, permissions, disk full)
    8   device error: no CUDA device or CuPy, or device memory exhausted
    9   outputs differ beyond the tolerance (`metrale compare` with --max-kl, --max-rel-err, --min-top1 or --rtol)
    70  internal error: a bug in metrale (run with METRALE_DEBUG=1 for the traceback)
    130 interrupted (Ctrl-C); no partial output file is left behind
    141 stdout closed by its reader (`metrale decode ... | head -1`): metrale stops at once and quietly
        (nothing on stderr), as a Unix tool killed by SIGPIPE exits 128 + 13; a dump not yet written is
        not written, and no partial file is left behind
"""

from __future__ import annotations


class MetraleError(Exception):
    """Base class: a failure with a one-line, actionable message and a documented exit code."""

    exit_code = 70
    kind = "error"

    def __init__(self, message: str) -> None:
        # Keep the message on one line whatever the caller passed in.
        super().__init__(" ".join(str(message).split()))


class UsageError(MetraleError):
    exit_code = 2
    kind = "usage error"


class CheckpointError(MetraleError):
    exit_code = 3
    kind = "checkpoint error"


class ConfigError(MetraleError):
    exit_code = 4
    kind = "config error"


class InputError(MetraleError):
    exit_code = 5
    kind = "input error"


class NonFiniteLogitsError(MetraleError):
    exit_code = 6
    kind = "non-finite logits"

    def __init__(self, message: str, *, row: int | None = None, position: int | None = None) -> None:
        super().__init__(message)
        self.row = row
        self.position = position


class OutputError(MetraleError):
    exit_code = 7
    kind = "output error"


class DeviceError(MetraleError):
    exit_code = 8
    kind = "device error"


class Interrupted(MetraleError):
    exit_code = 130
    kind = "interrupted"


class StdoutClosed(MetraleError):
    """The reader of stdout went away (a closed pipe): stop, and say nothing (stderr is for errors)."""

    exit_code = 141  # 128 + SIGPIPE, what `yes | head -1` reports for yes
    kind = "stdout closed"


EXIT_CODES: dict[int, str] = {
    0: "success",
    UsageError.exit_code: "usage error (bad or conflicting options)",
    CheckpointError.exit_code: "checkpoint error (weights files, shard index, tensor names or shapes)",
    ConfigError.exit_code: "config error (config.json invalid or unsupported)",
    InputError.exit_code: "input error (token ids, prompt, lengths)",
    NonFiniteLogitsError.exit_code: "non-finite logits (NaN or Inf in a produced row)",
    OutputError.exit_code: "output error (dump path not writable, disk full)",
    DeviceError.exit_code: "device error (no CUDA/CuPy, out of device memory)",
    MetraleError.exit_code: "internal error (set METRALE_DEBUG=1 for a traceback)",
    Interrupted.exit_code: "interrupted (Ctrl-C); no partial file is left",
    StdoutClosed.exit_code: "stdout closed by its reader (| head): quiet stop; no partial file is left",
}


class DivergenceError(MetraleError):
    """`metrale compare` with a tolerance: the outputs differ beyond it (the report is printed first)."""

    exit_code = 9
    kind = "outputs differ"


EXIT_CODES[DivergenceError.exit_code] = "outputs differ beyond the tolerance (compare --max-kl, --rtol ...)"
