"""Weight formats: how a checkpoint stores a weight, and its exact dequantization to fp32.

A `Param` (models/spec.py) carries its storage format by name: None for the dense formats (BF16, F16, F32
tensors, read as they are), or a format registered here (FP8 with block or per-channel scales, MXFP4,
NVFP4, int4 with group scales, ...). A format says
  - which tensors the checkpoint stores for one logical weight [out, in]: the stored tensor (`stored`:
    its name and shape; packed formats store another shape) and the companions beside it (`companions`:
    scales, zero points), each with its shape, so the checkpoint check names a missing or mis-shaped one
    before anything loads;
  - their safetensors dtypes (`dtypes`, per stored tensor then per companion);
  - `dequantize(stored, *companions) -> fp32 [out, in]`: the exact value the weight stands for. This
    module is the one home of every format's arithmetic; the NumPy engine (the reference) uses it, and
    each backend owns how it multiplies by such a weight (backends/cuda/formats.py: per format, how it
    uploads and which kernel multiplies).

Which params of a checkpoint are in which format is the checkpoint's `quantization_config` (config.json):
its `quant_method` names a registered `QuantMethod`, whose `format_of(config, param)` gives each param's
format (or None: left dense, as `modules_to_not_convert` does). An unknown quant_method is refused with
the field named. The loader (models/weights.py) and the tensor-parallel sharding table know no format.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any, Callable

from .spec import Tensor

if TYPE_CHECKING:
    import numpy as np

    from .spec import ModelDefinition, Param

DENSE_DTYPES = ("BF16", "F16", "F32")  # what a param with no format may be stored as


@dataclass(frozen=True)
class WeightFormat:
    name: str
    companions: Callable[[Tensor], tuple[Tensor, ...]]  # the tensors stored beside weight t (scales, ...)
    dtypes: tuple[tuple[str, ...], ...]  # allowed dtypes: of the stored tensor, then of each companion
    dequantize: Callable[..., np.ndarray]  # (stored, *companions) -> fp32 [out, in]
    stored: Callable[[Tensor], Tensor] = lambda t: t  # the stored tensor of logical weight t (packed: other shape)
    # input_quant(x, *companions) -> x': the activations as the checkpoint's scheme says an engine quantizes them
    # before multiplying (FP8 W8A8: e4m3 with dynamic per-token group scales, or the static input scale), as
    # fp32 values; None: the scheme keeps activations unquantized (weight-only). `--activation-quant emulate`.
    input_quant: Callable[..., np.ndarray] | None = None
    input_quant_doc: str = ""  # what input_quant does, in a few words (inspect, dumps' metadata)
    # row_slices: dequantize also takes the stored tensors cut to a range of weight rows (companions with a row per
    # weight row cut alike, one per params["block"][0] rows cut to their blocks, 0-d / [1] ones whole), so the
    # NumPy engine can keep the stored bytes and dequantize a block of rows inside each product
    row_slices: bool = False
    # check(*stored tensors): raise CheckpointError when the tensors' values contradict each other (a packed
    # weight's weight_shape); run once on the whole tensors by a backend that keeps them (dequantize checks too)
    check: Callable[..., None] | None = None
    # draw(rng, i, shape, logical) -> stored tensor i (shape `shape`; 0: the stored weight, then the companions) of
    # a random weight of logical shape [..., out, fan_in] whose values are about N(0, 1 / fan_in) (presets' random
    # weights); None: e4m3 or float scales by dtype (random_weights.py)
    draw: Callable[[Any, int, tuple[int, ...], tuple[int, ...]], np.ndarray] | None = None
    kind: str = ""  # the family of formats this one belongs to ("fp8_block": every block size); "": none
    params: dict[str, Any] = field(default_factory=dict, compare=False)  # the family's parameters (block size)

    @property
    def family(self) -> str:
        """What a backend registers its implementation under: the kind, else the format's own name."""
        return self.kind or self.name

    def tensors(self, t: Tensor) -> tuple[Tensor, ...]:
        """Everything the checkpoint stores for logical weight t: the stored tensor, then its companions."""
        return (self.stored(t),) + self.companions(t)


class QuantConfigError(Exception):
    """A quantization_config field metrale does not implement (or a malformed one); config.py names the file."""

    def __init__(self, field: str, value: Any, why: str) -> None:
        super().__init__(f"quantization_config.{field} {value!r} {why}")


