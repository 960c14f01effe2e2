"""Loading a model onto the GPU: what the CUDA kernels cannot compute is refused first (unsupported_features and
the size checks, before CuPy is looked for), then the tensors are uploaded once in bf16 (upload_weights) and the
engine is built (load_cuda_engine)."""

from __future__ import annotations

import os
from typing import Callable

import numpy as np

from ...config import ModelConfig
from ...engine.mixers import kinds_of, mixer_kind
from ...engine_base import check_context
from ...errors import DeviceError, UsageError
from ...models.spec import ModelDefinition, MoeSpec
from ...models.weights import WeightSource, Weights, check_checkpoint, load_weights
from ...models.formats import dequantize, stored_tensors
from .buffers import oom_error
from .formats import EXPERT_KEYS, PROJECTION_KEYS, cuda_format
from .engine import CudaEngine
from .paths import BASE_PATH, PATH_ENV, check_path, default_path

# The MLP weights the CUDA passes compute with (engine/loop.py's keys): a dense layer's gated MLP (with a sandwich
# post-norm), a sparse layer's MoE kernels (no sandwich post-norm there).  A layer's mixer weights are its mixer
# kind's (its CUDA module's WEIGHT_KEYS).
DENSE_MLP_KEYS = frozenset({"mlp_norm", "gate_up", "down", "mlp_out_norm"})
INDEXER_KEYS = frozenset({"idx_q", "idx_k", "idx_k_norm", "idx_k_norm_bias", "idx_w"})  # MlaIndexer's (refused)
MOE_MLP_KEYS = frozenset({"mlp_norm", "router", "router_bias", "router_correction", "experts_gate_up",
                          "experts_gate_up_bias", "experts_down", "experts_down_bias", "shared_gate_up", "shared_down"})
# Weights kept in fp32 on the device: the router's choice correction (e_score_correction_bias, fp32 in the
# checkpoints; its bf16 rounding would move choices the NumPy engine makes on the fp32 values), and the attention
# sinks (one logit per head: the kernels read them as fp32, whatever the checkpoint stores).
FP32_KEYS = frozenset({"router_correction", "sinks"})


def _cupy():
    try:
        import cupy
    except Exception as e:  # ImportError, or a CUDA library that fails to load
        raise DeviceError(f"--device cuda needs CuPy ({type(e).__name__}: {e})") from None
    return cupy


