"""What the reports say (issue 11): the generated text, byte tokens, verify's unchecked rows and its
one-pass-equals-sequential figures, interrupted decodes, hidden-state dumps, inspect and bench fields.
The CLI runs in process (tests/conftest.py: run_cli)."""

from __future__ import annotations

import io
import json

import numpy as np
import pytest
from rich.cells import cell_len
from rich.console import Console

from metrale_cli import render
from metrale_cli.cli.entry import State
from metrale_cli.model import DEFAULT_MODEL_DIR
from metrale_cli.tokenizer import Tokenizer

LLAMA = "tests/fixtures/models/llama"
EMOJI = "\U0001f642"


def as_json(result) -> dict:
    assert result.exit_code == 0, result.stderr
    return json.loads(result.stdout)


class TTY(io.StringIO):
    def isatty(self) -> bool:
        return True


def reference_tokenizer():
    """The tokenizers library itself, read from the embedded model's tokenizer.json."""
    from tokenizers import Tokenizer as HF

    return HF.from_file(str(DEFAULT_MODEL_DIR / "tokenizer.json"))


# -- item 8: the generated text ----------------------------------------------------------------------------------


def test_decode_text_is_the_tokenizers_decoding_of_the_generated_ids(run_cli):
    doc = as_json(run_cli("decode", "--steps", 12, "-f", "json"))
    ids = [s["token"] for s in doc["steps"]]
    assert doc["text"] == reference_tokenizer().decode(ids, skip_special_tokens=False)
    plain = run_cli("decode", "--steps", 12, "-f", "plain")
    assert f"text: {render.quote_text(doc['text'])}\n" in plain.stdout
    assert plain.stdout.count("\ntext: ") == 1


def test_byte_tokens_show_their_bytes(run_cli):
    """Drafts that are the four byte tokens of 🙂: each shows its byte, in JSON and plain (item 13)."""
    tok = Tokenizer.from_file(DEFAULT_MODEL_DIR / "tokenizer.json")
    ids = tok._inner.encode(EMOJI, add_special_tokens=False).ids
    doc = as_json(run_cli("verify", "--draft", " ".join(map(str, ids)), "-f", "json"))
    assert [row["draft_text"] for row in doc["rows"]] == ["<0xF0>", "<0x9F>", "<0x99>", "<0x82>"]
    plain = run_cli("verify", "--draft", " ".join(map(str, ids)), "-f", "plain")
    assert "<0xF0> |" in plain.stdout and "\ufffd" not in plain.stdout


def test_decode_without_tokenizer_has_no_text(run_cli):
    doc = as_json(run_cli("decode", "-m", LLAMA, "-t", "1 2 3", "--steps", 3, "-f", "json"))
    assert doc["text"] is None
    assert "\ntext: " not in run_cli("decode", "-m", LLAMA, "-t", "1 2 3", "--steps", 3, "-f", "plain").stdout


def test_rich_on_a_terminal_streams_the_text_before_the_table(run_cli):
    doc = as_json(run_cli("decode", "--steps", 10, "-f", "json"))
    out = TTY()
    state = State(out=Console(file=out, width=80, color_system=None), err=Console(file=io.StringIO()))
    assert run_cli("decode", "--steps", 10, "-f", "rich", obj=state).exit_code == 0
    shown = out.getvalue()
    streamed = "The for statement" + doc["text"]  # the prompt, then the continuation as it came
    assert streamed in shown
    assert shown.index(streamed) < shown.index("decode: 10 tokens")
    assert shown.count(doc["text"].splitlines()[0]) >= 1 and shown.count("prompt tokens") == 1


def test_rich_off_a_terminal_prints_the_text_once(run_cli):
    doc = as_json(run_cli("decode", "--steps", 10, "-f", "json"))
    r = run_cli("decode", "--steps", 10, "-f", "rich")
    assert r.exit_code == 0
    assert "The for statement" + doc["text"] in r.stdout


def test_text_is_decoded_from_the_ids_together_not_joined_per_token(run_cli, tok_model):
    from tokenizers import Tokenizer as HF

    doc = as_json(run_cli("decode", "-m", tok_model, "-t", "1 2 3", "--steps", 24, "--ignore-eos", "-f", "json"))
    ids = [s["token"] for s in doc["steps"]]
    assert doc["text"] == HF.from_file(str(tok_model / "tokenizer.json")).decode(ids, skip_special_tokens=False)
    assert any(s["text"].startswith("<0x") for s in doc["steps"])  # byte tokens shown as bytes...
    assert "<0x" not in doc["text"]  # ...but decoded together in the text


