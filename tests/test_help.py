"""`metrale --help` and every `metrale COMMAND --help`: each example runs as printed, none is split across
lines at 80 columns, prose is wrapped once (by Rich, not also by the docstring's line breaks), flags show no
value placeholder, and the option descriptions keep a readable column.

The examples run in process through run_cli (conftest.py), which sets METRALE_DISABLE_CUDA=1: `--device auto`
resolves to the CPU. An example that asks for `--device cuda` therefore cannot run here; it is checked to fail
with the device error (exit 8) and nothing else, which shows its options parse and pass every check that comes
before the device. Examples run with a temporary directory as the working directory, so the files they write
(rows.npy, ...) land there and are checked to exist.
"""

from __future__ import annotations

import re
import shlex

import pytest
from typer import rich_utils
from typer.testing import CliRunner

from metrale_cli.cli.entry import app
from metrale_cli.cli.help_format import reflow_help

COMMANDS = ["", "decode", "verify", "forward", "inspect", "bench"]  # "": the top-level help
# compare and score: their examples need input files, so they are held to the layout rules only
LAID_OUT = COMMANDS + ["compare", "score"]
WIDE = 250  # wide enough that Rich wraps nothing
WRITES = ("--dump-logits", "--dump-hidden", "--json")  # options whose value is a file the example writes


def render_help(command: str, columns: int, monkeypatch: pytest.MonkeyPatch | None = None) -> str:
    """The help as a terminal `columns` wide shows it (typer's TERMINAL_WIDTH would override COLUMNS)."""
    args = [command, "--help"] if command else ["--help"]
    mp = monkeypatch or pytest.MonkeyPatch()
    try:
        mp.setattr(rich_utils, "MAX_WIDTH", columns)
        r = CliRunner().invoke(app, args, env={"COLUMNS": str(columns)}, catch_exceptions=False)
    finally:
        if monkeypatch is None:
            mp.undo()
    assert r.exit_code == 0, r.stderr
    return r.stdout


def examples_block(text: str) -> list[str]:
    """The lines under "Examples:" up to the next blank line, stripped of Rich's padding."""
    lines = [line.strip() for line in text.splitlines()]
    start = lines.index("Examples:")
    end = lines.index("", start)
    return lines[start + 1:end]


EXAMPLES = [(command, line) for command in COMMANDS for line in examples_block(render_help(command, WIDE))]


@pytest.mark.parametrize("command", COMMANDS)
def test_every_help_has_examples_of_its_command(command):
    block = examples_block(render_help(command, WIDE))
    assert block, f"no examples in `metrale {command} --help`"
    for line in block:  # a line that does not start a command would be the tail of a split one
        assert line.startswith(f"metrale {command}".rstrip() + " ") or line == f"metrale {command}", line


@pytest.mark.parametrize("command", LAID_OUT)
def test_no_example_is_split_at_80_columns(command, monkeypatch):
    """At 80 columns the example lines are exactly those of a wide terminal: none wrapped."""
    assert examples_block(render_help(command, 80, monkeypatch)) == examples_block(render_help(command, WIDE))


@pytest.mark.parametrize("command, line", EXAMPLES, ids=[line for _, line in EXAMPLES])
def test_example_runs(command, line, run_cli, tmp_path, monkeypatch):
    argv = shlex.split(line)
    assert argv[0] == "metrale"
    args = argv[1:]
    monkeypatch.chdir(tmp_path)  # after run_cli's chdir: what the example writes goes to tmp
    r = run_cli(*args)
    if "--device" in args and args[args.index("--device") + 1] == "cuda":
        # METRALE_DISABLE_CUDA=1: the device is refused, after every option was parsed and checked.
        assert r.exit_code == 8, (r.stdout, r.stderr)
        assert r.stderr.strip().startswith("metrale: device error: --device cuda"), r.stderr
        return
    assert r.exit_code == 0, (line, r.stdout, r.stderr)
    assert r.stdout.strip(), line
    for opt in WRITES:
        if opt in args:
            assert (tmp_path / args[args.index(opt) + 1]).is_file(), f"{line} wrote no {args[args.index(opt) + 1]}"


