#!/usr/bin/env python
"""Build golden reference fixtures with Hugging Face transformers (fp32, CPU).

For every model in MODELS this script
  * builds a tiny random-weight model with transformers (eager attention, fp32),
    re-initialises ALL parameters from a seeded torch.Generator (norm weights and
    biases included, so a missing norm / bias is noticed by the tests),
  * writes it with ``save_pretrained`` to ``tests/fixtures/models/<name>/``,
  * runs transformers on a random prompt and writes ``tests/fixtures/golden/<name>.npz``.

Everything is seeded; no network is needed.  Regenerate with

    python scripts/make_reference_fixtures.py

Golden npz keys (all loadable without allow_pickle):
  prompt               int64   [T]
  prefill_logits       float32 [T, vocab]   model(prompt).logits, all rows
  greedy_tokens        int64   [N]          generate(do_sample=False, N new tokens, eos disabled)
  greedy_logits        float32 [N, vocab]   raw logits that produced each greedy token
  hidden_after_norm    float32 [hidden]     final-norm output at the last prompt position
  bf16_prefill_logits  uint16  [T, vocab]   bit patterns of prefill_logits.to(torch.bfloat16)
  transformers_version / torch_version      0-d unicode arrays
"""

from __future__ import annotations

import io
import json
import os
import shutil
import sys
import zipfile
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import numpy as np  # noqa: E402
import torch  # noqa: E402
import transformers  # noqa: E402
from transformers import (  # noqa: E402
    AutoModelForCausalLM,
    GenerationConfig,
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
)
from transformers import (  # noqa: E402  (mixtures of experts)
    MixtralConfig,
    MixtralForCausalLM,
    Qwen2MoeConfig,
    Qwen2MoeForCausalLM,
    Qwen3MoeConfig,
    Qwen3MoeForCausalLM,
)

sys.path.insert(0, str(Path(__file__).resolve().parent))
import mla_reference_specs as mla_specs  # noqa: E402  (latent attention, DeepSeek routing, GLM-4.5)

ROOT = Path(__file__).resolve().parent.parent
FIX = ROOT / "tests" / "fixtures"
MODELS_DIR = FIX / "models"
GOLDEN_DIR = FIX / "golden"

PROMPT_LEN = 12
NEW_TOKENS = 32
TIED_EMBED_STD = 0.2
MIN_DISTINCT = NEW_TOKENS // 2  # reject prompts whose greedy decode falls into a short loop
MIN_MARGIN = 0.05  # reject prompts whose greedy decode has a top1-top2 gap below this

# Shared tiny shape.  vocab is deliberately not a power of two (nor a multiple of 8);
# intermediate != hidden so a transposed MLP weight cannot go unnoticed.
BASE = dict(
    vocab_size=300,
    hidden_size=64,
    intermediate_size=80,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
    rms_norm_eps=1e-5,
    initializer_range=0.5,  # metadata only: weights are re-initialised below
    hidden_act="silu",
    bos_token_id=None,
    eos_token_id=None,  # eos disabled so greedy decoding never stops early
    pad_token_id=None,
    attn_implementation="eager",
)
ROPE_DEFAULT = {"rope_type": "default", "rope_theta": 10000.0}
ROPE_LLAMA3 = {
    "rope_type": "llama3",
    "rope_theta": 10000.0,
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 32,
}


def model_specs():
    return [
        # name, seed, model class, config class, extra config kwargs, save options
        ("llama", 1001, LlamaForCausalLM, LlamaConfig,
         dict(tie_word_embeddings=False, rope_parameters=dict(ROPE_DEFAULT)), {}),
        ("llama_tied", 1002, LlamaForCausalLM, LlamaConfig,
         dict(tie_word_embeddings=True, rope_parameters=dict(ROPE_DEFAULT)), {}),
        ("llama3_rope", 1003, LlamaForCausalLM, LlamaConfig,
         dict(tie_word_embeddings=False, rope_parameters=dict(ROPE_LLAMA3)),
         dict(max_shard_size="150KB", legacy_config=True)),
        ("mistral", 1004, MistralForCausalLM, MistralConfig,
         dict(tie_word_embeddings=False, head_dim=32, sliding_window=None,
              rope_parameters=dict(ROPE_DEFAULT)), {}),
        ("qwen2", 1005, Qwen2ForCausalLM, Qwen2Config,
         dict(rope_parameters=dict(ROPE_DEFAULT)), {}),  # default: untied, q/k/v bias
        ("qwen3", 1006, Qwen3ForCausalLM, Qwen3Config,
         dict(tie_word_embeddings=True, head_dim=24, rope_parameters=dict(ROPE_DEFAULT)), {}),
        ("llama_bf16", 1007, LlamaForCausalLM, LlamaConfig,
         dict(tie_word_embeddings=False, rope_parameters=dict(ROPE_DEFAULT)), dict(bf16=True)),
    ]


