"""compare's report: two logits dumps (error statistics, argmax, softmax KL and delta p, per row) or two
layer dumps (per tensor in forward order, the first divergence)."""

from __future__ import annotations

import math
from typing import Any

from rich import box
from rich.console import Console
from rich.table import Table
from rich.text import Text

from ..align import describe
from .common import counted, dump_json, f4, num, write


def _e3(x: float | None) -> str:
    return "n/a" if x is None or not math.isfinite(x) else f"{x:.3e}"


def _cos(x: float | None) -> str:
    return "n/a" if x is None or not math.isfinite(x) else f"{x:.8f}"


def _errors_json(e: Any) -> dict[str, Any] | None:
    if e is None:
        return None
    return {"max_abs_diff": num(e.max_abs_diff, ".3e"), "max_abs_a": num(e.max_abs_a, ".3e"),
            "rel_err": num(e.rel_err, ".3e"), "nmse": num(e.nmse, ".3e"), "cosine": num(e.cosine, ".8f"),
            "rel_diff": num(e.rel_diff, ".3e")}


def _side_json(s: Any) -> dict[str, Any]:
    doc: dict[str, Any] = {"path": s.path, "source": s.source}
    if s.tensors is None:
        doc.update({"dtype": s.dtype, "shape": s.shape})
    else:
        doc["tensors"] = s.tensors
    if s.notes:
        doc["notes"] = list(s.notes)
    return doc


SPARKS = "▁▂▃▄▅▆▇█"


def sparkline(values: list[float]) -> str:
    """One character per value, heights on a log scale from the smallest positive value to the largest
    (0 is the lowest bar; NaN/Inf the highest, as '!')."""
    finite = [v for v in values if math.isfinite(v) and v > 0]
    lo, hi = (math.log10(min(finite)), math.log10(max(finite))) if finite else (0.0, 0.0)
    out = []
    for v in values:
        if not math.isfinite(v):
            out.append("!")
        elif v <= 0 or hi == lo:
            out.append(SPARKS[0] if v <= 0 or not finite else SPARKS[-1])
        else:
            out.append(SPARKS[round((math.log10(v) - lo) / (hi - lo) * (len(SPARKS) - 1))])
    return "".join(out)


def _spark_line(label: str, positions: list[Any], values: list[float]) -> str:
    finite = [(v, p) for v, p in zip(values, positions) if math.isfinite(v)]
    worst = max(finite, default=None)
    span = f"{positions[0]}..{positions[-1]}" if positions else ""
    top = "" if worst is None else f", max {worst[0]:.1e} at {worst[1]}"
    return f"{label} by position {span}{top}: {sparkline(values)}"


def _side_text(s: Any) -> str:
    what = f"{s.tensors} tensors" if s.tensors is not None else f"{s.dtype}, [{s.shape[0]}, {s.shape[1]}]"
    return f"{s.path} ({s.source}, {what})"


def _where(row: int, position: int | None) -> str:
    return f"row {row}" + (f" (position {position})" if position is not None else "")


