"""The metrale command line: parse options, check them, call decoding, hand the results to render.

No math and no printing here: decoding.py computes, render.py prints, dumps.py writes files. Inputs are
checked against config.json (and tokenizer.json) before any weight is loaded.
"""


import contextlib
import json
import math
import os
import re
import signal
import sys
import threading
from dataclasses import dataclass, field
from inspect import cleandoc
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, Callable, Iterator, Optional, Sequence

import typer
from rich.console import Console
from rich.markup import escape
from typer.core import TyperCommand, TyperGroup

try:  # typer >= 0.25 vendors click as typer._click; earlier versions use click itself
    from typer._click import exceptions as click_exc
except ImportError:  # pragma: no cover
    from click import exceptions as click_exc  # type: ignore[no-redef]

from . import __version__, render
from .checkpoint import Checkpoint
from .dumps import HIDDEN_KINDS, DumpInfo, DumpTarget, check_dump_path, commit, write_hidden, write_logits
from .errors import EXIT_CODES, ConfigError, Interrupted, MetraleError, NonFiniteLogitsError, UsageError
from .inputs import (ModelSpec, PromptFormat, check_draft_matches, check_ids_in_vocab, check_positive,
                     check_prompt_format, context_for, parse_token_ids, read_model_spec, resolve_prompt)
from .model import EMBEDDED_MODELS, LoadedModel, model_dir, model_path, open_model, resolve_device
from .models import FAMILIES
from .models.weights import check_checkpoint

if TYPE_CHECKING:  # the commands import decoding (and with it numpy) when they run: --help stays fast
    from .decoding.results import DecodeResult, SpecDecodeResult

EXIT_CODE_HELP = "\n".join(f"  {code:>3}  {text}" for code, text in sorted(EXIT_CODES.items()))

EMBEDDED_HELP = f"an embedded model by name: {', '.join(EMBEDDED_MODELS)} (an existing path of that name wins)"

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

DEFAULT_K = 4
INTERRUPTED = "stopped by Ctrl-C (no partial output file is left)"


# -- consoles and the error boundary --------------------------------------------------------------------------


@dataclass
class State:
    """The two consoles every report goes through; created once per run, passed down to render."""

    out: Console = field(default_factory=lambda: Console(highlight=False))
    err: Console = field(default_factory=lambda: Console(stderr=True, highlight=False))


# -- help text -------------------------------------------------------------------------------------------------


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

    def format_help(self, ctx: typer.Context, formatter: Any) -> None:
        for param in self.get_params(ctx):  # type: ignore[attr-defined]
            if getattr(param, "is_flag", False) and param.metavar is None:
                param.metavar = ""
        super().format_help(ctx, formatter)  # type: ignore[misc]


class MetraleCommand(HelpFormat, TyperCommand):
    """A metrale command: typer's, with metrale's help format."""


class MetraleGroup(HelpFormat, TyperGroup):
    """Turns every failure into one line on stderr and a documented exit code (see errors.py)."""

    def invoke(self, ctx: typer.Context) -> Any:
        try:
            return super().invoke(ctx)
        except KeyboardInterrupt:
            raise Interrupted(INTERRUPTED) from None

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
    except MetraleError as e:
        render.error_line(err, f"metrale: {e.kind}: {e}")
        return e.exit_code
    except (KeyboardInterrupt, typer.Abort):
        render.error_line(err, f"metrale: {Interrupted.kind}: {INTERRUPTED}")
        return Interrupted.exit_code
    except click_exc.NoArgsIsHelpError as e:  # bare `metrale`: the help (typer's rich help prints itself)
        text = e.ctx.get_help() if e.ctx is not None else ""
        if text:
            render.help_text(err, text)
        return 2
    except click_exc.UsageError as e:
        where = f" (see '{e.ctx.command_path} --help')" if e.ctx is not None else ""
        render.error_line(err, f"metrale: {UsageError.kind}: {' '.join(e.format_message().split())}{where}")
        return 2
    except click_exc.ClickException as e:
        render.error_line(err, f"metrale: error: {' '.join(e.format_message().split())}")
        return e.exit_code
    except BrokenPipeError:  # `metrale decode | head`: the reader left; nothing more to say
        _silence_stdout()
        return 0
    except Exception as e:  # a bug: one line, the traceback only on request
        if os.environ.get("METRALE_DEBUG"):
            import traceback  # only for this, a bug's report

            render.help_text(err, traceback.format_exc().rstrip())
        msg = " ".join(str(e).split()) or "(no message)"
        render.error_line(err, f"metrale: internal error: {type(e).__name__}: {msg} "
                               "(set METRALE_DEBUG=1 for the traceback)")
        return MetraleError.exit_code


def _silence_stdout() -> None:
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
        render.help_text(Console(highlight=False), f"metrale {__version__}")
        raise typer.Exit()


@app.callback()
def _root(version: Annotated[bool, typer.Option("--version", callback=_version, is_eager=True,
                                                help="Print the version and exit.")] = False) -> None:
    pass


# -- options shared by decode, verify and forward ---------------------------------------------------------------

ModelOpt = Annotated[Optional[str], typer.Option(
    "--model", "-m", metavar="PATH",
    help=f"Checkpoint directory, .safetensors file or index.json, or {EMBEDDED_HELP}. Default: default.")]
PromptOpt = Annotated[Optional[str], typer.Option(
    "--prompt", "-p", metavar="TEXT", help="Prompt text (needs tokenizer.json). Default: \"The for statement\".")]
TokensOpt = Annotated[Optional[str], typer.Option(
    "--tokens", "-t", metavar="IDS",
    help="Prompt token ids: \"1 2 3\", \"1,2,3\" or a JSON array \"[1, 2, 3]\"; '-' reads them from stdin.")]
ChatOpt = Annotated[bool, typer.Option(
    "--chat", help="Format --prompt with the checkpoint's chat template (as transformers' apply_chat_template).")]
SystemOpt = Annotated[Optional[str], typer.Option(
    "--system", metavar="TEXT", help="With --chat: a system message before the prompt.")]
NoSpecialTokensOpt = Annotated[bool, typer.Option(
    "--no-special-tokens", help="Encode --prompt without the tokenizer's added BOS/template tokens.")]
DeviceOpt = Annotated[str, typer.Option("--device", metavar="auto|cpu|cuda", help="Where to run.")]
LogitsDtypeOpt = Annotated[str, typer.Option(
    "--logits-dtype", metavar="bf16|fp32", help="Dtype of the logits rows the engine writes.")]
FormatOpt = Annotated[Optional[str], typer.Option(
    "--format", "-f", metavar="rich|plain|json", help="Output format (default: rich on a terminal, else plain).")]
DumpLogitsOpt = Annotated[Optional[str], typer.Option(
    "--dump-logits", metavar="PATH", help="Write every logits row: .safetensors, .npy, .bin, or - (stdout).")]
HiddenOpt = Annotated[bool, typer.Option(
    "--hidden", help="Summarize the hidden state after the final norm (of the last row).")]
DumpHiddenOpt = Annotated[Optional[str], typer.Option(
    "--dump-hidden", metavar="PATH",
    help="Write the hidden state after the final norm behind every logits row, fp32 [rows, hidden]: "
         ".safetensors, .npy or .bin.")]
DumpLayersOpt = Annotated[Optional[str], typer.Option(
    "--dump-layers", metavar="PATH",
    help="Write every module's output (fp32 [rows, width], named after the Hugging Face modules) for every "
         "row the command processed: .safetensors or .npz; .json with --dump-stats.")]
