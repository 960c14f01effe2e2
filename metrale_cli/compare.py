"""The statistics of `metrale compare A B`: B against the reference A, overall and row by row (logits), or
tensor by tensor in forward order (layer dumps). Everything is computed in float64 and returned as
dataclasses; render prints them.

Per logits row (a = A's row, b = B's):
    max_abs_diff  max |a - b|                       rel_err   max |a - b| / max |a|
    nmse          mean((a - b)^2) / var(a)          cosine    Σab / sqrt(Σa² Σb²)
    rel_diff      1 - 2 Σab / (Σa² + Σb²)  (SGLang's comparator)
    argmax        first index of the maximum (torch.argmax); agreement of A's and B's
    top-k overlap |top_k(a) ∩ top_k(b)| / k for k = 5, 10 (ties broken towards the lower token id)
    kl            KL(P_A || P_B) = Σ p_a (log p_a - log p_b), P = softmax of the row
    dp            Δp = p_B(t) - p_A(t) for A's top token t
Overall: the error statistics over every value of the finite rows (one pool, not a mean of rows), the
argmax agreement over all rows (a row holding NaN/Inf on either side counts as disagreeing), the mean
top-k overlap; KL mean, max, percentiles 99.9 ... 0.1 and min over rows, Δp mean, max, percentiles,
min and RMS, and "same top p" (the percentage of rows whose argmax agrees), as llama.cpp's
`llama-perplexity --kl-divergence` reports them: percentiles interpolate linearly between the sorted
values (numpy's default, llama.cpp's formula). Two differences from llama.cpp: its KL skips terms whose
reference probability is below e^-16 (it stores the reference log-probs quantized to 16 bits; here they
are exact), and its Δp is of the text's actual next token (here: of A's top token, as no text is given).

Rows pair up by position wherever both sides say which position each row is for (align.py): a forward
dump against a decode dump compares the positions both hold and names those only one side holds;
--positions selects among the common ones. Without positions the rows pair up by index.

Tolerances turn the report into a check (exit 9 on failure, errors.DivergenceError):
    --max-kl X       every row's KL(P_A || P_B) <= X
    --max-rel-err X  every row's max|Δ| / max|A| <= X
    --min-top1 X     the fraction of rows whose argmax agrees >= X
    (with any of them, a row holding NaN/Inf on either side fails)
    --rtol X         layer dumps: every tensor's max|Δ| / max|A| <= X
The first row that exceeds a given per-row tolerance is reported with its reasons (argmax differences
count only when --min-top1 fails). For layer dumps the first tensor in forward order whose rel_err
exceeds --rtol (default for the report alone: 1e-3, which exits 0) is the first divergence.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Sequence

import numpy as np

from .align import RowAlignment, align_rows
from .compare_inputs import Matrix, ReadOptions, logits_side, read_input
from .errors import InputError, UsageError
from .layer_dumps import LayerDump

BLOCK_ROWS = 64  # rows converted to float64 at a time: bounds the scratch memory for wide vocabularies
TOP_KS = (5, 10)
KL_PERCENTILES = (99.9, 99.0, 95.0, 90.0, 50.0, 10.0, 5.0, 1.0, 0.1)
DP_PERCENTILES = (99.9, 99.0, 95.0, 90.0, 75.0, 50.0, 25.0, 10.0, 5.0, 1.0, 0.1)
DEFAULT_RTOL = 1e-3  # layer dumps: the first-divergence threshold when --rtol is not given


# -- results ------------------------------------------------------------------------------------------------


@dataclass
class ErrorStats:
    max_abs_diff: float
    max_abs_a: float
    rel_err: float  # max_abs_diff / max_abs_a
    nmse: float
    cosine: float
    rel_diff: float


@dataclass
class RowStats:
    row: int
    position: int | None
    errors: ErrorStats
    argmax_a: int
    argmax_b: int
    top_overlap: dict[int, float]  # k -> overlap fraction
    kl: float
    dp: float
    finite: bool = True


@dataclass
class ArgmaxMismatch:
    """A row whose argmax differs: both candidates, with their logits on both sides."""

    row: int
    position: int | None
    a_token: int
    a_logit: float  # A's logit of its own top token
    b_logit_at_a: float  # B's logit of A's top token
    b_token: int
    a_logit_at_b: float  # A's logit of B's top token
    b_logit: float  # B's logit of its own top token
    margin_a: float  # a_logit - a_logit_at_b: how far A was from choosing B's token


@dataclass
class SoftmaxStats:
    kl_mean: float
    kl_max: float
    kl_percentiles: dict[str, float]  # "99.9" -> value
    kl_min: float
    dp_mean: float
    dp_max: float
    dp_percentiles: dict[str, float]
    dp_min: float
    dp_rms: float
    same_top_p_pct: float  # over the finite rows


@dataclass
class Tolerances:
    max_kl: float | None = None
    max_rel_err: float | None = None
    min_top1: float | None = None
    rtol: float | None = None

    @property
    def logits_given(self) -> bool:
        return any(v is not None for v in (self.max_kl, self.max_rel_err, self.min_top1))

    def check(self) -> None:
        for name, v in (("--max-kl", self.max_kl), ("--max-rel-err", self.max_rel_err), ("--rtol", self.rtol)):
            if v is not None and not (math.isfinite(v) and v >= 0):
                raise UsageError(f"{name} must be a number >= 0, got {v}")
        if self.min_top1 is not None and not 0 <= self.min_top1 <= 1:
            raise UsageError(f"--min-top1 is a fraction of rows in [0, 1], got {self.min_top1}")


@dataclass
class PositionError:
    """The final logits' error at one row: KL(P_A || P_B) and max|A-B| / max|A| (NaN for a non-finite row)."""

    row: int
    position: int | None
    kl: float
    rel_err: float


