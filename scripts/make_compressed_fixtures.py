#!/usr/bin/env python
"""Build the compressed-tensors fixtures with the compressed-tensors package itself, and their goldens (fp32, CPU).

Each fixture takes a reference fixture (tests/fixtures/models/<source>, made by make_reference_fixtures.py),
applies a compressed-tensors quantization config to transformers' fp32 model of it
(`apply_quantization_config`), sets every weight's scales (and zero points, and NVFP4 global scales) with the
package's own `calculate_qparams` / `generate_gparam` from the weight's min and max per tensor, row, group or
block, compresses it with the package's compressors (`ModelCompressor.compress_model`, which quantizes and packs)
and saves it as llm-compressor does (`save_pretrained` then `update_config`): `tests/fixtures/models/<name>/`.

Goldens (`tests/fixtures/golden/<name>.npz`, the keys of make_reference_fixtures.py):
  - transformers loading the compressed checkpoint on the CPU in fp32 (CompressedTensorsConfig with
    run_compressed=False: it decompresses every weight with the package at load), whose weights are asserted
    here to equal the package's own decompression in fp32 bit for bit (`reference_weights`);
  - NVFP4: the package's decompression computes in its working dtype (its fp4 unpacking yields bf16), so
    transformers' load holds bf16-rounded weights; the golden is transformers' fp32 model of the source
    fixture with its Linear weights set to the package's decompression in fp32 (`reference_weights`: the same
    `dequantize` with fp32 inputs), and the script asserts transformers' load equals those values rounded to bf16;
  - mixed-precision: transformers 5.25 decompresses every module with one group's scheme and fails to load it;
    the golden is computed as for NVFP4, on the package's fp32 decompression.

    python scripts/make_compressed_fixtures.py            # all
    python scripts/make_compressed_fixtures.py llama_ct_w4a16

Needs compressed-tensors (tested with 0.20.1: `pip install compressed-tensors`), transformers and torch.
"""

from __future__ import annotations

import copy
import json
import logging
import os
import shutil
import sys
import tempfile
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import numpy as np  # noqa: E402
import torch  # noqa: E402
import transformers  # noqa: E402
from safetensors.torch import load_file  # noqa: E402

sys.path.insert(0, str(Path(__file__).parent))
import make_reference_fixtures as ref  # noqa: E402

FIXTURES = Path(__file__).resolve().parent.parent / "tests" / "fixtures"


def _args(**kw):
    from compressed_tensors.quantization import QuantizationArgs

    return QuantizationArgs(**kw)


def _scheme(targets, weights, inputs=None, fmt=None):
    from compressed_tensors.quantization import QuantizationScheme

    return QuantizationScheme(targets=targets, weights=weights, input_activations=inputs, format=fmt)


def specs() -> dict:
    """name: (source fixture, config_groups, ignore, global format (None: inferred), prompt seed)."""
    fp8 = dict(num_bits=8, type="float", symmetric=True)
    nvfp4 = dict(num_bits=4, type="float", strategy="tensor_group", group_size=16, symmetric=True,
                 scale_dtype=torch.float8_e4m3fn, zp_dtype=torch.float8_e4m3fn)
    attn = r"re:.*self_attn\.(q|k|v|o)_proj$"
    return {
        # FP8_DYNAMIC: per-channel FP8 weights, dynamic per-token activations
        "llama_ct_fp8_channel": ("llama", {"group_0": _scheme(
            ["Linear"], _args(strategy="channel", **fp8),
            _args(strategy="token", dynamic=True, **fp8))}, ["lm_head"], "float-quantized", 21),
        # FP8: per-tensor weights, static per-tensor activation scales (input_scale)
        "qwen3_ct_fp8_tensor": ("qwen3", {"group_0": _scheme(
            ["Linear"], _args(strategy="tensor", **fp8), _args(strategy="tensor", **fp8))},
            ["lm_head"], "float-quantized", 1006),
        # FP8_BLOCK with 32x32 blocks: partial blocks along the 80-wide inputs and outputs
        "llama_ct_fp8_block": ("llama", {"group_0": _scheme(
            ["Linear"], _args(strategy="block", block_structure=[32, 32], **fp8),
            _args(strategy="group", group_size=16, dynamic=True, **fp8))}, ["lm_head"], "float-quantized", 23),
        # W4A16: int4 groups of 16 packed into int32; layer 1's MLP left dense by a "re:" ignore
        "llama_ct_w4a16": ("llama", {"group_0": _scheme(
            ["Linear"], _args(num_bits=4, type="int", strategy="group", group_size=16, symmetric=True))},
            ["lm_head", r"re:.*layers\.1\.mlp\..*"], "pack-quantized", 24),
        # mixed-precision: attention int8 per channel, asymmetric (int-quantized, zero points), chosen by a regex
        # target over the class target; the MLP W4A16 asymmetric (pack-quantized, packed zero points)
        "qwen3_ct_mixed": ("qwen3", {
            "group_0": _scheme(["Linear"], _args(num_bits=4, type="int", strategy="group", group_size=16,
                                                 symmetric=False), fmt="pack-quantized"),
            "group_1": _scheme([attn], _args(num_bits=8, type="int", strategy="channel", symmetric=False),
                               _args(num_bits=8, type="int", strategy="token", dynamic=True, symmetric=True),
                               fmt="int-quantized")}, ["lm_head"], "mixed-precision", 1006),
        # NVFP4 (W4A4): e2m1 pairs, e4m3 scales per 16, a global scale, input_global_scale
        "llama_ct_nvfp4": ("llama", {"group_0": _scheme(
            ["Linear"], _args(**nvfp4),
            _args(dynamic="local", observer="static_minmax", **nvfp4))}, ["lm_head"], "nvfp4-pack-quantized", 26),
    }


