"""The CLI in process: commands, options, formats, help, and the error boundary."""

from __future__ import annotations

import io
import json
from pathlib import Path

import pytest
from rich.console import Console

from metrale_cli import cli, render  # cli: main, the console script
from metrale_cli.cli import job
from metrale_cli.cli.entry import State
from metrale_cli.decoding import decode as decode_pass
from metrale_cli.errors import EXIT_CODES
from metrale_cli.model import DEFAULT_MODEL_DIR, EMBEDDED_MODELS, model_dir, open_model

REPO = Path(__file__).resolve().parent.parent
LLAMA = "tests/fixtures/models/llama"  # relative: the CLI tests run in REPO
TOKENS = "1 2 3"


def greedy_tokens(model: str, prompt: list[int], steps: int) -> list[int]:
    """Plain greedy decoding straight through the engine, for comparison with the CLI."""
    from metrale_cli.decoding.decode import run_decode

    m = open_model(model, device="cpu", max_context=len(prompt) + steps)
    try:
        return [s.token for s in run_decode(m.engine, prompt, steps).steps]
    finally:
        m.close()


def as_json(result) -> dict:
    assert result.exit_code == 0, result.stderr
    return json.loads(result.stdout)


# -- help -------------------------------------------------------------------------------------------------------


def test_top_level_help_lists_exit_codes(run_cli):
    r = run_cli("--help")
    assert r.exit_code == 0
    for code, text in EXIT_CODES.items():
        assert f"{code:>3}  {text.split(' (')[0]}" in r.stdout


@pytest.mark.parametrize("command", ["decode", "verify", "forward", "inspect", "bench"])
def test_every_command_help_shows_an_example(run_cli, command):
    r = run_cli(command, "--help")
    assert r.exit_code == 0
    assert "Examples:" in r.stdout
    assert f"metrale {command}" in r.stdout.split("Examples:")[1]


def test_no_arguments_shows_help_and_exits_2(run_cli):
    r = run_cli()
    assert r.exit_code == 2
    assert "decode" in r.stdout + r.stderr and "Traceback" not in r.stderr


def test_version(run_cli):
    r = run_cli("--version")
    assert r.exit_code == 0 and r.stdout.startswith("metrale ")


# -- decode -----------------------------------------------------------------------------------------------------


def test_decode_json_matches_engine_greedy(run_cli):
    doc = as_json(run_cli("decode", "-m", LLAMA, "-t", TOKENS, "--steps", 6, "--top-k", 3, "-f", "json",
                          "--device", "cpu"))
    assert set(doc) >= {"model", "device", "logits_dtype", "prompt_tokens", "steps"}
    assert doc["prompt_tokens"] == [1, 2, 3] and doc["device"] == "cpu" and doc["logits_dtype"] == "fp32"
    assert [s["token"] for s in doc["steps"]] == greedy_tokens(LLAMA, [1, 2, 3], 6)
    assert [s["position"] for s in doc["steps"]] == list(range(3, 9))
    for s in doc["steps"]:
        assert set(s) == {"position", "token", "text", "logit", "argmax_note", "top_k"}
        assert len(s["top_k"]) == 3 and s["top_k"][0]["token"] == s["token"]
        probs = [t["prob"] for t in s["top_k"]]
        assert probs == sorted(probs, reverse=True) and 0 < sum(probs) <= 1.001
    assert "timings" not in doc and "hidden" not in doc and "speculative" not in doc


def test_decode_tokens_from_stdin_and_commas(run_cli):
    a = as_json(run_cli("decode", "-m", LLAMA, "-t", "-", "--steps", 3, "-f", "json", input="1, 2,3\n"))
    b = as_json(run_cli("decode", "-m", LLAMA, "-t", "1,2,3", "--steps", 3, "-f", "json"))
    assert a["prompt_tokens"] == b["prompt_tokens"] == [1, 2, 3]
    assert a["steps"] == b["steps"]


