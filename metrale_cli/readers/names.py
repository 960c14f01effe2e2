"""Engine tensor names -> metrale's tap names, and tensor-parallel shards -> whole tensors.

An engine reader gives `Raw`: per forward step, each tensor as one array per TP rank. A module whose output
is a tuple gives `NAME#0`, `NAME#1`, ... (vLLM's `outputs_0`, SGLang's list values). `resolve` turns one
step's Raw into metrale's taps, [rows, width] each:

Built-in map (vLLM and SGLang name modules by the Hugging Face paths, so one map serves both):

    engine module (output)                    metrale tap                          across TP ranks
    model.embed_tokens                        model.embed_tokens                   replicated
    model.layers.{i}.input_layernorm#0        model.layers.{i}.input_layernorm    replicated
    model.layers.{i}.self_attn.qkv_proj       .self_attn.q_proj, k_proj, v_proj   column, fused: split per rank
    model.layers.{i}.self_attn.q_norm, k_norm .self_attn.q_norm, k_norm (Qwen3)  column
    model.layers.{i}.self_attn.rotary_emb#0/1 .self_attn.q_rope, k_rope           column
    model.layers.{i}.self_attn.attn           .self_attn.o_proj.input             column
    model.layers.{i}.self_attn (or o_proj)    .self_attn                           replicated (row-parallel, summed)
    model.layers.{i}.post_attention_layernorm#0  .post_attention_layernorm        replicated
    model.layers.{i}.mlp.gate_up_proj         .mlp.gate_proj, up_proj              column, fused: split per rank
    model.layers.{i}.mlp.act_fn               .mlp.down_proj.input                 column
    model.layers.{i}.mlp (or down_proj)       .mlp                                 replicated
    model.layers.{i}.mlp.gate#0 (MoE router)  .mlp.gate (the router logits)       replicated
      (vLLM's Mixtral names its MoE block block_sparse_moe: read as mlp)
    model.layers.{i}#0 + #1                   model.layers.{i}  (output + residual; else the residual
                                              the next layer's input_layernorm#1 or model.norm#1 carries)
    model.norm#0                              model.norm                           replicated
    logits_processor / lm_head                logits (kept aside for a logits comparison)  gathered

A fused qkv_proj is split with the widths the rope outputs show, else from the model's config.json
(num_attention_heads, num_key_value_heads, head_dim); gate_up_proj in two equal halves. Column-parallel
shards are concatenated along the last axis (a fused one split on each rank first); replicated tensors are
rank 0's, checked equal on every rank. A name no rule knows is kept as it is when all ranks agree.

`--map FILE` (TOML or JSON) adds rules, tried before the built-in ones:

    [[map]]
    pattern = 'blk\\.(\\d+)\\.attn_out'     # a regular expression matching the whole engine name
    name = "model.layers.{1}.self_attn"     # {1}: the pattern's first group
    # optional: split = [2048, 512, 512] with names = [...] (widths of the whole tensor, along the last
    # axis); slice = [0, 2048] (columns kept); tp = "column" | "replicated" (default)

JSON: {"map": [{"pattern": ..., "name": ...}, ...]}, or {"PATTERN": "NAME", ...}.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from ..errors import InputError, UsageError

LOGITS = "logits"


@dataclass
class Raw:
    """One forward step of an engine dump: name -> one array per TP rank (rank order)."""

    tensors: dict[str, list[np.ndarray]]
    positions: list[int] | None = None
    tokens: list[int] | None = None


@dataclass
class Rule:
    pattern: re.Pattern
    names: list[str]
    split: list[int] | None = None  # widths of the whole tensor
    slice: tuple[int, int] | None = None
    tp: str = "replicated"  # or "column"
    fallback: bool = False  # only when no other rule produced the name


@dataclass
class Config:
    """What splitting fused outputs needs from config.json (None: not given)."""

    heads: int | None = None
    kv_heads: int | None = None
    head_dim: int | None = None
    layers: int | None = None

    @classmethod
    def read(cls, path: str | Path | None) -> "Config":
        if path is None:
            return cls()
        p = Path(path)
        p = p / "config.json" if p.is_dir() else p
        try:
            doc = json.loads(p.read_text("utf-8"))
        except (OSError, ValueError) as e:
            raise InputError(f"{p}: not a readable config.json ({' '.join(str(e).split())})") from None
        doc = doc.get("text_config", doc) if isinstance(doc, dict) else {}
        heads, hidden = doc.get("num_attention_heads"), doc.get("hidden_size")
        head_dim = doc.get("head_dim") or (hidden // heads if heads and hidden else None)
        return cls(heads, doc.get("num_key_value_heads", heads), head_dim, doc.get("num_hidden_layers"))


_L = r"model\.layers\.(\d+)"
BUILTIN: list[Rule] = [
    Rule(re.compile(r"model\.embed_tokens(?:#0)?"), ["model.embed_tokens"]),
    Rule(re.compile(_L + r"\.input_layernorm(?:#0)?"), ["model.layers.{1}.input_layernorm"]),
    Rule(re.compile(_L + r"\.self_attn\.qkv_proj(?:#0)?"),
         ["model.layers.{1}.self_attn.q_proj", "model.layers.{1}.self_attn.k_proj",
          "model.layers.{1}.self_attn.v_proj"], split=[], tp="column"),
    Rule(re.compile(_L + r"\.self_attn\.(q|k|v)_proj(?:#0)?"), ["model.layers.{1}.self_attn.{2}_proj"], tp="column"),
    Rule(re.compile(_L + r"\.self_attn\.(q|k)_norm(?:#0)?"), ["model.layers.{1}.self_attn.{2}_norm"], tp="column"),
    Rule(re.compile(_L + r"\.self_attn\.rotary_emb#0"), ["model.layers.{1}.self_attn.q_rope"], tp="column"),
    Rule(re.compile(_L + r"\.self_attn\.rotary_emb#1"), ["model.layers.{1}.self_attn.k_rope"], tp="column"),
    Rule(re.compile(_L + r"\.self_attn\.attn(?:#0)?"), ["model.layers.{1}.self_attn.o_proj.input"], tp="column"),
    Rule(re.compile(_L + r"\.self_attn(?:#0)?"), ["model.layers.{1}.self_attn"]),
    Rule(re.compile(_L + r"\.self_attn\.o_proj(?:#0)?"), ["model.layers.{1}.self_attn"], fallback=True),
    Rule(re.compile(_L + r"\.post_attention_layernorm(?:#0)?"), ["model.layers.{1}.post_attention_layernorm"]),
    Rule(re.compile(_L + r"\.mlp\.gate_up_proj(?:#0)?"),
         ["model.layers.{1}.mlp.gate_proj", "model.layers.{1}.mlp.up_proj"], split=[], tp="column"),
    Rule(re.compile(_L + r"\.mlp\.(gate|up)_proj(?:#0)?"), ["model.layers.{1}.mlp.{2}_proj"], tp="column"),
    Rule(re.compile(_L + r"\.mlp\.act_fn(?:#0)?"), ["model.layers.{1}.mlp.down_proj.input"], tp="column"),
    Rule(re.compile(_L + r"\.(?:mlp|block_sparse_moe)\.gate(?:#0)?"), ["model.layers.{1}.mlp.gate"]),
    Rule(re.compile(_L + r"\.(?:mlp|block_sparse_moe)(?:#0)?"), ["model.layers.{1}.mlp"]),
    Rule(re.compile(_L + r"\.mlp\.down_proj(?:#0)?"), ["model.layers.{1}.mlp"], fallback=True),
    Rule(re.compile(r"model\.norm(?:#0)?"), ["model.norm"]),
    Rule(re.compile(r"model(?:#0)?"), ["model.norm"], fallback=True),  # SGLang: the model's output, normed
    Rule(re.compile(r"(?:logits_processor|lm_head)(?:#0)?"), [LOGITS]),  # gathered: whole on each rank holding it
]
# parts of a tuple output consumed by the residual-stream derivation (not taps themselves)
_RESIDUAL = re.compile(_L + r"#[01]|" + _L + r"\.(?:input|post_attention)_layernorm#1|model\.norm#1")


def load_map(path: str | Path) -> list[Rule]:
    """--map FILE: TOML or JSON rules (see the module docstring)."""
    p = Path(path)
    try:
        text = p.read_text("utf-8")
    except OSError as e:
        raise UsageError(f"--map {p}: cannot be read ({e.strerror or e})") from None
    if p.suffix.lower() == ".toml":
        try:
            import tomllib  # Python 3.11+
        except ImportError:  # pragma: no cover - Python 3.10
            try:
                import tomli as tomllib  # type: ignore[no-redef]
            except ImportError:
                raise UsageError(f"--map {p}: TOML needs Python 3.11 or the tomli package; "
                                 "or write the map as JSON") from None
        try:
            doc: Any = tomllib.loads(text)
        except ValueError as e:
            raise UsageError(f"--map {p}: not valid TOML ({e})") from None
    else:
        try:
            doc = json.loads(text)
        except ValueError as e:
            raise UsageError(f"--map {p}: not valid JSON ({e})") from None
    if isinstance(doc, dict) and "map" not in doc and all(isinstance(v, str) for v in doc.values()):
        doc = {"map": [{"pattern": k, "name": v} for k, v in doc.items()]}
    entries = doc.get("map") if isinstance(doc, dict) else None
    if not isinstance(entries, list) or not entries:
        raise UsageError(f"--map {p}: expected a list of rules under 'map' (pattern, name)")
    return [_rule(p, i, e) for i, e in enumerate(entries)]


def _rule(p: Path, i: int, e: Any) -> Rule:
    where = f"--map {p}: rule {i + 1}"
    if not isinstance(e, dict) or not isinstance(e.get("pattern"), str):
        raise UsageError(f"{where}: needs a 'pattern' (a regular expression)")
    unknown = sorted(set(e) - {"pattern", "name", "names", "split", "slice", "tp"})
    if unknown:
        raise UsageError(f"{where}: unknown key {unknown[0]!r} (keys: pattern, name, names, split, slice, tp)")
    try:
        pattern = re.compile(e["pattern"])
    except re.error as err:
        raise UsageError(f"{where}: pattern {e['pattern']!r} is not a regular expression ({err})") from None
    names = e.get("names") or ([e["name"]] if isinstance(e.get("name"), str) else None)
    if not names or not all(isinstance(n, str) for n in names):
        raise UsageError(f"{where}: needs 'name' (or 'names' with 'split')")
    split = e.get("split")
    if split is not None and not (isinstance(split, list) and len(split) == len(names)
                                  and all(isinstance(w, int) and w > 0 for w in split)):
        raise UsageError(f"{where}: 'split' is a list of positive widths, one per name in 'names'")
    if split is None and len(names) > 1:
        raise UsageError(f"{where}: several 'names' need a 'split' giving each one's width")
    sl = e.get("slice")
    if sl is not None and not (isinstance(sl, list) and len(sl) == 2 and all(isinstance(v, int) for v in sl)
                               and 0 <= sl[0] < sl[1]):
        raise UsageError(f"{where}: 'slice' is [start, stop] columns, 0 <= start < stop")
    tp = e.get("tp", "replicated")
    if tp not in ("replicated", "column"):
        raise UsageError(f"{where}: 'tp' is 'replicated' or 'column', got {tp!r}")
    return Rule(pattern, list(names), split, tuple(sl) if sl else None, tp)


@dataclass
class Resolved:
    taps: dict[str, np.ndarray]
    logits: np.ndarray | None
    notes: list[str] = field(default_factory=list)


def resolve(raw: Raw, rules: list[Rule], builtin: bool, config: Config, where: str) -> Resolved:
    """One step's taps (see the module docstring)."""
    all_rules = rules + (BUILTIN if builtin else [])
    out: dict[str, np.ndarray] = {}
    fallbacks: dict[str, np.ndarray] = {}
    notes: list[str] = []
    logits = None
    for name, shards in raw.tensors.items():
        rule, m = next(((r, r.pattern.fullmatch(name)) for r in all_rules if r.pattern.fullmatch(name)), (None, None))
        if rule is None:
            if builtin and _RESIDUAL.fullmatch(name):
                continue
            out.setdefault(name, _replicated(name, shards, where))
            continue
        names = [_fill(t, m) for t in rule.names]
        parts = _apply(rule, name, shards, names, raw, config, where, notes)
        for target, value in zip(names, parts):
            if target == LOGITS:
                logits = value
            elif rule.fallback:
                fallbacks.setdefault(target, value)
            else:
                out[target] = value
    for target, value in fallbacks.items():
        out.setdefault(target, value)
    if builtin:
        _residual_stream(raw, out, config, where)
        _shared_rope(out, notes)
    return Resolved({n: _rows(v) for n, v in out.items()}, logits, notes)