# -- items 10 and 11: verify ---------------------------------------------------------------------------------------


def _drafts_equal_to_targets_after_a_rejection(run_cli) -> list[int]:
    """d[0], d[1] greedy, d[2] wrong, then d[3], d[4] set to the very targets verify computes after the
    wrong draft (a target depends only on the drafts before it), so those rows have draft == target."""
    want = [row["target"] for row in as_json(run_cli("verify", "--k", 2, "-f", "json"))["rows"]]
    drafts = want + [(want[1] + 7) % 2048, 1, 1]
    for i in (3, 4):
        rows = as_json(run_cli("verify", "--draft", " ".join(map(str, drafts)), "-f", "json"))["rows"]
        drafts[i] = rows[i]["target"]
    return drafts


def test_verify_rows_after_the_first_rejection_are_not_checked(run_cli):
    drafts = _drafts_equal_to_targets_after_a_rejection(run_cli)
    ids = " ".join(map(str, drafts))
    doc = as_json(run_cli("verify", "--draft", ids, "-f", "json"))
    rows = doc["rows"]
    assert [r["draft"] == r["target"] for r in rows] == [True, True, False, True, True]
    assert [r["status"] for r in rows] == ["accepted", "accepted", "rejected", "unchecked", "unchecked"]
    assert [r["accepted"] for r in rows] == [True, True, False, None, None]
    assert doc["accepted"] == 2
    plain = run_cli("verify", "--draft", ids, "-f", "plain").stdout.splitlines()
    shown = [line.split()[3] for line in plain if line.split() and line.split()[0] in
             {str(r["position"]) for r in rows}]
    assert shown == ["yes", "yes", "no", "unchecked", "unchecked"]
    rich = run_cli("verify", "--draft", ids, "-f", "rich").stdout
    marks = [line.split("\u2502")[4].strip() for line in rich.splitlines() if line.count("\u2502") > 5]
    assert marks == ["\u2713", "\u2713", "\u2717", "\u00b7", "\u00b7"]
    assert "not checked: acceptance stopped at position" in rich


def _row_bits(engine, ptr):
    raw = bytearray(engine.row_nbytes(ptr))
    engine.copy_logits_to_host(ptr, raw)
    return np.frombuffer(bytes(raw), np.uint16)


def test_verify_self_reports_ulps_and_identical_rows(run_cli):
    """The figures against a computation of their own from the verify rows and the plain decode rows."""
    from metrale_cli.decoding.decode import run_decode
    from metrale_cli.model import open_model

    doc = as_json(run_cli("verify", "--k", 6, "-f", "json", "--logits-dtype", "bf16"))
    m = open_model(None, device="cpu", max_context=32, fp32_logits=False)
    try:
        seq = run_decode(m.engine, doc["prompt_tokens"], 7, keep_rows=True).rows.array()[1:]  # decode rows
        m.engine.reset()
        m.engine.prefill(doc["prompt_tokens"])
        m.engine.verify([r["draft"] for r in doc["rows"]])
        buf = m.engine.logits_buffer_ptr()
        ver = np.stack([_row_bits(m.engine, buf.row_ptr(i)) for i in range(6)])
    finally:
        m.close()

    def value(bits):  # bf16 bit patterns to float64, without ml_dtypes
        return (bits.astype(np.uint32) << 16).view(np.float32).astype(np.float64)

    def ordered(bits):
        b = bits.astype(np.int64)
        return np.where(b & 0x8000, -(b & 0x7FFF), b & 0x7FFF)

    diff = np.abs(value(ver) - value(seq))
    assert doc["max_abs_diff_vs_sequential"] == float(format(diff.max(), ".3e"))
    at_max = diff == diff.max()
    assert doc["max_abs_diff_ulps_vs_sequential"] == int(np.abs(ordered(ver) - ordered(seq))[at_max].max())
    assert doc["rows_identical_vs_sequential"] == int((ver == seq).all(axis=1).sum())
    plain = run_cli("verify", "--k", 6, "-f", "plain", "--logits-dtype", "bf16").stdout
    assert f"max_abs_diff_ulps_vs_sequential: {doc['max_abs_diff_ulps_vs_sequential']}\n" in plain
    assert f"rows_identical_vs_sequential: {doc['rows_identical_vs_sequential']}/6\n" in plain