LayersOpt = Annotated[Optional[str], typer.Option(
    "--layers", metavar="I,J,...", help="The layers --dump-layers holds: indices, -1 = the last (default: all).")]
DumpStatsOpt = Annotated[bool, typer.Option(
    "--dump-stats", help="--dump-layers writes per-tensor statistics (min, max, mean, std, NaN/Inf counts, "
                         "sha256) as .json instead of the data, for models too big to dump whole.")]
TimingsOpt = Annotated[bool, typer.Option("--timings", help="Report load, prefill and per-token times.")]
MaxContextOpt = Annotated[Optional[int], typer.Option(
    "--max-context", metavar="N", help="KV cache positions (default: just what the job needs).")]
TpOpt = Annotated[Optional[int], typer.Option(
    "--tp", metavar="N",
    help="Tensor parallelism: the model sharded over N ranks, one process each (Megatron style). --device cuda: "
         "N GPUs of this host over NCCL; --device cpu: N NumPy engine processes summing through shared memory "
         "(checks the sharding; not faster). --tp 1 runs the same sharded path on one rank.")]
DraftModelOpt = Annotated[Optional[str], typer.Option(
    "--draft-model", metavar="PATH",
    help="A smaller checkpoint with the same tokenizer that drafts tokens (a path or an embedded name, "
         "e.g. default-draft).")]


@dataclass
class Common:
    """The options every pass command takes, as given."""

    model: str | None
    prompt: str | None
    tokens: str | None
    device: str
    logits_dtype: str
    fmt: str | None
    dump_logits: str | None
    hidden: bool
    dump_hidden: str | None
    timings: bool
    max_context: int | None
    chat: bool = False
    system: str | None = None
    no_special_tokens: bool = False
    layers: "LayerOptions | None" = None
    tp: int | None = None  # --tp N: ranks of tensor parallelism (None: the plain one-process engine)

    @property
    def prompt_format(self) -> PromptFormat:
        return PromptFormat(self.chat, self.system, not self.no_special_tokens)


@dataclass
class LayerOptions:
    """--dump-layers PATH, --layers I,J,... and --dump-stats, as given."""

    path: str | None
    select: str | None
    stats: bool

    @property
    def wanted(self) -> bool:
        return self.path is not None


@dataclass
class Job:
    """Common options checked and resolved, before any weight is loaded."""

    state: State
    common: Common
    fmt: str
    fp32: bool
    device: str
    spec: ModelSpec
    ids: list[int]
    prompt_text: str | None
    logits_dump: DumpTarget | None
    hidden_dump: DumpTarget | None
    layers_dump: DumpTarget | None = None

    @property
    def report_console(self) -> Console:
        # Logits going to stdout push the report to stderr so the two never mix.
        return self.state.err if self.logits_dump is not None and self.logits_dump.to_stdout else self.state.out

    @property
    def want_hidden(self) -> bool:
        return self.common.hidden or self.hidden_dump is not None

    def meta(self, command: str, model: LoadedModel, **extra: Any) -> render.Meta:
        return render.Meta(command, self.spec.label, model.device, "fp32" if self.fp32 else "bf16", self.fmt,
                           prompt=self.prompt_text, has_tokenizer=model.tokenizer is not None,
                           timings=self.common.timings, **extra)


def prepare(state: State, c: Common) -> Job:
    """Every check that needs no weights: options, dump paths, device, config, token ids."""
    if c.prompt is not None and c.tokens is not None:
        raise UsageError("--prompt and --tokens are exclusive: give one of them")
    check_prompt_format(c.prompt, c.tokens, c.prompt_format)
    fmt = render.choose_format(c.fmt, state.out)
    if c.logits_dtype not in ("bf16", "fp32"):
        raise UsageError(f"--logits-dtype must be bf16 or fp32, got {c.logits_dtype!r}")
    logits_dump = check_dump_path(c.dump_logits, "--dump-logits") if c.dump_logits is not None else None
    hidden_dump = (check_dump_path(c.dump_hidden, "--dump-hidden", HIDDEN_KINDS, stdout_ok=False)
                   if c.dump_hidden is not None else None)
    if logits_dump and hidden_dump and logits_dump.path is not None and \
            os.path.abspath(logits_dump.path) == os.path.abspath(hidden_dump.path):
        raise UsageError(f"--dump-logits and --dump-hidden name the same file {c.dump_logits}")
    if c.max_context is not None:
        check_positive(c.max_context, "--max-context")
    layers_dump = _check_layer_options(c.layers)
    device = resolve_device(c.device)
    spec = read_model_spec(c.model)
    if c.tp is not None:
        check_tensor_parallel(c.tp, device, spec.config)
    if c.layers is not None and c.layers.select is not None:
        from .layer_dumps import parse_layers

        parse_layers(c.layers.select, spec.config.num_hidden_layers)  # a bad index fails before any load
    ids, text = resolve_prompt(spec, c.prompt, c.tokens, lambda: typer.get_text_stream("stdin").read(),
                               c.prompt_format)
    return Job(state, c, fmt, c.logits_dtype == "fp32", device, spec, ids, text, logits_dump, hidden_dump,
               layers_dump)


def check_tensor_parallel(tp: int, device: str, cfg: Any) -> None:
    """--tp N: a degree the model splits into, and the devices for it (before any process starts)."""
    from .parallel.launcher import check_devices
    from .parallel.sharding import check_tp

    check_positive(tp, "--tp")
    check_tp(cfg.definition, tp)
    check_devices(device, tp)


def _check_layer_options(opts: LayerOptions | None) -> DumpTarget | None:
    if opts is None or not opts.wanted:
        if opts is not None and (opts.select is not None or opts.stats):
            raise UsageError(f"{'--layers' if opts.select is not None else '--dump-stats'} needs --dump-layers PATH")
        return None
    from .layer_dumps import check_layer_dump_path  # numpy: only for a command that dumps layers

    return check_layer_dump_path(opts.path, stats=opts.stats)


def record_layers(job: Job, model: LoadedModel) -> "LayerRecorder | None":
    """With --dump-layers, every pass of `model` from now on is recorded (the taps run beside the passes)."""
    if job.layers_dump is None:
        return None
    from .engine.observe import LayerRecorder
    from .layer_dumps import parse_layers

    chosen = set(parse_layers(job.common.layers.select, model.config.num_hidden_layers))
    recorder = LayerRecorder(model.engine, lambda name: _tap_layer(name) in chosen | {None}, sorted(chosen))
    model.engine.tap = recorder
    return recorder


def _tap_layer(name: str) -> int | None:
    """model.layers.{i}[.sub] -> i; None (always kept) for the embedding and the final norm."""
    parts = name.split(".")
    return int(parts[2]) if len(parts) > 2 and parts[1] == "layers" else None


def load(job: Job, spec: ModelSpec, ctx: int, tp: int | None = None) -> LoadedModel:
    with render.load_progress(job.state.err, spec.label) as progress:
        return open_model(spec.path, device=job.device, max_context=ctx, fp32_logits=job.fp32,
                          progress=progress, tp=tp)


