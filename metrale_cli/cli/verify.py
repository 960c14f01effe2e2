"""metrale verify: one verify pass over K drafts (the model's own, given ids, a draft model's or the MTP layer's)."""


from typing import Annotated, Any, Optional

import typer

from ..errors import UsageError
from ..inputs import (check_draft_matches, check_ids_in_vocab, check_positive, context_for, parse_token_ids,
                      read_model_spec)
from ..render.verify import render_verify
from .entry import app
from .help_format import MetraleCommand
from .job import (Job, check_mtp_draft, dumps_on_nonfinite, load, load_mtp, prepare, record_layers, token_text,
                  write_dumps)
from .options import DEFAULT_K, Common, DraftModelOpt, pass_options


@app.command(cls=MetraleCommand)
@pass_options
def verify(
    ctx: typer.Context,
    c: Common,
    k: Annotated[Optional[int], typer.Option(
        "--k", metavar="K",
        help=f"Drafts checked in the one verify pass (default {DEFAULT_K}, or the --draft ids' count).",
    )] = None,
    draft: Annotated[Optional[str], typer.Option(
        "--draft", metavar="self|mtp|IDS",
        help="'self' (the model's own greedy tokens, default), 'mtp' (the checkpoint's multi-token-prediction "
             "layer; CPU) or exactly K token ids.")] = None,
    draft_model: DraftModelOpt = None,
) -> None:
    """One verify pass: prefill the prompt, then check K draft tokens in a single forward.

    Per position: the draft token, the target's greedy token, accepted or not, and the top1-top2 margin.
    Acceptance stops at the first mismatch; then the accepted count and the next token.

    Drafts: --draft self (the default) drafts by K sequential decode steps of the same model, and
    max_abs_diff_vs_sequential compares each verify row with the matching decode row; --draft "IDS" checks
    exactly K given token ids; --draft-model PATH drafts with a smaller model; --draft mtp takes the
    model's own token after the prompt, then K - 1 drafts of its multi-token-prediction layer (as
    speculative decoding with MTP runs a pass; DeepSeek-V3, GLM-4.5). Rows after the first rejection are
    not checked.

    Expected for --draft self: a rounding difference (max_abs_diff_ulps_vs_sequential), since one pass over
    K rows sums in another order than K one-row steps: with bf16 rows a step or a few (1 on the CPU engine;
    one bf16 step is 0.0625 for logits from 8 to 16); with fp32 rows (the CPU default) the same
    differences unrounded, about 1e-5, some hundred fp32 steps. rows_identical_vs_sequential counts the
    bit-identical rows.

    Examples:
      metrale verify --prompt "The for statement" --k 4
      metrale verify --tokens "1 2 3" --draft "17 42 7" --model default
      metrale verify --draft-model default-draft --k 4 --format json
    """
    if draft is not None and draft_model is not None:
        raise UsageError("--draft and --draft-model are exclusive: give one draft source")
    job = prepare(ctx.obj, c)
    draft_ids = None
    mtp = draft is not None and draft.strip() == "mtp"
    if mtp:
        check_mtp_draft(job)
    elif draft is not None and draft.strip() != "self":
        draft_ids = _parse_draft_ids(draft)
        if k is None:
            k = len(draft_ids)
    k = DEFAULT_K if k is None else k
    check_positive(k, "--k")
    if draft_ids is not None:
        if len(draft_ids) != k:  # two options that disagree: a usage error, whatever the model
            raise UsageError(f"--draft gives {len(draft_ids)} token ids ({draft.strip()!r}) but --k is {k}")
        check_ids_in_vocab(draft_ids, job.spec.config.vocab_size, "--draft")
    _verify(job, k, draft_ids, draft_model, mtp)


def _parse_draft_ids(draft: str) -> list[int]:
    try:
        return parse_token_ids(draft, "--draft")
    except UsageError as e:
        raise UsageError(f"{e}; verify --draft takes 'self' or K token ids") from None


def _verify(job: Job, k: int, draft_ids: list[int] | None, draft_path: str | None, mtp: bool = False) -> None:
    from ..decoding.verify import run_verify

    n = len(job.ids)
    # The verify pass runs every draft (the last draft's row gives the bonus token): prompt + k positions.
    # A draft model runs only the drafts before its last: prompt + k - 1.
    what = f"prompt ({n} tokens) + --k {k}"
    ctx = context_for(job.spec, n + k, what, job.common.max_context)
    draft_spec = read_model_spec(draft_path) if draft_path is not None else None
    draft_ctx = n + k - 1
    if draft_spec is not None:
        check_draft_matches(job.spec, draft_spec)
        context_for(draft_spec, draft_ctx, f"for the draft model, prompt ({n} tokens) + --k {k} - 1", None)
    target = load(job, job.spec, ctx, job.common.tp)
    recorder = record_layers(job, target)
    drafter_model = None
    try:
        drafter_model = load(job, draft_spec, draft_ctx) if draft_spec is not None else None
        layer = load_mtp(job, target, ctx) if mtp else None
        source: Any = (draft_ids if draft_ids is not None else "model" if drafter_model else "mtp" if mtp
                       else "self")
        with dumps_on_nonfinite(job, "verify", target.engine, recorder):
            result = run_verify(target.engine, job.ids, k, draft=source,
                                draft_engine=drafter_model.engine if drafter_model else layer,
                                token_text=token_text(target), keep_rows=job.logits_dump is not None,
                                want_hidden=job.want_hidden)
        result.timings.load_s = target.load_seconds + (drafter_model.load_seconds if drafter_model else 0.0)
        drafts = [row.draft for row in result.rows]
        write_dumps(job, "verify", result.logit_rows, result.hidden_rows, job.ids + drafts,
                    list(range(n - 1, n + k)), recorder)
        meta = job.meta("verify", target, draft_model=draft_spec.label if draft_spec else None)
        render_verify(job.report_console, meta, result)
    finally:
        target.close()
        if drafter_model is not None:
            drafter_model.close()
