"""--chat, --system and --no-special-tokens: the prompt's token ids equal transformers' apply_chat_template.

Two checks of the same property: committed golden ids (tests/fixtures/chat/golden.json, made by
scripts/make_chat_fixtures.py with transformers) run everywhere; the `reference` tests compare live with
transformers on freshly drawn conversations and on template variants built in tmp.
"""

from __future__ import annotations

import itertools
import json
import shutil
import subprocess
import sys
from datetime import datetime
from pathlib import Path

import numpy as np
import pytest

from metrale_cli.chat import ChatTemplate, find_chat_template, render_chat, special_tokens
from metrale_cli.errors import CheckpointError, InputError, UsageError
from metrale_cli.inputs import PromptFormat, read_model_spec, resolve_prompt

REPO = Path(__file__).resolve().parent.parent
CHAT_FIXTURES = REPO / "tests" / "fixtures" / "chat"
GOLDEN = json.loads((CHAT_FIXTURES / "golden.json").read_text("utf-8"))
CASES = GOLDEN["cases"]
FIXTURE_NAMES = ("chatml", "llama3")

# Gemma-style: no system role. Its refusal is the template's own raise_exception.
NO_SYSTEM_TEMPLATE = ("{% if messages[0]['role'] == 'system' %}{{ raise_exception('System role not supported') }}"
                      "{% endif %}{% for m in messages %}<turn>{{ m['role'] }}\n{{ m['content'] }}</turn>\n"
                      "{% endfor %}{% if add_generation_prompt %}<turn>model\n{% endif %}")


def _no_stdin() -> str:
    raise AssertionError("stdin must not be read")


def chat_checkpoint(dest: Path, fixture: str, helpers) -> Path:
    """The llama fixture model (vocab 300) with the tokenizer files of chat fixture `fixture`."""
    helpers.copy_model(dest)
    for f in (CHAT_FIXTURES / fixture).iterdir():
        shutil.copy(f, dest / f.name)
    return dest


@pytest.fixture
def model(tmp_path, helpers):
    """model(name) -> a fresh chat checkpoint in tmp (a copy the test may edit), a new one per call."""
    made = itertools.count()
    return lambda name: chat_checkpoint(tmp_path / f"{name}-{next(made)}", name, helpers)


def ids_for(directory: Path, prompt: str, fmt: PromptFormat) -> tuple[list[int], str | None]:
    return resolve_prompt(read_model_spec(str(directory)), prompt, None, _no_stdin, fmt)


def case_id(case: dict) -> str:
    return f"{case['fixture']}-{CASES.index(case)}"


# -- golden ids (no transformers needed) -----------------------------------------------------------------------


@pytest.mark.parametrize("case", CASES, ids=case_id)
def test_chat_ids_equal_transformers_golden(case, model):
    ids, text = ids_for(model(case["fixture"]), case["prompt"], PromptFormat(chat=True, system=case["system"]))
    assert text == case["rendered"]
    assert ids == case["chat_ids"]


@pytest.mark.parametrize("case", CASES, ids=case_id)
def test_plain_ids_with_and_without_special_tokens_equal_golden(case, model):
    d = model(case["fixture"])
    assert ids_for(d, case["prompt"], PromptFormat()) == (case["plain_ids"], case["prompt"])
    assert ids_for(d, case["prompt"], PromptFormat(special_tokens=False)) == \
        (case["plain_ids_no_special"], case["prompt"])


def test_goldens_cover_bos_and_template_variants():
    """The goldens are worth something only if the fixtures differ where it matters."""
    llama = [c for c in CASES if c["fixture"] == "llama3"]
    bos = llama[0]["plain_ids"][0]
    assert all(c["plain_ids"] == [bos] + c["plain_ids_no_special"] for c in llama)  # a BOS post-processor
    assert all(c["chat_ids"].count(bos) == 1 and c["chat_ids"][0] == bos for c in llama)  # one BOS, the template's
    chatml = [c for c in CASES if c["fixture"] == "chatml"]
    assert all(c["plain_ids"] == c["plain_ids_no_special"] for c in chatml)
    assert any(c["system"] is None and "You are a helpful assistant." in c["rendered"] for c in chatml)