def write_dumps(job: Job, command: str, rows, hidden_rows, tokens: list[int], positions: list[int],
                recorder: "LayerRecorder | None" = None) -> None:
    """The logits rows and the hidden rows behind them, with the same tokens and positions; and the layers
    of every row the command processed (their own positions: prompt rows too, and redone drafts)."""
    info = DumpInfo(command, job.spec.label, tokens, positions)
    if job.logits_dump is not None:
        write_logits(job.logits_dump, rows, info, typer.get_binary_stream("stdout"))
    if job.hidden_dump is not None:
        write_hidden(job.hidden_dump, hidden_rows, info)
    if recorder is not None:
        from .layer_dumps import LayerDumpInfo, write_layers

        write_layers(job.layers_dump, recorder.tensors(), recorder.positions,
                     LayerDumpInfo(command, job.spec.label, tokens, recorder.layers))


@contextlib.contextmanager
def ctrl_c_stops() -> Iterator[Callable[[], bool]]:
    """While decoding, the first Ctrl-C asks the decoding loop to stop after the current step (the tokens
    so far are then reported, marked interrupted, and metrale exits 130); a second one interrupts at once.
    Yields the should_stop() that the loop polls."""
    if threading.current_thread() is not threading.main_thread():  # signals reach the main thread only
        yield lambda: False
        return
    asked: list[int] = []
    previous = signal.getsignal(signal.SIGINT) or signal.default_int_handler  # None: not set from Python

    def first_ctrl_c(signum: int, frame: Any) -> None:
        asked.append(signum)
        signal.signal(signal.SIGINT, previous)  # the next Ctrl-C is KeyboardInterrupt again

    signal.signal(signal.SIGINT, first_ctrl_c)
    try:
        yield lambda: bool(asked)
    finally:
        signal.signal(signal.SIGINT, previous)


@contextlib.contextmanager
def dumps_on_nonfinite(job: Job, command: str, engine: Any,
                       recorder: "LayerRecorder | None" = None) -> Iterator[None]:
    """When the run inside meets NaN/Inf, the requested dumps of the rows it produced (the failing ones
    included, and the layers of every pass so far) are written first, as they are the evidence; then it
    fails (exit 6), naming where the values first appear (a rerun of the tokens with every tap on)."""
    from .decoding.results import NonFiniteRun
    from .decoding.rows import describe_nonfinite

    try:
        yield
    except NonFiniteRun as e:
        ev = e.evidence
        write_dumps(job, command, ev.rows, ev.hidden, ev.tokens, ev.positions, recorder)
        parts = [str(e)]
        where = describe_nonfinite(engine, ev.tokens)
        if where:
            parts.append(where)
        written = []
        if ev.rows is not None:
            n = len(ev.rows.data)
            written.append(f"{job.common.dump_logits} ({n} row{'s' if n != 1 else ''})")
        if ev.hidden is not None and job.common.dump_hidden is not None:
            written.append(job.common.dump_hidden)
        if recorder is not None:
            written.append(job.common.layers.path)
        if written:
            parts.append("written anyway: " + ", ".join(written))
        raise NonFiniteLogitsError("; ".join(parts), row=e.row, position=e.position) from None


def _token_text(model: LoadedModel):
    return model.tokenizer.token_text if model.tokenizer is not None else None


# -- decode -------------------------------------------------------------------------------------------------------


@app.command(cls=MetraleCommand)
def decode(
    ctx: typer.Context,
    model: ModelOpt = None,
    prompt: PromptOpt = None,
    tokens: TokensOpt = None,
    chat: ChatOpt = False,
    system: SystemOpt = None,
    no_special_tokens: NoSpecialTokensOpt = False,
    steps: Annotated[int, typer.Option("--steps", "-n", metavar="N", help="Tokens to produce.")] = 16,
    # No short form: "-k" would read like --k (the draft count) and silently mean something else.
    top_k: Annotated[Optional[int], typer.Option(
        "--top-k", metavar="K",
        help="Also show the K best tokens per step (K >= 1; more than the vocabulary shows all of it).")] = None,
    ignore_eos: Annotated[bool, typer.Option("--ignore-eos", help="Do not stop at an EOS token.")] = False,
    draft: Annotated[Optional[str], typer.Option(
        "--draft", metavar="ngram", help="Speculative decoding with prompt-lookup (n-gram) drafts.")] = None,
    draft_model: DraftModelOpt = None,
    k: Annotated[Optional[int], typer.Option(
        "--k", metavar="K", help=f"Drafts per verify pass (default {DEFAULT_K}).")] = None,
    device: DeviceOpt = "auto",
    logits_dtype: LogitsDtypeOpt = "bf16",
    fmt: FormatOpt = None,
    dump_logits: DumpLogitsOpt = None,
    hidden: HiddenOpt = False,
    dump_hidden: DumpHiddenOpt = None,
    dump_layers: DumpLayersOpt = None,
    layers: LayersOpt = None,
    dump_stats: DumpStatsOpt = False,
    timings: TimingsOpt = False,
    max_context: MaxContextOpt = None,
    tp: TpOpt = None,
) -> None:
    """Greedy decoding: prefill the prompt, then --steps decode steps, one line per produced token.

    Each step shows the position, token id, token text and its logit; --top-k K adds the K best tokens
    with their logits and probabilities. Decoding stops at an EOS token unless --ignore-eos.

    --draft ngram (prompt lookup) or --draft-model PATH decodes speculatively, --k drafts per verify pass:
    the tokens are those of plain greedy decoding, and the report adds the drafted and accepted counts.
    With --timings a speculative run also times plain greedy decoding of the same prompt.

    Examples:
      metrale decode --prompt "The for statement" --steps 8 --top-k 3
      metrale decode --tokens "[1, 2, 3]" --model default --format json
      metrale decode --draft-model default-draft --k 4 --timings
      metrale decode --draft ngram --k 4 --steps 32 --ignore-eos
    """
    c = Common(model, prompt, tokens, device, logits_dtype, fmt, dump_logits, hidden, dump_hidden, timings,
               max_context, chat, system, no_special_tokens, LayerOptions(dump_layers, layers, dump_stats), tp)
    if draft is not None and draft != "ngram":
        raise UsageError(f"decode --draft takes 'ngram', got {draft!r} (a draft model is --draft-model PATH)")
    if draft is not None and draft_model is not None:
        raise UsageError("--draft ngram and --draft-model are exclusive: give one draft source")
    speculative = draft is not None or draft_model is not None
    if k is not None and not speculative:
        raise UsageError(f"--k {k} needs a draft source: --draft ngram or --draft-model PATH")
    job = prepare(ctx.obj, c)
    check_positive(steps, "--steps")
    if top_k is not None:
        check_positive(top_k, "--top-k", " (leave --top-k out for no candidates)")
        top_k = _cap_top_k(ctx.obj, top_k, job.spec.config.vocab_size)
    k = DEFAULT_K if k is None else k
    if speculative:
        check_positive(k, "--k")
    _decode(job, steps, top_k or 0, ignore_eos, speculative, draft_model, k)


def _cap_top_k(state: State, top_k: int, vocab: int) -> int:
    """A K beyond the vocabulary means "every token": cap it, and say so (the report shows the capped K)."""
    if top_k <= vocab:
        return top_k
    render.note(state.err, f"--top-k {top_k} is more than the vocabulary: showing all {vocab} tokens")
    return vocab