@pytest.mark.parametrize("text", ["[1, 2, 3]", "[1,2,3]\n", " [ 1 ,\n 2, 3 ] "])
def test_tokens_accept_a_json_array(run_cli, text):
    """The list form Python and JSON print, as --tokens and on stdin, means the same ids as '1 2 3'."""
    want = as_json(run_cli("forward", "-m", LLAMA, "-t", TOKENS, "--rows", "all", "-f", "json"))
    for args, stdin in ((["-t", text], None), (["-t", "-"], text)):
        doc = as_json(run_cli("forward", "-m", LLAMA, *args, "--rows", "all", "-f", "json", input=stdin))
        assert doc["prompt_tokens"] == [1, 2, 3] and doc["rows"] == want["rows"]


def test_verify_draft_accepts_a_json_array(run_cli):
    want = greedy_tokens(LLAMA, [1, 2, 3], 2)
    doc = as_json(run_cli("verify", "-m", LLAMA, "-t", TOKENS, "--draft", json.dumps(want), "-f", "json"))
    assert doc["k"] == 2 and [row["draft"] for row in doc["rows"]] == want and doc["accepted"] == 2


def test_top_k_beyond_the_vocabulary_is_capped_and_said(run_cli):
    r = run_cli("decode", "-m", LLAMA, "-t", TOKENS, "--steps", 2, "--top-k", 100000, "-f", "json")
    doc = as_json(r)
    assert "--top-k 100000 is more than the vocabulary: showing all 300 tokens" in r.stderr
    for s in doc["steps"]:  # every token once, best first: the whole distribution
        assert sorted(t["token"] for t in s["top_k"]) == list(range(300))
        # JSON rounds each prob to 4 decimals: 300 of them sum to 1 within 300 * 5e-5
        assert abs(sum(t["prob"] for t in s["top_k"]) - 1) <= 300 * 5e-5
    exact = run_cli("decode", "-m", LLAMA, "-t", TOKENS, "--steps", 2, "--top-k", 300, "-f", "json")
    assert json.loads(exact.stdout) == doc and exact.stderr == ""  # K = vocabulary: no note


def test_k_is_the_draft_count_and_minus_k_is_gone(run_cli):
    """--k counts drafts on decode and verify; -k (once short for --top-k) is now unknown, so
    `decode -k 2 --draft ngram` fails instead of silently meaning top-k 2 with 4 drafts."""
    doc = as_json(run_cli("decode", "-m", LLAMA, "-t", "5 6 7 5 6 7", "--steps", 6, "--draft", "ngram", "--k", 2,
                          "-f", "json"))
    assert doc["speculative"]["k"] == 2 and len(doc["speculative"]["acceptance_by_position"]) == 2
    assert all(s["top_k"] == [] for s in doc["steps"])
    doc = as_json(run_cli("verify", "-m", LLAMA, "-t", TOKENS, "--k", 2, "-f", "json"))
    assert doc["k"] == 2 and len(doc["rows"]) == 2
    for command in (["decode", "--draft", "ngram"], ["verify"]):
        r = run_cli(*command, "-m", LLAMA, "-t", TOKENS, "-k", 2)
        assert r.exit_code == 2 and "No such option: -k" in r.stderr, r.stderr
        assert r.stdout == ""


def test_decode_stops_at_eos_unless_ignored(run_cli, tmp_path, helpers):
    tokens = greedy_tokens(LLAMA, [1, 2, 3], 6)
    eos = tokens[2]
    model = helpers.copy_model(tmp_path / "eos", config={"eos_token_id": eos})
    doc = as_json(run_cli("decode", "-m", model, "-t", TOKENS, "--steps", 6, "-f", "json"))
    assert [s["token"] for s in doc["steps"]] == tokens[:tokens.index(eos) + 1] and doc["stopped_at_eos"]
    doc = as_json(run_cli("decode", "-m", model, "-t", TOKENS, "--steps", 6, "-f", "json", "--ignore-eos"))
    assert [s["token"] for s in doc["steps"]] == tokens and not doc["stopped_at_eos"]


