"""`metrale bench`: decode, verify and prefill speed against the hardware's own limits, measured in one run.

A model is built from a preset in configs/ with random weights (drawn on the device for CUDA, so an
8B preset needs no file). In the same run the bench measures the ceilings it compares against:
- read bandwidth: a large read-only pass (a grid-stride uint4 kernel on the GPU, a sum on the CPU);
- the floor of a decode step: the bytes it must read (every weight but the embedding table, plus the
  KV cache up to the context) over that bandwidth;
- the GEMM rate: a large bf16 matrix product (fp32 on the CPU).
Then decode ms/token, verify ms for each k, prefill tokens/s and, when transformers is importable (GPU),
transformers eager on the same weights. Device times are CUDA-event medians after warm-up.

With `paths` (`metrale bench --path rows,fused`, CUDA only) the standard figures are taken on the first
path, and then every path in turn is timed in the same run, on the same engine, weights and KV cache:
decode step (ms, x floor, fraction of the read bandwidth = floor / step), verify for each k (ms, x that
path's decode step), and one decode step's logits against the first path's (max |diff|, argmax), with the
fused path's counters checked afterwards (BenchResult.paths; render.render_bench shows them side by side).
"""

from __future__ import annotations

import statistics
import time
from importlib import resources
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np

from .config import ModelConfig, load_config
from .errors import DeviceError, UsageError
from .floors import (expert_params, kv_bytes_read, linear_state_bytes, moe_step_bytes, prefill_flops, weight_bytes,
                     weight_formats_note)
from .random_weights import RandomTensors

# The presets: shipped as metrale_cli.assets.presets when installed; read from the repository's
# top-level configs/ when running from a source checkout (that subpackage has no directory there).
SOURCE_CONFIGS = Path(__file__).resolve().parent.parent / "configs"


@dataclass
class Figure:
    name: str
    value: float
    unit: str
    target: str = ""  # what the figure is held to, in words
    ratio: float | None = None  # value relative to the target's reference (see target)
    met: bool | None = None


@dataclass
class PathResult:
    """One rows path (CudaEngine.set_path) measured beside the other in the same run."""

    path: str
    decode_ms: float
    floor_ratio: float  # decode step / decode floor
    bandwidth_fraction: float  # floor bytes / decode step / read bandwidth (= 1 / floor_ratio)
    verify_ms: dict[str, float] = field(default_factory=dict)  # k -> ms
    verify_ratio: dict[str, float] = field(default_factory=dict)  # k -> verify ms / this path's decode step
    logits_max_abs_diff: float | None = None  # one decode step's logits vs the first path's (None: the first)
    argmax_matches: bool | None = None
    fallbacks: dict[str, str] = field(default_factory=dict)  # op -> why this path runs it unfused (decode)


@dataclass
class BenchResult:
    preset: str
    device: str
    context: int
    params: int
    streamed_bytes: int
    kv_bytes: int
    figures: list[Figure] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    paths: list[PathResult] = field(default_factory=list)  # --path: each rows-path variant, side by side

    def to_json(self) -> dict:
        return asdict(self)

    def get(self, name: str) -> Figure | None:
        return next((f for f in self.figures if f.name == name), None)


def presets_dir() -> Path:
    """Where the preset JSON files are: the installed package's, else the source tree's configs/."""
    installed = Path(str(resources.files("metrale_cli.assets") / "presets"))
    return installed if installed.is_dir() else SOURCE_CONFIGS


def preset_path(name: str) -> Path:
    p = Path(name)
    if p.suffix == ".json" and p.is_file():
        return p
    if p.is_dir() and (p / "config.json").is_file():  # a checkpoint directory: its config.json
        return p / "config.json"
    folder = presets_dir()
    cand = folder / f"{name}.json"
    if not cand.is_file():
        names = ", ".join(sorted(q.stem for q in folder.glob("*.json"))) or f"none found in {folder}"
        raise UsageError(f"unknown preset '{name}' (available: {names})")
    return cand