def _shared_rope(out: dict[str, np.ndarray], notes: list[str]) -> None:
    """The rotary embedding is one module shared by every layer; a dump that hooks it under each layer's
    name (SGLang's) records one call's output under all of them. Identical rope outputs in two layers mean
    that: they are left out, with a note."""
    ropes = [n for n in out if n.endswith(".self_attn.q_rope")]
    if len(ropes) > 1 and any(out[a].shape == out[b].shape and np.array_equal(out[a], out[b])
                              for a, b in zip(ropes, ropes[1:])):
        for n in [n for n in out if n.endswith((".self_attn.q_rope", ".self_attn.k_rope"))]:
            del out[n]
        notes.append("q_rope/k_rope left out: every layer's name holds the same output (the rotary embedding "
                     "is one module shared by the layers, hooked once per name)")


def _fill(template: str, m: re.Match) -> str:
    return re.sub(r"\{(\d+)\}", lambda g: m.group(int(g.group(1))) or "", template)


def _apply(rule: Rule, name: str, shards: list[np.ndarray], names: list[str], raw: Raw, config: Config,
           where: str, notes: list[str]) -> list[np.ndarray]:
    if rule.tp == "replicated":
        whole = [_replicated(name, shards, where)]
        if rule.split:
            whole = _split(whole[0], rule.split, name, where)
    else:
        shards = [s.reshape(s.shape[0], -1) for s in shards]  # [tokens, heads, head_dim] shards join by heads
        widths = _widths(rule, name, shards, names, raw, config, where, notes)
        if widths is None:
            return [np.concatenate(shards, axis=-1)]
        per_rank = [_split(s, widths, name, where) for s in shards]
        whole = [np.concatenate([parts[k] for parts in per_rank], axis=-1) for k in range(len(widths))]
    if rule.slice is not None:
        whole = [w[..., rule.slice[0]:rule.slice[1]] for w in whole]
    return whole


