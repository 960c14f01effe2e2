"""metrale bench: decode, verify and prefill speed against the hardware's own limits, on random weights."""


import json
from typing import Annotated, Optional

import typer

from ..dumps import check_dump_path, commit
from ..errors import UsageError
from ..inputs import check_positive
from ..model import resolve_device
from ..render.bench import render_bench
from ..render.common import choose_format, note
from .entry import State, app
from .help_format import MetraleCommand
from .job import check_tensor_parallel
from .options import DeviceOpt, FormatOpt, ThreadsOpt, TpOpt


@app.command(cls=MetraleCommand)
def bench(
    ctx: typer.Context,
    preset: Annotated[Optional[str], typer.Option(
        "--preset", metavar="NAME|PATH", help="A preset in configs/ (e.g. llama-3.1-8b, qwen3-8b-fp8, qwen3-30b-a3b, deepseek-v2-lite, "
                         "qwen3.5-27b, gpt-oss-20b; an unknown name lists them all) or a config.json path (or a "
                         "directory holding one). Default: llama-3.1-8b on cuda, tiny-llama on cpu.",
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
        help="CUDA rows paths to time side by side in this run: fused (the default: rows with rope + KV append "
             "inside the attention kernel), rows (the fallback, what --tp ranks run). The figures above the table "
             "are taken on the first.",
        show_default=False)] = None,
    fmt: FormatOpt = None,
    tp: TpOpt = None,
    threads: ThreadsOpt = None,
) -> None:
    """Measure decode, verify and prefill speed against the hardware's own limits, in one run.

    Random weights from a preset (drawn on the GPU for cuda, so no checkpoint file is needed). The same
    run measures the read bandwidth, the decode floor (bytes a step must read / bandwidth) and the GEMM
    rate, then decode ms/token, verify ms per k, prefill tokens/s and, when transformers is installed,
    transformers eager on the same weights. Each figure is printed with its ratio to its target.

    Examples:
      metrale bench --device cpu --preset tiny-llama --context 256 --prefill 256
      metrale bench --device cuda --context 8192 --json bench-8k.json
      metrale bench --device cuda --path fused,rows --no-transformers
    """
    from .. import bench as bench_mod

    state: State = ctx.obj
    fmt_ = choose_format(fmt, state.out)
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
        raise UsageError("--path needs at least one name (fused, rows)")
    chosen = resolve_device(device)
    path_list = bench_mod.check_paths(path_list, chosen)
    name = preset or ("llama-3.1-8b" if chosen == "cuda" else "tiny-llama")
    if tp is not None:
        from ..config import load_config

        check_tensor_parallel(tp, chosen, load_config(bench_mod.preset_path(name)))
    result = bench_mod.run_bench(name, device=chosen, context=context, ks=k_list, prefill_tokens=prefill,
                                 repeats=repeats, with_transformers=not no_transformers,
                                 progress=lambda m: note(state.err, m), tp=tp, paths=path_list,
                                 threads=threads)
    render_bench(state.out, fmt_, result)
    if target is not None:
        commit([(target.path, [json.dumps(result.to_json(), indent=2).encode() + b"\n"])])
