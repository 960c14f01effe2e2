"""Help text as metrale prints it: docstrings reflowed for typer's rich help, and flags shown without a
value placeholder."""


import re
from inspect import cleandoc
from typing import Any

import typer
from rich.markup import escape
from typer.core import TyperCommand


def reflow_help(doc: str) -> str:
    """A docstring as typer's rich help needs it: prose paragraphs, hard-wrapped in the source, become one
    line each (Rich wraps them to the terminal; typer would keep the source's breaks, giving ragged lines);
    a paragraph with an indented line (examples, the exit codes) is kept verbatim, line for line."""
    paragraphs = [p for p in re.split(r"\n[ \t]*\n", cleandoc(doc)) if p.strip()]
    out = [escape(p if any(line[:1].isspace() for line in p.splitlines())
                  else " ".join(line.strip() for line in p.splitlines())) for p in paragraphs]
    # typer dedents the paragraphs after the first as one text (inspect.cleandoc), which strips the
    # examples' indent when every line but the first ("Examples:") is indented; starting that text with a
    # blank line, which cleandoc drops, makes "Examples:" count for the indentation.
    return out[0] + "\n\n\n" + "\n\n".join(out[1:]) if len(out) > 1 else "".join(out)


class HelpFormat:
    """Mixed into metrale's typer command and group classes: reflowed docstrings, and no "<bool>" for flags
    (it suggested `--ignore-eos true`, which fails: a flag takes no value)."""

    def __init__(self, *args: Any, help: str | None = None, **kwargs: Any) -> None:
        super().__init__(*args, help=reflow_help(help) if help else help, **kwargs)  # type: ignore[call-arg]
        for param in self.params:  # type: ignore[attr-defined]
            if getattr(param, "help", None):  # "[rows, hidden]" is text, not a markup tag to drop
                param.help = escape(param.help)

    def format_help(self, ctx: typer.Context, formatter: Any) -> None:
        for param in self.get_params(ctx):  # type: ignore[attr-defined]
            if getattr(param, "is_flag", False) and param.metavar is None:
                param.metavar = ""
        try:
            super().format_help(ctx, formatter)  # type: ignore[misc]
        except SystemExit:  # typer's help console meeting a closed stdout (Rich exits 1): the CLI's exit 141
            raise BrokenPipeError("stdout closed") from None


class MetraleCommand(HelpFormat, TyperCommand):
    """A metrale command: typer's, with metrale's help format."""
