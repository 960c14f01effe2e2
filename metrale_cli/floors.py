"""What a step must read and compute: the bytes and FLOPs `metrale bench` divides by the measured bandwidth and
GEMM rate to get its floors (weights in the format the engine holds them, the KV cache or latent rows up to the
context, linear-attention state, the experts a router chose)."""

from __future__ import annotations

import numpy as np

from .config import ModelConfig


def kv_bytes_read(cfg: ModelConfig, context: int, elem: int) -> int:
    """K and V bytes one decode step at `context` reads: a sliding layer only its window of them; a latent
    attention layer its one latent row per position (layers of another mixer kind hold no KV cache)."""
    return sum((layer.mixer.latent_size if layer.mixer.kind == "mla" else 2 * layer.mixer.kv_size) * elem
               * min(context, getattr(layer.mixer, "window", None) or context) for layer in cfg.definition.layers
               if layer.mixer.kind in ("attention", "mla"))


def linear_state_bytes(cfg: ModelConfig, rows: int = 1) -> int:
    """Recurrent and conv state bytes (fp32) a pass of `rows` tokens moves through a linear-attention model's
    layers: each layer's state read once and written after every row (the CUDA engine keeps each row's state for
    rollback). The same at every context: the state does not grow."""
    per = sum(4 * (m.num_v_heads * m.k_head_dim * m.v_head_dim + m.conv_dim * (m.conv_kernel - 1))
              for m in (layer.mixer for layer in cfg.definition.layers) if m.kind == "linear_attention")
    return per * (1 + rows)


def weight_bytes(eng, cfg: ModelConfig, elem: int) -> tuple[int, float]:
    """(the weight bytes one decode step reads, every expert counted; the bytes of one expert parameter, on average
    over the experts). The embedding table is left out (a step reads one row of it) unless the lm_head is that table.
    On the GPU a weight takes `elem` bytes an element, one kept in its weight format the bytes the device holds it in
    (e4m3 and scales; MXFP4 experts' codes and E8M0 scales; 4-bit codes and fp32 scales: loading.stored_param_bytes).
    The CPU engine holds each weight as it keeps it (bf16 bits, a format's stored bytes, or fp32: backends/numpy/
    stored.py): its arrays' bytes are counted."""
    from math import prod

    one, total = expert_params(cfg)
    w = getattr(eng, "w", None)
    if w is not None and not hasattr(eng, "cp"):  # the NumPy engine's weights
        def held(a) -> int:
            return int(getattr(a, "nbytes", 0))

        experts = sum(held(a) for lw in w.layers for k, a in lw.items() if k.startswith("experts_"))
        streamed = sum(held(a) for lw in w.layers for a in lw.values()) + held(w.lm_head) + held(w.final_norm)
        return streamed, (experts / total if total else float(elem))
    from .backends.cuda.loading import kept_as_stored, stored_param_bytes  # the others: bf16 (dequantized at load)

    embed = 0 if cfg.tie_word_embeddings else cfg.vocab_size * cfg.hidden_size
    formatted = [p for p in cfg.definition.params() if kept_as_stored(p)]
    streamed = (cfg.parameter_count() - embed) * elem
    streamed += sum(stored_param_bytes(p) - prod(p.shape) * elem for p in formatted)
    experts = [p for p in cfg.definition.params() if p.key in ("experts_gate_up", "experts_down")]
    held = sum(stored_param_bytes(p) if kept_as_stored(p) else prod(p.shape) * elem for p in experts)
    return streamed, (held / total if total else float(elem))


def weight_formats_note(cfg: ModelConfig, device: str) -> str | None:
    """The bench's line on how the weights are stored, for a quantized model, and what the floor counts of them on
    `device`: the CUDA engine holds the params it keeps as stored in their format and the rest dequantized to bf16."""
    params = [p for p in cfg.definition.params() if p.format is not None]
    if not params:
        return None
    names = ", ".join(sorted({p.format for p in params}))
    held = "the bytes the engine holds them in (as stored: weights and scales; fp32 copies where it dequantizes at load)"
    if device == "cuda":
        from .backends.cuda.loading import kept_as_stored

        bf16 = sorted({p.key for p in params if not kept_as_stored(p)})
        stored = any(kept_as_stored(p) for p in params)
        held = ("the bytes the engine holds them in (packed weights and their scales)" if not bf16 else
                f"bf16 for {', '.join(bf16)} (dequantized at load)" + (", the packed weights and scales of the rest" if stored else ""))
    return f"weights: quant_method {cfg.quantization['quant_method']} ({names}); the floor counts {held}"


def expert_params(cfg: ModelConfig) -> tuple[int, int]:
    """(parameters of one expert, of all experts of all sparse layers); (0, 0) for a dense model."""
    if cfg.moe is None:
        return 0, 0
    s = cfg.moe.spec
    one = 3 * s.intermediate_size * cfg.hidden_size
    return one, one * s.num_experts * len(cfg.moe.sparse_layers)


def moe_step_bytes(eng, cfg: ModelConfig, tokens: list[int], context: int, xb: float, streamed: int) -> int:
    """Weight bytes a pass over `tokens` at position `context` reads: `streamed` with only the experts its
    router chose (per sparse layer the union over its rows), taken from the router's top-k taps of the
    same pass run once more with the taps on (a verify pass of `tokens`: the rows kernels), then trimmed back."""
    from .engine.observe import tapping

    chosen: dict[str, int] = {}

    def tap(name: str, x) -> None:
        if name.endswith(".mlp.gate.top_k_index"):
            chosen[name] = len(np.unique(np.asarray(x)))

    eng.trim(context)
    with tapping(eng, tap):
        eng.verify(list(tokens))
    eng.trim(context)
    one, total = expert_params(cfg)
    return int(streamed - total * xb + sum(chosen.values()) * one * xb)


def prefill_flops(cfg: ModelConfig, t: int) -> float:
    """FLOPs of a prefill of t tokens (a mixture of experts: each token through its top_k experts only)."""
    one, total = expert_params(cfg)
    active = cfg.parameter_count() - (total - one * cfg.moe.spec.top_k * len(cfg.moe.sparse_layers) if one else 0)
    matmul = 2 * t * (active - cfg.vocab_size * cfg.hidden_size * (1 if cfg.tie_word_embeddings else 2))
    softmax_layers = sum(layer.mixer.kind != "linear_attention" for layer in cfg.definition.layers)
    attn = 2 * 2 * softmax_layers * cfg.num_attention_heads * cfg.head_dim * t * t / 2  # causal QK^T and PV
    head = 2 * cfg.hidden_size * cfg.vocab_size  # the last row's logits
    return matmul + attn + head