def upload_weights(cfg: ModelConfig, source: WeightSource, kern, progress: Callable[[int], None] | None = None,
                   rank: tuple[int, int] | None = None, activation_quant: str = "none") -> Weights:
    """Read each tensor once from `source`, round it to bf16 and place it on the device, fusing
    multi-part params (q/k/v, gate/up) on the device. RandomTensors draw on the device directly.
    `rank` = (r, n): keep tensor-parallel rank r's shard (parallel/sharding.RankShard), each layer cut on
    the device as soon as it is uploaded. `activation_quant` "emulate": each weight kept as stored carries how its
    inputs are quantized (formats.CudaFormat.input_quant; check_activation_quant has refused what cannot)."""
    cp = kern.cp
    if rank is None:  # refuse before reading anything when the weights cannot fit (a tp rank holds a share)
        free, total = cp.cuda.runtime.memGetInfo()
        check_fits(cfg, free, total)

    fp32 = {t.name for layer in cfg.definition.layers for p in layer.params if p.key in FP32_KEYS for t in p.parts}

    def to_bf16(f32):  # a device f32 array rounded to bf16 bits on the device, bit-identical to torch's rounding
        out = cp.empty(f32.shape, cp.uint16)
        kern.f32_to_bf16(f32, out)
        return out

    def get(name: str):
        info = source.info(name)
        nbytes = int(np.prod(info.shape)) * 2
        try:
            if name in fp32:
                out = (source.device_array(name, cp) if source.draws_on_device
                       else cp.asarray(np.asarray(source.array(name), dtype=np.float32)))
                out = cp.ascontiguousarray(out, dtype=cp.float32) if out.dtype != cp.float32 else out
                if not source.draws_on_device:
                    source.release(name)
            elif source.draws_on_device:
                out = to_bf16(source.device_array(name, cp))
            else:
                host = source.array(name)
                if info.dtype == "BF16":
                    out = cp.asarray(np.ascontiguousarray(host).view(np.uint16))
                else:  # F32/F16: rounded on the device
                    out = to_bf16(cp.asarray(np.asarray(host, dtype=np.float32)))
                source.release(name)
        except cp.cuda.memory.OutOfMemoryError:
            raise oom_error(cp, f"loading {name}", nbytes) from None
        if progress is not None:
            progress(nbytes)
        return out

    def concat(parts):  # a fresh contiguous array (a shard's slice must not keep its whole tensor alive)
        if getattr(parts[0], "format", None) is not None:  # a formatted weight's parts (formats.py)
            return cuda_format(parts[0].format).concat(parts, cp)
        return parts[0].copy() if len(parts) == 1 else cp.concatenate(parts, axis=0)

    def formatted(p) -> list:  # a param stored in a weight format: that format's device weights, or bf16
        def read(name: str, bf16_bits: bool = False):
            host = source.array(name, bf16_bits=bf16_bits)
            if progress is not None:
                progress(int(host.nbytes))
            return host

        if kept_as_stored(p) and p.experts:  # per-expert tensors: each expert's parts fused, then stacked [E, N, K]
            entry = cuda_format(p.format)
            parts = entry.upload(p, read, kern)
            n = len(parts) // p.experts
            fused = []
            for i in range(p.experts):  # each expert's parts dropped once fused (the peak: one layer's experts twice)
                fused.append(entry.concat(parts[i * n:(i + 1) * n], cp))
                parts[i * n:(i + 1) * n] = [None] * n
            parts = [entry.stack(fused, cp)]
        elif kept_as_stored(p):  # a projection, or experts stored stacked (gpt-oss's MXFP4: one part [E, N, K])
            entry = cuda_format(p.format)
            parts = entry.upload(p, read, kern)
            if activation_quant == "emulate" and entry.input_quant is not None:
                how = entry.input_quant(p, read, kern)
                for part in parts:
                    part.input_quant = how
        else:  # kernels that read bf16 (experts, latent attention's own weights): the exact values rounded once
            parts = [to_bf16(cp.asarray(np.asarray(value, dtype=np.float32)))  # formats.py reads BF16 as bits
                     for value in dequantize(p, lambda name: read(name, bf16_bits=True))]
        for t in stored_tensors(p):
            source.release(t.name)
        return parts

    shard = None
    if rank is not None:
        from ...parallel.sharding import RankShard

        shard = RankShard(cfg.definition, rank[0], rank[1], concat)
    try:
        return load_weights(cfg.definition, get, concat, shard=shard, read_formatted=formatted)
    except cp.cuda.memory.OutOfMemoryError:  # fusing parts (q/k/v, gate/up) or stacking experts: a copy's peak
        raise oom_error(cp, "fusing the weights' parts on the device", 0) from None


def kept_as_stored(p) -> bool:
    """Whether the CUDA engine keeps formatted param p as stored: a projection whose format has projection kernels
    (FP8's and the 4-bit GEMVs; unsupported_features refuses one whose sizes the entry does not take), or stacked MoE
    experts whose entry can `stack` them and takes their sizes and layout (FP8 experts per expert tensor, MXFP4 experts
    stacked in one tensor with gate and up interleaved: read by the MoE kernels' format policies; experts it does not
    take, FP8 of an input width not a multiple of 16 say, fall back to bf16); any other formatted weight (latent
    attention's own weights, formats without a CUDA entry) is dequantized and rounded to bf16 at load, for the kernels
    that read bf16. A formatted param's stored tensors say their own layout (Param.transposed is a dense export's)."""
    if p.format is None:
        return False
    entry = cuda_format(p.format)
    if entry is None:
        return False
    if p.key in PROJECTION_KEYS:
        return entry.linear is not None
    stacked = bool(p.experts) or (entry.stacked_parts and len(p.shape) == 3)
    return (p.key in EXPERT_KEYS and stacked and entry.stack is not None and (entry.reorders_rows or not p.interleaved)
            and entry.refuses(p) is None)