@dataclass
class Side:
    """What one input was: for the report's header."""

    path: str
    source: str
    dtype: str | None
    shape: list[int] | None  # logits [rows, vocab]
    tensors: int | None = None  # layer dumps
    notes: list[str] = field(default_factory=list)  # what reading an engine's dump left out


@dataclass
class Exceeding:
    row: int
    position: int | None
    reasons: list[str]


@dataclass
class LogitsComparison:
    a: Side
    b: Side
    rows: int
    vocab: int
    overall: ErrorStats | None  # None when no row is finite on both sides
    top1_agree: int
    top_overlap: dict[int, float]  # k -> mean overlap over the finite rows
    softmax: SoftmaxStats | None
    mismatches: list[ArgmaxMismatch]
    nonfinite_rows: list[int]
    tolerances: Tolerances
    first_exceeding: Exceeding | None
    exceeding_rows: int
    failures: list[str]
    row_stats: list[RowStats] | None = None  # with --rows
    alignment: RowAlignment | None = None  # which rows of A and B were paired
    by_position: list[PositionError] = field(default_factory=list)  # every row, in order
    kind: str = "logits"

    @property
    def top1_rate(self) -> float:
        return self.top1_agree / self.rows

    @property
    def first_argmax_mismatch(self) -> ArgmaxMismatch | None:
        return self.mismatches[0] if self.mismatches else None

    @property
    def passed(self) -> bool | None:
        """None when no tolerance was given (a report, not a check)."""
        return None if not self.tolerances.logits_given else not self.failures


@dataclass
class TensorComparison:
    name: str
    shape: list[int]
    errors: ErrorStats
    worst_row: int  # the row holding the largest |Δ|
    worst_position: int | None
    nonfinite_mismatch: int  # values finite on one side only
    diverged: bool
    row_rel_err: list[float] = field(default_factory=list)  # per row: its max|A-B| / the tensor's max|A|
    first_row: int | None = None  # the first row beyond the tolerance (NaN/Inf where A is finite counts)
    first_position: int | None = None


