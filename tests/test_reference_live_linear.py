"""Live comparison of the hybrid Gated DeltaNet families with transformers on freshly drawn random models
(skipped without it): prefill across chunk boundaries (1, 63, 64, 65 and 192 tokens; transformers' chunk
of 64), the linear-attention output taps against transformers' hooks, the state after prefill against
transformers' cache, and greedy decoding. Draws whose run has a routing near tie are redrawn (as the MoE
live tests do)."""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from metrale_cli import decoding  # noqa: E402
from metrale_cli.engine.observe import tapping  # noqa: E402
from metrale_cli.model import open_model  # noqa: E402

pytestmark = pytest.mark.reference

L, F = "linear_attention", "full_attention"
COMMON = dict(vocab_size=211, hidden_size=48, intermediate_size=72, num_attention_heads=4, num_key_value_heads=2,
              head_dim=16, max_position_embeddings=512, rms_norm_eps=1e-5, initializer_range=0.5,
              linear_conv_kernel_dim=4, bos_token_id=None, eos_token_id=None, pad_token_id=None)
VARIANTS = {
    # 4 layers L F L L, top-2 of 8 experts + shared, one value head per key head
    "qwen3_next": ("Qwen3NextConfig", "Qwen3NextForCausalLM", dict(
        num_hidden_layers=4, layer_types=[L, F, L, L], linear_num_key_heads=2, linear_num_value_heads=2,
        linear_key_head_dim=8, linear_value_head_dim=12, num_experts=8, num_experts_per_tok=2,
        moe_intermediate_size=24, shared_expert_intermediate_size=32)),
    # dense every layer (num_experts 0), 3 value heads per key head, the default interval (L L L F)
    "qwen3_next_dense": ("Qwen3NextConfig", "Qwen3NextForCausalLM", dict(
        num_hidden_layers=4, linear_num_key_heads=1, linear_num_value_heads=3, linear_key_head_dim=16,
        linear_value_head_dim=8, num_experts=0)),
    # Qwen3.5: flat in_proj_qkv / z / b / a; dense, or every layer sparse and renormalised; the multimodal
    # checkpoints' text part (a one-block vision tower that is never read)
    "qwen3_5_text": ("Qwen3_5TextConfig", "Qwen3_5ForCausalLM", dict(
        num_hidden_layers=4, layer_types=[L, L, F, L], linear_num_key_heads=2, linear_num_value_heads=4,
        linear_key_head_dim=8, linear_value_head_dim=12)),
    "qwen3_5": ("Qwen3_5Config", "Qwen3_5ForConditionalGeneration", dict(
        num_hidden_layers=4, linear_num_key_heads=2, linear_num_value_heads=2, linear_key_head_dim=8,
        linear_value_head_dim=12)),
    "qwen3_5_moe_text": ("Qwen3_5MoeTextConfig", "Qwen3_5MoeForCausalLM", dict(
        num_hidden_layers=4, layer_types=[L, F, L, L], linear_num_key_heads=2, linear_num_value_heads=4,
        linear_key_head_dim=8, linear_value_head_dim=12, num_experts=8, num_experts_per_tok=2,
        moe_intermediate_size=24, shared_expert_intermediate_size=32)),
    "qwen3_5_moe": ("Qwen3_5MoeConfig", "Qwen3_5MoeForConditionalGeneration", dict(
        num_hidden_layers=4, linear_num_key_heads=2, linear_num_value_heads=2, linear_key_head_dim=8,
        linear_value_head_dim=12, num_experts=8, num_experts_per_tok=4, moe_intermediate_size=24,
        shared_expert_intermediate_size=32)),
}
VISION = dict(depth=1, hidden_size=32, intermediate_size=40, num_heads=2, out_hidden_size=48, patch_size=14,
              spatial_merge_size=2, temporal_patch_size=2)
LENGTHS = (1, 63, 64, 65, 192)
STEPS = 16
MIN_ROUTE_GAP = 1e-5


def randomize(model, rng: np.random.Generator) -> None:
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("A_log"):
                val = np.log(rng.uniform(0.05, 0.5, p.shape))
            elif name.endswith("dt_bias"):
                val = rng.normal(0, 0.5, p.shape)
            elif name.endswith("linear_attn.norm.weight"):
                val = rng.uniform(0.5, 1.5, p.shape)
            elif "visual" in name:
                continue
            elif "norm" in name:  # (1 + w)
                val = rng.uniform(-0.5, 0.5, p.shape)
            elif "embed" in name:
                val = rng.normal(0, 1.0, p.shape)
            else:
                val = rng.normal(0, 1.2 / np.sqrt(p.shape[-1]), p.shape)
            p.copy_(torch.from_numpy(val.astype(np.float32)))


def route_gap(model, ids) -> float:
    logits = []
    hooks = [layer.mlp.gate.register_forward_hook(lambda m, a, o: logits.append(o[0].detach()))
             for layer in decoder(model).layers if hasattr(layer.mlp, "gate")]
    with torch.no_grad():
        model(ids, use_cache=False)
    for h in hooks:
        h.remove()
    k, gap = text_config(model).num_experts_per_tok, float("inf")
    for lg in logits:
        p = torch.softmax(lg.float(), -1).sort(-1, descending=True).values
        gap = min(gap, float((p[:, k - 1] - p[:, k]).min()))
    return gap