def experts_kept(definition: ModelDefinition, families: tuple[str, ...]) -> bool:
    """Whether the model has stacked experts of these weight-format families kept as stored (read by the MoE
    kernels' format policies)."""
    from ...models.formats import weight_format

    return any(p.key in EXPERT_KEYS and kept_as_stored(p) and weight_format(p.format).family in families
               for p in definition.params())


def fp8_experts_kept(definition: ModelDefinition) -> bool:
    """Whether the model has FP8 experts kept as stored (the MoE kernels' FP8 policy)."""
    return experts_kept(definition, ("fp8_block", "fp8_tensor"))


def mxfp4_experts_kept(definition: ModelDefinition) -> bool:
    """Whether the model has MXFP4 experts kept as stored (the MoE kernels' MXFP4 policy)."""
    return experts_kept(definition, ("mxfp4",))


def stored_param_bytes(p) -> int:
    """The device bytes of a param kept as stored (kept_as_stored): its CUDA format's `nbytes` (4-bit codes with
    fp32 scales), else the checkpoint's stored bytes (e4m3 and fp32 scales)."""
    from ...models.formats import stored_nbytes

    nbytes = cuda_format(p.format).nbytes
    return nbytes(p) if nbytes is not None else stored_nbytes(p)


def device_weight_bytes(definition: ModelDefinition) -> int:
    """The bytes the CUDA engine holds the weights in: bf16, fp32 for FP32_KEYS, a weight format's bytes where the
    format runs as stored (its CudaFormat.nbytes, else the stored bytes: e4m3 and scales). What is read: not a
    checkpoint's vision tower, say."""
    from math import prod

    def held(p) -> int:
        if kept_as_stored(p):
            return stored_param_bytes(p)
        return (4 if p.key in FP32_KEYS else 2) * sum(prod(t.shape) for t in p.parts)

    return sum(held(p) for p in definition.params())


def check_fits(cfg: ModelConfig, free: int, total: int) -> None:
    """DeviceError when the weights cannot fit in `free` bytes of the GPU, naming the smallest --tp whose ranks'
    shares would fit a GPU of this size (the degrees parallel/sharding takes: powers of two dividing the heads)."""
    need = device_weight_bytes(cfg.definition)
    if need <= free:
        return
    kv_heads = cfg.num_key_value_heads or cfg.num_attention_heads
    degrees = [n for n in (2, 4, 8, 16, 32, 64) if cfg.num_attention_heads % n == 0 and kv_heads % n == 0]
    fits = next((n for n in degrees if need / n <= 0.9 * total), None)
    split = f"split the model with --tp {fits} (one GPU of this size each)" if fits else "split the model with --tp N"
    raise DeviceError(f"the weights need {need / 2**30:.1f} GiB and the GPU has {free / 2**30:.1f} GiB free of "
                      f"{total / 2**30:.1f} GiB: use a GPU with more memory, or {split}")


def mixer_weight_keys(kind: str, layer_keys: frozenset[str]) -> frozenset[str] | None:
    """The weights of a layer whose mixer is of kind `kind` that the kind's CUDA implementation computes with (its
    module's WEIGHT_KEYS; without one, every weight of the layer that is not the MLP's), or None when the kind has
    no CUDA implementation."""
    kind_ = mixer_kind(kind)
    if kind_.backends.get("cuda") is None:
        return None
    keys = getattr(kind_.backend("cuda"), "WEIGHT_KEYS", None)
    return frozenset(keys) if keys is not None else frozenset(layer_keys - DENSE_MLP_KEYS - MOE_MLP_KEYS)


