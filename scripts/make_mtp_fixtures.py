#!/usr/bin/env python
"""Multi-token-prediction (MTP) fixtures, made and checked with transformers' own MTP module (fp32, CPU).

DeepSeek-V3 and GLM-4.5 / GLM-4.7-Flash checkpoints carry `num_nextn_predict_layers` MTP layers after the decoder,
stored as model.layers.{num_hidden_layers + j}.*: enorm, hnorm, eh_proj, a decoder block (always sparse),
shared_head.norm (and copies of the embedding and lm_head, which transformers does not read: it shares the main
model's). transformers 5 runs them (`generate(use_mtp=True)`, modeling_layers.MtpModel): for the token at
position p, eh_proj([enorm(embed(x_p)), hnorm(h_{p-1})]) goes through the block and shared_head.norm, then the
main lm_head; h_{p-1} is the main model's last hidden state (after its final norm) at the position before.

For each base fixture of make_reference_fixtures.py named in MTP (same config and weights), this script
  * draws one MTP layer's weights (seeded) into transformers' MtpModel,
  * writes them under the checkpoint's names (the block's through save_pretrained of the same architecture one
    layer deeper, so the layout is transformers' own), beside the base weights, in tests/fixtures/models/<name>_mtp/,
  * loads the result back with MtpModel.from_pretrained (transformers' loader and renamings) and checks every
    weight came back, then
  * writes tests/fixtures/golden/<name>_mtp.npz: the prompt, the main model's hidden rows (post final norm) and
    the MTP logits of positions 1..T-1 (row j: the MTP's prediction for position j + 2).

    python scripts/make_mtp_fixtures.py deepseek_v3 glm4_moe                    # the dense fixtures and goldens
    python scripts/make_quantized_fixtures.py deepseek_v3_mtp_fp8_block       # the first one in block FP8
    python scripts/make_mtp_fixtures.py deepseek_v3_mtp_fp8_block             # its MTP golden (exact values)

Every file is byte-identical on rerun.
"""

from __future__ import annotations

import json
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
from safetensors.numpy import load_file, save_file  # noqa: E402
from transformers import AutoModelForCausalLM  # noqa: E402
from transformers.modeling_layers import MtpModel  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from make_reference_fixtures import GOLDEN_DIR, MODELS_DIR, write_npz  # noqa: E402

MTP = {"deepseek_v3": 1501, "glm4_moe": 1502}  # base fixture -> seed
# block-FP8 fixtures of make_quantized_fixtures.py made from the ones above (run that script first)
FP8 = ("deepseek_v3_mtp_fp8_block",)
PROMPT_LEN = 12


def reinit_mtp_(mtp: MtpModel, seed: int) -> None:
    """Every MTP weight drawn as make_reference_fixtures.reinit_ draws a model's (norms U(0.5, 1.5), biases
    N(0, 0.5), projections N(0, 1.2 / sqrt(in))); the router's correction bias N(0, 0.15). The shared embedding
    and head are the main model's and stay."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in sorted(mtp.named_parameters(), key=lambda kv: kv[0]):
            if not name.startswith("layers."):
                continue
            if "norm" in name:
                new = 0.5 + torch.rand(p.shape, generator=g, dtype=torch.float32)
            elif name.endswith(".bias"):
                new = 0.5 * torch.randn(p.shape, generator=g, dtype=torch.float32)
            else:
                new = 1.2 / p.shape[-1] ** 0.5 * torch.randn(p.shape, generator=g, dtype=torch.float32)
            p.copy_(new)
        for name, b in sorted(mtp.named_buffers(), key=lambda kv: kv[0]):
            if name.endswith("e_score_correction_bias"):
                b.copy_(0.15 * torch.randn(b.shape, generator=g, dtype=torch.float32))


def checkpoint_tensors(main, mtp: MtpModel, config: dict) -> dict[str, np.ndarray]:
    """The MTP layer's tensors under the checkpoint's names: the block's as save_pretrained writes layer L of the
    same architecture with L + 1 layers (all sparse), the MTP parts beside them, and the embedding and head copies
    DeepSeek's checkpoints carry."""
    L = config["num_hidden_layers"]
    deeper = dict(config, num_hidden_layers=L + 1, num_nextn_predict_layers=0)
    if "mlp_layer_types" in deeper:
        deeper["mlp_layer_types"] = list(deeper["mlp_layer_types"]) + ["sparse"]
    cfg = type(main.config).from_dict(deeper)
    big = type(main)(cfg).eval()
    layer = mtp.layers[0]
    with torch.no_grad():
        big.model.layers[L].load_state_dict(layer.mtp_block.state_dict())
    with tempfile.TemporaryDirectory() as tmp:
        big.save_pretrained(tmp, safe_serialization=True)
        saved = {}
        for f in sorted(Path(tmp).glob("*.safetensors")):
            saved.update(load_file(str(f)))
    p = f"model.layers.{L}."
    out = {k: v for k, v in saved.items() if k.startswith(p)}
    parts = {"enorm.weight": layer.enorm.weight, "hnorm.weight": layer.hnorm.weight,
             "eh_proj.weight": layer.eh_proj.weight, "shared_head.norm.weight": layer.post_norm.weight,
             "embed_tokens.weight": main.model.embed_tokens.weight, "shared_head.head.weight": main.lm_head.weight}
    for k, v in parts.items():
        out[p + k] = v.detach().numpy().copy()
    return out


