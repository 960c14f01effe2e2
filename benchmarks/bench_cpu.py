"""CPU benchmark: metrale's NumPy engine against transformers (torch, fp32, eager) on the same checkpoint.

    python benchmarks/bench_cpu.py [--layers 12] [--prompt 128] [--steps 32] [--threads N]

Builds one random Llama checkpoint of about 100M parameters with transformers (saved as fp32
safetensors in a temporary directory), then runs each engine in its own subprocess so that peak memory
is measured per engine: prefill time, per-token decode time (median over the steps), and peak RSS
against the budget "fp32 weights + KV cache + 25%". Prints a table and the ratio metrale / transformers.
Needs the `reference` extra (torch, transformers). Not a test: timings depend on the machine.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

SHAPE = dict(vocab_size=32000, hidden_size=768, intermediate_size=2048, num_attention_heads=12,
             num_key_value_heads=4, max_position_embeddings=2048, rms_norm_eps=1e-5, rope_theta=10000.0)


def build(path: Path, layers: int) -> None:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(**SHAPE, num_hidden_layers=layers, initializer_range=0.05, tie_word_embeddings=False)
    model = LlamaForCausalLM(cfg).float()
    model.save_pretrained(path)
    print(f"checkpoint: {sum(p.numel() for p in model.parameters()) / 1e6:.1f}M params", file=sys.stderr)


def rss_mb() -> float:
    """Peak resident memory of this process so far (VmHWM). Not ru_maxrss: Linux carries that across
    exec, so a child started by a large parent would report the parent's peak."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def run_metrale(path: str, prompt: list[int], steps: int) -> dict:
    import numpy as np

    from metrale_cli.model import open_model

    base = rss_mb()
    t0 = time.perf_counter()
    m = open_model(path, device="cpu", max_context=len(prompt) + steps + 1, fp32_logits=True)
    load = time.perf_counter() - t0
    e = m.engine
    e.prefill(prompt[:8])  # warm-up: first-call costs stay out of the numbers
    e.decode(1)
    e.reset()
    t0 = time.perf_counter()
    e.prefill(prompt)
    prefill = time.perf_counter() - t0
    tok = e.argmax_on_device(e.logits_buffer_ptr().row_ptr(0))
    times, tokens = [], []
    for _ in range(steps):
        t0 = time.perf_counter()
        e.decode(tok)
        tok = e.argmax_on_device(e.decode_logits_ptr())
        times.append(time.perf_counter() - t0)
        tokens.append(tok)
    kv = sum(state.nbytes for state in e.states.values())
    weights = m.config.parameter_count() * 4
    return dict(load_s=load, prefill_s=prefill, decode_ms=1000 * float(np.median(times)), tokens=tokens,
                peak_rss_mb=rss_mb(), base_rss_mb=base, weights_mb=weights / 2**20, kv_mb=kv / 2**20)


def run_transformers(path: str, prompt: list[int], steps: int) -> dict:
    import numpy as np
    import torch
    from transformers import AutoModelForCausalLM, DynamicCache

    base = rss_mb()
    t0 = time.perf_counter()
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="eager").eval()
    load = time.perf_counter() - t0
    ids = torch.tensor([prompt])
    times, tokens = [], []
    with torch.inference_mode():
        warm = model(ids[:, :8], past_key_values=DynamicCache(), use_cache=True)  # warm-up
        model(torch.tensor([[1]]), past_key_values=warm.past_key_values, use_cache=True)
        cache = DynamicCache()
        t0 = time.perf_counter()
        out = model(ids, past_key_values=cache, use_cache=True, logits_to_keep=1)
        prefill = time.perf_counter() - t0
        tok = int(out.logits[0, -1].argmax())
        for _ in range(steps):
            t0 = time.perf_counter()
            out = model(torch.tensor([[tok]]), past_key_values=out.past_key_values, use_cache=True)
            tok = int(out.logits[0, -1].argmax())
            times.append(time.perf_counter() - t0)
            tokens.append(tok)
    return dict(load_s=load, prefill_s=prefill, decode_ms=1000 * float(np.median(times)), tokens=tokens,
                peak_rss_mb=rss_mb(), base_rss_mb=base)


def child(args) -> None:
    import numpy as np

    if args.threads:
        import torch

        torch.set_num_threads(args.threads)
    prompt = [int(t) for t in np.random.default_rng(1).integers(0, SHAPE["vocab_size"], args.prompt)]
    fn = run_metrale if args.child == "metrale" else run_transformers
    print(json.dumps(fn(args.path, prompt, args.steps)))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", type=int, default=12)
    ap.add_argument("--prompt", type=int, default=128)
    ap.add_argument("--steps", type=int, default=32)
    ap.add_argument("--threads", type=int, default=0, help="torch threads (default: torch's choice)")
    ap.add_argument("--child", choices=["metrale", "transformers"])
    ap.add_argument("--path")
    ap.add_argument("--json", help="write the results here")
    args = ap.parse_args()
    if args.child:
        return child(args)
    with tempfile.TemporaryDirectory() as tmp:
        build(Path(tmp), args.layers)
        res = {}
        for name in ("transformers", "metrale"):
            cmd = [sys.executable, __file__, "--child", name, "--path", tmp, "--prompt", str(args.prompt),
                   "--steps", str(args.steps), "--threads", str(args.threads)]
            env = dict(os.environ, PYTHONPATH=str(Path(__file__).resolve().parents[1]))
            res[name] = json.loads(subprocess.run(cmd, check=True, capture_output=True, text=True,
                                                  env=env).stdout.splitlines()[-1])
    t, m = res["transformers"], res["metrale"]
    budget = (m["weights_mb"] + m["kv_mb"]) * 1.25
    used = m["peak_rss_mb"] - m["base_rss_mb"]
    print(f"{'':24}{'transformers':>14}{'metrale':>12}{'ratio':>8}")
    print(f"{'prefill ' + str(args.prompt) + ' tokens (s)':24}{t['prefill_s']:>14.3f}{m['prefill_s']:>12.3f}"
          f"{m['prefill_s'] / t['prefill_s']:>8.2f}")
    print(f"{'decode (ms/token)':24}{t['decode_ms']:>14.2f}{m['decode_ms']:>12.2f}"
          f"{m['decode_ms'] / t['decode_ms']:>8.2f}")
    print(f"same greedy tokens: {t['tokens'] == m['tokens']}")
    print(f"metrale peak memory: {used:.0f} MiB above start (budget fp32 weights {m['weights_mb']:.0f} + "
          f"KV {m['kv_mb']:.0f} MiB + 25% = {budget:.0f} MiB): {'within' if used <= budget else 'OVER'}")
    if args.json:
        Path(args.json).write_text(json.dumps(res, indent=2))


if __name__ == "__main__":
    main()
