"""Check metrale's CPU engine against transformers on a real pretrained checkpoint (issue 36's measurement).

For each prompt:
  1. `metrale decode --model DIR --prompt P --steps N --ignore-eos --device cpu --format json --top-k 2`
     (the default fp32 logits), and transformers' fp32 greedy generate (eager attention, do_sample=False,
     N new tokens, EOS not stopping it) from the same prompt token ids (metrale's `prompt_tokens`): are the
     N tokens identical?  If not, the first differing step and both sides' top-2 logits there.
  2. `metrale compare --reference transformers --model DIR --prompt P --steps M --format json`, in fp32 and
     with `--compute bf16`, at their default tolerances: exit status and figures (rows' max rel err, max KL,
     top-1 agreement).  With --layers, each is run once more with `--layers all` for the largest layer
     tensor rel err and whether the layer check (rtol) passes.
Exit status 1 when a greedy run differs or a check (as run without --layers) does not exit 0; the --layers
runs are reported, not counted.

    python scripts/real_checkpoint_check.py DIR [--prompt P ...] [--steps 48] [--check-steps 16] [--layers]

metrale runs as a subprocess (the venv's `metrale`, i.e. this tree when installed editable); needs torch and
transformers (pip install 'metrale[reference]').  A developer tool: scripts/convert_gguf.py builds such
checkpoints from GGUF files.
"""

from __future__ import annotations

import argparse
import copy
import json
import shutil
import subprocess
import sys
from pathlib import Path

PROMPTS = [
    "The capital of France is",
    'def fibonacci(n):\n    """Return the n-th Fibonacci number."""\n',
    "Once upon a time, in a small village by the sea,",
    "Q: What is 17 times 23?\nA:",
    "Die Geschichte der Stadt Berlin beginnt",
    "List three uses of a paperclip:\n1.",
    "Photosynthesis is the process by which green plants",
]


def metrale_exe() -> list[str]:
    exe = Path(sys.executable).parent / "metrale"
    if exe.is_file():
        return [str(exe)]
    found = shutil.which("metrale")
    return [found] if found else [sys.executable, "-m", "metrale_cli"]


def metrale(args: list[str]) -> tuple[int, dict | None, str]:
    """Run metrale ARGS --format json: (exit status, parsed JSON or None, stderr)."""
    p = subprocess.run(metrale_exe() + args + ["--format", "json"], capture_output=True, text=True)
    try:
        out = json.loads(p.stdout)
    except json.JSONDecodeError:
        out = None
    return p.returncode, out, p.stderr.strip()


def top2(row) -> str:
    v, i = row.topk(2)
    return ", ".join(f"{int(t)}:{float(x):.4f}" for t, x in zip(i, v))


def hf_greedy(model, prompt_ids: list[int], steps: int):
    """transformers' fp32 greedy: (tokens, per-step logits rows)."""
    import torch
    cfg = copy.deepcopy(model.generation_config)
    cfg.do_sample, cfg.max_new_tokens, cfg.min_new_tokens = False, steps, None
    cfg.eos_token_id = None  # like --ignore-eos: every run produces `steps` tokens
    cfg.temperature = cfg.top_p = cfg.top_k = None
    cfg.return_dict_in_generate, cfg.output_logits = True, True
    ids = torch.tensor([prompt_ids])
    # generate fills a passed config's unset (None) fields from model.generation_config, so its EOS would
    # come back: the model's own config is swapped for this one while it runs.
    saved, model.generation_config = model.generation_config, cfg
    try:
        with torch.no_grad():
            out = model.generate(ids, attention_mask=torch.ones_like(ids), generation_config=cfg)
    finally:
        model.generation_config = saved
    if len(out.logits) != steps:
        raise RuntimeError(f"transformers generated {len(out.logits)} tokens, not {steps}")
    tokens = out.sequences[0, len(prompt_ids):].tolist()
    return tokens, [row[0].float() for row in out.logits]


