"""CPU benchmark of the NumPy engine on a preset's random weights: load, prefill, decode tok/s, peak RSS.

    python benchmarks/bench_cpu_stored.py --preset llama-3.2-1b [--prompt 128] [--steps 16] [--threads N]
        [--tree DIR ...] [--rounds 2]

Random BF16 weights (RandomTensors, as `metrale bench` draws them) for a preset in configs/, so no
checkpoint is needed, an 8B one included: drawn into memory, or with `--checkpoint DIR` written once as a
safetensors checkpoint and memory-mapped from it as a real checkpoint is. Each run is its own process (peak
RSS per run, VmHWM); with `--tree DIR` the same measurement also runs on other source trees of metrale
(for example an older commit, `git archive <commit> | tar -x -C DIR`), the trees interleaved round by
round so that a busy machine weighs on each alike. Prints per tree the medians over rounds: load s, prefill tok/s, decode
tok/s (the median step, argmax included), peak RSS and the stored weight bytes + KV cache it is held to.
Not a test: timings depend on the machine and its load.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def peak_rss_mib() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def write_checkpoint(preset: str, directory: Path) -> None:
    """The preset's random weights (RandomTensors, seed 0) as a one-file safetensors checkpoint, written a
    tensor at a time (no copy of the whole model in memory)."""
    import shutil

    from metrale_cli.bench import preset_path
    from metrale_cli.config import load_config
    from metrale_cli.random_weights import RandomTensors

    directory.mkdir(parents=True, exist_ok=True)
    path = preset_path(preset)
    cfg = load_config(path)
    source = RandomTensors(cfg, seed=0)
    header, offset = {}, 0
    for name in source.tensor_names():
        info = source.info(name)
        header[name] = {"dtype": info.dtype, "shape": list(info.shape), "data_offsets": [offset, offset + info.nbytes]}
        offset += info.nbytes
    raw = json.dumps(header).encode()
    raw += b" " * (-len(raw) % 8)
    with open(directory / "model.safetensors.tmp", "wb") as f:
        f.write(len(raw).to_bytes(8, "little") + raw)
        for name in source.tensor_names():
            f.write(source.array(name, bf16_bits=True).tobytes())
    os.replace(directory / "model.safetensors.tmp", directory / "model.safetensors")
    shutil.copyfile(path, directory / "config.json")


def child(args) -> dict:
    import numpy as np

    from metrale_cli.backends.numpy.engine import load_numpy_engine
    from metrale_cli.bench import preset_path
    from metrale_cli.checkpoint import Checkpoint
    from metrale_cli.config import load_config
    from metrale_cli.random_weights import RandomTensors

    cfg = load_config(Path(args.checkpoint) if args.checkpoint else preset_path(args.preset))
    ctx = args.prompt + args.steps + 8
    t0 = time.perf_counter()
    source = Checkpoint.open(Path(args.checkpoint)) if args.checkpoint else RandomTensors(cfg, seed=0)
    kw = {"threads": args.threads} if args.threads and "threads" in load_numpy_engine.__code__.co_varnames else {}
    e = load_numpy_engine(cfg, source, ctx, **kw)
    load = time.perf_counter() - t0
    prompt = [int(t) for t in np.random.default_rng(1).integers(0, cfg.vocab_size, args.prompt)]
    e.prefill(prompt[:4])  # warm-up: first-call costs (kernel loading) stay out of the figures
    e.decode(1)
    e.reset()
    t0 = time.perf_counter()
    e.prefill(prompt)
    prefill = time.perf_counter() - t0
    tok = e.argmax_on_device(e.logits_buffer_ptr().row_ptr(0))
    times = []
    for _ in range(args.steps):
        t0 = time.perf_counter()
        e.decode(tok)
        tok = e.argmax_on_device(e.decode_logits_ptr())
        times.append(time.perf_counter() - t0)
    kv = sum(s.nbytes for s in e.states.values())
    stored = sum(source.info(n).nbytes for n in source.tensor_names())
    return dict(load_s=load, prefill_tok_s=args.prompt / prefill, decode_tok_s=1 / float(np.median(times)),
                peak_rss_mib=peak_rss_mib(), stored_mib=stored / 2**20, kv_mib=kv / 2**20)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="llama-3.2-1b")
    ap.add_argument("--prompt", type=int, default=128)
    ap.add_argument("--steps", type=int, default=16)
    ap.add_argument("--threads", type=int, default=0, help="metrale's --threads (default: the cores available)")
    ap.add_argument("--tree", action="append", default=[], help="another metrale source tree to time alike")
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--checkpoint", metavar="DIR",
                    help="write the random weights there as a safetensors checkpoint (once) and load that: weights "
                         "memory-mapped from a file, as a real checkpoint's, instead of drawn into memory")
    ap.add_argument("--child", action="store_true")
    args = ap.parse_args()
    if args.child:
        print(json.dumps(child(args)))
        return
    if args.checkpoint and not (Path(args.checkpoint) / "model.safetensors").is_file():
        write_checkpoint(args.preset, Path(args.checkpoint))
    trees = [str(ROOT)] + args.tree
    results: dict[str, list[dict]] = {t: [] for t in trees}
    for _ in range(args.rounds):
        for tree in trees:
            cmd = [sys.executable, str(Path(__file__).resolve()), "--child", "--preset", args.preset,
                   "--prompt", str(args.prompt), "--steps", str(args.steps), "--threads", str(args.threads)]
            cmd += ["--checkpoint", str(Path(args.checkpoint).resolve())] if args.checkpoint else []
            out = subprocess.run(cmd, check=True, capture_output=True, text=True,
                                 env=dict(os.environ, PYTHONPATH=tree), cwd=tree)
            results[tree].append(json.loads(out.stdout.splitlines()[-1]))
    print(f"{args.preset}: prompt {args.prompt}, {args.steps} decode steps, {args.rounds} round(s), "
          f"load average {os.getloadavg()[0]:.2f} on {os.cpu_count()} cores")
    print(f"{'tree':40}{'load s':>8}{'prefill tok/s':>15}{'decode tok/s':>14}{'peak RSS MiB':>14}{'stored+KV MiB':>15}")
    for tree, runs in results.items():
        med = {k: sorted(r[k] for r in runs)[len(runs) // 2] for k in runs[0]}
        print(f"{tree[-40:]:40}{med['load_s']:>8.1f}{med['prefill_tok_s']:>15.1f}{med['decode_tok_s']:>14.2f}"
              f"{med['peak_rss_mib']:>14.0f}{med['stored_mib'] + med['kv_mib']:>15.0f}")


if __name__ == "__main__":
    main()