def _decode(job: Job, steps: int, top_k: int, ignore_eos: bool, speculative: bool, draft_path: str | None,
            k: int) -> None:
    from .decoding.decode import run_decode
    from .decoding.rows import TextStream
    from .decoding.speculative import ModelDrafter, NgramDrafter

    n = len(job.ids)
    what = f"prompt ({n} tokens) + --steps {steps}"
    ctx = context_for(job.spec, n + steps, what, job.common.max_context, n + steps + (k if speculative else 0))
    draft_spec = read_model_spec(draft_path) if draft_path is not None else None
    if draft_spec is not None:
        check_draft_matches(job.spec, draft_spec)
        ctx = min(ctx, context_for(draft_spec, n + steps, f"for the draft model, {what}", None, ctx))
    if speculative and job.layers_dump is not None:
        raise UsageError("--dump-layers records plain decoding: a speculative run's rejected drafts would mix "
                         "into the rows (dump one verify pass with `metrale verify --dump-layers` instead)")
    target = load(job, job.spec, ctx, job.common.tp)
    recorder = record_layers(job, target)
    drafter_model = report = None
    try:
        drafter_model = load(job, draft_spec, ctx) if draft_spec is not None else None
        meta = job.meta("decode", target, top_k=top_k, draft_model=draft_spec.label if draft_spec else None)
        tok = target.tokenizer
        report = render.DecodeReport(job.report_console, meta,
                                     TextStream(tok.decode, job.ids) if tok is not None else None)
        report.begin(job.ids, steps)
        kwargs = dict(top_k=top_k, eos_ids=target.config.eos_token_ids, ignore_eos=ignore_eos,
                      token_text=_token_text(target), keep_rows=job.logits_dump is not None,
                      want_hidden=job.want_hidden, on_step=report.step,
                      detokenize=tok.decode if tok is not None else None)
        plain_match = None
        with ctrl_c_stops() as stop, dumps_on_nonfinite(job, "decode", target.engine, recorder):
            kwargs["should_stop"] = stop
            if speculative:
                drafter = ModelDrafter(drafter_model.engine) if drafter_model is not None else NgramDrafter()
                result, plain_match = _speculative(job, target, drafter, steps, k, kwargs)
            else:
                result = run_decode(target.engine, job.ids, steps, **kwargs)
        result.timings.load_s = target.load_seconds + (drafter_model.load_seconds if drafter_model else 0.0)
        if not result.interrupted:  # an interrupted run writes no dump: the rows would be a partial run
            fed = job.ids + [s.token for s in result.steps[:-1]]
            write_dumps(job, "decode", result.rows, result.hidden_rows, fed,
                        [s.position - 1 for s in result.steps], recorder)
        report.finish(result, plain_match)
        if result.interrupted:
            raise Interrupted(f"stopped by Ctrl-C after {len(result.steps)} tokens (no dump file is written)")
    finally:
        if report is not None:
            report.close()
        target.close()
        if drafter_model is not None:
            drafter_model.close()


def _speculative(job: Job, target: LoadedModel, drafter, steps: int, k: int,
                 kwargs: dict[str, Any]) -> "tuple[SpecDecodeResult, bool | None]":
    from .decoding.decode import run_decode
    from .decoding.speculative import speculative_decode

    result = speculative_decode(target.engine, drafter, job.ids, steps, k, **kwargs)
    if not job.common.timings or result.interrupted:
        return result, None
    # Plain greedy decoding of the same prompt on the same engine, for the tokens/s comparison. Both rates
    # count the tokens after the first (which the identical prefill produces) over the decode-phase time.
    plain: DecodeResult = run_decode(target.engine, job.ids, steps, eos_ids=kwargs["eos_ids"],
                                     ignore_eos=kwargs["ignore_eos"], should_stop=kwargs["should_stop"])
    if plain.interrupted:  # Ctrl-C during the comparison: the speculative tokens stand, without it
        result.interrupted = True
        return result, None
    result.spec_tokens_per_s = _decode_rate(result)
    result.plain_tokens_per_s = _decode_rate(plain)
    return result, [s.token for s in plain.steps] == [s.token for s in result.steps]


def _decode_rate(result: "DecodeResult") -> float | None:
    seconds = sum(result.timings.step_s)
    return (len(result.steps) - 1) / seconds if seconds > 0 and len(result.steps) > 1 else None


# -- verify --------------------------------------------------------------------------------------------------------


@app.command(cls=MetraleCommand)
def verify(
    ctx: typer.Context,
    model: ModelOpt = None,
    prompt: PromptOpt = None,
    tokens: TokensOpt = None,
    chat: ChatOpt = False,
    system: SystemOpt = None,
    no_special_tokens: NoSpecialTokensOpt = False,
    k: Annotated[Optional[int], typer.Option(
        "--k", metavar="K",
        help=f"Drafts checked in the one verify pass (default {DEFAULT_K}, or the --draft ids' count).",
    )] = None,
    draft: Annotated[Optional[str], typer.Option(
        "--draft", metavar="self|IDS",
        help="'self' (the model's own greedy tokens, default) or exactly K token ids.")] = None,
    draft_model: DraftModelOpt = None,
    device: DeviceOpt = "auto",
    logits_dtype: LogitsDtypeOpt = "bf16",
    fmt: FormatOpt = None,
    dump_logits: DumpLogitsOpt = None,
    hidden: HiddenOpt = False,
    dump_hidden: DumpHiddenOpt = None,
    dump_layers: DumpLayersOpt = None,
    layers: LayersOpt = None,
    dump_stats: DumpStatsOpt = False,
    timings: TimingsOpt = False,
    max_context: MaxContextOpt = None,
    tp: TpOpt = None,
) -> None:
    """One verify pass: prefill the prompt, then check K draft tokens in a single forward.

    Per position: the draft token, the target's greedy token, accepted or not, and the top1-top2 margin.
    Acceptance stops at the first mismatch; then the accepted count and the next token.

    Drafts: --draft self (the default) drafts by K sequential decode steps of the same model, and
    max_abs_diff_vs_sequential compares each verify row with the matching decode row; --draft "IDS" checks
    exactly K given token ids; --draft-model PATH drafts with a smaller model. Rows after the first
    rejection are not checked.

    Expected for --draft self: a rounding difference of a step or a few of the logits dtype
    (max_abs_diff_ulps_vs_sequential; 1 bf16 step on the CPU engine, and one bf16 step is 0.0625 for logits
    from 8 to 16), since one pass over K rows sums in another order than K one-row steps;
    rows_identical_vs_sequential counts the bit-identical rows.

    Examples:
      metrale verify --prompt "The for statement" --k 4
      metrale verify --tokens "1 2 3" --draft "17 42 7" --model default
      metrale verify --draft-model default-draft --k 4 --format json
    """
    c = Common(model, prompt, tokens, device, logits_dtype, fmt, dump_logits, hidden, dump_hidden, timings,
               max_context, chat, system, no_special_tokens, LayerOptions(dump_layers, layers, dump_stats), tp)
    if draft is not None and draft_model is not None:
        raise UsageError("--draft and --draft-model are exclusive: give one draft source")
    job = prepare(ctx.obj, c)
    draft_ids = None
    if draft is not None and draft.strip() != "self":
        draft_ids = _parse_draft_ids(draft)
        if k is None:
            k = len(draft_ids)
    k = DEFAULT_K if k is None else k
    check_positive(k, "--k")
    if draft_ids is not None:
        if len(draft_ids) != k:  # two options that disagree: a usage error, whatever the model
            raise UsageError(f"--draft gives {len(draft_ids)} token ids ({draft.strip()!r}) but --k is {k}")
        check_ids_in_vocab(draft_ids, job.spec.config.vocab_size, "--draft")
    _verify(job, k, draft_ids, draft_model)