def compare_json(r: Any) -> dict[str, Any]:
    al = r.alignment
    doc: dict[str, Any] = {"command": "compare", "kind": r.kind, "a": _side_json(r.a), "b": _side_json(r.b),
                           "rows": r.rows, "only_a_positions": list(al.only_a) if al else [],
                           "only_b_positions": list(al.only_b) if al else [],
                           "positions_selected": bool(al and al.selected)}
    if r.kind == "layers":
        return _layers_json(doc, r)
    if r.kind == "stats":
        return _stats_json(doc, r)
    t = r.tolerances
    sm = r.softmax
    doc.update({
        "vocab": r.vocab, "overall": _errors_json(r.overall),
        "top1": {"agree": r.top1_agree, "rows": r.rows, "rate": num(r.top1_rate)},
        **{f"top{k}_overlap": num(v) for k, v in r.top_overlap.items()},
        "softmax": None if sm is None else {
            "kl_mean": num(sm.kl_mean, ".3e"), "kl_max": num(sm.kl_max, ".3e"),
            "kl_percentiles": {q: num(v, ".3e") for q, v in sm.kl_percentiles.items()},
            "kl_min": num(sm.kl_min, ".3e"), "dp_mean": num(sm.dp_mean, ".3e"), "dp_max": num(sm.dp_max, ".3e"),
            "dp_percentiles": {q: num(v, ".3e") for q, v in sm.dp_percentiles.items()},
            "dp_min": num(sm.dp_min, ".3e"), "dp_rms": num(sm.dp_rms, ".3e"),
            "same_top_p_pct": num(sm.same_top_p_pct, ".3f")},
        "argmax_mismatches": [_mismatch_json(m) for m in r.mismatches],
        "first_argmax_mismatch": None if r.first_argmax_mismatch is None else r.first_argmax_mismatch.row,
        "nonfinite_rows": list(r.nonfinite_rows),
        "tolerances": {"max_kl": t.max_kl, "max_rel_err": t.max_rel_err, "min_top1": t.min_top1},
        "first_exceeding": None if r.first_exceeding is None else {
            "row": r.first_exceeding.row, "position": r.first_exceeding.position,
            "reasons": list(r.first_exceeding.reasons)},
        "exceeding_rows": r.exceeding_rows, "passed": r.passed, "failures": list(r.failures),
    })
    doc["by_position"] = [{"row": e.row, "position": e.position, "kl": num(e.kl, ".3e"),
                           "rel_err": num(e.rel_err, ".3e")} for e in r.by_position]
    if r.row_stats is not None:
        doc["row_stats"] = [_row_json(s) for s in r.row_stats]
    return doc


def _mismatch_json(m: Any) -> dict[str, Any]:
    return {"row": m.row, "position": m.position, "a_token": m.a_token, "a_logit": num(m.a_logit),
            "b_logit_at_a_token": num(m.b_logit_at_a), "b_token": m.b_token,
            "a_logit_at_b_token": num(m.a_logit_at_b), "b_logit": num(m.b_logit), "margin_a": num(m.margin_a)}


def _row_json(s: Any) -> dict[str, Any]:
    return {"row": s.row, "position": s.position, "finite": s.finite, **(_errors_json(s.errors) or {}),
            "argmax_a": s.argmax_a, "argmax_b": s.argmax_b,
            **{f"top{k}_overlap": num(v) for k, v in s.top_overlap.items()},
            "kl": num(s.kl, ".3e"), "dp": num(s.dp, ".3e")}


def _layers_json(doc: dict[str, Any], r: Any) -> dict[str, Any]:
    first = r.first_divergence
    doc.update({
        "positions": r.positions,
        "tensors": [{"name": t.name, "shape": t.shape, **(_errors_json(t.errors) or {}), "worst_row": t.worst_row,
                     "worst_position": t.worst_position, "nonfinite_mismatch": t.nonfinite_mismatch,
                     "diverged": t.diverged, "first_row": t.first_row, "first_position": t.first_position,
                     "rel_err_by_row": [num(v, ".3e") for v in t.row_rel_err]} for t in r.tensors],
        "only_in_a": list(r.only_a), "only_in_b": list(r.only_b), "rtol": r.rtol, "rtol_is_check": r.rtol_is_check,
        "first_divergence": None if first is None else {
            "name": first.name, "row": first.first_row, "position": first.first_position,
            "rel_err": num(first.errors.rel_err, ".3e"), "before_max_rel_err": num(r.before_max_rel_err, ".3e")},
        "by_position": [{"position": p, "max_rel_err": num(v, ".3e"), "first_exceeding": n}
                        for p, v, n in r.by_position()],
        "summary": r.divergence_line(), "passed": r.passed, "failures": list(r.failures),
    })
    return doc


def _alignment_line(r: Any) -> str | None:
    """Which positions were compared, when some rows of A or B were not (else None: every row was)."""
    al = r.alignment
    return None if al is None or not al.partial else f"alignment: {describe(al)}"


def render_compare(console: Console, fmt: str, r: Any) -> None:
    """The report of `metrale compare` (logits or layer dumps); --rows adds the per-row table."""
    if fmt == "json":
        dump_json(console, compare_json(r))
    elif r.kind == "stats":
        stats_report(console, r, rich=fmt != "plain")
    elif r.kind == "layers":
        (plain_layers if fmt == "plain" else rich_layers)(console, r)
    else:
        (plain_logits_compare if fmt == "plain" else rich_logits_compare)(console, r)