@dataclass
class LayerComparison:
    a: Side
    b: Side
    rows: int
    positions: list[int] | None
    tensors: list[TensorComparison]  # in A's forward order, the tensors both dumps hold
    only_a: list[str]
    only_b: list[str]
    rtol: float
    rtol_is_check: bool
    first_divergence: TensorComparison | None
    before_max_rel_err: float | None  # the largest rel_err before the first divergence
    failures: list[str] = field(default_factory=list)
    alignment: RowAlignment | None = None
    kind: str = "layers"

    @property
    def passed(self) -> bool | None:
        return None if not self.rtol_is_check else not self.failures

    def by_position(self) -> list[tuple[int, float, str | None]]:
        """Per row compared: (position, or the row index without positions; the largest rel err of any tensor
        there; the first tensor in forward order beyond the tolerance there, None when none is)."""
        out = []
        for r in range(self.rows):
            errs = [t.row_rel_err[r] for t in self.tensors if r < len(t.row_rel_err)]
            first = next((t.name for t in self.tensors if r < len(t.row_rel_err) and not t.row_rel_err[r] <= self.rtol),
                         None)
            out.append((self.positions[r] if self.positions else r, max(errs, default=0.0), first))
        return out

    def divergence_line(self) -> str:
        """'first divergence: model.layers.17.mlp at position 5, rel err 3.1e-02; everything before it <= 1.0e-04'."""
        d = self.first_divergence
        if d is None:
            worst = max((t.errors.rel_err for t in self.tensors), default=0.0)
            return f"no divergence: every tensor's rel err <= {self.rtol:.1e} (largest {worst:.1e})"
        what = "NaN/Inf where A is finite" if d.nonfinite_mismatch and not d.errors.rel_err > self.rtol \
            else f"rel err {d.errors.rel_err:.1e}"
        at = "" if d.first_row is None else (f" at position {d.first_position}" if d.first_position is not None
                                             else f" at row {d.first_row}")
        line = f"first divergence: {d.name}{at}, {what} (rtol {self.rtol:.1e})"
        if self.before_max_rel_err is None:
            return line + "; it is the first tensor compared"
        return line + f"; everything before it <= {self.before_max_rel_err:.1e}"


# -- entry point ----------------------------------------------------------------------------------------------


def run_compare(a_path: str, b_path: str, opts: ReadOptions, tol: Tolerances, keep_rows: bool = False,
                positions: Sequence[int] | None = None) -> Any:
    """Read A and B and compare them: logits against logits, or layer dump against layer dump; `positions`
    (--positions) selects among the positions both hold."""
    opts.check()
    tol.check()
    a = read_input(a_path, "A", opts)
    b = read_input(b_path, "B", opts)
    stats = _stats_comparison(a, b, a_path, b_path, tol, keep_rows)
    if stats is not None:
        return stats
    if isinstance(a, Matrix) and isinstance(b, LayerDump) and "logits" in b.metadata:
        b = logits_side(b, "B")  # an engine's dump against a logits dump: its logits
    elif isinstance(b, Matrix) and isinstance(a, LayerDump) and "logits" in a.metadata:
        a = logits_side(a, "A")
    if isinstance(a, Matrix) != isinstance(b, Matrix):
        what = {True: "a logits matrix", False: "a layer dump"}
        raise InputError(f"A ({a_path}) is {what[isinstance(a, Matrix)]} but B ({b_path}) is "
                         f"{what[isinstance(b, Matrix)]}; compare two of a kind")
    if isinstance(a, Matrix):
        if tol.rtol is not None:
            raise UsageError("--rtol applies to layer dumps (per tensor); for logits use --max-rel-err")
        return compare_logits(a, b, tol, keep_rows=keep_rows, a_path=a_path, b_path=b_path, select=positions)
    if tol.logits_given:
        raise UsageError("--max-kl, --max-rel-err and --min-top1 apply to logits; for layer dumps use --rtol")
    if keep_rows:
        raise UsageError("--rows lists logits rows; for layer dumps each tensor's worst row is in the table")
    return compare_layers(a, b, tol.rtol, a_path=a_path, b_path=b_path, select=positions)