def layer_max(d: dict) -> tuple[float, str]:
    worst = max(d["layers"]["tensors"], key=lambda t: t["rel_err"])
    return worst["rel_err"], worst["name"]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("model", help="checkpoint directory")
    ap.add_argument("--prompt", action="append", help="a prompt (repeatable; default: 7 built-in ones)")
    ap.add_argument("--steps", type=int, default=48, help="greedy tokens compared (default 48)")
    ap.add_argument("--check-steps", type=int, default=16, help="compare --reference --steps (default 16)")
    ap.add_argument("--layers", action="store_true", help="also run each check with --layers all")
    args = ap.parse_args(argv)
    try:
        import torch
        import transformers
        from transformers import AutoModelForCausalLM
    except ImportError as e:
        sys.exit(f"real_checkpoint_check: needs torch and transformers ({e}); pip install 'metrale[reference]'")
    prompts = args.prompt or PROMPTS
    print(f"model {args.model}; metrale {' '.join(metrale_exe())}; transformers {transformers.__version__}, "
          f"torch {torch.__version__}")
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32, attn_implementation="eager")
    model.eval()

    print(f"\n== greedy: metrale decode (CPU, default fp32 logits) vs transformers fp32 generate, {args.steps} steps")
    greedy = []
    for n, p in enumerate(prompts):
        rc, d, err = metrale(["decode", "--model", args.model, "--prompt", p, "--steps", str(args.steps),
                              "--ignore-eos", "--device", "cpu", "--top-k", "2"])
        if rc != 0 or d is None:
            print(f"[{n}] {p!r}: metrale decode exited {rc}: {err}")
            greedy.append(None)
            continue
        mine = [s["token"] for s in d["steps"]]
        ref, rows = hf_greedy(model, d["prompt_tokens"], args.steps)
        margins = [float(v[0] - v[1]) for v in (r.topk(2).values for r in rows)]
        same = mine == ref
        greedy.append(same)
        print(f"[{n}] {p!r}: {len(d['prompt_tokens'])} prompt tokens {d['prompt_tokens']}")
        print(f"    identical: {'yes' if same else 'NO'} ({len(mine)} metrale / {len(ref)} transformers tokens); "
              f"smallest transformers top-1/top-2 margin {min(margins):.4f} at step {margins.index(min(margins))}")
        if not same:
            k = next((i for i, (a, b) in enumerate(zip(mine, ref)) if a != b), min(len(mine), len(ref)))
            m2 = ", ".join(f"{t['token']}:{t['logit']:.4f}" for t in d["steps"][k]["top_k"]) if k < len(mine) else "-"
            print(f"    first difference at step {k}: metrale {mine[k] if k < len(mine) else '-'} (top-2 {m2}), "
                  f"transformers {ref[k] if k < len(ref) else '-'} (top-2 {top2(rows[k]) if k < len(rows) else '-'})")
        print(f"    text: {d['text']!r}")

    print(f"\n== reference checks: metrale compare --reference transformers --steps {args.check_steps}, "
          f"default tolerances")
    table = []
    for compute in ("fp32", "bf16"):
        for n, p in enumerate(prompts):
            base = ["compare", "--reference", "transformers", "--model", args.model, "--prompt", p,
                    "--steps", str(args.check_steps)] + (["--compute", "bf16"] if compute == "bf16" else [])
            rc, d, err = metrale(base)
            if d is None:
                print(f"[{compute} {n}] exited {rc}: {err}")
                continue
            lg = d["logits"]
            row = {"compute": compute, "prompt": n, "rc": rc, "passed": d["passed"],
                   "rel_err": max(r["rel_err"] for r in lg["row_stats"]), "kl_max": lg["softmax"]["kl_max"],
                   "top1": lg["top1"]["rate"], "tokens_identical": d["tokens_identical"], "tol": d["tolerances"]}
            line = (f"[{compute} {n}] exit {rc} ({'pass' if d['passed'] else 'FAIL'}): rel err {row['rel_err']:.3e}, "
                    f"KL max {row['kl_max']:.3e}, top-1 {lg['top1']['agree']}/{lg['top1']['rows']}, "
                    f"greedy tokens identical {d['tokens_identical']}")
            if d["failures"]:
                line += f"; failures: {d['failures']}"
            if args.layers:
                lrc, ld, lerr = metrale(base + ["--layers", "all"])
                if ld is None or "layers" not in ld or ld["layers"] is None:
                    line += f"\n    --layers all exited {lrc}: {lerr}"
                else:
                    row["layer"], name = layer_max(ld)
                    row["layers_passed"] = ld["layers"]["passed"]
                    line += (f"\n    --layers all: exit {lrc}; largest layer rel err {row['layer']:.3e} ({name}); "
                             f"{ld['layers']['summary']}")
            print(line)
            table.append(row)

    print("\n== summary (worst over prompts; margin = default tolerance / measured)")
    for compute in ("fp32", "bf16"):
        rows = [r for r in table if r["compute"] == compute]
        if not rows:
            continue
        t = rows[0]["tol"]
        rel, kl, top1 = max(r["rel_err"] for r in rows), max(r["kl_max"] for r in rows), min(r["top1"] for r in rows)
        s = (f"{compute}: {sum(r['rc'] == 0 for r in rows)}/{len(rows)} exit 0; rel err {rel:.3e} "
             f"(tol {t['max_rel_err']:g}, margin {t['max_rel_err'] / rel:.1f}x), KL {kl:.3e} "
             f"(tol {t['max_kl']:g}, margin {t['max_kl'] / max(kl, 1e-30):.1f}x), top-1 {top1:.3f} "
             f"(min {t['min_top1']:g})")
        if all("layer" in r for r in rows):
            lay = max(r["layer"] for r in rows)
            s += (f", layer rel err {lay:.3e} (rtol {t['rtol']:g}, margin {t['rtol'] / max(lay, 1e-30):.2f}x; "
                  f"layer check passed on {sum(r['layers_passed'] for r in rows)}/{len(rows)})")
        print(s)
    ok = [g for g in greedy if g is not None]
    print(f"greedy {args.steps} steps identical on {sum(ok)}/{len(prompts)} prompts")
    return 0 if all(greedy) and all(r["rc"] == 0 for r in table) else 1


if __name__ == "__main__":
    sys.exit(main())
