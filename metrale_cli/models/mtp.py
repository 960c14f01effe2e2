"""A checkpoint's multi-token-prediction (MTP) layer as a model of its own: the draft `decode --draft mtp` runs.

DeepSeek-V3 (and Kimi-K2) and GLM-4.5 checkpoints carry `num_nextn_predict_layers` MTP layers after the decoder,
stored as model.layers.{num_hidden_layers + j}.*. As transformers 5 runs them (modeling_layers.MtpModel,
`generate(use_mtp=True)`), the layer predicts the token after next: for the token x_p at position p,

    x = eh_proj([enorm(embed(x_p)), hnorm(h_{p-1})])     h_{p-1}: the main model's hidden state at p - 1,
    x = block(x)                                          after its final norm; the block is a decoder layer
    logits = lm_head(shared_head.norm(x))                 of the family's, always sparse

with the main model's embedding and lm_head (the checkpoint's copies, embed_tokens and shared_head.head, are
not read). `mtp_config` describes that as a one-layer ModelConfig, so an engine runs it as it runs a model: the
block's weights and cache, its final norm shared_head.norm; the eh_proj step before it is engine/mtp.py's.
"""

from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING

from ..errors import CheckpointError, ConfigError
from .spec import ModelDefinition, Param

if TYPE_CHECKING:
    from .model_config import ModelConfig

# The families whose MTP layer is checked against transformers' MtpModel (tests/test_mtp.py; kimi_k2 is DeepSeek-V3's
# architecture under another name, read by the same code).
FAMILIES = ("deepseek_v3", "kimi_k2", "glm4_moe")


def layer_count(cfg: ModelConfig) -> int:
    """num_nextn_predict_layers as the family parsed it (0 for a family without MTP layers)."""
    return int(getattr(cfg.options, "nextn", 0) or 0)


def prefix(cfg: ModelConfig, depth: int = 0) -> str:
    return f"model.layers.{cfg.num_hidden_layers + depth}."


def mtp_config(cfg: ModelConfig, depth: int = 0) -> ModelConfig:
    """MTP layer `depth` as a one-layer model: its block (sparse, with the family's mixer), the MTP weights
    (mtp_enorm, mtp_hnorm, mtp_eh_proj) among the block's, shared_head.norm as the final norm, the main model's
    embedding and lm_head."""
    if cfg.model_type not in FAMILIES:
        raise ConfigError(f"--draft mtp: {cfg.model_type} has no multi-token-prediction layer metrale runs "
                          f"(it runs those of {', '.join(FAMILIES)})")
    n = layer_count(cfg)
    if depth >= n:
        raise ConfigError(f"--draft mtp: num_nextn_predict_layers is {n}: the config declares no "
                          "multi-token-prediction layer")
    if cfg.moe is None:  # every decoder layer dense (first_k_dense_replace >= num_hidden_layers): no sparse spec
        raise ConfigError("--draft mtp: the multi-token-prediction layer is a sparse block, and this config has no "
                          "sparse layer to take its experts' sizes from")
    last = cfg.num_hidden_layers + depth
    # The family's own definition, one layer deeper and every layer sparse: its last layer is the MTP block
    # with the checkpoint's names (model.layers.{last}.*), whatever the family's mixer.
    deeper = replace(cfg, num_hidden_layers=last + 1, options=replace(cfg.options, nextn=0),
                     moe=replace(cfg.moe, sparse_layers=tuple(range(last + 1))))
    block = cfg.family.define(deeper).layers[last]
    main = cfg.family.define(cfg)
    p, h = prefix(cfg, depth), cfg.hidden_size
    extra = (Param.of("mtp_enorm", (p + "enorm.weight", (h,))), Param.of("mtp_hnorm", (p + "hnorm.weight", (h,))),
             Param.of("mtp_eh_proj", (p + "eh_proj.weight", (h, 2 * h))))
    others = tuple(f"model.layers.{i}." for i in range(cfg.num_hidden_layers + n) if i != last)
    definition = ModelDefinition(
        family=cfg.model_type, layers=(replace(block, params=block.params + extra),),
        embed=main.embed, final_norm=Param.of("final_norm", (p + "shared_head.norm.weight", (h,))),
        lm_head=main.lm_head, norm=main.norm, embed_scale=main.embed_scale,
        # the main model's tensors and the copies of the embedding and head the MTP layer carries
        ignored=main.ignored + (main.final_norm.parts[0].name, p + "embed_tokens.weight",
                                p + "shared_head.head.weight"),
        ignored_prefixes=others + tuple(q for q in main.ignored_prefixes if q != p))
    family = replace(cfg.family, define=lambda _cfg: definition)
    return replace(cfg, num_hidden_layers=1, moe=replace(cfg.moe, sparse_layers=(0,)), family=family,
                   options=replace(cfg.options, nextn=0))


def holds(cfg: ModelConfig, names, depth: int = 0) -> bool:
    """Whether a checkpoint's tensor `names` hold MTP layer `depth` (its eh_proj: conversions often drop the layer)."""
    return prefix(cfg, depth) + "eh_proj.weight" in set(names)


def check_present(cfg: ModelConfig, names, depth: int = 0) -> None:
    """Refuse a checkpoint without the MTP layer's tensors (many conversions drop them) before anything loads."""
    if not holds(cfg, names, depth):
        raise CheckpointError(f"--draft mtp: the checkpoint has no multi-token-prediction layer "
                              f"({prefix(cfg, depth)}eh_proj.weight is missing; conversions often drop it)")