# --------------------------------------------------------------------------- mixtures of experts
# Sparse families: >= 8 experts, top-k 2 and 8, dense and sparse layers mixed, norm_topk_prob both ways.
# Goldens add the router's view of the prompt (see moe_golden); prompts are also required to keep every
# routing decision clear of a near tie (MIN_ROUTE_GAP), so fp32 rounding cannot change an expert.
MOE_TYPES = ("qwen2_moe", "qwen3_moe", "mixtral") + mla_specs.TYPES
MIN_ROUTE_GAP = 1e-5  # smallest allowed gap between the k-th and (k+1)-th routing probability


def moe_model_specs():
    return [
        # 3 layers, layer 1 dense (mlp_only_layers); top-8 of 16 experts, renormalised; q/k norm, untied
        ("qwen3_moe", 1101, Qwen3MoeForCausalLM, Qwen3MoeConfig,
         dict(num_hidden_layers=3, head_dim=24, num_experts=16, num_experts_per_tok=8, moe_intermediate_size=40,
              norm_topk_prob=True, mlp_only_layers=[1], decoder_sparse_step=1, tie_word_embeddings=False,
              rope_parameters=dict(ROPE_DEFAULT)), {}),
        # top-2 of 8 experts, not renormalised, a sigmoid-gated shared expert, q/k/v bias
        ("qwen2_moe", 1102, Qwen2MoeForCausalLM, Qwen2MoeConfig,
         dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=40, shared_expert_intermediate_size=56,
              norm_topk_prob=False, tie_word_embeddings=False, rope_parameters=dict(ROPE_DEFAULT)), {}),
        # top-2 of 8 experts of intermediate_size, always renormalised (block_sparse_moe.experts.{i}.w1/w2/w3)
        ("mixtral", 1103, MixtralForCausalLM, MixtralConfig,
         dict(num_local_experts=8, num_experts_per_tok=2, head_dim=32, sliding_window=None,
              tie_word_embeddings=False, rope_parameters=dict(ROPE_DEFAULT)), {}),
    ]


def is_moe(model) -> bool:
    return model.config.model_type in MOE_TYPES


def moe_golden(model, ids: torch.Tensor) -> tuple[dict, float]:
    """Router logits, chosen experts and weights, and the sparse block's output per sparse layer on `ids`
    [1, T] (no cache), and the smallest top-k boundary gap of the routing probabilities."""
    logs: dict[str, list] = {"router_logits": [], "top_k_index": [], "top_k_weights": [], "moe_output": []}
    def router_hook(module, args, out) -> None:  # the router returns (logits, weights, indices)
        for key, value in zip(("router_logits", "top_k_weights", "top_k_index"), out):
            logs[key].append(value.detach().clone())

    def block_hook(module, args, out) -> None:
        logs["moe_output"].append(out[0].detach().clone())

    hooks, layers = [], []
    for i, layer in enumerate(model.model.layers):
        if not hasattr(layer.mlp, "gate"):
            continue  # a dense layer
        layers.append(i)
        hooks.append(layer.mlp.gate.register_forward_hook(router_hook))
        hooks.append(layer.mlp.register_forward_hook(block_hook))
    with torch.no_grad():
        model(ids, use_cache=False)
    for h in hooks:
        h.remove()
    k = model.config.num_experts_per_tok
    gap = float("inf")
    grouped = model.config.model_type in mla_specs.TYPES
    if grouped:  # DeepSeek / GLM routing: the margins of its group and expert choices
        gap = min(mla_specs.route_gap(model, layers, logs["router_logits"]), mla_specs.indexer_gap(model, ids))
    for logits in [] if grouped else logs["router_logits"]:
        probs = torch.softmax(logits.float(), dim=-1).sort(dim=-1, descending=True).values
        if k < probs.shape[-1]:
            gap = min(gap, float((probs[:, k - 1] - probs[:, k]).min()))
    arrays = {
        "moe_layers": np.array(layers, np.int64),
        "router_logits": torch.stack(logs["router_logits"]).numpy().astype(np.float32),
        "top_k_index": torch.stack(logs["top_k_index"]).numpy().astype(np.int64),
        "top_k_weights": torch.stack(logs["top_k_weights"]).numpy().astype(np.float32),
        "moe_output": torch.stack(logs["moe_output"]).numpy().astype(np.float32),
    }
    return arrays, gap


