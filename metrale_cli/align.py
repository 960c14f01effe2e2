"""Which rows of two dumps `metrale compare` pairs: by position wherever both sides say which position each
row is for (logits dumps and layer dumps carry `positions`; a side carrying only the token ids it ran, one
row per token, is for positions 0..n-1), else row by row.

A forward dump (rows at positions 0..21) against a decode dump (rows at 5..20) compares positions 5..20 and
names 0..4 and 21 as only in A. When both sides carry their token ids, the rows compared must have run the
same tokens up to their position (a causal model's row at p depends on tokens 0..p), else the rows are not
the same computation and the comparison is refused. `--positions` selects among the common positions.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Sequence

from .errors import InputError, UsageError


@dataclass
class RowAlignment:
    """The rows compared: A's and B's row indices pair up, at `positions` (None: rows numbered only)."""

    rows_a: list[int]
    rows_b: list[int]
    positions: list[int] | None
    only_a: list[int] = field(default_factory=list)  # positions A holds and B does not
    only_b: list[int] = field(default_factory=list)
    selected: bool = False  # --positions chose among the common positions

    @property
    def partial(self) -> bool:
        """Whether some rows of either side are not compared (the report then says which)."""
        return bool(self.only_a or self.only_b or self.selected)


def parse_positions(spec: str | None) -> list[int] | None:
    """--positions '5..20,22' -> [5, ..., 20, 22] (ranges inclusive); None when not given."""
    if spec is None:
        return None
    out: list[int] = []
    for part in (p for p in re.split(r"[\s,]+", spec.strip()) if p):
        m = re.fullmatch(r"(\d+)(?:\.\.(\d+))?", part)
        if m is None or (m.group(2) is not None and int(m.group(2)) < int(m.group(1))):
            raise UsageError(f"--positions: {part!r} is not a position or a range A..B (e.g. '5..20,22')")
        out += list(range(int(m.group(1)), int(m.group(2) or m.group(1)) + 1))
    if not out:
        raise UsageError("--positions is empty: give positions such as '5..20' or '0,3,7'")
    return sorted(set(out))


def _positions(positions: list[int] | None, tokens: list[int] | None, rows: int) -> list[int] | None:
    if positions is not None and len(positions) == rows:
        return positions
    if positions is None and tokens is not None and len(tokens) == rows:
        return list(range(rows))
    return None  # none, or a description that does not fit the data: rows are numbered only


def align_rows(rows_a: int, rows_b: int, pa: list[int] | None, pb: list[int] | None, ta: list[int] | None = None,
               tb: list[int] | None = None, select: Sequence[int] | None = None, names: tuple[str, str] = ("A", "B")
               ) -> RowAlignment:
    """Pair A's rows with B's (see the module docstring); InputError when they cannot be paired. `names`
    describe the two sides in messages."""
    pa, pb = _positions(pa, ta, rows_a), _positions(pb, tb, rows_b)
    if pa is None or pb is None:
        if rows_a != rows_b:
            raise InputError(f"{names[0]} has {rows_a} rows and {names[1]} {rows_b}, and "
                             f"{'neither side says' if pa is None and pb is None else 'only one side says'} "
                             "which position each row is for: the rows cannot be paired")
        pos = pa if pa is not None else pb
        return _select(RowAlignment(list(range(rows_a)), list(range(rows_b)), pos), select)
    where_b = {p: i for i, p in enumerate(pb)}
    common = [p for p in pa if p in where_b]
    if not common:
        raise InputError(f"A's rows are for positions {_short(pa)} and B's for {_short(pb)}: no position in common")
    if ta is not None and tb is not None:
        _check_tokens(ta, tb, max(common))
    seen_a = set(pa)
    al = RowAlignment([i for i, p in enumerate(pa) if p in where_b], [where_b[p] for p in common], common,
                      [p for p in pa if p not in where_b], [p for p in pb if p not in seen_a])
    return _select(al, select)


def _check_tokens(ta: list[int], tb: list[int], last: int) -> None:
    n = min(last + 1, len(ta), len(tb))
    diff = next((j for j in range(n) if ta[j] != tb[j]), None)
    if diff is not None:
        raise InputError(f"A and B ran different tokens from position {diff} (A: {ta[diff]}, B: {tb[diff]}): "
                         "their rows there are not the same computation")


def _select(al: RowAlignment, select: Sequence[int] | None) -> RowAlignment:
    if select is None:
        return al
    have = al.positions if al.positions is not None else list(range(len(al.rows_a)))
    index = {p: k for k, p in enumerate(have)}
    missing = [p for p in select if p not in index]
    if missing:
        raise InputError(f"--positions {_short(missing)} {'is' if len(missing) == 1 else 'are'} not on both sides "
                         f"(positions on both: {_ranges(have)})")
    keep = [index[p] for p in select]
    return RowAlignment([al.rows_a[k] for k in keep], [al.rows_b[k] for k in keep],
                        None if al.positions is None else [al.positions[k] for k in keep], al.only_a, al.only_b, True)


def _short(xs: Sequence[int], n: int = 8) -> str:
    return "[" + ", ".join(map(str, xs[:n])) + (", ..." if len(xs) > n else "") + "]"


def _ranges(xs: Sequence[int]) -> str:
    """[0, 1, 2, 5, 7, 8] -> '0..2, 5, 7..8'; 'none' when empty."""
    out: list[str] = []
    for p in sorted(xs):
        if out and p == end + 1:
            end = p
            out[-1] = f"{start}..{end}"
            continue
        start = end = p
        out.append(str(p))
    return ", ".join(out) or "none"


def describe(al: RowAlignment) -> str:
    """'compared 5..20 (16); only in A: 0..4, 21; only in B: none' for the report."""
    compared = _ranges(al.positions) if al.positions is not None else f"rows {_ranges(al.rows_a)}"
    return (f"compared {compared} ({len(al.rows_a)}{', selected by --positions' if al.selected else ''}); "
            f"only in A: {_ranges(al.only_a)}; only in B: {_ranges(al.only_b)}")