def _check_text(r: Any, hint: str) -> str:
    if r.passed is None:
        return f"not run (a report; {hint} to check)"
    if r.kind in ("layers", "stats"):  # the divergence line just above says why
        return f"{'passed' if r.passed else 'FAILED'} (--rtol {r.rtol:g})"
    return "passed" if r.passed else "FAILED: " + "; ".join(r.failures)


_LOGITS_HINT = "give --max-kl, --max-rel-err or --min-top1"


def _softmax_lines(sm: Any) -> list[tuple[str, str]]:
    if sm is None:
        return []
    out = [("kl_mean", _e3(sm.kl_mean)), ("kl_max", _e3(sm.kl_max))]
    out += [(f"kl_p{q}", _e3(v)) for q, v in sm.kl_percentiles.items()]
    out += [("kl_min", _e3(sm.kl_min)), ("dp_mean", _e3(sm.dp_mean)), ("dp_max", _e3(sm.dp_max))]
    out += [(f"dp_p{q}", _e3(v)) for q, v in sm.dp_percentiles.items()]
    out += [("dp_min", _e3(sm.dp_min)), ("dp_rms", _e3(sm.dp_rms)), ("same_top_p", f"{sm.same_top_p_pct:.3f}%")]
    return out


def _logits_summary(r: Any) -> list[tuple[str, str]]:
    e = r.overall
    rows = [] if e is None else [("max_abs_diff", _e3(e.max_abs_diff)), ("max_abs_a", _e3(e.max_abs_a)),
                                 ("rel_err", _e3(e.rel_err)), ("nmse", _e3(e.nmse)), ("cosine", _cos(e.cosine)),
                                 ("rel_diff", _e3(e.rel_diff))]
    rows.append(("top1_agreement", f"{r.top1_agree}/{r.rows} ({r.top1_rate:.4f})"))
    rows += [(f"top{k}_overlap", "n/a" if not math.isfinite(v) else f4(v)) for k, v in r.top_overlap.items()]
    return rows + _softmax_lines(r.softmax)


def _mismatch_cells(m: Any) -> list[str]:
    return [str(m.row), "-" if m.position is None else str(m.position), str(m.a_token), f4(m.a_logit),
            f4(m.b_logit_at_a), str(m.b_token), f4(m.a_logit_at_b), f4(m.b_logit), f4(m.margin_a)]


_MISMATCH_HEAD = ["row", "position", "a_token", "a_logit", "b_at_a_token", "b_token", "a_at_b_token", "b_logit",
                  "margin_a"]
_ROW_HEAD = ["row", "position", "max_abs_diff", "rel_err", "nmse", "cosine", "kl", "dp", "argmax_a", "argmax_b",
             "top5", "top10"]


def _row_cells(s: Any) -> list[str]:
    e = s.errors
    return [str(s.row), "-" if s.position is None else str(s.position), _e3(e.max_abs_diff), _e3(e.rel_err),
            _e3(e.nmse), _cos(e.cosine), _e3(s.kl), _e3(s.dp), str(s.argmax_a), str(s.argmax_b),
            *("n/a" if not math.isfinite(s.top_overlap[k]) else f4(s.top_overlap[k]) for k in (5, 10))]


def _plain_table(c: Console, head: list[str], rows: list[list[str]], first_left: bool = False) -> None:
    widths = [max(len(h), *(len(row[i]) for row in rows)) if rows else len(h) for i, h in enumerate(head)]

    def line(cells: list[str]) -> str:
        return "  ".join(cell.ljust(w) if first_left and i == 0 else cell.rjust(w)
                         for i, (cell, w) in enumerate(zip(cells, widths))).rstrip()

    write(c, line(head))
    for row in rows:
        write(c, line(row))


