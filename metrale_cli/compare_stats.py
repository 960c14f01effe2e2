"""A statistics comparison: metrale's taps (A, a layer dump, or a --dump-stats file) against a side that holds
only statistics of its tensors (B, llama.cpp's eval-callback output: each node's sum and its edge values,
the first and last 3 along each dimension, printed to 4 decimals).

What both hold is compared, with tolerances scaled to the tensor:
    sum          |Σa - Σb| <= max(rtol, n·2^-24)·Σ|a| + 5e-7 per printed sum (llama.cpp sums n values in
                 float32 and prints 6 decimals)
    edge values  max |a - b| over the printed values <= rtol·max|a| + 5e-5 (4 decimals printed)
With a --dump-stats file on A only the sum is common. The first tensor in forward order outside a tolerance
is the first divergence, at the first printed position where an edge value is outside it (when one is).
The q and k taps are compared in llama.cpp's row order (readers/llamacpp.py). A node over fewer tokens than
the prompt (llama.cpp's last layer keeps only the output rows after attention) holds the last positions.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from .errors import InputError
from .layer_dumps import LayerDump, forward_order
from .readers.llamacpp import PERMUTED, EvalCallback, Node, edges_of, tap_view, to_llamacpp_layout, token_axis

EDGE_ABS = 5e-5  # half the last printed decimal of an edge value
SUM_ABS = 5e-7  # half the last printed decimal of a sum


@dataclass
class StatTensor:
    name: str
    node: str  # the llama.cpp node compared
    shape: list[int]  # [tokens, width]
    sum_a: float
    sum_b: float | None
    sum_tol: float
    edges: int  # edge values compared (0: none)
    edge_max_diff: float | None
    edge_tol: float | None
    first_position: int | None
    diverged: bool


@dataclass
class StatsComparison:
    a: Any  # compare.Side
    b: Any
    rows: int
    positions: list[int]
    tensors: list[StatTensor]
    only_a: list[str]
    only_b: list[str]
    rtol: float
    rtol_is_check: bool
    first_divergence: StatTensor | None
    what: str  # what was compared, for the report's header
    failures: list[str] = field(default_factory=list)
    kind: str = "stats"
    alignment: Any = None

    @property
    def passed(self) -> bool | None:
        return None if not self.rtol_is_check else not self.failures

    def divergence_line(self) -> str:
        d = self.first_divergence
        if d is None:
            return f"no divergence: every sum and edge value within its tolerance (rtol {self.rtol:.1e})"
        at = f" at position {d.first_position}" if d.first_position is not None else ""
        why = []
        if d.sum_b is None or not abs(d.sum_a - d.sum_b) <= d.sum_tol:
            why.append(f"sum {d.sum_a:.6g} vs {d.sum_b if d.sum_b is None else f'{d.sum_b:.6g}'} "
                       f"(tolerance {d.sum_tol:.1e})")
        if d.edge_max_diff is not None and not d.edge_max_diff <= (d.edge_tol or 0.0):
            why.append(f"edge values differ by {d.edge_max_diff:.1e} (tolerance {d.edge_tol:.1e})")
        return f"first divergence: {d.name} ({d.node}){at}: {'; '.join(why)}"


@dataclass
class StatsDoc:
    """A --dump-stats file read back."""

    path: Path
    doc: dict[str, Any]


def read_stats_file(p: Path, label: str) -> StatsDoc:
    """A --dump-stats JSON file: {"tensors": [{"name", "shape", "sum", "abs_max", ...}], "positions", "tokens"}."""
    try:
        doc = json.loads(p.read_text("utf-8"))
    except (OSError, ValueError) as e:
        raise InputError(f"{label}: {p}: not a readable --dump-stats file ({' '.join(str(e).split())})") from None
    if not isinstance(doc, dict) or not isinstance(doc.get("tensors"), list):
        raise InputError(f"{label}: {p}: not a --dump-stats file (no tensors list)")
    return StatsDoc(p, doc)


def compare_stats(a: LayerDump | StatsDoc, b: EvalCallback, rtol: float | None, sides: tuple[Any, Any],
                  default_rtol: float) -> StatsComparison:
    """A (a layer dump, or a --dump-stats document) against llama.cpp's printed statistics."""
    limit = default_rtol if rtol is None else rtol
    stats_only = isinstance(a, StatsDoc)
    if isinstance(a, StatsDoc):
        a = a.doc  # type: ignore[assignment]
    taps = b.taps
    tokens_b = b.tokens
    t_rows = max((_tokens(n) for n in taps.values()), default=0)
    positions_a = (a.get("positions") if stats_only else a.positions) or []
    tokens_a = a.get("tokens") if stats_only else a.tokens
    want = list(range(t_rows))
    where = {p: i for i, p in enumerate(positions_a)}
    missing = [p for p in want if p not in where]
    if missing:
        raise InputError(f"A holds positions {positions_a[:8]}, but llama.cpp ran positions 0..{t_rows - 1}: "
                         "dump every prompt row (forward --rows all) of the same prompt")
    if tokens_a is not None and tokens_b is not None:
        diff = next((j for j in range(min(len(tokens_a), len(tokens_b), t_rows)) if tokens_a[j] != tokens_b[j]), None)
        if diff is not None:
            raise InputError(f"A and B ran different tokens from position {diff} (A: {tokens_a[diff]}, "
                             f"B: {tokens_b[diff]}): their rows there are not the same computation")
    if stats_only and list(positions_a) != want:
        raise InputError(f"A's statistics are over positions {positions_a[:8]}, llama.cpp's over 0..{t_rows - 1}: "
                         "dump the statistics of every prompt row (forward --rows all) of the same prompt")
    rows = [where[p] for p in want]
    head_dim = next((n.ne[0] for n in b.nodes if n.name.split("-")[0] in ("Qcur", "Kcur") and n.ne[2] > 1), None)
    if stats_only:
        a_names = [t["name"] for t in a["tensors"]]
        a_stats = {t["name"]: t for t in a["tensors"]}
    else:
        a_names = list(a.tensors)
    common = [n for n in forward_order(a_names) if n in taps]
    tensors = []
    for name in common:
        node = taps[name]
        if stats_only:
            if _tokens(node) == t_rows:  # A's sum is over every position: a node over fewer is not comparable
                tensors.append(_sum_only(name, node, a_stats[name], limit))
        else:
            # a node over fewer tokens holds the last ones (llama.cpp keeps only the output rows in the last
            # layer after attention)
            values = np.asarray(a.tensors[name][rows[t_rows - _tokens(node):]], dtype=np.float64)
            if name.rsplit(".", 1)[-1] in PERMUTED and head_dim:
                values = to_llamacpp_layout(values, head_dim)
            tensors.append(_compare(name, node, values, limit, t_rows - _tokens(node)))
    if not tensors:
        raise InputError(f"A and B hold no tensor in common (llama.cpp nodes mapped: "
                         f"{', '.join(list(taps)[:4]) or 'none'})")
    first = next((t for t in tensors if t.diverged), None)
    what = ("statistics comparison: B (llama.cpp eval-callback) holds each node's sum and edge values "
            "(first and last 3 along each dimension, 4 decimals); " +
            ("A holds statistics only: compared the sums (of the nodes over every position)" if stats_only
             else "compared the sums and edge values"))
    result = StatsComparison(sides[0], sides[1], t_rows, want, tensors,
                             [n for n in a_names if n not in taps], [n for n in taps if n not in a_names],
                             limit, rtol is not None, first, what)
    if rtol is not None and first is not None:
        result.failures = [result.divergence_line()]
    return result


