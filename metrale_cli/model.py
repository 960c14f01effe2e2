"""Opening a checkpoint: config, tensors, tokenizer and the engine for the chosen device, in one call."""

from __future__ import annotations

import os
import re
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Callable

from .checkpoint import Checkpoint
from .config import ModelConfig, load_config
from .errors import CheckpointError, DeviceError, UsageError
from .tokenizer import Tokenizer

if TYPE_CHECKING:
    from .engine.protocols import Engine

DEFAULT_MODEL_DIR = Path(__file__).parent / "assets" / "models" / "default"
DEVICES = ("auto", "cpu", "cuda")
COMPUTES = ("fp32", "bf16")  # the NumPy engine's precisions; the CUDA engine computes with bf16 weights
# owner/name, as Hugging Face spells repo ids (letters, digits, '-', '_', '.'; neither part starts with
# '.' or '-'): a missing path of that shape was probably meant as one.
_HUB_REPO_ID = re.compile(r"[A-Za-z0-9_][\w.-]{0,95}/[A-Za-z0-9_][\w.-]{0,95}")


@dataclass
class LoadedModel:
    path: Path
    config: ModelConfig
    checkpoint: Checkpoint
    engine: Engine  # NumpyEngine or CudaEngine (engine/protocols.py)
    tokenizer: Tokenizer | None
    device: str  # "cpu" or "cuda"
    load_seconds: float

    def close(self) -> None:
        close = getattr(self.engine, "close", None)  # a tensor-parallel engine ends its worker processes
        if close is not None:
            close()
        self.checkpoint.close()


def cuda_available() -> bool:
    """True when CuPy imports and sees at least one CUDA device (never raises)."""
    if os.environ.get("METRALE_DISABLE_CUDA"):
        return False
    try:
        import cupy  # noqa: F401

        return cupy.cuda.runtime.getDeviceCount() > 0
    except Exception:
        return False


def resolve_device(device: str) -> str:
    if device not in DEVICES:
        raise UsageError(f"--device must be one of {', '.join(DEVICES)}, got '{device}'")
    if device == "auto":
        return "cuda" if cuda_available() else "cpu"
    if device == "cuda" and not cuda_available():
        try:
            import cupy  # noqa: F401
        except Exception:
            raise DeviceError(
                "--device cuda needs CuPy: pip install 'metrale[cuda12]' or 'metrale[cuda13]'"
            ) from None
        raise DeviceError("--device cuda: CuPy sees no CUDA device")
    return device


def check_compute(compute: str | None, device: str) -> str:
    """--compute on a resolved device: fp32 (the default) or bf16 on the CPU; bf16 only, and by default,
    on the GPU (the CUDA engine holds bf16 weights)."""
    if compute is not None and compute not in COMPUTES:
        raise UsageError(f"--compute must be one of {', '.join(COMPUTES)}, got {compute!r}")
    if device == "cuda":
        if compute == "fp32":
            raise UsageError("--compute fp32 runs on the CPU only: the CUDA engine computes with bf16 weights "
                             "(--device cuda is --compute bf16; --logits-dtype fp32 still writes fp32 logits)")
        return "bf16"
    return compute or "fp32"


def default_logits_dtype(device: str) -> str:
    """--logits-dtype's default on a resolved device: fp32 on the CPU, where the NumPy engine computes fp32
    logits anyway (bf16 rows would round ties into its greedy choice: its greedy tokens are transformers'
    fp32 ones only in fp32), bf16 on the GPU, whose engine writes bf16 rows as the engines it models do."""
    return "fp32" if device == "cpu" else "bf16"


# Names for the models shipped in the package, usable as --model/--draft-model from any directory. Their
# directories sit beside DEFAULT_MODEL_DIR, so moving the embedded models only changes that constant.
EMBEDDED_MODELS = ("default", "default-draft")


def model_path(path: str | Path | None) -> Path:
    """What --model names: None is the embedded default; an existing file or directory is itself (so a
    ./default directory wins over the embedded model of that name); otherwise an embedded model's name."""
    if path is None:
        return DEFAULT_MODEL_DIR
    p = Path(path)
    if p.exists():
        return p
    if str(path) in EMBEDDED_MODELS:
        return DEFAULT_MODEL_DIR.parent / str(path)
    hint = hub_hint(path) or f" (embedded models: {', '.join(EMBEDDED_MODELS)})"
    raise CheckpointError(f"{p}: no such file or directory{hint}")


def model_dir(path: str | Path | None) -> Path:
    """The checkpoint directory: model_path itself, or the directory of a .safetensors/index.json file."""
    p = model_path(path)
    return p.parent if p.is_file() else p