def _stats_comparison(a: Any, b: Any, a_path: str, b_path: str, tol: Tolerances, keep_rows: bool) -> Any:
    """llama.cpp's printed statistics (B) against metrale's layer dump or --dump-stats file (A); None when
    neither side is statistics."""
    from .compare_stats import StatsDoc, compare_stats
    from .readers.llamacpp import EvalCallback

    if not any(isinstance(x, (StatsDoc, EvalCallback)) for x in (a, b)):
        return None
    if isinstance(a, EvalCallback):
        raise UsageError("llama.cpp's eval-callback output is compared as B, against metrale's dump as A")
    if not isinstance(b, EvalCallback):
        which = "A" if isinstance(a, StatsDoc) else "B"
        raise InputError(f"{which} is a --dump-stats file (statistics, not tensors): it is compared only with "
                         "llama.cpp's eval-callback output; for other dumps compare the tensors (.safetensors, .npz)")
    if isinstance(a, Matrix) or tol.logits_given or keep_rows:
        raise UsageError("llama.cpp's eval-callback output holds layer statistics: compare it with a layer dump "
                         "(or --dump-stats file) using --rtol")
    sides = (Side(a_path, a.source if isinstance(a, LayerDump) else "metrale --dump-stats", None, None,
                  len(a.tensors) if isinstance(a, LayerDump) else len(a.doc["tensors"])),
             Side(b_path, "llama.cpp eval-callback", None, None, len(b.nodes), list(b.notes)))
    return compare_stats(a, b, tol.rtol, sides, DEFAULT_RTOL)


# -- logits -------------------------------------------------------------------------------------------------------


def compare_logits(a: Matrix, b: Matrix, tol: Tolerances | None = None, *, keep_rows: bool = False,
                   a_path: str | None = None, b_path: str | None = None,
                   select: Sequence[int] | None = None) -> LogitsComparison:
    tol = tol or Tolerances()
    if a.shape[1] != b.shape[1]:
        raise InputError(f"A ({a.path}) is [{a.shape[0]}, {a.shape[1]}] and B ({b.path}) is "
                         f"[{b.shape[0]}, {b.shape[1]}]: the vocabularies do not match")
    al = align_rows(a.shape[0], b.shape[0], a.positions, b.positions, a.tokens, b.tokens, select,
                    (f"A ({a.path}, [{a.shape[0]}, {a.shape[1]}])", f"B ({b.path}, [{b.shape[0]}, {b.shape[1]}])"))
    x, y = _take(a.values, al.rows_a), _take(b.values, al.rows_b)
    rows = _row_stats(x, y, al.positions)
    finite = [r for r in rows if r.finite]
    agree = sum(r.argmax_a == r.argmax_b for r in finite)
    mismatches = [_mismatch(x, y, r) for r in finite if r.argmax_a != r.argmax_b]
    result = LogitsComparison(
        a=_side(a_path or str(a.path), a), b=_side(b_path or str(b.path), b), rows=len(rows), vocab=a.shape[1],
        overall=_pooled_error_stats(x, y, [r.row for r in finite]) if finite else None,
        top1_agree=agree,
        top_overlap={k: float(np.mean([r.top_overlap[k] for r in finite])) if finite else math.nan
                     for k in TOP_KS},
        softmax=_softmax_stats(finite) if finite else None,
        mismatches=mismatches, nonfinite_rows=[r.row for r in rows if not r.finite], tolerances=tol,
        first_exceeding=None, exceeding_rows=0, failures=[], row_stats=rows if keep_rows else None, alignment=al,
        by_position=[PositionError(r.row, r.position, r.kl if r.finite else math.nan,
                                   r.errors.rel_err if r.finite else math.nan) for r in rows])
    _apply_tolerances(result, rows)
    return result


def _side(path: str, m: Matrix) -> Side:
    return Side(path, m.source, m.dtype, list(m.shape))


def _take(values: np.ndarray, rows: list[int]) -> np.ndarray:
    """The given rows of values (values itself when they are all of them, in order: no copy)."""
    return values if rows == list(range(values.shape[0])) else values[rows]


def _row_stats(a: np.ndarray, b: np.ndarray, positions: list[int] | None) -> list[RowStats]:
    out: list[RowStats] = []
    for start in range(0, a.shape[0], BLOCK_ROWS):
        x = np.asarray(a[start:start + BLOCK_ROWS], dtype=np.float64)
        y = np.asarray(b[start:start + BLOCK_ROWS], dtype=np.float64)
        finite = np.isfinite(x).all(axis=1) & np.isfinite(y).all(axis=1)
        with np.errstate(all="ignore"):  # non-finite rows give NaN here and are reported as such
            err = _row_errors(x, y)
            kl, dp = _row_softmax(x, y)
        ia, ib = np.argmax(x, axis=1), np.argmax(y, axis=1)
        for j in range(x.shape[0]):
            r = start + j
            overlap = {k: _top_overlap(x[j], y[j], k) for k in TOP_KS} if finite[j] else dict.fromkeys(TOP_KS, math.nan)
            out.append(RowStats(r, positions[r] if positions is not None else None,
                                ErrorStats(*(float(v[j]) for v in err)), int(ia[j]), int(ib[j]), overlap,
                                float(kl[j]), float(dp[j]), bool(finite[j])))
    return out


