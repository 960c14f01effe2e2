"""--activation-quant emulate: each quantized weight's input quantized as its checkpoint's scheme says an engine does.

References written here from the schemes' definitions, independent of metrale's code: FP8 W8A8 dynamic (per
token and per weight_block_size[1] columns, s = amax / 448, x' = e4m3(x / s) * s; DeepSeek's act_quant), per
tensor dynamic (one scale per token), static (the checkpoint's activation_scale), and end to end transformers'
fp32 model of the dequantized checkpoint with torch forward pre-hooks that quantize every FP8 Linear's input.
"""

from __future__ import annotations

import json

import ml_dtypes
import numpy as np
import pytest

from metrale_cli.models.quantized.activations import e4m3_groups as quantize_groups

from golden_parity import FIXTURES, emulated_errors, rel_err, rows
from test_quantized_fp8 import quantize_llama


def reference_groups(x: np.ndarray, group: int, ue8m0: bool = False) -> np.ndarray:
    out = np.empty_like(x)
    for i in range(x.shape[0]):
        for j0 in range(0, x.shape[1], group):
            g = x[i, j0:j0 + group]
            s = np.float32(np.abs(g).max()) / np.float32(448)
            if ue8m0 and s > 0:
                s = np.float32(2.0 ** np.ceil(np.log2(s)))
            out[i, j0:j0 + group] = 0 if s == 0 else (g / s).astype(ml_dtypes.float8_e4m3fn).astype(np.float32) * s
    return out


@pytest.mark.parametrize("shape,group", [((3, 300), 128), ((1, 64), 16), ((5, 48), 48)])
@pytest.mark.parametrize("ue8m0", [False, True])
def test_dynamic_groups_follow_the_definition(shape, group, ue8m0):
    x = np.random.default_rng().standard_normal(shape).astype(np.float32) * 3
    x[0, :group] = 0  # an all-zero group stays zero
    got = quantize_groups(x, group, ue8m0)
    assert np.array_equal(got, reference_groups(x, group, ue8m0))
    assert not np.array_equal(got, x)


def torch_reference(path, prompt, quant):
    """transformers' fp32 model of the dequantized checkpoint, every FP8 Linear's input passed through `quant`
    (a torch function of the input tensor and the module name)."""
    torch = pytest.importorskip("torch")
    pytest.importorskip("transformers")
    pytest.importorskip("accelerate")  # transformers loads an FP8 checkpoint through it
    import sys

    sys.path.insert(0, str(FIXTURES.parent.parent / "scripts"))
    import make_quantized_fixtures as mq

    model = mq.load_dequantized(path)
    with open(path / "config.json") as f:
        skip = json.load(f)["quantization_config"].get("modules_to_not_convert") or []
    for name, module in model.named_modules():
        if isinstance(module, torch.nn.Linear) and name.endswith("proj") and not any(name.startswith(s) for s in skip):
            module.register_forward_pre_hook(lambda m, args, name=name: (quant(args[0], name),))
    with torch.no_grad():
        return model(torch.tensor([prompt])).logits[0].numpy()


def torch_groups(x, group: int):
    import torch

    shape = x.shape
    g = torch.nn.functional.pad(x, (0, -shape[-1] % group)).reshape(*shape[:-1], -1, group)
    s = g.abs().amax(-1, keepdim=True) / 448
    s = torch.where(s > 0, s, torch.ones_like(s))
    q = (g / s).to(torch.float8_e4m3fn).to(torch.float32) * s
    return q.reshape(*shape[:-1], -1)[..., :shape[-1]]


@pytest.mark.parametrize("name,group", [("llama_fp8_block", 16), ("qwen3_fp8_tensor", None)])
def test_emulated_w8a8_matches_transformers_with_quantized_inputs(name, group):
    """Quantizing is a step function, so an activation within fp32 rounding of an e4m3 rounding boundary may land
    on either side, and these small random models amplify that one step: transformers against itself with the
    inputs of its quantizers jittered by 1e-7 differed by more than 1e-5 on 1 to 2 prompts of 40, by up to 4e-2
    (measured 2026-12-07). So the end-to-end check is a majority over fresh prompts, each one where the plain
    (unquantized-input) engine is far off; the quantizers themselves are checked exactly above."""
    path = FIXTURES / "models" / name
    errs = emulated_errors(name, lambda prompt: torch_reference(
        path, prompt, lambda x, _: torch_groups(x, group or x.shape[-1])), count=9, length=10)
    assert sum(x <= 1e-5 for x in errs) >= 5


def test_static_activation_scales_are_read_from_the_checkpoint(tmp_path):
    rng = np.random.default_rng()
    scales = {}

    def add_static(tensors, config):
        config["quantization_config"]["activation_scheme"] = "static"
        for name in [n for n in tensors if n.endswith("proj.weight")]:
            scales[name] = np.float32(rng.uniform(0.005, 0.02))
            tensors[name.removesuffix("weight") + "activation_scale"] = np.array(scales[name], np.float32)

    path, _ = quantize_llama(tmp_path, (16, 16), rng, add_static)
    torch = pytest.importorskip("torch")

    def static(x, module):
        s = float(scales[module + ".weight"])
        if module.endswith(("q_proj", "k_proj", "v_proj")):  # fused as qkv: the largest scale of the three
            s = max(float(scales[module.rsplit(".", 1)[0] + f".{p}.weight"]) for p in ("q_proj", "k_proj", "v_proj"))
        if module.endswith(("gate_proj", "up_proj")):
            s = max(float(scales[module.rsplit(".", 1)[0] + f".{p}.weight"]) for p in ("gate_proj", "up_proj"))
        return (x / s).clamp(-448, 448).to(torch.float8_e4m3fn).to(torch.float32) * s

    from metrale_cli.model import open_model

    e = open_model(path, device="cpu", max_context=32, fp32_logits=True, activation_quant="emulate").engine
    errs = []
    for _ in range(7):  # a majority of fresh prompts, as above: a rounding boundary may fall either way
        prompt = [int(t) for t in rng.integers(0, 300, 8)]
        want = torch_reference(path, prompt, static)
        e.trim(0)
        e.prefill(prompt, all_logits=True)
        errs.append(rel_err(rows(e, e.logits_buffer_ptr(), len(prompt)), want))
    print("static activation scales vs transformers, 7 prompts:", ", ".join(f"{x:.1e}" for x in errs))
    assert sum(x <= 1e-5 for x in errs) >= 4


def test_the_mode_is_recorded_in_dumps_and_refused_where_it_does_not_run(tmp_path):
    from typer.testing import CliRunner

    from metrale_cli.cli import app
    from metrale_cli.checkpoint import Checkpoint

    path = FIXTURES / "models" / "llama_fp8_block"
    out = tmp_path / "rows.safetensors"
    res = CliRunner().invoke(app, ["forward", "-m", str(path), "-t", "1,2,3", "--activation-quant", "emulate",
                                   "--dump-logits", str(out), "--format", "plain"])
    assert res.exit_code == 0, res.output
    with Checkpoint.open(out) as dump:
        assert dump.metadata["activation_quant"] == "emulate"
    res = CliRunner().invoke(app, ["forward", "-m", str(path), "-t", "1,2,3", "--activation-quant", "sometimes"])
    assert res.exit_code == 2 and "--activation-quant must be none or emulate" in res.output