def hub_hint(path: str | Path | None) -> str:
    """For a missing path shaped like a Hugging Face repo id: how to get a local copy (else "")."""
    if path is None or not _HUB_REPO_ID.fullmatch(str(path)):
        return ""
    return (f" (if {path} is a Hugging Face repo id: metrale reads local checkpoint directories only; "
            f"download it with `hf download {path} --local-dir DIR` or `huggingface-cli download {path} "
            "--local-dir DIR` and pass DIR)")


def open_model(path: str | Path | None = None, *, device: str = "auto", max_context: int | None = None,
               fp32_logits: bool | None = None, progress: Callable[[int, int], None] | None = None,
               tp: int | None = None, compute: str | None = None, mla: str | None = None,
               activation_quant: str | None = None, threads: int | None = None) -> LoadedModel:
    """Load config.json, the safetensors tensors and tokenizer.json, and build the engine.

    `max_context` sizes the KV cache (default: the model's limit, capped at 4096). `progress(done, total)`
    is called with weight bytes as they are converted or uploaded. `tp`: the model sharded over that
    many ranks, one process each (parallel/launcher.py); this process is rank 0. `compute`: the NumPy
    engine's precision, "fp32" (the reference, its default) or "bf16" (every intermediate rounded where a
    bf16 forward rounds it); the CUDA engine is bf16 by nature and refuses "fp32" (check_compute).
    `mla`: the NumPy engine's latent-attention algebra, "naive" (default) or "absorbed" (engine/mla.py).
    `activation_quant`: "none" (default) or "emulate" (quantized weights' inputs quantized as their checkpoint's
    scheme says: models/formats.WeightFormat.input_quant; on the CUDA engine FP8 weights' only).
    `threads`: the NumPy engine's threads (default: the cores available).
    `fp32_logits`: the rows' dtype, by default the device's (default_logits_dtype: fp32 on the CPU, bf16 on
    the GPU).
    """
    t0 = time.perf_counter()
    chosen = resolve_device(device)
    compute = check_compute(compute, chosen)
    if fp32_logits is None:
        fp32_logits = default_logits_dtype(chosen) == "fp32"
    directory = model_dir(path)
    cfg = load_config(directory)
    target = model_path(path)
    ckpt = Checkpoint.open(target if target.is_file() else directory)
    try:
        ctx = max_context or min(cfg.max_context, 4096)
        total = ckpt.total_bytes
        done = [0]

        def step(nbytes: int) -> None:
            done[0] += nbytes
            if progress is not None:
                progress(min(done[0], total), total)

        if tp is not None:
            if (activation_quant or "none") != "none":
                raise UsageError("--activation-quant emulate does not run under --tp yet (use --tp 1)")
            from .parallel.launcher import LoadSpec, start

            spec = LoadSpec(chosen, ctx, fp32_logits, path=str(target if target.is_file() else directory),
                            compute=compute)
            engine = start(cfg, spec, tp, source=ckpt, progress=step)
        elif chosen == "cuda":
            from .backends.cuda.loading import load_cuda_engine

            engine = load_cuda_engine(cfg, ckpt, ctx, fp32_logits, step, mla=mla,
                                      activation_quant=activation_quant or "none")
        else:
            from .backends.numpy.engine import load_numpy_engine

            engine = load_numpy_engine(cfg, ckpt, ctx, fp32_logits, step, compute=compute, mla=mla or "naive",
                                       activation_quant=activation_quant or "none", threads=threads)
    except BaseException:
        ckpt.close()
        raise
    tok_path = directory / "tokenizer.json"
    tokenizer = Tokenizer.from_file(tok_path) if tok_path.is_file() else None
    return LoadedModel(directory, cfg, ckpt, engine, tokenizer, chosen, time.perf_counter() - t0)


def check_mtp(path: str | Path | None, cfg: ModelConfig, device: str, tp: int | None) -> None:
    """decode --draft mtp, before anything loads: the NumPy engine, one process, a family whose MTP layer metrale
    runs (models/mtp.py) and a checkpoint that holds it."""
    from .models.mtp import check_present, mtp_config

    if device != "cpu":
        raise UsageError("--draft mtp runs the multi-token-prediction layer on the NumPy engine only yet "
                         "(use --device cpu)")
    if tp is not None:
        raise UsageError("--draft mtp does not run under --tp yet")
    mtp_config(cfg)
    target = model_path(path)
    ckpt = Checkpoint.open(target if target.is_file() else model_dir(path))
    try:
        check_present(cfg, ckpt.tensor_names())
    finally:
        ckpt.close()


def open_mtp(target: LoadedModel, max_context: int, fp32_logits: bool, compute: str = "fp32",
             mla: str | None = None, activation_quant: str | None = None):
    """The target checkpoint's first multi-token-prediction layer as a NumPy engine (decode --draft mtp), computing
    as the target does."""
    from .backends.numpy.mtp import load_numpy_mtp

    return load_numpy_mtp(target.config, target.checkpoint, max_context, fp32_logits, compute=compute,
                          mla=mla or "naive", activation_quant=activation_quant or "none")
