"""Random weights for a config, drawn on demand: a stand-in for a Checkpoint in benchmarks and tests.

Scales keep activations in a sane range at any depth (Linear weights N(0, 1/fan_in), norms near 1), so
timings run on realistic numbers, never on zeros. On the GPU the weights are drawn directly on the device
(`device_array`), so an 8B-parameter preset needs no 16 GB file.
"""

from __future__ import annotations

import zlib
from typing import Any
from pathlib import Path

import numpy as np

from .config import ModelConfig
from .logits import fp32_to_bf16, fp32_to_bf16_bits
from .models.formats import weight_format
from .models.weights import expected_tensors
from .safetensors_file import DTYPES, TensorInfo


DRAW_ELEMENTS = 1 << 22  # values drawn at once (16 MiB of fp32): a weight's bf16 bits are filled block by block


class RandomTensors:
    """A WeightSource (models/weights.py) whose tensors are made from the model definition."""

    made_from_definition = True  # right by construction: no checkpoint check
    draws_on_device = True

    def __init__(self, cfg: ModelConfig, seed: int = 0) -> None:
        self.cfg = cfg
        self.seed = seed
        self.shapes = expected_tensors(cfg.definition)
        # Params stored in a weight format: their stored tensors in the format's first dtype, drawn by the format
        # (WeightFormat.draw) or, without one, as e4m3 weights and float scales (_formatted):
        # name -> (dtype, the logical weight's shape, the format, the tensor's index among the stored ones)
        self.formatted: dict[str, tuple[str, tuple[int, ...], Any, int]] = {}
        for p in cfg.definition.params():
            if p.format is not None:
                fmt = weight_format(p.format)
                for t in p.parts:
                    for i, (s, dtypes) in enumerate(zip(fmt.tensors(t), fmt.dtypes)):
                        self.formatted[s.name] = (dtypes[0], tuple(t.shape), fmt, i)
        # (1 + w) norms (Gemma) store w: drawn around 0, so the scale is near 1 as for the other families
        self.norm_mean = 1.0 - cfg.definition.norm.offset
        self.directory = Path(f"<random {cfg.model_type} weights, seed {seed}>")
        self.files: list[Path] = []
        self.has_tokenizer = False

    # -- the Checkpoint surface the engines use ------------------------------------------------------------
    def tensor_names(self) -> list[str]:
        return list(self.shapes)

    def info(self, name: str) -> TensorInfo:
        shape = self.shapes[name]
        dtype = self.formatted[name][0] if name in self.formatted else "BF16"
        return TensorInfo(name, dtype, shape, 0, int(np.prod(shape)) * DTYPES[dtype][0] // 8)

    @property
    def total_bytes(self) -> int:
        return sum(self.info(n).nbytes for n in self.shapes)

    def array(self, name: str, *, bf16_bits: bool = False) -> np.ndarray:
        """bf16 (uint16 bit patterns with bf16_bits, as Checkpoint.array gives them); a formatted param's
        stored tensors in their dtype."""
        rng = np.random.default_rng([self.seed, zlib.crc32(name.encode())])
        shape = self.shapes[name]
        if name in self.formatted:
            dtype, logical, fmt, i = self.formatted[name]
            if fmt.draw is not None:
                return fmt.draw(rng, i, shape, logical)
            return self._formatted(rng, shape, dtype, logical[-1])
        mean, std = self._moments(name, shape, self.norm_mean)
        if bf16_bits and len(shape) > 1:  # drawn a block of rows at a time: no fp32 copy of a large tensor
            out = np.empty(shape, np.uint16)
            step = max(1, DRAW_ELEMENTS // max(1, int(np.prod(shape[1:]))))
            for lo in range(0, shape[0], step):  # the same stream as one draw: the same numbers
                rows = (min(shape[0], lo + step) - lo,) + tuple(shape[1:])
                out[lo:lo + rows[0]] = fp32_to_bf16_bits(rng.standard_normal(rows, dtype=np.float32) * std + mean)
            return out
        values = rng.standard_normal(shape, dtype=np.float32) * std + mean
        return fp32_to_bf16_bits(values) if bf16_bits else fp32_to_bf16(values)

    def device_array(self, name: str, cp):
        """The same distribution drawn on the device (not the same numbers as `array`), as float32;
        the CUDA loader rounds it to bf16 on the device."""
        shape = self.shapes[name]
        mean, std = self._moments(name, shape, self.norm_mean)
        rs = cp.random.RandomState(self.seed * 1000003 + zlib.crc32(name.encode()))
        return rs.standard_normal(shape, dtype=cp.float32) * cp.float32(std) + cp.float32(mean)

    @staticmethod
    def _formatted(rng, shape: tuple[int, ...], dtype: str, fan_in: int) -> np.ndarray:
        """An e4m3 weight: random signs, exponents 2^-3..2^3 and mantissas (std about 5, never NaN), whose
        scales (F32/BF16: fan_in^-0.5 / 5 within +-20%) give the Linear weights' N(0, 1/fan_in) size."""
        import ml_dtypes

        if dtype == "F8_E4M3":
            b = rng.integers(0, 256, shape, dtype=np.uint8)
            exponent = (4 + (b >> 3) % 7).astype(np.uint8)  # biased 4..10: 2^-3 .. 2^3
            return ((b & 0x87) | (exponent << 3)).view(ml_dtypes.float8_e4m3fn)
        values = (fan_in ** -0.5 / 5 * rng.uniform(0.8, 1.2, shape)).astype(np.float32)
        return values if dtype == "F32" else fp32_to_bf16(values)

    def release(self, name: str) -> None:
        pass

    def close(self) -> None:
        pass

    def dtypes(self) -> dict[str, int]:
        counts: dict[str, int] = {}
        for n in self.shapes:
            counts[self.info(n).dtype] = counts.get(self.info(n).dtype, 0) + 1
        return counts

    @staticmethod
    def _moments(name: str, shape: tuple[int, ...], norm_mean: float = 1.0) -> tuple[float, float]:
        if name.endswith("norm.weight"):
            return norm_mean, 0.1
        if name.endswith("bias"):
            return 0.0, 0.1
        if "embed_tokens" in name:
            return 0.0, 1.0
        return 0.0, float(shape[-1]) ** -0.5
