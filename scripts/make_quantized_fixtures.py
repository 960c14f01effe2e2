#!/usr/bin/env python
"""Build the quantized-checkpoint and gpt-oss fixtures and their transformers goldens (fp32, CPU).

Each fixture takes one of the reference fixtures (tests/fixtures/models/<source>, made by
make_reference_fixtures.py), stores its decoder Linear weights quantized as a real checkpoint of that
format does, and writes `tests/fixtures/models/<name>/` (config.json with the quantization_config, the
safetensors) and `tests/fixtures/golden/<name>.npz`. The goldens are transformers' own: it loads the
quantized checkpoint on the CPU by dequantizing it (`dequantize=True`, fp32), and its dequantized weights
are checked here to equal the exact value of every stored weight (fp32 product of the stored value and its
scale; an independent NumPy dequantization below, not metrale's).

The quantization itself only has to make a valid checkpoint (any scales would do): per [bn, bk] block
scale = amax / 448 (stored in the scale dtype the spec names), e4m3 = round-to-nearest-even(w / scale).

    python scripts/make_quantized_fixtures.py            # all
    python scripts/make_quantized_fixtures.py llama_fp8_block

gpt-oss (`gpt_oss`, `gpt_oss_mxfp4`): a tiny GptOssForCausalLM made by transformers (4 layers alternating a
sliding window of 4 with full attention, 8 experts top-2 with biases, YaRN factor 4, sinks), every parameter
re-drawn; `gpt_oss` is its save_pretrained (the experts fused [E, in, out], gate/up interleaved), `gpt_oss_mxfp4`
the same model with its experts stored as MXFP4 (`*_blocks` / `*_scales`: per 32 values the E8M0 scale
2^ceil(log2(amax / 6)), each value rounded to the nearest e2m1), loaded by transformers with
Mxfp4Config(dequantize=True).

Golden npz keys: those of make_reference_fixtures.py (prompt, prefill_logits, greedy_tokens, ...).
"""

from __future__ import annotations

import json
import os
import shutil
import sys
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import ml_dtypes  # noqa: E402
import numpy as np  # noqa: E402
import torch  # noqa: E402
import transformers  # noqa: E402
from safetensors.numpy import load_file, save_file  # noqa: E402

sys.path.insert(0, str(Path(__file__).parent))
import make_reference_fixtures as ref  # noqa: E402

FIXTURES = Path(__file__).resolve().parent.parent / "tests" / "fixtures"
E4M3_MAX = 448.0

# name: (source fixture, weight_block_size or None (per tensor), scale dtype, modules_to_not_convert)
SPECS = {
    "llama_fp8_block": ("llama", [16, 16], "F32", None),
    "qwen3_moe_fp8_block": ("qwen3_moe", [8, 8], "BF16", ["model.layers.1.mlp"]),
    "qwen3_fp8_tensor": ("qwen3", None, "F32", None),
    # DeepSeek-V3 as shipped (F32 scale_inv, every Linear but the router), blocks of 8 that divide its small dims
    "deepseek_v3_fp8_block": ("deepseek_v3", [8, 8], "F32", None),
    # the same with its multi-token-prediction layer (make_mtp_fixtures.py: its golden from the exact values)
    "deepseek_v3_mtp_fp8_block": ("deepseek_v3_mtp", [8, 8], "F32", None),
}


def is_linear(name: str, a: np.ndarray) -> bool:
    """A Linear weight the checkpoint stores in FP8: not the embedding, lm_head, a router, nor an MTP layer's
    eh_proj (engines load that as a plain Linear, so checkpoints keep it dense)."""
    return (a.ndim == 2 and name.endswith(("proj.weight", "proj_with_mqa.weight")) and "embed" not in name
            and "lm_head" not in name and not name.endswith(("mlp.gate.weight", "eh_proj.weight")))


def skipped(name: str, skip: list[str] | None) -> bool:
    module = name.removesuffix(".weight")
    return any(module == s or module.startswith(s + ".") for s in skip or ())


def as_scale_dtype(s: np.ndarray, dtype: str) -> np.ndarray:
    return s.astype(np.float32) if dtype == "F32" else s.astype(ml_dtypes.bfloat16)