def _sum_tol(n: int, abs_sum: float, rtol: float, sums: int) -> float:
    return max(rtol, n * 2.0 ** -24) * abs_sum + SUM_ABS * sums


def _tokens(node: Node) -> int:
    return node.ne[1] if node.ne[2] * node.ne[3] == 1 else node.ne[2]


def _compare(name: str, node: Node, values: np.ndarray, rtol: float, first_pos: int) -> StatTensor:
    a4 = tap_view(values, node)
    sum_a = float(a4.sum())
    sum_tol = _sum_tol(a4.size, float(np.abs(a4).sum()), rtol, node.ne[3])
    sum_ok = node.total is not None and abs(sum_a - node.total) <= sum_tol
    edges, max_d, edge_tol, first = 0, None, None, None
    if node.edges is not None:
        ea = edges_of(a4, node)
        d = np.abs(ea - node.edges)
        d = np.where(np.isnan(ea) & np.isnan(node.edges), 0.0, d)
        edges, max_d = int(d.size), float(np.nanmax(d)) if not np.isnan(d).all() else math.inf
        if np.isnan(d).any():
            max_d = math.inf
        edge_tol = rtol * float(np.nanmax(np.abs(a4))) + EDGE_ABS
        bad = np.argwhere(~(d <= edge_tol))
        if bad.size:
            axis = token_axis(node)
            first = first_pos + min(node.index_sets[axis][int(i)] for i in bad[:, axis])
    diverged = not sum_ok or (max_d is not None and not max_d <= (edge_tol or 0.0))
    return StatTensor(name, node.name, list(values.shape), sum_a, node.total, sum_tol, edges, max_d, edge_tol,
                      first, diverged)


def _sum_only(name: str, node: Node, stats: dict[str, Any], rtol: float) -> StatTensor:
    shape = [int(x) for x in stats.get("shape", [0, 0])]
    n = int(np.prod(shape)) if shape else 0
    sum_a = float(stats.get("sum") or 0.0)
    # without the values, Σ|a| is bounded by n·max|a|
    abs_sum = n * float(stats.get("abs_max") or 0.0)
    sum_tol = _sum_tol(n, abs_sum, rtol, node.ne[3])
    ok = node.total is not None and abs(sum_a - node.total) <= sum_tol
    return StatTensor(name, node.name, shape, sum_a, node.total, sum_tol, 0, None, None, None, not ok)