@pytest.mark.parametrize("case", GOLDEN["env_cases"], ids=lambda c: c["name"])
def test_jinja_environment_matches_transformers_golden(case):
    template = ChatTemplate(case["template"], Path("golden.json"))
    assert render_chat(template, GOLDEN["env_messages"], GOLDEN["env_specials"]) == case["rendered"]


def test_strftime_now_is_the_local_time():
    before = datetime.now()
    out = render_chat(ChatTemplate("{{ strftime_now('%Y-%m-%d %H') }}", Path("t")), [], {})
    after = datetime.now()
    assert out in {before.strftime("%Y-%m-%d %H"), after.strftime("%Y-%m-%d %H")}


# -- where the template and special tokens come from -------------------------------------------------------------


def _llama3_template() -> str:
    return json.loads((CHAT_FIXTURES / "llama3" / "tokenizer_config.json").read_text("utf-8"))["chat_template"]


def _edit_tokenizer_config(d: Path, **changes) -> None:
    path = d / "tokenizer_config.json"
    raw = json.loads(path.read_text("utf-8"))
    for key, value in changes.items():
        if value is None:
            raw.pop(key, None)
        else:
            raw[key] = value
    path.write_text(json.dumps(raw), "utf-8")


def test_a_named_list_uses_the_default_template(model):
    d = model("llama3")
    _edit_tokenizer_config(d, chat_template=[{"name": "tool_use", "template": "{{ raise_exception('no') }}"},
                                             {"name": "default", "template": _llama3_template()}])
    case = next(c for c in CASES if c["fixture"] == "llama3" and c["system"])
    ids, _ = ids_for(d, case["prompt"], PromptFormat(chat=True, system=case["system"]))
    assert ids == case["chat_ids"]
    assert find_chat_template(d).where.endswith("tokenizer_config.json (chat_template 'default')")


def test_a_named_list_without_default_is_an_input_error(model):
    d = model("llama3")
    _edit_tokenizer_config(d, chat_template=[{"name": "rag", "template": "x"}, {"name": "tool_use", "template": "y"}])
    with pytest.raises(InputError, match=r"\['rag', 'tool_use'\] and none is 'default'"):
        find_chat_template(d)


@pytest.mark.parametrize("bad", [42, [{"name": "default"}], {"default": "x"}])
def test_a_chat_template_of_the_wrong_type_is_a_checkpoint_error(model, bad):
    d = model("llama3")
    _edit_tokenizer_config(d, chat_template=bad)
    with pytest.raises(CheckpointError, match="must be a string or a list"):
        find_chat_template(d)


def test_chat_template_jinja_wins_over_tokenizer_config(model):
    d = model("chatml")
    _edit_tokenizer_config(d, chat_template="{{ raise_exception('the tokenizer_config template was used') }}")
    case = next(c for c in CASES if c["fixture"] == "chatml")
    assert ids_for(d, case["prompt"], PromptFormat(chat=True, system=case["system"]))[0] == case["chat_ids"]
    assert find_chat_template(d).source == d / "chat_template.jinja"


def test_no_template_names_both_places(model):
    d = model("llama3")
    _edit_tokenizer_config(d, chat_template=None)
    with pytest.raises(InputError) as e:
        ids_for(d, "Hello", PromptFormat(chat=True))
    assert str(d / "chat_template.jinja") in str(e.value) and str(d / "tokenizer_config.json") in str(e.value)


def test_invalid_tokenizer_config_is_a_checkpoint_error(model):
    d = model("llama3")
    (d / "tokenizer_config.json").write_text('{"chat_template": "x",', "utf-8")
    with pytest.raises(CheckpointError, match="tokenizer_config.json: not valid JSON"):
        ids_for(d, "Hello", PromptFormat(chat=True))


