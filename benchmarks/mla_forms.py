"""How far the two latent-attention algebras (`--mla naive`, transformers' per-head decompression, and `--mla absorbed`,
kv_b_proj folded into the query and the output as engines run it) lie apart at a real preset's sizes, on the NumPy
engine in fp32: the preset's random weights (configs/, as stored) cut to its first layers (the widths are the
preset's; a sparse layer of a large preset would not fit a CPU's memory), one prefill of a random prompt and greedy
decode steps in each form, every row compared (metrale compare's statistics).

    PYTHONPATH=. python3 benchmarks/mla_forms.py --preset deepseek-v3 --layers 3 --tokens 64 --steps 8
    PYTHONPATH=. python3 benchmarks/mla_forms.py --preset deepseek-v2-lite --layers 2 --json out.json

Prints one line per preset; with --json, writes the figures."""

from __future__ import annotations

import argparse
import gc
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import numpy as np  # noqa: E402

from metrale_cli.bench import preset_path  # noqa: E402
from metrale_cli.compare import compare_logits  # noqa: E402
from metrale_cli.compare_inputs import Matrix  # noqa: E402
from metrale_cli.config import parse_config  # noqa: E402
from metrale_cli.random_weights import RandomTensors  # noqa: E402


def cut(raw: dict, layers: int) -> dict:
    """The preset's config with its first `layers` layers (per-layer lists cut alike)."""
    out = dict(raw, num_hidden_layers=layers, num_nextn_predict_layers=0)
    for key in ("mlp_layer_types", "layer_types"):
        if key in out:
            out[key] = list(out[key])[:layers]
    return out


def rows_of(cfg, form: str, prompt: list[int], steps: list[int] | None) -> tuple[np.ndarray, list[int], float]:
    """fp32 logits [T + S, vocab]: the prompt's rows, then one per decode step (fed `steps`, or greedy when None)."""
    from metrale_cli.backends.numpy.engine import load_numpy_engine

    eng = load_numpy_engine(cfg, RandomTensors(cfg, seed=0), len(prompt) + 16, fp32_logits=True, mla=form)
    t0 = time.perf_counter()
    eng.prefill(prompt, all_logits=True)
    out = [eng._logits.copy()]
    fed = []
    for i in range(len(steps) if steps is not None else 8):
        tok = steps[i] if steps is not None else int(np.argmax(out[-1][-1]))
        fed.append(tok)
        eng.decode(tok)
        out.append(eng._decode_logits.copy())
    seconds = time.perf_counter() - t0
    del eng
    gc.collect()
    return np.concatenate(out).astype(np.float32), fed, seconds


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", required=True)
    ap.add_argument("--layers", type=int, default=2, help="the first N layers (default 2)")
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json")
    a = ap.parse_args()
    raw = json.loads(preset_path(a.preset).read_text())
    cfg = parse_config(cut(raw, a.layers), a.preset)
    if cfg.definition.layers[0].mixer.kind != "mla":
        print(f"{a.preset}: no latent attention", file=sys.stderr)
        return 2
    prompt = [int(t) for t in np.random.default_rng(a.seed).integers(0, cfg.vocab_size, a.tokens)]
    naive, fed, t_naive = rows_of(cfg, "naive", prompt, None)
    naive = naive[:a.tokens + a.steps]
    absorbed, _, t_abs = rows_of(cfg, "absorbed", prompt, fed[:a.steps])
    path = Path(a.preset)
    r = compare_logits(Matrix("A", path, "naive", "fp32", naive), Matrix("B", path, "absorbed", "fp32", absorbed))
    m = cfg.definition.layers[0].mixer
    fig = {"preset": a.preset, "layers": a.layers, "tokens": a.tokens, "steps": a.steps, "heads": m.num_heads,
           "kv_lora_rank": m.kv_lora_rank, "rel_err": r.overall.rel_err, "max_abs": r.overall.max_abs_diff,
           "kl_mean": r.softmax.kl_mean, "kl_max": r.softmax.kl_max, "top1_agree": r.top1_agree / r.rows,
           "seconds_naive": t_naive, "seconds_absorbed": t_abs}
    print(f"{a.preset}, first {a.layers} layers ({m.num_heads} heads, kv_lora {m.kv_lora_rank}), {a.tokens} prompt "
          f"rows + {a.steps} decode rows, naive vs absorbed (fp32): logits rel err {fig['rel_err']:.2e}, max |diff| "
          f"{fig['max_abs']:.2e}, mean KL {fig['kl_mean']:.2e}, max KL {fig['kl_max']:.2e}, top-1 agreement "
          f"{100 * fig['top1_agree']:.1f} % ({t_naive:.1f} s / {t_abs:.1f} s)")
    if a.json:
        Path(a.json).write_text(json.dumps(fig, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
