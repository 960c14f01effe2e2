#!/usr/bin/env python
"""Build the chat-template fixtures and their golden token ids with Hugging Face transformers.

Writes, under tests/fixtures/chat/:
  chatml/   tokenizer.json, tokenizer_config.json, chat_template.jinja   (SmolLM2 / Qwen style ChatML)
  llama3/   tokenizer.json, tokenizer_config.json with "chat_template"  (Llama-3 style: bos_token,
            raise_exception, a BOS-adding post-processor)
  golden.json  for every fixture and conversation: transformers' rendered text and
            apply_chat_template(..., add_generation_prompt=True, tokenize=True) ids, and the plain
            encodings of the prompt with and without special tokens; plus small templates that pin the
            jinja environment (tojson, loopcontrols, trim/lstrip blocks, namespace, {% generation %})
            rendered by transformers' own render_jinja_template.

Nothing here uses metrale_cli: the tokenizers are built with `tokenizers`, the templates are written out
below, and every golden value comes from transformers. Deterministic; no network. Regenerate with

    python scripts/make_chat_fixtures.py
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import tokenizers  # noqa: E402
import transformers  # noqa: E402
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors  # noqa: E402
from transformers import AutoTokenizer  # noqa: E402
from transformers.utils.chat_template_utils import render_jinja_template  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
OUT = ROOT / "tests" / "fixtures" / "chat"

BASE_VOCAB = 290  # byte symbols + merges; the special tokens come after (the fixture models have vocab 300)

# Words the conversations below use, so they encode to a few tokens each rather than byte by byte.
WORDS = ["You", "\u0120are", "\u0120a", "\u0120helpful", "\u0120assistant", "system", "user", "assistant",
         "What", "\u0120is", "\u0120the", "\u0120capital", "\u0120of", "\u0120France", "Hello", "\u010a",
         "\u010a\u010a", "\u0120for", "\u0120statement", "\u0120Be", "\u0120brief"]

# A ChatML template in the style of SmolLM2-Instruct and Qwen2: a default system message when there is
# none, one <|im_start|>role ... <|im_end|> block per message. Written over several lines with indented
# block tags, so it renders plain ChatML only with trim_blocks and lstrip_blocks (as transformers sets them).
CHATML_TEMPLATE = """\
{% for message in messages %}
    {% if loop.first and message['role'] != 'system' %}
<|im_start|>system
You are a helpful assistant.<|im_end|>
    {% endif %}