def quantize(model: torch.nn.Module, groups: dict, ignore: list[str], rng: torch.Generator) -> None:
    """Apply the config and set each quantized module's qparams with the package's min/max rules."""
    from compressed_tensors.quantization import QuantizationConfig, apply_quantization_config
    from compressed_tensors.quantization.utils import (
        calculate_qparams,
        generate_gparam,
        maybe_pad_tensor_for_block_quant,
    )
    from compressed_tensors.utils import update_offload_parameter

    apply_quantization_config(model, QuantizationConfig(config_groups=copy.deepcopy(groups), ignore=ignore),
                              show_progress=False)
    for _, m in model.named_modules():
        scheme = getattr(m, "quantization_scheme", None)
        if scheme is None:
            continue
        w, args = m.weight.data, scheme.weights
        global_scale = None
        if args.strategy == "tensor_group":
            global_scale = generate_gparam(w.amin(), w.amax())
            update_offload_parameter(m, "weight_global_scale", global_scale)
        if args.strategy in ("group", "tensor_group"):
            g = w.unflatten(-1, (-1, args.group_size))
            lo, hi = g.amin(-1), g.amax(-1)
        elif args.strategy == "channel":
            lo, hi = w.amin(-1, keepdim=True), w.amax(-1, keepdim=True)
        elif args.strategy == "block":
            bh, bw = args.block_structure
            p = maybe_pad_tensor_for_block_quant(w, (bh, bw))
            b = p.reshape(p.shape[0] // bh, bh, p.shape[1] // bw, bw).transpose(1, 2)
            lo, hi = b.amin((-1, -2)), b.amax((-1, -2))
        else:
            lo, hi = w.amin(), w.amax()
        scale, zero_point = calculate_qparams(lo, hi, args, global_scale=global_scale)
        update_offload_parameter(m, "weight_scale", scale)
        if hasattr(m, "weight_zero_point"):
            update_offload_parameter(m, "weight_zero_point", zero_point)
        a = scheme.input_activations
        if a is not None and a.dynamic is False:  # a static activation scale from a random activation sample
            x = torch.randn(64, w.shape[1], generator=rng)
            s, _ = calculate_qparams(x.amin(), x.amax(), a)
            update_offload_parameter(m, "input_scale", s)
        if a is not None and a.dynamic == "local":
            x = torch.randn(64, w.shape[1], generator=rng)
            update_offload_parameter(m, "input_global_scale", generate_gparam(x.amin(), x.amax()))


def reference_weights(path: Path) -> dict[str, np.ndarray]:
    """Checkpoint weight name -> the package's decompression of it in fp32, for every quantized module: the
    package's own matching of targets and ignore (apply_quantization_config on the architecture) and its own
    compressor's decompress (NVFP4: its `dequantize` on fp32 inputs, as its compressor does in bf16)."""
    from compressed_tensors.compressors import BaseCompressor
    from compressed_tensors.compressors.nvfp4.helpers import unpack_fp4_from_uint8
    from compressed_tensors.quantization import QuantizationConfig, apply_quantization_config
    from compressed_tensors.quantization.lifecycle.forward import dequantize

    config = json.loads((path / "config.json").read_text())
    qc = QuantizationConfig.model_validate(config["quantization_config"])
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.from_pretrained(path))
    apply_quantization_config(model, qc, show_progress=False)
    tensors = {}
    for f in sorted(path.glob("*.safetensors")):
        tensors.update(load_file(f))
    out = {}
    for name, m in model.named_modules():
        scheme = getattr(m, "quantization_scheme", None)
        if scheme is None:
            continue
        local = {k.removeprefix(name + "."): v for k, v in tensors.items() if k.rsplit(".", 1)[0] == name}
        fmt = scheme.format or qc.format
        if fmt == "nvfp4-pack-quantized":
            packed = local["weight_packed"]
            q = unpack_fp4_from_uint8(packed, packed.shape[0], packed.shape[1] * 2, dtype=torch.float32)
            w = dequantize(x_q=q, scale=local["weight_scale"].to(torch.float32), args=scheme.weights,
                           global_scale=local["weight_global_scale"], dtype=torch.float32)
        else:
            w = BaseCompressor.get_value_from_registry(fmt).decompress(local, scheme)["weight"]
        assert w.dtype == torch.float32, (name, w.dtype)
        out[name + ".weight"] = w.numpy()
    return out