def test_special_tokens_come_from_tokenizer_config(model):
    d = model("llama3")  # bos_token in the AddedToken dict form, eos_token a string
    assert special_tokens(d) == {"bos_token": "<|begin_of_text|>", "eos_token": "<|eot_id|>"}
    _edit_tokenizer_config(d, eos_token=None, added_tokens_decoder=None)
    (d / "special_tokens_map.json").write_text(json.dumps({"eos_token": {"content": "<|end_of_text|>"}}))
    assert special_tokens(d) == {"bos_token": "<|begin_of_text|>", "eos_token": "<|end_of_text|>"}


# -- template failures --------------------------------------------------------------------------------------------


def _with_template(d: Path, text: str) -> Path:
    (d / "chat_template.jinja").write_text(text, "utf-8")
    return d


def test_raise_exception_is_an_input_error_with_its_message(model):
    d = _with_template(model("chatml"), NO_SYSTEM_TEMPLATE)
    with pytest.raises(InputError, match="refused the conversation: System role not supported"):
        ids_for(d, "Hello", PromptFormat(chat=True, system="Be brief."))
    assert ids_for(d, "Hello", PromptFormat(chat=True))[1] == "<turn>user\nHello</turn>\n<turn>model\n"


def test_a_syntax_error_names_the_file_and_line(model):
    d = _with_template(model("chatml"), "{% for m in messages %}\n{{ m['content'] }\n{% endfor %}")
    with pytest.raises(CheckpointError) as e:
        ids_for(d, "Hello", PromptFormat(chat=True))
    assert str(d / "chat_template.jinja") in str(e.value) and "syntax error at line 2" in str(e.value)


@pytest.mark.parametrize("text, culprit", [
    ("{{ messages[0]['content'] + 1 }}", "TypeError"),
    ("{{ ''.__class__.__mro__ }}", "SecurityError"),
    ("{% set ns = namespace() %}{% set ns._x = 1 %}", "underscore"),
])
def test_a_failing_template_is_a_checkpoint_error(model, text, culprit):
    d = _with_template(model("chatml"), text)
    with pytest.raises(CheckpointError, match=culprit):
        ids_for(d, "Hello", PromptFormat(chat=True))


@pytest.mark.parametrize("prompt, tokens, fmt, message", [
    ("Hello", None, PromptFormat(system="x"), "--system needs --chat"),
    (None, "1 2", PromptFormat(chat=True), "--tokens are ids already"),
    (None, None, PromptFormat(chat=True), "--chat needs --prompt"),
    (None, "1 2", PromptFormat(special_tokens=False), "--no-special-tokens"),
    ("Hello", None, PromptFormat(chat=True, special_tokens=False), "drop --no-special-tokens"),
])
def test_option_combinations_without_meaning_are_usage_errors(model, prompt, tokens, fmt, message):
    spec = read_model_spec(str(model("llama3")))
    with pytest.raises(UsageError, match=message):
        resolve_prompt(spec, prompt, tokens, _no_stdin, fmt)


def test_importing_the_cli_does_not_import_jinja2():
    code = "import sys, metrale_cli.cli; print('jinja2' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


# -- the CLI end to end, in process ------------------------------------------------------------------------------


@pytest.mark.parametrize("fixture", FIXTURE_NAMES)
def test_decode_chat_json_shows_the_template_tokens(run_cli, model, fixture):
    case = next(c for c in CASES if c["fixture"] == fixture and c["system"])
    r = run_cli("decode", "--model", model(fixture), "--chat", "--system", case["system"], "--prompt",
                case["prompt"], "--steps", 2, "--format", "json")
    assert r.exit_code == 0, r.stderr
    out = json.loads(r.stdout)
    assert out["prompt_tokens"] == case["chat_ids"]
    assert out["prompt"] == case["rendered"]
    assert [s["position"] for s in out["steps"]][0] == len(case["chat_ids"])


@pytest.mark.parametrize("command", ["verify", "forward", "score"])
def test_verify_forward_and_score_take_chat(run_cli, model, command):
    case = next(c for c in CASES if c["fixture"] == "llama3" and c["system"] is None)
    r = run_cli(command, "--model", model("llama3"), "--chat", "--prompt", case["prompt"], "--format", "json")
    assert r.exit_code == 0, r.stderr
    assert json.loads(r.stdout)["prompt_tokens"] == case["chat_ids"]