def test_ulp_distance_counts_representable_values_between():
    from metrale_cli.decoding.verify import ulp_distance

    def bf16(*bits):
        return np.array(bits, "<u2").tobytes()

    # 1.0 vs the next bf16 up; +0 vs -0; the smallest subnormals of both signs; 8.0 vs 8.0625 (one step)
    a = bf16(0x3F80, 0x0000, 0x0001, 0x4100, 0xC100)
    b = bf16(0x3F81, 0x8000, 0x8001, 0x4101, 0x4100)
    assert ulp_distance(a, b, fp32=False).tolist() == [1, 0, 2, 1, 2 * 0x4100]
    x = np.float32(3.0)
    up = np.nextafter(np.nextafter(x, np.float32(4)), np.float32(4))
    assert ulp_distance(np.array([x], "<f4").tobytes(), np.array([up], "<f4").tobytes(), fp32=True).tolist() == [2]


# -- item 4: Ctrl-C during decode ---------------------------------------------------------------------------------


def _ctrl_c_after(monkeypatch, method: str, calls: int) -> None:
    """A real SIGINT to this process from inside the engine's `calls`-th decode/verify, as a Ctrl-C in
    the middle of decoding would arrive."""
    import os
    import signal

    from metrale_cli.backends.numpy.engine import NumpyEngine

    original = getattr(NumpyEngine, method)
    seen = [0]

    def interrupting(self, *args, **kwargs):
        seen[0] += 1
        out = original(self, *args, **kwargs)
        if seen[0] == calls:
            os.kill(os.getpid(), signal.SIGINT)
        return out

    monkeypatch.setattr(NumpyEngine, method, interrupting)


def _greedy(prompt: list[int], steps: int, model=None) -> list[int]:
    from metrale_cli.decoding.decode import run_decode
    from metrale_cli.model import open_model

    m = open_model(model, device="cpu", max_context=len(prompt) + steps)
    try:
        return [s.token for s in run_decode(m.engine, prompt, steps).steps]
    finally:
        m.close()


STOPPED = "metrale: interrupted: stopped by Ctrl-C after {} tokens (no dump file is written)"


def test_ctrl_c_json_reports_the_tokens_so_far(run_cli, monkeypatch, tmp_path):
    _ctrl_c_after(monkeypatch, "decode", 5)
    dump = tmp_path / "rows.npy"
    r = run_cli("decode", "--steps", 40, "--ignore-eos", "-f", "json", "--dump-logits", dump, "--hidden")
    assert r.exit_code == 130
    doc = json.loads(r.stdout)
    tokens = [s["token"] for s in doc["steps"]]
    assert doc["interrupted"] is True and doc["stopped_at_eos"] is False
    assert len(tokens) == 6  # the prefill's token and the 5 decode steps that ran
    assert tokens == _greedy(doc["prompt_tokens"], 6)
    assert doc["text"] == reference_tokenizer().decode(tokens, skip_special_tokens=False)
    assert doc["hidden"]["size"] > 0
    assert r.stderr.splitlines() == [STOPPED.format(6)]
    assert list(tmp_path.iterdir()) == []  # no dump of a partial run


def test_ctrl_c_in_speculative_decode(run_cli, monkeypatch):
    _ctrl_c_after(monkeypatch, "verify", 3)
    r = run_cli("decode", "-m", LLAMA, "-t", "5 6 7 8 5 6 7 8 5 6 7", "--steps", 60, "--ignore-eos",
                "--draft-model", LLAMA, "--k", 2, "-f", "json", "--timings")
    assert r.exit_code == 130
    doc = json.loads(r.stdout)
    tokens = [s["token"] for s in doc["steps"]]
    assert doc["interrupted"] is True and doc["speculative"]["verify_passes"] == 3
    assert len(tokens) == 1 + 3 * 3  # the prefill's token, then 3 passes of 2 accepted drafts + 1
    assert tokens == _greedy([5, 6, 7, 8, 5, 6, 7, 8, 5, 6, 7], len(tokens), LLAMA)
    assert "plain_tokens_per_s_mean" not in doc["timings"]  # the comparison run is not started
    assert r.stderr.splitlines() == [STOPPED.format(len(tokens))]


