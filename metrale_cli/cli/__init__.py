"""The metrale command line: parse options, check them, call the computation, hand the results to render.

No math and no printing here: decoding (and compare, scoring, bench...) computes, render prints, dumps.py
writes files. Inputs are checked against config.json (and tokenizer.json) before any weight is loaded.

    entry        the app, its help, the error boundary (exit codes) and main(), the console script
    help_format  docstrings reflowed for typer's help; flags shown without a value
    options      the options the commands share, declared once
    job          what the pass commands share once parsed: the checks, loading, the dumps, Ctrl-C
    decode, verify, forward, inspect, bench, compare, score: one module per command

Importing the package registers the commands, in the order `metrale --help` lists them. Heavy modules
(numpy and what needs it) are imported inside the commands, so `metrale --help` stays fast.
"""

# Registers the commands, in this order.
from . import decode, verify, forward, inspect, bench, compare, score  # noqa: F401
from .entry import app, main

__all__ = ["app", "main"]