def unsupported_features(definition: ModelDefinition) -> list[str]:
    """What the model definition asks for that the CUDA kernels do not compute. Each is refused with a
    DeviceError naming it, never run with wrong numbers (the NumPy engine runs them all). The family
    features (embedding scale, softcaps, (1 + w) norms, sliding windows, partial rotary, linear and
    longrope and yarn scaling (the rope's inv_freq and attention factor from the spec), gelu_tanh, sandwich
    norms, in MoE layers too, the attention output gate, attention sinks) and latent attention run in the kernels;
    what remains is a mixer kind with no CUDA implementation, a weight the passes do not know, a gate activation the
    fused MLP lacks, what the MoE kernels do not take (a router kind without a device function in routers.cu, an
    experts activation other than MOE_ACTIVATIONS'), and Gated DeltaNet sizes its kernels lack (key head dims other
    than 64, 128, 256)."""
    from .kernels.moe import MOE_ACTIVATIONS, ROUTER_KINDS  # no CuPy needed
    from .kernels.tuning import ACTIVATIONS

    found: list[str] = []
    for p in definition.params():
        if kept_as_stored(p):
            why = cuda_format(p.format).refuses(p)
            found += [why] if why else []
    for layer in definition.layers:
        mixer = mixer_weight_keys(layer.mixer.kind, frozenset(layer.keys()))
        if mixer is None:
            found.append(f"layer kind {layer.mixer.kind}")
        if layer.mixer.kind == "linear_attention":  # the Gated DeltaNet kernels' sizes
            from .linear_attention import unsupported

            found += unsupported(layer.mixer)
        if getattr(layer.mixer, "indexer", None) is not None:  # the weights it reads are then not listed again
            found.append("DeepSeek sparse attention's indexer (index_topk)")
            mixer = mixer | INDEXER_KEYS if mixer is not None else None
        if isinstance(layer.mlp, MoeSpec):  # kernels/moe.cu: routers.cu's kinds, (clamped) SwiGLU experts after an RMSNorm
            found += [f"{layer.mlp.router.kind} routing"] if layer.mlp.router.kind not in ROUTER_KINDS else []
            act = layer.mlp.activation
            found += [f"mixture-of-experts activation {act}"] if act not in MOE_ACTIVATIONS else []
            by_key = {p.key: p for p in layer.params}
            if ("shared_down" in by_key and kept_as_stored(by_key["shared_down"])
                    and not kept_as_stored(by_key["experts_down"])):  # the down kernels' shared operand
                found.append("a shared expert in FP8 with experts in bf16")
            mlp = MOE_MLP_KEYS
        else:
            found += [f"activation {layer.mlp.activation}"] if layer.mlp.activation not in ACTIVATIONS else []
            mlp = DENSE_MLP_KEYS
        if mixer is not None:
            found += [f"weight {k}" for k in sorted(layer.keys() - mlp - mixer)]
    return list(dict.fromkeys(found))


# CUDA code that is tested on the CPU against stand-in kernels but has not yet passed its GPU tests: refused by name
# unless METRALE_CUDA_UNVERIFIED=1 (the GPU tests set it: they are what verifies it), so no one gets its numbers
# unknowingly. New CUDA code adds an entry (what it is called, which definitions use it) and removes it once its GPU
# tests pass. Latent attention and the DeepSeek / GLM routers passed in session 17; Gated DeltaNet (its
# verify-then-trim included), gpt-oss (attention sinks, topk_softmax routing with a router bias, clamped-SwiGLU experts
# with biases) and weights dequantized to bf16 at load (FP8 in 8-wide blocks, MXFP4 experts) in session 18
# (docs/measurements/2026-12-07-session18). Gated now (issue 41): every projection kept as stored (FP8, NVFP4, int4),
# read by the one quantized GEMV of session 19 (kernels/qgemv.cu, with the RMSNorm and gate activation fused), until
# tests/gpu/test_fp8.py and test_w4.py pass; FP8 experts read as stored by the MoE kernels (moe.cu's FP8 variants,
# the prefill's per-expert dequantization), until tests/gpu/test_moe_fp8_cuda.py passes; the route kernels past 256
# experts (their 16- and 32-slot instances, Qwen3-Next's 512; issue 38), until tests/gpu/test_moe_routers_cuda.py and
# tests/gpu/test_moe_cuda.py pass with their 512- and 1024-expert cases; MXFP4 experts read as stored (moe.cu's MXFP4
# policy and moe_dequant_bf16_kernel, e2m1.cu), until tests/gpu/test_moe_mxfp4_cuda.py passes.
UNVERIFIED_ENV = "METRALE_CUDA_UNVERIFIED"