def draw(variant: str, seed: int, path):
    cfg_name, model_name, extra = VARIANTS[variant]
    rng = np.random.default_rng(seed)
    if model_name.endswith("ConditionalGeneration"):
        text = {k: v for k, v in {**COMMON, **extra}.items() if k not in ("bos_token_id", "eos_token_id", "pad_token_id")}
        config = getattr(transformers, cfg_name)(text_config=text, vision_config=VISION)
    else:
        config = getattr(transformers, cfg_name)(**COMMON, **extra)
    torch.manual_seed(seed)
    model = getattr(transformers, model_name)(config).float().eval()
    randomize(model, rng)
    model.save_pretrained(path)
    model = transformers.AutoModelForCausalLM.from_pretrained(
        path, dtype=torch.float32, attn_implementation="eager", experts_implementation="eager").eval()
    prompt = rng.integers(0, COMMON["vocab_size"], max(LENGTHS))
    ids = torch.from_numpy(prompt)[None]
    with torch.no_grad():
        gen = model.generate(ids[:, :20], attention_mask=torch.ones_like(ids[:, :20]), do_sample=False,
                             max_new_tokens=STEPS, min_new_tokens=STEPS, eos_token_id=None, pad_token_id=0,
                             output_logits=True, return_dict_in_generate=True)
    sparse = getattr(text_config(model), "num_experts", 0)
    gap = min(route_gap(model, ids), route_gap(model, gen.sequences)) if sparse else float("inf")
    return model, prompt, gen, gap


def decoder(model):
    return getattr(model.model, "language_model", model.model)


def text_config(model):
    return model.config.get_text_config()


def rel(a, b) -> float:
    return float(np.abs(a - b).max() / np.abs(b).max())


@pytest.mark.parametrize("variant", VARIANTS)
def test_live_hybrid_against_transformers(variant, tmp_path):
    seed0 = int(np.random.default_rng().integers(2**31))
    for attempt in range(10):
        seed, path = seed0 + attempt, tmp_path / f"m{attempt}"
        model, prompt, gen, gap = draw(variant, seed, path)
        if gap >= MIN_ROUTE_GAP:
            break
    else:
        pytest.fail(f"no draw without a routing near tie from seed {seed0}")
    eng = lambda: open_model(path, device="cpu", max_context=256, fp32_logits=True).engine  # noqa: E731
    linear = [i for i, t in enumerate(text_config(model).layer_types) if t == L]
    for n in LENGTHS:
        ids = torch.from_numpy(prompt[:n])[None]
        hooks, hf = [], {}
        for i in linear:
            hooks.append(decoder(model).layers[i].linear_attn.register_forward_hook(
                lambda m, a, o, i=i: hf.__setitem__(i, o[0].detach().numpy())))
        cache = transformers.DynamicCache(config=text_config(model))
        with torch.no_grad():
            ref = model(ids, cache=cache, use_cache=True).logits[0].numpy()
        for h in hooks:
            h.remove()
        e, taps = eng(), {}
        with tapping(e, lambda key, value: taps.__setitem__(key, np.array(value))):
            fwd = decoding.run_forward(e, list(prompt[:n]), all_rows=True, keep_rows=True)
        err = rel(fwd.logit_rows.array(), ref)
        tap_err = max(rel(taps[f"model.layers.{i}.linear_attn"], hf[i]) for i in linear)
        st = e.states["linear_attention"].tensors()
        state_err = max(max(rel(st[f"model.layers.{i}.linear_attn.recurrent_state"],
                                cache.layers[i].recurrent_states[0][0].numpy()),
                            rel(st[f"model.layers.{i}.linear_attn.conv_state"],
                                cache.layers[i].conv_states[0][0, :, 1:].numpy())) for i in linear)
        print(f"{variant} seed={seed} T={n}: logits {err:.1e}, linear_attn taps {tap_err:.1e}, state {state_err:.1e}")
        # Fresh draws: the chunked rule's fp32 roundings (metrale's and transformers' sum in different orders;
        # transformers' own chunked and recurrent rules differ by ~1e-5 at strong decays). Measured maxima over CI
        # runs and 15 local runs of all six variants (2026-12-07): logits 4.4e-5 (qwen3_next_dense seed 1381173352,
        # T=192), a linear_attn tap 2.5e-4 (relative to that layer's own largest value; qwen3_next_dense seed
        # 624600909, T=1, whose logits agreed to 6.3e-7), a state 2.2e-5 (qwen3_5_moe_text seed 1590196192, T=1).
        # The bounds sit above those with room; a wrong rule is off by 1e-2 or more, and the fixtures' goldens hold
        # 1e-5 (tests/test_reference_linear.py).
        assert err <= 1e-4 and tap_err <= 1e-3 and state_err <= 1e-4, f"seed {seed}, T={n}"
    out = decoding.run_decode(eng(), list(prompt[:20]), STEPS, keep_rows=True)
    ref_tokens = gen.sequences[0, 20:].tolist()
    ref_rows = torch.stack(gen.logits, 0)[:, 0].numpy()
    assert [s.token for s in out.steps] == ref_tokens, f"seed {seed}"
    assert rel(out.rows.array(), ref_rows) <= 1e-4, f"seed {seed}"  # as the prefill bound above
