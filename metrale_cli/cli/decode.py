"""metrale decode: greedy decoding, plain or speculative (a draft model or prompt lookup)."""


from typing import TYPE_CHECKING, Annotated, Any, Optional

import typer

from ..errors import Interrupted, UsageError
from ..inputs import check_draft_matches, check_positive, context_for, read_model_spec
from ..model import LoadedModel
from ..render.common import note
from ..render.decode import DecodeReport
from ..state_dumps import check_state_dump, write_state_dump
from .entry import State, app
from .help_format import MetraleCommand
from .job import (Job, check_mtp_draft, ctrl_c_stops, dumps_on_nonfinite, load, load_mtp, prepare, record_layers,
                  token_text, write_dumps)
from .options import DEFAULT_K, Common, DraftModelOpt, DumpStateOpt, pass_options

DRAFTS = ("ngram", "mtp")  # --draft's sources (a draft model is --draft-model PATH)

if TYPE_CHECKING:  # the commands import decoding (and with it numpy) when they run: --help stays fast
    from ..decoding.results import SpecDecodeResult


@app.command(cls=MetraleCommand)
@pass_options
def decode(
    ctx: typer.Context,
    c: Common,
    steps: Annotated[int, typer.Option("--steps", "-n", metavar="N", help="Tokens to produce.")] = 16,
    # No short form: "-k" would read like --k (the draft count) and silently mean something else.
    top_k: Annotated[Optional[int], typer.Option(
        "--top-k", metavar="K",
        help="Also show the K best tokens per step (K >= 1; more than the vocabulary shows all of it).")] = None,
    ignore_eos: Annotated[bool, typer.Option("--ignore-eos", help="Do not stop at an EOS token.")] = False,
    draft: Annotated[Optional[str], typer.Option(
        "--draft", metavar="ngram|mtp",
        help="Speculative decoding with prompt-lookup (n-gram) drafts, or with the checkpoint's "
             "multi-token-prediction layer (DeepSeek-V3, GLM-4.5; CPU).")] = None,
    draft_model: DraftModelOpt = None,
    k: Annotated[Optional[int], typer.Option(
        "--k", metavar="K", help=f"Drafts per verify pass (default {DEFAULT_K}).")] = None,
    dump_state: DumpStateOpt = None,
) -> None:
    """Greedy decoding: prefill the prompt, then --steps decode steps, one line per produced token.

    Each step shows the position, token id, token text and its logit; --top-k K adds the K best tokens
    with their logits and probabilities. Decoding stops at an EOS token unless --ignore-eos.

    --draft ngram (prompt lookup), --draft mtp (the checkpoint's multi-token-prediction layer, as
    transformers' generate(use_mtp=True) runs it; drafts after the first reuse the layer on its own output)
    or --draft-model PATH decodes speculatively, --k drafts per verify pass: the tokens are those of plain
    greedy decoding, and the report adds the drafted and accepted counts. With --timings a speculative run
    also times plain greedy decoding of the same prompt.

    Examples:
      metrale decode --prompt "The for statement" --steps 8 --top-k 3
      metrale decode --tokens "[1, 2, 3]" --model default --format json
      metrale decode --draft-model default-draft --k 4 --timings
      metrale decode --draft ngram --k 4 --steps 32 --ignore-eos
    """
    if draft is not None and draft not in DRAFTS:
        raise UsageError(f"decode --draft takes {' or '.join(map(repr, DRAFTS))}, got {draft!r} "
                         "(a draft model is --draft-model PATH)")
    if draft is not None and draft_model is not None:
        raise UsageError(f"--draft {draft} and --draft-model are exclusive: give one draft source")
    speculative = draft is not None or draft_model is not None
    if k is not None and not speculative:
        raise UsageError(f"--k {k} needs a draft source: --draft ngram, --draft mtp or --draft-model PATH")
    job = prepare(ctx.obj, c)
    if draft == "mtp":
        check_mtp_draft(job)
    check_positive(steps, "--steps")
    if top_k is not None:
        check_positive(top_k, "--top-k", " (leave --top-k out for no candidates)")
        top_k = _cap_top_k(ctx.obj, top_k, job.spec.config.vocab_size)
    k = DEFAULT_K if k is None else k
    if speculative:
        check_positive(k, "--k")
    state_dump = check_state_dump(dump_state, job.spec.config.definition) if dump_state is not None else None
    _decode(job, steps, top_k or 0, ignore_eos, speculative, draft_model, k, state_dump, mtp=draft == "mtp")