# --------------------------------------------------------------------------- helpers


def reinit_(model: torch.nn.Module, seed: int, tied: bool) -> None:
    """Deterministically overwrite every parameter.

    Scales are chosen so activations stay O(1) (soft, informative attention) while
    the logits are far from uniform.  Norm weights ~ U(0.5, 1.5), biases ~ N(0, 0.5).
    Tied models get small embeddings: with lm_head == embed_tokens a large embedding
    makes every step predict the current token again (a degenerate repeat loop).
    """
    embed_std = TIED_EMBED_STD if tied else 1.0
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in sorted(model.named_parameters(), key=lambda kv: kv[0]):
            if "norm" in name:
                new = 0.5 + torch.rand(p.shape, generator=g, dtype=torch.float32)
            elif name.endswith(".bias"):
                new = 0.5 * torch.randn(p.shape, generator=g, dtype=torch.float32)
            elif "embed_tokens" in name:
                new = embed_std * torch.randn(p.shape, generator=g, dtype=torch.float32)
            elif "lm_head" in name:
                new = 2.5 / p.shape[1] ** 0.5 * torch.randn(p.shape, generator=g, dtype=torch.float32)
            else:  # Linear [out, in], or stacked experts [E, out, in]
                new = 1.2 / p.shape[-1] ** 0.5 * torch.randn(p.shape, generator=g, dtype=torch.float32)
            p.copy_(new)


def write_npz(path: Path, arrays: dict) -> None:
    """np.savez equivalent with a fixed zip timestamp, so output is byte-reproducible."""
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w", compression=zipfile.ZIP_STORED) as zf:
        for key in arrays:
            arr = np.asarray(arrays[key])
            info = zipfile.ZipInfo(key + ".npy", date_time=(1980, 1, 1, 0, 0, 0))
            info.compress_type = zipfile.ZIP_STORED
            info.external_attr = 0o644 << 16
            b = io.BytesIO()
            np.lib.format.write_array(b, arr, allow_pickle=False)
            zf.writestr(info, b.getvalue())
    path.write_bytes(buf.getvalue())


def write_json(path: Path, obj) -> None:
    path.write_text(json.dumps(obj, indent=2, sort_keys=True) + "\n")


def to_legacy_config(cfg: dict) -> dict:
    """Rewrite a transformers-5 config.json into the transformers-4.x layout."""
    cfg = dict(cfg)
    if "dtype" in cfg:
        cfg["torch_dtype"] = cfg.pop("dtype")
    rp = dict(cfg.pop("rope_parameters"))
    cfg["rope_theta"] = rp.pop("rope_theta")
    if rp.get("rope_type", "default") != "default":
        cfg["rope_scaling"] = rp
    else:
        cfg["rope_scaling"] = None
    return cfg


def bf16_bits(t: torch.Tensor) -> np.ndarray:
    return t.to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16).copy()


def load_fp32(path: Path) -> torch.nn.Module:
    moe = json.loads((path / "config.json").read_text())["model_type"] in MOE_TYPES
    # MoE: transformers' plain per-expert loop (its CPU default is a grouped matmul)
    m = AutoModelForCausalLM.from_pretrained(path, attn_implementation="eager",
                                             **({"experts_implementation": "eager"} if moe else {}))
    return m.float().eval()


