"""Token-mixer kinds: what each kind of layer mixer computes, written once, and which module implements it
on each backend.

A layer (models/spec.LayerSpec) is a token mixer followed by an MLP. The mixer's spec names its kind
(`LayerSpec.mixer.kind`): "attention" (GQA/MQA with rope, windows, softcaps, sinks and output gates), "mla"
(DeepSeek's latent attention) and "linear_attention" (Gated DeltaNet: a conv state and a recurrent state instead
of a KV cache). A kind is one `MixerKind`:

- `forward(ops, i, layer, lw, x) -> x`: the sublayer in the order every backend runs it (its input norm,
  its projections through `ops.linear`, its own ops through `ops.mixer(i)`, its output projection added
  into the residual stream), with its taps named after the Hugging Face modules;
- `tap_names(prefix, layer)`: the taps `forward` emits for layer `prefix` = "model.layers.{i}", in order;
- `backends`: per backend name ("numpy", "cuda") its implementation, an object or the dotted path of a
  module imported on first use (so a CPU run never imports CuPy), providing
    `state(engine, layers) -> MixerState`: the cache of the engine's layers of this kind (a KV cache for
        attention, a latent cache for latent attention, recurrent + conv states for linear attention);
    `ops(pass_, state)`: the object `ops.mixer(i)` returns to `forward` during one pass.

`register_mixer` adds a kind (the built-in ones and, for instance, a test's toy kind); the engines look
kinds up by name and know none of them. docs/ADDING_AN_ARCHITECTURE.md walks through adding one.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Mapping, Protocol

from ..errors import DeviceError

if TYPE_CHECKING:
    from ..models.spec import LayerSpec
    from .ops import X, Ops


class MixerState(Protocol):
    """One kind's cache for the layers of that kind in one engine; the engine's `trim` and `reset` reach
    every kind's state through these."""

    nbytes: int

    def reset(self) -> None: ...

    def trim(self, length: int) -> None:
        """Roll back to the first `length` positions (rejected drafts), or raise InputError when this
        state cannot (a ring that overwrote them; a recurrent state with no saved copy)."""
        ...


@dataclass(frozen=True)
class MixerKind:
    name: str
    forward: Callable[[Ops, int, LayerSpec, dict[str, Any], X], X]
    tap_names: Callable[[str, LayerSpec], list[str]]
    backends: Mapping[str, Any] = field(default_factory=dict)  # backend -> implementation (or module path)

    def backend(self, name: str) -> Any:
        """This kind's implementation on backend `name`; DeviceError when that backend has none."""
        impl = self.backends.get(name)
        if impl is None:
            raise DeviceError(f"the {name} engine does not implement the '{self.name}' layer kind yet")
        return importlib.import_module(impl) if isinstance(impl, str) else impl


_KINDS: dict[str, MixerKind] = {}
# The built-in kinds, each registered by importing its module on first use (the module registers itself)
BUILTIN = {"attention": "metrale_cli.engine.attention", "mla": "metrale_cli.engine.mla",
           "linear_attention": "metrale_cli.engine.linear_attention"}


def register_mixer(kind: MixerKind) -> MixerKind:
    """Make `kind` known to every engine (a later registration of the same name replaces it)."""
    _KINDS[kind.name] = kind
    return kind


def mixer_kind(name: str) -> MixerKind:
    if name not in _KINDS and name in BUILTIN:
        importlib.import_module(BUILTIN[name])
    if name not in _KINDS:
        raise KeyError(f"no mixer kind '{name}' is registered (known: {', '.join(sorted(_KINDS))})")
    return _KINDS[name]


def kinds_of(layers: Any) -> dict[str, list[int]]:
    """{kind name: the indices of the layers whose mixer is of that kind}, in first-seen order."""
    out: dict[str, list[int]] = {}
    for i, layer in enumerate(layers):
        out.setdefault(layer.mixer.kind, []).append(i)
    return out
