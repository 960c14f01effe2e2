"""inspect's report: a checkpoint's description, one key a line."""

from __future__ import annotations

from typing import Any

from rich.console import Console
from rich.table import Table
from rich.text import Text

from .common import dump_json, write


def render_inspect(console: Console, fmt: str, info: dict[str, Any]) -> None:
    if fmt == "json":
        dump_json(console, info)
        return
    rows = _inspect_rows(info)
    if fmt == "plain":
        write(console, "metrale inspect")
        for key, value in rows:
            write(console, f"{key}: {value}")
        return
    t = Table(title=f"inspect: {info['model']}", title_justify="left", show_header=False)
    t.add_column(style="bold")
    t.add_column()
    for key, value in rows:
        bad = key == "problems" or key.startswith("  ")  # the problems and each tensor with NaN/Inf
        style = "red" if bad else ("green" if key == "valid" and value == "yes" else None)
        t.add_row(key, Text(str(value), style=style or ""))
    console.print(t)


def _layer_pattern(sliding: list[int] | None, n: int | None) -> str | None:
    """"none", "all", or how many slide and the shortest repeating pattern ("4 of 6: S S F repeated");
    None when unknown (a config.json metrale cannot run)."""
    if sliding is None or n is None:
        return None
    if not sliding:
        return "none"
    if len(sliding) == n:
        return "all"
    kinds = ["S" if i in set(sliding) else "F" for i in range(n)]
    period = next(p for p in range(1, n + 1) if all(kinds[i] == kinds[i % p] for i in range(n)))
    if period <= n // 2:
        return f"{len(sliding)} of {n}: {' '.join(kinds[:period])} repeated"
    return f"{len(sliding)} of {n}: " + ", ".join(map(str, sliding))


def _inspect_rows(info: dict[str, Any]) -> list[tuple[str, str]]:
    """Every key of the JSON but "command", as text; "n/a" where a value is unknown (a config.json
    metrale cannot run is described from its raw fields)."""
    def shown(v: Any) -> str:
        if v is None:
            return "n/a"
        if isinstance(v, bool):
            return "yes" if v else "no"
        return f"{v:g}" if isinstance(v, float) else str(v)

    def rope_text(rope: dict[str, Any]) -> str:
        text = f"theta {shown(rope['theta'])}, {shown(rope['type'])}"
        if rope["scaling"]:
            text += " (" + ", ".join(f"{k} {shown(v)}" for k, v in rope["scaling"].items()) + ")"
        fraction = rope.get("rotary_fraction")
        return text + (f", rotary fraction {shown(fraction)}" if fraction not in (None, 1) else "")

    rope_s = rope_text(info["rope"])
    rows = [
        ("model", info["model"]), ("architecture", info["architecture"]), ("model_type", info["model_type"]),
        ("layers", info["layers"]), ("heads", info["heads"]), ("kv_heads", info["kv_heads"]),
        ("head_dim", info["head_dim"]), ("hidden", info["hidden"]), ("intermediate", info["intermediate"]),
        ("vocab", info["vocab"]), ("max_position_embeddings", info["max_position_embeddings"]),
        ("sliding_window", info["sliding_window"] if info["sliding_window"] is not None else "none"),
        ("parameters", f"{info['parameters']:,}" if info["parameters"] is not None else None),
        ("dtype", info["dtype"]),
        ("dtypes", ", ".join(f"{k} x{v}" for k, v in info["dtypes"].items()) or None),
        ("tensors", info["tensors"]),
        ("shards", info["shards"]), ("files", " ".join(info["files"]) or None),
        ("bytes", f"{info['bytes']:,}" if info["bytes"] is not None else None),
        ("tied_embeddings", info["tied_embeddings"]), ("rope", rope_s),
        ("sliding_layers", _layer_pattern(info["sliding_layers"], info["layers"])),
        ("sliding_rope", rope_text(info["sliding_rope"]) if info["sliding_rope"] else
         "as rope" if info["sliding_layers"] else "none" if info["sliding_layers"] is not None else None),
        ("attn_logit_softcapping", info["attn_logit_softcapping"] or "none"),
        ("attention_sinks", {True: "yes (a learned logit per head in every softmax)", False: "none"}.get(
            info.get("attention_sinks"))),
        ("final_logit_softcapping", info["final_logit_softcapping"] or "none"),
        ("attention_scale", f"{info['attention_scale']:.6g}" if info["attention_scale"] is not None else None),
        ("norm", info["norm"]), ("post_norms", info["post_norms"]), ("activation", info["activation"]),
        ("embed_scale", info["embed_scale"] or ("none" if info["norm"] is not None else None)),
        ("tokenizer", info["tokenizer"]), ("bos_token_id", info["bos_token_id"]),
        ("eos_token_ids", " ".join(map(str, info["eos_token_ids"])) or "none"),
        ("experts", _experts_text(info["experts"], info["layers"]) if info.get("experts") else "none"),
        ("weight_formats", _formats_text(info.get("weight_formats"))),
    ]
    if info.get("latent_attention"):
        rows.append(("latent_attention", _latent_text(info["latent_attention"])))
    if info.get("mtp"):
        rows.append(("mtp", _mtp_text(info["mtp"])))
    rows += [("notes", note) for note in info.get("notes", [])]
    if info.get("linear_attention"):
        rows.append(("linear_attention", _linear_text(info["linear_attention"], info["layers"])))
    rows.append(("valid", info["valid"]))
    if info["problems"]:
        rows.append(("problems", info["problems"]))
    rows.extend(_nonfinite_rows(info))
    return [(k, shown(v)) for k, v in rows]