def _quantized_projections(definition: ModelDefinition) -> bool:
    from .formats import PROJECTION_KEYS

    return any(kept_as_stored(p) and p.key in PROJECTION_KEYS for p in definition.params())


def _over_256_experts(definition: ModelDefinition) -> bool:
    return any(isinstance(layer.mlp, MoeSpec) and layer.mlp.num_experts > 256 for layer in definition.layers)


UNVERIFIED: tuple[tuple[str, Callable[[ModelDefinition], bool]], ...] = (
    ("projections read as stored by the quantized GEMV (FP8, NVFP4, int4)", _quantized_projections),
    ("FP8 experts read as stored by the MoE kernels", fp8_experts_kept),
    ("MoE route kernels over more than 256 experts", _over_256_experts),
    ("MXFP4 experts read as stored by the MoE kernels", mxfp4_experts_kept),
)


def unverified_features(definition: ModelDefinition) -> list[str]:
    """What the model runs through CUDA code that has not passed its GPU tests (UNVERIFIED's entries it uses)."""
    return [name for name, uses in UNVERIFIED if uses(definition)]


def check_activation_quant(definition: ModelDefinition) -> None:
    """UsageError unless the CUDA engine can quantize every quantized weight's inputs as its scheme says
    (`--activation-quant emulate`): the formats kept as stored whose CUDA entry emulates the scheme (FP8); a weight
    dequantized to bf16 at load, or a scheme the NumPy engine refuses too, is named."""
    from ...models.formats import weight_format

    for p in definition.params():
        if p.format is None:
            continue
        wf = weight_format(p.format)
        if wf.input_quant is None and not wf.input_quant_doc:
            continue  # weight-only: its inputs stay unquantized
        entry = cuda_format(p.format) if kept_as_stored(p) and p.key in PROJECTION_KEYS else None
        if entry is None or entry.input_quant is None or wf.input_quant is None:
            how = ("is dequantized to bf16 at load" if not kept_as_stored(p)
                   else "is read by the MoE kernels, which do not quantize their inputs" if p.key in EXPERT_KEYS
                   else "has no CUDA input quantization")
            raise UsageError(f"--activation-quant emulate: {p.parts[0].name} ({p.format}) {how} on the CUDA engine; "
                             "use --device cpu")


def check_sizes(cfg: ModelConfig) -> None:
    """DeviceError unless the kernels take the model's sizes: head_dim (the attention kernels' instances, when the
    model has attention layers), hidden / intermediate sizes that are multiples of 8 (16-byte loads), and each
    mixer kind's own limits. Needs no CuPy."""
    from .kernels.tuning import DECODE_HEAD_DIMS, PREFILL_HEAD_DIMS

    dims = sorted(set(DECODE_HEAD_DIMS) & set(PREFILL_HEAD_DIMS))
    attention = any(layer.mixer.kind == "attention" for layer in cfg.definition.layers)
    if attention and cfg.head_dim not in dims:
        raise DeviceError(f"head_dim {cfg.head_dim} is not supported by the CUDA kernels "
                          f"(supported: {', '.join(map(str, dims))}); use --device cpu")
    odd = [n for n, v in (("hidden_size", cfg.hidden_size), ("intermediate_size", cfg.intermediate_size))
           if v % 8]
    if odd:
        raise DeviceError(f"{odd[0]} must be a multiple of 8 for the CUDA kernels; use --device cpu")
    for kind in kinds_of(cfg.definition.layers):  # a mixer kind's own size limits (its CUDA module's sizes_refused)
        why = getattr(mixer_kind(kind).backend("cuda"), "sizes_refused", None)
        why = why(cfg) if why is not None else None
        if why is not None:
            raise DeviceError(f"{cfg.model_type}: the CUDA {kind} kernels do not take {why}; use --device cpu")


