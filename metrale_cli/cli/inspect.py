"""metrale inspect: describe a checkpoint (from its config.json and tensor listing; --scan reads the values)."""


import json
import math
from typing import Annotated, Any, Optional

import typer

from ..checkpoint import Checkpoint, HeaderListing
from ..errors import CheckpointError, ConfigError, MetraleError, UsageError
from ..inputs import ModelSpec, read_model_spec
from ..model import model_dir, model_path
from ..models.weights import check_checkpoint
from ..render.common import choose_format
from ..render.inspect import render_inspect
from .entry import State, app
from .help_format import MetraleCommand
from .options import EMBEDDED_HELP, FormatOpt, ModelOpt


@app.command(cls=MetraleCommand)
def inspect(
    ctx: typer.Context,
    path: Annotated[Optional[str], typer.Argument(
        metavar="PATH", help=f"Checkpoint directory, .safetensors file or index.json, or {EMBEDDED_HELP}. "
                             "Default: default. The same as --model.", show_default=False)] = None,
    model: ModelOpt = None,
    fmt: FormatOpt = None,
    scan: Annotated[bool, typer.Option(
        "--scan", help="Also read every tensor and list those holding NaN or Inf (reads the whole checkpoint).")] = False,
) -> None:
    """Describe a checkpoint: architecture, sizes, parameter count, dtypes, shards, rope, tokenizer.

    PATH (or --model PATH, as every other command takes it) names the checkpoint.
    The tensors are checked against config.json (names, shapes, dtypes).
    An invalid checkpoint is still described, then its problem is named on stderr: a weights file that
    does not open (truncated, malformed) from config.json and the tensors its headers list (exit 3); tensors
    that do not match config.json (exit 3); a config.json metrale cannot run (another model_type,
    hidden_act...) from its raw fields and the tensors (exit 4).
    Without --scan no tensor value is read, so NaN/Inf in the weights are not looked for.

    Examples:
      metrale inspect
      metrale inspect default-draft --format json
      metrale inspect --model default --scan
    """
    state: State = ctx.obj
    fmt_ = choose_format(fmt, state.out)
    if path is not None and model is not None and path != model:
        raise UsageError(f"inspect takes one checkpoint: PATH {path!r} or --model {model!r}, not both")
    path = path if path is not None else model
    try:
        spec = read_model_spec(path)
    except ConfigError as unsupported:  # describe what config.json and the tensors say, then fail (exit 4)
        _inspect_without_config(state, fmt_, path, unsupported, scan)
        raise
    try:
        ckpt = Checkpoint.open(spec.checkpoint_path)
    except CheckpointError as broken:  # what config.json and the headers still say, then the problem (exit 3)
        listing = HeaderListing(spec.checkpoint_path)
        problem = _broken(broken, listing)
        render_inspect(state.out, fmt_, _with_scan(_inspect_info(spec, listing, problem), listing, False))
        raise problem from None
    try:
        problem: MetraleError | None = None
        try:
            check_checkpoint(spec.config, ckpt)
        except MetraleError as e:
            problem = e
        render_inspect(state.out, fmt_, _with_scan(_inspect_info(spec, ckpt, problem), ckpt, scan))
    finally:
        ckpt.close()
    if problem is not None:
        raise problem


def _broken(problem: CheckpointError, listing: HeaderListing) -> MetraleError:
    """The problem, with the tensors the headers list beyond the end of their file."""
    if not listing.truncated:
        return problem
    names = ", ".join(listing.truncated[:3]) + (", ..." if len(listing.truncated) > 3 else "")
    return CheckpointError(f"{problem}; {len(listing.truncated)} of {len(listing.tensor_names())} listed tensors "
                           f"lie beyond the end of their file ({names})")


def _with_scan(info: dict[str, Any], ckpt: Checkpoint | HeaderListing, scan: bool) -> dict[str, Any]:
    """inspect's "scanned" and "nonfinite" keys: with --scan, the tensors holding NaN or Inf."""
    info["nonfinite"] = None
    if scan:
        from ..scan import scan_nonfinite

        info["nonfinite"] = [t.to_json() for t in scan_nonfinite(ckpt)]
    info["scanned"] = scan
    return info


def _inspect_without_config(state: State, fmt: str, path: str | None, problem: ConfigError, scan: bool) -> None:
    """A config.json metrale cannot run (model_type gpt_neox, hidden_act gelu...): its raw fields and the
    tensor listing, with the problem named. Prints nothing when config.json is no JSON object or the
    weights cannot be listed (the caller's error then says why)."""
    directory = model_dir(path)
    try:
        raw = json.loads((directory / "config.json").read_text("utf-8"))
        target = model_path(path)
        ckpt = Checkpoint.open(target if target.is_file() else directory)
    except (OSError, ValueError, MetraleError):
        return
    try:
        if isinstance(raw, dict):
            info = _raw_inspect_info("default" if path is None else path, raw, ckpt, problem)
            render_inspect(state.out, fmt, _with_scan(info, ckpt, scan))
    finally:
        ckpt.close()


