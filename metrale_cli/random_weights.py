"""Random weights for a config, drawn on demand: a stand-in for a Checkpoint in benchmarks and tests.

Scales keep activations in a sane range at any depth (Linear weights N(0, 1/fan_in), norms near 1), so
timings run on realistic numbers, never on zeros. On the GPU the weights are drawn directly on the device
(`device_array`), so an 8B-parameter preset needs no 16 GB file.
"""

from __future__ import annotations

import zlib
from pathlib import Path

import numpy as np

from .config import ModelConfig
from .logits import fp32_to_bf16, fp32_to_bf16_bits
from .models.weights import expected_tensors
from .safetensors_file import TensorInfo


class RandomTensors:
    """A WeightSource (models/weights.py) whose tensors are made from the model definition."""

    made_from_definition = True  # right by construction: no checkpoint check
    draws_on_device = True

    def __init__(self, cfg: ModelConfig, seed: int = 0) -> None:
        self.cfg = cfg
        self.seed = seed
        self.shapes = expected_tensors(cfg.definition)
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
        return TensorInfo(name, "BF16", shape, 0, 2 * int(np.prod(shape)))

    @property
    def total_bytes(self) -> int:
        return sum(2 * int(np.prod(s)) for s in self.shapes.values())

    def array(self, name: str, *, bf16_bits: bool = False) -> np.ndarray:
        """bf16 (uint16 bit patterns with bf16_bits, as Checkpoint.array gives them)."""
        rng = np.random.default_rng([self.seed, zlib.crc32(name.encode())])
        shape = self.shapes[name]
        mean, std = self._moments(name, shape, self.norm_mean)
        values = rng.standard_normal(shape, dtype=np.float32) * std + mean
        return fp32_to_bf16_bits(values) if bf16_bits else fp32_to_bf16(values)

    def device_array(self, name: str, cp):
        """The same distribution drawn on the device (not the same numbers as `array`), as float32;
        the CUDA loader rounds it to bf16 on the device."""
        shape = self.shapes[name]
        mean, std = self._moments(name, shape, self.norm_mean)
        rs = cp.random.RandomState(self.seed * 1000003 + zlib.crc32(name.encode()))
        return rs.standard_normal(shape, dtype=cp.float32) * cp.float32(std) + cp.float32(mean)

    def release(self, name: str) -> None:
        pass

    def close(self) -> None:
        pass

    def dtypes(self) -> dict[str, int]:
        return {"BF16": len(self.shapes)}

    @staticmethod
    def _moments(name: str, shape: tuple[int, ...], norm_mean: float = 1.0) -> tuple[float, float]:
        if name.endswith("norm.weight"):
            return norm_mean, 0.1
        if name.endswith("bias"):
            return 0.0, 0.1
        if "embed_tokens" in name:
            return 0.0, 1.0
        return 0.0, float(shape[-1]) ** -0.5