def quantize_block(w: np.ndarray, block: list[int], scale_dtype: str) -> tuple[np.ndarray, np.ndarray]:
    bn, bk = block
    rows, cols = w.shape
    grid = (-(-rows // bn), -(-cols // bk))
    scale = np.empty(grid, np.float32)
    for i in range(grid[0]):
        for j in range(grid[1]):
            scale[i, j] = np.abs(w[i * bn:(i + 1) * bn, j * bk:(j + 1) * bk]).max() / E4M3_MAX
    stored = as_scale_dtype(scale, scale_dtype)
    full = np.repeat(np.repeat(stored.astype(np.float32), bn, 0)[:rows], bk, 1)[:, :cols]
    return (w / full).astype(ml_dtypes.float8_e4m3fn), stored


def quantize_tensor(w: np.ndarray, scale_dtype: str) -> tuple[np.ndarray, np.ndarray]:
    stored = as_scale_dtype(np.array(np.abs(w).max() / E4M3_MAX, np.float32), scale_dtype)
    return (w / stored.astype(np.float32)).astype(ml_dtypes.float8_e4m3fn), stored


def exact(q: np.ndarray, scale: np.ndarray, block: list[int] | None) -> np.ndarray:
    """The fp32 value each stored weight stands for (independent of metrale's dequantization)."""
    s = scale.astype(np.float32)
    if block is None:
        return q.astype(np.float32) * s
    rows, cols = q.shape
    return q.astype(np.float32) * np.repeat(np.repeat(s, block[0], 0)[:rows], block[1], 1)[:, :cols]


def build(name: str) -> None:
    source, block, scale_dtype, skip = SPECS[name]
    src, out = FIXTURES / "models" / source, FIXTURES / "models" / name
    if out.exists():
        shutil.rmtree(out)
    out.mkdir(parents=True)
    tensors: dict[str, np.ndarray] = {}
    for f in sorted(src.glob("*.safetensors")):
        tensors.update(load_file(f))
    stored, values = {}, {}
    for key, a in tensors.items():
        a = a.astype(np.float32)
        if is_linear(key, a) and not skipped(key, skip):
            q, s = quantize_block(a, block, scale_dtype) if block else quantize_tensor(a, scale_dtype)
            stored[key], stored[key + "_scale_inv"] = q, s
            values[key] = exact(q, s, block)
        else:
            stored[key] = values[key] = a
    save_file(stored, str(out / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((src / "config.json").read_text())
    qc = {"quant_method": "fp8", "activation_scheme": "dynamic", "weight_block_size": block}
    if skip:
        qc["modules_to_not_convert"] = skip
    config["quantization_config"] = qc
    ref.write_json(out / "config.json", config)
    for extra in ("generation_config.json",):
        if (src / extra).exists():
            shutil.copy(src / extra, out / extra)

    model = load_dequantized(out)
    state = {k: v.numpy() for k, v in model.state_dict().items()}
    checked = 0
    mtp = tuple(f"model.layers.{config['num_hidden_layers'] + j}." for j in range(config.get("num_nextn_predict_layers", 0)))
    for key, v in values.items():  # transformers' dequantization == the exact values, bit for bit
        if mtp and key.startswith(mtp):  # a multi-token-prediction layer: not in transformers' model
            continue
        got = transformers_weight(state, key)
        if key + "_scale_inv" in stored:
            assert np.array_equal(got, v), f"{name}: transformers' dequantized {key} differs"
            checked += 1
    assert checked, name
    arrays, info = ref.pick_prompt(model, config["vocab_size"], 7, model.config)
    ref.write_npz(FIXTURES / "golden" / f"{name}.npz", arrays)
    print(f"== {name}: margin {info['margin']:.4f}, distinct {info['distinct']}, checks {info['checks']}")


def transformers_weight(state: dict[str, np.ndarray], key: str) -> np.ndarray:
    """Checkpoint tensor `key` as transformers holds it (one expert's rows of its fused expert tensors)."""
    if key in state:
        return state[key]
    prefix, expert, proj = key.rsplit(".", 3)[0], int(key.split(".")[-3]), key.split(".")[-2]
    if proj == "down_proj":
        return state[f"{prefix}.down_proj"][expert]
    gate_up = state[f"{prefix}.gate_up_proj"][expert]
    half = gate_up.shape[0] // 2
    return gate_up[:half] if proj == "gate_proj" else gate_up[half:]


def load_dequantized(path: Path) -> torch.nn.Module:
    """transformers' own load of the FP8 checkpoint on the CPU: dequantized to fp32."""
    moe = json.loads((path / "config.json").read_text())["model_type"] in ref.MOE_TYPES
    cfg = transformers.FineGrainedFP8Config(dequantize=True, **_block_kwargs(path))
    model = transformers.AutoModelForCausalLM.from_pretrained(
        path, dtype=torch.float32, attn_implementation="eager", quantization_config=cfg,
        **({"experts_implementation": "eager"} if moe else {}))
    return model.eval()


def _block_kwargs(path: Path) -> dict:
    qc = json.loads((path / "config.json").read_text())["quantization_config"]
    return {k: qc[k] for k in ("weight_block_size", "modules_to_not_convert", "activation_scheme") if k in qc}


E2M1 = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0], np.float32)


def gpt_oss_model() -> torch.nn.Module:
    cfg = transformers.GptOssConfig(
        vocab_size=300, hidden_size=64, intermediate_size=32, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, num_local_experts=8, num_experts_per_tok=2, sliding_window=4,
        max_position_embeddings=256, rms_norm_eps=1e-5, bos_token_id=None, eos_token_id=None, pad_token_id=None,
        rope_parameters={"rope_type": "yarn", "factor": 4.0, "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False,
                         "original_max_position_embeddings": 64, "rope_theta": 10000.0})
    cfg._attn_implementation = "eager"
    torch.manual_seed(11)
    model = transformers.GptOssForCausalLM(cfg).float().eval()
    g = torch.Generator().manual_seed(11)
    with torch.no_grad():
        for name, p in sorted(model.named_parameters()):
            if "norm" in name:
                new = 0.5 + torch.rand(p.shape, generator=g)
            elif name.endswith("bias") or name.endswith("sinks"):
                new = 0.5 * torch.randn(p.shape, generator=g)
            elif "embed" in name:
                new = torch.randn(p.shape, generator=g)
            elif "lm_head" in name:
                new = 2.5 / p.shape[-1] ** 0.5 * torch.randn(p.shape, generator=g)
            elif "experts" in name:  # [E, in, out]
                new = 1.2 / p.shape[-2] ** 0.5 * torch.randn(p.shape, generator=g)
            else:
                new = 1.2 / p.shape[-1] ** 0.5 * torch.randn(p.shape, generator=g)
            p.copy_(new)
    return model


def mxfp4(w: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """[E, N, K] fp32 -> blocks U8 [E, N, K/32, 16] (low nibble first), E8M0 scales U8 [E, N, K/32]."""
    g = w.reshape(*w.shape[:-1], -1, 32)
    exp = np.ceil(np.log2(np.maximum(np.abs(g).max(-1), 1e-30) / 6.0)).astype(np.int32)
    v = g / np.ldexp(np.float32(1), exp)[..., None]
    code = np.abs(np.abs(v)[..., None] - E2M1).argmin(-1).astype(np.uint8) | ((v < 0) << 3).astype(np.uint8)
    return (code[..., 0::2] | (code[..., 1::2] << 4)).astype(np.uint8), (exp + 127).astype(np.uint8)


def build_gpt_oss(name: str) -> None:
    out = FIXTURES / "models" / name
    if out.exists():
        shutil.rmtree(out)
    model = gpt_oss_model()
    model.to(torch.bfloat16).save_pretrained(out)  # as gpt-oss's bf16 exports: the goldens compute on these values
    if name == "gpt_oss_mxfp4":
        tensors = load_file(out / "model.safetensors")
        for key in [k for k in tensors if k.endswith(("experts.gate_up_proj", "experts.down_proj"))]:
            w = tensors.pop(key).astype(np.float32).swapaxes(-1, -2)  # stored [E, in, out] -> [E, out, in]
            blocks, scales = mxfp4(w)
            tensors[key + "_blocks"], tensors[key + "_scales"] = blocks, scales
        save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
        config = json.loads((out / "config.json").read_text())
        config["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": [
            "model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]}
        ref.write_json(out / "config.json", config)
        model = transformers.AutoModelForCausalLM.from_pretrained(
            out, dtype=torch.float32, attn_implementation="eager",
            quantization_config=transformers.Mxfp4Config(dequantize=True)).eval()
    else:
        ref.write_json(out / "config.json", json.loads((out / "config.json").read_text()))
        model = ref.load_fp32(out)
    arrays, info = ref.pick_prompt(model, 300, 11, model.config)
    ref.write_npz(FIXTURES / "golden" / f"{name}.npz", arrays)
    print(f"== {name}: margin {info['margin']:.4f}, distinct {info['distinct']}, checks {info['checks']}")


GPT_OSS = ("gpt_oss", "gpt_oss_mxfp4")


def main(argv: list[str]) -> None:
    torch.set_num_threads(1)
    torch.use_deterministic_algorithms(True)
    transformers.logging.set_verbosity_error()
    for name in argv[1:] or (*SPECS, *GPT_OSS):
        build_gpt_oss(name) if name in GPT_OSS else build(name)


if __name__ == "__main__":
    main(sys.argv)