def _median(xs: list[float]) -> float:
    return float(statistics.median(xs))


class _Timer:
    """Wall-clock on the CPU; CUDA events on the GPU (device time of the work between)."""

    def __init__(self, engine) -> None:
        self.engine = engine
        self.cuda = getattr(engine, "device", "cpu") == "cuda"

    def time(self, fn, repeats: int, warmup: int = 3) -> float:
        """Median seconds of fn() over `repeats` runs."""
        for _ in range(warmup):
            fn()
        self.engine.synchronize()
        out = []
        if self.cuda:
            cp = self.engine.cp
            s = self.engine.stream
            for _ in range(repeats):
                a, b = cp.cuda.Event(), cp.cuda.Event()
                a.record(s)
                fn()
                b.record(s)
                b.synchronize()
                out.append(cp.cuda.get_elapsed_time(a, b) / 1000)
        else:
            for _ in range(repeats):
                t0 = time.perf_counter()
                fn()
                out.append(time.perf_counter() - t0)
        return _median(out)


# -- ceilings --------------------------------------------------------------------------------------------


READ_KERNEL = r"""
extern "C" __global__ void read_all(const uint4* __restrict__ src, size_t n, unsigned int* out) {
    unsigned int acc = 0;
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x) {
        uint4 v = __ldg(src + i);
        acc ^= v.x ^ v.y ^ v.z ^ v.w;
    }
    if (acc == 0x12345678u) out[0] = acc;  // keeps the loads alive; practically never taken
}
"""


