"""A preset's multi-token-prediction layer at its real widths on the NumPy engine: random weights in the preset's
stored formats (configs/; GLM-4.5-Air's FP8 blocks, eh_proj dense), the decoder cut to its first layers (the MTP
layer needs one sparse layer's sizes), one pass of random tokens and hidden rows; prints the load and pass times and
whether every logit is finite.

    PYTHONPATH=. python3 benchmarks/mtp_layer.py --preset glm-4.5-air-fp8 --tokens 16
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import numpy as np  # noqa: E402

from metrale_cli.backends.numpy.engine import read_weights  # noqa: E402
from metrale_cli.backends.numpy.mtp import NumpyMtpEngine  # noqa: E402
from metrale_cli.bench import preset_path  # noqa: E402
from metrale_cli.config import parse_config  # noqa: E402
from metrale_cli.models.mtp import mtp_config  # noqa: E402
from metrale_cli.random_weights import RandomTensors  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", required=True)
    ap.add_argument("--layers", type=int, default=2, help="the decoder's first N layers (one of them sparse)")
    ap.add_argument("--tokens", type=int, default=16)
    a = ap.parse_args()
    raw = json.loads(preset_path(a.preset).read_text())
    cfg = parse_config(dict(raw, num_hidden_layers=a.layers), a.preset)
    mcfg = mtp_config(cfg)
    eh = next(p for p in mcfg.definition.layers[0].params if p.key == "mtp_eh_proj")
    t0 = time.perf_counter()
    mtp = NumpyMtpEngine(mcfg, read_weights(mcfg, RandomTensors(mcfg, seed=0)), a.tokens + 8, fp32_logits=True)
    loaded = time.perf_counter() - t0
    rng = np.random.default_rng(0)
    tokens = [int(t) for t in rng.integers(0, cfg.vocab_size, a.tokens)]
    t0 = time.perf_counter()
    n = mtp.run(tokens, rng.standard_normal((a.tokens, cfg.hidden_size)).astype(np.float32), all_logits=True)
    ran = time.perf_counter() - t0
    formats = sorted({p.format or "dense" for p in mcfg.definition.layers[0].params})
    print(f"{a.preset}: MTP layer {mtp.layer} ({', '.join(formats)}; eh_proj {list(eh.shape)} "
          f"{eh.format or 'dense'}): loaded in {loaded:.1f} s, {n} rows in {ran:.2f} s, finite: "
          f"{bool(np.isfinite(mtp._logits).all())}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
