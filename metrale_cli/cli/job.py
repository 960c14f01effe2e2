"""What decode, verify, forward and score share once their options are parsed: the checks that need no
weights (prepare, giving a Job), loading a model, the dumps (written also when a run meets NaN/Inf), the
layer recorder, and Ctrl-C stopping a decoding loop after its current step."""


import contextlib
import os
import signal
import threading
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Iterator

import typer
from rich.console import Console

from ..dumps import HIDDEN_KINDS, DumpInfo, DumpTarget, check_dump_path, write_hidden, write_logits
from ..errors import NonFiniteLogitsError, UsageError
from ..inputs import ModelSpec, check_positive, check_prompt_format, read_model_spec, resolve_prompt
from ..model import (LoadedModel, check_compute, check_mtp, default_logits_dtype, open_model, open_mtp,
                     resolve_device)
from ..render.common import Meta, choose_format, counted, load_progress
from .entry import State
from .options import Common, LayerOptions

if TYPE_CHECKING:  # the layer taps import numpy: only a command that dumps layers loads them
    from ..engine.observe import LayerRecorder


@dataclass
class Job:
    """Common options checked and resolved, before any weight is loaded."""

    state: State
    common: Common
    fmt: str
    fp32: bool
    device: str
    compute: str  # the engine's precision on that device: fp32 | bf16
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

    def meta(self, command: str, model: LoadedModel, **extra: Any) -> Meta:
        return Meta(command, self.spec.label, model.device, "fp32" if self.fp32 else "bf16", self.fmt, self.compute,
                    prompt=self.prompt_text, has_tokenizer=model.tokenizer is not None,
                    timings=self.common.timings, **extra)


def prepare(state: State, c: Common) -> Job:
    """Every check that needs no weights: options, dump paths, device, config, token ids."""
    if c.prompt is not None and c.tokens is not None:
        raise UsageError("--prompt and --tokens are exclusive: give one of them")
    check_prompt_format(c.prompt, c.tokens, c.prompt_format)
    fmt = choose_format(c.fmt, state.out)
    if c.logits_dtype not in ("bf16", "fp32", None):
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
    compute = check_compute(c.compute, device)
    if c.mla is not None:
        from ..engine.mla import FORMS

        if c.mla not in FORMS:
            raise UsageError(f"--mla must be one of {', '.join(FORMS)}, got {c.mla!r}")
    if c.activation_quant not in (None, "none", "emulate"):
        raise UsageError(f"--activation-quant must be none or emulate, got {c.activation_quant!r}")
    if c.layers is not None and c.layers.taps == "fine" and device == "cuda":
        raise UsageError("--taps fine runs on the CPU engine only yet (use --device cpu)")
    dtype = c.logits_dtype or default_logits_dtype(device)
    spec = read_model_spec(c.model)
    if c.tp is not None:
        check_tensor_parallel(c.tp, device, spec.config)
    if c.layers is not None and c.layers.select is not None:
        from ..layer_dumps import parse_layers

        parse_layers(c.layers.select, spec.config.num_hidden_layers)  # a bad index fails before any load
    ids, text = resolve_prompt(spec, c.prompt, c.tokens, lambda: typer.get_text_stream("stdin").read(),
                               c.prompt_format)
    return Job(state, c, fmt, dtype == "fp32", device, compute, spec, ids, text, logits_dump,
               hidden_dump, layers_dump)


def text_file_prompt(text_file: str | None, prompt: str | None, tokens: str | None) -> str | None:
    """--text-file F read as the --prompt text (score, compare --reference); else --prompt as given."""
    if text_file is None:
        return prompt
    if prompt is not None or tokens is not None:
        raise UsageError("--text-file, --prompt and --tokens are exclusive: give one of them")
    from ..scoring import read_text_file

    return read_text_file(text_file, lambda: typer.get_text_stream("stdin").read())


def check_tensor_parallel(tp: int, device: str, cfg: Any) -> None:
    """--tp N: a degree the model splits into, and the devices for it (before any process starts)."""
    from ..parallel.launcher import check_devices
    from ..parallel.sharding import check_tp

    check_positive(tp, "--tp")
    check_tp(cfg.definition, tp)
    check_devices(device, tp)


def _check_layer_options(opts: LayerOptions | None) -> DumpTarget | None:
    if opts is None or not opts.wanted:
        if opts is not None and (opts.select is not None or opts.stats or opts.taps is not None):
            flag = "--layers" if opts.select is not None else "--dump-stats" if opts.stats else "--taps"
            raise UsageError(f"{flag} needs --dump-layers PATH")
        return None
    if opts.taps not in (None, "default", "fine"):
        raise UsageError(f"--taps must be default or fine, got {opts.taps!r}")
    from ..layer_dumps import check_layer_dump_path  # numpy: only for a command that dumps layers

    return check_layer_dump_path(opts.path, stats=opts.stats)


