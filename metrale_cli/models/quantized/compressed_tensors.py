"""compressed-tensors checkpoints (llm-compressor's output): `quantization_config.quant_method == "compressed-tensors"`.

The config, as the compressed-tensors package reads it:
  - `config_groups`: {name: scheme}; a scheme has `targets` (module class names, of which metrale matches
    "Linear", exact module names, or "re:" regexes matched from the start of the name), `weights` (num_bits,
    type int | float, strategy tensor | channel | group | block, group_size, block_structure, symmetric),
    `input_activations` and a `format` (else the config's global `format`);
  - `ignore`: modules left dense (exact names or "re:" regexes; a parent's name does not cover its children);
  - a module matching several groups takes the first of its matching targets ordered exact names, then
    regexes (alphabetically), then class names, the later group winning a target two groups share.

Formats, per logical weight `<module>.weight` [out, in] (the value is computed in fp32 as the package does):
  - float-quantized / naive-quantized FP8: `weight` F8_E4M3, `weight_scale` [1] (tensor), [out, 1]
    (channel), [out, in / g] (group) or [ceil(out / bn), ceil(in / bk)] (block, partial edge blocks); value
    = e4m3 * scale, exact in fp32;
  - int-quantized / naive-quantized int8: `weight` I8, the same scales, `weight_zero_point` I8 (same shape)
    when asymmetric; value = (q - zero_point) * scale;
  - pack-quantized (W4A16, W8A16): `weight_packed` I32 [out, ceil(in * bits / 32)], the bits of a row's values
    one after the other from bit 0 of its first word, each stored as q + 2^(bits - 1); `weight_shape` [2] (the
    logical [out, in]); `weight_zero_point` I32 [ceil(out * bits / 32), groups] when asymmetric, packed the
    same way down the output axis; value = (q - zero_point) * scale;
  - nvfp4-pack-quantized: `weight_packed` U8 [out, in / 2] (two e2m1 a byte, the low nibble first),
    `weight_scale` F8_E4M3 [out, in / 16], `weight_global_scale` F32 [1]; the global scale DIVIDES: value =
    e2m1 * fp32(scale / global_scale) (the package's order; it then rounds to its working dtype, bf16 by
    default, which metrale does not);
  - static activation scales beside a weight: `input_scale` [1] (FP8 / int8 tensor-wise) or
    `input_global_scale` [1] (NVFP4 W4A4); read by `--activation-quant emulate`, not by the weight's value.
`input_activations` (ACTIVATIONS below): FP8 dynamic per token or group, FP8 / int8 static per tensor, int8
dynamic per token, NVFP4 dynamic local are emulated; any other scheme loads and is refused by emulate.
Everything else (kv_cache_scheme, transforms, sparsity, output activations, other bit widths and formats) is
refused by field name.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

import numpy as np

from ...errors import CheckpointError
from ..formats import QuantMethod, WeightFormat, register_format, register_quant_method, weight_format
from ..spec import Tensor
from . import activations, e4m3_as_fp32, linear_weight, module_of, refuse, scale_as_fp32
from .mxfp4 import E2M1

SCALE_DTYPES = ("F32", "BF16", "F16")
FLOAT_FORMATS = ("float-quantized", "naive-quantized")
INT_FORMATS = ("int-quantized", "naive-quantized")
FORMATS = FLOAT_FORMATS + INT_FORMATS + ("pack-quantized", "nvfp4-pack-quantized", "mixed-precision")
PACK_BITS = (4, 8)
NVFP4_GROUP = activations.NVFP4_GROUP
ARG_FIELDS = {"num_bits", "type", "symmetric", "group_size", "strategy", "block_structure", "dynamic", "actorder",
              "scale_dtype", "zp_dtype", "observer", "observer_kwargs"}


@dataclass(frozen=True)
class Scheme:
    """What one group stores for a weight: the kind (fp8, int8, pack, nvfp4) and its parameters."""

    kind: str
    strategy: str = "tensor"
    bits: int = 8
    group: int = 0  # values per scale along the input axis (group strategy)
    block: tuple[int, int] = (0, 0)  # block strategy
    asym: bool = False  # a zero point beside the scale
    static_input: str = ""  # the activation scale tensor stored beside the weight ("input_scale", ...)
    inputs: str = ""  # how the input activations are quantized (ACTIVATIONS' keys; "": they are not)
    input_group: int = 0  # values per dynamic scale along the input (inputs "fp8_group")

    @property
    def name(self) -> str:
        how = {"group": f"group{self.group}", "block": f"block{self.block[0]}x{self.block[1]}"}.get(
            self.strategy, self.strategy)
        kind = f"pack{self.bits}" if self.kind == "pack" else self.kind
        implied = {"", "nvfp4", "fp8_static" if self.kind == "fp8" else "int8_static"}  # by the weights and scales
        inputs = [] if self.inputs in implied else [
            "a" + re.sub(r"\W+", "", self.inputs.replace("_group", f"_group{self.input_group}"))]
        return "_".join(["ct", kind] + ([] if self.kind == "nvfp4" else [how]) + (["asym"] if self.asym else [])
                        + ([self.static_input] if self.static_input else []) + inputs)


def _scale_shape(s: Scheme, out: int, cols: int) -> tuple[int, ...]:
    if s.strategy == "tensor":
        return (1,)
    if s.strategy == "channel":
        return (out, 1)
    if s.strategy == "group":
        return (out, cols // s.group)
    return (-(-out // s.block[0]), -(-cols // s.block[1]))


def _expand(scale: np.ndarray, s: Scheme, shape: tuple[int, int]) -> np.ndarray:
    """A scale (or zero point) per tensor / row / group / block, repeated to the weight's shape."""
    out, cols = shape
    if s.strategy in ("tensor", "channel"):
        return np.broadcast_to(scale.reshape(-1, 1), shape) if s.strategy == "channel" else scale.reshape(())
    if s.strategy == "group":
        return np.repeat(scale, s.group, axis=1)
    return np.repeat(np.repeat(scale, s.block[0], axis=0)[:out], s.block[1], axis=1)[:, :cols]


