"""Captured layers equal transformers' hidden states, for every fixture family (skipped without it).

transformers' `output_hidden_states` gives L + 1 entries: [0] the embeddings, [i + 1] the residual
stream after layer i for i < L - 1, and [L] the output of the final norm (its last layer's residual
stream is not returned). metrale's taps `model.embed_tokens`, `model.layers.{i}` and `model.norm` are
checked against exactly those.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from metrale_cli.engine.observe import capture  # noqa: E402
from metrale_cli.model import open_model  # noqa: E402

pytestmark = pytest.mark.reference

FIXTURES = Path(__file__).parent / "fixtures" / "models"


def _loaded_as_stored(path) -> bool:
    """Whether transformers' plain load computes with the checkpoint's exact values: not so for compressed-tensors
    (it runs the compressed modules, or rounds decompressed NVFP4 to bf16) and ModelOpt checkpoints (no CPU load),
    which tests/test_quantized_compressed.py checks end to end (logits, greedy rows, weights bit for bit) against
    transformers' fp32 forward on the package's own fp32 decompression instead."""
    import json

    qc = json.loads((path / "config.json").read_text()).get("quantization_config") or {}
    return qc.get("quant_method") not in ("compressed-tensors", "modelopt")


@pytest.mark.parametrize("name", sorted(p.name for p in FIXTURES.iterdir()
                                        if (p / "config.json").is_file() and _loaded_as_stored(p)))
def test_layers_equal_transformers_hidden_states(name):
    m = open_model(FIXTURES / name, device="cpu", fp32_logits=True)
    if m.config.quantization is not None:  # transformers dequantizes a quantized checkpoint through accelerate
        pytest.importorskip("accelerate")
    rng = np.random.default_rng()
    tokens = rng.integers(0, m.config.vocab_size, 11)
    got = capture(m.engine, tokens.tolist(), lambda n: True)
    model = transformers.AutoModelForCausalLM.from_pretrained(FIXTURES / name, dtype=torch.float32,
                                                              attn_implementation="eager").eval()
    with torch.no_grad():
        hs = model(torch.from_numpy(tokens)[None], output_hidden_states=True).hidden_states
    L = m.config.num_hidden_layers
    assert len(hs) == L + 1
    pairs = [("model.embed_tokens", hs[0])] + [(f"model.layers.{i}", hs[i + 1]) for i in range(L - 1)]
    pairs.append(("model.norm", hs[L]))
    # Gated DeltaNet layers: both chunked rules' fp32 roundings reach 1.1e-5 on some draws (tests/test_reference_linear.py)
    bound = 2e-5 if any(layer.mixer.kind == "linear_attention" for layer in m.config.definition.layers) else 1e-5
    for key, ref in pairs:
        ref = ref[0].numpy()
        err = np.abs(got[key] - ref).max() / np.abs(ref).max()
        assert err < bound, f"{name} {key}: rel err {err:.2e}"
    # what the README says: the last layer's residual stream is not hidden_states[L] (that is after the norm)
    last, after_norm = got[f"model.layers.{L - 1}"], hs[L][0].numpy()
    assert np.abs(last - after_norm).max() / np.abs(after_norm).max() > 1e-2, name
