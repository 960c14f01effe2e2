"""metrale score: teacher-forced scoring of a text, token by token."""


from typing import Annotated, Optional

import typer

from ..errors import UsageError
from ..render.score import render_score
from .entry import app
from .help_format import MetraleCommand
from .job import load, prepare, text_file_prompt, token_text
from .options import (ChatOpt, Common, ComputeOpt, DeviceOpt, FormatOpt, MaxContextOpt, ModelOpt, NoSpecialTokensOpt,
                      PromptOpt, SystemOpt, TextFileOpt, ThreadsOpt, TimingsOpt, TokensOpt)


@app.command(cls=MetraleCommand)
def score(
    ctx: typer.Context,
    model: ModelOpt = None,
    prompt: PromptOpt = None,
    tokens: TokensOpt = None,
    text_file: TextFileOpt = None,
    chat: ChatOpt = False,
    system: SystemOpt = None,
    no_special_tokens: NoSpecialTokensOpt = False,
    top_k: Annotated[int, typer.Option("--top-k", "-k", metavar="K", help="Alternatives shown per token.")] = 3,
    chunk: Annotated[Optional[int], typer.Option(
        "--chunk", metavar="N", help="Tokens per window (default: the whole text, at most the context).")] = None,
    stride: Annotated[Optional[int], typer.Option(
        "--stride", metavar="S", help="Windows start every S tokens (default N - 1: each token scored once).")] = None,
    device: DeviceOpt = "auto",
    logits_dtype: Annotated[str, typer.Option(
        "--logits-dtype", metavar="bf16|fp32", help="Dtype of the logits rows scored (fp32: exact).")] = "fp32",
    compute: ComputeOpt = None,
    threads: ThreadsOpt = None,
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
    from ..scoring import choose_chunk, run_score

    if top_k < 0:
        raise UsageError(f"--top-k must be 0 or more, got {top_k}")
    prompt = text_file_prompt(text_file, prompt, tokens)
    c = Common(model, prompt, tokens, device, logits_dtype, fmt, None, False, None, timings, max_context,
               chat, system, no_special_tokens, compute, threads=threads)
    job = prepare(ctx.obj, c)
    n_chunk, n_stride, kv = choose_chunk(job.spec.config, job.spec.label, len(job.ids), chunk, stride, max_context)
    target = load(job, job.spec, kv)
    try:
        result = run_score(target.engine, job.ids, chunk=n_chunk, stride=n_stride, top_k=top_k,
                           token_text=token_text(target))
        result.timings.load_s = target.load_seconds
        meta = job.meta("score", target, top_k=top_k)
        if text_file is not None:
            meta.prompt = None  # the file may be long: reports name it instead
        render_score(job.report_console, meta, result, text_file)
    finally:
        target.close()
