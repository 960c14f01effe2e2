"""Other engines' dumps for `metrale compare`: each format in its own module, chosen by `--from` or by
content, and turned into what compare reads (a logits `Matrix` or a `LayerDump` named by metrale's taps;
llama.cpp's printed statistics stay an `llamacpp.EvalCallback`, for compare_stats).

    vllm         intermediate tensor logging: a run folder of step_N/<module>/outputs_<device>.pt (vllm.py)
    sglang       --debug-tensor-dump-output-folder: TP{t}_PP{p}_Rank{r}/PassNNNNN.pt dicts; or the
                 dumper's one file per tensor (sglang.py)
    trtllm       run.py --output_logits_npy (a [batch, beams, steps, vocab] .npy of batch 1, beam 1), or a
                 folder of per-op .pt files (each file a tensor named by its stem, or a dict)
    torch        a .pt file (a tensor: logits rows; a dict, nested: one tap per tensor) or a folder of them
                 (a file holding one tensor names it by its stem; a dict's tensors keep their keys)
    llamacpp     llama-eval-callback's printed output (a text file: each node's edge values and sum, for a
                 statistics comparison), or llama-debug --save-logits' llamacpp-<model>.bin (or its folder)
    npy, safetensors, bin   as compare_inputs reads them

Several TP ranks: vLLM's devices (cuda_0, cuda_1) and SGLang's rank folders are found in the folder given;
`--tp-dirs D0,D1,...` names one folder per rank instead. Shards join as names.py says. SGLang's pipeline
stages (PP0, PP1, ...) each hold their own layers: their tensors are put together per step. Steps (vLLM's
step_N, SGLang's passes) are concatenated in order: rows of a prefill, then one per decode step, at the
positions the dump records (else counted from 0: one sequence). Every .pt is read by torch_pickle (no
torch, no code from the file run).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from ..errors import InputError, UsageError
from ..layer_dumps import LayerDump, forward_order
from . import llamacpp, sglang, torch_pickle, vllm
from .names import LOGITS, Config, Raw, Rule, load_map, resolve

FORMATS = ("vllm", "sglang", "trtllm", "torch", "npy", "safetensors", "bin", "llamacpp")
FILE_FORMATS = {"npy": (".npy",), "safetensors": (".safetensors",), "bin": (".bin",)}


@dataclass
class LogitsRows:
    """Logits an engine saved as such (a .pt tensor, llama-debug's .bin): for compare_inputs' Matrix."""

    values: np.ndarray
    dtype: str  # f32 | f16 | bf16 | f64 | ...
    source: str
    positions: list[int] | None = None
    tokens: list[int] | None = None
    path: Path | None = None


def is_engine_input(path: Path, fmt: str | None) -> bool:
    """Whether this package reads path (else compare_inputs' own readers do)."""
    if fmt in FILE_FORMATS:
        return False
    if fmt is not None:
        return True
    if path.is_dir() or path.suffix.lower() == ".pt" or path.name.startswith("llamacpp-"):
        return True
    return path.suffix.lower() in (".txt", ".log") and llamacpp.is_eval_callback(path)


def read_engine(path: str | Path, label: str, fmt: str | None, *, map_file: str | None = None,
                model: str | None = None, tp_dirs: list[str] | None = None) -> Any:
    """Side `label` of a comparison from an engine's dump: a LayerDump; LogitsRows for saved logits; an
    llamacpp.EvalCallback (statistics); None for a file compare_inputs reads itself (TensorRT-LLM's .npy)."""
    p = Path(path)
    where = f"{label}: {p}"
    if fmt == "llamacpp" or (fmt is None and (p.name.startswith("llamacpp-") or (p.is_dir() and any(
            p.glob("llamacpp-*.bin")))) or (fmt is None and p.is_file() and llamacpp.is_eval_callback(p))):
        return _llamacpp(p, where)
    if fmt is not None and fmt not in FORMATS:
        raise UsageError(f"--from takes {', '.join(FORMATS)}, got {fmt!r}")
    rules: list[Rule] = load_map(map_file) if map_file else []
    config = Config.read(model)
    dirs = [Path(d) for d in tp_dirs] if tp_dirs else [p]
    for d in dirs:
        if not d.exists():
            raise InputError(f"{label}: {d}: no such file or folder")
    if fmt == "trtllm" and p.is_file() and p.suffix.lower() == ".npy":
        return None  # compare_inputs reads the logits .npy
    if p.is_file():
        if len(dirs) > 1:
            raise UsageError("--tp-dirs names folders, one per TP rank")
        return _from_file(p, label, where, rules)
    kind, steps = _read_dirs(dirs, fmt, where)
    builtin = kind in ("vllm", "sglang")
    source = {"vllm": "vLLM intermediate logging", "sglang": "SGLang tensor dump",
              "sglang-dumper": "SGLang dumper files", "torch": ".pt files"}[kind]
    if len(steps[0].tensors) and max(len(v) for v in steps[0].tensors.values()) > 1:
        source += f", {max(len(v) for v in steps[0].tensors.values())} TP ranks"
    return assemble(steps, p, where, source, rules, builtin, config)


def _llamacpp(p: Path, where: str) -> Any:
    if p.is_file() and llamacpp.is_eval_callback(p):
        return llamacpp.read_eval_callback(p, where)
    if llamacpp.debug_files(p) is None:
        raise InputError(f"{where}: neither llama-eval-callback output (a text file of common_debug_cb_eval "
                         "lines) nor llama-debug --save-logits output (llamacpp-<model>.bin)")
    values, tokens, logits_path = llamacpp.read_debug_logits(p, where)
    positions = [len(tokens) - 1] if tokens else None
    return LogitsRows(values, "f32", "llama-debug --save-logits", positions, tokens, logits_path)


def _read_dirs(dirs: list[Path], fmt: str | None, where: str) -> tuple[str, list[Raw]]:
    per_dir = []
    kinds = set()
    for d in dirs:
        kind, steps = _read_dir(d, fmt, where)
        kinds.add(kind)
        per_dir.append(steps)
    if len(per_dir) == 1:
        return kinds.pop(), per_dir[0]
    return kinds.pop(), _merge_ranks(per_dir, where)


def _read_dir(d: Path, fmt: str | None, where: str) -> tuple[str, list[Raw]]:
    if fmt in (None, "vllm") and vllm.is_run(d):
        return "vllm", vllm.read(d, where)
    if fmt in (None, "sglang"):
        stages = sglang.stage_dirs(d)
        if stages:
            per_stage = [_merge_ranks([sglang.read_passes(r, where) for r in ranks], where) for ranks in stages]
            return "sglang", per_stage[0] if len(per_stage) == 1 else _merge_stages(per_stage, where)
        if sglang.is_pass_dir(d):
            return "sglang", sglang.read_passes(d, where)
        if sglang.is_dumper_dir(d):
            return "sglang-dumper", sglang.read_dumper(d, where)
    if fmt in (None, "torch", "trtllm") and any(f.suffix == ".pt" for f in d.iterdir()):
        tensors: dict[str, list[np.ndarray]] = {}
        for f in sorted(d.iterdir()):
            if f.suffix == ".pt":
                obj = torch_pickle.load(f, f"{where}: {f.name}")
                # a lone tensor is named by its file; a dict's tensors by their keys
                prefix = f.stem if not isinstance(obj, dict) else ""
                tensors.update({k: [v.array] for k, v in sglang.flatten(obj, prefix).items()})
        return "torch", [Raw(tensors)]
    what = f"a {fmt} dump" if fmt else "a dump metrale reads"
    raise InputError(f"{where}: not {what} (vLLM step_N folders, SGLang TP*_PP*_Rank* or Pass*.pt, "
                     "SGLang dumper files, or .pt files)")


def _merge_ranks(per_rank: list[list[Raw]], where: str) -> list[Raw]:
    """Step k of every rank joined: each tensor's rank list, in rank order."""
    counts = {len(steps) for steps in per_rank}
    if len(counts) != 1:
        raise InputError(f"{where}: the TP ranks hold different numbers of steps ({sorted(counts)})")
    merged = []
    for k in range(counts.pop()):
        steps = [r[k] for r in per_rank]
        names = [n for n in steps[0].tensors if all(n in s.tensors for s in steps)]
        merged.append(Raw({n: [a for s in steps for a in s.tensors[n]] for n in names},
                          steps[0].positions, steps[0].tokens))
    return merged


def _merge_stages(per_stage: list[list[Raw]], where: str) -> list[Raw]:
    """Step k of every pipeline stage joined: each stage holds its own layers; a tensor in two stages is
    ambiguous, and the token ids and positions must agree where stages carry them."""
    counts = {len(steps) for steps in per_stage}
    if len(counts) != 1:
        raise InputError(f"{where}: the pipeline stages hold different numbers of steps ({sorted(counts)})")
    merged = []
    for k in range(counts.pop()):
        tensors: dict[str, list[np.ndarray]] = {}
        positions = tokens = None
        for stage, raw in enumerate(s[k] for s in per_stage):
            twice = sorted(set(tensors) & set(raw.tensors))
            if twice:
                raise InputError(f"{where}: {twice[0]} is in two pipeline stages (step {k})")
            tensors.update(raw.tensors)
            for seen, now, what in ((positions, raw.positions, "positions"), (tokens, raw.tokens, "token ids")):
                if seen is not None and now is not None and seen != now:
                    raise InputError(f"{where}: pipeline stages 0 and {stage} ran different {what} in step {k}")
            positions = positions if positions is not None else raw.positions
            tokens = tokens if tokens is not None else raw.tokens
        merged.append(Raw(tensors, positions, tokens))
    return merged


def _from_file(p: Path, label: str, where: str, rules: list[Rule]) -> Any:
    obj = torch_pickle.load(p, where)
    if isinstance(obj, torch_pickle.Tensor):  # one tensor: logits rows
        return LogitsRows(obj.array, obj.dtype_name, "PyTorch tensor (.pt)", path=p)
    flat = sglang.flatten(obj)
    if not flat:
        raise InputError(f"{where}: holds no tensors")
    modules = any(k.startswith("model.layers.") for k in flat)
    return assemble([Raw({k: [v.array] for k, v in flat.items()})], p, where, "PyTorch dict (.pt)", rules,
                    modules, Config())


def assemble(steps: list[Raw], p: Path, where: str, source: str, rules: list[Rule], builtin: bool,
             config: Config) -> LayerDump:
    """The steps' taps concatenated by rows, at their positions; logits kept aside in the metadata."""
    per_step: list[dict[str, np.ndarray]] = []
    positions: list[int] = []
    tokens: list[int] = []
    logits: list[np.ndarray] = []
    logits_pos: list[int] = []
    notes: list[str] = []
    cursor = 0
    for k, raw in enumerate(steps):
        res = resolve(raw, rules, builtin, config, where)
        notes += [n for n in res.notes if n not in notes]
        taps = {n: a for n, a in res.taps.items() if a.shape[0] > 0}
        if not taps and res.logits is None:
            continue
        rows = _step_rows(taps, raw, where, notes, k)
        taps = {n: a for n, a in taps.items() if a.shape[0] == rows}
        if raw.positions is not None and len(raw.positions) >= rows:
            pos = raw.positions[len(raw.positions) - rows:]  # fewer rows: the last ones (a last-token-only dump)
        else:
            pos = list(range(cursor, cursor + rows))
        cursor = (max(pos) + 1) if pos else cursor
        positions += pos
        if raw.tokens is not None and len(raw.tokens) == rows:
            tokens += raw.tokens
        if res.logits is not None:
            lg = np.asarray(res.logits, dtype=np.float32).reshape(-1, res.logits.shape[-1])
            logits.append(lg)
            logits_pos += pos[-lg.shape[0]:] if len(pos) >= lg.shape[0] else list(range(lg.shape[0]))
        per_step.append(taps)
    if not per_step:
        raise InputError(f"{where}: holds no tensors to compare")
    names = [n for n in per_step[0] if all(n in s for s in per_step)]
    dropped = sorted({n for s in per_step for n in s} - set(names))
    if dropped:
        notes.append(f"not in every step, left out: {', '.join(dropped[:6])}{' ...' if len(dropped) > 6 else ''}")
    tensors = {}
    for n in forward_order(names):
        widths = {s[n].shape[1] for s in per_step}
        if len(widths) > 1:
            raise InputError(f"{where}: {n} changes width between steps ({sorted(widths)})")
        tensors[n] = np.concatenate([s[n] for s in per_step], axis=0)
    meta: dict[str, Any] = {"notes": notes}
    if logits:
        meta[LOGITS] = np.concatenate(logits, axis=0)
        meta["logits_positions"] = logits_pos
    ok_tokens = tokens if len(tokens) == len(positions) and positions == list(range(len(positions))) else None
    return LayerDump(p, tensors, positions, ok_tokens, meta, source)


def _step_rows(taps: dict[str, np.ndarray], raw: Raw, where: str, notes: list[str], k: int) -> int:
    """The step's row count: the most common first dimension (its positions' length on a tie)."""
    counts: dict[int, int] = {}
    for a in taps.values():
        counts[a.shape[0]] = counts.get(a.shape[0], 0) + 1
    if not counts:
        return 0
    full = len(raw.positions) if raw.positions is not None else -1
    rows = max(counts, key=lambda r: (counts[r], r == full, r))
    odd = [n for n, a in taps.items() if a.shape[0] != rows]
    if odd:
        notes.append(f"step {k}: {', '.join(odd[:4])} hold other than {rows} rows, left out")
    return rows
