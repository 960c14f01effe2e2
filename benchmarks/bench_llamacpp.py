"""metrale's CPU engine and llama.cpp side by side on the same checkpoint: prefill and decode tok/s, peak RSS.

    python benchmarks/bench_llamacpp.py --llamacpp DIR --work DIR [--preset llama-3.2-1b | --checkpoint HF_DIR]
        [--dtype bf16|f32] [--prompt 128] [--steps 64] [--threads 2] [--rounds 3]

`--llamacpp DIR`: a llama.cpp source tree built from source with `llama-bench` (for example the copy vendored in
the llama-cpp-python sdist: `cmake -B build -DGGML_NATIVE=ON && cmake --build build --target llama-bench -j2`);
its `convert_hf_to_gguf.py` (needs the `gguf` package) converts the checkpoint to GGUF at `--dtype`, once, into
`--work`. The checkpoint: a Hugging Face directory, or a preset's random weights written there once (BF16, with the
embedded default model's tokenizer so that the converter has a vocabulary; the tokens are random anyway). metrale
reads the same weights at the same dtype (an F32 copy of a BF16 checkpoint for `--dtype f32`).

Each round runs llama-bench (`-p PROMPT -n STEPS -t THREADS -r 1`, its own prefill and decode timing) and
metrale (benchmarks/bench_cpu_stored.py's measurement in a process of its own: prefill of PROMPT tokens, the
median decode step), interleaved, and prints the medians and the ratios metrale / llama.cpp. Peak RSS: metrale's
VmHWM; llama.cpp's maximum resident set from /usr/bin/time when it is there. Not a test: timings depend on the
machine and its load (the load average is printed).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).resolve().parent))


def hf_checkpoint(args) -> Path:
    """The Hugging Face checkpoint to run: given, or the preset's random weights written once (with a tokenizer)."""
    if args.checkpoint:
        return Path(args.checkpoint)
    import bench_cpu_stored

    out = Path(args.work) / f"{args.preset}-bf16"
    if not (out / "model.safetensors").is_file():
        bench_cpu_stored.write_checkpoint(args.preset, out)
    config = json.loads((out / "config.json").read_text())
    if "architectures" not in config:  # presets leave it out; the converter picks its model class by it
        from metrale_cli.models import FAMILIES

        config["architectures"] = [FAMILIES[config["model_type"]].hf_class]
        (out / "config.json").write_text(json.dumps(config, indent=2))
    default = ROOT / "metrale_cli" / "assets" / "models" / "default"
    for name in ("tokenizer.json", "tokenizer_config.json"):
        if (default / name).is_file() and not (out / name).is_file():
            shutil.copyfile(default / name, out / name)
    return out


def as_dtype(src: Path, dtype: str, work: Path) -> Path:
    """src with every floating tensor at dtype (a copy, once), for metrale to read what llama.cpp reads."""
    if dtype == "bf16":
        return src
    out = work / f"{src.name}-{dtype}"
    if (out / "model.safetensors").is_file():
        return out
    import numpy as np
    from safetensors.numpy import save_file

    from metrale_cli.checkpoint import Checkpoint

    out.mkdir(parents=True, exist_ok=True)
    with Checkpoint.open(src) as ckpt:
        tensors = {n: np.asarray(ckpt.array(n), np.float32) for n in ckpt.tensor_names()}
    save_file(tensors, str(out / "model.safetensors"))
    for f in src.iterdir():
        if f.suffix == ".json" and f.name != "model.safetensors.index.json":
            shutil.copyfile(f, out / f.name)
    return out


# The converter names a BPE tokenizer by its hash and does not know the embedded model's GPT-2 byte-level BPE:
# told "gpt-2" (as scripts/make_llamacpp_fixtures.py does); the tokens are irrelevant to the timings.
CONVERT = """
import sys
sys.path[:0] = [{src!r}, {gguf!r}]
import conversion.base as base
base.TextModel.get_vocab_base_pre = lambda self, tokenizer: "gpt-2"
import runpy
sys.argv = ["convert_hf_to_gguf.py", {model!r}, "--outtype", {dtype!r}, "--outfile", {out!r}]
runpy.run_path({script!r}, run_name="__main__")
"""