# --------------------------------------------------------------------------- golden run


def run_golden(model, prompt: np.ndarray, cfg) -> tuple[dict, dict]:
    ids = torch.from_numpy(prompt).long()[None]
    captured = {}
    decoder = getattr(model.model, "language_model", model.model)  # Gemma3ForConditionalGeneration nests it
    hook = decoder.norm.register_forward_hook(lambda m, i, o: captured.__setitem__("norm", o.detach().clone()))
    with torch.no_grad():
        out = model(ids, output_hidden_states=True, use_cache=False)
        hook.remove()
        logits = out.logits[0].float()
        hs_last = out.hidden_states[-1][0, -1]
        norm_last = captured["norm"][0, -1]
        lm_last = model.lm_head(norm_last)
    checks = {
        "hidden_states[-1] is post-norm": bool(torch.equal(hs_last, norm_last)),
        "lm_head(hidden) vs logits": float((lm_last - logits[-1]).abs().max()),
    }

    gcfg = GenerationConfig(
        do_sample=False, max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS,
        eos_token_id=None, pad_token_id=0, bos_token_id=None,
        output_logits=True, output_scores=True, return_dict_in_generate=True,
        num_beams=1, temperature=None, top_p=None, top_k=None,
    )
    with torch.no_grad():
        gen = model.generate(ids, attention_mask=torch.ones_like(ids), generation_config=gcfg)
    seq = gen.sequences[0]
    assert torch.equal(seq[: len(prompt)], ids[0])
    new = seq[len(prompt):]
    assert new.numel() == NEW_TOKENS, new.numel()
    glog = torch.stack([x[0] for x in gen.logits]).float()
    gscores = torch.stack([x[0] for x in gen.scores]).float()
    assert torch.equal(glog.argmax(-1), new), "greedy tokens are not argmax of raw logits"
    checks["scores==logits (no processor changed them)"] = bool(torch.equal(glog, gscores))
    checks["greedy_logits[0] vs prefill_logits[-1]"] = float((glog[0] - logits[-1]).abs().max())
    # full (no-cache) forward of prompt + generated tokens must reproduce the greedy logits
    with torch.no_grad():
        full = model(seq[None, :-1], use_cache=False).logits[0, len(prompt) - 1:].float()
    checks["greedy_logits vs no-cache forward"] = float((full - glog).abs().max())
    top2 = glog.topk(2, dim=-1).values
    margin = float((top2[:, 0] - top2[:, 1]).min())

    arrays = {
        "prompt": prompt.astype(np.int64),
        "prefill_logits": logits.numpy().astype(np.float32),
        "greedy_tokens": new.numpy().astype(np.int64),
        "greedy_logits": glog.numpy().astype(np.float32),
        "hidden_after_norm": norm_last.float().numpy().astype(np.float32),
        "bf16_prefill_logits": bf16_bits(logits),
        "transformers_version": np.array(transformers.__version__),
        "torch_version": np.array(torch.__version__),
    }
    info = {
        "margin": margin,
        "distinct": int(new.unique().numel()),
        "spread": float(logits.max() - logits.min()),
        "row_spread": float((logits.max(-1).values - logits.min(-1).values).mean()),
        "checks": checks,
    }
    return arrays, info


def pick_prompt(model, vocab: int, seed: int, cfg):
    """First seeded prompt whose greedy decode has no near ties and no short loop (deterministic)."""
    for attempt in range(50):
        rng = np.random.default_rng(seed * 100 + attempt)
        prompt = rng.integers(0, vocab, size=PROMPT_LEN, dtype=np.int64)
        arrays, info = run_golden(model, prompt, cfg)
        info["attempt"] = attempt
        if is_moe(model):  # the router's view of the prompt, and no near tie anywhere in the greedy run
            extra, _ = moe_golden(model, torch.from_numpy(prompt)[None])
            seq = np.concatenate([prompt, arrays["greedy_tokens"][:-1]])
            _, info["route_gap"] = moe_golden(model, torch.from_numpy(seq)[None])
            arrays.update(extra)
            arrays.update(mla_specs.mla_golden(model, torch.from_numpy(prompt)[None]))  # MLA: the normed latents
            if info["route_gap"] < MIN_ROUTE_GAP:
                continue
        if info["margin"] >= MIN_MARGIN and info["distinct"] >= MIN_DISTINCT:
            return arrays, info
    raise RuntimeError("no prompt without near ties found")


