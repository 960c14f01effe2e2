#!/usr/bin/env python
"""Build the hybrid linear-attention fixtures (Gated DeltaNet families) with transformers, fp32, CPU.

Same conventions as make_reference_fixtures.py (whose helpers it uses): a tiny random-weight model per
spec, saved under tests/fixtures/models/<name>/, and goldens in tests/fixtures/golden/<name>.npz. Run

    python scripts/make_linear_fixtures.py            # all of them
    python scripts/make_linear_fixtures.py qwen3_next # just some

Golden keys besides make_reference_fixtures' (prompt, prefill_logits, greedy_tokens, greedy_logits,
hidden_after_norm, bf16_prefill_logits, versions):
  long_prompt        int64   [192]       three chunks of transformers' chunked rule (chunk 64)
  long_logits        float32 [192, V]    model(long_prompt).logits
  lengths            int64   [5]         1, 63, 64, 65, 192
  lengths_last       float32 [5, V]      the last row of model(long_prompt[:n]) for each n, a forward of its own
  linear_layers      int64   [L]         the linear-attention layers
  conv_state         float32 [L, conv_dim, kernel]        transformers' cache after model(prompt)
  recurrent_state    float32 [L, v_heads, k_dim, v_dim]   (the conv state keeps kernel inputs; the
                                                           oldest is never read again)

Weights: make_reference_fixtures' reinit_, then (1 + w) norm weights ~ U(-0.5, 0.5) (RMSNormGated's plain
w stays U(0.5, 1.5)), A = exp(A_log) ~ U(0.05, 0.5) and dt_bias ~ N(0, 0.5): the decay exp(g) per token is
then mostly 0.7..0.97, so the state carries tens of tokens and every chunk boundary matters. (With A up
to 16, as transformers initialises it, the fp32 chunked rule's own rounding, from exp of differences of
large cumulative decays, reaches ~1e-5 relative: both transformers' and metrale's.)
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import torch
import transformers

sys.path.insert(0, str(Path(__file__).resolve().parent))
import make_reference_fixtures as ref  # noqa: E402

LENGTHS = (1, 63, 64, 65, 192)
PROMPT_LEN = 65  # the main prompt crosses one chunk boundary
LIN = "linear_attention"
FULL = "full_attention"
SMALL = dict(vocab_size=300, hidden_size=64, intermediate_size=80, num_attention_heads=4, num_key_value_heads=2,
             head_dim=32, max_position_embeddings=512, rms_norm_eps=1e-5, initializer_range=0.5,
             bos_token_id=None, eos_token_id=None, pad_token_id=None,
             linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=24,
             linear_conv_kernel_dim=4)


VISION = dict(depth=1, hidden_size=32, intermediate_size=40, num_heads=2, out_hidden_size=64, patch_size=14,
              spatial_merge_size=2, temporal_patch_size=2)


def specs():
    from transformers import (Qwen3_5Config, Qwen3_5ForConditionalGeneration, Qwen3_5MoeForCausalLM,
                              Qwen3_5MoeTextConfig, Qwen3NextConfig, Qwen3NextForCausalLM)

    text = {k: v for k, v in SMALL.items() if k not in ("bos_token_id", "eos_token_id", "pad_token_id")}

    return [
        # 5 layers L L L F L; sparse layers top-2 of 8 with the gated shared expert, layer 1 dense
        ("qwen3_next", 1401, Qwen3NextForCausalLM, lambda: Qwen3NextConfig(
            **SMALL, num_hidden_layers=5, layer_types=[LIN, LIN, LIN, FULL, LIN], num_experts=8, num_experts_per_tok=2,
            moe_intermediate_size=40, shared_expert_intermediate_size=56, norm_topk_prob=True, mlp_only_layers=[1],
            tie_word_embeddings=False)),
        # Qwen3.5 dense, the multimodal checkpoint (a one-block vision tower, never read): 4 layers L L L F,
        # flat in_proj_qkv / z / b / a, the decoder under model.language_model.
        ("qwen3_5", 1402, Qwen3_5ForConditionalGeneration, lambda: Qwen3_5Config(
            text_config=dict(text, num_hidden_layers=4, tie_word_embeddings=False), vision_config=VISION,
            tie_word_embeddings=False)),
        # Qwen3.5-MoE text model: 4 layers L F L L, every layer top-4 of 8 (renormalised) + the shared expert
        ("qwen3_5_moe_text", 1403, Qwen3_5MoeForCausalLM, lambda: Qwen3_5MoeTextConfig(
            **SMALL, num_hidden_layers=4, layer_types=[LIN, FULL, LIN, LIN], num_experts=8, num_experts_per_tok=4,
            moe_intermediate_size=40, shared_expert_intermediate_size=56, tie_word_embeddings=False)),
    ]


def reinit_hybrid_(model, seed: int) -> None:
    ref.reinit_(model, seed, bool(model.config.get_text_config().tie_word_embeddings))
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, p in sorted(model.named_parameters(), key=lambda kv: kv[0]):
            if name.endswith("A_log"):
                p.copy_(torch.empty(p.shape).uniform_(0.05, 0.5, generator=g).log())
            elif name.endswith("dt_bias"):
                p.copy_(0.5 * torch.randn(p.shape, generator=g))
            elif "norm" in name and "linear_attn.norm" not in name:  # zero-centred (1 + w)
                p.copy_(torch.rand(p.shape, generator=g) - 0.5)


def states(model, prompt: np.ndarray) -> dict:
    """transformers' cache contents after a prefill of `prompt`."""
    text = model.config.get_text_config()
    cache = transformers.DynamicCache(config=text)
    with torch.no_grad():
        model(torch.from_numpy(prompt)[None], cache=cache, use_cache=True)
    layers = [i for i, t in enumerate(text.layer_types) if t == LIN]
    return {"linear_layers": np.array(layers, np.int64),
            "conv_state": np.stack([cache.layers[i].conv_states[0][0].numpy() for i in layers]).astype(np.float32),
            "recurrent_state": np.stack([cache.layers[i].recurrent_states[0][0].numpy()
                                         for i in layers]).astype(np.float32)}