def test_forward_no_special_tokens_drops_the_bos(run_cli, model):
    case = next(c for c in CASES if c["fixture"] == "llama3")
    d = model("llama3")
    plain = run_cli("forward", "--model", d, "--prompt", case["prompt"], "--format", "json")
    bare = run_cli("forward", "--model", d, "--prompt", case["prompt"], "--no-special-tokens", "--format", "json")
    assert plain.exit_code == bare.exit_code == 0, plain.stderr + bare.stderr
    assert json.loads(plain.stdout)["prompt_tokens"] == case["plain_ids"]
    assert json.loads(bare.stdout)["prompt_tokens"] == case["plain_ids_no_special"]


def _no_template(d: Path) -> None:
    _edit_tokenizer_config(d, chat_template=None)


@pytest.mark.parametrize("args, edit, code, culprit", [
    (["--chat", "--tokens", "1 2"], None, 2, "--tokens are ids already"),
    (["--chat"], None, 2, "--chat needs --prompt"),
    (["--system", "x", "--prompt", "Hello"], None, 2, "--system needs --chat"),
    (["--no-special-tokens", "--tokens", "1"], None, 2, "--no-special-tokens"),
    (["--chat", "--no-special-tokens", "--prompt", "Hello"], None, 2, "drop --no-special-tokens"),
    (["--chat", "--prompt", "Hello"], _no_template, 5, "tokenizer_config.json"),
    (["--chat", "--system", "x", "--prompt", "Hello"],
     lambda d: _with_template(d, NO_SYSTEM_TEMPLATE), 5, "System role not supported"),
    (["--chat", "--prompt", "Hello"], lambda d: _with_template(d, "{% if %}"), 3, "chat_template.jinja"),
])
def test_chat_errors_are_one_line(run_cli, model, args, edit, code, culprit):
    d = model("llama3")
    if edit is not None:
        edit(d)
    for command in ("decode", "verify", "forward", "score"):
        r = run_cli(command, "--model", d, *args)
        assert r.exit_code == code, (command, r.stdout, r.stderr)
        assert len(r.stderr.splitlines()) == 1 and culprit in r.stderr, r.stderr
        assert "Traceback" not in r.stdout + r.stderr


def test_usage_errors_come_before_the_model_is_read(run_cli, tmp_path):
    r = run_cli("decode", "--model", tmp_path / "missing", "--system", "x", "--prompt", "Hello")
    assert r.exit_code == 2 and "--system needs --chat" in r.stderr


@pytest.mark.parametrize("command", ["decode", "verify", "forward", "score", "compare"])
def test_help_lists_the_chat_options(run_cli, command):
    r = run_cli(command, "--help", env={"COLUMNS": "200"})
    assert r.exit_code == 0
    for option in ("--chat", "--system", "--no-special-tokens"):
        assert option in r.stdout


# -- live against transformers --------------------------------------------------------------------------------------

ALPHABET = list("abcdefghij XYZ.,?!\n\t") + ["Hello", " the", " capital", "\u00e9", "\u00fc\u00df", "\U0001f642",
                                                 "\u2014", "<|im_end|>", "<|eot_id|>", "<|begin_of_text|>", "  "]


def _random_text(rng: np.random.Generator, lo: int = 1, hi: int = 24) -> str:
    text = "".join(rng.choice(ALPHABET, size=int(rng.integers(lo, hi))))
    return text if text.strip() else text + "x"


@pytest.fixture
def hf():
    pytest.importorskip("transformers")
    from transformers import AutoTokenizer

    return lambda d: AutoTokenizer.from_pretrained(str(d))


def _hf_chat_ids(tok, system: str | None, prompt: str) -> list[int]:
    msgs = ([{"role": "system", "content": system}] if system is not None else []) + \
        [{"role": "user", "content": prompt}]
    return list(tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True, return_dict=False))