def test_ctrl_c_rich_and_plain_say_interrupted(run_cli, monkeypatch):
    _ctrl_c_after(monkeypatch, "decode", 3)
    out = TTY()
    state = State(out=Console(file=out, width=80, color_system=None), err=Console(file=io.StringIO()))
    assert run_cli("decode", "--steps", 40, "--ignore-eos", "-f", "rich", obj=state).exit_code == 130
    assert "decode: 4 tokens (interrupted by Ctrl-C)" in out.getvalue()
    _ctrl_c_after(monkeypatch, "decode", 3)
    r = run_cli("decode", "--steps", 40, "--ignore-eos", "-f", "plain")
    assert r.exit_code == 130 and "\nstopped: interrupted after 4 tokens\n" in r.stdout


def test_a_second_ctrl_c_interrupts_at_once(run_cli, monkeypatch):
    """The second Ctrl-C arrives inside the step the first one let finish: no report, exit 130."""
    import os
    import signal

    from metrale_cli.backends.numpy.engine import NumpyEngine

    original = NumpyEngine.decode

    def twice(self, token):
        os.kill(os.getpid(), signal.SIGINT)  # the first asks to stop after this step...
        os.kill(os.getpid(), signal.SIGINT)  # ...the second raises KeyboardInterrupt right here
        return original(self, token)

    monkeypatch.setattr(NumpyEngine, "decode", twice)
    r = run_cli("decode", "--steps", 40, "-f", "json")
    assert r.exit_code == 130 and r.stdout == ""
    assert r.stderr.splitlines() == ["metrale: interrupted: stopped by Ctrl-C (no partial output file is left)"]
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler  # the handler is put back


# -- item 7: rich output at 80 and 120 columns ---------------------------------------------------------------------

RICH_COMMANDS = {
    "decode": ["decode", "--steps", 6, "--top-k", 3, "--hidden", "--timings"],
    "speculative": ["decode", "--steps", 8, "--draft", "ngram", "--k", 4, "--hidden", "--timings"],
    "verify": ["verify", "--draft", "455 199 1761 10", "--hidden", "--timings"],
    "forward": ["forward", "--rows", "all", "--hidden", "--timings"],
    "inspect": ["inspect"],
}


@pytest.mark.parametrize("width", [80, 120])
@pytest.mark.parametrize("terminal", [False, True])
@pytest.mark.parametrize("command", RICH_COMMANDS)
def test_rich_output_fits_the_terminal(run_cli, command, width, terminal):
    out = TTY() if terminal else io.StringIO()
    state = State(out=Console(file=out, width=width, color_system=None), err=Console(file=io.StringIO()))
    args = RICH_COMMANDS[command]
    assert run_cli(*args, "-f", "rich", obj=state).exit_code == 0
    lines = out.getvalue().splitlines()
    assert lines and all(cell_len(line) <= width for line in lines), [ln for ln in lines if cell_len(ln) > width]
    if command == "decode":  # every candidate: its id, logit, probability and bar on one line
        doc = as_json(run_cli(*args, "-f", "json"))
        for step in doc["steps"]:
            for cand in step["top_k"]:
                assert any(f"\u2502 {cand['token']:>5} \u2502" in line and f" {cand['logit']:.4f} \u2502 "
                           f"{cand['prob']:.4f} \u2502 " in line for line in lines), cand


# -- item 17: inspect and bench ------------------------------------------------------------------------------------


@pytest.mark.parametrize("model", [None, "tests/fixtures/models/llama3_rope"])
def test_inspect_plain_has_every_json_key(run_cli, model):
    path = [model] if model else []
    doc = as_json(run_cli("inspect", *path, "-f", "json"))
    plain = run_cli("inspect", *path, "-f", "plain").stdout.splitlines()
    keys = [line.split(":", 1)[0] for line in plain[1:]]
    # "scanned" is said by the nonfinite line ("not scanned (--scan reads every tensor)" without --scan)
    assert set(keys) == set(doc) - {"command", "scanned"} - ({"problems"} if doc["problems"] is None else set())
    assert not doc["scanned"] and "nonfinite: not scanned (--scan reads every tensor)" in plain
    assert f"bos_token_id: {doc['bos_token_id'] if doc['bos_token_id'] is not None else 'n/a'}" in plain
    assert f"files: {' '.join(doc['files'])}" in plain