def unpack_int32(words: np.ndarray, bits: int, count: int) -> np.ndarray:
    """Rows of `count` signed values from rows of I32 words (value i at bit i * bits, stored + 2^(bits - 1))."""
    per = 32 // bits
    u = np.ascontiguousarray(words).view(np.uint32)
    shifts = np.arange(per, dtype=np.uint32) * np.uint32(bits)
    values = (u[..., None] >> shifts) & np.uint32((1 << bits) - 1)
    values = values.reshape(*u.shape[:-1], -1)[..., :count]
    return values.astype(np.int32) - (1 << (bits - 1))


def nvfp4_values(packed: np.ndarray) -> np.ndarray:
    """fp32 [..., 2n] e2m1 values from U8 [..., n] (two a byte, the low nibble first; bit 3 the sign)."""
    b = np.asarray(packed, np.uint8)
    out = np.empty(b.shape[:-1] + (2 * b.shape[-1],), np.float32)
    out[..., 0::2] = E2M1[b & 0x0F]
    out[..., 1::2] = E2M1[b >> 4]
    return out


def nvfp4_block_scales(scale: np.ndarray, global_scale: np.ndarray) -> np.ndarray:
    """fp32 [out, in / 16]: each NVFP4 block's scale, fp32(weight_scale) / weight_global_scale."""
    return e4m3_as_fp32(scale) / scale_as_fp32(global_scale).reshape(())


def _check_shape(shape: np.ndarray, packed: np.ndarray, s: Scheme) -> None:
    """weight_shape against the whole packed tensor: its rows too."""
    if int(np.asarray(shape).reshape(-1)[0]) != packed.shape[0]:
        raise CheckpointError(f"weight_shape {[int(v) for v in np.asarray(shape).reshape(-1)]} does not match its "
                              f"weight_packed {list(packed.shape)} ({s.bits}-bit values)")
    _logical_cols(shape, packed, s)


def pack_scale_grid(scale: np.ndarray, params: dict, cols: int) -> tuple[np.ndarray, int]:
    """(fp32 [rows, groups] scales, columns a scale covers) of a symmetric pack-quantized weight (format params:
    strategy, group): what its dequantization repeats over the columns."""
    grid = scale_as_fp32(scale)
    if params["strategy"] == "group":
        return grid.reshape(grid.shape[0], -1), params["group"]
    return grid.reshape(-1, 1), cols  # channel: one per row; tensor: one (broadcast over the rows by the caller)