def _widths(rule: Rule, name: str, shards: list[np.ndarray], names: list[str], raw: Raw, config: Config,
            where: str, notes: list[str]) -> list[int] | None:
    """Per-rank widths of a fused column-parallel output (None: not fused)."""
    if rule.split is None:
        return None
    tp, width = len(shards), shards[0].shape[-1]
    if rule.split:  # a --map rule: widths of the whole tensor
        if any(w % tp for w in rule.split):
            raise InputError(f"{where}: {name}: split {rule.split} does not divide over {tp} TP ranks")
        return [w // tp for w in rule.split]
    if len(names) == 2:  # gate_up_proj: two equal halves
        if width % 2:
            raise InputError(f"{where}: {name} has odd width {width}: it cannot hold gate and up halves")
        return [width // 2, width // 2]
    prefix = name.split(".self_attn.")[0]
    q_rope, k_rope = (raw.tensors.get(f"{prefix}.self_attn.rotary_emb#{i}") for i in (0, 1))
    if q_rope is not None and k_rope is not None:
        q, k = q_rope[0].shape[-1], k_rope[0].shape[-1]
    elif config.heads and config.kv_heads and config.head_dim:
        if config.heads % tp or config.kv_heads % tp:
            raise InputError(f"{where}: {name}: {config.heads} heads and {config.kv_heads} kv heads do not "
                             f"divide over {tp} TP ranks (replicated kv heads are not read)")
        q, k = config.heads // tp * config.head_dim, config.kv_heads // tp * config.head_dim
    else:
        raise InputError(f"{where}: {name} is q, k and v fused: give --model DIR (its config.json says the "
                         "head counts) to split it, or dump the rotary embedding's outputs")
    if q + 2 * k != width:
        raise InputError(f"{where}: {name} is {width} wide per rank, not q {q} + k {k} + v {k}")
    return [q, k, k]


def _split(a: np.ndarray, widths: list[int], name: str, where: str) -> list[np.ndarray]:
    if sum(widths) != a.shape[-1]:
        raise InputError(f"{where}: {name} is {a.shape[-1]} wide, not {' + '.join(map(str, widths))}")
    edges = np.cumsum([0, *widths])
    return [a[..., edges[k]:edges[k + 1]] for k in range(len(widths))]


def _replicated(name: str, shards: list[np.ndarray], where: str) -> np.ndarray:
    first = shards[0]
    for r, s in enumerate(shards[1:], 1):
        if s.shape != first.shape or not np.array_equal(s, first, equal_nan=True):
            raise InputError(f"{where}: {name} differs between TP ranks 0 and {r} and no rule says how its "
                             "shards join: add a --map rule with tp = \"column\"")
    return first


def _residual_stream(raw: Raw, out: dict[str, np.ndarray], config: Config, where: str) -> None:
    """model.layers.{i}: the decoder layer's (output, residual) pair summed, else the residual the next
    norm received (the fused add-and-norm returns it as its second output)."""
    layers = {int(m.group(1)) for n in raw.tensors if (m := re.match(_L, n))}
    last = max(layers, default=-1)
    for i in sorted(layers):
        name = f"model.layers.{i}"
        if name in out:
            continue
        pair = [raw.tensors.get(f"{name}#{k}") for k in (0, 1)]
        if pair[0] is not None and pair[1] is not None:
            out[name] = _replicated(name + "#0", pair[0], where) + _replicated(name + "#1", pair[1], where)
            continue
        nxt = raw.tensors.get(f"model.layers.{i + 1}.input_layernorm#1")
        if nxt is None and i == last and (config.layers is None or i == config.layers - 1):
            nxt = raw.tensors.get("model.norm#1")
        if nxt is not None:
            out[name] = _replicated(name, nxt, where)


def _rows(a: np.ndarray) -> np.ndarray:
    """[tokens, ...] -> [tokens, width] float32."""
    a = np.asarray(a, dtype=np.float32)
    if a.ndim == 1:
        return a[:, None] if a.size else a.reshape(0, 1)
    return a.reshape(a.shape[0], -1)
