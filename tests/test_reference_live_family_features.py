"""Live comparison with transformers on freshly drawn Gemma 2 / 3, Phi-3 and windowed models (skipped
without transformers). Each run draws new weights, a new prompt and, for the windowed families, a new
small window, so the prompt and the generation always cross it; the longrope model's switch position is
drawn inside the run too.
"""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from metrale_cli import decoding  # noqa: E402
from metrale_cli.model import open_model  # noqa: E402

pytestmark = pytest.mark.reference

S, F = "sliding_attention", "full_attention"
COMMON = dict(vocab_size=211, hidden_size=48, intermediate_size=72, num_hidden_layers=3, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=128, rms_norm_eps=1e-5, pad_token_id=None,
              bos_token_id=None, eos_token_id=None)
PROMPT, STEPS = 10, 16


def families(rng: np.random.Generator) -> dict:
    window = int(rng.integers(3, 9))  # < the prompt: prefill, decode and verify all cross it
    switch = int(rng.integers(PROMPT + 1, PROMPT + STEPS - 1))  # longrope: inside the generation
    rotary = 6  # phi3 head_dim 48 / 4 = 12, times 0.5

    def longrope(n: int, original: int) -> dict:
        return {"rope_type": "longrope", "rope_theta": 10000.0, "original_max_position_embeddings": original,
                "short_factor": rng.uniform(1, 2, n).round(3).tolist(),
                "long_factor": rng.uniform(2, 8, n).round(3).tolist()}

    return {
        "gemma2": ("Gemma2Config", "Gemma2ForCausalLM", dict(
            head_dim=16, query_pre_attn_scalar=int(rng.integers(8, 33)), sliding_window=window,
            attn_logit_softcapping=float(rng.uniform(2, 6)), final_logit_softcapping=float(rng.uniform(8, 20)),
            layer_types=[S, F, S], tie_word_embeddings=False)),
        "gemma3_text": ("Gemma3TextConfig", "Gemma3ForCausalLM", dict(
            head_dim=16, query_pre_attn_scalar=16, sliding_window=window, layer_types=[S, F, S],
            rope_parameters={F: {"rope_type": "linear", "factor": float(rng.uniform(2, 8)), "rope_theta": 1e5},
                             S: {"rope_type": "default", "rope_theta": 1e3}})),
        "gemma3_mm": ("Gemma3Config", "Gemma3ForConditionalGeneration", dict(
            text_config=dict(**COMMON, head_dim=16, query_pre_attn_scalar=16, sliding_window=window,
                             layer_types=[S, S, F]),
            vision_config=dict(hidden_size=32, intermediate_size=40, num_hidden_layers=1, num_attention_heads=2,
                               image_size=28, patch_size=14, model_type="siglip_vision_model"),
            mm_tokens_per_image=4, boi_token_index=200, eoi_token_index=201, image_token_index=202)),
        "phi3_window": ("Phi3Config", "Phi3ForCausalLM", dict(sliding_window=window)),
        "phi3_longrope_partial_tied": ("Phi3Config", "Phi3ForCausalLM", dict(
            tie_word_embeddings=True, original_max_position_embeddings=switch,
            rope_parameters={**longrope(rotary // 2, switch), "partial_rotary_factor": 0.5})),
        "mistral_window": ("MistralConfig", "MistralForCausalLM", dict(head_dim=16, sliding_window=window)),
        "qwen2_window": ("Qwen2Config", "Qwen2ForCausalLM", dict(
            use_sliding_window=True, sliding_window=window, max_window_layers=1)),
    }


def randomize(model, rng: np.random.Generator) -> None:
    """Fan-in scaled weights; norms drawn so a missing one shows: Gemma's (1 + w) weights around 0."""
    gemma = "Gemma" in type(model).__name__
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "vision" in name or "multi_modal" in name:
                continue
            if name.endswith("norm.weight"):
                val = rng.uniform(-0.5, 0.5, p.shape) if gemma else rng.uniform(0.5, 1.5, p.shape)
            elif "embed" in name:
                val = rng.normal(0, 0.3, p.shape)
            else:
                val = rng.normal(0, 1.5 / np.sqrt(p.shape[-1]), p.shape)
            p.copy_(torch.from_numpy(val.astype(np.float32)))


def build(family: str, tmp_path, rng):
    cfg_name, model_name, extra = families(rng)[family]
    kwargs = extra if "text_config" in extra else {**COMMON, **extra}
    config = getattr(transformers, cfg_name)(**kwargs)
    config._attn_implementation = "eager"
    config.get_text_config()._attn_implementation = "eager"
    model = getattr(transformers, model_name)(config).float().eval()
    randomize(model, rng)
    model.save_pretrained(tmp_path)
    return transformers.AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32,
                                                             attn_implementation="eager").eval()


@pytest.mark.parametrize("family", ["gemma2", "gemma3_text", "gemma3_mm", "phi3_window", "phi3_longrope_partial_tied",
                                    "mistral_window", "qwen2_window"])
def test_live_against_transformers(family, tmp_path):
    seed = int(np.random.default_rng().integers(2**31))
    rng = np.random.default_rng(seed)
    torch.manual_seed(seed)
    model = build(family, tmp_path, rng)
    vocab = model.config.get_text_config().vocab_size
    prompt = rng.integers(0, 200, PROMPT)  # below the multimodal model's image token ids
    with torch.no_grad():
        ref = model(torch.from_numpy(prompt)[None]).logits[0].numpy()
        ids = torch.from_numpy(prompt)[None]
        gen = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=STEPS,
                             min_new_tokens=STEPS, eos_token_id=None, pad_token_id=0,
                             output_logits=True, return_dict_in_generate=True)
    ref_tokens = gen.sequences[0, PROMPT:].tolist()
    ref_rows = torch.stack(gen.logits, 0)[:, 0].numpy()

    eng = open_model(tmp_path, device="cpu", max_context=64, fp32_logits=True).engine
    assert eng.vocab_size() == vocab
    fwd = decoding.run_forward(eng, list(prompt), all_rows=True, keep_rows=True)
    err = np.abs(fwd.logit_rows.array() - ref).max() / np.abs(ref).max()
    print(f"{family} seed={seed}: prefill max|diff|/max|ref| = {err:.2e}")
    assert err <= 1e-5, f"seed {seed}"

    out = decoding.run_decode(eng, list(prompt), STEPS, keep_rows=True)
    tokens = [s.token for s in out.steps]
    if tokens != ref_tokens:  # only a near tie in the reference may explain a different token
        i = next(j for j, (a, b) in enumerate(zip(tokens, ref_tokens)) if a != b)
        top2 = np.sort(ref_rows[i])[-2:]
        assert top2[1] - top2[0] < 1e-4, f"seed {seed}: token {i} differs with margin {top2[1] - top2[0]}"
    else:
        gerr = np.abs(out.rows.array() - ref_rows).max() / np.abs(ref_rows).max()
        print(f"{family} seed={seed}: greedy rows max|diff|/max|ref| = {gerr:.2e}")
        assert gerr <= 1e-5, f"seed {seed}"

    # a verify pass over random drafts equals transformers' forward of the whole sequence (no cache)
    drafts = [int(t) for t in rng.integers(0, 200, 6)]
    eng.reset()
    eng.prefill(list(prompt))
    eng.verify(drafts)
    rows = np.stack([eng._logits[i].astype(np.float32) for i in range(6)])
    with torch.no_grad():
        whole = model(torch.tensor([list(prompt) + drafts])).logits[0, -6:].numpy()
    assert np.abs(rows - whole).max() / np.abs(whole).max() <= 1e-5, f"seed {seed}"


@pytest.mark.parametrize("name", ["gemma2", "gemma3_mm"])
def test_sandwich_taps_equal_transformers_modules(name):
    """The taps at HF module names, the post-norms included, equal those modules' outputs."""
    from pathlib import Path

    from metrale_cli.engine.observe import capture

    path = Path(__file__).parent / "fixtures" / "models" / name
    m = open_model(path, device="cpu", fp32_logits=True)
    tokens = np.random.default_rng().integers(0, 200, 11)
    got = capture(m.engine, tokens.tolist(), lambda n: True)
    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32,
                                                              attn_implementation="eager").eval()
    decoder = getattr(model.model, "language_model", model.model)
    seen = {}
    hooks = []
    for i, layer in enumerate(decoder.layers):
        for sub in ("self_attn", "post_attention_layernorm", "mlp", "post_feedforward_layernorm"):
            def hook(mod, args, out, key=f"model.layers.{i}.{sub}"):
                seen[key] = (out[0] if isinstance(out, tuple) else out)[0].detach().numpy()
            hooks.append(getattr(layer, sub).register_forward_hook(hook))
    with torch.no_grad():
        model(torch.from_numpy(tokens)[None])
    for h in hooks:
        h.remove()
    assert len(seen) == 4 * len(decoder.layers)
    for key, ref in seen.items():
        err = np.abs(got[key] - ref).max() / np.abs(ref).max()
        assert err < 1e-5, f"{name} {key}: rel err {err:.2e}"
