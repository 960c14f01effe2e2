"""metrale compare: two logits dumps or two layer dumps; or --reference transformers, metrale checked
against transformers on the same checkpoint."""


from pathlib import Path
from typing import Annotated, Any, Optional

import typer

from ..errors import UsageError
from ..inputs import check_positive, context_for
from ..render.common import choose_format
from ..render.compare import render_compare
from ..render.reference import render_reference_check
from .entry import State, app
from .help_format import MetraleCommand
from .job import load, prepare, text_file_prompt
from .options import (ChatOpt, Common, ComputeOpt, FormatOpt, MlaOpt, ModelOpt, NoSpecialTokensOpt, PromptOpt,
                      SystemOpt, TextFileOpt, TokensOpt)


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
    from_b: Annotated[Optional[str], typer.Option(
        "--from", metavar="FORMAT", help="B's format: vllm, sglang, trtllm, llamacpp, torch, npy, safetensors, "
                                         "bin (default: by content).")] = None,
    from_a: Annotated[Optional[str], typer.Option(
        "--from-a", metavar="FORMAT", help="A's format, when it is another engine's dump.")] = None,
    map_file: Annotated[Optional[str], typer.Option(
        "--map", metavar="FILE", help="Rules naming an engine's tensors as metrale's taps (TOML or JSON).")] = None,
    tp_dirs: Annotated[Optional[str], typer.Option(
        "--tp-dirs", metavar="D0,D1,...", help="B is these folders, one per tensor-parallel rank.")] = None,
    rows: Annotated[bool, typer.Option("--rows", help="Also list the statistics of every row.")] = False,
    positions: Annotated[Optional[str], typer.Option(
        "--positions", metavar="P,A..B",
        help="Compare only these positions (of those both sides hold; ranges inclusive).")] = None,
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
    text_file: TextFileOpt = None,
    chat: ChatOpt = False,
    system: SystemOpt = None,
    no_special_tokens: NoSpecialTokensOpt = False,
    steps: Annotated[Optional[int], typer.Option(
        "--steps", "-n", metavar="N", help="With --reference: greedy tokens compared after the prompt (default 8).")] = None,
    layers: Annotated[Optional[str], typer.Option(
        "--layers", metavar="I,J,...|all", help="With --reference: also compare these layers' taps.")] = None,
    device: Annotated[Optional[str], typer.Option(
        "--device", metavar="cpu|cuda", help="With --reference: where metrale runs (default cpu).")] = None,
    logits_dtype: Annotated[Optional[str], typer.Option(
        "--logits-dtype", metavar="fp32|bf16",
        help="With --reference: metrale's logits dtype; bf16 also pairs bf16 compute on both sides "
             "(default: the compute's).")] = None,
    compute: ComputeOpt = None,
    mla: MlaOpt = None,
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
    order, each position's largest error and first tensor beyond --rtol, and the first divergence: the
    first tensor in forward order beyond it, at its first such position.

    Other engines' dumps: --from FORMAT (B), --from-a FORMAT (A), else by content. To make them:
      vllm      vllm serve M --enforce-eager --intermediate-log-config
                '{"enabled": true}' (the run folder: step_N/MODULE/outputs_*.pt)
      sglang    sglang.launch_server --debug-tensor-dump-output-folder D (D, its
                TP*_PP*_Rank* folders of PassNNNNN.pt); or DUMPER_ENABLE=1
                (the dumper's folder of name=...pt files)
      trtllm    python run.py ... --output_logits_npy out.npy (out.npy);
                per-op .pt files: their folder
      llamacpp  llama-eval-callback -m M.gguf -p P > out.txt 2>&1 (out.txt: each
                node's sum and edge values, a statistics comparison);
                llama-debug ... --save-logits (its folder: the last row's logits)
      torch     torch.save(tensor_or_dict, "x.pt") (x.pt, or a folder of them)
      npy, safetensors, bin: as above

    No .pt file is unpickled by torch: only tensor and storage records are read, and a file naming anything
    else (code) is refused (exit 5). vLLM and SGLang module paths become metrale's taps (model.layers.N.self_attn,
    .mlp, the residual stream model.layers.N, ...; finer ones such as self_attn.q_proj are listed as only on
    that side): qkv_proj is split into q, k, v with the head counts of --model DIR's config.json (or the rope
    outputs' widths), gate_up_proj into gate and up. TP shards (vLLM's devices, SGLang's rank folders, or
    --tp-dirs D0,D1) join along the features (column-parallel) or are taken once (row-parallel, already
    summed). --map FILE (TOML or JSON rules: pattern, name, optional split, slice, tp) names anything else.
    Steps (prefill, then decode) are rows at their positions; token ids both sides carry must agree (else
    exit 5). Against a logits dump, an engine dump's logits (logits_processor) are compared.

    Rows pair up by position wherever both sides say which position each row is for (metrale's dumps do):
    a forward dump against a decode dump compares the positions both hold and names the others (rows that
    ran different tokens are refused); --positions selects among them. Without positions rows pair by index.
    With --max-kl, --max-rel-err, --min-top1 or --rtol it is a check: exit 9 when exceeded.

    --reference transformers --model DIR checks metrale itself: transformers (pip install
    'metrale[reference]') decodes --steps N greedy tokens after the prompt; both then run prompt + those
    tokens teacher-forced (one forward, so an early difference does not cascade), and the prompt's last row
    and the N step rows are compared as above (A = transformers, B = metrale), with each row's argmax and
    whether metrale's greedy tokens are transformers'. --layers also compares those layers' taps with
    transformers' hidden_states and module outputs, naming the first diverging one. The prompt options
    are decode's (--prompt, --tokens, --chat, --system, --no-special-tokens) and --text-file.
    Like with like: fp32 on both sides on the CPU by default; --compute bf16 (or --logits-dtype bf16) runs
    metrale's bf16 compute against transformers in bf16; --device cuda runs metrale's GPU engine against
    transformers in bf16 on the GPU (on the CPU when torch sees no GPU). The header says what each side
    computed. --mla absorbed checks a latent-attention model's absorbed algebra against transformers' naive one.
    It is a check by default (exit 9 beyond it), with tolerances set from the worst a correct
    model measured (scripts/measure_reference_margins.py on the embedded model and 19 fixture families, and
    two real checkpoints, SmolLM2-135M and Gemma 3 270M): fp32 rel err 1e-3, KL 1e-4, every argmax agrees,
    layers --rtol 1e-3 (measured at worst 4.4e-6, 1.1e-10, 1.0, 8.7e-6); bf16 1.5e-1, 1e-1, 0.8, 3e-1
    (measured at worst 5.0e-2, 2.9e-2, 0.955, 1.3e-1, on SmolLM2; a mixture of experts in bf16 can route a
    near tie to another expert and fail: check it in fp32). The options override.

    Examples:
      metrale compare ref.safetensors mine.npy --dtype bf16
      metrale compare ref.npy mine.bin --vocab 128256 --dtype bf16 --max-kl 1e-3
      metrale compare ref-layers.safetensors mine-layers.safetensors --rtol 1e-3
      metrale compare layers.safetensors vllm_run/ --model DIR --rtol 1e-4
      metrale compare logits.npy sglang_dump/ --from sglang --max-kl 1e-3
      metrale compare layers.safetensors ops/ --from torch --map names.toml
      metrale compare layers.safetensors out.txt --from llamacpp --rtol 1e-3
      metrale compare --reference transformers --prompt "The for" --steps 4
      metrale compare --reference transformers --tokens "1 2 3" --layers 0,-1
    """
    from ..align import parse_positions
    from ..compare import Tolerances, failure_message, run_compare
    from ..compare_inputs import ReadOptions
    from ..errors import DivergenceError

    state: State = ctx.obj
    fmt_ = choose_format(fmt, state.out)
    given = {"--model": model, "--prompt": prompt, "--tokens": tokens, "--text-file": text_file, "--steps": steps,
             "--layers": layers, "--device": device, "--logits-dtype": logits_dtype, "--compute": compute,
             "--mla": mla, "--system": system, "--chat": chat or None, "--no-special-tokens": no_special_tokens or None}
    if reference is not None:
        if a is not None or b is not None:
            raise UsageError("--reference runs the comparison itself: give --model, not files A and B")
        c = Common(model, text_file_prompt(text_file, prompt, tokens), tokens, device or "cpu", logits_dtype or "",
                   fmt, None, False, None, False, None, chat, system, no_special_tokens, compute, mla=mla)
        return _reference_check(ctx, reference, c, steps, layers, Tolerances(max_kl, max_rel_err, min_top1, rtol))
    engine = any(v is not None for v in (from_b, from_a, tp_dirs, map_file)) or any(
        x is not None and (Path(x).is_dir() or x.endswith(".pt")) for x in (a, b))
    if engine:
        given.pop("--model")  # with an engine's dump, --model's config.json splits fused outputs
    extra = [name for name, value in given.items() if value is not None]
    if extra:
        raise UsageError(f"{', '.join(extra)} go with --reference transformers (comparing two files needs none)")
    dirs = [d for d in tp_dirs.split(",") if d] if tp_dirs is not None else None
    if b is None and dirs:
        b = dirs[0]
    if a is None or b is None:
        raise UsageError("compare needs two files: metrale compare A B (A is the reference)")
    result = run_compare(a, b, ReadOptions(tensor, tensor_b, vocab, dtype, from_a, from_b, map_file, model, dirs),
                         Tolerances(max_kl, max_rel_err, min_top1, rtol), keep_rows=rows,
                         positions=parse_positions(positions))
    render_compare(state.out, fmt_, result)
    if result.passed is False:
        raise DivergenceError(failure_message(result))


def _reference_check(ctx: typer.Context, reference: str, c: Common, steps: int | None, layers: str | None,
                     tol: Any) -> None:
    """compare --reference: check the options, load metrale's engine, run the check, render, exit 9 if it failed."""
    from ..errors import DivergenceError
    from ..layer_dumps import parse_layers
    from ..model import resolve_device
    from ..reference_check import (DEFAULT_STEPS, REFERENCES, check_reference, divergence_message, import_reference,
                                   pair_precision)

    if reference not in REFERENCES:
        raise UsageError(f"--reference takes {', '.join(REFERENCES)}, got {reference!r}")
    steps = DEFAULT_STEPS if steps is None else steps
    check_positive(steps, "--steps")
    tol.check()
    precision = pair_precision(resolve_device(c.device), c.compute, c.logits_dtype or None)
    c.logits_dtype, c.compute = precision.logits, precision.compute
    import_reference()  # a missing extra fails before anything is loaded
    job = prepare(ctx.obj, c)
    chosen = parse_layers(layers, job.spec.config.num_hidden_layers) if layers is not None else None
    n = len(job.ids)
    kv = context_for(job.spec, n + steps, f"prompt ({n} tokens) + --steps {steps}", None)
    target = load(job, job.spec, kv)
    try:
        result = check_reference(target.engine, target.config, directory=job.spec.directory, model=job.spec.label,
                                 precision=precision, prompt=job.ids, steps=steps, layers=chosen, tolerances=tol,
                                 reference=reference)
    finally:
        target.close()
    render_reference_check(ctx.obj.out, job.fmt, result)
    if not result.passed:
        raise DivergenceError(divergence_message(result))
