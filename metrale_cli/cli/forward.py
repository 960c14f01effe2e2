"""metrale forward: one forward pass over the prompt."""


from typing import Annotated

import typer

from ..errors import UsageError
from ..inputs import context_for
from ..render.forward import render_forward
from ..state_dumps import check_state_dump, write_state_dump
from .entry import app
from .help_format import MetraleCommand
from .job import (check_mtp_draft, dumps_on_nonfinite, load, load_mtp, prepare, record_layers, record_mtp_layer,
                  token_text, write_dumps)
from .options import Common, DumpStateOpt, pass_options


@app.command(cls=MetraleCommand)
@pass_options
def forward(
    ctx: typer.Context,
    c: Common,
    rows: Annotated[str, typer.Option("--rows", metavar="last|all",
                                      help="The rows reported and dumped (every dump holds the same rows): the "
                                           "last (default) or every prompt row.")] = "last",
    dump_state: DumpStateOpt = None,
    mtp: Annotated[bool, typer.Option(
        "--mtp", help="The rows of the checkpoint's multi-token-prediction layer (DeepSeek-V3, GLM-4.5; CPU): row "
                      "p from token p and the model's hidden row at p - 1, from the prompt's second token.")] = False,
) -> None:
    """One forward pass over the prompt: the argmax token and its logit for the last row or every row.

    --dump-logits writes the logits rows themselves (.safetensors, .npy, .bin), to compare with another
    engine bit for bit. Every dump (--dump-logits, --dump-hidden, --dump-layers) holds the rows --rows
    selects: --rows all for every prompt row. --dump-state writes a linear-attention model's recurrent
    and conv states after the pass. --mtp reports and dumps the multi-token-prediction layer's rows
    instead (as transformers' MtpModel computes them; the dumps say "forward --mtp"), to compare with an
    engine's MTP draft logits; with --dump-layers the dump holds the layer's taps under the checkpoint's
    names (model.layers.{L}.enorm, .hnorm, .eh_proj, the block's, .shared_head.norm).

    Examples:
      metrale forward --prompt "The for statement" --rows all
      metrale forward --tokens "1 2 3" --model default --dump-logits rows.npy
      metrale forward --rows all --dump-layers layers.safetensors --layers 0,-1
    """
    from ..decoding.decode import run_forward

    if rows not in ("last", "all"):
        raise UsageError(f"--rows must be last or all, got {rows!r}")
    job = prepare(ctx.obj, c)
    command = "forward --mtp" if mtp else "forward"
    if mtp:
        if dump_state is not None:
            raise UsageError("--mtp and --dump-state: the multi-token-prediction layer keeps no recurrent state")
        check_mtp_draft(job)
    state_dump = check_state_dump(dump_state, job.spec.config.definition) if dump_state is not None else None
    n = len(job.ids)
    model_ctx = context_for(job.spec, n, f"prompt ({n} tokens)", c.max_context)
    target = load(job, job.spec, model_ctx, job.common.tp)
    recorder = record_layers(job, target) if not mtp else None
    try:
        layer = load_mtp(job, target, model_ctx) if mtp else None
        if layer is not None:
            recorder = record_mtp_layer(job, layer)
        with dumps_on_nonfinite(job, command, target.engine, recorder):
            result = run_forward(target.engine, job.ids, all_rows=rows == "all", token_text=token_text(target),
                                 keep_rows=job.logits_dump is not None, want_hidden=job.want_hidden, mtp=layer)
        result.timings.load_s = target.load_seconds
        write_dumps(job, command, result.logit_rows, result.hidden_rows, job.ids,
                    [row.position for row in result.rows], recorder)
        if state_dump is not None:
            write_state_dump(state_dump, target.engine)
        render_forward(job.report_console, job.meta(command, target), result)
    finally:
        target.close()