def test_inspect_unsupported_config_describes_what_it_can_then_exits_4(run_cli, tmp_path, helpers):
    supported = as_json(run_cli("inspect", LLAMA, "-f", "json"))
    model = helpers.copy_model(tmp_path / "g", config={"model_type": "gpt_neox",
                                                     "architectures": ["GPTNeoXForCausalLM"],
                                                     "hidden_act": "gelu"})
    r = run_cli("inspect", model, "-f", "json")
    assert r.exit_code == 4
    doc = json.loads(r.stdout)
    assert set(doc) == set(supported)
    assert doc["model_type"] == "gpt_neox" and doc["architecture"] == "GPTNeoXForCausalLM"
    same = ("layers", "heads", "kv_heads", "head_dim", "hidden", "intermediate", "vocab", "parameters", "dtypes",
            "shards", "files", "bytes", "tied_embeddings", "max_position_embeddings", "tokenizer")
    assert {k: doc[k] for k in same} == {k: supported[k] for k in same}  # from the raw fields and tensors
    assert doc["valid"] is False and "gpt_neox" in doc["problems"] and "model_type" in doc["problems"]
    assert r.stderr.count("\n") == 1 and r.stderr.startswith("metrale: config error: ") and "gpt_neox" in r.stderr
    plain = run_cli("inspect", model, "-f", "plain")
    assert plain.exit_code == 4 and "model_type: gpt_neox\n" in plain.stdout and "valid: no\n" in plain.stdout
    assert "problems: " in plain.stdout and "layers: 2\n" in plain.stdout


def test_inspect_config_that_is_not_json_prints_only_the_error(run_cli, tmp_path, helpers):
    model = helpers.copy_model(tmp_path / "bad")
    (model / "config.json").write_text("{not json")
    r = run_cli("inspect", model, "-f", "plain")
    assert r.exit_code == 4 and r.stdout == "" and "invalid JSON" in r.stderr


def test_bench_plain_leaves_out_the_fields_a_figure_does_not_have(run_cli, tmp_path):
    r = run_cli("bench", "--device", "cpu", "--preset", "tiny-llama", "--context", 16, "--prefill", 16,
                "--repeats", 2, "--ks", "1,4", "--no-transformers", "-f", "plain", "--json", tmp_path / "b.json")
    assert r.exit_code == 0
    figures = {f["name"]: f for f in json.loads((tmp_path / "b.json").read_text())["figures"]}  # the same run
    lines = {line.split(":", 1)[0]: line for line in r.stdout.splitlines()[2:]}
    assert set(figures) <= set(lines)
    for name, f in figures.items():
        fields = lines[name].split(" | ")
        assert all(field.strip() and not field.endswith(":") for field in fields), lines[name]
        assert any(x.startswith("target: ") for x in fields) == bool(f["target"])
        assert any(x.startswith("ratio: ") for x in fields) == (f["ratio"] is not None)
        assert (fields[-1] in ("met", "MISSED")) == (f["met"] is not None)


def test_a_long_prompt_is_echoed_in_part_and_kept_whole_in_json(run_cli, helpers, tmp_path):
    """2,480 prompt tokens: rich and plain echo the first 24 and the last 8 ids and say how many are left
    out; JSON holds every one. A long prompt text is cut the same way (render.common.echo_text)."""
    from metrale_cli.render.common import echo_text

    model = helpers.random_llama(tmp_path / "m", hidden=32, layers=1, heads=2, kv_heads=1, intermediate=32,
                                 vocab=512, max_positions=4096)
    ids = [i % 500 for i in range(2480)]
    args = ["forward", "-m", model, "-t", " ".join(map(str, ids))]
    plain = run_cli(*args, "-f", "plain").stdout
    line = next(x for x in plain.splitlines() if x.startswith("prompt_tokens: "))
    assert line == ("prompt_tokens: " + " ".join(map(str, ids[:24])) + " \u2026 " + " ".join(map(str, ids[-8:]))
                    + " (2480; 2448 not shown)")
    rich = run_cli(*args, "-f", "rich", env={"COLUMNS": "80"}).stdout
    assert "(2480; 2448 not shown)" in " ".join(rich.split()) and len(rich) < 4000
    assert json.loads(run_cli(*args, "-f", "json").stdout)["prompt_tokens"] == ids
    text = "x" * 1000
    assert echo_text(text) == "x" * 300 + " \u2026 (600 characters not shown) \u2026 " + "x" * 100
    assert echo_text("short text") == "short\u2423text"