def record_layers(job: Job, model: LoadedModel) -> "LayerRecorder | None":
    """With --dump-layers, every pass of `model` from now on is recorded (the taps run beside the passes)."""
    if job.layers_dump is None:
        return None
    from ..engine.observe import LayerRecorder
    from ..layer_dumps import parse_layers

    chosen = set(parse_layers(job.common.layers.select, model.config.num_hidden_layers))
    recorder = LayerRecorder(model.engine, lambda name: _tap_layer(name) in chosen | {None}, sorted(chosen))
    model.engine.tap = recorder
    if job.common.layers.taps == "fine":
        model.engine.fine_taps = True  # engine/ops.Ops.fine_taps: the passes tap inside the blocks too
    return recorder


def record_mtp_layer(job: Job, engine) -> "LayerRecorder | None":
    """forward --mtp --dump-layers: every tap of the multi-token-prediction layer (backends/numpy/mtp.py), under
    the checkpoint's names; --layers does not apply (one layer)."""
    if job.layers_dump is None:
        return None
    from ..engine.observe import LayerRecorder

    recorder = LayerRecorder(engine, lambda name: True, [engine.layer])
    engine.tap = recorder
    if job.common.layers.taps == "fine":
        engine.fine_taps = True
    return recorder


def _tap_layer(name: str) -> int | None:
    """model.layers.{i}[.sub] -> i; None (always kept) for the embedding and the final norm."""
    parts = name.split(".")
    return int(parts[2]) if len(parts) > 2 and parts[1] == "layers" else None


def check_mtp_draft(job: Job) -> None:
    """--draft mtp / forward --mtp, before anything loads: model.check_mtp on the job's model and device."""
    check_mtp(job.spec.path, job.spec.config, job.device, job.common.tp)


def load_mtp(job: Job, target: LoadedModel, ctx: int):
    """The target's multi-token-prediction layer, computing as the job's target does (model.open_mtp)."""
    return open_mtp(target, ctx, job.fp32, job.compute, job.common.mla, job.common.activation_quant)


def load(job: Job, spec: ModelSpec, ctx: int, tp: int | None = None) -> LoadedModel:
    with load_progress(job.state.err, spec.label) as progress:
        return open_model(spec.path, device=job.device, max_context=ctx, fp32_logits=job.fp32,
                          progress=progress, tp=tp, compute=job.compute, mla=job.common.mla,
                          activation_quant=job.common.activation_quant, threads=job.common.threads)


def engine_settings(job: Job) -> dict[str, str]:
    """What the dumps' metadata records of the engine's choices: a quantized checkpoint's activation mode."""
    if job.spec.config.quantization is None:
        return {}
    return {"activation_quant": job.common.activation_quant or "none"}


def write_dumps(job: Job, command: str, rows, hidden_rows, tokens: list[int], positions: list[int],
                recorder: "LayerRecorder | None" = None) -> None:
    """The logits rows, the hidden rows behind them and the layers of the same rows, with the same tokens
    and positions: every dump of one command holds the same rows."""
    info = DumpInfo(command, job.spec.label, tokens, positions, engine_settings(job))
    if job.logits_dump is not None:
        write_logits(job.logits_dump, rows, info, typer.get_binary_stream("stdout"))
    if job.hidden_dump is not None:
        write_hidden(job.hidden_dump, hidden_rows, info)
    if recorder is not None:
        from ..layer_dumps import LayerDumpInfo, write_layers

        tensors, at = recorder.at(positions)
        write_layers(job.layers_dump, tensors, at, LayerDumpInfo(command, job.spec.label, tokens, recorder.layers,
                                                                 engine_settings(job)))


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
    from ..decoding.results import NonFiniteRun
    from ..decoding.rows import describe_nonfinite

    try:
        yield
    except NonFiniteRun as e:
        ev = e.evidence
        positions = ev.positions
        if ev.rows is None and ev.hidden is None and recorder is not None:  # layers only: every row run since
            positions = sorted({p for p in recorder.positions if p >= ev.first_position})
        write_dumps(job, command, ev.rows, ev.hidden, ev.tokens, positions, recorder)
        parts = [str(e)]
        where = describe_nonfinite(engine, ev.tokens)
        if where:
            parts.append(where)
        written = []
        if ev.rows is not None:
            n = len(ev.rows.data)
            written.append(f"{job.common.dump_logits} ({counted(n, 'row')})")
        if ev.hidden is not None and job.common.dump_hidden is not None:
            written.append(job.common.dump_hidden)
        if recorder is not None:
            written.append(job.common.layers.path)
        if written:
            parts.append("written anyway: " + ", ".join(written))
        raise NonFiniteLogitsError("; ".join(parts), row=e.row, position=e.position) from None


def token_text(model: LoadedModel):
    return model.tokenizer.token_text if model.tokenizer is not None else None