def _cap_top_k(state: State, top_k: int, vocab: int) -> int:
    """A K beyond the vocabulary means "every token": cap it, and say so (the report shows the capped K)."""
    if top_k <= vocab:
        return top_k
    note(state.err, f"--top-k {top_k} is more than the vocabulary: showing all {vocab} tokens")
    return vocab


def _decode(job: Job, steps: int, top_k: int, ignore_eos: bool, speculative: bool, draft_path: str | None,
            k: int, state_dump=None, mtp: bool = False) -> None:
    from ..decoding.decode import run_decode
    from ..decoding.rows import TextStream
    from ..decoding.speculative import ModelDrafter, MtpDrafter, NgramDrafter

    n = len(job.ids)
    # The last token produced is never fed back: the cache holds the prompt and the tokens before it. A
    # speculative run needs no more (its verify passes draft only into the room left); k more by default.
    need = n + steps - 1
    what = f"prompt ({n} tokens) + --steps {steps} - 1 (the last token is not run)"
    ctx = context_for(job.spec, need, what, job.common.max_context, need + (k if speculative else 0))
    draft_spec = read_model_spec(draft_path) if draft_path is not None else None
    if draft_spec is not None:
        check_draft_matches(job.spec, draft_spec)
        ctx = min(ctx, context_for(draft_spec, need, f"for the draft model, {what}", None, ctx))
    if speculative and job.layers_dump is not None:
        raise UsageError("--dump-layers records plain decoding: a speculative run's rejected drafts would mix "
                         "into the rows (dump one verify pass with `metrale verify --dump-layers` instead)")
    target = load(job, job.spec, ctx, job.common.tp)
    recorder = record_layers(job, target)
    drafter_model = report = mtp_engine = None
    try:
        drafter_model = load(job, draft_spec, ctx) if draft_spec is not None else None
        if mtp:
            mtp_engine = load_mtp(job, target, ctx)
        meta = job.meta("decode", target, top_k=top_k, draft_model=draft_spec.label if draft_spec else None)
        tok = target.tokenizer
        report = DecodeReport(job.report_console, meta,
                              TextStream(tok.decode, job.ids) if tok is not None else None)
        report.begin(job.ids, steps)
        kwargs = dict(top_k=top_k, eos_ids=target.config.eos_token_ids, ignore_eos=ignore_eos,
                      token_text=token_text(target), keep_rows=job.logits_dump is not None,
                      want_hidden=job.want_hidden, on_step=report.step,
                      detokenize=tok.decode if tok is not None else None)
        plain_match = None
        with ctrl_c_stops() as stop, dumps_on_nonfinite(job, "decode", target.engine, recorder):
            kwargs["should_stop"] = stop
            if speculative:
                drafter = (ModelDrafter(drafter_model.engine) if drafter_model is not None
                           else MtpDrafter(mtp_engine, target.engine) if mtp_engine is not None else NgramDrafter())
                result, plain_match = _speculative(job, target, drafter, steps, k, kwargs)
            else:
                result = run_decode(target.engine, job.ids, steps, **kwargs)
        result.timings.load_s = target.load_seconds + (drafter_model.load_seconds if drafter_model else 0.0)
        if not result.interrupted:  # an interrupted run writes no dump: the rows would be a partial run
            fed = job.ids + [s.token for s in result.steps[:-1]]
            write_dumps(job, "decode", result.rows, result.hidden_rows, fed,
                        [s.position - 1 for s in result.steps], recorder)
            if state_dump is not None:  # the state after the last token run (the last produced is not run)
                write_state_dump(state_dump, target.engine)
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
    from ..decoding.speculative import speculative_decode, time_against_plain

    result = speculative_decode(target.engine, drafter, job.ids, steps, k, **kwargs)
    if not job.common.timings or result.interrupted:
        return result, None
    return result, time_against_plain(target.engine, result, job.ids, steps, eos_ids=kwargs["eos_ids"],
                                      ignore_eos=kwargs["ignore_eos"], should_stop=kwargs["should_stop"])
