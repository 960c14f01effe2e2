"""llama.cpp's own outputs.

`llama-eval-callback -m M.gguf -p PROMPT` prints every graph node it computes:

    common_debug_cb_eval:  attn_norm-0 = (f32)  MUL(norm-0{192, 4, 1, 1}, blk.0.attn_norm.weight{...}}) = {192, 4, 1, 1}
        [
            [
                [ v, v, v, ..., v, v, v ],   (the first and last 3 along each dimension)
                ...
            ],
        ]
        sum = S

`ne` is innermost first (ne0 the features, ne1 the tokens for a 2-D activation; a 3-D one is [head_dim,
heads, tokens]), values are printed to 4 decimals, and the sum (one per ne3) to 6, accumulated in float32.
So a node is known only by its statistics: `Node` keeps its edge values, indexed, and its sum. Nodes named
NAME-N belong to layer N; several nodes may share a name (Qcur-0 after the projection, after a reshape,
after rope), told apart by their op. The token ids are the lines after "number of input tokens = N" (the
last field of each: the log may prefix a time). Newer builds name the embedding node `embd`, older ones
`inp_embd`.

`llama-debug -m M.gguf -p PROMPT --save-logits` writes `llamacpp-<model>.bin` (the last position's logits,
raw float32) and `llamacpp-<model>-tokens.bin` (the prompt's ids, int32) into its output folder.

Names map to metrale's taps (`TAPS`); llama.cpp's converter permutes the q and k projection rows of
Llama-family checkpoints (each head's two rope halves interleaved), so q/k taps are compared through that
permutation (`to_llamacpp_layout`).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from ..errors import InputError

EDGE = 3  # llama.cpp's common_debug_print_tensor shows the first and last 3 along each dimension
_HEADER = re.compile(r"^\S+: +(.+?) = \((\w+)\) +(\w+)\((.*)\) = \{(\d+), (\d+), (\d+), (\d+)\}\s*$")
_NUMBER = re.compile(r"-?(?:\d+\.\d+|nan|inf)")
_SUM = re.compile(r"^\s*sum = (\S+)\s*$")

# (llama.cpp name without the layer suffix, op or None for any) -> metrale tap ({i}: the layer)
TAPS: list[tuple[str, str | None, str]] = [
    ("inp_embd", "GET_ROWS", "model.embed_tokens"),
    ("embd", "GET_ROWS", "model.embed_tokens"),
    ("attn_norm", None, "model.layers.{i}.input_layernorm"),
    ("Qcur", "MUL_MAT", "model.layers.{i}.self_attn.q_proj"),
    ("Kcur", "MUL_MAT", "model.layers.{i}.self_attn.k_proj"),
    ("Vcur", "MUL_MAT", "model.layers.{i}.self_attn.v_proj"),
    ("Qcur", "ROPE", "model.layers.{i}.self_attn.q_rope"),
    ("Kcur", "ROPE", "model.layers.{i}.self_attn.k_rope"),
    ("kqv_out", None, "model.layers.{i}.self_attn.o_proj.input"),
    ("attn_out", None, "model.layers.{i}.self_attn"),
    ("ffn_norm", None, "model.layers.{i}.post_attention_layernorm"),
    ("ffn_gate", "MUL_MAT", "model.layers.{i}.mlp.gate_proj"),
    ("ffn_up", "MUL_MAT", "model.layers.{i}.mlp.up_proj"),
    ("ffn_swiglu", None, "model.layers.{i}.mlp.down_proj.input"),
    ("ffn_out", None, "model.layers.{i}.mlp"),
    ("l_out", None, "model.layers.{i}"),
    ("result_norm", None, "model.norm"),
]
PERMUTED = ("q_proj", "k_proj", "q_rope", "k_rope")
_VIEWS = ("RESHAPE", "VIEW", "PERMUTE", "TRANSPOSE", "CPY", "CONT")  # rows llama.cpp's converter reorders for its rope


@dataclass
class Node:
    """One printed graph node: its shape (ne, innermost first), edge values and sum."""

    name: str
    dtype: str
    op: str
    ne: tuple[int, int, int, int]
    edges: np.ndarray | None  # [len(I3), len(I2), len(I1), len(I0)] at the indices `index_sets` gives
    total: float | None  # the sum of the printed per-ne3 sums

    @property
    def index_sets(self) -> list[list[int]]:
        """Per dimension, outermost (ne3) first: the indices whose values were printed."""
        return [edge_indices(n) for n in reversed(self.ne)]


@dataclass
class EvalCallback:
    path: Path
    nodes: list[Node]
    tokens: list[int] | None
    taps: dict[str, Node] = field(default_factory=dict)  # metrale tap -> the node it is
    notes: list[str] = field(default_factory=list)


def edge_indices(n: int) -> list[int]:
    return list(range(n)) if n <= 2 * EDGE else [*range(EDGE), *range(n - EDGE, n)]


def is_eval_callback(p: Path) -> bool:
    try:
        with open(p, "r", encoding="utf-8", errors="replace") as f:
            head = f.read(65536)
    except OSError:
        return False
    return "common_debug_cb_eval:" in head or "ggml_debug:" in head


def read_eval_callback(p: Path, where: str) -> EvalCallback:
    try:
        lines = p.read_text("utf-8", errors="replace").splitlines()
    except OSError as e:
        raise InputError(f"{where}: cannot be read ({e.strerror or e})") from None
    nodes: list[Node] = []
    notes: list[str] = []
    tokens = None
    k = 0
    while k < len(lines):
        line = lines[k]
        m = _HEADER.match(line)
        if m is None:
            t = re.search(r"number of input tokens = (\d+)", line)
            if t:
                n = int(t.group(1))
                ids = [(s.split() or [""])[-1] for s in lines[k + 1:k + 1 + n]]  # after any log prefix
                if len(ids) == n and all(re.fullmatch(r"-?\d+", s) for s in ids):
                    tokens = [int(s) for s in ids]
                    k += n
            k += 1
            continue
        ne = tuple(int(m.group(g)) for g in range(5, 9))
        values: list[float] = []
        sums: list[float] = []
        k += 1
        while k < len(lines) and not _HEADER.match(lines[k]):
            s = _SUM.match(lines[k])
            if s:
                sums.append(float(s.group(1)))
                if len(sums) == ne[3]:
                    k += 1
                    break
            elif lines[k].lstrip().startswith("["):
                values += [float(v) for v in _NUMBER.findall(lines[k])]
            elif lines[k].strip() and not lines[k].strip().startswith(("]", "...")):
                break  # a log line: this node printed no values (a quantized tensor)
            k += 1
        node = Node(m.group(1).strip(), m.group(2), m.group(3), ne,  # type: ignore[arg-type]
                    None, sum(sums) if sums else None)
        shape = [len(s) for s in node.index_sets]
        complete = len(sums) == ne[3]
        if values and (len(values) != int(np.prod(shape)) or not complete):
            if k >= len(lines):  # the output ends inside this node
                notes.append(f"the output ends inside node {node.name} (llama.cpp's logger can drop its last "
                             "lines at exit: write stdout and stderr to one file, > out.txt 2>&1); it is left out")
                break
            raise InputError(f"{where}: node {node.name}: {len(values)} printed values, expected "
                             f"{int(np.prod(shape))} for shape {{{', '.join(map(str, ne))}}}: a damaged file")
        if values:
            node.edges = np.array(values, dtype=np.float64).reshape(shape)
        nodes.append(node)
    if not nodes:
        raise InputError(f"{where}: no tensors printed by llama-eval-callback")
    out = EvalCallback(p, nodes, tokens, notes=notes)
    out.taps = map_taps(nodes)
    return out


def map_taps(nodes: list[Node]) -> dict[str, Node]:
    """metrale tap -> node; for a name printed several times, the last node of the op the map names."""
    out: dict[str, Node] = {}
    for node in nodes:
        m = re.fullmatch(r"(.+?)(?:-(\d+))?", node.name)
        base, layer = m.group(1), m.group(2)  # type: ignore[union-attr]
        for name, op, tap in TAPS:
            if base == name and (op is None or node.op == op) and ("{i}" in tap) == (layer is not None):
                key = tap.format(i=layer)
                if node.edges is None and node.total is None:
                    continue
                if op is None and key in out and node.op in _VIEWS:
                    continue  # a view of a node already taken (a reshape alone is taken: kqv_out)
                out[key] = node
    return out


def to_llamacpp_layout(a: np.ndarray, head_dim: int) -> np.ndarray:
    """A q or k tap [rows, heads * head_dim] in Hugging Face's layout (each head: first rope half, second
    half) put in llama.cpp's (the halves interleaved, as its converter permutes the weight rows)."""
    rows, width = a.shape
    heads = width // head_dim
    return a.reshape(rows, heads, 2, head_dim // 2).swapaxes(2, 3).reshape(rows, width)


def tap_view(a: np.ndarray, node: Node) -> np.ndarray:
    """metrale's tap [tokens, width] as the node's 4-D array [ne3, ne2, ne1, ne0] (outermost first)."""
    ne0, ne1, ne2, ne3 = node.ne
    if ne2 * ne3 == 1:  # [width, tokens]
        want = (ne1, ne0)
    else:  # [head_dim, heads, tokens]
        want = (ne2 * ne3, ne0 * ne1)
    if a.shape != want:
        raise InputError(f"{node.name} is {{{', '.join(map(str, node.ne))}}} but metrale's tap is "
                         f"{list(a.shape)} (tokens x width)")
    return a.reshape(ne3, ne2, ne1, ne0) if ne2 * ne3 > 1 else a.reshape(1, 1, ne1, ne0)


def edges_of(a4: np.ndarray, node: Node) -> np.ndarray:
    """The values of a 4-D array at the node's printed indices."""
    return a4[np.ix_(*node.index_sets)]


def token_axis(node: Node) -> int:
    """Which axis of the 4-D edge array runs over tokens."""
    return 1 if node.ne[2] * node.ne[3] > 1 else 2


# -- llama-debug --save-logits ------------------------------------------------------------------------------------

def debug_files(p: Path) -> tuple[Path, Path | None] | None:
    """The logits .bin and its tokens .bin, given either one or their folder."""
    if p.is_dir():
        bins = sorted(f for f in p.glob("llamacpp-*.bin") if not f.name.endswith("-tokens.bin"))
        if not bins:
            return None
        p = bins[0]
    if p.name.endswith("-tokens.bin"):
        p = p.with_name(p.name[: -len("-tokens.bin")] + ".bin")
    if not (p.name.startswith("llamacpp-") and p.suffix == ".bin" and p.is_file()):
        return None
    tokens = p.with_name(p.stem + "-tokens.bin")
    return p, tokens if tokens.is_file() else None


def read_debug_logits(p: Path, where: str) -> tuple[np.ndarray, list[int] | None, Path]:
    """llama-debug's saved logits: one row (the prompt's last position) and the prompt's token ids."""
    found = debug_files(p)
    if found is None:
        raise InputError(f"{where}: not llama-debug --save-logits output (llamacpp-<model>.bin)")
    logits_path, tokens_path = found
    raw = logits_path.read_bytes()
    if not raw or len(raw) % 4:
        raise InputError(f"{where}: {logits_path.name} is {len(raw)} bytes, not whole float32 logits")
    tokens = None
    if tokens_path is not None:
        t = tokens_path.read_bytes()
        if len(t) % 4:
            raise InputError(f"{where}: {tokens_path.name} is {len(t)} bytes, not whole int32 token ids")
        tokens = [int(x) for x in np.frombuffer(t, dtype="<i4")]
    return np.frombuffer(raw, dtype="<f4").reshape(1, -1).copy(), tokens, logits_path
