"""DeepSeek-V3 (`DeepseekV3ForCausalLM`; Moonlight declares it too, Kimi-K2 declares `kimi_k2` with
DeepSeek-V3's architecture and code, read alike here), DeepSeek-V3.2 (`DeepseekV32ForCausalLM`: V3 with DeepSeek
sparse attention's indexer, models/spec.MlaIndexer) and DeepSeek-V2 (`DeepseekV2ForCausalLM`, DeepSeek-V2-Lite):
latent attention (the "mla" mixer kind, models/spec.MlaSpec) and a mixture of experts with DeepSeek's routing.

Per layer: x += o_proj(mla(input_layernorm(x))); x += mlp(post_attention_layernorm(x)), the MLP dense
(intermediate_size) on the first `first_k_dense_replace` layers, sparse after: n_routed_experts SwiGLU
experts of moe_intermediate_size plus ungated shared experts (one SwiGLU of moe_intermediate_size *
n_shared_experts, `mlp.shared_experts`).
- V3 routing (sigmoid_biased_grouped): sigmoid scores, e_score_correction_bias for the choice only, the
  topk_group best of n_group groups, renormalised when norm_topk_prob, times routed_scaling_factor.
- V3.2: V3's blocks, every layer's attention restricted to the index_topk positions its indexer scores highest;
  the query always through q_lora_rank, the rope always interleaved (transformers ignores rope_interleave), the
  sparse layers from `mlp_layer_types` (default: from first_k_dense_replace, 3).
- V2 routing: softmax, `topk_method` greedy (softmax_topk) or group_limited_greedy (softmax_group_limited),
  never renormalised (transformers' V2 router ignores norm_topk_prob: a config setting it is refused),
  times routed_scaling_factor.
RoPE (default or yarn) over the qk_rope_head_dim dims; YaRN's mscale_all_dim also scales the softmax.
The multi-token-prediction layers (`num_nextn_predict_layers`, stored as model.layers.{num_hidden_layers}...)
are not part of the forward; V3's first one runs as a draft (models/mtp.py, `decode --draft mtp`).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

from . import llama, moe
from .model_config import Family, MoeConfig
from .rope_params import read_rope
from .spec import LayerSpec, MlaIndexer, MlaSpec, MlpSpec, ModelDefinition, MoeSpec, Norm, Param, RouterSpec

if TYPE_CHECKING:
    from .model_config import ConfigReader, ModelConfig

EXPERT_NAMES = ("gate_proj", "up_proj", "down_proj")
# DeepSeek-V3.2's sparse-attention indexer: a config with these is not the V3 architecture
V32_FIELDS = ("index_topk", "index_head_dim", "index_n_heads")


@dataclass(frozen=True)
class DeepseekOptions:
    mla: MlaSpec  # every layer's latent attention
    nextn: int  # num_nextn_predict_layers: the multi-token-prediction layers the checkpoint may hold (not run)
    shared_index: tuple[int, ...] = ()  # layers whose indexer reuses the last one's choice (GLM-5's "shared")


@dataclass(frozen=True)
class MoeDefaults:
    """A family's transformers defaults for the fields a config may leave out."""

    experts: int
    top_k: int | None
    size: int
    shared: int
    first_dense: int
    n_group: int
    topk_group: int
    norm_topk_prob: bool
    scaling: float


V3 = MoeDefaults(256, 8, 2048, 1, 3, 8, 4, True, 2.5)
V2 = MoeDefaults(64, None, 1407, 2, 0, 1, 1, False, 1.0)


@dataclass(frozen=True)
class MlaDefaults:
    """A family's transformers defaults for the latent-attention sizes a config may leave out."""

    q_lora: int  # q_lora_rank (an explicit null means q_proj)
    kv_lora: int
    nope: int
    rope: int
    v: int


V3_MLA = MlaDefaults(q_lora=1536, kv_lora=512, nope=128, rope=64, v=128)


def parse_v3(r: ConfigReader) -> dict[str, Any]:
    for key in V32_FIELDS:
        if key in r.raw:
            r.refuse(key, r.raw[key], "DeepSeek-V3.2's sparse attention indexer is not implemented")
    accept_sigmoid_routing(r)
    return parse_mla(r, r.optional("rope_interleave", bool, True), sigmoid_grouped_moe(r, V3))