def routing_gap(model, ids: np.ndarray) -> float:
    if not any(hasattr(layer.mlp, "gate") for layer in getattr(model.model, "language_model", model.model).layers):
        return float("inf")
    return ref.moe_golden(model, torch.from_numpy(ids)[None])[1]


def build(name, seed, model_cls, make_config):
    out = ref.MODELS_DIR / name
    config = make_config()
    config._attn_implementation = "eager"
    config.get_text_config()._attn_implementation = "eager"
    torch.manual_seed(seed)
    model = model_cls(config).float().eval()
    reinit_hybrid_(model, seed)
    model.save_pretrained(out)
    cfg_path = out / "config.json"
    ref.write_json(cfg_path, __import__("json").loads(cfg_path.read_text()))
    # reload from disk; sparse layers with transformers' plain per-expert loop (its CPU default is grouped)
    sparse = bool(getattr(config.get_text_config(), "num_experts", 0))
    model = model_cls.from_pretrained(out, attn_implementation="eager",
                                      **({"experts_implementation": "eager"} if sparse else {})).float().eval()
    vocab = config.get_text_config().vocab_size
    for attempt in range(50):
        rng = np.random.default_rng(seed * 100 + attempt)
        prompt = rng.integers(0, vocab, size=PROMPT_LEN, dtype=np.int64)
        long_prompt = rng.integers(0, vocab, size=max(LENGTHS), dtype=np.int64)
        arrays, info = ref.run_golden(model, prompt, config)
        seq = np.concatenate([prompt, arrays["greedy_tokens"][:-1]])
        info["route_gap"] = min(routing_gap(model, seq), routing_gap(model, long_prompt))
        if info["margin"] >= ref.MIN_MARGIN and info["distinct"] >= ref.MIN_DISTINCT and info["route_gap"] >= ref.MIN_ROUTE_GAP:
            break
    else:
        raise RuntimeError("no prompt without near ties found")
    info["attempt"] = attempt
    with torch.no_grad():
        arrays["long_prompt"] = long_prompt
        arrays["long_logits"] = model(torch.from_numpy(long_prompt)[None]).logits[0].float().numpy()
        arrays["lengths"] = np.array(LENGTHS, np.int64)
        arrays["lengths_last"] = np.stack([model(torch.from_numpy(long_prompt[:n])[None]).logits[0, -1].float().numpy()
                                           for n in LENGTHS])
    arrays.update(states(model, prompt))
    ref.GOLDEN_DIR.mkdir(parents=True, exist_ok=True)
    ref.write_npz(ref.GOLDEN_DIR / f"{name}.npz", arrays)
    return info


def main(argv):
    torch.set_num_threads(1)
    torch.use_deterministic_algorithms(True)
    transformers.logging.set_verbosity_error()
    transformers.logging.disable_progress_bar()
    only = set(argv[1:])
    for spec in specs():
        if only and spec[0] not in only:
            continue
        info = build(*spec)
        print(f"== {spec[0]}: min-greedy-margin={info['margin']:.4f} distinct-greedy={info['distinct']} "
              f"route-gap={info['route_gap']:.2e} prompt-attempt={info['attempt']}")
        for k, v in info["checks"].items():
            print(f"   {k}: {v}")


if __name__ == "__main__":
    main(sys.argv)