def _row_errors(x: np.ndarray, y: np.ndarray) -> tuple[np.ndarray, ...]:
    d = x - y
    max_d = np.abs(d).max(axis=1)
    max_a = np.abs(x).max(axis=1)
    saa, sbb, sab = (x * x).sum(axis=1), (y * y).sum(axis=1), (x * y).sum(axis=1)
    return (max_d, max_a, _ratio(max_d, max_a), _ratio(np.mean(d * d, axis=1), x.var(axis=1)),
            sab / np.sqrt(saa * sbb), 1 - 2 * sab / (saa + sbb))


def _ratio(num: np.ndarray, den: np.ndarray) -> np.ndarray:
    """num / den, with 0/0 = 0 (identical constant rows) and x/0 = inf."""
    with np.errstate(all="ignore"):
        return np.where(den > 0, num / np.where(den > 0, den, 1), np.where(num > 0, np.inf, 0.0))


def _log_softmax(x: np.ndarray) -> np.ndarray:
    m = x.max(axis=1, keepdims=True)
    return x - (m + np.log(np.exp(x - m).sum(axis=1, keepdims=True)))


def _row_softmax(x: np.ndarray, y: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    la, lb = _log_softmax(x), _log_softmax(y)
    pa = np.exp(la)
    kl = (pa * (la - lb)).sum(axis=1)
    t = np.argmax(x, axis=1)[:, None]
    dp = np.exp(np.take_along_axis(lb, t, 1)) - np.take_along_axis(pa, t, 1)
    return kl, dp[:, 0]


def top_k_ids(row: np.ndarray, k: int) -> np.ndarray:
    """The k largest entries' ids, largest first, ties to the lower id (deterministic under bf16 ties)."""
    k = min(k, row.size)
    threshold = np.partition(row, row.size - k)[row.size - k]
    cand = np.flatnonzero(row >= threshold)
    return cand[np.lexsort((cand, -row[cand]))][:k]


def _top_overlap(x: np.ndarray, y: np.ndarray, k: int) -> float:
    kk = min(k, x.size)
    return len(np.intersect1d(top_k_ids(x, k), top_k_ids(y, k))) / kk


def _mismatch(a: np.ndarray, b: np.ndarray, r: RowStats) -> ArgmaxMismatch:
    x, y = a[r.row], b[r.row]
    ta, tb = r.argmax_a, r.argmax_b
    return ArgmaxMismatch(r.row, r.position, ta, float(x[ta]), float(y[ta]), tb, float(x[tb]), float(y[tb]),
                          float(np.float64(x[ta]) - np.float64(x[tb])))


def _pooled_error_stats(a: np.ndarray, b: np.ndarray, rows: Sequence[int]) -> ErrorStats:
    """The error statistics over every value of the given rows, in two passes (mean, then spread)."""
    idx = np.asarray(rows)
    blocks = [idx[i:i + BLOCK_ROWS] for i in range(0, idx.size, BLOCK_ROWS)]
    n = idx.size * a.shape[1]
    sum_a = sum(float(np.asarray(a[blk], np.float64).sum()) for blk in blocks)
    mean_a = sum_a / n
    max_d = max_a = ssd = var_sum = saa = sbb = sab = 0.0
    for blk in blocks:
        x, y = np.asarray(a[blk], np.float64), np.asarray(b[blk], np.float64)
        d = x - y
        max_d, max_a = max(max_d, float(np.abs(d).max())), max(max_a, float(np.abs(x).max()))
        ssd += float((d * d).sum())
        var_sum += float(((x - mean_a) ** 2).sum())
        saa, sbb, sab = saa + float((x * x).sum()), sbb + float((y * y).sum()), sab + float((x * y).sum())
    return _error_stats(max_d, max_a, ssd / n, var_sum / n, saa, sbb, sab)


def _error_stats(max_d: float, max_a: float, mse: float, var: float, saa: float, sbb: float,
                 sab: float) -> ErrorStats:
    def ratio(num: float, den: float) -> float:
        return num / den if den > 0 else (math.inf if num > 0 else 0.0)

    cosine = sab / math.sqrt(saa * sbb) if saa > 0 and sbb > 0 else math.nan
    rel_diff = 1 - 2 * sab / (saa + sbb) if saa + sbb > 0 else 0.0
    return ErrorStats(max_d, max_a, ratio(max_d, max_a), ratio(mse, var), cosine, rel_diff)


def _percentiles(values: np.ndarray, qs: Sequence[float]) -> dict[str, float]:
    return {f"{q:g}": float(np.percentile(values, q)) for q in qs}


def _softmax_stats(rows: list[RowStats]) -> SoftmaxStats:
    kl = np.array([r.kl for r in rows])
    dp = np.array([r.dp for r in rows])
    same = sum(r.argmax_a == r.argmax_b for r in rows)
    return SoftmaxStats(
        kl_mean=float(kl.mean()), kl_max=float(kl.max()), kl_percentiles=_percentiles(kl, KL_PERCENTILES),
        kl_min=float(kl.min()), dp_mean=float(dp.mean()), dp_max=float(dp.max()),
        dp_percentiles=_percentiles(dp, DP_PERCENTILES), dp_min=float(dp.min()),
        dp_rms=float(np.sqrt(np.mean(dp * dp))), same_top_p_pct=100.0 * same / len(rows))


def _apply_tolerances(result: LogitsComparison, rows: list[RowStats]) -> None:
    tol = result.tolerances
    if not tol.logits_given:
        return
    top1_fails = tol.min_top1 is not None and result.top1_rate < tol.min_top1
    reasons: dict[int, list[str]] = {}
    for r in rows:
        why = []
        if not r.finite:
            why.append("NaN/Inf in A or B")
        else:
            if tol.max_kl is not None and r.kl > tol.max_kl:
                why.append(f"KL {r.kl:.3e} > --max-kl {tol.max_kl:g}")
            if tol.max_rel_err is not None and r.errors.rel_err > tol.max_rel_err:
                why.append(f"rel err {r.errors.rel_err:.3e} > --max-rel-err {tol.max_rel_err:g}")
            if top1_fails and r.argmax_a != r.argmax_b:
                why.append(f"argmax {r.argmax_b} != A's {r.argmax_a}")
        if why:
            reasons[r.row] = why
    failures = []
    if result.nonfinite_rows:
        failures.append(f"{len(result.nonfinite_rows)} rows hold NaN/Inf (first: row {result.nonfinite_rows[0]})")
    finite = [r for r in rows if r.finite]
    for name, limit, value in (("--max-kl", tol.max_kl, lambda r: r.kl),
                               ("--max-rel-err", tol.max_rel_err, lambda r: r.errors.rel_err)):
        over = [value(r) for r in finite if limit is not None and value(r) > limit]
        if over:
            label = "KL(P_A||P_B)" if name == "--max-kl" else "max|Δ|/max|A|"
            failures.append(f"{label} up to {max(over):.3e} > {name} {limit:g} in {len(over)} of {result.rows} rows")
    if top1_fails:
        failures.append(f"top-1 agreement {result.top1_rate:.4f} < --min-top1 {tol.min_top1:g} "
                        f"({result.rows - result.top1_agree} of {result.rows} rows differ)")
    result.failures = failures
    result.exceeding_rows = len(reasons)
    if reasons:
        first = min(reasons)
        result.first_exceeding = Exceeding(first, rows[first].position, reasons[first])


def failure_message(result: Any) -> str:
    """The one line a failed check ends with (errors.DivergenceError's message)."""
    if result.kind in ("layers", "stats"):
        return result.divergence_line()
    text = "; ".join(result.failures)
    fe = result.first_exceeding
    if fe is not None:
        where = f"row {fe.row}" + (f" (position {fe.position})" if fe.position is not None else "")
        text += f"; first row exceeding: {where}: {', '.join(fe.reasons)}"
    return text


# -- layer dumps ------------------------------------------------------------------------------------------------------


def compare_layers(a: LayerDump, b: LayerDump, rtol: float | None = None, *, a_path: str | None = None,
                   b_path: str | None = None, select: Sequence[int] | None = None) -> LayerComparison:
    common = [n for n in a.tensors if n in b.tensors]
    only_a = [n for n in a.tensors if n not in b.tensors]
    only_b = [n for n in b.tensors if n not in a.tensors]
    if not common:
        raise InputError(f"A ({a.path}) and B ({b.path}) hold no tensor of the same name "
                         f"(A: {_names(list(a.tensors))}; B: {_names(list(b.tensors))})")
    for n in common:
        if a.tensors[n].shape[1:] != b.tensors[n].shape[1:] or a.tensors[n].shape[0] != a.rows or \
                b.tensors[n].shape[0] != b.rows:
            raise InputError(f"tensor {n}: A ({a.path}) is {list(a.tensors[n].shape)} and B ({b.path}) is "
                             f"{list(b.tensors[n].shape)}")
    al = align_rows(int(a.rows), int(b.rows), a.positions, b.positions, a.tokens, b.tokens, select,
                    (f"A ({a.path})", f"B ({b.path})"))
    positions = al.positions
    limit = DEFAULT_RTOL if rtol is None else rtol
    tensors = [_tensor_comparison(n, _take(a.tensors[n], al.rows_a), _take(b.tensors[n], al.rows_b), positions,
                                  limit) for n in common]
    first = next((t for t in tensors if t.diverged), None)
    before = None
    if first is not None:
        earlier = [t.errors.rel_err for t in tensors[:tensors.index(first)]]
        before = max(earlier) if earlier else None
    result = LayerComparison(
        Side(a_path or str(a.path), a.source, None, None, len(a.tensors), list(a.metadata.get("notes") or [])),
        Side(b_path or str(b.path), b.source, None, None, len(b.tensors), list(b.metadata.get("notes") or [])),
        len(al.rows_a), positions, tensors, only_a, only_b, limit, rtol is not None, first, before, alignment=al)
    if rtol is not None and first is not None:
        result.failures = [result.divergence_line()]
    return result


def _names(names: list[str], n: int = 4) -> str:
    return ", ".join(names[:n]) + (", ..." if len(names) > n else "") if names else "none"


def _tensor_comparison(name: str, a: np.ndarray, b: np.ndarray, positions: list[int] | None,
                       rtol: float) -> TensorComparison:
    x, y = np.asarray(a, np.float64), np.asarray(b, np.float64)
    fx, fy = np.isfinite(x), np.isfinite(y)
    both = fx & fy
    xs, ys = x[both], y[both]
    d = np.abs(xs - ys)
    if d.size:
        stats = _error_stats(float(d.max()), float(np.abs(xs).max()), float(np.mean(d * d)), float(xs.var()),
                             float(xs @ xs), float(ys @ ys), float(xs @ ys))
        with np.errstate(invalid="ignore"):  # inf - inf where both sides are infinite: masked out
            full = np.where(both, np.abs(x - y), -1.0)
        worst = int(np.unravel_index(int(np.argmax(full)), full.shape)[0])
    else:
        stats, worst = ErrorStats(math.nan, math.nan, math.nan, math.nan, math.nan, math.nan), 0
    mismatch = int((fx != fy).sum())
    diverged = bool(mismatch) or not stats.rel_err <= rtol
    with np.errstate(invalid="ignore"):
        row_d = np.where(both, np.abs(x - y), 0.0).max(axis=1) if x.size else np.zeros(x.shape[0])
    max_a = stats.max_abs_a if math.isfinite(stats.max_abs_a) else 0.0
    row_rel = [float(v) for v in _ratio(row_d, np.full_like(row_d, max_a))]
    row_rel = [math.inf if (fx[r] != fy[r]).any() else v for r, v in enumerate(row_rel)]
    first = next((r for r, v in enumerate(row_rel) if not v <= rtol), None) if diverged else None
    return TensorComparison(name, list(a.shape), stats, worst, positions[worst] if positions else None,
                            mismatch, diverged, row_rel, first,
                            positions[first] if positions and first is not None else None)