def parse_v32(r: ConfigReader) -> dict[str, Any]:
    return parse_dsa(r, V3, V3_MLA, index_heads=64, interleave=False)


def parse_dsa(r: ConfigReader, d: MoeDefaults, m: MlaDefaults, index_heads: int, interleave: bool,
              shared: tuple[int, ...] = ()) -> dict[str, Any]:
    """DeepSeek-V3.2's blocks (also GLM-5's): V3's latent attention and routing with the sparse attention indexer
    (`index_heads` heads by default, its rope `interleave`d or not) on every layer, its own or, on the `shared`
    layers, the last one's."""
    accept_sigmoid_routing(r)
    if r.raw.get("rope_interleave") is False:
        r.refuse("rope_interleave", False, "transformers' sparse attention models always rotate interleaved pairs")
    if "q_lora_rank" in r.raw and r.raw["q_lora_rank"] is None:
        r.refuse("q_lora_rank", None, "the sparse attention indexer reads the query latent (q_lora_rank is required)")
    heads, dim = moe.positive(r, "index_n_heads", index_heads), moe.positive(r, "index_head_dim", 128)
    if dim < moe.positive(r, "qk_rope_head_dim", m.rope):
        r.refuse("index_head_dim", dim, "smaller than qk_rope_head_dim (the indexer rotates that many of its dims)")
    indexer = MlaIndexer(heads, dim, moe.positive(r, "index_topk", 2048), interleave)
    sparse = sparse_layers(r, d.first_dense, reads_first_k=True)
    fields = parse_mla(r, True, sigmoid_grouped_moe(r, d, sparse), m, indexer=indexer)
    fields["options"] = replace(fields["options"], shared_index=shared)
    return fields


def sparse_layers(r: ConfigReader, first_dense: int, reads_first_k: bool) -> tuple[int, ...]:
    """The layers `mlp_layer_types` marks sparse ("dense" / "sparse" per layer) as transformers' DeepSeek-V3.2 and
    GLM-4.7-Flash configs read them; absent, the first `first_dense` layers are dense (first_k_dense_replace's
    value when `reads_first_k`). A first_k_dense_replace that says otherwise than the layer types is refused."""
    n = r.positive_int("num_hidden_layers")
    first = r.optional("first_k_dense_replace", int, None)
    if first is not None and first < 0:
        r.refuse("first_k_dense_replace", first, "must not be negative")
    types = r.optional("mlp_layer_types", list, None)
    if types is None:
        k = min(n, first if reads_first_k and first is not None else first_dense)
        types = ["dense"] * k + ["sparse"] * (n - k)
    elif len(types) != n or any(t not in ("dense", "sparse") for t in types):
        r.refuse("mlp_layer_types", types, f"needs dense or sparse for each of the {n} layers")
    if first is not None and types != ["dense"] * min(n, first) + ["sparse"] * (n - min(n, first)):
        r.refuse("first_k_dense_replace", first, "disagrees with the layers' dense / sparse types (mlp_layer_types "
                 "or its default), which is what transformers reads for this family")
    return tuple(i for i, t in enumerate(types) if t == "sparse")


def parse_v2(r: ConfigReader) -> dict[str, Any]:
    _accept(r, "scoring_func", ("softmax",), "DeepSeek-V2 routes by softmax")
    method = r.optional("topk_method", str, "greedy")
    if method not in ("greedy", "group_limited_greedy"):
        r.refuse("topk_method", method, "supported: greedy, group_limited_greedy")
    if r.optional("norm_topk_prob", bool, False):
        r.refuse("norm_topk_prob", True, "transformers' DeepSeek-V2 router never renormalises")
    if r.raw.get("rope_interleave") is False:
        r.refuse("rope_interleave", False, "DeepSeek-V2 always rotates interleaved pairs")
    d = V2
    experts, top_k, size = _experts(r, d)
    n_group, topk_group = _groups(r, d, experts, top_k) if method == "group_limited_greedy" else (1, 1)
    kind = "softmax_group_limited" if method == "group_limited_greedy" else "softmax_topk"
    router = RouterSpec(kind, n_group=n_group, topk_group=topk_group,
                        routed_scaling_factor=float(r.optional("routed_scaling_factor", (int, float), d.scaling)))
    return parse_mla(r, True, _moe(r, d, experts, top_k, size, False, router))