def plain_logits_compare(c: Console, r: Any) -> None:
    write(c, "metrale compare")
    write(c, f"a: {_side_text(r.a)}")
    write(c, f"b: {_side_text(r.b)}")
    write(c, f"kind: logits, rows: {r.rows}, vocab: {r.vocab}")
    _plain_alignment(c, r)
    write(c, "")
    for key, value in _logits_summary(r):
        write(c, f"{key}: {value}")
    write(c, f"nonfinite_rows: {' '.join(map(str, r.nonfinite_rows)) or 'none'}")
    write(c, "")
    write(c, f"argmax_mismatches: {len(r.mismatches)}")
    if r.mismatches:
        _plain_table(c, _MISMATCH_HEAD, [_mismatch_cells(m) for m in r.mismatches])
    if r.row_stats is not None:
        write(c, "")
        _plain_table(c, _ROW_HEAD, [_row_cells(s) for s in r.row_stats])
    write(c, "")
    m = r.first_argmax_mismatch
    write(c, f"first_argmax_mismatch: {'none' if m is None else _where(m.row, m.position)}")
    fe = r.first_exceeding
    shown = "none" if fe is None else f"{_where(fe.row, fe.position)}: {', '.join(fe.reasons)}"
    write(c, f"first_exceeding: {shown}")
    write(c, f"check: {_check_text(r, _LOGITS_HINT)}")


def _plain_alignment(c: Console, r: Any) -> None:
    line = _alignment_line(r)
    if line is not None:
        write(c, line)
    for label, side in (("a", r.a), ("b", r.b)):
        for note in side.notes:
            write(c, f"note ({label}): {note}")


def _rich_sides(c: Console, r: Any) -> None:
    c.print(Text(f"A (reference): {_side_text(r.a)}"))
    c.print(Text(f"B: {_side_text(r.b)}"))
    line = _alignment_line(r)
    if line is not None:
        c.print(Text(line, style="yellow"))
    for label, side in (("A", r.a), ("B", r.b)):
        for note in side.notes:
            c.print(Text(f"note ({label}): {note}", style="yellow"))


def rich_logits_compare(c: Console, r: Any) -> None:
    _rich_sides(c, r)
    e = r.overall
    if e is not None:
        c.print(_rich_grid(f"logits: {r.rows} rows x {r.vocab}, over every value",
                           ["max|A-B|", "max|A|", "max|A-B|/max|A|", "NMSE", "cosine", "rel_diff"],
                           [[_e3(e.max_abs_diff), _e3(e.max_abs_a), _e3(e.rel_err), _e3(e.nmse), _cos(e.cosine),
                             _e3(e.rel_diff)]]))
    overlap = ["n/a" if not math.isfinite(v) else f4(v) for v in r.top_overlap.values()]
    c.print(_rich_grid("argmax", ["top-1 agree", *(f"top-{k} overlap" for k in r.top_overlap), "nonfinite rows"],
                       [[f"{r.top1_agree}/{r.rows} ({r.top1_rate:.4f})", *overlap,
                         " ".join(map(str, r.nonfinite_rows)) or "none"]]))
    sm = r.softmax
    if sm is not None:
        keys = ["mean", "max", *sm.kl_percentiles, "min"]
        kl = {"mean": sm.kl_mean, "max": sm.kl_max, **sm.kl_percentiles, "min": sm.kl_min}
        dp = {"mean": sm.dp_mean, "max": sm.dp_max, **sm.dp_percentiles, "min": sm.dp_min, "rms": sm.dp_rms}
        rows = [[k if k in ("mean", "max", "min", "rms") else f"{k}%", _e3(kl[k]) if k in kl else "",
                 _e3(dp[k]) if k in dp else ""] for k in keys[:2] + list(sm.dp_percentiles) + ["min", "rms"]]
        c.print(_rich_grid(f"softmax (same top p {sm.same_top_p_pct:.3f}%)", ["", "KL(P_A||P_B)", "Δp (A's top)"],
                           rows, first_left=True))
    if r.mismatches:
        head = ["row", "pos", "A top", "A logit", "B there", "B top", "A there", "B logit", "A margin"]
        c.print(_rich_grid(f"argmax differs in {counted(len(r.mismatches), 'row')}", head,
                           [_mismatch_cells(m) for m in r.mismatches], compact=True))
    if r.row_stats is not None:
        head = ["row", "pos", "max|A-B|", "rel err", "KL", "Δp", "A top", "B top", "top5"]
        c.print(_rich_grid("per row", head, [[x for i, x in enumerate(_row_cells(s)) if i not in (4, 5, 11)]
                                             for s in r.row_stats], compact=True))
    if len(r.by_position) > 1:
        pos = [e.position if e.position is not None else e.row for e in r.by_position]
        c.print(Text(_spark_line("KL", pos, [e.kl for e in r.by_position])))
        c.print(Text(_spark_line("rel err", pos, [e.rel_err for e in r.by_position])))
    fe = r.first_exceeding
    if fe is not None:
        c.print(Text(f"first row exceeding: {_where(fe.row, fe.position)}: {', '.join(fe.reasons)}", style="red"))
    _rich_check(c, r, _LOGITS_HINT)