def test_decode_fp32_logits(run_cli):
    doc = as_json(run_cli("decode", "-m", LLAMA, "-t", TOKENS, "--steps", 3, "-f", "json", "--logits-dtype", "fp32"))
    assert doc["logits_dtype"] == "fp32"
    assert [s["token"] for s in doc["steps"]] == greedy_tokens(LLAMA, [1, 2, 3], 3)


def test_decode_prompt_with_tokenizer_shows_escaped_text(run_cli, tok_model):
    r = run_cli("decode", "-m", tok_model, "-p", "The for statement", "--steps", 4, "-f", "plain")
    assert r.exit_code == 0, r.stderr
    assert "prompt: The\u2423for\u2423statement" in r.stdout
    assert "prompt_tokens: 257 260 269 (3)" in r.stdout
    doc = as_json(run_cli("decode", "-m", tok_model, "--steps", 2, "-f", "json"))  # the default prompt
    assert doc["prompt"] == "The for statement" and doc["prompt_tokens"] == [257, 260, 269]
    assert all(isinstance(s["text"], str) for s in doc["steps"])


@pytest.mark.parametrize("draft", ["ngram", "model", "other-model"])
def test_speculative_decode_gives_greedy_tokens(run_cli, draft):
    prompt = "5 6 7 8 5 6 7 8 5 6 7"
    args = {"ngram": ["--draft", "ngram"], "model": ["--draft-model", LLAMA],
            "other-model": ["--draft-model", "tests/fixtures/models/llama_bf16"]}[draft]
    doc = as_json(run_cli("decode", "-m", LLAMA, "-t", prompt, "--steps", 12, "--k", 3, *args, "-f", "json",
                          "--timings"))
    want = greedy_tokens(LLAMA, [int(t) for t in prompt.split()], 12)
    assert [s["token"] for s in doc["steps"]] == want
    spec = doc["speculative"]
    assert set(spec) == {"drafted", "accepted", "acceptance_rate", "mean_accepted_per_pass", "verify_passes",
                         "acceptance_by_position", "k", "draft_source", "draft_model"}
    assert spec["k"] == 3 and spec["draft_source"] == draft.replace("other-", "")
    assert len(spec["acceptance_by_position"]) == 3 and 0 <= spec["accepted"] <= spec["drafted"]
    if draft == "model":  # the model drafting for itself: every draft is accepted
        assert spec["acceptance_rate"] == 1.0 and spec["mean_accepted_per_pass"] == 3.0
        assert spec["verify_passes"] == 3
    t = doc["timings"]
    assert t["plain_tokens_match"] is True
    assert t["tokens_per_s_mean"] > 0 and t["plain_tokens_per_s_mean"] > 0


def test_hidden_summary_matches_engine(run_cli):
    doc = as_json(run_cli("forward", "-m", LLAMA, "-t", TOKENS, "-f", "json", "--hidden"))
    m = open_model(LLAMA, device="cpu", max_context=3)
    m.engine.prefill([1, 2, 3])
    import hashlib

    h = m.engine.copy_hidden_to_host()
    assert doc["hidden"]["sha256"] == hashlib.sha256(h.astype("<f4").tobytes()).hexdigest()
    assert set(doc["hidden"]) == {"size", "norm", "mean", "std", "min", "max", "first", "sha256"}
    assert doc["hidden"]["size"] == 64 and len(doc["hidden"]["first"]) == 8


@pytest.mark.parametrize("command", ["decode", "verify", "forward"])
def test_timings_only_on_request(run_cli, command):
    base = [command, "-m", LLAMA, "-t", TOKENS]
    plain = run_cli(*base, "-f", "plain")
    timed = run_cli(*base, "-f", "plain", "--timings")
    assert "timings" not in plain.stdout and "timings.load_s" in timed.stdout
    doc = as_json(run_cli(*base, "-f", "json", "--timings"))
    assert doc["timings"]["load_s"] >= 0 and doc["timings"]["prefill_ms"] > 0


TIMED = {"decode": ["--steps", 6], "speculative": ["--steps", 6, "--draft", "ngram"], "verify": [], "forward": [],
         "score": []}