def _dequantizer(s: Scheme):
    def fp8(w, scale, *_):
        return e4m3_as_fp32(w) * _expand(scale_as_fp32(scale), s, w.shape)

    def int8(w, scale, *rest):
        q = np.asarray(w, np.int8).astype(np.float32)
        if s.asym:
            q -= _expand(np.asarray(rest[0], np.int8).astype(np.float32), s, q.shape)
        return q * _expand(scale_as_fp32(scale), s, q.shape)

    def pack(packed, scale, shape, *rest):
        out, cols = packed.shape[0], _logical_cols(shape, packed, s)
        q = unpack_int32(packed, s.bits, cols).astype(np.float32)
        if s.asym:
            zp = unpack_int32(np.asarray(rest[0]).T, s.bits, out).T.astype(np.float32)
            q -= _expand(zp, s, q.shape)
        return q * _expand(scale_as_fp32(scale), s, q.shape)

    def nvfp4(packed, scale, global_scale, *_):
        return nvfp4_values(packed) * np.repeat(nvfp4_block_scales(scale, global_scale), NVFP4_GROUP, axis=1)

    return {"fp8": fp8, "int8": int8, "pack": pack, "nvfp4": nvfp4}[s.kind]


def _logical_cols(shape: np.ndarray, packed: np.ndarray, s: Scheme) -> int:
    """The input width weight_shape names, checked against the packed tensor (whose shape was checked before; its
    rows may be a slice of the weight's: a symmetric scheme's weight is dequantized a block of rows at a time)."""
    stored = [int(v) for v in np.asarray(shape).reshape(-1)]
    words = packed.shape[1]
    if len(stored) != 2 or stored[0] < packed.shape[0] or -(-stored[1] * s.bits // 32) != words:
        raise CheckpointError(f"weight_shape {stored} does not match its weight_packed {list(packed.shape)} "
                              f"({s.bits}-bit values)")
    return stored[1]


def scheme_format(s: Scheme) -> str:
    """The registered format name of scheme s (registered on first use)."""
    try:
        weight_format(s.name)
    except KeyError:
        register_format(_make_format(s))
    return s.name


def _make_format(s: Scheme) -> WeightFormat:
    def base(t: Tensor) -> str:
        return t.name.removesuffix("weight")

    def stored(t: Tensor) -> Tensor:
        out, cols = t.shape
        if s.kind == "pack":
            return Tensor(t.name + "_packed", (out, -(-cols * s.bits // 32)))
        if s.kind == "nvfp4":
            return Tensor(t.name + "_packed", (out, cols // 2))
        return t

    def companions(t: Tensor) -> tuple[Tensor, ...]:
        out, cols = t.shape
        if s.kind == "nvfp4":
            scales = (Tensor(t.name + "_scale", (out, cols // NVFP4_GROUP)), Tensor(t.name + "_global_scale", (1,)))
        else:
            scales = (Tensor(t.name + "_scale", _scale_shape(s, out, cols)),)
        if s.kind == "pack":
            scales += (Tensor(t.name + "_shape", (2,)),)
        if s.asym:
            zp = _scale_shape(s, out, cols)
            if s.kind == "pack":
                zp = (-(-out * s.bits // 32), zp[1])
            scales += (Tensor(t.name + "_zero_point", zp),)
        if s.static_input:
            scales += (Tensor(base(t) + s.static_input, (1,)),)
        return scales

    dtypes: tuple[tuple[str, ...], ...] = {
        "fp8": (("F8_E4M3",), SCALE_DTYPES),
        "int8": (("I8",), SCALE_DTYPES),
        "pack": (("I32",), SCALE_DTYPES, ("I64", "I32")),
        "nvfp4": (("U8",), ("F8_E4M3",), ("F32",)),
    }[s.kind]
    if s.asym:
        dtypes += (("I32",),) if s.kind == "pack" else (("I8",),)
    if s.static_input:
        dtypes += (("F32",) if s.kind == "nvfp4" else SCALE_DTYPES,)
    params = {"strategy": s.strategy, "bits": s.bits, "group": s.group, "asym": s.asym, "static_input": s.static_input}
    if s.strategy == "block":
        params["block"] = s.block
    quant, doc = (ACTIVATIONS.get(s.inputs, (None, "not emulated: " + s.inputs.removeprefix("other:")))
                  if s.inputs else (None, ""))

    def draw(rng, i: int, shape: tuple[int, ...], logical: tuple[int, ...]) -> np.ndarray:
        """A symmetric pack-quantized weight: random words (uniform integers in [-2^(bits-1), 2^(bits-1))), float
        scales of fan_in^-0.5 / the integers' rms (within +-20%), its weight_shape: about N(0, 1 / fan_in)."""
        if i == 0:
            return rng.integers(-2**31, 2**31, shape, dtype=np.int64).astype(np.int32)
        if i == 1:
            rms = float(np.sqrt(((np.arange(1 << s.bits) - (1 << (s.bits - 1))) ** 2).mean()))
            return (logical[-1] ** -0.5 / rms * rng.uniform(0.8, 1.2, shape)).astype(np.float32)
        return np.array(logical[-2:], np.int64)

    return WeightFormat(s.name, companions=companions, dtypes=dtypes, dequantize=_dequantizer(s), stored=stored,
                        draw=draw if s.kind == "pack" and not s.asym and not s.static_input else None,
                        kind=f"ct_{s.kind}", params=params, input_quant=quant and (lambda x, *c: quant(x, s, *c)),
                        # asymmetric packed schemes pack their zero points down the rows: whole tensors only
                        row_slices=not (s.kind == "pack" and s.asym),
                        check=(lambda packed, scale, shape, *_: _check_shape(shape, packed, s)) if s.kind == "pack"
                        else None,
                        input_quant_doc=doc.format(group=s.input_group))


# ---- the input activations (activations.py), as the package's forward_quantize computes them -----------------

def _static(x: np.ndarray, quant, companions) -> np.ndarray:
    return quant(x, scale_as_fp32(companions[-1]).reshape(()))


ACTIVATIONS = {  # Scheme.inputs -> (x, scheme, *companions) -> x', and what inspect says it does
    "fp8_token": (lambda x, s, *c: activations.e4m3_groups(x, x.shape[-1]), "e4m3, dynamic scale per token"),
    "fp8_group": (lambda x, s, *c: activations.e4m3_groups(x, s.input_group),
                  "e4m3, dynamic scale per token and {group} columns"),
    "fp8_static": (lambda x, s, *c: _static(x, activations.e4m3_static, c),
                   "e4m3 with the checkpoint's static input_scale"),
    "int8_token": (lambda x, s, *c: activations.int8_per_token(x), "int8, dynamic symmetric scale per token"),
    "int8_static": (lambda x, s, *c: _static(x, activations.int8_static, c),
                    "int8 with the checkpoint's static input_scale"),
    "nvfp4": (lambda x, s, *c: _static(x, activations.nvfp4, c),
              "NVFP4: e2m1 with an e4m3 scale per 16 columns under the checkpoint's input_global_scale"),
}


# ---- the config ------------------------------------------------------------------------------------------------

def _groups(qc: dict[str, Any]) -> dict[str, dict[str, Any]]:
    groups = qc.get("config_groups")
    if not isinstance(groups, dict) or not groups:
        refuse("config_groups", groups, "must name at least one scheme")
    return groups


def _scheme(qc: dict[str, Any], name: str) -> Scheme:
    """Group `name`'s scheme, refusing by field what metrale does not implement."""
    g = qc["config_groups"][name]
    where = f"config_groups.{name}"
    if not isinstance(g, dict):
        refuse(where, g, "is a preset name with targets; metrale reads schemes written out in full")
    for key in ("output_activations",):
        if g.get(key) is not None:
            refuse(f"{where}.{key}", g[key], "is not implemented")
    fmt = g.get("format") or qc.get("format")
    if fmt not in FORMATS or fmt == "mixed-precision":
        refuse(f"{where}.format" if g.get("format") else "format", fmt,
               f"is not a format metrale reads ({', '.join(f for f in FORMATS if f != 'mixed-precision')})")
    w = g.get("weights")
    if not isinstance(w, dict):
        refuse(f"{where}.weights", w, "is not implemented (activation-only quantization)")
    extra = sorted(set(w) - ARG_FIELDS)
    if extra:
        refuse(f"{where}.weights.{extra[0]}", w[extra[0]], "is not a field metrale knows")
    bits, kind_type = w.get("num_bits", 8), str(w.get("type", "int")).lower()
    strategy = w.get("strategy") or ("tensor" if w.get("group_size") is None
                                     else "channel" if w.get("group_size") == -1 else "group")
    asym = not w.get("symmetric", True)
    if w.get("dynamic", False) is not False:
        refuse(f"{where}.weights.dynamic", w.get("dynamic"), "is not implemented (weights quantized on the fly)")
    if w.get("actorder") not in (None, "weight", "static"):
        refuse(f"{where}.weights.actorder", w.get("actorder"), "is not implemented (a g_idx reordering)")
    group = int(w.get("group_size") or 0)
    block = tuple(w.get("block_structure") or (0, 0))
    if strategy == "group" and group <= 0:
        refuse(f"{where}.weights.group_size", w.get("group_size"), "must be positive for strategy group")
    if strategy == "block" and (len(block) != 2 or not all(isinstance(b, int) and b > 0 for b in block)):
        refuse(f"{where}.weights.block_structure", w.get("block_structure"), "must be two positive integers")
    field = f"{where}.weights"

    if fmt == "nvfp4-pack-quantized":
        if (kind_type, bits, strategy, group) != ("float", 4, "tensor_group", NVFP4_GROUP) or asym:
            refuse(field, _brief(w), "is not NVFP4 (float 4-bit, symmetric, tensor_group of 16)")
        if w.get("scale_dtype") not in (None, "torch.float8_e4m3fn", "float8_e4m3fn"):
            refuse(f"{field}.scale_dtype", w.get("scale_dtype"), "is not float8_e4m3fn")
        kind = "nvfp4"
    elif fmt == "pack-quantized":
        if kind_type != "int" or bits not in PACK_BITS:
            refuse(field, _brief(w), f"is not implemented for pack-quantized (int {' or '.join(map(str, PACK_BITS))}-bit)")
        if strategy not in ("channel", "group") and not (strategy == "tensor" and not asym):
            refuse(f"{field}.strategy", strategy, "is not implemented for pack-quantized (channel, group, symmetric tensor)")
        kind = "pack"
    elif kind_type == "float" and fmt in FLOAT_FORMATS:
        if bits != 8 or asym:
            refuse(field, _brief(w), "is not implemented (float weights: symmetric FP8 e4m3)")
        if strategy not in ("tensor", "channel", "block"):
            refuse(f"{field}.strategy", strategy, "is not implemented for FP8 weights (tensor, channel, block)")
        kind = "fp8"
    elif kind_type == "int" and fmt in INT_FORMATS:
        if bits != 8:
            refuse(field, _brief(w), "is not implemented (int-quantized weights: int8)")
        if strategy not in ("tensor", "channel", "group"):
            refuse(f"{field}.strategy", strategy, "is not implemented for int8 weights (tensor, channel, group)")
        kind = "int8"
    else:
        refuse(field, _brief(w), f"cannot be stored as {fmt}")
    static, inputs, input_group = _inputs(g.get("input_activations"), kind, where)
    return Scheme(kind, strategy, bits, group if strategy in ("group", "tensor_group") else 0,
                  block if strategy == "block" else (0, 0), asym, static, inputs, input_group)


def _brief(w: dict[str, Any]) -> str:
    return f"{w.get('type', 'int')} {w.get('num_bits', 8)}-bit {w.get('strategy')}"


def _inputs(a: dict[str, Any] | None, kind: str, where: str) -> tuple[str, str, int]:
    """The input activations' scheme: (the static scale tensor stored beside each weight, "" if none; the
    ACTIVATIONS key, "" if they are not quantized; the dynamic group size), refusing what metrale does not
    emulate by field."""
    if a is None:
        return "", "", 0
    field = f"{where}.input_activations"
    if not isinstance(a, dict):
        refuse(field, a, "must be a scheme")
    extra = sorted(set(a) - ARG_FIELDS)
    if extra:
        refuse(f"{field}.{extra[0]}", a[extra[0]], "is not a field metrale knows")
    dynamic, strategy = a.get("dynamic", False), a.get("strategy", "tensor")
    bits, kind_type = a.get("num_bits", 8), str(a.get("type", "int")).lower()
    if not a.get("symmetric", True):
        refuse(f"{field}.symmetric", False, "is not implemented (asymmetric activations)")
    if kind == "nvfp4":
        if dynamic != "local" or strategy != "tensor_group" or a.get("group_size") != NVFP4_GROUP:
            refuse(field, _brief(a), "is not implemented beside NVFP4 weights (NVFP4 tensor_group, dynamic local)")
        return "input_global_scale", "nvfp4", NVFP4_GROUP
    if (kind_type, bits) == ("float", 8):
        if dynamic is False and strategy == "tensor":
            return "input_scale", "fp8_static", 0
        if dynamic is True and strategy == "token":
            return "", "fp8_token", 0
        if dynamic is True and strategy == "group" and int(a.get("group_size") or 0) > 0:
            return "", "fp8_group", int(a["group_size"])
    if (kind_type, bits, dynamic, strategy) == ("int", 8, True, "token"):
        return "", "int8_token", 0
    if (kind_type, bits, dynamic, strategy) == ("int", 8, False, "tensor"):
        return "input_scale", "int8_static", 0
    # loads (the weights do not depend on it), but --activation-quant emulate refuses it by name
    return "input_scale" if dynamic is False and strategy == "tensor" else "", "other:" + _brief(a), 0


def _matches(target: str, module: str) -> bool:
    if target.startswith("re:"):
        try:
            return re.match(target[3:], module) is not None
        except re.error as e:
            refuse("config_groups", target, f"is not a valid pattern ({e})")
    return target == module


def _is_class(target: str) -> bool:
    return not target.startswith("re:") and "." not in target and target[:1].isupper()


def _group_of(qc: dict[str, Any], module: str, linear: bool) -> str | None:
    """The config group that quantizes `module` (None: not targeted, or ignored), as compressed-tensors picks it."""
    owner: dict[str, str] = {}
    for name, g in qc["config_groups"].items():
        for target in g.get("targets", []):
            owner[target] = name
    names = sorted((t for t in owner if not _is_class(t)), key=lambda t: (t.startswith("re:"), t))
    hits = [t for t in names if _matches(t, module)] + [t for t in owner if _is_class(t) and linear and t == "Linear"]
    if not hits:
        return None
    for ign in qc.get("ignore") or ():
        if (_is_class(ign) and linear and ign == "Linear") or (not _is_class(ign) and _matches(ign, module)):
            return None
    return owner[hits[0]]


def _format_of(qc: dict[str, Any], p) -> str | None:
    linear = linear_weight(p)
    groups = [_group_of(qc, module_of(t.name), linear or p.key == "lm_head") for t in p.parts]
    if p.key == "lm_head" and groups[0] is not None:
        refuse("ignore", qc.get("ignore"), "does not name lm_head, which metrale reads dense only")
    if not linear:
        return None
    if len(set(groups)) > 1:
        refuse("config_groups", {module_of(t.name): g for t, g in zip(p.parts, groups)},
               f"quantize {p.key}'s parts differently; metrale multiplies them as one weight")
    if groups[0] is None:
        return None
    s = _scheme(qc, groups[0])
    cols = p.parts[0].shape[-1]
    step = {"group": s.group, "nvfp4": NVFP4_GROUP}.get("nvfp4" if s.kind == "nvfp4" else s.strategy, 1)
    if cols % step:
        refuse(f"config_groups.{groups[0]}.weights.group_size", step,
               f"does not divide {p.key}'s input width ({cols})")
    return scheme_format(s)


def _check(qc: dict[str, Any]) -> None:
    for key in ("kv_cache_scheme", "moe_sparsity_config"):
        if qc.get(key) is not None:
            refuse(key, qc[key], "is not implemented")
    for key in ("sparsity_config", "transform_config"):
        if qc.get(key):
            refuse(key, qc[key], "is not implemented")
    status = qc.get("quantization_status", "compressed")
    if status != "compressed":
        refuse("quantization_status", status, "is not compressed (fake-quantized dense weights are not read)")
    if qc.get("format") not in FORMATS and qc.get("format") is not None:
        refuse("format", qc.get("format"), "is not a format metrale reads")
    if not isinstance(qc.get("ignore") or [], list):
        refuse("ignore", qc.get("ignore"), "must be a list")
    for name, g in _groups(qc).items():
        _scheme(qc, name)
        targets = g.get("targets")
        if not isinstance(targets, list) or not targets:
            refuse(f"config_groups.{name}.targets", targets, "must be a non-empty list")
        for t in targets:
            if _is_class(t) and t != "Linear":
                refuse(f"config_groups.{name}.targets", t, "is a module class metrale does not match (Linear only)")


register_quant_method(QuantMethod("compressed-tensors", _format_of, check=_check))