def _formats_text(x: dict[str, Any] | None) -> str | None:
    """The stored weight formats in one line: "dense", or the quant_method and how many params each format holds."""
    if x is None:
        return None
    if x["quant_method"] is None:
        return "dense"
    text = f"{x['quant_method']}: " + ", ".join(f"{name} x{n}" for name, n in x["params"].items())
    emulated = "; ".join(f"{name}: {doc}" for name, doc in x.get("activation_quant", {}).items())
    return text + (f" (--activation-quant emulate: {emulated})" if emulated else "")


def _nonfinite_rows(info: dict[str, Any]) -> list[tuple[str, str]]:
    """inspect's NaN/Inf lines: what --scan found, or that nothing was looked at without it."""
    if not info.get("scanned"):
        return [("nonfinite", "not scanned (--scan reads every tensor)")]
    found = info["nonfinite"] or []
    if not found:
        return [("nonfinite", "none")]
    rows = [("nonfinite", "1 tensor holds NaN or Inf" if len(found) == 1 else f"{len(found)} tensors hold NaN or Inf")]
    return rows + [(f"  {t['name']}", f"{t['dtype']}: {t['nan']:,} NaN, {t['inf']:,} Inf") for t in found]


def _experts_text(x: dict[str, Any], layers: int) -> str:
    """A mixture of experts in one line: the experts, the routing rule, the sparse layers, the active size."""
    kind = x.get("router", "softmax_topk")
    rule = {"softmax_topk": "softmax in fp32", "topk_softmax": "softmax of the top-k logits",
            "softmax_group_limited": f"softmax in fp32, within the best {x.get('topk_group')} of "
                                     f"{x.get('n_group')} groups",
            "sigmoid_biased_grouped": f"sigmoid with correction bias, within the best {x.get('topk_group')} of "
                                      f"{x.get('n_group')} groups"}.get(kind, kind)
    routing = f"top-{x['top_k']} ({rule}, " + ("renormalised" if x["norm_topk_prob"] else "not renormalised")
    scaling = x.get("routed_scaling_factor", 1.0)
    routing += (f", times {scaling:g})" if scaling != 1.0 else ")")
    if x["shared_expert_intermediate"]:
        gate = "sigmoid gate" if x.get("shared_expert_gated", True) else "ungated"
        routing += f" + a shared expert of intermediate {x['shared_expert_intermediate']} ({gate})"
    sparse = x["sparse_layers"]
    dense = [i for i in range(layers) if i not in set(sparse)]
    where = f"all {layers}" if not dense else ", ".join(map(str, sparse)) + " (dense: " + ", ".join(map(str, dense)) + ")"
    return (f"{x['count']} of intermediate {x['intermediate']}, {routing}; sparse layers {where}; "
            f"{x['active_parameters']:,} active parameters per token")


def _mtp_text(m: dict) -> str:
    held = "in the checkpoint" if m["present"] else "not in the checkpoint"
    runs = "; runs as a draft (--draft mtp, forward --mtp)" if m["draft"] else ""
    return f"{m['layers']} multi-token-prediction layer{'s' if m['layers'] > 1 else ''}, {held}{runs}"


def _latent_text(m: dict[str, Any]) -> str:
    """An MLA model's latent attention in one line, with its cache per token."""
    q = f"q_lora_rank {m['q_lora_rank']}" if m["q_lora_rank"] is not None else "q_proj"
    ix = m.get("indexer")
    shared = ""
    if ix and ix["shared_layers"]:
        shared = f"; layers {', '.join(map(str, ix['shared_layers']))} share the last one's"
    sparse = (f", sparse attention indexer ({ix['heads']} heads of {ix['head_dim']}, the top {ix['index_topk']:,} "
              f"positions{shared})" if ix else "")
    return (f"{m['layers']} layers{sparse}, kv_lora_rank {m['kv_lora_rank']}, {q}, qk nope/rope "
            f"{m['qk_nope_head_dim']}/{m['qk_rope_head_dim']}, v {m['v_head_dim']}, "
            f"rope {'interleaved' if m['rope_interleave'] else 'rotate_half'}, softmax scale {m['softmax_scale']:.6g}; "
            f"cache {m['cache_floats_per_token']:,} values per token ({4 * m['cache_floats_per_token']:,} bytes in fp32, "
            f"{2 * m['cache_floats_per_token']:,} in bf16)")


def _linear_text(x: dict[str, Any], layers: int) -> str:
    """The Gated DeltaNet layers in one line: where, their heads, and the state a sequence keeps for them."""
    return (f"layers {', '.join(map(str, x['layers']))} of {layers}; key heads {x['key_heads']} x {x['key_head_dim']}, "
            f"value heads {x['value_heads']} x {x['value_head_dim']}, conv kernel {x['conv_kernel']}; state "
            f"{x['state_bytes_per_sequence']:,} bytes per sequence (fp32: conv {x['conv_state_bytes']:,} + "
            f"recurrent {x['recurrent_state_bytes']:,})")
