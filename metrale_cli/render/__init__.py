"""Turning results into Rich tables, plain text or JSON. This is the only package that prints.

One module per report (decode, verify, forward, inspect, bench, compare, score, reference: compare
--reference), beside common (the format choice, number formats, the header, JSON output, the lines on
stderr), text (token text made visible) and tails (the hidden-state summary and the timings).

Formats (`--format`, default: rich when stdout is a terminal, plain otherwise):
    rich   tables, colour for accepted/rejected drafts, bars for top-k probabilities, timings at the end;
           everything fits the console's width (80 columns included): a row of a table is one line
           (a top-k candidate is a row of its own; token texts are cut with an ellipsis rather than
           wrapped), and only prose (inspect's values, bench's targets) wraps at spaces
    plain  deterministic text: fixed column widths, no colour, nothing that depends on the terminal width;
           decode prints one line per step as it is produced, then "stopped: after N tokens (--steps)",
           "stopped: at EOS after N tokens" or "stopped: interrupted after N tokens"
    json   one JSON object per command (indented, UTF-8)

plain and json are snapshot-stable: timings appear only with --timings, and numbers have fixed formats:
logits, probabilities, margins and rates 4 decimals (%.4f; in JSON the same value as a number),
max_abs_diff_vs_sequential %.3e (4 significant digits), hidden-state statistics 6 significant digits
(%.6g), milliseconds 3 decimals, tokens/s 1 decimal. A NaN or infinite number is `null` in JSON.

Token text (plain and rich) is escaped so that whitespace and control characters are visible:
    space -> ␣ (U+2423);  newline, tab, carriage return -> \\n \\t \\r;  backslash -> \\\\;
    a literal ␣ -> \\u2423;  other control, format and separator characters -> \\uXXXX (\\UXXXXXXXX above
    U+FFFF);  every other printable character is kept as it is.
A token that is not valid UTF-8 on its own (a byte-level or byte-fallback piece of a multi-byte
character) shows the bytes that are no character as <0xF0><0x9F> (tokenizer.py), in every format.
In JSON, "text" fields hold the raw token text (JSON string escapes only), or null without a tokenizer.

The generated text of decode ("text") is decoded by the tokenizer from the produced ids together
(decoding.continuation_text), never joined from the token texts, so a character split over byte
tokens comes out whole. plain prints it on one line as a JSON string, `text: "..."` (quote_text: JSON's
escapes, and every other invisible character as \\uXXXX); rich prints it after the prompt, keeping
newlines, and on a terminal streams it while decoding; JSON holds it raw.

JSON keys (decode, verify and forward objects start with "command", "model" (the --model path as given,
or "default"), "device" ("cpu"|"cuda"), "compute" ("fp32"|"bf16": the engine's precision) and "logits_dtype"
("bf16"|"fp32"); "hidden" appears only with
--hidden or --dump-hidden, "timings" only with --timings; positions are 0-based):

decode   {"prompt": text|null, "prompt_tokens": [ids],
          "steps": [{"position", "token", "text", "logit", "argmax_note",
                     "top_k": [{"token", "text", "logit", "prob"}]}],
          "text": the generated text (null without a tokenizer), "stopped_at_eos": bool,
          "interrupted": bool (Ctrl-C stopped decoding: the report holds the tokens produced so far),
          "speculative": {"k", "draft_source", "draft_model", "drafted", "accepted", "acceptance_rate",
                          "mean_accepted_per_pass", "verify_passes", "acceptance_by_position": [rates]}
                         (only with --draft ngram or --draft-model)}
verify   {"prompt", "prompt_tokens", "k", "draft_source", "draft_model",
          "rows": [{"position", "draft", "draft_text", "target", "target_text", "accepted", "status",
                    "margin", "argmax_note"}],
          "accepted", "next_token", "next_text", "max_abs_diff_vs_sequential",
          "max_abs_diff_ulps_vs_sequential", "rows_identical_vs_sequential" (the last three null unless
          --draft self)}
         A row's "status" is "accepted", "rejected" or "unchecked": acceptance stops at the first
         rejection, so the rows after it are not checked, whatever their draft and target (their target
         is the argmax of a row that follows the rejected draft). "accepted" is true, false, or null for
         an unchecked row. plain shows yes / no / unchecked, rich a green check, a red cross, a dim dot.
         max_abs_diff_ulps_vs_sequential: max_abs_diff_vs_sequential in steps (ulps) of the logits dtype
         at the logit where it occurs (one bf16 step is 0.0625 for logits from 8 to 16);
         rows_identical_vs_sequential: how many of the k verify rows equal their decode rows bit for bit.
forward  {"prompt", "prompt_tokens", "rows": [{"position", "input", "argmax", "text", "logit", "argmax_note"}]}
"argmax_note" (decode steps, verify rows' target, forward rows): null, or for a bf16 row whose maximum is
          at several ids or whose fp32 argmax (before rounding; the NumPy engine) differs,
          {"tied": [ids] (empty when no tie; the lowest wins), "fp32_argmax": id|null}. plain ends such a
          line with "[bf16 tie 17=42, lowest wins; fp32 argmax 42]", rich adds a "bf16" column.
inspect  {"command", "model", "architecture", "model_type", "layers", "heads", "kv_heads",
          "head_dim", "hidden", "intermediate", "vocab", "max_position_embeddings", "sliding_window",
          "parameters", "dtype", "dtypes": {dtype: tensors}, "tensors" (how many the headers list), "shards",
          "files", "bytes", "tied_embeddings",
          "rope": {"theta", "type", "scaling", "rotary_fraction"}, "sliding_layers": [layer indices],
          "sliding_rope": {as rope} | null (when the sliding layers' rope differs), "attn_logit_softcapping",
          "final_logit_softcapping", "attention_scale", "norm", "post_norms", "activation", "embed_scale",
          "tokenizer", "bos_token_id", "eos_token_ids", "experts", "valid", "problems"}, plus, only when
          there is one, "latent_attention" {"layers", "q_lora_rank", "kv_lora_rank", "qk_nope_head_dim",
          "qk_rope_head_dim", "v_head_dim", "rope_interleave", "softmax_scale", "cache_floats_per_token"}
          (MLA models) and "notes": [what the checkpoint holds that is not run]
"hidden"  {"size", "norm", "mean", "std", "min", "max", "first": [8 values], "sha256"}
          (the post-final-norm hidden state of the last row the command produced, the last row of
          --dump-hidden: for decode, plain or speculative, the row that chose the last token; sha256 of
          its fp32 bytes)
"timings" every rate sits beside the time per token on the same basis, each named for it:
          X_per_token_ms_mean and X_tokens_per_s_mean are the time over the tokens and its reciprocal;
          per_token_ms_median and tokens_per_s_of_median the median step and its reciprocal.
          Every command: {"load_s", "prefill_ms", "prefill_per_token_ms_mean", "prefill_tokens_per_s_mean"}
          (score: every window's prefill, over the tokens the windows ran). decode adds the decode phase
          (the tokens after the first, which the prefill row gives, over the time after the prefill):
          "per_token_ms_mean", "tokens_per_s_mean", "per_token_ms_median", "tokens_per_s_of_median".
          Speculative decode has no per-token median (a verify pass gives one token or more): it adds
          "per_pass_ms_mean", "per_pass_ms_median" (per verify pass), "per_token_ms_mean",
          "tokens_per_s_mean", and with the comparison run "plain_per_token_ms_mean",
          "plain_tokens_per_s_mean" (plain greedy decoding of the same prompt on the same engine), "speedup",
          "plain_tokens_match". verify adds "verify_ms", "verify_per_token_ms_mean",
          "verify_tokens_per_s_mean" (the one pass over k drafts).

bench    {"preset", "device", "context", "params", "streamed_bytes", "kv_bytes",
          "figures": [{"name", "value", "unit", "target", "ratio", "met"}], "notes": [text],
          "paths": [{"path", "decode_ms", "floor_ratio", "bandwidth_fraction", "verify_ms": {k: ms},
                     "verify_ratio": {k: verify / that path's decode}, "logits_max_abs_diff" (vs the first path;
                     null for it), "argmax_matches", "fallbacks": {op: why unfused}}] (empty without --path;
          with it, "figures" are the first path's)

compare (logits)  {"command": "compare", "kind": "logits", "a"/"b": {"path", "source", "dtype", "shape"},
          "rows" (compared), "only_a_positions", "only_b_positions" (positions one side holds and the other
          not: rows pair up by position), "positions_selected" (--positions), "vocab",
          "overall": {"max_abs_diff", "max_abs_a", "rel_err", "nmse", "cosine", "rel_diff"}
          (null when no row is finite on both sides), "top1": {"agree", "rows", "rate"}, "top5_overlap",
          "top10_overlap", "softmax": {"kl_mean", "kl_max", "kl_percentiles": {"99.9", "99", "95", "90", "50",
          "10", "5", "1", "0.1"}, "kl_min", "dp_mean", "dp_max", "dp_percentiles": {"99.9", "99", "95", "90",
          "75", "50", "25", "10", "5", "1", "0.1"}, "dp_min", "dp_rms", "same_top_p_pct"},
          "argmax_mismatches": [{"row", "position", "a_token", "a_logit", "b_logit_at_a_token", "b_token",
          "a_logit_at_b_token", "b_logit", "margin_a"}], "first_argmax_mismatch": row|null,
          "nonfinite_rows": [rows], "tolerances": {"max_kl", "max_rel_err", "min_top1"} (null: not given),
          "first_exceeding": {"row", "position", "reasons": [text]}|null, "exceeding_rows",
          "passed": bool|null (null: no tolerance given), "failures": [text],
          "row_stats": [{"row", "position", "finite", "max_abs_diff", "max_abs_a", "rel_err", "nmse", "cosine",
          "rel_diff", "argmax_a", "argmax_b", "top5_overlap", "top10_overlap", "kl", "dp"}] (only with --rows)}
compare (layers)  {"command": "compare", "kind": "layers", "a"/"b": {"path", "source", "tensors"}, "rows",
          "only_a_positions", "only_b_positions", "positions_selected" (as for logits),
          "positions": [ints]|null, "tensors": [{"name", "shape", "max_abs_diff", "max_abs_a", "rel_err", "nmse",
          "cosine", "rel_diff", "worst_row", "worst_position", "nonfinite_mismatch", "diverged"}] (forward order),
          "only_in_a", "only_in_b", "rtol", "rtol_is_check", "first_divergence": {"name", "rel_err",
          "before_max_rel_err"}|null, "summary": the first-divergence line, "passed": bool|null, "failures"}
          Error statistics, KL and Δp are %.3e (4 significant digits), cosine %.8f, overlaps and rates %.4f,
          same_top_p_pct %.3f; positions are null for inputs that do not record them.
score     {"command", "model", "device", "compute", "logits_dtype", "prompt": text|null (null with --text-file),
          "text_file": path|null, "prompt_tokens": [ids], "chunk", "stride",
          "windows": [{"start", "end", "first_scored"}],
          "scored": [{"position", "token", "text", "logprob", "prob", "rank",
                      "top_k": [{"token", "text", "logit", "prob"}]}],
          "scored_tokens", "total_logprob", "mean_nll", "perplexity" (%.6g: six significant digits, what fp32
          logits support across BLAS builds; natural log),
          "timings": {"load_s", "prefill_ms", "tokens_per_s"} (only with --timings)}
"""

from .bench import render_bench
from .common import Meta, choose_format, error_line, f4, help_text, json_text, load_progress, note, num
from .compare import render_compare
from .decode import DecodeReport
from .forward import render_forward
from .inspect import render_inspect
from .reference import render_reference_check
from .score import render_score
from .text import display_text, escape_text, quote_text
from .verify import render_verify

__all__ = [
    "DecodeReport", "Meta", "choose_format", "display_text", "error_line", "escape_text", "f4", "help_text",
    "json_text", "load_progress", "note", "num", "quote_text", "render_bench", "render_compare", "render_forward",
    "render_inspect", "render_reference_check", "render_score", "render_verify",
]