# --------------------------------------------------------------- family features: Gemma 2/3, Phi-3 (issue 13)
#
# Windows of 8 (every prompt of 12 and every greedy run crosses them), (1 + w) norm weights drawn around 0,
# small softcaps so that tanh bends the scores and logits, query_pre_attn_scalar != head_dim, and longrope
# with original_max_position_embeddings small enough that the short/long switch happens inside the run.

ISSUE13_BASE = dict(vocab_size=300, hidden_size=64, intermediate_size=80, num_attention_heads=4,
                    num_key_value_heads=2, rms_norm_eps=1e-5, initializer_range=0.5, bos_token_id=None,
                    eos_token_id=None, pad_token_id=None)
S, F = "sliding_attention", "full_attention"


def _longrope(seed: int, rotary_dim: int, original: int) -> dict:
    g = np.random.default_rng(seed)
    return {"rope_type": "longrope", "rope_theta": 10000.0, "original_max_position_embeddings": original,
            "short_factor": [round(float(x), 3) for x in g.uniform(1.0, 2.0, rotary_dim // 2)],
            "long_factor": [round(float(x), 3) for x in g.uniform(2.0, 8.0, rotary_dim // 2)]}


def issue13_specs():
    from transformers import (Gemma2Config, Gemma2ForCausalLM, Gemma3Config, Gemma3ForCausalLM,
                              Gemma3ForConditionalGeneration, Gemma3TextConfig, Phi3Config, Phi3ForCausalLM)

    rope = {"rope_parameters": dict(ROPE_DEFAULT)}

    gemma3_text = dict(num_hidden_layers=6, head_dim=32, query_pre_attn_scalar=20, sliding_window=8,
                       max_position_embeddings=256)
    return [
        # name, seed, model class, config factory, layout ("5.x" | "4.x")
        ("gemma2", 1301, Gemma2ForCausalLM, lambda: Gemma2Config(
            **ISSUE13_BASE, num_hidden_layers=3, head_dim=32, query_pre_attn_scalar=24, sliding_window=8,
            max_position_embeddings=256, attn_logit_softcapping=4.0, final_logit_softcapping=30.0,
            layer_types=[S, F, S]), "5.x"),
        ("gemma3_text", 1302, Gemma3ForCausalLM, lambda: Gemma3TextConfig(
            **ISSUE13_BASE, **gemma3_text, final_logit_softcapping=30.0, layer_types=[S, S, F, S, S, F],
            rope_parameters={F: {"rope_type": "linear", "factor": 4.0, "rope_theta": 100000.0},
                             S: {"rope_type": "default", "rope_theta": 1000.0}}), "5.x"),
        ("gemma3_text_4x", 1303, Gemma3ForCausalLM, lambda: Gemma3TextConfig(
            **ISSUE13_BASE, **gemma3_text,  # default pattern 5 sliding : 1 full
            rope_parameters={F: {"rope_type": "linear", "factor": 8.0, "rope_theta": 1000000.0},
                             S: {"rope_type": "default", "rope_theta": 10000.0}}), "4.x"),
        ("gemma3_mm", 1304, Gemma3ForConditionalGeneration, lambda: Gemma3Config(
            text_config=dict(**ISSUE13_BASE, num_hidden_layers=3, head_dim=32, query_pre_attn_scalar=20,
                             sliding_window=8, max_position_embeddings=256, layer_types=[S, S, F]),
            vision_config=dict(hidden_size=32, intermediate_size=40, num_hidden_layers=1, num_attention_heads=2,
                               image_size=28, patch_size=14, model_type="siglip_vision_model"),
            mm_tokens_per_image=4, boi_token_index=290, eoi_token_index=291, image_token_index=292), "5.x"),
        ("phi3", 1305, Phi3ForCausalLM, lambda: Phi3Config(
            **ISSUE13_BASE, num_hidden_layers=3, sliding_window=8, max_position_embeddings=256,
            tie_word_embeddings=False), "5.x"),
        ("phi3_longrope", 1306, Phi3ForCausalLM, lambda: Phi3Config(
            **ISSUE13_BASE, num_hidden_layers=3, max_position_embeddings=256, original_max_position_embeddings=16,
            rope_parameters=_longrope(1306, 16, 16), tie_word_embeddings=False), "4.x"),
        ("phi4_mini", 1307, Phi3ForCausalLM, lambda: Phi3Config(
            **ISSUE13_BASE, num_hidden_layers=3, max_position_embeddings=256, original_max_position_embeddings=8,
            rope_parameters={**_longrope(1307, 12, 8), "partial_rotary_factor": 0.75}, tie_word_embeddings=True),
         "5.x"),
        # the Llama-block families' windows, now attended to instead of refused
        ("mistral_window", 1308, MistralForCausalLM, lambda: MistralConfig(
            **ISSUE13_BASE, num_hidden_layers=2, head_dim=32, sliding_window=8, max_position_embeddings=256,
            tie_word_embeddings=False, **rope), "5.x"),
        ("qwen3_window", 1309, Qwen3ForCausalLM, lambda: Qwen3Config(
            **ISSUE13_BASE, num_hidden_layers=3, head_dim=24, use_sliding_window=True, sliding_window=8,
            max_window_layers=1, max_position_embeddings=256, tie_word_embeddings=False, **rope), "5.x"),
    ]


GEMMA_TIED_EMBED_STD = 0.04  # times sqrt(hidden) = 8 at the input: 0.32, so a token does not predict itself
GEMMA_FINAL_NORM_SHIFT = 16.0  # final norm scale ~16: the tied head's logits keep a spread of ~10


def reinit_issue13_(model: torch.nn.Module, seed: int, tied: bool) -> None:
    """reinit_, then for Gemma: (1 + w) norm weights w ~ U(-0.5, 0.5) (a scale of 0.5..1.5, as the other
    families' U(0.5, 1.5) weights, so a norm that forgets the 1 is noticed); with tied embeddings a small
    embedding (the input is scaled by sqrt(hidden)) and a large final norm scale (the head is that embedding)."""
    # A multimodal model: only its language model is redrawn (the vision tower keeps its seeded init).
    model = getattr(getattr(model, "model", None), "language_model", model)
    reinit_(model, seed, tied)
    if "Gemma" not in type(model).__name__:
        return
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, p in sorted(model.named_parameters(), key=lambda kv: kv[0]):
            if "vision" in name or "multi_modal" in name:
                continue
            if "norm" in name:
                new = torch.rand(p.shape, generator=g, dtype=torch.float32) - 0.5
                if tied and name.endswith("norm.weight") and "layers." not in name:  # the final norm
                    new += GEMMA_FINAL_NORM_SHIFT
                p.copy_(new)
            elif tied and "embed_tokens" in name:
                p.copy_(GEMMA_TIED_EMBED_STD * torch.randn(p.shape, generator=g, dtype=torch.float32))


def legacy_gemma3(cfg: dict) -> dict:
    """A 5.x Gemma 3 text config.json in the 4.x layout: rope_theta / rope_local_base_freq / rope_scaling,
    sliding_window_pattern instead of layer_types, torch_dtype."""
    cfg = dict(cfg)
    cfg["torch_dtype"] = cfg.pop("dtype")
    rp = cfg.pop("rope_parameters")
    full, local = dict(rp[F]), dict(rp[S])
    cfg["rope_theta"] = full.pop("rope_theta")
    cfg["rope_local_base_freq"] = local.pop("rope_theta")
    cfg["rope_scaling"] = full if full.get("rope_type") != "default" else None
    cfg.pop("layer_types")
    cfg.pop("_sliding_window_pattern", None)
    cfg["sliding_window_pattern"] = 6
    return cfg


def legacy_phi3(cfg: dict) -> dict:
    """A 5.x Phi-3 config.json in the 4.x layout: rope_scaling {type, short_factor, long_factor}, rope_theta
    and partial_rotary_factor at the top level, torch_dtype."""
    cfg = dict(cfg)
    cfg["torch_dtype"] = cfg.pop("dtype")
    rp = dict(cfg.pop("rope_parameters"))
    cfg["rope_theta"] = rp.pop("rope_theta")
    cfg["partial_rotary_factor"] = rp.pop("partial_rotary_factor", 1.0)
    rp.pop("original_max_position_embeddings", None)  # Phi-3 keeps it at the top level
    kind = rp.pop("rope_type")
    cfg["rope_scaling"] = {"type": kind, **rp} if kind != "default" else None
    return cfg


def build_issue13(name, seed, model_cls, make_config, layout):
    out_dir = MODELS_DIR / name
    if out_dir.exists():
        shutil.rmtree(out_dir)
    config = make_config()
    text = config.get_text_config()
    text._attn_implementation = "eager"
    config._attn_implementation = "eager"
    torch.manual_seed(seed)
    model = model_cls(config).float().eval()
    tied = bool(getattr(text, "tie_word_embeddings", False))
    reinit_issue13_(model, seed, tied)
    model.save_pretrained(out_dir)
    model = load_fp32(out_dir)
    arrays, info = pick_prompt(model, text.vocab_size, seed, config)
    notes = {"layer_types": getattr(text, "layer_types", None), "sliding_window": text.sliding_window}
    rope = model.model.rotary_emb if hasattr(model.model, "rotary_emb") else None
    if rope is not None and getattr(rope, "attention_scaling", 1.0) != 1.0:
        notes["longrope attention_scaling"] = rope.attention_scaling
    cfg_path = out_dir / "config.json"
    new_cfg = json.loads(cfg_path.read_text())
    if layout == "4.x":
        legacy = legacy_gemma3(new_cfg) if "gemma3" in name else legacy_phi3(new_cfg)
        write_json(cfg_path, legacy)
        m2 = load_fp32(out_dir)
        drop_type = lambda rp: {k: v for k, v in rp.items() if k != "type"}  # noqa: E731 (the 4.x alias)
        assert drop_type(m2.config.rope_parameters) == drop_type(model.config.rope_parameters), (
            m2.config.rope_parameters, model.config.rope_parameters)
        assert list(getattr(m2.config, "layer_types", [])) == list(getattr(model.config, "layer_types", []))
        with torch.no_grad():
            l2 = m2(torch.from_numpy(arrays["prompt"])[None]).logits[0].float().numpy()
        assert np.array_equal(l2, arrays["prefill_logits"]), "the 4.x layout changed the logits"
        notes["4.x layout reload"] = "identical logits"
    else:
        write_json(cfg_path, new_cfg)
    from safetensors import safe_open
    with safe_open(out_dir / "model.safetensors", "pt") as sf:
        keys = list(sf.keys())
    notes["n_tensors"] = len(keys)
    notes["has lm_head"] = any("lm_head" in k for k in keys)
    GOLDEN_DIR.mkdir(parents=True, exist_ok=True)
    write_npz(GOLDEN_DIR / f"{name}.npz", arrays)
    return info, notes


# --------------------------------------------------------------------------- main


def build(name, seed, model_cls, cfg_cls, extra, opts):
    out_dir = MODELS_DIR / name
    if out_dir.exists():
        shutil.rmtree(out_dir)
    kwargs = dict(BASE)
    kwargs.update(extra)
    attn = kwargs.pop("attn_implementation")
    config = cfg_cls(**kwargs)
    config._attn_implementation = attn
    torch.manual_seed(seed)
    model = model_cls(config).float().eval()
    reinit_(model, seed, bool(getattr(config, "tie_word_embeddings", False)))
    mla_specs.draw_buffers_(model, seed)  # DeepSeek / GLM routers' correction bias (none elsewhere)
    if getattr(config, "tie_word_embeddings", False):
        assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()

    notes = {}
    if opts.get("bf16"):
        model.to(torch.bfloat16).save_pretrained(out_dir)
        model = load_fp32(out_dir)  # golden = fp32 compute on the bf16-rounded weights
        notes["loaded dtype"] = str(next(AutoModelForCausalLM.from_pretrained(out_dir).parameters()).dtype)
    else:
        model.save_pretrained(out_dir, max_shard_size=opts.get("max_shard_size", "50GB"))

    if config.rope_parameters.get("rope_type") == "llama3":
        inv = model.model.rotary_emb.inv_freq
        hd = config.head_dim
        base = 1.0 / (10000.0 ** (torch.arange(0, hd, 2, dtype=torch.int64).float() / hd))
        changed = int((~torch.isclose(inv, base)).sum())
        assert changed > 0, "llama3 rope scaling changed nothing"
        notes["llama3 inv_freq changed"] = f"{changed}/{inv.numel()}"

    # reload from disk so the golden data is exactly what the saved checkpoint gives
    model = load_fp32(out_dir)
    arrays, info = pick_prompt(model, config.vocab_size, seed, config)

    if opts.get("legacy_config"):
        cfg_path = out_dir / "config.json"
        new_cfg = json.loads(cfg_path.read_text())
        legacy = to_legacy_config(new_cfg)
        write_json(cfg_path, legacy)
        m2 = load_fp32(out_dir)
        assert m2.config.rope_parameters == model.config.rope_parameters, (
            m2.config.rope_parameters, model.config.rope_parameters)
        with torch.no_grad():
            l2 = m2(torch.from_numpy(arrays["prompt"])[None]).logits[0].float().numpy()
        notes["legacy config reload max|dlogits|"] = float(np.abs(l2 - arrays["prefill_logits"]).max())
        assert np.array_equal(l2, arrays["prefill_logits"]), "legacy config changed the logits"
    else:
        # normalise formatting (sorted keys) so re-runs are byte-identical
        cfg_path = out_dir / "config.json"
        write_json(cfg_path, json.loads(cfg_path.read_text()))

    files = sorted(p.name for p in out_dir.iterdir())
    notes["files"] = files
    from safetensors import safe_open
    keys = []
    for f in files:
        if f.endswith(".safetensors"):
            with safe_open(out_dir / f, "pt") as sf:
                keys += list(sf.keys())
    notes["n_tensors"] = len(keys)
    notes["has lm_head"] = any(k.startswith("lm_head") for k in keys)
    notes["norm-ish keys"] = sorted({k.split("layers.0.")[-1] for k in keys if "layers.0." in k and "norm" in k})
    notes["bias keys"] = sorted({k.split("layers.0.")[-1] for k in keys if "layers.0." in k and k.endswith("bias")})

    GOLDEN_DIR.mkdir(parents=True, exist_ok=True)
    write_npz(GOLDEN_DIR / f"{name}.npz", arrays)
    return info, notes


def main(argv):
    torch.set_num_threads(1)
    torch.use_deterministic_algorithms(True)
    transformers.logging.set_verbosity_error()
    transformers.logging.disable_progress_bar()
    only = set(argv[1:])
    MODELS_DIR.mkdir(parents=True, exist_ok=True)
    builds = [(spec[0], build, spec) for spec in model_specs() + moe_model_specs()]
    builds += [(spec[0], build_issue13, spec) for spec in issue13_specs()]
    builds += [(name, build, (name, seed, getattr(transformers, m), getattr(transformers, c), extra, opts))
               for name, seed, m, c, extra, opts in mla_specs.mla_model_specs()]
    for name, builder, spec in builds:
        if only and name not in only:
            continue
        info, notes = builder(*spec)
        print(f"== {name}: spread(max-min)={info['spread']:.3f} mean-row-spread={info['row_spread']:.3f} "
              f"min-greedy-margin={info['margin']:.4f} distinct-greedy={info['distinct']} prompt-attempt={info['attempt']}")
        for k, v in {**info["checks"], **notes}.items():
            print(f"   {k}: {v}")
        if "route_gap" in info:
            print(f"   min top-k routing gap (prompt + greedy tokens): {info['route_gap']:.2e}")


if __name__ == "__main__":
    main(sys.argv)
