"""What the passes return: plain dataclasses of tokens, rows, statistics and timings.

Positions are 0-based indices into the sequence (prompt then generated tokens). Rendering them is
render's job; computing them that of the other modules of this package.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field

import numpy as np

from ..errors import NonFiniteLogitsError


@dataclass
class TopK:
    token: int
    text: str | None
    logit: float
    prob: float


@dataclass
class ArgmaxNote:
    """Why a bf16 row's argmax may not be an fp32 engine's: its maximum at several ids (`tied`; the lowest
    wins, as torch.argmax), and the argmax of the row's fp32 logits before rounding where the engine knows
    it and it differs (`fp32_argmax`: the NumPy engine; the CUDA engine's rows are bf16 from the start)."""

    tied: list[int]  # the ids holding the row's maximum, when more than one
    fp32_argmax: int | None  # None: the same as the row's, or not known


@dataclass
class HiddenSummary:
    size: int
    norm: float
    mean: float
    std: float
    min: float
    max: float
    first: list[float]
    sha256: str  # of the fp32 little-endian bytes
    values: np.ndarray = field(repr=False)


@dataclass
class Rows:
    """Every logits row a command produced, in order, exactly as copy_logits_to_host gave them."""

    dtype: str  # "bf16" | "fp32"
    vocab: int
    data: list[bytes] = field(default_factory=list)

    def append(self, raw: bytes) -> None:
        self.data.append(raw)

    def array(self) -> np.ndarray:
        """[rows, vocab] as float32 or as uint16 bf16 bit patterns."""
        dt = np.float32 if self.dtype == "fp32" else np.uint16
        if not self.data:
            return np.zeros((0, self.vocab), dt)
        return np.frombuffer(b"".join(self.data), dtype=dt).reshape(len(self.data), self.vocab)


@dataclass
class HiddenRows:
    """The post-final-norm hidden state behind every logits row a command produced, in the same order
    (row i is the hidden state the logits row i was computed from), as fp32 [hidden] vectors."""

    size: int
    data: list[np.ndarray] = field(default_factory=list)

    def extend(self, rows: np.ndarray) -> None:
        self.data.extend(np.asarray(r, dtype=np.float32) for r in rows)

    def array(self) -> np.ndarray:
        """[rows, hidden] float32."""
        return np.stack(self.data) if self.data else np.zeros((0, self.size), np.float32)

    def summary(self) -> HiddenSummary | None:
        """The --hidden summary: the last row."""
        return summarize_hidden(self.data[-1]) if self.data else None


@dataclass
class Timings:
    load_s: float = 0.0
    prefill_s: float = 0.0
    prompt_tokens: int = 0
    step_s: list[float] = field(default_factory=list)  # one per decode step / verify pass
    extra: dict[str, float] = field(default_factory=dict)


@dataclass
class DecodeStep:
    position: int  # position of the produced token
    token: int
    text: str | None
    logit: float
    top_k: list[TopK]
    note: ArgmaxNote | None = None  # a bf16 row's tie, or its fp32 argmax where it differs


@dataclass
class DecodeResult:
    prompt_tokens: list[int]
    steps: list[DecodeStep]
    stopped_at_eos: bool
    rows: Rows | None
    hidden: HiddenSummary | None
    timings: Timings
    text: str | None = None  # the continuation, decoded from the produced ids together (continuation_text)
    hidden_rows: HiddenRows | None = None  # with want_hidden: one per logits row, in the same order
    interrupted: bool = False  # should_stop() asked to stop before the steps or an EOS were reached


@dataclass
class VerifyRow:
    position: int  # position of the draft token
    draft: int
    target: int  # the target model's greedy token at this position
    accepted: bool | None  # None: not checked, acceptance stopped at an earlier rejection
    margin: float  # top-1 minus top-2 logit of the row that decided this position
    draft_text: str | None = None
    target_text: str | None = None
    note: ArgmaxNote | None = None  # of the row that chose `target`

    @property
    def status(self) -> str:
        """accepted | rejected | unchecked (after the first rejection, whatever draft and target are)."""
        return "unchecked" if self.accepted is None else ("accepted" if self.accepted else "rejected")


@dataclass
class VerifyResult:
    k: int
    draft_source: str
    prompt_tokens: list[int]
    rows: list[VerifyRow]
    accepted: int
    next_token: int
    next_text: str | None
    max_abs_diff_vs_sequential: float | None  # only for --draft self
    logit_rows: Rows | None
    hidden: HiddenSummary | None
    timings: Timings
    # --draft self: max_abs_diff_vs_sequential in steps (ulps) of the logits dtype at the logit where it
    # occurs, and how many of the k verify rows are bit-identical to their sequential decode rows
    max_abs_diff_ulps_vs_sequential: int | None = None
    rows_identical_vs_sequential: int | None = None
    hidden_rows: HiddenRows | None = None  # with want_hidden: one per logits row, in the same order


@dataclass
class ForwardRow:
    position: int
    argmax: int
    text: str | None
    logit: float
    note: ArgmaxNote | None = None
    # forward --mtp: the model's own argmax at this position (the MTP layer's argmax equal to it: a greedy
    # verify pass would accept that first draft)
    model_argmax: int | None = None


@dataclass
class ForwardResult:
    prompt_tokens: list[int]
    rows: list[ForwardRow]
    logit_rows: Rows | None
    hidden: HiddenSummary | None
    timings: Timings
    hidden_rows: HiddenRows | None = None  # with want_hidden: one per reported row, in the same order


@dataclass
class SpecStats:
    k: int
    draft_source: str
    verify_passes: int = 0
    drafted: int = 0
    accepted: int = 0
    drafted_at: list[int] = field(default_factory=list)  # per draft position 0..k-1
    accepted_at: list[int] = field(default_factory=list)

    @property
    def acceptance_rate(self) -> float:
        return self.accepted / self.drafted if self.drafted else 0.0

    @property
    def mean_accepted_per_pass(self) -> float:
        return self.accepted / self.verify_passes if self.verify_passes else 0.0

    @property
    def acceptance_by_position(self) -> list[float]:
        return [a / d if d else 0.0 for a, d in zip(self.accepted_at, self.drafted_at)]


@dataclass
class SpecDecodeResult(DecodeResult):
    stats: SpecStats | None = None
    plain_tokens_per_s: float | None = None  # plain greedy decoding in the same run (--timings)
    spec_tokens_per_s: float | None = None


@dataclass
class Evidence:
    """What a pass produced up to its first non-finite logits row, kept for the dumps: the rows (the
    failing ones included), the hidden rows behind them, and the ids the engine ran."""

    rows: Rows | None  # None when no logits dump was asked for
    hidden: HiddenRows | None  # None when no hidden state was asked for; else one per row, as `rows`
    tokens: list[int]  # every input id the engine ran, from position 0
    first_position: int  # rows[i] is the output at input position first_position + i

    @property
    def positions(self) -> list[int]:
        n = len(self.rows.data) if self.rows is not None else len(self.hidden.data) if self.hidden else 0
        return list(range(self.first_position, self.first_position + n))


class NonFiniteRun(NonFiniteLogitsError):
    """A pass's NonFiniteLogitsError with the evidence it produced: the CLI writes the dumps, then fails."""

    def __init__(self, err: NonFiniteLogitsError, evidence: Evidence) -> None:
        super().__init__(str(err), row=err.row, position=err.position)
        self.evidence = evidence


def summarize_hidden(values: np.ndarray, first: int = 8) -> HiddenSummary:
    v = np.ascontiguousarray(values, dtype="<f4")
    return HiddenSummary(
        size=int(v.size), norm=float(np.linalg.norm(v.astype(np.float64))), mean=float(v.mean()),
        std=float(v.std()), min=float(v.min()), max=float(v.max()),
        first=[float(x) for x in v[:first]], sha256=hashlib.sha256(v.tobytes()).hexdigest(), values=v,
    )
