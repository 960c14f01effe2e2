"""Which tensors an architecture needs, with their shapes, and the check of a checkpoint against them.

Tensor names are the Hugging Face names. Every engine takes its weights through `expected_tensors`, so
there is one table of names to keep right.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from .config import ModelConfig
from .errors import CheckpointError, ConfigError

if TYPE_CHECKING:
    from .checkpoint import Checkpoint

RUNNABLE_DTYPES = ("BF16", "F16", "F32")

# Buffers some exporters save that carry no weights: tolerated, never read.
IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


@dataclass(frozen=True)
class LayerNames:
    """The checkpoint names of one decoder layer's tensors (None where the architecture has none)."""

    input_norm: str
    q: str
    k: str
    v: str
    o: str
    q_bias: str | None
    k_bias: str | None
    v_bias: str | None
    o_bias: str | None
    q_norm: str | None
    k_norm: str | None
    post_norm: str
    gate: str
    up: str
    down: str


def layer_names(cfg: ModelConfig, i: int) -> LayerNames:
    p = f"model.layers.{i}."
    bias = cfg.attention_bias
    return LayerNames(
        input_norm=p + "input_layernorm.weight",
        q=p + "self_attn.q_proj.weight",
        k=p + "self_attn.k_proj.weight",
        v=p + "self_attn.v_proj.weight",
        o=p + "self_attn.o_proj.weight",
        q_bias=p + "self_attn.q_proj.bias" if bias else None,
        k_bias=p + "self_attn.k_proj.bias" if bias else None,
        v_bias=p + "self_attn.v_proj.bias" if bias else None,
        o_bias=p + "self_attn.o_proj.bias" if cfg.o_proj_bias else None,
        q_norm=p + "self_attn.q_norm.weight" if cfg.qk_norm else None,
        k_norm=p + "self_attn.k_norm.weight" if cfg.qk_norm else None,
        post_norm=p + "post_attention_layernorm.weight",
        gate=p + "mlp.gate_proj.weight",
        up=p + "mlp.up_proj.weight",
        down=p + "mlp.down_proj.weight",
    )


EMBED = "model.embed_tokens.weight"
FINAL_NORM = "model.norm.weight"
LM_HEAD = "lm_head.weight"


def expected_tensors(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor the architecture reads, name -> shape (HF layout: Linear weights are [out, in])."""
    h, i, v, d = cfg.hidden_size, cfg.intermediate_size, cfg.vocab_size, cfg.head_dim
    shapes: dict[str, tuple[int, ...]] = {EMBED: (v, h), FINAL_NORM: (h,)}
    if not cfg.tie_word_embeddings:
        shapes[LM_HEAD] = (v, h)
    for layer in range(cfg.num_hidden_layers):
        n = layer_names(cfg, layer)
        shapes.update({
            n.input_norm: (h,),
            n.q: (cfg.q_size, h),
            n.k: (cfg.kv_size, h),
            n.v: (cfg.kv_size, h),
            n.o: (h, cfg.q_size),
            n.post_norm: (h,),
            n.gate: (i, h),
            n.up: (i, h),
            n.down: (h, i),
        })
        optional = {
            n.q_bias: (cfg.q_size,),
            n.k_bias: (cfg.kv_size,),
            n.v_bias: (cfg.kv_size,),
            n.o_bias: (h,),
            n.q_norm: (d,),
            n.k_norm: (d,),
        }
        shapes.update({name: shape for name, shape in optional.items() if name is not None})
    return shapes


def check_checkpoint(cfg: ModelConfig, ckpt: Checkpoint) -> None:
    """Fail with one message listing every missing, unexpected, mis-shaped or unrunnable tensor."""
    present = set(ckpt.tensor_names())
    if EMBED in present:
        rows = ckpt.info(EMBED).shape[0] if ckpt.info(EMBED).shape else None
        if rows is not None and rows != cfg.vocab_size:
            raise ConfigError(
                f"{ckpt.directory / 'config.json'}: vocab_size {cfg.vocab_size} differs from the {rows} "
                f"rows of {EMBED}"
            )
    want = expected_tensors(cfg)
    problems: list[str] = []
    missing = sorted(set(want) - present, key=_natural)
    if missing:
        problems.append(f"missing {len(missing)}: {_listing(missing)}")
    unexpected = sorted(
        (n for n in present - set(want) if not _tolerated(cfg, n)), key=_natural
    )
    if unexpected:
        problems.append(f"unexpected {len(unexpected)}: {_listing(unexpected)}")
    misshaped = [
        f"{n} {list(ckpt.info(n).shape)} (expected {list(want[n])})"
        for n in sorted(present & set(want), key=_natural)
        if tuple(ckpt.info(n).shape) != want[n]
    ]
    if misshaped:
        problems.append(f"wrong shape {len(misshaped)}: {_listing(misshaped)}")
    bad_dtype = [
        f"{n} {ckpt.info(n).dtype}"
        for n in sorted(present & set(want), key=_natural)
        if ckpt.info(n).dtype not in RUNNABLE_DTYPES
    ]
    if bad_dtype:
        problems.append(f"dtype not BF16/F16/F32 {len(bad_dtype)}: {_listing(bad_dtype)}")
    if problems:
        raise CheckpointError(
            f"{ckpt.directory}: tensors do not match config.json ({cfg.model_type}, "
            f"{cfg.num_hidden_layers} layers): " + "; ".join(problems)
        )


def _tolerated(cfg: ModelConfig, name: str) -> bool:
    if name.endswith(IGNORED_SUFFIXES):
        return True
    # Some exporters keep the tied head; it is ignored because it must equal the embedding.
    return cfg.tie_word_embeddings and name == LM_HEAD


def _listing(names: list[str], limit: int = 12) -> str:
    shown = ", ".join(names[:limit])
    return shown + (f", ... and {len(names) - limit} more" if len(names) > limit else "")


def _natural(name: str) -> tuple:
    """Sort model.layers.10 after model.layers.9."""
    return tuple((0, int(p), "") if p.isdigit() else (1, 0, p) for p in name.split("."))