def read_bandwidth_gpu(cp, nbytes: int = 4 << 30) -> float:
    """Bytes per second of READ_KERNEL over nbytes of random data on the current device (median of 20
    eager launches).  The one read ceiling of metrale: the kernel benches in benchmarks/ use it too."""
    buf = cp.random.randint(0, 2**31 - 1, nbytes // 4, dtype=cp.int32)
    out = cp.zeros(1, cp.uint32)
    k = cp.RawKernel(READ_KERNEL, "read_all")
    n = nbytes // 16
    sms = cp.cuda.Device().attributes["MultiProcessorCount"]
    args = ((sms * 8,), (512,), (buf, np.uint64(n), out))
    for _ in range(3):
        k(*args)
    times = []
    for _ in range(20):
        a, b = cp.cuda.Event(), cp.cuda.Event()
        a.record()
        k(*args)
        b.record()
        b.synchronize()
        times.append(cp.cuda.get_elapsed_time(a, b) / 1000)
    del buf
    return nbytes / _median(times)


def gemm_rate_gpu(cp, n: int = 8192) -> float:
    import ml_dtypes

    a = cp.asarray(np.random.default_rng(0).standard_normal((n, n), np.float32).astype(ml_dtypes.bfloat16))
    b = cp.asarray(np.random.default_rng(1).standard_normal((n, n), np.float32).astype(ml_dtypes.bfloat16))
    for _ in range(3):
        a @ b
    times = []
    for _ in range(10):
        e0, e1 = cp.cuda.Event(), cp.cuda.Event()
        e0.record()
        a @ b
        e1.record()
        e1.synchronize()
        times.append(cp.cuda.get_elapsed_time(e0, e1) / 1000)
    return 2 * n**3 / _median(times)


def read_bandwidth_cpu(nbytes: int = 512 << 20) -> float:
    x = np.random.default_rng(0).standard_normal(nbytes // 4, dtype=np.float32)
    x.sum()
    times = []
    for _ in range(5):
        t0 = time.perf_counter()
        x.sum()
        times.append(time.perf_counter() - t0)
    return nbytes / _median(times)


def gemm_rate_cpu(n: int = 1024) -> float:
    a = np.random.default_rng(0).standard_normal((n, n), dtype=np.float32)
    a @ a
    times = []
    for _ in range(5):
        t0 = time.perf_counter()
        a @ a
        times.append(time.perf_counter() - t0)
    return 2 * n**3 / _median(times)


# -- the bench -------------------------------------------------------------------------------------------


def build_engine(cfg: ModelConfig, device: str, context: int, tp: int | None = None, threads: int | None = None):
    """The engine of the bench's random weights; with `tp`, rank 0's engine of that many ranks, each of
    which draws the same weights (by name and seed) and keeps its shard."""
    if tp is not None:
        from .parallel.launcher import LoadSpec, start

        return start(cfg, LoadSpec(device, context, False, config=cfg, seed=0), tp)
    source = RandomTensors(cfg, seed=0)
    if device == "cuda":
        from .backends.cuda.loading import load_cuda_engine

        return load_cuda_engine(cfg, source, context)
    from .backends.numpy.engine import load_numpy_engine

    check_cpu_fits(cfg, available_memory())
    return load_numpy_engine(cfg, source, context, threads=threads)


def available_memory() -> int | None:
    """The bytes of memory this machine can give a new allocation now (Linux MemAvailable), or None where unknown."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def check_cpu_fits(cfg: ModelConfig, available: int | None) -> None:
    """DeviceError when the preset's random weights cannot fit this machine's memory: the CPU engine draws them into
    memory and holds at least their stored bytes (a quantized weight's packed bytes and scales, a dense one's bf16;
    norms and dequantized weights take more), so a preset whose stored bytes exceed what is available is refused
    before anything is drawn instead of driving the machine out of memory."""
    from .models.formats import stored_nbytes

    need = sum(stored_nbytes(p) for p in cfg.definition.params())
    if available is not None and need > available:
        raise DeviceError(f"the random weights need at least {need / 2**30:.1f} GiB of memory and this machine has "
                          f"{available / 2**30:.1f} GiB available: use --device cuda (with --tp N) or a smaller "
                          "preset")


def check_paths(paths: tuple[str, ...] | None, device: str) -> tuple[str, ...] | None:
    """The --path list: known names (backends.cuda.paths.ROWS_PATHS), no repeats, CUDA only."""
    if not paths:
        return None
    if device != "cuda":
        raise UsageError("--path compares the CUDA engine's rows paths: it needs --device cuda")
    from .backends.cuda.paths import check_path  # no CuPy needed
    return tuple(dict.fromkeys(check_path(p) for p in paths))


def run_bench(preset: str, *, device: str = "cpu", context: int = 1024, ks: tuple[int, ...] = (1, 2, 4, 8),
              prefill_tokens: int = 2048, repeats: int = 50, transformers_steps: int = 20,
              with_transformers: bool = True, progress=None, tp: int | None = None,
              paths: tuple[str, ...] | None = None, threads: int | None = None) -> BenchResult:
    paths = check_paths(paths, device)
    if paths and tp is not None:
        raise UsageError("--path times the single-GPU engine's rows paths: it does not take --tp")
    path = preset_path(preset)
    cfg = load_config(path)
    say = progress or (lambda msg: None)
    max_k = max(ks) if ks else 1
    ctx_alloc = max(context + max_k + 1, prefill_tokens)
    say(f"building {path.stem} with random weights on {device}" + (f", --tp {tp}" if tp else ""))
    eng = build_engine(cfg, device, ctx_alloc, tp, threads)
    try:
        return _run_bench(eng, path.stem, cfg, device, context, ks, prefill_tokens, repeats, transformers_steps,
                          with_transformers and tp is None, say, tp, paths)
    finally:
        close = getattr(eng, "close", None)
        if close is not None:
            close()


def _run_bench(eng, name: str, cfg: ModelConfig, device: str, context: int, ks: tuple[int, ...],
               prefill_tokens: int, repeats: int, transformers_steps: int, with_transformers: bool, say,
               tp: int | None, paths: tuple[str, ...] | None = None) -> BenchResult:
    elem = 2 if device == "cuda" else 4  # an activation's (and the KV cache's) bytes
    streamed, xb = weight_bytes(eng, cfg, elem)  # xb: bytes an expert parameter takes as the engine holds it
    kv_read = kv_bytes_read(cfg, context, elem) + linear_state_bytes(cfg)  # a recurrent state counts as read
    res = BenchResult(name, device, context, cfg.parameter_count(), streamed, kv_read)
    if linear_state_bytes(cfg):
        res.notes.append(f"linear-attention layers: their recurrent and conv states ({linear_state_bytes(cfg) / 2**20:.0f}"
                         " MiB read and written a step) count in the floor with the KV cache")
    note = weight_formats_note(cfg, device)
    if note:
        res.notes.append(note)
    if tp is not None:  # the floor of one rank: its share of the weights and its KV heads
        from .parallel.sharding import rank_config

        streamed, kv_read = -(-streamed // tp), kv_bytes_read(rank_config(cfg, 0, tp), context, elem)
        res.notes.append(f"--tp {tp}: timed on rank 0; the floor is one rank's (weights / {tp} and its KV heads), "
                         "so decode / floor includes the all-reduces; transformers not measured")
    timer = _Timer(eng)
    rng = np.random.default_rng(0)

    say("measuring the read bandwidth and the GEMM rate")
    if device == "cuda":
        bw, gemm = read_bandwidth_gpu(eng.cp), gemm_rate_gpu(eng.cp)
    else:
        bw, gemm = read_bandwidth_cpu(), gemm_rate_cpu()

    say(f"filling the KV cache to {context} positions"
        + (" (a machine's first run compiles the kernels the model needs: up to a minute)" if device == "cuda" else ""))
    eng.reset()
    eng.prefill([int(t) for t in rng.integers(0, cfg.vocab_size, context)])
    eng.synchronize()
    # A mixture of experts reads the experts its router chose, not all of them: the floor counts those.
    step_bytes = streamed if cfg.moe is None else moe_step_bytes(eng, cfg, [5], context, xb, streamed)
    floor = (step_bytes + kv_read) / bw
    res.figures += [
        Figure("read bandwidth", bw / 1e9, "GB/s", "measured ceiling"),
        Figure("decode floor", floor * 1e3, "ms", "weights + KV bytes / read bandwidth"
               + ("" if cfg.moe is None else " (the experts this step's router chose)")),
        Figure("GEMM rate", gemm / 1e12, "TFLOP/s", "measured ceiling (bf16 on GPU, fp32 on CPU)"),
    ]
    if cfg.moe is not None:
        res.figures.append(_experts_figure("decode step", cfg, step_bytes, streamed, xb))

    if paths:
        eng.set_path(paths[0])

    def decode_once():
        eng.decode(5)
        eng.trim(context)  # keep the context fixed: every step attends over `context` positions

    decode_s = timer.time(decode_once, repeats)
    target = 1.15 if cfg.moe is None else 1.3  # a mixture of experts: more, smaller launches per step
    res.figures.append(Figure("decode step", decode_s * 1e3, "ms", f"<= {target} x floor", decode_s / floor,
                              decode_s <= target * floor))
    if getattr(getattr(eng, "kern", None), "pdl_supported", False):  # the step with the other PDL setting
        default = eng.use_pdl  # on where the device has it (CudaEngine.use_pdl)
        eng.set_pdl(not default)
        other = timer.time(decode_once, repeats)
        eng.set_pdl(default)
        res.figures.append(Figure(f"decode step {'without' if default else 'with'} PDL", other * 1e3, "ms",
                                  "x decode step", other / decode_s))

    def greedy_once():
        eng.decode(5)
        eng.argmax_on_device(eng.decode_logits_ptr())
        eng.trim(context)

    t_wall = []
    for _ in range(3):
        greedy_once()
    for _ in range(repeats):
        t0 = time.perf_counter()
        greedy_once()
        t_wall.append(time.perf_counter() - t0)
    res.figures.append(Figure("decode + argmax (host wall)", _median(t_wall) * 1e3, "ms", "tokens/s = 1000 / this"))

    for k in ks:
        drafts = [int(t) for t in rng.integers(0, cfg.vocab_size, k)]

        def verify_once():
            eng.verify(drafts)
            eng.trim(context)

        v = timer.time(verify_once, repeats)
        limit = 1.15 if k <= 4 else 1.3
        res.figures.append(Figure(f"verify k={k}", v * 1e3, "ms", f"<= {limit} x decode step" if k in (4, 8) else "",
                                  v / decode_s, (v <= limit * decode_s) if k in (4, 8) else None))
        if cfg.moe is not None:  # against its own floor: the union of the experts its k rows chose
            vb = moe_step_bytes(eng, cfg, drafts, context, xb, streamed)
            vfloor = (vb + kv_read + linear_state_bytes(cfg, k) - linear_state_bytes(cfg)) / bw  # k rows' states
            res.figures.append(Figure(f"verify k={k} floor", vfloor * 1e3, "ms", "weights (its experts) + KV / bw",
                                      v / vfloor))
            res.figures.append(_experts_figure(f"verify k={k}", cfg, vb, streamed, xb))

    if paths:
        res.paths = _time_paths(eng, paths, timer, decode_once, floor, ks, context, repeats, rng, cfg.vocab_size, say)
        eng.set_path(paths[0])

    say(f"prefill of {prefill_tokens} tokens")
    prompt = [int(t) for t in rng.integers(0, cfg.vocab_size, prefill_tokens)]

    def prefill_once():
        eng.reset()
        eng.prefill(prompt)

    p = timer.time(prefill_once, max(3, repeats // 10), warmup=1)
    flops = prefill_flops(cfg, prefill_tokens)
    res.figures.append(Figure(f"prefill {prefill_tokens}", prefill_tokens / p, "tokens/s",
                              ">= 50% of the GEMM rate", flops / p / gemm, flops / p >= 0.5 * gemm))

    if with_transformers and device == "cuda" and cfg.moe is not None:
        res.notes.append("transformers not measured: the bench maps dense weights only")
    elif with_transformers and device == "cuda":
        say("transformers eager on the same weights")
        try:
            hf = transformers_decode_ms(eng, cfg, context, transformers_steps)
        except ImportError as e:
            res.notes.append(f"transformers not measured: {e}")
        else:
            res.figures.append(Figure("transformers eager decode", hf * 1e3, "ms",
                                      ">= 20 x slower than metrale", hf / decode_s, hf >= 20 * decode_s))
    return res


def _time_paths(eng, paths, timer, decode_once, floor: float, ks, context: int, repeats: int, rng, vocab: int,
                say) -> list[PathResult]:
    """Each rows path in turn on the same engine and KV cache: decode, verify per k, and one step's logits
    against the first path's (the fused path's counters are checked after its runs: DeviceError if not)."""
    drafts = {k: [int(t) for t in rng.integers(0, vocab, k)] for k in ks}
    out: list[PathResult] = []
    first = None
    for name in paths:
        say(f"rows path '{name}': decode and verify")
        eng.set_path(name)
        step = timer.time(decode_once, repeats)
        r = PathResult(name, step * 1e3, step / floor, floor / step)
        if name == "fused":
            r.fallbacks = {op: why for op, why in eng.fused_plan(1).items() if why}
        for k in ks:
            def verify_once(d=drafts[k]):
                eng.verify(d)
                eng.trim(context)

            v = timer.time(verify_once, repeats)
            r.verify_ms[str(k)], r.verify_ratio[str(k)] = v * 1e3, v / step
        eng.trim(context)
        eng.decode(5)
        logits = _decode_logits(eng)
        eng.trim(context)
        eng.check_fused()
        if first is None:
            first = logits
        else:
            r.logits_max_abs_diff = float(np.max(np.abs(logits - first)))
            r.argmax_matches = bool(np.argmax(logits) == np.argmax(first))
        out.append(r)
    return out


def _decode_logits(eng) -> np.ndarray:
    """The decode logits row as fp32 on the host (bf16 logits widened exactly)."""
    ptr = eng.decode_logits_ptr()
    buf = bytearray(eng.row_nbytes(ptr))
    eng.copy_logits_to_host(ptr, buf)
    if eng.logits_ptr_is_fp32(ptr):
        return np.frombuffer(buf, np.float32).copy()
    return (np.frombuffer(buf, np.uint16).astype(np.uint32) << 16).view(np.float32)


def _experts_figure(what: str, cfg: ModelConfig, step_bytes: int, streamed: int, xb: float) -> Figure:
    one, total = expert_params(cfg)
    read = step_bytes - (streamed - total * xb)
    return Figure(f"experts read by the {what}", 100 * read / (total * xb), "%",
                  f"of the expert bytes ({read / one / xb / len(cfg.moe.sparse_layers):.1f} experts per layer)")


def transformers_decode_ms(eng, cfg: ModelConfig, context: int, steps: int) -> float:
    """Seconds per decode step of transformers (eager, bf16) holding the same weights as `eng`."""
    import torch
    import transformers

    from .models.weights import split_param

    cp = eng.cp
    eng.synchronize()
    with torch.device("meta"):
        hf_cfg = _hf_config(transformers, cfg)
        model = transformers.AutoModelForCausalLM.from_config(hf_cfg, dtype=torch.bfloat16)
    model = model.to_empty(device="cuda").eval()

    def t(a):
        return torch.from_dlpack(a).view(torch.bfloat16)

    params = dict(model.named_parameters())
    definition, w = cfg.definition, eng.w
    with torch.no_grad():
        # every engine weight back into the checkpoint tensors it was fused from
        pairs = [(definition.embed, w.embed), (definition.final_norm, w.final_norm)]
        if definition.lm_head is not None:
            pairs.append((definition.lm_head, w.lm_head))
        for layer, lw in zip(definition.layers, w.layers):
            pairs += [(p, lw[p.key]) for p in layer.params]
        for p, value in pairs:
            for name, rows in split_param(p, t(value)).items():
                params[name].copy_(rows)
    model.model.rotary_emb.__init__(model.config, device="cuda")  # buffers were left empty by to_empty
    cp.cuda.Device().synchronize()
    ids = torch.randint(0, cfg.vocab_size, (1, context), device="cuda")
    with torch.inference_mode():
        out = model(ids, use_cache=True)
        cache = out.past_key_values
        tok = out.logits[:, -1:].argmax(-1)
        times = []
        for i in range(steps + 3):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            out = model(tok, past_key_values=cache, use_cache=True)
            tok = out.logits[:, -1:].argmax(-1)
            torch.cuda.synchronize()
            if i >= 3:
                times.append(time.perf_counter() - t0)
    del model
    torch.cuda.empty_cache()
    return _median(times)


def _hf_config(transformers, cfg: ModelConfig):
    kw = dict(vocab_size=cfg.vocab_size, hidden_size=cfg.hidden_size, intermediate_size=cfg.intermediate_size,
              num_hidden_layers=cfg.num_hidden_layers, num_attention_heads=cfg.num_attention_heads,
              num_key_value_heads=cfg.num_key_value_heads, head_dim=cfg.head_dim, rms_norm_eps=cfg.rms_norm_eps,
              max_position_embeddings=cfg.max_position_embeddings, tie_word_embeddings=cfg.tie_word_embeddings,
              attn_implementation="eager")
    rope = {"rope_type": "default", "rope_theta": cfg.rope_theta}
    if cfg.rope_scaling is not None:
        rope = {"rope_type": "llama3", "rope_theta": cfg.rope_theta, **asdict(cfg.rope_scaling)}
    return transformers.AutoConfig.for_model(cfg.model_type, **kw, rope_parameters=rope)
