"""Measure how far a correct metrale is from transformers, per model and precision pair: the figures behind
`compare --reference`'s default tolerances (reference_check.DEFAULT_TOLERANCES, its help and the README).

For the embedded default model (a real trained model) and every fixture family (tests/fixtures/models/*),
for each pair (fp32: fp32 on both sides; bf16: metrale's bf16 compute against transformers' bf16 forward,
both on the CPU) it runs the reference check on --prompts random prompts (seeded) of --length tokens plus
--steps greedy steps, every layer tapped, and prints the largest per-row max|Δ|/max|A|, the largest per-row
KL(P_A || P_B), the lowest top-1 agreement, and the largest layer tensor rel err, over every row of every
prompt; then the worst over all models, beside the current defaults.

    PYTHONPATH=. python scripts/measure_reference_margins.py [--prompts 4] [--length 24] [--steps 8]

Needs torch and transformers (pip install 'metrale[reference]'); a few minutes on 2 cores.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from metrale_cli.compare import Tolerances  # noqa: E402
from metrale_cli.layer_dumps import parse_layers  # noqa: E402
from metrale_cli.model import open_model  # noqa: E402
from metrale_cli.reference_check import DEFAULT_TOLERANCES, check_reference, pair_precision  # noqa: E402

FIXTURES = ROOT / "tests" / "fixtures" / "models"
NO_LIMIT = Tolerances(max_kl=1e30, max_rel_err=1e30, min_top1=0.0, rtol=1e30)  # report, never fail


def models() -> list[tuple[str, str]]:
    """(label, --model) of the embedded model and every fixture family."""
    return [("default", "default")] + [(p.name, str(p)) for p in sorted(FIXTURES.iterdir())
                                       if (p / "config.json").is_file()]


def measure(path: str, pair: str, prompts: int, length: int, steps: int) -> dict[str, float]:
    precision = pair_precision("cpu", pair, pair)
    rng = np.random.default_rng(0)
    worst = {"rel_err": 0.0, "kl": 0.0, "top1": 1.0, "layers": 0.0, "rows": 0}
    for _ in range(prompts):
        loaded = open_model(path, device="cpu", max_context=length + steps, fp32_logits=pair == "fp32",
                            compute=precision.compute)
        try:
            prompt = rng.integers(0, loaded.config.vocab_size, length).tolist()
            r = check_reference(loaded.engine, loaded.config, directory=loaded.path, model=path,
                                precision=precision, prompt=prompt, steps=steps,
                                layers=parse_layers(None, loaded.config.num_hidden_layers), tolerances=NO_LIMIT)
        finally:
            loaded.close()
        rows = r.logits.row_stats
        worst["rel_err"] = max(worst["rel_err"], max(s.errors.rel_err for s in rows))
        worst["kl"] = max(worst["kl"], max(s.kl for s in rows))
        worst["top1"] = min(worst["top1"], r.logits.top1_rate)
        worst["layers"] = max(worst["layers"], max(t.errors.rel_err for t in r.layers.tensors))
        worst["rows"] += len(rows)
    return worst


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--length", type=int, default=24)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--only", help="comma separated model labels (default: all)")
    args = ap.parse_args()
    chosen = [m for m in models() if args.only is None or m[0] in args.only.split(",")]
    print(f"{args.prompts} prompts x ({args.length} random tokens + {args.steps} steps) per model, every row "
          "and every layer tap; CPU, transformers eager")
    print(f"{'model':<16} {'pair':<5} {'rows':>5} {'max rel_err':>12} {'max KL':>10} {'min top1':>9} "
          f"{'max layer rel':>14}")
    overall: dict[str, dict[str, float]] = {}
    for label, path in chosen:
        for pair in ("fp32", "bf16"):
            try:
                w = measure(path, pair, args.prompts, args.length, args.steps)
            except Exception as e:  # a family transformers cannot load is reported, not fatal
                print(f"{label:<16} {pair:<5} failed: {type(e).__name__}: {' '.join(str(e).split())[:80]}")
                continue
            print(f"{label:<16} {pair:<5} {w['rows']:>5} {w['rel_err']:>12.2e} {w['kl']:>10.2e} "
                  f"{w['top1']:>9.4f} {w['layers']:>14.2e}")
            o = overall.setdefault(pair, {"rel_err": 0.0, "kl": 0.0, "top1": 1.0, "layers": 0.0})
            o.update(rel_err=max(o["rel_err"], w["rel_err"]), kl=max(o["kl"], w["kl"]),
                     top1=min(o["top1"], w["top1"]), layers=max(o["layers"], w["layers"]))
    print()
    for pair, o in overall.items():
        d = DEFAULT_TOLERANCES[pair]
        print(f"worst {pair}: rel_err {o['rel_err']:.2e} (default --max-rel-err {d.max_rel_err:g}), "
              f"KL {o['kl']:.2e} (--max-kl {d.max_kl:g}), top1 {o['top1']:.4f} (--min-top1 {d.min_top1:g}), "
              f"layers {o['layers']:.2e} (--rtol {d.rtol:g})")


if __name__ == "__main__":
    main()