def gguf(hf: Path, dtype: str, llamacpp: Path, work: Path) -> Path:
    out = work / f"{hf.name}-{dtype}.gguf"
    if not out.is_file():
        code = CONVERT.format(src=str(llamacpp), gguf=str(llamacpp / "gguf-py"), model=str(hf), dtype=dtype,
                              out=str(out), script=str(llamacpp / "convert_hf_to_gguf.py"))
        subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True)
    return out


def llama_bench(binary: Path, model: Path, args) -> dict:
    cmd = [str(binary), "-m", str(model), "-p", str(args.prompt), "-n", str(args.steps), "-t", str(args.threads),
           "-r", "1", "-o", "json"]
    timer = shutil.which("time") or ("/usr/bin/time" if Path("/usr/bin/time").is_file() else None)
    if timer:
        cmd = [timer, "-v"] + cmd
    r = subprocess.run(cmd, check=True, capture_output=True, text=True)
    rows = json.loads(r.stdout[r.stdout.index("["):])
    out = {"prefill_tok_s": next(x["avg_ts"] for x in rows if x["n_prompt"] > 0 and x["n_gen"] == 0),
           "decode_tok_s": next(x["avg_ts"] for x in rows if x["n_gen"] > 0 and x["n_prompt"] == 0)}
    for line in r.stderr.splitlines():
        if "Maximum resident set size" in line:
            out["peak_rss_mib"] = int(line.split(":")[1]) / 1024
    return out


def metrale(hf: Path, args) -> dict:
    cmd = [sys.executable, str(ROOT / "benchmarks" / "bench_cpu_stored.py"), "--child", "--checkpoint", str(hf),
           "--prompt", str(args.prompt), "--steps", str(args.steps), "--threads", str(args.threads)]
    r = subprocess.run(cmd, check=True, capture_output=True, text=True, env=dict(os.environ, PYTHONPATH=str(ROOT)))
    return json.loads(r.stdout.splitlines()[-1])


def median(runs: list[dict], key: str) -> float:
    values = sorted(r[key] for r in runs if key in r)
    return values[len(values) // 2] if values else float("nan")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--llamacpp", required=True, help="llama.cpp source tree with build/bin/llama-bench")
    ap.add_argument("--work", required=True, help="where the checkpoint copies and GGUF files are kept")
    ap.add_argument("--preset", default="llama-3.2-1b")
    ap.add_argument("--checkpoint", help="a Hugging Face checkpoint directory (instead of the preset's random weights)")
    ap.add_argument("--dtype", choices=("bf16", "f32"), default="bf16")
    ap.add_argument("--prompt", type=int, default=128)
    ap.add_argument("--steps", type=int, default=64)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    llamacpp, work = Path(args.llamacpp), Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    binary = llamacpp / "build" / "bin" / "llama-bench"
    hf = hf_checkpoint(args)
    model = gguf(hf, args.dtype, llamacpp, work)
    ours = as_dtype(hf, args.dtype, work)
    runs: dict[str, list[dict]] = {"metrale": [], "llama.cpp": []}
    for _ in range(args.rounds):
        runs["llama.cpp"].append(llama_bench(binary, model, args))
        runs["metrale"].append(metrale(ours, args))
    print(f"{hf.name} at {args.dtype}: prompt {args.prompt}, {args.steps} decode steps, {args.threads} threads, "
          f"{args.rounds} interleaved round(s), load average {os.getloadavg()[0]:.2f} on {os.cpu_count()} cores")
    print(f"{'':12}{'prefill tok/s':>15}{'decode tok/s':>14}{'peak RSS MiB':>14}")
    for name, r in runs.items():
        print(f"{name:12}{median(r, 'prefill_tok_s'):>15.1f}{median(r, 'decode_tok_s'):>14.2f}"
              f"{median(r, 'peak_rss_mib'):>14.0f}")
    m, l = runs["metrale"], runs["llama.cpp"]
    print(f"{'ratio':12}{median(m, 'prefill_tok_s') / median(l, 'prefill_tok_s'):>15.2f}"
          f"{median(m, 'decode_tok_s') / median(l, 'decode_tok_s'):>14.2f}"
          f"{median(m, 'peak_rss_mib') / median(l, 'peak_rss_mib'):>14.2f}")


if __name__ == "__main__":
    main()
