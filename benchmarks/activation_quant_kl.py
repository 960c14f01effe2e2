"""How much `--activation-quant emulate` moves a quantized model's logits: a preset's random weights (configs/, in
their stored format) loaded twice, without and with the checkpoint's activation quantization, one prefill of the
same random prompt each, every position's logits compared (metrale compare's statistics: mean and max KL, top-1
agreement):

    PYTHONPATH=. python3 benchmarks/activation_quant_kl.py --preset qwen3-8b-fp8 --device cuda --tokens 256
    PYTHONPATH=. python3 benchmarks/activation_quant_kl.py --preset path/to/config.json --device cpu --tokens 40

Prints one line per mode pair and, with --json, writes the figures."""

from __future__ import annotations

import argparse
import gc
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import numpy as np  # noqa: E402

from metrale_cli.bench import preset_path  # noqa: E402
from metrale_cli.compare import compare_logits  # noqa: E402
from metrale_cli.compare_inputs import Matrix  # noqa: E402
from metrale_cli.config import load_config  # noqa: E402
from metrale_cli.random_weights import RandomTensors  # noqa: E402


def prefill_logits(cfg, device: str, mode: str, prompt: list[int]) -> np.ndarray:
    """fp32 [T, vocab]: every position's logits of one prefill of `prompt` with activation quantization `mode`."""
    source = RandomTensors(cfg, seed=0)
    if device == "cuda":
        from metrale_cli.backends.cuda.loading import load_cuda_engine

        eng = load_cuda_engine(cfg, source, len(prompt) + 8, activation_quant=mode)
    else:
        from metrale_cli.backends.numpy.engine import load_numpy_engine

        eng = load_numpy_engine(cfg, source, len(prompt) + 8, activation_quant=mode)
    eng.prefill(prompt, all_logits=True)
    ptr = eng.logits_buffer_ptr()
    rows = []
    for i in range(ptr.rows):
        buf = bytearray(eng.row_nbytes(ptr))
        eng.copy_logits_to_host(ptr.row_ptr(i), buf)
        rows.append(np.frombuffer(buf, np.float32).copy() if eng.logits_ptr_is_fp32(ptr)
                    else (np.frombuffer(buf, np.uint16).astype(np.uint32) << 16).view(np.float32))
    del eng
    gc.collect()
    if device == "cuda":
        import cupy as cp

        cp.get_default_memory_pool().free_all_blocks()
    return np.stack(rows)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", required=True)
    ap.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    ap.add_argument("--tokens", type=int, default=256)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json")
    a = ap.parse_args()
    cfg = load_config(preset_path(a.preset))
    if not cfg.quantization:
        print(f"{a.preset}: not a quantized preset", file=sys.stderr)
        return 2
    prompt = [int(t) for t in np.random.default_rng(a.seed).integers(0, cfg.vocab_size, a.tokens)]
    none = prefill_logits(cfg, a.device, "none", prompt)
    emulated = prefill_logits(cfg, a.device, "emulate", prompt)
    path = Path(a.preset)
    r = compare_logits(Matrix("A", path, "none", "fp32", none), Matrix("B", path, "emulate", "fp32", emulated))
    fig = {"preset": a.preset, "device": a.device, "tokens": a.tokens, "kl_mean": r.softmax.kl_mean,
           "kl_max": r.softmax.kl_max, "top1_agree": r.top1_agree / r.rows, "rel_err": r.overall.rel_err}
    print(f"{a.preset} on {a.device}, {a.tokens} positions, --activation-quant none vs emulate: mean KL "
          f"{fig['kl_mean']:.3e}, max KL {fig['kl_max']:.3e}, top-1 agreement {100 * fig['top1_agree']:.1f} %, "
          f"logits rel err {fig['rel_err']:.3e}")
    if a.json:
        Path(a.json).write_text(json.dumps(fig, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