@dataclass(frozen=True)
class QuantMethod:
    """A `quantization_config.quant_method`: which format each param of a definition is stored in
    (`format_of(config, param)`, None: left dense), after `check(config)` has refused what it does not
    implement (raising QuantConfigError)."""

    name: str
    format_of: Callable[[dict[str, Any], Param], str | None]
    check: Callable[[dict[str, Any]], None] = lambda qc: None


_FORMATS: dict[str, WeightFormat] = {}
_METHODS: dict[str, QuantMethod] = {}
BUILTIN = "metrale_cli.models.quantized"  # the built-in formats, imported on the first lookup


def _builtins() -> None:
    importlib.import_module(BUILTIN)


def register_format(fmt: WeightFormat) -> WeightFormat:
    _FORMATS[fmt.name] = fmt
    return fmt


def register_quant_method(method: QuantMethod) -> QuantMethod:
    _METHODS[method.name] = method
    return method


def weight_format(name: str) -> WeightFormat:
    if name not in _FORMATS:
        _builtins()
    if name not in _FORMATS:
        raise KeyError(f"no weight format '{name}' is registered (known: {', '.join(sorted(_FORMATS))})")
    return _FORMATS[name]


def quant_method(name: str) -> QuantMethod | None:
    if name not in _METHODS:
        _builtins()
    return _METHODS.get(name)


def known_quant_methods() -> list[str]:
    _builtins()
    return sorted(_METHODS)


def stored_tensors(p: Param) -> list[Tensor]:
    """What the checkpoint holds for param p: its parts as they are, or each part's stored tensors."""
    if p.format is None:
        return [Tensor(t.name, t.shape[:-2] + t.shape[:-3:-1]) for t in p.parts] if p.transposed else list(p.parts)
    fmt = weight_format(p.format)
    return [s for t in p.parts for s in fmt.tensors(t)]


def allowed_dtypes(p: Param) -> dict[str, tuple[str, ...]]:
    """Checkpoint tensor name -> the dtypes it may be stored as, for every tensor of param p."""
    if p.format is None:
        return {t.name: DENSE_DTYPES for t in stored_tensors(p)}
    fmt = weight_format(p.format)
    return {s.name: dtypes for t in p.parts for s, dtypes in zip(fmt.tensors(t), fmt.dtypes)}


def stored_nbytes(p: Param) -> int:
    """The bytes the checkpoint stores for param p in its (first allowed) dtypes: what a backend that keeps the
    format reads (a dense param: 2 bytes an element, as bf16)."""
    from math import prod

    from ..safetensors_file import DTYPES

    if p.format is None:
        return 2 * sum(prod(t.shape) for t in p.parts)
    fmt = weight_format(p.format)
    return sum(prod(s.shape) * DTYPES[d[0]][0] // 8 for t in p.parts for s, d in zip(fmt.tensors(t), fmt.dtypes))


def apply(definition: ModelDefinition, quantization: dict[str, Any] | None) -> ModelDefinition:
    """The definition with each param's format set by the quantization config (unchanged without one)."""
    if not quantization:
        return definition
    method = _METHODS[quantization["quant_method"]]

    def formatted(params: tuple[Param, ...]) -> tuple[Param, ...]:
        return tuple(replace(p, format=method.format_of(quantization, p)) for p in params)

    layers = tuple(replace(layer, params=formatted(layer.params)) for layer in definition.layers)
    lm_head = None if definition.lm_head is None else formatted((definition.lm_head,))[0]
    return replace(definition, layers=layers, lm_head=lm_head)


def check_stored(p: Param, read: Callable[[str], Any]) -> None:
    """The format's check of each part's stored tensors (a backend keeping them as stored calls it at load)."""
    from ..errors import CheckpointError

    fmt = weight_format(p.format)
    if fmt.check is None:
        return
    for t in p.parts:
        try:
            fmt.check(*(read(s.name) for s in fmt.tensors(t)))
        except CheckpointError as e:
            raise CheckpointError(f"{t.name} ({p.format}): {e}") from None


def dequantize(p: Param, read: Callable[[str], Any]) -> list[np.ndarray]:
    """Each part of param p (stored in a weight format: p.format is set) as its exact fp32 value [rows, ...],
    from `read(name)` (the stored arrays, BF16 as uint16 bits). Dense params are the loader's `read`'s."""
    from ..errors import CheckpointError

    fmt = weight_format(p.format)
    out = []
    for t in p.parts:
        try:
            out.append(fmt.dequantize(*(read(s.name) for s in fmt.tensors(t))))
        except CheckpointError as e:  # a stored value that contradicts the tensors' shapes: name the weight
            raise CheckpointError(f"{t.name} ({p.format}): {e}") from None
    return out