def sigmoid_grouped_moe(r: ConfigReader, d: MoeDefaults,
                        sparse: tuple[int, ...] | None = None) -> MoeConfig | None:
    """DeepSeek-V3's sparse block (also GLM-4.5's and GLM-4.7-Flash's): sigmoid_biased_grouped routing, ungated
    shared experts, on the `sparse` layers (None: those from first_k_dense_replace on)."""
    experts, top_k, size = _experts(r, d)
    n_group, topk_group = _groups(r, d, experts, top_k)
    if experts // n_group < 2:
        r.refuse("n_group", n_group, f"leaves groups of fewer than 2 of the {experts} experts (a group scores its best two)")
    router = RouterSpec("sigmoid_biased_grouped", n_group=n_group, topk_group=topk_group,
                        routed_scaling_factor=float(r.optional("routed_scaling_factor", (int, float), d.scaling)))
    return _moe(r, d, experts, top_k, size, r.optional("norm_topk_prob", bool, d.norm_topk_prob), router, sparse)


def accept_sigmoid_routing(r: ConfigReader) -> None:
    """DeepSeek-V3's routing fields, when a config names them (V3.2, GLM-4.5, GLM-4.7-Flash and GLM-5 route alike)."""
    _accept(r, "scoring_func", ("sigmoid",), "this family routes as DeepSeek-V3 (sigmoid scores)")
    _accept(r, "topk_method", ("noaux_tc",), "this family routes as DeepSeek-V3 (noaux_tc: grouped sigmoid routing "
            "with correction bias)")


def _accept(r: ConfigReader, key: str, values: tuple[str, ...], why: str) -> None:
    """Refuse `key` unless it is absent, null or one of `values`."""
    value = r.raw.get(key)
    if value is not None and value not in values:
        r.refuse(key, value, why)


def _experts(r: ConfigReader, d: MoeDefaults) -> tuple[int, int, int]:
    experts = moe.positive(r, "n_routed_experts", d.experts)
    top_k = (r.positive_int("num_experts_per_tok") if d.top_k is None
             else moe.positive(r, "num_experts_per_tok", d.top_k))
    if top_k > experts:
        r.refuse("num_experts_per_tok", top_k, f"more than the {experts} experts")
    return experts, top_k, moe.positive(r, "moe_intermediate_size", d.size)


