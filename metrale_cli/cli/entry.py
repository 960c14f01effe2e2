"""The app and its error boundary: the top-level help, the consoles, every failure turned into one line on
stderr and a documented exit code (errors.py), and main(), the `metrale` console script."""


import os
import sys
from dataclasses import dataclass, field
from typing import Annotated, Any, Callable, Sequence

import typer
from rich.console import Console
from typer.core import TyperGroup

try:  # typer >= 0.25 vendors click as typer._click; earlier versions use click itself
    from typer._click import exceptions as click_exc
except ImportError:  # pragma: no cover
    from click import exceptions as click_exc  # type: ignore[no-redef]

from .. import __version__
from ..errors import EXIT_CODES, Interrupted, MetraleError, StdoutClosed, UsageError
from ..models import FAMILIES
from ..render.common import error_line, help_text
from .help_format import HelpFormat
from .options import EMBEDDED_HELP

EXIT_CODE_HELP = "\n".join(f"  {code:>3}  {text}" for code, text in sorted(EXIT_CODES.items()))

TOP_HELP = f"""Forward, decode and verify passes on Hugging Face checkpoints ({", ".join(FAMILIES)}),
on the CPU (NumPy) or a CUDA GPU (CuPy), reporting exactly what the model computed.

--model takes a checkpoint directory, a .safetensors file or index.json, or {EMBEDDED_HELP}.
Without --model: the embedded model "default".

Examples:
  metrale decode --prompt "The for statement" --steps 8 --top-k 3
  metrale verify --tokens "1 2 3" --k 4 --model default
  metrale inspect default-draft

Exit codes:
{EXIT_CODE_HELP}

Exit 2 when the command line is wrong whatever the model (an unknown option, a malformed value, a count
below 1, options that disagree); exit 5 when this model cannot take it (a token id beyond its vocabulary,
text without a tokenizer.json, a length beyond its context).

Set METRALE_DEBUG=1 to see the traceback of an internal error."""

INTERRUPTED = "stopped by Ctrl-C (no partial output file is left)"


class PipeConsole(Console):
    """A Console whose closed pipe is a BrokenPipeError, as for any other write (Rich's own handling exits 1
    from wherever the write happened), so the error boundary gives the one documented exit (141)."""

    def on_broken_pipe(self) -> None:
        raise BrokenPipeError("stdout closed")


@dataclass
class State:
    """The two consoles every report goes through; created once per run, passed down to render."""

    out: Console = field(default_factory=lambda: PipeConsole(highlight=False))
    err: Console = field(default_factory=lambda: PipeConsole(stderr=True, highlight=False))


class MetraleGroup(HelpFormat, TyperGroup):
    """Turns every failure into one line on stderr and a documented exit code (see errors.py)."""

    def invoke(self, ctx: typer.Context) -> Any:
        try:
            return super().invoke(ctx)
        except KeyboardInterrupt:
            raise Interrupted(INTERRUPTED) from None
        except BrokenPipeError:  # before click's own handling, which exits 1
            raise StdoutClosed("the reader of stdout left") from None

    def make_context(self, *args: Any, **kwargs: Any) -> Any:  # --help and --version print from here
        try:
            return super().make_context(*args, **kwargs)
        except BrokenPipeError:
            raise StdoutClosed("the reader of stdout left") from None

    def main(self, args: Sequence[str] | None = None, prog_name: str | None = None,
             complete_var: str | None = None, standalone_mode: bool = True, **extra: Any) -> Any:
        state = extra.get("obj")
        if not isinstance(state, State):
            state = extra["obj"] = State()
        code = _guarded(state.err, lambda: super(MetraleGroup, self).main(
            args, prog_name or "metrale", complete_var, standalone_mode=False, **extra))
        if standalone_mode:
            sys.exit(code)
        return code


def _guarded(err: Console, run: Callable[[], Any]) -> int:
    try:
        rv = run()
        return rv if isinstance(rv, int) else 0
    except (StdoutClosed, BrokenPipeError):  # `metrale decode | head`: the reader left; nothing more to say
        _silence_stdout()
        return StdoutClosed.exit_code
    except MetraleError as e:
        error_line(err, f"metrale: {e.kind}: {e}")
        return e.exit_code
    except (KeyboardInterrupt, typer.Abort):
        error_line(err, f"metrale: {Interrupted.kind}: {INTERRUPTED}")
        return Interrupted.exit_code
    except click_exc.NoArgsIsHelpError as e:  # bare `metrale`: the help (typer's rich help prints itself)
        text = e.ctx.get_help() if e.ctx is not None else ""
        if text:
            help_text(err, text)
        return 2
    except click_exc.UsageError as e:
        where = f" (see '{e.ctx.command_path} --help')" if e.ctx is not None else ""
        error_line(err, f"metrale: {UsageError.kind}: {' '.join(e.format_message().split())}{where}")
        return 2
    except click_exc.ClickException as e:
        error_line(err, f"metrale: error: {' '.join(e.format_message().split())}")
        return e.exit_code
    except Exception as e:  # a bug: one line, the traceback only on request
        if os.environ.get("METRALE_DEBUG"):
            import traceback  # only for this, a bug's report

            help_text(err, traceback.format_exc().rstrip())
        msg = " ".join(str(e).split()) or "(no message)"
        error_line(err, f"metrale: internal error: {type(e).__name__}: {msg} "
                        "(set METRALE_DEBUG=1 for the traceback)")
        return MetraleError.exit_code


def _silence_stdout() -> None:
    """stdout to /dev/null, so the interpreter's last flush of it does not fail again."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
    except (OSError, ValueError, AttributeError):
        pass


app = typer.Typer(cls=MetraleGroup, help=TOP_HELP, add_completion=False, no_args_is_help=True,
                  pretty_exceptions_enable=False, rich_markup_mode="rich",
                  context_settings={"help_option_names": ["-h", "--help"]})


def _version(value: bool) -> None:
    if value:
        help_text(PipeConsole(highlight=False), f"metrale {__version__}")
        raise typer.Exit()


@app.callback()
def _root(version: Annotated[bool, typer.Option("--version", callback=_version, is_eager=True,
                                                help="Print the version and exit.")] = False) -> None:
    pass


def main(argv: Sequence[str] | None = None) -> None:
    """The `metrale` console script: run the app and exit with its code."""
    for stream in (sys.stdout, sys.stderr):
        try:  # a token text the terminal cannot encode must not crash the report
            stream.reconfigure(errors="backslashreplace")  # type: ignore[union-attr]
        except (AttributeError, ValueError):
            pass
    typer.main.get_command(app).main(args=argv, prog_name="metrale")