def _rich_grid(title: str, head: list[str], rows: list[list[str]], first_left: bool = False,
               compact: bool = False) -> Table:
    # compact: no vertical rules, so a wide per-row table still fits an 80-column terminal
    t = (Table(title=title, title_justify="left", box=box.SIMPLE_HEAD, show_edge=False, pad_edge=False,
               collapse_padding=True)
         if compact else Table(title=title, title_justify="left"))
    for i, h in enumerate(head):
        t.add_column(h, justify="left" if first_left and i == 0 else "right")
    for row in rows:
        t.add_row(*row)
    return t


def _rich_check(c: Console, r: Any, hint: str) -> None:
    style = "dim" if r.passed is None else ("bold green" if r.passed else "bold red")
    c.print(Text(f"check: {_check_text(r, hint)}", style=style))


_LAYER_HEAD = ["tensor", "shape", "max_abs_diff", "rel_err", "nmse", "cosine", "rel_diff", "worst_row"]


def _layer_cells(t: Any) -> list[str]:
    e = t.errors
    worst = str(t.worst_row) + (f" (pos {t.worst_position})" if t.worst_position is not None else "")
    return [t.name, "x".join(map(str, t.shape)), _e3(e.max_abs_diff), _e3(e.rel_err), _e3(e.nmse), _cos(e.cosine),
            _e3(e.rel_diff), worst]


_LAYERS_HINT = "give --rtol"
BY_POSITION_ROWS = 64  # plain output lists the per-position table up to this many rows (JSON always)


def plain_layers(c: Console, r: Any) -> None:
    write(c, "metrale compare")
    write(c, f"a: {_side_text(r.a)}")
    write(c, f"b: {_side_text(r.b)}")
    write(c, f"kind: layers, rows: {r.rows}, tensors compared: {len(r.tensors)}")
    write(c, f"positions: {' '.join(map(str, r.positions)) if r.positions is not None else 'n/a'}")
    _plain_alignment(c, r)
    write(c, "")
    _plain_table(c, _LAYER_HEAD, [_layer_cells(t) for t in r.tensors], first_left=True)
    write(c, "")
    write(c, f"only_in_a: {' '.join(r.only_a) or 'none'}")
    write(c, f"only_in_b: {' '.join(r.only_b) or 'none'}")
    if 1 < r.rows <= BY_POSITION_ROWS:
        write(c, "")
        _plain_table(c, ["position", "max_rel_err", "first_exceeding"],
                     [[str(p), _e3(v), n or "-"] for p, v, n in r.by_position()])
        write(c, "")
    write(c, r.divergence_line())
    write(c, f"check: {_check_text(r, _LAYERS_HINT)}")