def load_dequantized(path: Path) -> torch.nn.Module:
    """transformers' own load of the compressed checkpoint on the CPU, decompressed, fp32."""
    cfg = transformers.CompressedTensorsConfig(run_compressed=False)
    return transformers.AutoModelForCausalLM.from_pretrained(
        path, dtype=torch.float32, attn_implementation="eager", quantization_config=cfg).eval()


# Formats whose golden computes on the package's fp32 decompression set into transformers' dense model: NVFP4
# (transformers' load holds it rounded to bf16) and mixed-precision (transformers 5.25 cannot load it).
DIRECT = ("nvfp4-pack-quantized", "mixed-precision")


def dense_model(src: Path, values: dict[str, np.ndarray]) -> torch.nn.Module:
    """transformers' fp32 model of the source fixture with the given Linear weights (saved and reloaded)."""
    model = ref.load_fp32(src)
    with torch.no_grad():
        params = dict(model.named_parameters())
        for key, v in values.items():
            params[key].copy_(torch.from_numpy(v))
    with tempfile.TemporaryDirectory() as tmp:
        model.save_pretrained(tmp)
        return ref.load_fp32(Path(tmp))


def build(name: str) -> None:
    import compressed_tensors
    from compressed_tensors.compressors import ModelCompressor

    source, groups, ignore, fmt, seed = specs()[name]
    src, out = FIXTURES / "models" / source, FIXTURES / "models" / name
    if out.exists():
        shutil.rmtree(out)
    torch.manual_seed(seed)
    model = ref.load_fp32(src)
    quantize(model, groups, ignore, torch.Generator().manual_seed(seed))
    # mixed-precision: each module by its group's format (the package then writes the global format)
    compressor = ModelCompressor.from_pretrained_model(model, None if fmt == "mixed-precision" else fmt)
    compressor.compress_model(model)
    model.save_pretrained(out)
    compressor.update_config(out)
    config = json.loads((out / "config.json").read_text())
    ref.write_json(out / "config.json", config)
    shutil.copy(src / "generation_config.json", out / "generation_config.json")

    values = reference_weights(out)
    assert len(values) >= 6, name
    if fmt != "mixed-precision":  # transformers 5.25 decompresses every module with one group's scheme
        loaded = load_dequantized(out)
        state = {k: v.detach().numpy() for k, v in loaded.state_dict().items()}
        for key, v in values.items():
            want = torch.from_numpy(v).to(torch.bfloat16).float().numpy() if fmt == DIRECT[0] else v
            assert np.array_equal(state[key], want), f"{name}: transformers' decompressed {key} differs"
    golden_model = loaded if fmt not in DIRECT else dense_model(src, values)
    for attempt in range(8):  # the first prompt seed (seed, seed + 1000, ...) whose greedy run has no near tie
        try:
            arrays, info = ref.pick_prompt(golden_model, config["vocab_size"], seed + 1000 * attempt,
                                           golden_model.config)
            break
        except RuntimeError:
            continue
    else:
        raise RuntimeError(f"{name}: no prompt without near ties")
    arrays["compressed_tensors_version"] = np.array(compressed_tensors.__version__)
    ref.write_npz(FIXTURES / "golden" / f"{name}.npz", arrays)
    print(f"== {name}: {len(values)} weights, margin {info['margin']:.4f}, distinct {info['distinct']}")


def main(argv: list[str]) -> None:
    torch.set_num_threads(1)
    torch.use_deterministic_algorithms(True)
    transformers.logging.set_verbosity_error()
    logging.disable(logging.WARNING)
    try:
        from loguru import logger

        logger.disable("compressed_tensors")
    except ImportError:
        pass
    for name in argv[1:] or specs():
        build(name)


if __name__ == "__main__":
    main(sys.argv)
