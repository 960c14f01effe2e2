"""What the reports say (issue 11): the generated text, byte tokens, verify's unchecked rows and its
one-pass-equals-sequential figures, interrupted decodes, hidden-state dumps, inspect and bench fields.
The CLI runs in process (tests/conftest.py: run_cli)."""

from __future__ import annotations

import io
import json

from rich.console import Console

from metrale_cli import cli, render
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
    state = cli.State(out=Console(file=out, width=80, color_system=None), err=Console(file=io.StringIO()))
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