def load_cuda_engine(cfg: ModelConfig, source, max_context: int, fp32_logits: bool = False,
                     progress: Callable[[int], None] | None = None, use_graphs: bool = True, tp=None,
                     path: str | None = None, mla: str | None = None, activation_quant: str = "none") -> CudaEngine:
    """Check the tensors, upload them once, and build the engine (CuPy is imported here, not before).
    With `tp` (parallel/comm.ParallelRank, its device current) only that rank's shard is uploaded, and the
    engine is that rank's. `path`: the rows path (ROWS_PATHS; None: default_path(), i.e.
    $METRALE_CUDA_PATH or DEFAULT_PATH); a tensor-parallel rank runs BASE_PATH only (the fused path is not
    verified under --tp). `mla` (latent-attention models, `--mla`): None, the absorbed form on the rows paths and
    the naive one in long prefills (backends/cuda/mla.py), or "absorbed" everywhere; "naive" is the CPU engine's
    only (refused here). `activation_quant`: "none" or "emulate" (FP8 weights' inputs quantized as their scheme
    says, check_activation_quant)."""
    if mla not in (None, "absorbed") and any(layer.mixer.kind == "mla" for layer in cfg.definition.layers):
        raise UsageError(f"--mla {mla}: the CUDA engine decodes latent attention in the absorbed form only "
                         "(--mla absorbed, or leave it out: long prefills then run the naive form); "
                         "use --device cpu for the naive form throughout")
    path = check_path(path) if path is not None else default_path(tp is not None)
    if tp is not None and path != BASE_PATH:
        raise UsageError(f"the CUDA '{path}' path does not run under --tp yet (unset {PATH_ENV} or choose {BASE_PATH})")
    check_context(cfg, max_context)
    if activation_quant not in ("none", "emulate"):
        raise UsageError(f"--activation-quant must be none or emulate, got {activation_quant!r}")
    if activation_quant == "emulate":
        if tp is not None:
            raise UsageError("--activation-quant emulate does not run under --tp yet (use --tp 1)")
        check_activation_quant(cfg.definition)
    full = cfg
    if tp is not None:
        from ...parallel.sharding import rank_config

        cfg = rank_config(full, tp.rank, tp.size)
    missing = unsupported_features(cfg.definition)
    if tp is not None and any(p.format is not None for p in cfg.definition.params()):
        missing.append("weights stored in a weight format under --tp")
    if missing:
        raise DeviceError(f"{cfg.model_type}: the CUDA engine does not implement {', '.join(missing)} yet; "
                          "use --device cpu")
    unverified = unverified_features(cfg.definition)
    if unverified and os.environ.get(UNVERIFIED_ENV) != "1":
        raise DeviceError(f"{cfg.model_type}: the CUDA engine's {', '.join(unverified)} have not passed their GPU "
                          f"tests yet; use --device cpu (or set {UNVERIFIED_ENV}=1 to run them unverified)")
    if cfg.moe is not None:
        from .kernels.moe import MoeKernels

        s = cfg.moe.spec
        why = MoeKernels.check_sizes(s.num_experts, s.top_k, s.intermediate_size, s.shared_expert_size or 8,
                                     n_group=s.router.n_group)
        if why is not None:
            raise DeviceError(f"{cfg.model_type}: the CUDA MoE kernels do not take {why}; use --device cpu")
    check_sizes(cfg)
    if not source.made_from_definition:
        check_checkpoint(full, source)  # the whole model's tensors, before a rank keeps its share
    _cupy()
    from .kernels import Kernels

    try:
        kern = Kernels()
    except Exception as e:
        raise DeviceError(f"cannot compile the CUDA kernels ({type(e).__name__}: {str(e).splitlines()[0]})") from None
    weights = upload_weights(full, source, kern, progress, None if tp is None else (tp.rank, tp.size),
                             activation_quant=activation_quant)
    engine = CudaEngine(cfg, weights, kern, max_context, fp32_logits, use_graphs, tp)
    engine.mla = mla  # read by the latent-attention prefill (backends/cuda/mla.PrefillMla)
    if path != engine.path:
        engine.set_path(path)
    return engine


__all__ = ["check_activation_quant", "load_cuda_engine", "unsupported_features", "upload_weights"]