def _prose_paragraphs(text: str) -> list[list[str]]:
    """The description above the panels, split into paragraphs; blocks with indented lines (examples, exit
    codes) are left out: they are laid out by hand."""
    head = "\n".join(line[1:].rstrip() for line in text.split("╭")[0].splitlines())  # Rich pads 1 column
    paragraphs: list[list[str]] = []
    for block in re.split(r"\n\n+", head.strip("\n")):
        lines = block.splitlines()
        if not lines[0].startswith("Usage:") and not any(line[:1] == " " for line in lines):
            paragraphs.append(lines)
    return paragraphs


@pytest.mark.parametrize("command", LAID_OUT)
def test_prose_is_wrapped_once_at_80_columns(command, monkeypatch):
    """Each line of a paragraph ends only because the next word would not fit in the 78 columns Rich has
    (80 less its padding): the docstring's own line breaks are gone, so no ragged short lines."""
    paragraphs = _prose_paragraphs(render_help(command, 80, monkeypatch))
    assert paragraphs
    for lines in paragraphs:
        for line, following in zip(lines, lines[1:]):
            assert len(line) + 1 + len(following.split()[0]) > 78, (line, following)


@pytest.mark.parametrize("command", LAID_OUT)
def test_flags_show_no_value_placeholder_and_usage_no_double_brackets(command, monkeypatch):
    text = render_help(command, 80, monkeypatch)
    assert "<bool>" not in text and "[[" not in text
    assert not re.search(r"<\w+>", text.split("─ Options ")[1])  # every option names its value (N, PATH...)


@pytest.mark.parametrize("command", LAID_OUT[1:])
def test_option_descriptions_keep_a_readable_column_at_80(command, monkeypatch):
    """The description column starts at the same place on every row; at 80 columns it is >= 30 wide."""
    text = render_help(command, 80, monkeypatch)
    row = next(line for line in text.splitlines() if "Show this message and exit." in line)
    assert 80 - row.index("Show this message and exit.") - 2 >= 30, row


def test_model_help_names_the_embedded_models(monkeypatch):
    for command in ("decode", "verify", "forward", "inspect"):
        text = " ".join(render_help(command, WIDE, monkeypatch).split())
        assert "an embedded model by name: default, default-draft" in text, command
    assert "default-draft" in " ".join(render_help("", WIDE, monkeypatch).split())


def test_help_text_survives_rich_markup(monkeypatch):
    """Brackets in help text are literal: the JSON array form is shown, not eaten as a markup tag."""
    assert '"[1, 2, 3]"' in render_help("decode", WIDE, monkeypatch)
    text = " ".join(render_help("forward", WIDE, monkeypatch).split())  # option help too: no "fp32 :"
    assert "fp32 [rows, hidden]:" in text and "(fp32 [rows, width], named" in text
    assert reflow_help("Summary.\n\nRows [rows, vocab] in\norder.") == "Summary.\n\n\nRows \\[rows, vocab] in order."


def test_reflow_keeps_indented_blocks_and_their_indent():
    doc = """First line
    of the summary.

    Prose that was
    hard-wrapped.

    Examples:
      metrale forward --rows all
      metrale forward --tokens "1 2 3"
    """
    assert reflow_help(doc) == ("First line of the summary.\n\n\nProse that was hard-wrapped.\n\n"
                                "Examples:\n  metrale forward --rows all\n  metrale forward --tokens \"1 2 3\"")


def test_examples_alone_after_the_summary_keep_their_indent():
    """typer dedents the paragraphs after the first as one text: with only "Examples:" unindented at its
    start, the examples lost their indent (forward's help did); reflow_help's leading blank line keeps it."""
    import typer

    from metrale_cli.cli.help_format import MetraleCommand

    demo = typer.Typer(rich_markup_mode="rich")

    @demo.command(cls=MetraleCommand)
    def run() -> None:
        """Summary.

        Examples:
          metrale run --one
          metrale run --two
        """

    @demo.command(cls=MetraleCommand)
    def other() -> None:
        """Another command, so that `run` is a subcommand."""

    r = CliRunner().invoke(demo, ["run", "--help"], env={"COLUMNS": "80"})
    assert r.exit_code == 0
    assert "\n Examples:" in r.stdout and "\n   metrale run --one" in r.stdout and "\n   metrale run --two" in r.stdout