@pytest.mark.parametrize("command", list(TIMED))
def test_timings_pair_each_rate_with_its_time_on_one_basis(run_cli, command):
    """Every per-token time sits beside the rate on the same basis, named for it: X_per_token_ms_mean with
    X_tokens_per_s_mean (one the reciprocal of the other), per_token_ms_median with tokens_per_s_of_median."""
    name = "decode" if command == "speculative" else command
    t = as_json(run_cli(name, "-m", LLAMA, "-t", "1 2 3 1 2", *TIMED[command], "-f", "json", "--timings"))["timings"]
    pairs = [(k, k.replace("per_token_ms", "tokens_per_s")) for k in t if "per_token_ms_mean" in k]
    pairs += [("per_token_ms_median", "tokens_per_s_of_median")] if "per_token_ms_median" in t else []
    want = {"decode": 3, "speculative": 3, "verify": 2, "forward": 1, "score": 1}[command]
    assert len(pairs) == want, t
    for ms, rate in pairs:
        assert t[ms] > 0 and 1000 / t[rate] == pytest.approx(t[ms], rel=1e-3, abs=6e-4), (ms, rate)  # ms: 3 decimals
    assert not [k for k in t if k.endswith("tokens_per_s") or k.endswith("_ms_median") and "per_" not in k]
    assert "per_pass_ms_median" in t and "per_pass_ms_mean" in t if command == "speculative" else True


@pytest.mark.parametrize("command", ["decode", "verify", "forward"])
def test_rich_format_renders(run_cli, command):
    extra = ["--top-k", 2, "--hidden", "--timings"] if command == "decode" else ["--timings"]
    r = run_cli(command, "-m", LLAMA, "-t", TOKENS, "-f", "rich", *extra)
    assert r.exit_code == 0, r.stderr
    assert command in r.stdout and "timings" in r.stdout


def test_default_format_is_rich_on_a_terminal_and_plain_otherwise(run_cli):
    class TTY(io.StringIO):
        def isatty(self):
            return True

    out = TTY()
    state = State(out=Console(file=out, width=100), err=Console(file=io.StringIO()))
    assert run_cli("forward", "-m", LLAMA, "-t", TOKENS, obj=state).exit_code == 0
    assert "\u2503" in out.getvalue() or "\u2502" in out.getvalue()  # a table border
    r = run_cli("forward", "-m", LLAMA, "-t", TOKENS)
    assert r.stdout.startswith("metrale forward\n")


# -- verify and forward --------------------------------------------------------------------------------------------


def test_verify_self_accepts_everything_and_matches_sequential(run_cli):
    doc = as_json(run_cli("verify", "-m", LLAMA, "-t", TOKENS, "--k", 4, "-f", "json", "--logits-dtype", "fp32"))
    want = greedy_tokens(LLAMA, [1, 2, 3], 5)
    assert doc["draft_source"] == "self" and doc["accepted"] == 4 and doc["next_token"] == want[4]
    assert [row["draft"] for row in doc["rows"]] == want[:4]
    assert all(row["accepted"] and row["margin"] >= 0 for row in doc["rows"])
    assert doc["max_abs_diff_vs_sequential"] < 1e-3


def test_verify_given_ids_stops_at_first_mismatch(run_cli):
    want = greedy_tokens(LLAMA, [1, 2, 3], 4)
    wrong = (want[1] + 1) % 300
    drafts = f"{want[0]},{wrong},{want[2]}"
    doc = as_json(run_cli("verify", "-m", LLAMA, "-t", TOKENS, "--draft", drafts, "-f", "json"))
    assert doc["k"] == 3 and doc["draft_source"] == "ids"  # k taken from the ids
    assert [row["accepted"] for row in doc["rows"]] == [True, False, None]  # d[2] is not checked
    assert [row["status"] for row in doc["rows"]] == ["accepted", "rejected", "unchecked"]
    assert doc["accepted"] == 1 and doc["next_token"] == want[1]
    assert doc["max_abs_diff_vs_sequential"] is None and doc["max_abs_diff_ulps_vs_sequential"] is None
    assert doc["rows_identical_vs_sequential"] is None