def _raw_inspect_info(label: str, raw: dict[str, Any], ckpt: Checkpoint, problem: ConfigError) -> dict[str, Any]:
    """inspect's keys from config.json as written (None where a field is absent or not a number) and
    the parameter count from the tensor listing."""
    def integer(key: str, fallback: Any = None) -> int | None:
        v = raw.get(key)
        return v if isinstance(v, int) and not isinstance(v, bool) else fallback

    def number(key: str) -> float | None:
        v = raw.get(key)
        return float(v) if isinstance(v, (int, float)) and not isinstance(v, bool) else None

    hidden, heads = integer("hidden_size"), integer("num_attention_heads")
    head_dim = integer("head_dim", hidden // heads if hidden and heads and hidden % heads == 0 else None)
    archs = raw.get("architectures")
    scaling = raw.get("rope_scaling") if isinstance(raw.get("rope_scaling"), dict) else None
    rope_params = raw.get("rope_parameters") if isinstance(raw.get("rope_parameters"), dict) else {}
    eos = raw.get("eos_token_id")
    params = sum(math.prod(ckpt.info(n).shape) for n in ckpt.tensor_names())
    return {
        "command": "inspect", "model": label,
        "architecture": archs[0] if isinstance(archs, list) and archs and isinstance(archs[0], str)
        else raw.get("model_type"),
        "model_type": raw.get("model_type"), "layers": integer("num_hidden_layers"), "heads": heads,
        "kv_heads": integer("num_key_value_heads", heads), "head_dim": head_dim, "hidden": hidden,
        "intermediate": integer("intermediate_size"), "vocab": integer("vocab_size"),
        "max_position_embeddings": integer("max_position_embeddings"), "sliding_window": integer("sliding_window"),
        "parameters": params, "dtype": raw.get("torch_dtype", raw.get("dtype")), **_listing_info(ckpt),
        "tied_embeddings": raw.get("tie_word_embeddings") is True,
        "rope": {"theta": raw.get("rope_theta", rope_params.get("rope_theta")),
                 "type": (scaling or rope_params).get("rope_type", (scaling or {}).get("type", "default")),
                 "scaling": scaling, "rotary_fraction": number("partial_rotary_factor")},
        # the block features of models/describe.py: unknown without a definition, but the softcaps as written
        "sliding_layers": None, "sliding_rope": None, "attn_logit_softcapping": number("attn_logit_softcapping"),
        "attention_sinks": None,
        "final_logit_softcapping": number("final_logit_softcapping"), "attention_scale": None, "norm": None,
        "post_norms": None, "activation": raw.get("hidden_activation", raw.get("hidden_act")), "embed_scale": None,
        "tokenizer": ckpt.has_tokenizer, "bos_token_id": integer("bos_token_id"),
        "eos_token_ids": eos if isinstance(eos, list) else [eos] if isinstance(eos, int) else [],
        "experts": None, "weight_formats": None,
        "valid": False, "problems": str(problem),
    }


def _inspect_info(spec: ModelSpec, ckpt: Checkpoint | HeaderListing,
                  problem: MetraleError | None) -> dict[str, Any]:
    cfg = spec.config
    try:
        raw = json.loads((spec.directory / "config.json").read_text("utf-8"))
    except (OSError, ValueError):
        raw = {}
    archs = raw.get("architectures")
    from ..models.describe import block_features, linear_attention_info

    linear = linear_attention_info(cfg)

    return {
        "command": "inspect", "model": spec.label,
        "architecture": archs[0] if isinstance(archs, list) and archs and isinstance(archs[0], str) else cfg.model_type,
        "model_type": cfg.model_type, "layers": cfg.num_hidden_layers, "heads": cfg.num_attention_heads,
        "kv_heads": cfg.num_key_value_heads, "head_dim": cfg.head_dim, "hidden": cfg.hidden_size,
        "intermediate": cfg.intermediate_size, "vocab": cfg.vocab_size,
        "max_position_embeddings": cfg.max_position_embeddings, "sliding_window": cfg.sliding_window,
        "parameters": cfg.parameter_count(), "dtype": cfg.dtype, **_listing_info(ckpt),
        "tied_embeddings": cfg.tie_word_embeddings,
        **block_features(cfg),  # rope, sliding layers, softcaps, norms, activation, embedding scale
        "tokenizer": ckpt.has_tokenizer, "bos_token_id": cfg.bos_token_id, "eos_token_ids": list(cfg.eos_token_ids),
        "experts": _experts_info(cfg), "weight_formats": _formats_info(cfg),
        **_latent_info(cfg),  # latent attention and what the checkpoint holds that is not run, when there is any
        **_mtp_info(cfg, ckpt),  # multi-token-prediction layers, when the config declares any
        **({"linear_attention": linear} if linear is not None else {}),  # Gated DeltaNet layers and their state
        "valid": problem is None, "problems": str(problem) if problem is not None else None,
        "scanned": False, "nonfinite": None,  # --scan: the tensors holding NaN/Inf (name, dtype, nan, inf)
    }


def _listing_info(ckpt: Checkpoint | HeaderListing) -> dict[str, Any]:
    """inspect's keys from the tensor listing: dtypes, how many tensors, the files and their data bytes."""
    return {"dtypes": ckpt.dtypes(), "tensors": len(ckpt.tensor_names()), "shards": len(ckpt.files),
            "files": [p.name for p in ckpt.files], "bytes": ckpt.total_bytes}


def _formats_info(cfg: Any) -> dict[str, Any]:
    """How the weights are stored: the quant_method (None: dense), and per weight format how many params use it
    (the rest stay in the checkpoint's dense dtypes)."""
    counts: dict[str, int] = {}
    for p in cfg.definition.params():
        counts[p.format or "dense"] = counts.get(p.format or "dense", 0) + 1
    qc = cfg.quantization or {}
    info: dict[str, Any] = {"quant_method": qc.get("quant_method"), "params": counts}
    if qc:  # what --activation-quant emulate does to each format's inputs
        from ..models.formats import weight_format

        info["activation_quant"] = {name: weight_format(name).input_quant_doc or "none (weight-only)"
                                    for name in counts if name != "dense"}
    return info


def _experts_info(cfg: Any) -> dict[str, Any] | None:
    """The sparse block of a mixture of experts (None for a dense model)."""
    if cfg.moe is None:
        return None
    s = cfg.moe.spec
    per_expert = 3 * s.intermediate_size * cfg.hidden_size
    r = s.router
    return {"count": s.num_experts, "top_k": s.top_k, "intermediate": s.intermediate_size,
            "norm_topk_prob": s.norm_topk_prob, "shared_expert_intermediate": s.shared_expert_size,
            "router": r.kind, "n_group": r.n_group, "topk_group": r.topk_group,
            "routed_scaling_factor": r.routed_scaling_factor, "shared_expert_gated": s.shared_expert_gated,
            "sparse_layers": list(cfg.moe.sparse_layers),
            "active_parameters": cfg.parameter_count() - len(cfg.moe.sparse_layers) * (s.num_experts - s.top_k) * per_expert}


def _mtp_info(cfg: Any, ckpt: Checkpoint | HeaderListing) -> dict[str, Any]:
    """"mtp": the multi-token-prediction layers the config declares, whether the checkpoint holds the first one's
    tensors (conversions often drop them) and whether metrale runs it as a draft (--draft mtp, forward --mtp)."""
    from ..models import mtp

    n = mtp.layer_count(cfg)
    if not n:
        return {}
    present = mtp.holds(cfg, ckpt.tensor_names())
    return {"mtp": {"layers": n, "present": present, "draft": present and cfg.model_type in mtp.FAMILIES}}


def _latent_info(cfg: Any) -> dict[str, Any]:
    """"latent_attention" (an MLA model: its sizes and its cache per token) and "notes" (what the checkpoint
    holds that is not run), each only when there is one."""
    out: dict[str, Any] = {}
    d = cfg.definition
    mla = [layer.mixer for layer in d.layers if layer.mixer.kind == "mla"]
    if mla:
        m = mla[0]
        out["latent_attention"] = {
            "layers": len(mla), "q_lora_rank": m.q_lora_rank, "kv_lora_rank": m.kv_lora_rank,
            "qk_nope_head_dim": m.qk_nope_head_dim, "qk_rope_head_dim": m.qk_rope_head_dim,
            "v_head_dim": m.v_head_dim, "rope_interleave": m.rope_interleave, "softmax_scale": m.scale,
            "cache_floats_per_token": sum(x.latent_size + (x.indexer.head_dim if x.indexer and not x.indexer.shared
                                                           else 0) for x in mla)}
        if m.indexer is not None:  # DeepSeek sparse attention: its keys are cached beside the latents
            out["latent_attention"]["indexer"] = {
                "heads": m.indexer.num_heads, "head_dim": m.indexer.head_dim, "index_topk": m.indexer.topk,
                "rope_interleave": m.indexer.interleave,
                "shared_layers": [i for i, x in enumerate(mla) if x.indexer is not None and x.indexer.shared]}
    if d.notes:
        out["notes"] = list(d.notes)
    return out
