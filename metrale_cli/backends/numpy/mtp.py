"""A multi-token-prediction layer on the NumPy engine (models/mtp.py, engine/mtp.py): the draft of
`decode --draft mtp`."""

from __future__ import annotations

from typing import Sequence

import numpy as np

from ...engine.mtp import mtp_forward
from ...errors import InputError
from ...models.mtp import check_present, mtp_config
from .engine import NumpyEngine, NumpyPass, read_weights


class NumpyMtpEngine(NumpyEngine):
    """The MTP layer as a one-layer NumPy engine. Its cache row i holds position i + 1 (the layer first sees the
    prompt's second token, beside the main model's first hidden row); each call's token rows take their
    `previous` hidden rows, given to run()."""

    position_offset = 1
    _observer = None

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._previous = np.zeros((0, self.cfg.hidden_size), np.float32)

    def run(self, tokens: Sequence[int], previous: np.ndarray, all_logits: bool = False) -> int:
        """The MTP layer on `tokens` at the next positions, `previous` [len(tokens), H] the hidden rows at the
        positions before them; logits rows in the logits buffer as prefill writes them (the post-norm rows
        behind them in hidden_rows: the value a further draft feeds back)."""
        previous = np.asarray(previous, np.float32).reshape(-1, self.cfg.hidden_size)
        if len(previous) != len(tokens):
            raise InputError(f"the MTP layer takes one previous hidden row per token: {len(previous)} rows for "
                             f"{len(tokens)} tokens")
        self._previous = previous
        return self.prefill(tokens, all_logits)

    @property
    def tap(self):
        """The observer of the passes (engine_base.EngineBase.tap), seeing the checkpoint's names."""
        return None if self._observer is None else named_as_stored(self._observer, self.layer)

    @tap.setter
    def tap(self, observer) -> None:
        self._observer = observer

    def _run(self, ops: NumpyPass) -> np.ndarray:
        previous, self._previous = self._previous[:ops.t], self._previous[ops.t:]
        return mtp_forward(ops, self.cfg.definition, self.w, previous)

    @property
    def layer(self) -> int:
        """The MTP layer's index in the checkpoint (model.layers.{layer}.*)."""
        return int(self.cfg.definition.final_norm.parts[0].name.split(".")[2])


def named_as_stored(tap, layer: int):
    """An observer that sees engine/mtp.py's taps under the checkpoint's names: model.layers.0.* ->
    model.layers.{layer}.*, model.norm -> model.layers.{layer}.shared_head.norm (the embedding's stays)."""
    def renamed(name: str, x) -> None:
        if name == "model.norm":
            name = f"model.layers.{layer}.shared_head.norm"
        elif name == "model.layers.0" or name.startswith("model.layers.0."):
            name = f"model.layers.{layer}" + name[len("model.layers.0"):]
        tap(name, x)
    return renamed


def load_numpy_mtp(cfg, source, max_context: int, fp32_logits: bool = False, compute: str = "fp32",
                   mla: str = "naive", activation_quant: str = "none") -> NumpyMtpEngine:
    """The checkpoint's first MTP layer (models/mtp.mtp_config) on the NumPy engine, its cache sized for
    max_context positions, computing as the target engine does (compute, mla, activation_quant)."""
    check_present(cfg, source.tensor_names())
    mcfg = mtp_config(cfg)
    return NumpyMtpEngine(mcfg, read_weights(mcfg, source, compute=compute, activation_quant=activation_quant),
                          max_context, fp32_logits, compute=compute, mla=mla, activation_quant=activation_quant)