def rich_layers(c: Console, r: Any) -> None:
    _rich_sides(c, r)
    t = Table(title=f"layer dumps: {r.rows} rows, {len(r.tensors)} tensors in forward order", title_justify="left",
              box=box.SIMPLE_HEAD, show_edge=False, pad_edge=False, collapse_padding=True)
    for i, h in enumerate(["tensor", "shape", "max|A-B|", "rel err", "cosine", "worst row"]):
        t.add_column(h, justify="left" if i == 0 else "right", no_wrap=i == 0)
    first = r.first_divergence
    seen = False
    for tc in r.tensors:
        seen = seen or tc is first
        style = "bold red" if tc is first else ("yellow" if seen and tc.diverged else "")
        cells = _layer_cells(tc)
        t.add_row(*cells[:4], cells[5], str(tc.worst_row), style=style)
    c.print(t)
    if r.rows > 1:
        by = r.by_position()
        c.print(Text(_spark_line("max rel err", [p for p, _, _ in by], [v for _, v, _ in by])))
    for label, names in (("only in A", r.only_a), ("only in B", r.only_b)):
        if names:
            c.print(Text(f"{label}: {' '.join(names)}", style="yellow"))
    c.print(Text(r.divergence_line(), style="bold red" if first is not None else "bold green"))
    _rich_check(c, r, _LAYERS_HINT)


# -- statistics (llama.cpp's eval-callback) -----------------------------------------------------------------------

_STATS_HEAD = ["tensor", "llama.cpp node", "shape", "sum_a", "sum_b", "sum_tol", "edges", "edge_max_diff", "edge_tol",
               "ok"]


def _stat_cells(t: Any) -> list[str]:
    return [t.name, t.node, "x".join(map(str, t.shape)), f"{t.sum_a:.6g}",
            "n/a" if t.sum_b is None else f"{t.sum_b:.6g}", _e3(t.sum_tol), str(t.edges), _e3(t.edge_max_diff),
            _e3(t.edge_tol), "DIFFERS" if t.diverged else "yes"]


def _stats_json(doc: dict[str, Any], r: Any) -> dict[str, Any]:
    first = r.first_divergence
    doc.update({
        "statistics_only": True, "what": r.what, "positions": r.positions,
        "tensors": [{"name": t.name, "node": t.node, "shape": t.shape, "sum_a": num(t.sum_a, ".7g"),
                     "sum_b": num(t.sum_b, ".7g"), "sum_tol": num(t.sum_tol, ".3e"), "edges": t.edges,
                     "edge_max_diff": num(t.edge_max_diff, ".3e"), "edge_tol": num(t.edge_tol, ".3e"),
                     "first_position": t.first_position, "diverged": t.diverged} for t in r.tensors],
        "only_in_a": list(r.only_a), "only_in_b": list(r.only_b), "rtol": r.rtol, "rtol_is_check": r.rtol_is_check,
        "first_divergence": None if first is None else {"name": first.name, "node": first.node,
                                                         "position": first.first_position},
        "summary": r.divergence_line(), "passed": r.passed, "failures": list(r.failures),
    })
    return doc


def stats_report(c: Console, r: Any, rich: bool) -> None:
    """A statistics comparison: plain lines, or the same with rich's table."""
    if rich:
        _rich_sides(c, r)
        c.print(Text(r.what, style="yellow"))
        c.print(_rich_grid(f"statistics: {r.rows} positions, {len(r.tensors)} tensors in forward order",
                           ["tensor", "sum A", "sum B", "tol", "edge |Δ|", "tol", "ok"],
                           [[x for i, x in enumerate(_stat_cells(t)) if i not in (1, 2, 6)] for t in r.tensors],
                           first_left=True, compact=True))
        c.print(Text(r.divergence_line(), style="bold red" if r.first_divergence is not None else "bold green"))
        _rich_check(c, r, _LAYERS_HINT)
        return
    write(c, "metrale compare")
    write(c, f"a: {_side_text(r.a)}")
    write(c, f"b: {_side_text(r.b)}")
    write(c, f"kind: statistics, positions: {' '.join(map(str, r.positions))}, tensors compared: {len(r.tensors)}")
    write(c, r.what)
    _plain_alignment(c, r)
    write(c, "")
    _plain_table(c, _STATS_HEAD, [_stat_cells(t) for t in r.tensors], first_left=True)
    write(c, "")
    write(c, f"only_in_a: {' '.join(r.only_a) or 'none'}")
    write(c, f"only_in_b: {' '.join(r.only_b) or 'none'}")
    write(c, r.divergence_line())
    write(c, f"check: {_check_text(r, _LAYERS_HINT)}")
