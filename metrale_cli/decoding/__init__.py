"""Forward, greedy decode, verify and speculative decoding, as small named steps over an engine.

Everything here reads results through the ModelLogits interface (argmax on the device, rows copied to
the host as bytes) and returns plain dataclasses; rendering lives in render. Positions are 0-based
indices into the sequence (prompt then generated tokens).

    results      the dataclasses the passes return
    rows         reading rows through ModelLogits, token texts, what a non-finite row leaves behind
    decode       one forward pass; greedy decoding
    verify       one verify pass over K drafts
    speculative  greedy speculative decoding (a draft model or prompt lookup)

The names below are re-exported for the callers that drive a whole pass (tests, scripts); the modules
of metrale_cli import from the module that defines a name.
"""

from .decode import run_decode, run_forward
from .results import (DecodeResult, DecodeStep, ForwardResult, ForwardRow, HiddenRows, HiddenSummary, Rows,
                      SpecDecodeResult, Timings, TopK, VerifyResult, VerifyRow)
from .rows import Reader, TextStream, continuation_text, describe_nonfinite
from .speculative import ModelDrafter, NgramDrafter, speculative_decode
from .verify import run_verify, ulp_distance

__all__ = [
    "DecodeResult", "DecodeStep", "ForwardResult", "ForwardRow", "HiddenRows", "HiddenSummary", "ModelDrafter",
    "NgramDrafter", "Reader", "Rows", "SpecDecodeResult", "TextStream", "Timings", "TopK", "VerifyResult",
    "VerifyRow", "continuation_text", "describe_nonfinite", "run_decode", "run_forward", "run_verify",
    "speculative_decode", "ulp_distance",
]
