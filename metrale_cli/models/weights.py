"""Checking a weight source against a model definition, and reading it into engine weights.

Both engines load through `load_weights`: it walks the definition's `Param`s once, reads each
checkpoint tensor through the backend's `read` (fp32 NumPy on the CPU, bf16 on the device for CUDA) and
fuses multi-part params (q/k/v -> qkv, gate/up -> gate_up) with the backend's `concat`; a stacked param
(`Param.experts`: one tensor per expert in the checkpoint) is that concatenation reshaped to [E, ...]. Tensor names
are the Hugging Face names the family module declared.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Generic, Protocol, TypeVar

from ..errors import CheckpointError, ConfigError
from .formats import allowed_dtypes, stored_tensors
from .spec import ModelDefinition, Param

if TYPE_CHECKING:
    from .model_config import ModelConfig
    from ..safetensors_file import TensorInfo


A = TypeVar("A")  # a backend's array type


class WeightSource(Protocol):
    """Where weights come from: a `Checkpoint` (safetensors on disk) or `RandomTensors` (drawn on demand)."""

    # True when the tensors were made from the definition itself (nothing to check); a checkpoint is
    # checked against the definition before anything is read.
    made_from_definition: bool
    # True when `device_array` can draw the tensor on the GPU (no host copy of an 8B model).
    draws_on_device: bool

    def tensor_names(self) -> list[str]: ...
    def info(self, name: str) -> TensorInfo: ...
    # A host array in the stored dtype; with bf16_bits a BF16 tensor comes as its uint16 bit patterns.
    def array(self, name: str, *, bf16_bits: bool = False) -> Any: ...
    def release(self, name: str) -> None: ...  # drop the pages of a tensor already converted
    @property
    def total_bytes(self) -> int: ...
    def close(self) -> None: ...


@dataclass
class Weights(Generic[A]):
    """A model's weights in one backend's arrays, keyed as the definition's Params."""

    embed: A  # [V, H]
    final_norm: A  # [H]
    lm_head: A  # [V, H]; the embedding table itself when tied
    layers: list[dict[str, A]]  # per layer: Param.key -> array


class Shard(Protocol):
    """What one tensor-parallel rank keeps of the weights as they load (parallel/sharding.RankShard)."""

    def layer(self, i: int, weights: dict[str, Any]) -> dict[str, Any]: ...  # layer i's share
    def vocab(self, table: Any) -> Any: ...  # the embedding / lm_head rows of the rank's range


def load_weights(definition: ModelDefinition, read: Callable[[str], A], concat: Callable[[list[A]], A],
                 embed: Callable[[str], A] | None = None, shard: Shard | None = None,
                 read_formatted: Callable[[Param], list[A]] | None = None) -> Weights[A]:
    """Read every param once. `embed(name)` reads the embedding table when it is not also the lm_head
    (the NumPy engine keeps it memory-mapped); by default it is read like every other tensor. With
    `shard`, each layer is cut to one rank's share as soon as it is read (the whole layer is dropped
    before the next is read), and the embedding and lm_head to its vocabulary rows. A param stored in a
    weight format (Param.format, formats.py) is read by `read_formatted(param)`, one backend array per
    part: the backend decides what it keeps (the NumPy engine the dequantized fp32 weight)."""
    keep_layer = (lambda i, lw: lw) if shard is None else shard.layer
    keep_rows = (lambda t: t) if shard is None else shard.vocab

    def param(p: Param) -> A:
        if p.format is not None and read_formatted is None:
            raise CheckpointError(f"{p.parts[0].name}: this engine does not read weights stored as {p.format}")
        parts = [read(t.name) for t in p.parts] if p.format is None else read_formatted(p)
        if p.transposed and p.format is None:  # stored [..., in, out]
            parts = [a.swapaxes(-1, -2).copy() for a in parts]
        if p.interleaved:
            parts = [deinterleave(a, p) for a in parts]
        value = parts[0] if len(parts) == 1 else concat(parts)
        return value.reshape(p.shape) if p.experts else value  # stacked experts: [E, rows, ...]

    layers = [keep_layer(i, {p.key: param(p) for p in layer.params}) for i, layer in enumerate(definition.layers)]
    final_norm = param(definition.final_norm)
    if definition.lm_head is None:
        table = keep_rows(param(definition.embed))
        return Weights(table, final_norm, table, layers)
    lm_head = keep_rows(param(definition.lm_head))
    table = keep_rows(embed(definition.embed.parts[0].name) if embed is not None else param(definition.embed))
    return Weights(table, final_norm, lm_head, layers)


