"""Make a deliberately perturbed copy of a metrale layer dump, to see `metrale compare` find the tensor.

    python scripts/perturb_layer_dump.py a.safetensors b.safetensors model.layers.2.mlp [--scale 1e-2] [--seed 0]

Every tensor is copied unchanged except TENSOR, which gets Gaussian noise of `scale` times its largest
magnitude (drawn with --seed, 0 by default, so the README's example output is reproducible).
Runs from a source checkout: `pip install` does not ship scripts/. The copy is written through metrale's own layer-dump writer,
so it keeps the positions, tokens and metadata of the original.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np

from metrale_cli.layer_dumps import LayerDumpInfo, read_layer_dump, write_layer_dump


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("src")
    ap.add_argument("dest")
    ap.add_argument("tensor")
    ap.add_argument("--scale", type=float, default=1e-2)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    dump = read_layer_dump(args.src)
    if args.tensor not in dump.tensors:
        raise SystemExit(f"{args.src} holds no tensor {args.tensor!r} (it holds {', '.join(dump.tensors)})")
    x = dump.tensors[args.tensor]
    noise = np.random.default_rng(args.seed).standard_normal(x.shape).astype(np.float32)
    dump.tensors[args.tensor] = x + np.float32(args.scale * np.abs(x).max()) * noise
    meta = dump.metadata
    info = LayerDumpInfo(meta.get("command", "forward"), meta.get("model", "?"), dump.tokens or [],
                         json.loads(meta.get("layers", "[]")))
    write_layer_dump(Path(args.dest), dump.tensors,
                     dump.positions or list(range(dump.rows or 0)), info)
    print(f"{args.dest}: {args.tensor} perturbed by {args.scale:g} x max|x|; every other tensor copied")


if __name__ == "__main__":
    main()
