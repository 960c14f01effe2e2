"""Model definitions: one module per architecture family, and the registry of supported families.

`FAMILIES` is the single supported list: the config parser, `inspect`, the help text, the tests' model
lists and the fixture scripts read it.
"""

from __future__ import annotations

from . import (deepseek, gemma2, gemma3, glm4_moe, glm4_moe_lite, glm_moe_dsa, gpt_oss, llama, mistral, mixtral,
               phi3, qwen2, qwen2_moe, qwen3, qwen3_5, qwen3_moe, qwen3_next)
from .model_config import Family

FAMILIES: dict[str, Family] = {f.model_type: f for f in (llama.FAMILY, mistral.FAMILY, qwen2.FAMILY, qwen3.FAMILY)}
# Gemma 2 / 3 and Phi-3 (sandwich norms, softcaps, sliding layers, partial rotary, longrope)
FAMILIES.update({f.model_type: f for f in (gemma2.FAMILY, gemma3.TEXT_FAMILY, gemma3.MULTIMODAL_FAMILY,
                                           phi3.FAMILY)})
# Mixtures of experts (models/moe.py)
FAMILIES.update({f.model_type: f for f in (qwen2_moe.FAMILY, qwen3_moe.FAMILY, mixtral.FAMILY)})
# Latent attention and DeepSeek's routing (models/deepseek.py), GLM-4.5 (that routing, GQA attention) and
# GLM-4.7-Flash (both)
FAMILIES.update({f.model_type: f for f in (deepseek.V3_FAMILY, deepseek.KIMI_K2_FAMILY, deepseek.V32_FAMILY,
                                           deepseek.V2_FAMILY, glm4_moe.FAMILY, glm4_moe_lite.FAMILY,
                                           glm_moe_dsa.FAMILY)})
# gpt-oss (attention sinks, clamped SwiGLU experts with biases, MXFP4 experts: models/quantized/mxfp4.py)
FAMILIES.update({gpt_oss.FAMILY.model_type: gpt_oss.FAMILY})
# Hybrid linear / full attention (Gated DeltaNet: the linear_attention mixer kind)
FAMILIES.update({f.model_type: f for f in (qwen3_next.FAMILY, *qwen3_5.FAMILIES)})

__all__ = ["FAMILIES", "Family"]
