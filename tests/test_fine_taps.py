"""--taps fine: the values inside a block that other engines dump, against transformers' own modules (forward
hooks on the norms and projections, pre-hooks for o_proj's and down_proj's inputs, and the model module's
apply_rotary_pos_emb wrapped to record q and k after rope), on fresh random prompts."""

from __future__ import annotations

import importlib
from pathlib import Path

import numpy as np
import pytest

from metrale_cli.engine.loop import tap_names
from metrale_cli.engine.observe import capture
from metrale_cli.model import open_model

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

FIXTURES = Path(__file__).parent / "fixtures" / "models"
MODELS = ["llama", "qwen2", "qwen3", "mistral", "gemma2"]


def transformers_taps(name: str, tokens: list[int]) -> dict[str, np.ndarray]:
    model = transformers.AutoModelForCausalLM.from_pretrained(FIXTURES / name, dtype=torch.float32,
                                                              attn_implementation="eager").eval()
    out: dict[str, np.ndarray] = {}

    def rows(t) -> np.ndarray:
        return t.detach()[0].reshape(t.shape[1], -1).numpy().copy()

    def keep(key):
        return lambda m, args, result: out.__setitem__(key, rows(result))

    def keep_input(key):
        return lambda m, args: out.__setitem__(key, rows(args[0]))

    for mod_name, module in model.named_modules():
        if not mod_name.startswith("model.layers."):
            continue
        leaf = mod_name.split(".", 3)[3] if mod_name.count(".") >= 3 else ""
        if leaf in ("input_layernorm", "self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj",
                    "self_attn.q_norm", "self_attn.k_norm", "mlp.gate_proj", "mlp.up_proj"):
            module.register_forward_hook(keep(mod_name))
        elif leaf in ("post_attention_layernorm", "pre_feedforward_layernorm"):
            module.register_forward_hook(keep(mod_name))
        elif leaf == "self_attn.o_proj":
            module.register_forward_pre_hook(keep_input(mod_name + ".input"))
        elif leaf == "mlp.down_proj":
            module.register_forward_pre_hook(keep_input(mod_name + ".input"))
    modeling = importlib.import_module(type(model).__module__)
    original = modeling.apply_rotary_pos_emb
    layer = [0]

    def recording(q, k, *args, **kwargs):  # [B, heads, T, d] each, layer by layer in order
        qr, kr = original(q, k, *args, **kwargs)
        p = f"model.layers.{layer[0]}.self_attn."
        out[p + "q_rope"] = qr[0].transpose(0, 1).reshape(qr.shape[2], -1).detach().numpy().copy()
        out[p + "k_rope"] = kr[0].transpose(0, 1).reshape(kr.shape[2], -1).detach().numpy().copy()
        layer[0] += 1
        return qr, kr

    modeling.apply_rotary_pos_emb = recording
    try:
        with torch.no_grad():
            model(torch.tensor([tokens]))
    finally:
        modeling.apply_rotary_pos_emb = original
    return out


@pytest.mark.parametrize("name", MODELS)
def test_fine_taps_equal_transformers_modules(name):
    m = open_model(FIXTURES / name, device="cpu", fp32_logits=True)
    tokens = [int(t) for t in np.random.default_rng().integers(0, m.config.vocab_size, 9)]
    m.engine.fine_taps = True
    got = capture(m.engine, tokens, lambda n: True)
    want = transformers_taps(name, tokens)
    fine = set(tap_names(m.config.definition, fine=True)) - set(tap_names(m.config.definition))
    assert fine and fine <= set(got)  # every fine tap the definition names was recorded
    compared = 0
    for key in sorted(fine):
        if key.endswith(("post_attention_layernorm",)) and key not in want:
            continue
        assert key in want, f"{name}: transformers has no partner for {key}"
        ref = want[key]
        err = float(np.abs(got[key] - ref).max() / np.abs(ref).max())
        assert err <= 1e-5, f"{name} {key}: {err:.2e}"
        compared += 1
    assert compared == len(fine)


def test_fine_taps_are_off_unless_asked_and_change_nothing():
    m = open_model(FIXTURES / "qwen3", device="cpu", fp32_logits=True)
    tokens = [5, 17, 250, 3]
    plain = capture(m.engine, tokens, lambda n: True)
    assert not any(n.endswith(("q_proj", "q_rope", "down_proj.input")) for n in plain)
    m.engine.fine_taps = True
    fine = capture(m.engine, tokens, lambda n: True)
    for key, value in plain.items():
        assert np.array_equal(fine[key], value), key  # the block's own path is the same


def test_the_cli_refuses_fine_taps_where_they_do_not_run(tmp_path, monkeypatch):
    from typer.testing import CliRunner

    from metrale_cli.cli import app, job

    monkeypatch.setattr(job, "resolve_device", lambda device: device if device != "auto" else "cpu")  # a GPU machine
    res = CliRunner().invoke(app, ["forward", "-m", str(FIXTURES / "llama"), "-t", "1,2", "--taps", "fine"])
    assert res.exit_code == 2 and "--taps needs --dump-layers PATH" in res.output
    res = CliRunner().invoke(app, ["forward", "-m", str(FIXTURES / "llama"), "-t", "1,2", "--taps", "fine",
                                   "--dump-layers", str(tmp_path / "d.safetensors"), "--device", "cuda"])
    assert res.exit_code == 2 and "--taps fine runs on the CPU engine only" in res.output
