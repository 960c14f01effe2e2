"""What a model definition says, as plain data: the tensors a decoder reads and the structure of its blocks.

A family module (llama.py, qwen2.py, ...) turns a parsed `ModelConfig` into a `ModelDefinition`: per layer
a `LayerSpec` (norm kind and placement, attention options, MLP kind) and the `Param`s it reads, each
named after the Hugging Face checkpoint tensors it comes from. The engines know no family: they run
`engine/loop.py`'s block order over these specs, and load weights through `models/weights.py`.

Engine weight keys (`Param.key`), one vocabulary for every family:

    input_norm      the norm before attention                   (HF input_layernorm)
    qkv, qkv_bias   q, k, v projections fused along the output axis (q_proj/k_proj/v_proj, or qkv_proj)
    q_norm, k_norm  per-head RMSNorm on q and k before RoPE     (qwen3)
    o, o_bias       the attention output projection             (o_proj)
    attn_out_norm   norm of the attention output before the residual add (sandwich blocks: Gemma's
                    post_attention_layernorm)
    mlp_norm        the norm before the MLP (Llama's post_attention_layernorm, Gemma's pre_feedforward_layernorm)
    gate_up         gate and up projections fused (gate_proj/up_proj, or gate_up_proj)
    down            the MLP output projection                   (down_proj)
    mlp_out_norm    norm of the MLP output before the residual add (Gemma's post_feedforward_layernorm)

Latent attention layers (LayerSpec.mixer a MlaSpec) read instead of qkv/qkv_bias/q_norm/k_norm:
    q               q_proj [heads * (nope + rope), H], or without it (q_lora_rank) the three below
    q_a, q_a_norm, q_b   q_a_proj [q_lora, H], q_a_layernorm [q_lora], q_b_proj [heads * (nope + rope), q_lora]
    kv_a            kv_a_proj_with_mqa [kv_lora + rope, H]
    kv_a_norm       kv_a_layernorm [kv_lora]
    kv_b            kv_b_proj [heads * (nope + v), kv_lora]
    idx_q, idx_k, idx_k_norm, idx_k_norm_bias, idx_w   DeepSeek sparse attention's indexer (self_attn.indexer.wq_b,
                    wk, k_norm weight and bias, weights_proj; MlaIndexer)

Sparse (mixture-of-experts) layers, whose LayerSpec.mlp is a MoeSpec, read instead of gate_up/down:
    router          the router [E, H] (HF mlp.gate / block_sparse_moe.gate), with the shared expert's gate
                    row appended [E + 1, H] when there is one (qwen2_moe shared_expert_gate)
    experts_gate_up every expert's gate and up projections, stacked [E, 2I, H] (`Param.experts`)
    experts_down    every expert's down projection, stacked [E, H, I]
    shared_gate_up  the shared expert's gate/up [2S, H] and down [H, S] (qwen2_moe shared_expert)
    shared_down
    router_correction  the choice correction of sigmoid_biased_grouped routing [E] (e_score_correction_bias)

Linear-attention layers (LayerSpec.mixer a LinearAttentionSpec, Gated DeltaNet) read instead of qkv/o:
    lin_in          in_proj_qkvz + in_proj_ba (qwen3_next), or in_proj_qkv + z + b + a (qwen3_5), fused
    conv            the depthwise causal conv1d over q | k | v   [conv_dim, 1, kernel]
    dt_bias, A_log  the decay's bias and log rate per value head
    lin_norm        RMSNormGated's weight [v_head_dim]           lin_out   out_proj [H, v_dim]

Per-layer attention options live in `AttentionSpec` (window, score softcap, rope with its partial
rotary / per-layer base / scaling), model-wide ones in `ModelDefinition` (embedding scale, final logit
softcap). Every default is the Llama behaviour.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from math import prod
from typing import TYPE_CHECKING, ClassVar

if TYPE_CHECKING:
    import numpy as np


@dataclass(frozen=True)
class Tensor:
    """One checkpoint tensor: its Hugging Face name and shape (Linear weights are [out, in])."""

    name: str
    shape: tuple[int, ...]


@dataclass(frozen=True)
class Param:
    """One engine weight, read from `parts` concatenated along axis 0 at load (q, k, v -> qkv).

    With `experts` = E > 0 the parts are E equal groups, one per expert in order (expert 0's gate and up,
    expert 1's, ...): their concatenation is reshaped to [E, rows of one group, ...], so one tensor per
    expert in the checkpoint becomes one stacked engine weight."""

    key: str
    parts: tuple[Tensor, ...]
    experts: int = 0
    # How the checkpoint stores each part (formats.py): None = dense (BF16/F16/F32 as they are), else a
    # registered weight format's name; set from the checkpoint's quantization_config (formats.apply).
    format: str | None = None
    # Layouts the loader undoes (gpt-oss's fused experts): `interleaved` - the output axis (the second to last
    # of a weight, the last of a bias) alternates the two halves (gate 0, up 0, gate 1, ...) and is reordered
    # to [all gate; all up]; `transposed` - stored dense as [..., in, out] (the parts' shapes say [..., out,
    # in]: the engine's layout); a weight format's stored tensors say their own layout.
    interleaved: bool = False
    transposed: bool = False

    @property
    def shape(self) -> tuple[int, ...]:
        first = self.parts[0].shape
        rows = sum(p.shape[0] for p in self.parts)
        if self.experts:
            return (self.experts, rows // self.experts) + tuple(first[1:])
        return (rows,) + tuple(first[1:])

    @staticmethod
    def of(key: str, *parts: tuple[str, tuple[int, ...]]) -> Param:
        return Param(key, tuple(Tensor(name, tuple(shape)) for name, shape in parts))

    @staticmethod
    def stacked(key: str, per_expert: list[list[tuple[str, tuple[int, ...]]]]) -> Param:
        """One stacked weight from the parts of each expert (every expert's parts alike in shape)."""
        parts = tuple(Tensor(name, tuple(shape)) for group in per_expert for name, shape in group)
        return Param(key, parts, experts=len(per_expert))


@dataclass(frozen=True)
class RopeScaling:
    """The `llama3` frequency scaling of Llama 3.1/3.2 (None in Rope means plain RoPE)."""

    factor: float
    low_freq_factor: float
    high_freq_factor: float
    original_max_position_embeddings: int


@dataclass(frozen=True)
class LongRope:
    """Phi-3's `longrope`: per-frequency divisors, `short_factor` while a forward's sequence fits
    `original_max_position_embeddings`, `long_factor` beyond it, and cos/sin scaled by
    `attention_factor`. Like transformers, the choice is made once per forward call (prefill, decode
    step, verify pass) from the highest position it runs: keys cached by earlier calls keep their rotation.
    """

    short_factor: tuple[float, ...]
    long_factor: tuple[float, ...]
    original_max_position_embeddings: int
    attention_factor: float


@dataclass(frozen=True)
class Yarn:
    """YaRN (`rope_type` "yarn"), as transformers' _compute_yarn_parameters: each frequency blends its
    interpolated value (divided by `factor`) and its original one by a linear ramp over the dims between the
    correction range of `beta_fast` and `beta_slow` rotations in `original_max_position_embeddings`
    positions (bounds floored / ceiled when `truncate`); cos and sin are multiplied by `attention_factor`.
    `mscale_all_dim` (DeepSeek) also scales an MLA layer's softmax (softmax_mscale)."""

    factor: float
    original_max_position_embeddings: int
    attention_factor: float
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    truncate: bool = True
    mscale_all_dim: float | None = None

    def ramp_bounds(self, dims: int, theta: float) -> tuple[float, float]:
        """The dims (of the dims/2 frequencies) where the ramp starts and ends."""
        def dim_of(rotations: float) -> float:
            return dims * math.log(self.original_max_position_embeddings / (rotations * 2 * math.pi)) / (2 * math.log(theta))

        low, high = dim_of(self.beta_fast), dim_of(self.beta_slow)
        if self.truncate:
            low, high = math.floor(low), math.ceil(high)
        return max(low, 0), min(high, dims - 1)

    def softmax_mscale(self) -> float:
        """The factor on an MLA layer's softmax scale: mscale(factor, mscale_all_dim) ** 2 (1 without it)."""
        if not self.mscale_all_dim:
            return 1.0
        return yarn_mscale(self.factor, self.mscale_all_dim) ** 2


def yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    """YaRN's attention scaling 0.1 * mscale * ln(factor) + 1 (1 for factor <= 1)."""
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


@dataclass(frozen=True)
class Rope:
    theta: float
    head_dim: int
    scaling: RopeScaling | None = None  # llama3 frequency scaling
    rotary_dim: int | None = None  # partial rotary (Phi-4-mini): only the first rotary_dim dims rotate
    linear_factor: float = 1.0  # `linear` scaling (Gemma 3 global layers): positions / factor
    longrope: LongRope | None = None
    yarn: Yarn | None = None

    @property
    def dims(self) -> int:
        """How many leading dims of each head rotate (rotate_half pairs i with i + dims/2)."""
        return self.head_dim if self.rotary_dim is None else self.rotary_dim

    @property
    def attention_scaling(self) -> float:
        """The factor on cos and sin (longrope's or YaRN's attention_factor; 1 otherwise)."""
        if self.yarn is not None:
            return self.yarn.attention_factor
        return self.longrope.attention_factor if self.longrope is not None else 1.0

    def uses_long(self, seq_len: int) -> bool:
        """longrope: whether a forward call whose highest position is seq_len - 1 takes the long factors."""
        return self.longrope is not None and seq_len > self.longrope.original_max_position_embeddings

    def inv_freq(self, long: bool = False) -> np.ndarray:
        """Inverse frequencies [dims/2] as fp32, computed in float64 and rounded once (matches
        transformers' fp32 values to the last ulp or so). `long` picks longrope's long factors."""
        import numpy as np

        d = self.dims
        inv = 1.0 / (self.theta ** (np.arange(0, d, 2, dtype=np.float64) / d))
        if self.scaling is not None:
            inv = _llama3_scale(inv, self.scaling)
        if self.longrope is not None:
            lr = self.longrope
            inv = inv / np.asarray(lr.long_factor if long else lr.short_factor, dtype=np.float64)
        if self.yarn is not None:
            inv = _yarn_blend(inv, self.yarn, d, self.theta)
        return (inv / self.linear_factor).astype(np.float32)


def _llama3_scale(inv_freq: np.ndarray, s: RopeScaling) -> np.ndarray:
    """Llama 3.1 scaling: long wavelengths divided by `factor`, short ones kept, a smooth blend between."""
    import numpy as np

    low_freq_wavelen = s.original_max_position_embeddings / s.low_freq_factor
    high_freq_wavelen = s.original_max_position_embeddings / s.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = np.where(wavelen > low_freq_wavelen, inv_freq / s.factor, inv_freq)
    smooth = (s.original_max_position_embeddings / wavelen - s.low_freq_factor) / (
        s.high_freq_factor - s.low_freq_factor
    )
    smoothed = (1 - smooth) * scaled / s.factor + smooth * scaled
    is_medium = ~(wavelen < high_freq_wavelen) & ~(wavelen > low_freq_wavelen)
    return np.where(is_medium, smoothed, scaled)


def _yarn_blend(inv_freq: np.ndarray, y: Yarn, dims: int, theta: float) -> np.ndarray:
    """YaRN: inv_freq / factor below the ramp's start, inv_freq past its end, linearly blended between."""
    import numpy as np

    low, high = y.ramp_bounds(dims, theta)
    if low == high:
        high += 0.001  # as transformers: no zero-width ramp
    ramp = np.clip((np.arange(dims // 2, dtype=np.float64) - low) / (high - low), 0, 1)
    keep = 1 - ramp  # the share of the original (extrapolated) frequency
    return inv_freq / y.factor * (1 - keep) + inv_freq * keep


@dataclass(frozen=True)
class Norm:
    """RMSNorm: x / sqrt(mean(x^2) + eps) * (offset + weight), in fp32. Gemma stores w with offset 1
    (the scale is 1 + w, added in fp32: in bf16 the sum would lose w's low bits)."""

    eps: float
    offset: float = 0.0


@dataclass(frozen=True)
class AttentionSpec:
    """The "attention" mixer kind (engine/attention.py): softmax attention over a KV cache."""

    kind: ClassVar[str] = "attention"  # engine/mixers.py: the mixer kind this spec is
    num_heads: int  # query heads
    num_kv_heads: int  # KV heads (grouped-query attention when fewer than query heads)
    head_dim: int
    rope: Rope
    scale: float  # on the scores q.k: head_dim ** -0.5 unless the family says otherwise
    qk_norm: bool = False  # per-head RMSNorm on q and k before RoPE (qwen3, gemma3)
    # Sliding window: the query at position p attends to keys in (p - window, p]; None = all of [0, p].
    window: int | None = None
    softcap: float | None = None  # scores -> tanh(scores / softcap) * softcap before the mask (gemma2)
    # Attention sinks (gpt-oss): a learned logit per query head (weight key `sinks` [num_heads]) that joins
    # every row's softmax as one more column and is dropped after it, so the probabilities sum below 1.
    sinks: bool = False
    # Output gate (qwen3_next, qwen3_5): q_proj is doubled, each head's rows [q_h; gate_h], and the attention
    # output of head h is multiplied by sigmoid(gate_h) before o_proj. The fused `qkv` is then [2q + 2kv, H].
    output_gate: bool = False

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def q_proj_size(self) -> int:
        """Rows of the q projection in the fused qkv: q, or q and its output gate interleaved per head."""
        return self.q_size * (2 if self.output_gate else 1)

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    @property
    def n_rep(self) -> int:
        """Query heads per KV head."""
        return self.num_heads // self.num_kv_heads


@dataclass(frozen=True)
class MlaIndexer:
    """DeepSeek Sparse Attention's lightning indexer (deepseek_v32, glm_moe_dsa): each query of a latent-attention
    layer attends only to the `topk` positions, of those it may see, that the indexer scores highest. Per token,
    with h the layer's normed input and q_a the normed query latent (q_a_norm(q_a(h))):
        q_i = idx_q(q_a)                [heads, head_dim]   k_i = LayerNorm(idx_k(h))   [head_dim], cached
        (the first qk_rope_head_dim dims of both rotated with the layer's rope: rotate_half pairs, or adjacent
        pairs when `interleave`, written as the attention's own interleaved rope writes them)
        score(s, t) = sum_h idx_w(h)[h] / sqrt(heads) * relu(q_i(s)[h] . k_i(t) / sqrt(head_dim))
    Weight keys: idx_q [heads * head_dim, q_lora_rank], idx_k [head_dim, H], idx_k_norm and idx_k_norm_bias
    [head_dim] (a LayerNorm with eps 1e-6), idx_w [heads, H]. A `shared` layer (GLM-5's "shared" indexer type) has
    none of them: it attends to the positions the nearest earlier layer with its own indexer chose."""

    num_heads: int
    head_dim: int
    topk: int
    interleave: bool = False
    shared: bool = False
    eps: float = 1e-6


@dataclass(frozen=True)
class MlaSpec:
    """The "mla" mixer kind (engine/mla.py): DeepSeek-V2/V3's multi-head latent attention. Per token, with
    h = input_norm(x):
        q = q_b(q_a_norm(q_a(h))) (q_lora_rank) or q_proj(h)     [heads, nope + rope], the rope part rotated
        [c; k_pe] = kv_a(h); c = kv_a_norm(c)                    the latent [kv_lora_rank], k_pe [rope], rotated
        [k_nope; v] = kv_b(c) per head                           [heads, nope + v]
        y = softmax([q_nope; q_pe] . [k_nope; k_pe] * scale) v   -> o_proj
    The cache holds the latent [c; k_pe] of every position (latent_size floats). `rope_interleave`: the rope
    dims rotate in adjacent pairs (x0, x1), (x2, x3), ... (DeepSeek-V2 always, V3's default), else as
    rotate_half pairs i with i + rope/2. Weight keys: input_norm, q (or q_a, q_a_norm, q_b), kv_a, kv_a_norm,
    kv_b, o, and the indexer's (MlaIndexer) when it has one."""

    kind: ClassVar[str] = "mla"
    num_heads: int
    q_lora_rank: int | None  # None: one q_proj
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    rope: Rope  # over the qk_rope_head_dim dims
    scale: float  # qk_head_dim ** -0.5, times YaRN's softmax mscale
    rope_interleave: bool = True
    latent_norm: Norm = Norm(1e-6)  # q_a_layernorm and kv_a_layernorm (transformers builds them with eps 1e-6)
    indexer: MlaIndexer | None = None  # DeepSeek sparse attention (deepseek_v32): which positions a query sees

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def latent_size(self) -> int:
        """Floats per cached position: the normed latent and the rotated shared key."""
        return self.kv_lora_rank + self.qk_rope_head_dim


@dataclass(frozen=True)
class LinearAttentionSpec:
    """The "linear_attention" mixer kind (engine/linear_attention.py): Gated DeltaNet (qwen3_next, qwen3_5).

    Weight keys: `lin_in` the input projection [2 k_dim + 2 v_dim + 2 v_heads, H] (q, k, v, z, b, a; in
    qwen3_next's head-grouped order when `grouped`, else flat), `conv` the depthwise causal conv
    [conv_dim, 1, conv_kernel] over q|k|v (conv_dim = 2 k_dim + v_dim), `dt_bias` and `A_log` [v_heads],
    `lin_norm` the gated RMSNorm weight [v_head_dim] (plain w, no offset), `lin_out` out_proj [H, v_dim]."""

    kind: ClassVar[str] = "linear_attention"
    num_k_heads: int
    num_v_heads: int  # a multiple of num_k_heads: q/k head h // (num_v_heads // num_k_heads) serves value head h
    k_head_dim: int
    v_head_dim: int
    conv_kernel: int  # linear_conv_kernel_dim
    eps: float  # the gated norm's (rms_norm_eps)
    grouped: bool = True  # lin_in in qwen3_next's order: per key head [q_h, k_h, v_h.., z_h..], then [b_h.., a_h..]
    chunk_size: int = 64  # the chunked (prefill) rule's chunk, transformers' default

    @property
    def k_dim(self) -> int:
        return self.num_k_heads * self.k_head_dim

    @property
    def v_dim(self) -> int:
        return self.num_v_heads * self.v_head_dim

    @property
    def conv_dim(self) -> int:
        return 2 * self.k_dim + self.v_dim

    @property
    def in_size(self) -> int:
        return 2 * self.k_dim + 2 * self.v_dim + 2 * self.num_v_heads


# Gated linear units, glu(gate, up) elementwise in fp32: "silu" = silu(g) * u (SwiGLU), "gelu_tanh" =
# gelu_tanh(g) * u (GeGLU), "swiglu_oai" = gpt-oss's clamped SwiGLU: g' = min(g, L), u' = clip(u, -L, L),
# g' * sigmoid(alpha g') * (u' + 1) with L = MoeSpec.swiglu_limit, alpha = MoeSpec.swiglu_alpha.
GLU_KINDS = ("silu", "gelu_tanh", "swiglu_oai")


@dataclass(frozen=True)
class MlpSpec:
    intermediate_size: int
    activation: str = "silu"  # gate activation of the gated MLP: act(gate) * up; "silu" | "gelu_tanh"


@dataclass(frozen=True)
class RouterSpec:
    """How a sparse layer picks each token's experts and weighs them (one kind per rule; every backend has
    one function per kind, selected by `kind`). With logits = router(h) in fp32 (+ the router bias, weight
    key `router_bias` [E], when `bias`):

    softmax_topk (qwen2_moe, qwen3_moe, mixtral): p = softmax(logits); the top_k largest p; divided by
        their sum when norm_topk_prob.
    topk_softmax (gpt-oss): the top_k largest logits; their softmax.
    (norm_topk_prob is MoeSpec's: every rule may renormalise; every rule's weights are then multiplied by
    routed_scaling_factor.)
    softmax_group_limited (DeepSeek-V2 group_limited_greedy): p = softmax(logits); the top_k largest p within
        the topk_group groups (of n_group) whose largest p are highest (the other experts' p taken as 0).
    sigmoid_biased_grouped (DeepSeek-V3, GLM-4.5): s = sigmoid(logits); the choice ranks s + correction
        (weight key `router_correction` [E], e_score_correction_bias), within the topk_group groups (of
        n_group) whose two best choice scores sum highest; the weights are the chosen s, divided by their
        sum (+ 1e-20) when norm_topk_prob, times routed_scaling_factor.
    Ties go to the lowest expert index on every backend."""

    kind: str = "softmax_topk"  # ROUTER_KINDS
    bias: bool = False  # the router projection has a bias (gpt-oss)
    n_group: int = 1
    topk_group: int = 1
    routed_scaling_factor: float = 1.0


ROUTER_KINDS = ("softmax_topk", "topk_softmax", "softmax_group_limited", "sigmoid_biased_grouped")


@dataclass(frozen=True)
class MoeSpec:
    """A sparse MLP block (mixture of experts) in place of the dense MLP, per token t with h = norm(x):

        the router (RouterSpec) picks top_k experts e with weights w_e (ties: the lowest expert index first);
        y = sum over them of w_e * down_e(glu(gate_e(h), up_e(h)))
        + sigmoid(shared_gate(h)) * shared_expert(h)  when shared_expert_size (qwen2_moe)
          (+ shared_expert(h), ungated, when not shared_expert_gated: DeepSeek's shared experts)
    with glu = `activation` (models/spec.GLU_KINDS), and each expert's gate/up and down biases added when
    `expert_bias` (weight keys `experts_gate_up_bias` [E, 2I], `experts_down_bias` [E, H]; gpt-oss).
    """

    num_experts: int
    top_k: int
    intermediate_size: int  # of one expert
    norm_topk_prob: bool
    activation: str = "silu"  # a GLU_KINDS name
    shared_expert_size: int | None = None  # intermediate size of the shared expert
    router: RouterSpec = RouterSpec()
    expert_bias: bool = False
    swiglu_limit: float | None = None  # the "swiglu_oai" activation's clamp (gpt-oss swiglu_limit)
    swiglu_alpha: float = 1.702  # and its sigmoid's slope (gpt-oss swiglu_alpha)
    shared_expert_gated: bool = True  # the shared expert times sigmoid(its gate row of the router) (qwen2_moe)
    # tensor parallelism (parallel/sharding.py): a rank routes over all num_experts experts and holds
    # experts first_expert .. first_expert + held_experts - 1 (its stacked weights); None: all of them
    first_expert: int = 0
    held_experts: int | None = None

    @property
    def held(self) -> range:
        """The experts whose weights this spec's engine holds (global indices)."""
        return range(self.first_expert, self.first_expert + (self.num_experts if self.held_experts is None
                                                             else self.held_experts))


@dataclass(frozen=True)
class LayerSpec:
    """One decoder block: a token mixer (attention, or another kind: engine/mixers.py) and an MLP, each
    pre-normed and added to the residual stream."""

    mixer: AttentionSpec | MlaSpec | LinearAttentionSpec  # or another mixer kind's spec: any frozen dataclass with a `kind` (engine/mixers.py)
    mlp: MlpSpec | MoeSpec  # a MoeSpec makes the layer sparse
    norm: Norm
    params: tuple[Param, ...]

    def keys(self) -> frozenset[str]:
        return frozenset(p.key for p in self.params)


@dataclass(frozen=True)
class ModelDefinition:
    family: str
    layers: tuple[LayerSpec, ...]
    embed: Param  # [V, H]
    final_norm: Param  # [H]
    lm_head: Param | None  # [V, H]; None when tied to the embedding
    norm: Norm  # the final norm's kind
    ignored: tuple[str, ...] = field(default=())  # checkpoint tensors tolerated and never read
    ignored_prefixes: tuple[str, ...] = field(default=())  # whole subtrees never read (a vision tower)
    embed_scale: float | None = None  # embedding rows times this fp32 value (Gemma: sqrt(hidden_size))
    final_logit_softcap: float | None = None  # logits -> tanh(logits / c) * c on every lm_head row
    notes: tuple[str, ...] = field(default=())  # what the checkpoint has that is not run (inspect shows them)

    def params(self) -> list[Param]:
        """Every weight, globals first (the order loaders and checks walk them)."""
        out = [self.embed, self.final_norm] + ([self.lm_head] if self.lm_head is not None else [])
        for layer in self.layers:
            out.extend(layer.params)
        return out

    def parameter_count(self) -> int:
        """The weights' element count (logical [out, in] shapes, whatever their storage)."""
        return sum(prod(t.shape) for p in self.params() for t in p.parts)