def deinterleave(a: Any, p: Param) -> Any:
    """An interleaved param's array (gate 0, up 0, gate 1, ... along its output axis: the second to last of a
    weight, the last of a bias) as [all gate; all up] (a fresh array: fancy indexing copies)."""
    import numpy as np

    bias = p.parts[0].name.endswith("bias")
    n = a.shape[-1] if bias else a.shape[-2]
    order = np.concatenate([np.arange(0, n, 2), np.arange(1, n, 2)])
    return a[..., order] if bias else a[..., order, :]


def split_param(p: Param, value: Any) -> dict[str, Any]:
    """The inverse of the load-time fusion: checkpoint name -> the rows of `value` it supplied."""
    if p.experts:  # stacked [E, rows, ...]: the parts follow each other in the flattened rows
        value = value.reshape((-1,) + tuple(value.shape[2:]))
    out, row = {}, 0
    for t in p.parts:
        out[t.name] = value[row:row + t.shape[0]]
        row += t.shape[0]
    return out


def expected_tensors(definition: ModelDefinition) -> dict[str, tuple[int, ...]]:
    """Checkpoint tensor name -> shape, for every tensor the definition reads (a formatted param's stored
    tensors and their scales: formats.stored_tensors)."""
    return {t.name: t.shape for p in definition.params() for t in stored_tensors(p)}


def check_checkpoint(cfg: ModelConfig, ckpt: WeightSource) -> None:
    """Fail with one message listing every missing, unexpected, mis-shaped or unrunnable tensor."""
    definition = cfg.definition
    present = set(ckpt.tensor_names())
    embed = definition.embed.parts[0].name
    if embed in present:
        rows = ckpt.info(embed).shape[0] if ckpt.info(embed).shape else None
        if rows is not None and rows != cfg.vocab_size:
            raise ConfigError(
                f"{ckpt.directory / 'config.json'}: vocab_size {cfg.vocab_size} differs from the {rows} "
                f"rows of {embed}"
            )
    want = expected_tensors(definition)
    problems: list[str] = []
    missing = sorted(set(want) - present, key=natural)
    if missing:
        problems.append(f"missing {len(missing)}: {_listing(missing)}")
    unexpected = sorted((n for n in present - set(want) if not _tolerated(definition, n)), key=natural)
    if unexpected:
        problems.append(f"unexpected {len(unexpected)}: {_listing(unexpected)}")
    misshaped = [
        f"{n} {list(ckpt.info(n).shape)} (expected {list(want[n])})"
        for n in sorted(present & set(want), key=natural)
        if tuple(ckpt.info(n).shape) != want[n]
    ]
    if misshaped:
        problems.append(f"wrong shape {len(misshaped)}: {_listing(misshaped)}")
    allowed = {n: d for p in definition.params() for n, d in allowed_dtypes(p).items()}
    bad_dtype = [
        f"{n} {ckpt.info(n).dtype} (expected {'/'.join(allowed[n])})"
        for n in sorted(present & set(want), key=natural)
        if ckpt.info(n).dtype not in allowed[n]
    ]
    if bad_dtype:
        problems.append(f"wrong dtype {len(bad_dtype)}: {_listing(bad_dtype)}")
    if problems:
        raise CheckpointError(
            f"{ckpt.directory}: tensors do not match config.json ({cfg.model_type}, "
            f"{cfg.num_hidden_layers} layers): " + "; ".join(problems)
        )


def _tolerated(definition: ModelDefinition, name: str) -> bool:
    return (any(name == s or name.endswith(s) for s in definition.ignored)
            or name.startswith(definition.ignored_prefixes))


def _listing(names: list[str], limit: int = 12) -> str:
    shown = ", ".join(names[:limit])
    return shown + (f", ... and {len(names) - limit} more" if len(names) > limit else "")


def natural(name: str) -> tuple:
    """Sort model.layers.10 after model.layers.9."""
    return tuple((0, int(p), "") if p.isdigit() else (1, 0, p) for p in name.split("."))