<|im_start|>{{ message['role'] }}
{{ message['content'] }}<|im_end|>
{% endfor %}
{% if add_generation_prompt %}
<|im_start|>assistant
{% endif %}
"""

# A Llama-3 style template: BOS from the bos_token variable, headers, trimmed contents, raise_exception
# for conversations it cannot format, and {% continue %} from the loopcontrols extension.
LLAMA3_TEMPLATE = """\
{{- bos_token }}
{%- if messages[0]['role'] == 'system' %}
    {%- set system_message = messages[0]['content'] | trim %}
    {{- '<|start_header_id|>system<|end_header_id|>\\n\\n' + system_message + '<|eot_id|>' }}
{%- endif %}
{%- set ns = namespace(turn=0) %}
{%- for message in messages %}
    {%- if message['role'] == 'system' %}
        {%- if not loop.first %}
            {{- raise_exception('A system message must come first') }}
        {%- endif %}
        {%- continue %}
    {%- endif %}
    {%- if (message['role'] == 'user') != (ns.turn % 2 == 0) %}
        {{- raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}
    {%- endif %}
    {{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n' + message['content'] | trim + '<|eot_id|>' }}
    {%- set ns.turn = ns.turn + 1 %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}
{%- endif %}
"""

FIXTURES = {
    "chatml": dict(
        specials=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
        bos_processor=None,
        # SmolLM2-Instruct's settings: GPT2Tokenizer class, <|im_start|>/<|im_end|> as bos/eos.
        config={"tokenizer_class": "GPT2Tokenizer", "bos_token": "<|im_start|>", "eos_token": "<|im_end|>",
                "unk_token": "<|endoftext|>", "pad_token": "<|im_end|>", "add_prefix_space": False},
        template_file=CHATML_TEMPLATE,
    ),
    "llama3": dict(
        specials=["<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>",
                  "<|eot_id|>"],
        bos_processor="<|begin_of_text|>",
        # Llama-3's settings: the plain fast tokenizer class, bos_token in the AddedToken dict form.
        config={"tokenizer_class": "PreTrainedTokenizerFast",
                "bos_token": {"__type": "AddedToken", "content": "<|begin_of_text|>", "lstrip": False,
                              "normalized": False, "rstrip": False, "single_word": False, "special": True},
                "eos_token": "<|eot_id|>", "chat_template": LLAMA3_TEMPLATE},
        template_file=None,
    ),
}

CONVERSATIONS = [  # (system, user prompt)
    (None, "What is the capital of France?"),
    ("You are a helpful assistant. Be brief.", "Hello"),
    ("  Spaces around the system message  \n", "  and around the prompt  \n"),
    (None, "Gr\u00fc\u00dfe \U0001f642 \u2014 caf\u00e9?"),
    (None, "a literal <|im_end|> and <|eot_id|> in the text"),
    ("", "an empty system message"),
]

# Templates that pin single features of transformers' jinja environment.
ENV_CASES = {
    "tojson": "{{ {'text': messages[0]['content'], 'n': 1} | tojson }}|{{ [1, 'x'] | tojson(indent=2) }}",
    "loopcontrols": "{% for m in ['a', 'b', 'c', 'd'] %}{% if m == 'b' %}{% continue %}{% endif %}"
                    "{% if m == 'd' %}{% break %}{% endif %}{{ m }}{% endfor %}",
    "blocks": "<\n  {% if true %}\n    x\n  {% endif %}\n  {%+ if true %}y{% endif %}\n>",
    "namespace": "{% set ns = namespace(total=0) %}{% for m in messages %}{% set ns.total = ns.total + "
                 "m['content'] | length %}{% endfor %}{{ ns.total }}",
    "generation": "{% for m in messages %}{% generation %}[{{ m['content'] }}]{% endgeneration %}{% endfor %}",
    "dict": "{{ dict(a=1, b=2) | dictsort | list }}",
    "special_tokens": "{{ bos_token }}|{{ eos_token }}|{{ unk_token is defined }}",
}
ENV_MESSAGES = [{"role": "user", "content": "<caf\u00e9 & \"tea\">"}]
ENV_SPECIALS = {"bos_token": "<s>", "eos_token": "</s>"}


def base_tokenizer() -> Tokenizer:
    """Byte-level BPE: the 256 byte symbols plus merges spelling WORDS, then letter pairs up to BASE_VOCAB."""
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    vocab = {ch: i for i, ch in enumerate(alphabet)}
    merges: list[tuple[str, str]] = []
    for word in WORDS:
        for end in range(2, len(word) + 1):
            piece, last = word[:end - 1], word[end - 1]
            if piece + last not in vocab and len(vocab) < BASE_VOCAB:
                merges.append((piece, last))
                vocab[piece + last] = len(vocab)
    pairs = iter((a, b) for a in "etaoinsrhl" for b in "etaoinsrhl")
    while len(vocab) < BASE_VOCAB:
        a, b = next(pairs)
        if a + b not in vocab:
            merges.append((a, b))
            vocab[a + b] = len(vocab)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    return tok


def write_fixture(name: str, spec: dict) -> Path:
    d = OUT / name
    d.mkdir(parents=True, exist_ok=True)
    for stale in ("chat_template.jinja",):
        (d / stale).unlink(missing_ok=True)
    tok = base_tokenizer()
    tok.add_special_tokens(list(spec["specials"]))
    if spec["bos_processor"] is not None:
        bos = spec["bos_processor"]
        tok.post_processor = processors.TemplateProcessing(
            single=f"{bos} $A", pair=f"{bos} $A {bos} $B", special_tokens=[(bos, tok.token_to_id(bos))])
    tok.save(str(d / "tokenizer.json"), pretty=True)
    added = {str(tok.token_to_id(t)): {"content": t, "lstrip": False, "normalized": False, "rstrip": False,
                                       "single_word": False, "special": True} for t in spec["specials"]}
    config = {"added_tokens_decoder": added, "clean_up_tokenization_spaces": False, "model_max_length": 256,
              **spec["config"]}
    (d / "tokenizer_config.json").write_text(json.dumps(config, indent=2, ensure_ascii=False) + "\n", "utf-8")
    if spec["template_file"] is not None:
        (d / "chat_template.jinja").write_text(spec["template_file"], "utf-8")
    return d


def messages_of(system: str | None, prompt: str) -> list[dict[str, str]]:
    return ([{"role": "system", "content": system}] if system is not None else []) + \
        [{"role": "user", "content": prompt}]


def golden_cases(name: str, d: Path) -> list[dict]:
    hf = AutoTokenizer.from_pretrained(str(d))
    cases = []
    for system, prompt in CONVERSATIONS:
        msgs = messages_of(system, prompt)
        ids = hf.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True, return_dict=False)
        text = hf.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False)
        assert ids == hf(text, add_special_tokens=False)["input_ids"], "apply_chat_template encodes differently"
        cases.append({"fixture": name, "system": system, "prompt": prompt, "rendered": text, "chat_ids": list(ids),
                      "plain_ids": hf(prompt)["input_ids"],
                      "plain_ids_no_special": hf(prompt, add_special_tokens=False)["input_ids"]})
    return cases


def env_cases() -> list[dict]:
    out = []
    for name, template in ENV_CASES.items():
        rendered, _ = render_jinja_template(conversations=[ENV_MESSAGES], chat_template=template,
                                            add_generation_prompt=True, **ENV_SPECIALS)
        out.append({"name": name, "template": template, "rendered": rendered[0]})
    return out


def main() -> int:
    cases = []
    for name, spec in FIXTURES.items():
        cases += golden_cases(name, write_fixture(name, spec))
    golden = {"transformers_version": transformers.__version__, "tokenizers_version": tokenizers.__version__,
              "cases": cases, "env_messages": ENV_MESSAGES, "env_specials": ENV_SPECIALS, "env_cases": env_cases()}
    (OUT / "golden.json").write_text(json.dumps(golden, indent=1, ensure_ascii=False) + "\n", "utf-8")
    print(f"wrote {OUT.relative_to(ROOT)}: {', '.join(FIXTURES)}, golden.json ({len(cases)} conversations)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