def test_verify_with_draft_model(run_cli):
    doc = as_json(run_cli("verify", "-m", LLAMA, "-t", TOKENS, "--k", 3, "--draft-model",
                          "tests/fixtures/models/llama_bf16", "-f", "json"))
    assert doc["draft_source"] == "model" and doc["draft_model"] == "tests/fixtures/models/llama_bf16"
    assert len(doc["rows"]) == 3


# -- embedded models by name -------------------------------------------------------------------------------------


def test_embedded_models_live_beside_the_default():
    for name in EMBEDDED_MODELS:
        assert model_dir(name) == DEFAULT_MODEL_DIR.parent / name
        assert (model_dir(name) / "config.json").is_file()


def test_embedded_models_by_name_work_from_any_directory(run_cli, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # outside the repository: the names must not depend on the cwd
    named = as_json(run_cli("decode", "--model", "default", "--steps", 8, "--draft-model", "default-draft",
                            "--k", 4, "-f", "json"))
    plain = as_json(run_cli("decode", "--steps", 8, "-f", "json"))
    assert named["model"] == "default" and named["speculative"]["draft_model"] == "default-draft"
    assert [s["token"] for s in named["steps"]] == [s["token"] for s in plain["steps"]]
    draft = as_json(run_cli("inspect", "default-draft", "-f", "json"))
    assert draft["model"] == "default-draft" and draft["valid"]
    assert draft["parameters"] < as_json(run_cli("inspect", "default", "-f", "json"))["parameters"]
    doc = as_json(run_cli("verify", "--draft-model", "default-draft", "--k", 2, "-f", "json"))
    assert doc["draft_model"] == "default-draft" and len(doc["rows"]) == 2


def test_an_existing_path_wins_over_an_embedded_name(run_cli, tmp_path, monkeypatch, helpers):
    helpers.copy_model(tmp_path / "default")  # the 300-token fixture, under the embedded model's name
    monkeypatch.chdir(tmp_path)
    doc = as_json(run_cli("inspect", "default", "-f", "json"))
    assert doc["vocab"] == 300 and doc["model"] == "default"
    r = run_cli("forward", "--model", "default", "-t", TOKENS, "-f", "json")
    assert as_json(r)["rows"][0]["argmax"] == greedy_tokens(str(tmp_path / "default"), [1, 2, 3], 1)[0]


def test_unknown_model_name_lists_the_embedded_ones(run_cli, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    r = run_cli("decode", "--model", "default-draft2", "-t", TOKENS)
    assert r.exit_code == 3
    assert "default-draft2: no such file or directory (embedded models: default, default-draft)" in r.stderr


def test_forward_rows(run_cli):
    last = as_json(run_cli("forward", "-m", LLAMA, "-t", TOKENS, "-f", "json"))
    every = as_json(run_cli("forward", "-m", LLAMA, "-t", TOKENS, "-f", "json", "--rows", "all"))
    assert [r["position"] for r in last["rows"]] == [2]
    assert [r["position"] for r in every["rows"]] == [0, 1, 2]
    assert every["rows"][2] == last["rows"][0]
    assert every["rows"][2]["argmax"] == greedy_tokens(LLAMA, [1, 2, 3], 1)[0]
    assert [r["input"] for r in every["rows"]] == [1, 2, 3]


# -- inspect --------------------------------------------------------------------------------------------------------


def test_inspect_fields(run_cli):
    doc = as_json(run_cli("inspect", "tests/fixtures/models/llama3_rope", "-f", "json"))
    assert doc["architecture"] == "LlamaForCausalLM" and doc["layers"] == 2 and doc["heads"] == 4
    assert doc["kv_heads"] == 2 and doc["head_dim"] == 16 and doc["hidden"] == 64 and doc["vocab"] == 300
    assert doc["shards"] == 3 and doc["bytes"] > 0 and doc["dtypes"] == {"F32": 21}
    assert doc["rope"]["type"] == "llama3" and doc["tokenizer"] is False and doc["valid"] is True
    from metrale_cli.config import load_config

    assert doc["parameters"] == load_config(REPO / "tests/fixtures/models/llama3_rope").parameter_count()
    tied = as_json(run_cli("inspect", "tests/fixtures/models/qwen3", "-f", "json"))
    assert tied["tied_embeddings"] is True and tied["head_dim"] == 24


def test_inspect_invalid_checkpoint_describes_then_fails(run_cli, tmp_path, helpers):
    model = helpers.copy_model(tmp_path / "m")
    helpers.edit_tensors(model, lambda t: t.pop("model.norm.weight"))
    r = run_cli("inspect", model, "-f", "plain")
    assert r.exit_code == 3
    assert "valid: no" in r.stdout and "model.norm.weight" in r.stdout
    assert r.stderr.count("\n") == 1 and "model.norm.weight" in r.stderr


def test_inspect_takes_model_as_every_command_does(run_cli):
    """inspect --model PATH is inspect PATH; both at once must agree."""
    by_option = run_cli("inspect", "--model", LLAMA, "-f", "json")
    assert by_option.exit_code == 0 and by_option.stdout == run_cli("inspect", LLAMA, "-f", "json").stdout
    assert run_cli("inspect", "-m", LLAMA, LLAMA, "-f", "json").stdout == by_option.stdout
    both = run_cli("inspect", LLAMA, "--model", "default")
    assert both.exit_code == 2 and "not both" in both.stderr


@pytest.mark.parametrize("keep", [0.5, 0.0001])
def test_inspect_describes_a_truncated_checkpoint_then_exits_3(run_cli, tmp_path, helpers, keep):
    """A weights file that does not open: config.json's description, the tensors its header still lists
    (none when the header itself is cut), and what is wrong; exit 3, one line on stderr."""
    import os

    model = helpers.copy_model(tmp_path / "m")
    weights = model / "model.safetensors"
    os.truncate(weights, int(weights.stat().st_size * keep))
    r = run_cli("inspect", "--model", model, "-f", "json")
    assert r.exit_code == 3 and r.stderr.count("\n") == 1 and "truncated" in r.stderr
    doc = json.loads(r.stdout)
    assert doc["valid"] is False and doc["layers"] == 2 and doc["vocab"] == 300 and "truncated" in doc["problems"]
    if keep == 0.5:
        assert doc["tensors"] == 21 and doc["dtypes"] == {"F32": 21}
        assert "listed tensors lie beyond the end of their file" in doc["problems"]
    else:
        assert doc["tensors"] == 0 and doc["files"] == ["model.safetensors"]
    plain = run_cli("inspect", model, "-f", "plain")
    assert plain.exit_code == 3 and "valid: no" in plain.stdout and "problems: " in plain.stdout


# -- the error boundary ------------------------------------------------------------------------------------------------


def test_internal_error_is_one_line_exit_70(run_cli, monkeypatch):
    def boom(*a, **k):
        raise RuntimeError("boom\nsecond line")

    monkeypatch.setattr(decode_pass, "run_forward", boom)  # cli imports it when forward runs
    r = run_cli("forward", "-m", LLAMA, "-t", TOKENS, env={"METRALE_DEBUG": None})
    assert r.exit_code == 70
    assert r.stderr == ("metrale: internal error: RuntimeError: boom second line "
                        "(set METRALE_DEBUG=1 for the traceback)\n")
    r = run_cli("forward", "-m", LLAMA, "-t", TOKENS, env={"METRALE_DEBUG": "1"})
    assert r.exit_code == 70 and "Traceback" in r.stderr and "boom" in r.stderr


def test_keyboard_interrupt_is_one_line_exit_130(run_cli, monkeypatch):
    def interrupted(*a, **k):
        raise KeyboardInterrupt

    monkeypatch.setattr(decode_pass, "run_forward", interrupted)
    r = run_cli("forward", "-m", LLAMA, "-t", TOKENS)
    assert r.exit_code == 130
    assert r.stderr == "metrale: interrupted: stopped by Ctrl-C (no partial output file is left)\n"


def test_main_exits_with_the_code(monkeypatch, capsys):
    monkeypatch.chdir(REPO)
    with pytest.raises(SystemExit) as e:
        cli.main(["forward", "-m", LLAMA, "-t", "1 999"])
    assert e.value.code == 5
    assert capsys.readouterr().err.startswith("metrale: input error: --tokens: token id 999")


def test_load_progress_bar_only_for_large_checkpoints_on_a_terminal():
    class TTY(io.StringIO):
        def isatty(self):
            return True

    tty = TTY()
    with render.load_progress(Console(file=tty, width=80), "big") as progress:
        progress(100, 300_000_000)
        progress(300_000_000, 300_000_000)
    assert "loading" in tty.getvalue()
    small = TTY()
    with render.load_progress(Console(file=small), "small") as progress:
        progress(100, 1000)
    pipe = io.StringIO()
    with render.load_progress(Console(file=pipe), "big") as progress:
        progress(100, 300_000_000)
    assert small.getvalue() == "" and pipe.getvalue() == ""


def test_context_is_sized_to_the_job(run_cli, monkeypatch):
    seen = []
    real = job.open_model

    def spy(path, **kw):
        seen.append(kw["max_context"])
        return real(path, **kw)

    monkeypatch.setattr(job, "open_model", spy)
    assert run_cli("decode", "-m", LLAMA, "-t", TOKENS, "--steps", 5).exit_code == 0
    assert run_cli("verify", "-m", LLAMA, "-t", TOKENS, "--k", 2).exit_code == 0
    assert run_cli("decode", "-m", LLAMA, "-t", TOKENS, "--steps", 5, "--draft", "ngram", "--k", 4).exit_code == 0
    assert run_cli("forward", "-m", LLAMA, "-t", TOKENS, "--max-context", 50).exit_code == 0
    assert seen == [7, 5, 11, 50]  # decode: the last token is never fed back (3 + 5 - 1)


def test_random_model_helper_runs(run_cli, tmp_path, helpers):
    model = helpers.random_llama(tmp_path / "r", vocab=512, max_positions=64)
    doc = as_json(run_cli("decode", "-m", model, "-t", TOKENS, "--steps", 2, "-f", "json"))
    assert len(doc["steps"]) == 2


# -- --compute -----------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("command", ["decode", "verify", "forward", "score"])
def test_compute_bf16_runs_the_bf16_engine_and_says_so(run_cli, command):
    """--compute bf16: the NumPy engine's bf16 mode, named in every format's header."""
    from metrale_cli import decoding
    from metrale_cli.model import open_model

    args = [command, "-m", "tests/fixtures/models/gemma2", "-t", TOKENS, "--device", "cpu", "--compute", "bf16"]
    doc = as_json(run_cli(*args, "-f", "json", "--logits-dtype", "fp32"))
    assert doc["compute"] == "bf16" and doc["logits_dtype"] == "fp32"
    plain = run_cli(*args, "-f", "plain")
    assert plain.exit_code == 0 and "\ncompute: bf16\n" in plain.stdout, plain.stderr
    if command == "forward":
        eng = open_model("tests/fixtures/models/gemma2", device="cpu", max_context=8, fp32_logits=True,
                         compute="bf16").engine
        want = decoding.run_forward(eng, [1, 2, 3], all_rows=False, keep_rows=True).rows[-1].logit
        assert doc["rows"][-1]["logit"] == pytest.approx(want, abs=1e-4)
    fp32 = as_json(run_cli(command, "-m", "tests/fixtures/models/gemma2", "-t", TOKENS, "--device", "cpu", "-f",
                           "json", "--logits-dtype", "fp32"))
    assert fp32["compute"] == "fp32"


def test_compute_takes_fp32_or_bf16(run_cli):
    r = run_cli("decode", "--compute", "fp16", "--device", "cpu")
    assert r.exit_code == 2 and "--compute must be one of fp32, bf16, got 'fp16'" in r.stderr
