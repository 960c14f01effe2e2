"""Gemma 3 text models: `Gemma3ForCausalLM` (model_type gemma3_text) and the language model of a
`Gemma3ForConditionalGeneration` checkpoint (model_type gemma3), run on text alone.

The block is Gemma 2's (gemma2.py: sandwich norms, (1 + w) RMSNorm, gelu_tanh, sqrt(hidden) embedding
scale, query_pre_attn_scalar) plus a per-head (1 + w) RMSNorm on q and k before RoPE, and no attention
softcapping. `layer_types` (default: 5 sliding : 1 full, `sliding_window_pattern`) picks the window and
the rope: sliding layers use the local base (4.x `rope_local_base_freq`, default 10000) unscaled, full
layers the global one (`rope_theta`, default 1e6) with its scaling (`linear` factor 8 on the 4b-27b
models); 5.x configs give both in `rope_parameters` keyed by layer type.

The multimodal checkpoint keeps its text weights under `language_model.model.` (and an untied head under
`language_model.lm_head`), which is how transformers 4.5x and 5 both save it: they are read by name, the
vision tower and projector are never read. Its `text_config` is the model's config; a prompt is text
only (no image tokens), as `Gemma3ForConditionalGeneration` runs it without pixel values.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from . import gemma2, windows
from .model_config import Family
from .rope_params import read_rope
from .spec import Rope

if TYPE_CHECKING:
    from .model_config import ConfigReader

# transformers' Gemma3TextConfig defaults (hub configs of the multimodal models omit most of these).
DEFAULTS: dict[str, Any] = {
    "vocab_size": 262208, "hidden_size": 2304, "intermediate_size": 9216, "num_hidden_layers": 26,
    "num_attention_heads": 8, "num_key_value_heads": 4, "head_dim": 256, "hidden_activation": "gelu_pytorch_tanh",
    "max_position_embeddings": 131072, "rms_norm_eps": 1e-6, "tie_word_embeddings": True,
    "attention_bias": False, "query_pre_attn_scalar": 256, "sliding_window": 4096,
    "final_logit_softcapping": None, "attn_logit_softcapping": None,
}
GLOBAL_THETA, LOCAL_THETA = 1_000_000.0, 10_000.0
ROPE_TYPES = ("default", "linear", "llama3")
# Top-level fields of a multimodal config.json that apply to its language model.
OUTER_FIELDS = ("dtype", "torch_dtype", "tie_word_embeddings", "eos_token_id", "bos_token_id")


def prepare_text(r: ConfigReader) -> dict[str, Any]:
    return {**DEFAULTS, **r.raw}


def prepare_multimodal(r: ConfigReader) -> dict[str, Any]:
    text = r.required("text_config", dict)
    outer = {k: r.raw[k] for k in OUTER_FIELDS if k in r.raw}
    return {**DEFAULTS, **text, **outer, "model_type": r.raw["model_type"]}


def parse_text(r: ConfigReader) -> dict[str, Any]:
    return _parse(r, multimodal=False)


def parse_multimodal(r: ConfigReader) -> dict[str, Any]:
    # Gemma3ForConditionalGeneration applies no final softcap (Gemma3ForCausalLM does): refuse rather
    # than pick one of the two.
    if r.optional("final_logit_softcapping", (int, float), None) is not None:
        r.refuse("text_config.final_logit_softcapping", r.raw["final_logit_softcapping"],
                 "Gemma3ForConditionalGeneration does not apply it")
    return _parse(r, multimodal=True)


def _parse(r: ConfigReader, multimodal: bool) -> dict[str, Any]:
    gemma2.refuse_common(r)
    # transformers' Gemma 3 attention never applies attn_logit_softcapping: a config that sets it asks
    # for something the reference does not do.
    if r.optional("attn_logit_softcapping", (int, float), None) is not None:
        r.refuse("attn_logit_softcapping", r.raw["attn_logit_softcapping"], "Gemma 3 attention has no softcapping")
    pattern = r.optional("sliding_window_pattern", int, 6)
    if pattern <= 0:
        r.refuse("sliding_window_pattern", pattern, "must be positive")
    layer_types = windows.read_layer_types(
        r, lambda i: windows.SLIDING if (i + 1) % pattern else windows.FULL)
    full, sliding = _ropes(r)
    bias = r.optional("attention_bias", bool, False)
    prefix = "language_model.model." if multimodal else "model."
    options = gemma2.GemmaOptions(
        query_pre_attn_scalar=gemma2.positive_number(r, "query_pre_attn_scalar"),
        attn_logit_softcapping=None,
        final_logit_softcapping=None if multimodal else gemma2.optional_positive(r, "final_logit_softcapping"),
        qk_norm=True, prefix=prefix,
        lm_head_name="language_model.lm_head.weight" if multimodal else "lm_head.weight",
        ignored_prefixes=("vision_tower.", "multi_modal_projector.") if multimodal else (),
        full_rope=full, sliding_rope=sliding,
    )
    return dict(attention_bias=bias, o_proj_bias=bias, qk_norm=True, sliding_window=windows.read_window(r),
                layer_types=layer_types, options=options, rope_theta=full.theta, rope_scaling=full.scaling)


def _ropes(r: ConfigReader) -> tuple[Rope, Rope]:
    """(full-attention rope, sliding-attention rope) from either config layout."""
    head_dim = r.positive_int("head_dim")
    nested = r.optional("rope_parameters", dict, None)
    scaling = r.optional("rope_scaling", dict, None)
    if nested is not None and not set(nested) <= {windows.FULL, windows.SLIDING}:
        r.refuse("rope_parameters", sorted(nested), f"expected one dict per layer type ({windows.FULL}, "
                 f"{windows.SLIDING})")
    params = {t: dict((nested or {}).get(t) or {"rope_type": "default"}) for t in (windows.FULL, windows.SLIDING)}
    if scaling is not None:  # 4.x: rope_scaling is the global (full-attention) rope's scaling
        params[windows.FULL].update(scaling)
    params[windows.FULL].setdefault("rope_theta", r.optional("rope_theta", (int, float), GLOBAL_THETA))
    params[windows.SLIDING].setdefault("rope_theta", r.optional("rope_local_base_freq", (int, float), LOCAL_THETA))
    key = "rope_parameters" if nested is not None else "rope_scaling"
    return tuple(read_rope(r, f"{key}.{t}", params[t], params[t]["rope_theta"], head_dim, ROPE_TYPES)
                 for t in (windows.FULL, windows.SLIDING))


TEXT_FAMILY = Family("gemma3_text", "Gemma3ForCausalLM", parse_text, gemma2.define,
                     "Gemma 3 text (q/k norms, 5:1 sliding layers, local and global rope)", prepare=prepare_text)
MULTIMODAL_FAMILY = Family("gemma3", "Gemma3ForConditionalGeneration", parse_multimodal, gemma2.define,
                           "Gemma 3 multimodal checkpoints: the language model on text (vision tower not read)",
                           prepare=prepare_multimodal)