def _parse_draft_ids(draft: str) -> list[int]:
    try:
        return parse_token_ids(draft, "--draft")
    except UsageError as e:
        raise UsageError(f"{e}; verify --draft takes 'self' or K token ids") from None


def _verify(job: Job, k: int, draft_ids: list[int] | None, draft_path: str | None) -> None:
    from .decoding.verify import run_verify

    n = len(job.ids)
    what = f"prompt ({n} tokens) + --k {k}"
    ctx = context_for(job.spec, n + k, what, job.common.max_context)
    draft_spec = read_model_spec(draft_path) if draft_path is not None else None
    if draft_spec is not None:
        check_draft_matches(job.spec, draft_spec)
        context_for(draft_spec, n + k, f"for the draft model, {what}", None)
    target = load(job, job.spec, ctx, job.common.tp)
    recorder = record_layers(job, target)
    drafter_model = None
    try:
        drafter_model = load(job, draft_spec, n + k) if draft_spec is not None else None
        source: Any = draft_ids if draft_ids is not None else ("model" if drafter_model else "self")
        with dumps_on_nonfinite(job, "verify", target.engine, recorder):
            result = run_verify(target.engine, job.ids, k, draft=source,
                                draft_engine=drafter_model.engine if drafter_model else None,
                                token_text=_token_text(target), keep_rows=job.logits_dump is not None,
                                want_hidden=job.want_hidden)
        result.timings.load_s = target.load_seconds + (drafter_model.load_seconds if drafter_model else 0.0)
        drafts = [row.draft for row in result.rows]
        write_dumps(job, "verify", result.logit_rows, result.hidden_rows, job.ids + drafts,
                    list(range(n - 1, n + k)), recorder)
        meta = job.meta("verify", target, draft_model=draft_spec.label if draft_spec else None)
        render.render_verify(job.report_console, meta, result)
    finally:
        target.close()
        if drafter_model is not None:
            drafter_model.close()


# -- forward --------------------------------------------------------------------------------------------------------


@app.command(cls=MetraleCommand)
def forward(
    ctx: typer.Context,
    model: ModelOpt = None,
    prompt: PromptOpt = None,
    tokens: TokensOpt = None,
    chat: ChatOpt = False,
    system: SystemOpt = None,
    no_special_tokens: NoSpecialTokensOpt = False,
    rows: Annotated[str, typer.Option("--rows", metavar="last|all",
                                      help="Report the last row (default) or every row.")] = "last",
    device: DeviceOpt = "auto",
    logits_dtype: LogitsDtypeOpt = "bf16",
    fmt: FormatOpt = None,
    dump_logits: DumpLogitsOpt = None,
    hidden: HiddenOpt = False,
    dump_hidden: DumpHiddenOpt = None,
    dump_layers: DumpLayersOpt = None,
    layers: LayersOpt = None,
    dump_stats: DumpStatsOpt = False,
    timings: TimingsOpt = False,
    max_context: MaxContextOpt = None,
    tp: TpOpt = None,
) -> None:
    """One forward pass over the prompt: the argmax token and its logit for the last row or every row.

    --dump-logits writes the logits rows themselves (.safetensors, .npy, .bin), to compare with another
    engine bit for bit.

    Examples:
      metrale forward --prompt "The for statement" --rows all
      metrale forward --tokens "1 2 3" --model default --dump-logits rows.npy
      metrale forward --rows all --dump-layers layers.safetensors --layers 0,-1
    """
    c = Common(model, prompt, tokens, device, logits_dtype, fmt, dump_logits, hidden, dump_hidden, timings,
               max_context, chat, system, no_special_tokens, LayerOptions(dump_layers, layers, dump_stats), tp)
    from .decoding.decode import run_forward

    if rows not in ("last", "all"):
        raise UsageError(f"--rows must be last or all, got {rows!r}")
    job = prepare(ctx.obj, c)
    n = len(job.ids)
    model_ctx = context_for(job.spec, n, f"prompt ({n} tokens)", c.max_context)
    target = load(job, job.spec, model_ctx, job.common.tp)
    recorder = record_layers(job, target)
    try:
        with dumps_on_nonfinite(job, "forward", target.engine, recorder):
            result = run_forward(target.engine, job.ids, all_rows=rows == "all", token_text=_token_text(target),
                                 keep_rows=job.logits_dump is not None, want_hidden=job.want_hidden)
        result.timings.load_s = target.load_seconds
        write_dumps(job, "forward", result.logit_rows, result.hidden_rows, job.ids,
                    [row.position for row in result.rows], recorder)
        render.render_forward(job.report_console, job.meta("forward", target), result)
    finally:
        target.close()


# -- inspect -------------------------------------------------------------------------------------------------------


@app.command(cls=MetraleCommand)
def inspect(
    ctx: typer.Context,
    path: Annotated[Optional[str], typer.Argument(
        metavar="PATH", help=f"Checkpoint directory, .safetensors file or index.json, or {EMBEDDED_HELP}. "
                             "Default: default.", show_default=False)] = None,
    fmt: FormatOpt = None,
    scan: Annotated[bool, typer.Option(
        "--scan", help="Also read every tensor and list those holding NaN or Inf (reads the whole checkpoint).")] = False,
) -> None:
    """Describe a checkpoint: architecture, sizes, parameter count, dtypes, shards, rope, tokenizer.

    The tensors are checked against config.json (names, shapes, dtypes).
    An invalid checkpoint is still described; metrale then exits non-zero with the problems on stderr.
    A config.json metrale cannot run (another model_type, hidden_act...) is described from its raw fields and the tensors, then named (exit 4).
    Without --scan no tensor value is read, so NaN/Inf in the weights are not looked for.

    Examples:
      metrale inspect
      metrale inspect default-draft --format json
      metrale inspect default --scan
    """
    state: State = ctx.obj
    fmt_ = render.choose_format(fmt, state.out)
    try:
        spec = read_model_spec(path)
    except ConfigError as unsupported:  # describe what config.json and the tensors say, then fail (exit 4)
        _inspect_without_config(state, fmt_, path, unsupported, scan)
        raise
    ckpt = Checkpoint.open(spec.checkpoint_path)
    try:
        problem: MetraleError | None = None
        try:
            check_checkpoint(spec.config, ckpt)
        except MetraleError as e:
            problem = e
        render.render_inspect(state.out, fmt_, _with_scan(_inspect_info(spec, ckpt, problem), ckpt, scan))
    finally:
        ckpt.close()
    if problem is not None:
        raise problem


def _with_scan(info: dict[str, Any], ckpt: Checkpoint, scan: bool) -> dict[str, Any]:
    """inspect's "scanned" and "nonfinite" keys: with --scan, the tensors holding NaN or Inf."""
    info["nonfinite"] = None
    if scan:
        from .scan import scan_nonfinite

        info["nonfinite"] = [t.to_json() for t in scan_nonfinite(ckpt)]
    info["scanned"] = scan
    return info