@torch.no_grad()
def make(base: str, seed: int) -> None:
    src, name = MODELS_DIR / base, f"{base}_mtp"
    dst = MODELS_DIR / name
    config = json.loads((src / "config.json").read_text())
    if config.get("num_nextn_predict_layers", 0) != 1:
        config["num_nextn_predict_layers"] = 1
    main = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32, attn_implementation="eager").eval()
    main.config.num_mtp_layers = 1
    torch.manual_seed(seed)
    mtp = MtpModel(main, 1).eval()
    reinit_mtp_(mtp, seed)

    if dst.exists():
        shutil.rmtree(dst)
    dst.mkdir(parents=True)
    (dst / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    if (src / "generation_config.json").exists():
        shutil.copy(src / "generation_config.json", dst / "generation_config.json")
    tensors = load_file(str(src / "model.safetensors"))
    tensors.update(checkpoint_tensors(main, mtp, config))
    save_file(dict(sorted(tensors.items())), str(dst / "model.safetensors"), metadata={"format": "pt"})

    # transformers' own loader reads the MTP layer back: every weight as drawn
    main2, loaded = load_mtp(dst, config)
    want = dict(mtp.named_parameters())
    for k, v in loaded.named_parameters():
        if k.startswith("layers."):
            assert torch.equal(v, want[k]), f"{name}: {k} did not round-trip"
    for k, b in loaded.named_buffers():
        if k.endswith("e_score_correction_bias"):
            assert torch.equal(b, dict(mtp.named_buffers())[k]), f"{name}: {k} did not round-trip"

    g = torch.Generator().manual_seed(seed + 1)
    prompt = torch.randint(0, config["vocab_size"], (1, PROMPT_LEN), generator=g)
    write_golden(name, main2, loaded, prompt)
    print(f"{name}: {len(tensors)} tensors")


def load_mtp(directory: Path, config: dict):
    """transformers' main model and its MtpModel, both from `directory` (fp32, eager)."""
    main = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32, attn_implementation="eager").eval()
    # MtpModel finds the MTP tensors by the main class's _keys_to_ignore_on_load_unexpected, written for the real
    # checkpoints' layer numbers (model.layers.61 in DeepSeek-V3): the tiny fixture's is num_hidden_layers
    main._keys_to_ignore_on_load_unexpected = [rf"model\.layers\.{config['num_hidden_layers']}\..*"]
    return main, MtpModel.from_pretrained(main, device_map={"": "cpu"}).eval()


@torch.no_grad()
def write_golden(name: str, main, mtp: MtpModel, prompt: torch.Tensor) -> None:
    """The golden: the prompt, the main model's hidden rows after its final norm, the MTP layer's rows at positions
    1..T-1 (each fed the main row of the position before) and the logits they give."""
    hidden = main(prompt, output_hidden_states=True).hidden_states[-1]  # [1, T, H], after the final norm
    positions = torch.arange(1, prompt.shape[1])[None, :]
    h = mtp.forward_layer(0, hidden[:, :-1], positions, None, input_ids=prompt[:, 1:])
    logits = mtp._project_to_logits(h)[0]  # [T - 1, V]
    write_npz(GOLDEN_DIR / f"{name}.npz", {
        "prompt": prompt[0].numpy().astype(np.int64),
        "hidden_after_norm": hidden[0].numpy().astype(np.float32),
        "mtp_logits": logits.numpy().astype(np.float32),
        "mtp_hidden": h[0].numpy().astype(np.float32),
        "transformers_version": np.array(transformers.__version__),
        "torch_version": np.array(torch.__version__),
    })
    print(f"{name}: MTP logits {tuple(logits.shape)}")


@torch.no_grad()
def make_fp8(name: str) -> None:
    """The MTP golden of a block-FP8 fixture of make_quantized_fixtures.py (its MTP block's projections FP8, eh_proj
    dense): transformers' MtpModel on the exact values every stored weight stands for (make_quantized_fixtures.exact,
    the format's definition), written as a dense checkpoint; the prompt of that fixture's golden. Written as
    tests/fixtures/golden/<name>_mtp.npz."""
    from make_quantized_fixtures import exact

    src = MODELS_DIR / name
    config = json.loads((src / "config.json").read_text())
    block = config["quantization_config"]["weight_block_size"]
    from safetensors.torch import load_file as load_torch  # numpy has no e4m3 dtype: read with torch, exact in fp32

    stored = {k: v.float().numpy() for k, v in load_torch(str(src / "model.safetensors")).items()}
    dense = {k: (exact(v, stored[k + "_scale_inv"], block) if k + "_scale_inv" in stored else v.astype(np.float32))
             for k, v in stored.items() if not k.endswith("_scale_inv")}
    assert any(k.startswith(f"model.layers.{config['num_hidden_layers']}.") and k + "_scale_inv" in stored
               for k in dense), f"{name}: no FP8 weight in the MTP layer"
    plain = {k: v for k, v in config.items() if k != "quantization_config"}
    with tempfile.TemporaryDirectory() as tmp:
        (Path(tmp) / "config.json").write_text(json.dumps(plain))
        save_file(dict(sorted(dense.items())), str(Path(tmp) / "model.safetensors"), metadata={"format": "pt"})
        main, mtp = load_mtp(Path(tmp), plain)
        prompt = torch.from_numpy(np.load(GOLDEN_DIR / f"{name}.npz")["prompt"])[None, :]
        write_golden(f"{name}_mtp", main, mtp, prompt)


def main(argv: list[str]) -> None:
    names = argv or [*MTP, *FP8]
    for base in names:
        if base not in MTP and base not in FP8:
            raise SystemExit(f"unknown fixture {base!r} (choose from {', '.join([*MTP, *FP8])})")
        make(base, MTP[base]) if base in MTP else make_fp8(base)


if __name__ == "__main__":
    main(sys.argv[1:])
