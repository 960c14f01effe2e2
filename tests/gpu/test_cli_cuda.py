"""The CLI on the GPU: the same shapes and argmaxes as on the CPU, dumps included; OOM is a clear error."""

from __future__ import annotations

import json

import numpy as np
import pytest
from safetensors.numpy import load_file

pytestmark = pytest.mark.gpu


def run_json(run_cli, *args):
    r = run_cli(*args, "--format", "json")
    assert r.exit_code == 0, r.stderr
    return json.loads(r.stdout)


def test_decode_matches_cpu(cp, run_cli, tmp_path):
    args = ["decode", "--prompt", "The while statement", "--steps", "24", "--ignore-eos", "--top-k", "3"]
    gpu = run_json(run_cli, *args, "--device", "cuda", "--dump-logits", str(tmp_path / "g.safetensors"))
    cpu = run_json(run_cli, *args, "--device", "cpu", "--dump-logits", str(tmp_path / "c.safetensors"))
    assert gpu["device"] == "cuda" and cpu["device"] == "cpu"
    assert [s["token"] for s in gpu["steps"]] == [s["token"] for s in cpu["steps"]]
    g, c = load_file(str(tmp_path / "g.safetensors")), load_file(str(tmp_path / "c.safetensors"))
    assert g["logits"].shape == c["logits"].shape and np.array_equal(g["tokens"], c["tokens"])
    gl, cl = g["logits"].astype(np.float32), c["logits"].astype(np.float32)
    assert np.array_equal(gl.argmax(1), cl.argmax(1))
    assert np.linalg.norm(gl - cl) / np.linalg.norm(cl) <= 2e-2


@pytest.mark.parametrize("dtype, ext", [("bf16", "npy"), ("fp32", "bin")])
def test_verify_k4_matches_cpu(cp, run_cli, tmp_path, dtype, ext):
    args = ["verify", "--k", "4", "--prompt", "The import system", "--logits-dtype", dtype]
    gpu = run_json(run_cli, *args, "--device", "cuda", "--dump-logits", str(tmp_path / f"g.{ext}"))
    cpu = run_json(run_cli, *args, "--device", "cpu", "--dump-logits", str(tmp_path / f"c.{ext}"))
    assert gpu["accepted"] == cpu["accepted"] == 4  # self drafts are always accepted
    assert [r["target"] for r in gpu["rows"]] == [r["target"] for r in cpu["rows"]]
    assert gpu["next_token"] == cpu["next_token"]
    assert gpu["max_abs_diff_vs_sequential"] <= 0.05
    gb, cb = (tmp_path / f"g.{ext}").read_bytes(), (tmp_path / f"c.{ext}").read_bytes()
    assert len(gb) == len(cb)
    side = json.loads((tmp_path / f"g.{ext}.json").read_text())
    assert side["shape"] == json.loads((tmp_path / f"c.{ext}.json").read_text())["shape"]


def test_speculative_decode_on_gpu_equals_plain(cp, run_cli):
    base = ["decode", "--prompt", "The while statement", "--steps", "40", "--ignore-eos", "--device", "cuda"]
    plain = run_json(run_cli, *base)
    for k in (1, 4, 8):
        spec = run_json(run_cli, *base, "--draft-model", "metrale_cli/assets/models/default-draft", "--k", str(k))
        assert [s["token"] for s in spec["steps"]] == [s["token"] for s in plain["steps"]]
        assert spec["speculative"]["drafted"] > 0


def test_out_of_memory_names_the_bytes(cp):
    from metrale_cli.config import parse_config
    from metrale_cli.backends.cuda.loading import load_cuda_engine
    from metrale_cli.errors import DeviceError
    from metrale_cli.random_weights import RandomTensors

    huge = parse_config({"model_type": "llama", "vocab_size": 2**24, "hidden_size": 16384,
                         "intermediate_size": 64, "num_hidden_layers": 1, "num_attention_heads": 128,
                         "num_key_value_heads": 8})
    with pytest.raises(DeviceError, match=r"the weights need 1025\.1 GiB and the GPU has .* GiB free"):
        load_cuda_engine(huge, RandomTensors(huge), 16)  # refused before a tensor is read
    small = parse_config({"model_type": "llama", "vocab_size": 256, "hidden_size": 256, "intermediate_size": 64,
                          "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 4,
                          "max_position_embeddings": 2**31})
    with pytest.raises(DeviceError, match=r"out of memory allocating the KV cache .*needed .* MiB more.*MiB free"):
        load_cuda_engine(small, RandomTensors(small), 2**31)  # K and V: 2 x 2 x 4 heads x 64 x 2^31 bf16 = 4 TiB