def _inspect_without_config(state: State, fmt: str, path: str | None, problem: ConfigError, scan: bool) -> None:
    """A config.json metrale cannot run (model_type gpt_neox, hidden_act gelu...): its raw fields and the
    tensor listing, with the problem named. Prints nothing when config.json is no JSON object or the
    weights cannot be listed (the caller's error then says why)."""
    directory = model_dir(path)
    try:
        raw = json.loads((directory / "config.json").read_text("utf-8"))
        target = model_path(path)
        ckpt = Checkpoint.open(target if target.is_file() else directory)
    except (OSError, ValueError, MetraleError):
        return
    try:
        if isinstance(raw, dict):
            info = _raw_inspect_info("default" if path is None else path, raw, ckpt, problem)
            render.render_inspect(state.out, fmt, _with_scan(info, ckpt, scan))
    finally:
        ckpt.close()


def _raw_inspect_info(label: str, raw: dict[str, Any], ckpt: Checkpoint, problem: ConfigError) -> dict[str, Any]:
    """inspect's keys from config.json as written (None where a field is absent or not a number) and
    the parameter count from the tensor listing."""
    def integer(key: str, fallback: Any = None) -> int | None:
        v = raw.get(key)
        return v if isinstance(v, int) and not isinstance(v, bool) else fallback

    def number(key: str) -> float | None:
        v = raw.get(key)
        return float(v) if isinstance(v, (int, float)) and not isinstance(v, bool) else None

    hidden, heads = integer("hidden_size"), integer("num_attention_heads")
    head_dim = integer("head_dim", hidden // heads if hidden and heads and hidden % heads == 0 else None)
    archs = raw.get("architectures")
    scaling = raw.get("rope_scaling") if isinstance(raw.get("rope_scaling"), dict) else None
    rope_params = raw.get("rope_parameters") if isinstance(raw.get("rope_parameters"), dict) else {}
    eos = raw.get("eos_token_id")
    params = sum(math.prod(ckpt.info(n).shape) for n in ckpt.tensor_names())
    return {
        "command": "inspect", "model": label,
        "architecture": archs[0] if isinstance(archs, list) and archs and isinstance(archs[0], str)
        else raw.get("model_type"),
        "model_type": raw.get("model_type"), "layers": integer("num_hidden_layers"), "heads": heads,
        "kv_heads": integer("num_key_value_heads", heads), "head_dim": head_dim, "hidden": hidden,
        "intermediate": integer("intermediate_size"), "vocab": integer("vocab_size"),
        "max_position_embeddings": integer("max_position_embeddings"), "sliding_window": integer("sliding_window"),
        "parameters": params, "dtype": raw.get("torch_dtype", raw.get("dtype")), "dtypes": ckpt.dtypes(),
        "shards": len(ckpt.files), "files": [p.name for p in ckpt.files], "bytes": ckpt.total_bytes,
        "tied_embeddings": raw.get("tie_word_embeddings") is True,
        "rope": {"theta": raw.get("rope_theta", rope_params.get("rope_theta")),
                 "type": (scaling or rope_params).get("rope_type", (scaling or {}).get("type", "default")),
                 "scaling": scaling, "rotary_fraction": number("partial_rotary_factor")},
        # the block features of models/describe.py: unknown without a definition, but the softcaps as written
        "sliding_layers": None, "sliding_rope": None, "attn_logit_softcapping": number("attn_logit_softcapping"),
        "final_logit_softcapping": number("final_logit_softcapping"), "attention_scale": None, "norm": None,
        "post_norms": None, "activation": raw.get("hidden_activation", raw.get("hidden_act")), "embed_scale": None,
        "tokenizer": ckpt.has_tokenizer, "bos_token_id": integer("bos_token_id"),
        "eos_token_ids": eos if isinstance(eos, list) else [eos] if isinstance(eos, int) else [],
        "experts": None,
        "valid": False, "problems": str(problem),
    }


def _inspect_info(spec: ModelSpec, ckpt: Checkpoint, problem: MetraleError | None) -> dict[str, Any]:
    cfg = spec.config
    try:
        raw = json.loads((spec.directory / "config.json").read_text("utf-8"))
    except (OSError, ValueError):
        raw = {}
    archs = raw.get("architectures")
    from .models.describe import block_features

    return {
        "command": "inspect", "model": spec.label,
        "architecture": archs[0] if isinstance(archs, list) and archs and isinstance(archs[0], str) else cfg.model_type,
        "model_type": cfg.model_type, "layers": cfg.num_hidden_layers, "heads": cfg.num_attention_heads,
        "kv_heads": cfg.num_key_value_heads, "head_dim": cfg.head_dim, "hidden": cfg.hidden_size,
        "intermediate": cfg.intermediate_size, "vocab": cfg.vocab_size,
        "max_position_embeddings": cfg.max_position_embeddings, "sliding_window": cfg.sliding_window,
        "parameters": cfg.parameter_count(), "dtype": cfg.dtype, "dtypes": ckpt.dtypes(),
        "shards": len(ckpt.files), "files": [p.name for p in ckpt.files], "bytes": ckpt.total_bytes,
        "tied_embeddings": cfg.tie_word_embeddings,
        **block_features(cfg),  # rope, sliding layers, softcaps, norms, activation, embedding scale
        "tokenizer": ckpt.has_tokenizer, "bos_token_id": cfg.bos_token_id, "eos_token_ids": list(cfg.eos_token_ids),
        "experts": _experts_info(cfg),
        "valid": problem is None, "problems": str(problem) if problem is not None else None,
        "scanned": False, "nonfinite": None,  # --scan: the tensors holding NaN/Inf (name, dtype, nan, inf)
    }


def _experts_info(cfg: Any) -> dict[str, Any] | None:
    """The sparse block of a mixture of experts (None for a dense model)."""
    if cfg.moe is None:
        return None
    s = cfg.moe.spec
    per_expert = 3 * s.intermediate_size * cfg.hidden_size
    return {"count": s.num_experts, "top_k": s.top_k, "intermediate": s.intermediate_size,
            "norm_topk_prob": s.norm_topk_prob, "shared_expert_intermediate": s.shared_expert_size,
            "sparse_layers": list(cfg.moe.sparse_layers),
            "active_parameters": cfg.parameter_count() - len(cfg.moe.sparse_layers) * (s.num_experts - s.top_k) * per_expert}


# -- bench ---------------------------------------------------------------------------------------------------------


@app.command(cls=MetraleCommand)
def bench(
    ctx: typer.Context,
    preset: Annotated[Optional[str], typer.Option(
        "--preset", metavar="NAME|PATH", help="A preset in configs/ (llama-3.1-8b, llama-3.2-1b, qwen3-8b, mistral-7b, "
                         "gemma-2-9b, gemma-3-12b, phi-3-mini, phi-4-mini, qwen3-30b-a3b, mixtral-8x7b, tiny-llama) "
                         "or a config.json path. Default: llama-3.1-8b on cuda, tiny-llama on cpu.",
        show_default=False)] = None,
    device: DeviceOpt = "auto",
    context: Annotated[int, typer.Option("--context", metavar="N",
                                         help="KV cache positions each decode/verify step attends over.")] = 1024,
    ks: Annotated[str, typer.Option("--ks", metavar="K,K,...", help="Verify sizes to time, comma separated.")] = "1,2,4,8",
    prefill: Annotated[int, typer.Option("--prefill", metavar="N", help="Prompt length of the prefill measurement.")] = 2048,
    repeats: Annotated[int, typer.Option("--repeats", metavar="N",
                                         help="Timed runs per figure (the median is reported).")] = 50,
    # One flag, not --transformers/--no-transformers: timing transformers is the default, and the pair's
    # second column squeezed the help text to ~20 characters.
    no_transformers: Annotated[bool, typer.Option(
        "--no-transformers", help="Do not time transformers eager on the same weights (timed by default on cuda, "
                                  "when transformers is installed).")] = False,
    json_path: Annotated[Optional[str], typer.Option("--json", metavar="PATH",
                                                     help="Also write the results as JSON (atomically).")] = None,
    paths: Annotated[Optional[str], typer.Option(
        "--path", metavar="NAME,NAME,...",
        help="CUDA rows-path variants to time side by side in this run: fused (the default: rows with rope + KV "
             "append inside the attention kernel), rows (the ring GEMV with PDL; what --tp ranks run), fused-cluster "
             "(fused, the attention's combine in a thread-block cluster: one launch), rows-stream (the default until "
             "2026-12-04), rows-fma (the projections of before the streaming GEMV). The figures above the table are "
             "taken on the first.",
        show_default=False)] = None,
    fmt: FormatOpt = None,
    tp: TpOpt = None,
) -> None:
    """Measure decode, verify and prefill speed against the hardware's own limits, in one run.

    Random weights from a preset (drawn on the GPU for cuda, so no checkpoint file is needed). The same
    run measures the read bandwidth, the decode floor (bytes a step must read / bandwidth) and the GEMM
    rate, then decode ms/token, verify ms per k, prefill tokens/s and, when transformers is installed,
    transformers eager on the same weights. Each figure is printed with its ratio to its target.

    Examples:
      metrale bench --device cpu --preset tiny-llama --context 256 --prefill 256
      metrale bench --device cuda --context 8192 --json bench-8k.json
      metrale bench --device cuda --path rows,rows-stream,fused --no-transformers
    """
    from . import bench as bench_mod

    state: State = ctx.obj
    fmt_ = render.choose_format(fmt, state.out)
    target = check_dump_path(json_path, "--json", kinds=("json",), stdout_ok=False) if json_path else None
    try:
        k_list = tuple(int(k) for k in ks.replace(",", " ").split())
    except ValueError:
        raise UsageError(f"--ks must be integers separated by commas, got '{ks}'") from None
    for name, value in (("--context", context), ("--prefill", prefill), ("--repeats", repeats)):
        check_positive(value, name)
    if any(k < 1 for k in k_list):
        raise UsageError(f"--ks values must be at least 1, got '{ks}'")
    path_list = tuple(p for p in (paths or "").replace(",", " ").split())
    if paths is not None and not path_list:
        raise UsageError("--path needs at least one name (rows, fused, fused-cluster, rows-stream, rows-fma)")
    chosen = resolve_device(device)
    path_list = bench_mod.check_paths(path_list, chosen)
    name = preset or ("llama-3.1-8b" if chosen == "cuda" else "tiny-llama")
    if tp is not None:
        from .config import load_config

        check_tensor_parallel(tp, chosen, load_config(bench_mod.preset_path(name)))
    result = bench_mod.run_bench(name, device=chosen, context=context, ks=k_list, prefill_tokens=prefill,
                                 repeats=repeats, with_transformers=not no_transformers,
                                 progress=lambda m: render.note(state.err, m), tp=tp, paths=path_list)
    render.render_bench(state.out, fmt_, result)
    if target is not None:
        commit([(target.path, [json.dumps(result.to_json(), indent=2).encode() + b"\n"])])


# -- entry point -----------------------------------------------------------------------------------------------------


def main(argv: Sequence[str] | None = None) -> None:
    """The `metrale` console script: run the app and exit with its code."""
    for stream in (sys.stdout, sys.stderr):
        try:  # a token text the terminal cannot encode must not crash the report
            stream.reconfigure(errors="backslashreplace")  # type: ignore[union-attr]
        except (AttributeError, ValueError):
            pass
    typer.main.get_command(app).main(args=argv, prog_name="metrale")


# -- compare and score (issue 15) ----------------------------------------------------------------------------------


@app.command(cls=MetraleCommand)
def compare(
    ctx: typer.Context,
    a: Annotated[Optional[str], typer.Argument(metavar="A", help="The reference: a logits dump or a layer dump.",
                                               show_default=False)] = None,
    b: Annotated[Optional[str], typer.Argument(metavar="B", help="The dump compared with A, of the same kind.",
                                               show_default=False)] = None,
    tensor: Annotated[Optional[str], typer.Option(
        "--tensor", metavar="NAME", help="Read this tensor of a .safetensors/.npz input as the logits rows.")] = None,
    tensor_b: Annotated[Optional[str], typer.Option(
        "--tensor-b", metavar="NAME", help="B's tensor name, when it differs from --tensor.")] = None,
    vocab: Annotated[Optional[int], typer.Option(
        "--vocab", metavar="N", help="Row width of a raw .bin without a sidecar.")] = None,
    dtype: Annotated[Optional[str], typer.Option(
        "--dtype", metavar="f32|bf16|f16", help="Dtype of a raw .bin, or of uint16 .npy/U16 data.")] = None,
    rows: Annotated[bool, typer.Option("--rows", help="Also list the statistics of every row.")] = False,
    max_kl: Annotated[Optional[float], typer.Option(
        "--max-kl", metavar="X", help="Check: every row's KL(P_A || P_B) <= X.")] = None,
    max_rel_err: Annotated[Optional[float], typer.Option(
        "--max-rel-err", metavar="X", help="Check: every row's max|A-B| / max|A| <= X.")] = None,
    min_top1: Annotated[Optional[float], typer.Option(
        "--min-top1", metavar="X", help="Check: the fraction of rows whose argmax agrees >= X.")] = None,
    rtol: Annotated[Optional[float], typer.Option(
        "--rtol", metavar="X", help="Layer dumps: the first tensor with max|A-B| / max|A| > X is the first "
                                    "divergence; exit 9 if there is one (default report threshold 1e-3).")] = None,
    reference: Annotated[Optional[str], typer.Option(
        "--reference", metavar="transformers", help="Instead of A and B: run transformers and metrale on --model "
                                                    "and compare them (needs the `reference` extra).")] = None,
    model: ModelOpt = None,
    prompt: PromptOpt = None,
    tokens: TokensOpt = None,
    steps: Annotated[Optional[int], typer.Option(
        "--steps", "-n", metavar="N", help="With --reference: greedy tokens compared after the prompt (default 8).")] = None,
    layers: Annotated[Optional[str], typer.Option(
        "--layers", metavar="I,J,...|all", help="With --reference: also compare these layers' taps.")] = None,
    device: Annotated[Optional[str], typer.Option(
        "--device", metavar="cpu|cuda", help="With --reference: where metrale runs (default cpu).")] = None,
    logits_dtype: Annotated[Optional[str], typer.Option(
        "--logits-dtype", metavar="fp32|bf16", help="With --reference: both sides' dtype (default fp32).")] = None,
    fmt: FormatOpt = None,
) -> None:
    """Compare two logits dumps or two layer dumps; A is the reference.

    Logits: max|A-B|, max|A-B|/max|A|, NMSE, cosine, rel_diff, argmax agreement, top-5/10 overlap,
    every row whose argmax differs (both candidates, A's margin), KL(P_A || P_B) and Δp statistics as
    llama-perplexity --kl-divergence reports them.
    Inputs: metrale's dumps (.safetensors, .npy, .bin with their sidecars), a plain .npy [rows, vocab]
    (float32, float16, or bf16 bit patterns with --dtype bf16), a .safetensors tensor (--tensor NAME),
    raw .bin (--vocab N --dtype f32|bf16|f16).
    Layer dumps (.safetensors/.npz from --dump-layers): the same error statistics per tensor in forward
    order, and the first tensor that diverges.
    With --max-kl, --max-rel-err, --min-top1 or --rtol it is a check: exit 9 when exceeded.

    --reference transformers --model DIR checks metrale itself: transformers (pip install
    'metrale[reference]') decodes --steps N greedy tokens after the prompt; both then run prompt + those
    tokens teacher-forced (one forward, so an early difference does not cascade), and the prompt's last row
    and the N step rows are compared as above (A = transformers, B = metrale), with each row's argmax and
    whether metrale's greedy tokens are transformers'. --layers also compares those layers' taps with
    transformers' hidden_states and module outputs, naming the first diverging one. fp32 on both sides by
    default; --logits-dtype bf16 runs both in bf16 (with --device cuda: metrale's GPU engine).
    transformers always runs on the CPU. It is a check by default (exit 9 beyond it): fp32 rel err 1e-3,
    KL 1e-4, every argmax agrees, layers --rtol 1e-3; bf16 5e-2, 1e-2, 0.9, 5e-2; the options override.

    Examples:
      metrale compare ref.safetensors mine.npy --dtype bf16
      metrale compare ref.npy mine.bin --vocab 128256 --dtype bf16 --max-kl 1e-3
      metrale compare ref-layers.safetensors mine-layers.safetensors --rtol 1e-3
      metrale compare --reference transformers --prompt "The for" --steps 4
      metrale compare --reference transformers --tokens "1 2 3" --layers 0,-1
    """
    from .compare import Tolerances, failure_message, run_compare
    from .compare_inputs import ReadOptions
    from .errors import DivergenceError

    state: State = ctx.obj
    fmt_ = render.choose_format(fmt, state.out)
    given = {"--model": model, "--prompt": prompt, "--tokens": tokens, "--steps": steps, "--layers": layers,
             "--device": device, "--logits-dtype": logits_dtype}
    if reference is not None:
        if a is not None or b is not None:
            raise UsageError("--reference runs the comparison itself: give --model, not files A and B")
        return _reference_check(ctx, reference, Common(model, prompt, tokens, device or "cpu", logits_dtype or "fp32",
                                                       fmt, None, False, None, False, None),
                                steps, layers, Tolerances(max_kl, max_rel_err, min_top1, rtol))
    extra = [name for name, value in given.items() if value is not None]
    if extra:
        raise UsageError(f"{', '.join(extra)} go with --reference transformers (comparing two files needs none)")
    if a is None or b is None:
        raise UsageError("compare needs two files: metrale compare A B (A is the reference)")
    result = run_compare(a, b, ReadOptions(tensor, tensor_b, vocab, dtype),
                         Tolerances(max_kl, max_rel_err, min_top1, rtol), keep_rows=rows)
    render.render_compare(state.out, fmt_, result)
    if result.passed is False:
        raise DivergenceError(failure_message(result))


def _reference_check(ctx: typer.Context, reference: str, c: Common, steps: int | None, layers: str | None,
                     tol: Any) -> None:
    """compare --reference: check the options, load metrale's engine, run the check, render, exit 9 if it failed."""
    from .errors import DivergenceError
    from .layer_dumps import parse_layers
    from .reference_check import DEFAULT_STEPS, REFERENCES, check_reference, divergence_message, import_reference

    if reference not in REFERENCES:
        raise UsageError(f"--reference takes {', '.join(REFERENCES)}, got {reference!r}")
    steps = DEFAULT_STEPS if steps is None else steps
    check_positive(steps, "--steps")
    tol.check()
    import_reference()  # a missing extra fails before anything is loaded
    job = prepare(ctx.obj, c)
    chosen = parse_layers(layers, job.spec.config.num_hidden_layers) if layers is not None else None
    n = len(job.ids)
    kv = context_for(job.spec, n + steps, f"prompt ({n} tokens) + --steps {steps}", None)
    target = load(job, job.spec, kv)
    try:
        result = check_reference(target.engine, target.config, directory=job.spec.directory, model=job.spec.label,
                                 device=target.device, dtype=c.logits_dtype, prompt=job.ids, steps=steps,
                                 layers=chosen, tolerances=tol, reference=reference)
    finally:
        target.close()
    render.render_reference_check(ctx.obj.out, job.fmt, result)
    if not result.passed:
        raise DivergenceError(divergence_message(result))


@app.command(cls=MetraleCommand)
def score(
    ctx: typer.Context,
    model: ModelOpt = None,
    prompt: PromptOpt = None,
    tokens: TokensOpt = None,
    text_file: Annotated[Optional[str], typer.Option(
        "--text-file", metavar="F", help="Score the text of file F (UTF-8; '-' reads stdin).")] = None,
    top_k: Annotated[int, typer.Option("--top-k", "-k", metavar="K", help="Alternatives shown per token.")] = 3,
    chunk: Annotated[Optional[int], typer.Option(
        "--chunk", metavar="N", help="Tokens per window (default: the whole text, at most the context).")] = None,
    stride: Annotated[Optional[int], typer.Option(
        "--stride", metavar="S", help="Windows start every S tokens (default N - 1: each token scored once).")] = None,
    device: DeviceOpt = "auto",
    logits_dtype: Annotated[str, typer.Option(
        "--logits-dtype", metavar="bf16|fp32", help="Dtype of the logits rows scored (fp32: exact).")] = "fp32",
    fmt: FormatOpt = None,
    timings: TimingsOpt = False,
    max_context: MaxContextOpt = None,
) -> None:
    """Teacher-forced scoring: the log-probability and rank of every actual next token of a text.

    Each token after the first is scored from the row of the position before it (log-softmax in float64,
    fp32 logits); then the total log-likelihood, the mean NLL and the perplexity, which for a text within
    one window equals transformers' exp(model(ids, labels=ids).loss).
    Longer texts: windows of --chunk N tokens every --stride S tokens, each a fresh forward; a window
    scores only the tokens no earlier one scored, so each of them sees at least N - S tokens of context.

    Examples:
      metrale score --prompt "The for statement iterates over a sequence"
      metrale score --text-file notes.txt --chunk 512 --stride 256 --format json
      metrale score --tokens "1 2 3 4 5" --model path/to/checkpoint --top-k 5
    """
    from .scoring import choose_chunk, read_text_file, run_score

    if text_file is not None and (prompt is not None or tokens is not None):
        raise UsageError("--text-file, --prompt and --tokens are exclusive: give one of them")
    if top_k < 0:
        raise UsageError(f"--top-k must be 0 or more, got {top_k}")
    if text_file is not None:
        prompt = read_text_file(text_file, lambda: typer.get_text_stream("stdin").read())
    c = Common(model, prompt, tokens, device, logits_dtype, fmt, None, False, None, timings, max_context)
    job = prepare(ctx.obj, c)
    n_chunk, n_stride, kv = choose_chunk(job.spec.config, job.spec.label, len(job.ids), chunk, stride, max_context)
    target = load(job, job.spec, kv)
    try:
        result = run_score(target.engine, job.ids, chunk=n_chunk, stride=n_stride, top_k=top_k,
                           token_text=_token_text(target))
        result.timings.load_s = target.load_seconds
        meta = job.meta("score", target, top_k=top_k)
        if text_file is not None:
            meta.prompt = None  # the file may be long: reports name it instead
        render.render_score(job.report_console, meta, result, text_file)
    finally:
        target.close()