@pytest.mark.reference
@pytest.mark.parametrize("fixture", FIXTURE_NAMES)
def test_live_random_conversations_equal_transformers(hf, model, fixture):
    seed = int(np.random.SeedSequence().entropy % 2**32)
    rng = np.random.default_rng(seed)
    d = model(fixture)
    tok = hf(d)
    for _ in range(20):
        system = _random_text(rng) if rng.random() < 0.6 else None
        prompt = _random_text(rng)
        ids, _ = ids_for(d, prompt, PromptFormat(chat=True, system=system))
        assert ids == _hf_chat_ids(tok, system, prompt), (seed, system, prompt)
        assert ids_for(d, prompt, PromptFormat(special_tokens=False))[0] == \
            tok(prompt, add_special_tokens=False)["input_ids"], (seed, prompt)
        assert ids_for(d, prompt, PromptFormat())[0] == tok(prompt)["input_ids"], (seed, prompt)


@pytest.mark.reference
def test_live_jinja_environment_equals_transformers():
    pytest.importorskip("transformers")
    from transformers.utils.chat_template_utils import render_jinja_template

    msgs = [{"role": "user", "content": "<b>caf\u00e9</b> & 'x'"}]
    templates = [c["template"] for c in GOLDEN["env_cases"]] + [
        "{{ strftime_now('%Y') }}|{{ messages | tojson(indent=1, sort_keys=True) }}",
        "{{ tools is none }}|{{ documents is none }}|{{ add_generation_prompt }}",
    ]
    for template in templates:
        want, _ = render_jinja_template(conversations=[msgs], chat_template=template, add_generation_prompt=True,
                                        bos_token="<s>")
        assert render_chat(ChatTemplate(template, Path("t")), msgs, {"bos_token": "<s>"}) == want[0], template


@pytest.mark.reference
def test_live_template_variants_equal_transformers(hf, model):
    """A named list, chat_template.jinja beside a tokenizer_config template, and legacy special_tokens_map."""
    listed = model("llama3")
    _edit_tokenizer_config(listed, chat_template=[{"name": "default", "template": _llama3_template()},
                                                  {"name": "rag", "template": "{{ raise_exception('rag') }}"}])
    both = model("chatml")
    _edit_tokenizer_config(both, chat_template="{{ bos_token }}{{ messages[-1]['content'] }}")
    legacy = _with_template(model("llama3"), "{{ bos_token }}[{{ eos_token }}]{{ messages[-1]['content'] }}")
    _edit_tokenizer_config(legacy, added_tokens_decoder=None, bos_token=None, chat_template=None)
    (legacy / "special_tokens_map.json").write_text(json.dumps({"bos_token": "<|begin_of_text|>",
                                                                "eos_token": "<|end_of_text|>"}))
    for d in (listed, both, legacy):
        for system in (None, "Be brief."):
            ids, _ = ids_for(d, "Hello the capital", PromptFormat(chat=True, system=system))
            assert ids == _hf_chat_ids(hf(d), system, "Hello the capital"), d.name


@pytest.mark.reference
def test_live_raise_exception_message_equals_transformers(hf, model):
    import jinja2

    d = _with_template(model("chatml"), NO_SYSTEM_TEMPLATE)
    with pytest.raises(jinja2.exceptions.TemplateError) as theirs:
        _hf_chat_ids(hf(d), "Be brief.", "Hello")
    with pytest.raises(InputError) as ours:
        ids_for(d, "Hello", PromptFormat(chat=True, system="Be brief."))
    assert str(ours.value).endswith(f": {theirs.value}")


@pytest.mark.reference
def test_compare_reference_takes_chat_and_checks_every_prompt_row(run_cli, model):
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    case = next(c for c in CASES if c["fixture"] == "llama3" and c["system"])
    r = run_cli("compare", "--reference", "transformers", "--model", model("llama3"), "--chat", "--system",
                case["system"], "--prompt", case["prompt"], "--steps", 2, "--format", "json")
    assert r.exit_code == 0, r.stderr
    doc = json.loads(r.stdout)
    n = len(case["chat_ids"])
    assert doc["prompt_tokens"] == case["chat_ids"] and doc["passed"]
    assert doc["positions"] == list(range(n + 2)) and doc["logits"]["rows"] == n + 2
    assert [row["position"] for row in doc["logits"]["row_stats"]] == list(range(n + 2))