def _groups(r: ConfigReader, d: MoeDefaults, experts: int, top_k: int) -> tuple[int, int]:
    n_group = moe.positive(r, "n_group", d.n_group)
    topk_group = moe.positive(r, "topk_group", d.topk_group)
    if experts % n_group:
        r.refuse("n_group", n_group, f"does not divide the {experts} experts")
    if topk_group > n_group:
        r.refuse("topk_group", topk_group, f"more than the {n_group} groups")
    if top_k > topk_group * (experts // n_group):
        r.refuse("num_experts_per_tok", top_k, f"more than the {topk_group} chosen groups hold")
    return n_group, topk_group


def _moe(r: ConfigReader, d: MoeDefaults, experts: int, top_k: int, size: int, norm_topk_prob: bool,
         router: RouterSpec, sparse: tuple[int, ...] | None = None) -> MoeConfig | None:
    shared = r.optional("n_shared_experts", int, d.shared)
    if shared <= 0:
        r.refuse("n_shared_experts", shared, "this family always has shared experts (at least 1)")
    freq = r.raw.get("moe_layer_freq")
    if freq is not None and freq != 1:
        r.refuse("moe_layer_freq", freq, "transformers makes every layer from first_k_dense_replace on sparse")
    if sparse is None:
        first = r.optional("first_k_dense_replace", int, d.first_dense)
        if first < 0:
            r.refuse("first_k_dense_replace", first, "must not be negative")
        sparse = tuple(range(first, r.positive_int("num_hidden_layers")))
    spec = MoeSpec(experts, top_k, size, norm_topk_prob, "silu", size * shared, router=router,
                   shared_expert_gated=False)
    return MoeConfig(spec, sparse) if sparse else None


def nextn_layers(r: ConfigReader) -> int:
    """num_nextn_predict_layers (transformers 5 also writes it as num_mtp_layers)."""
    key = "num_nextn_predict_layers" if "num_nextn_predict_layers" in r.raw else "num_mtp_layers"
    n = r.optional(key, int, 0)
    if n < 0:
        r.refuse(key, n, "must not be negative")
    return n


def parse_mla(r: ConfigReader, interleave: bool, moe_cfg: MoeConfig | None, d: MlaDefaults = V3_MLA,
              indexer: MlaIndexer | None = None) -> dict[str, Any]:
    """The ModelConfig fields of a latent-attention family: every layer's MlaSpec (sizes defaulting to `d`, with
    DeepSeek sparse attention's `indexer` when given), the sparse block `moe_cfg`."""
    llama.refuse_non_swiglu(r)
    if r.optional("attention_bias", bool, False):
        r.refuse("attention_bias", True, "biases on the latent attention projections are not implemented")
    heads = r.positive_int("num_attention_heads")
    kv_heads = r.optional("num_key_value_heads", int, heads)
    if kv_heads != heads:
        r.refuse("num_key_value_heads", kv_heads, f"latent attention has one key per query head ({heads})")
    q_lora = r.raw.get("q_lora_rank", d.q_lora)  # an explicit null means q_proj (no query compression)
    if q_lora is not None:
        q_lora = moe.positive(r, "q_lora_rank", d.q_lora)
    rope_dim = moe.positive(r, "qk_rope_head_dim", d.rope)
    if rope_dim % 2:
        r.refuse("qk_rope_head_dim", rope_dim, "RoPE needs an even number of dims")
    nope, v = moe.positive(r, "qk_nope_head_dim", d.nope), moe.positive(r, "v_head_dim", d.v)
    rope = _rope(r, rope_dim)
    scale = (nope + rope_dim) ** -0.5 * (rope.yarn.softmax_mscale() if rope.yarn is not None else 1.0)
    mla = MlaSpec(heads, q_lora, moe.positive(r, "kv_lora_rank", d.kv_lora), nope, rope_dim, v, rope, scale, interleave,
                  indexer=indexer)
    return dict(head_dim=rope_dim, attention_bias=False, o_proj_bias=False, qk_norm=False, sliding_window=None,
                layer_types=(), rope_theta=rope.theta, rope_scaling=None, moe=moe_cfg,
                options=DeepseekOptions(mla, nextn_layers(r)))


def _rope(r: ConfigReader, dims: int):
    """rope_parameters (5.x) or rope_scaling + rope_theta (4.x): default or yarn over `dims` dims."""
    key = "rope_scaling" if r.optional("rope_scaling", dict, None) else "rope_parameters"
    params = dict(r.optional(key, dict, None) or {})
    theta = params.get("rope_theta", r.optional("rope_theta", (int, float), 10000.0))
    partial = params.get("partial_rotary_factor", r.raw.get("partial_rotary_factor"))
    if partial not in (None, 1, 1.0):
        r.refuse("partial_rotary_factor", partial, "latent attention rotates all qk_rope_head_dim dims")
    return read_rope(r, key, params, theta, dims, ("default", "yarn"))


def define(cfg: ModelConfig) -> ModelDefinition:
    h, v, o = cfg.hidden_size, cfg.vocab_size, cfg.options
    norm, mlp = Norm(cfg.rms_norm_eps), MlpSpec(cfg.intermediate_size, "silu")
    shared = replace(o.mla, indexer=replace(o.mla.indexer, shared=True)) if o.shared_index else o.mla
    mixers = [shared if i in o.shared_index else o.mla for i in range(cfg.num_hidden_layers)]
    layers = tuple(LayerSpec(m, mlp, norm, layer_params(cfg, i, m)) for i, m in enumerate(mixers))
    n, L = o.nextn, cfg.num_hidden_layers
    base = ModelDefinition(
        family=cfg.model_type, layers=layers,
        embed=Param.of("embed", ("model.embed_tokens.weight", (v, h))),
        final_norm=Param.of("final_norm", ("model.norm.weight", (h,))),
        lm_head=None if cfg.tie_word_embeddings else Param.of("lm_head", ("lm_head.weight", (v, h))),
        norm=norm,
        ignored=llama.IGNORED_SUFFIXES + (("lm_head.weight",) if cfg.tie_word_embeddings else ()),
        ignored_prefixes=nextn_prefixes(L, n), notes=nextn_notes(L, n))
    return moe.define_sparse(cfg, base, "mlp", EXPERT_NAMES, shared="shared_experts.")


def nextn_prefixes(layers: int, n: int) -> tuple[str, ...]:
    return tuple(f"model.layers.{layers + j}." for j in range(n))


def nextn_notes(layers: int, n: int) -> tuple[str, ...]:
    """inspect's note on the MTP layers (its "mtp" row says whether the checkpoint holds them and whether they run
    as a draft: models/mtp.py)."""
    if not n:
        return ()
    where = f"model.layers.{layers}" + (f"..{layers + n - 1}" if n > 1 else "")
    return (f"num_nextn_predict_layers {n}: the multi-token-prediction layer{'s' if n > 1 else ''} ({where}) "
            f"{'are' if n > 1 else 'is'} not part of the forward",)


def layer_params(cfg: ModelConfig, i: int, m: MlaSpec) -> tuple[Param, ...]:
    h, inter = cfg.hidden_size, cfg.intermediate_size
    p, s = f"model.layers.{i}.", f"model.layers.{i}.self_attn."
    q_out = m.num_heads * m.qk_head_dim
    if m.q_lora_rank is None:
        q = [Param.of("q", (s + "q_proj.weight", (q_out, h)))]
    else:
        q = [Param.of("q_a", (s + "q_a_proj.weight", (m.q_lora_rank, h))),
             Param.of("q_a_norm", (s + "q_a_layernorm.weight", (m.q_lora_rank,))),
             Param.of("q_b", (s + "q_b_proj.weight", (q_out, m.q_lora_rank)))]
    ix, idx = m.indexer, []
    if ix is not None and not ix.shared:  # DeepSeek sparse attention's indexer
        x = s + "indexer."
        idx = [Param.of("idx_q", (x + "wq_b.weight", (ix.num_heads * ix.head_dim, m.q_lora_rank))),
               Param.of("idx_k", (x + "wk.weight", (ix.head_dim, h))),
               Param.of("idx_k_norm", (x + "k_norm.weight", (ix.head_dim,))),
               Param.of("idx_k_norm_bias", (x + "k_norm.bias", (ix.head_dim,))),
               Param.of("idx_w", (x + "weights_proj.weight", (ix.num_heads, h)))]
    return (
        Param.of("input_norm", (p + "input_layernorm.weight", (h,))),
        *q,
        *idx,
        Param.of("kv_a", (s + "kv_a_proj_with_mqa.weight", (m.latent_size, h))),
        Param.of("kv_a_norm", (s + "kv_a_layernorm.weight", (m.kv_lora_rank,))),
        Param.of("kv_b", (s + "kv_b_proj.weight", (m.num_heads * (m.qk_nope_head_dim + m.v_head_dim), m.kv_lora_rank))),
        Param.of("o", (s + "o_proj.weight", (h, m.num_heads * m.v_head_dim))),
        Param.of("mlp_norm", (p + "post_attention_layernorm.weight", (h,))),
        Param.of("gate_up", (p + "mlp.gate_proj.weight", (inter, h)), (p + "mlp.up_proj.weight", (inter, h))),
        Param.of("down", (p + "mlp.down_proj.weight", (h, inter))),
    )


V3_FAMILY = Family("deepseek_v3", "DeepseekV3ForCausalLM", parse_v3, define,
                   "DeepSeek-V3 / Kimi-K2 / Moonlight (latent attention, grouped sigmoid routing, shared experts)")
KIMI_K2_FAMILY = Family("kimi_k2", "DeepseekV3ForCausalLM", parse_v3, define,
                        "Kimi-K2 (DeepSeek-V3's architecture under its own model_type)")
V32_FAMILY = Family("deepseek_v32", "DeepseekV32ForCausalLM", parse_v32, define,
                    "DeepSeek-V3.2 (DeepSeek-V3 with the sparse attention indexer; NumPy engine only)")
V2_FAMILY = Family("deepseek_v2", "DeepseekV2ForCausalLM", parse_v2, define,
                   "DeepSeek-V2 / V2-Lite (latent attention, softmax greedy or group-limited routing)")
