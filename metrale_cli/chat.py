"""--chat: the prompt formatted with the checkpoint's own chat template, exactly as transformers does it.

transformers (`apply_chat_template`) renders the template with jinja2 in an immutable sandbox with
trim_blocks, lstrip_blocks and the loopcontrols extension, a `{% generation %}` tag, the globals
raise_exception / strftime_now / dict / namespace, a `tojson` filter that neither escapes HTML nor forces
ASCII, and the named special tokens (bos_token, eos_token, ...) of tokenizer_config.json as variables.
The environment below is set up the same way (see transformers/utils/chat_template_utils.py), so any
template from the Hub renders to the same text. jinja2 is imported only when --chat is used.

Where the template comes from, in transformers' order: chat_template.jinja in the checkpoint directory,
else "chat_template" in tokenizer_config.json (a string, or a list of {name, template} of which
"default" is used).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

from .errors import CheckpointError, InputError

CHAT_TEMPLATE_FILE = "chat_template.jinja"
TOKENIZER_CONFIG_FILE = "tokenizer_config.json"
SPECIAL_TOKENS_MAP_FILE = "special_tokens_map.json"
# transformers' SPECIAL_TOKENS_ATTRIBUTES: the special tokens every template sees by name.
SPECIAL_TOKEN_NAMES = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")


@dataclass(frozen=True)
class ChatTemplate:
    """A chat template and where it was found (for error messages)."""

    text: str
    source: Path
    name: str | None = None  # the entry of a named list in tokenizer_config.json

    @property
    def where(self) -> str:
        return f"{self.source}" if self.name is None else f"{self.source} (chat_template '{self.name}')"


def chat_messages(prompt: str, system: str | None) -> list[dict[str, str]]:
    """The conversation --chat formats: an optional system message, then the prompt as the user's."""
    system_part = [{"role": "system", "content": system}] if system is not None else []
    return system_part + [{"role": "user", "content": prompt}]


def format_chat(directory: Path, prompt: str, system: str | None) -> str:
    """The text the template renders for (system, prompt), ending with the assistant's generation prompt."""
    template = find_chat_template(directory)
    return render_chat(template, chat_messages(prompt, system), special_tokens(directory))


# -- where the template and the special tokens come from --------------------------------------------------------


def _read_json(path: Path) -> dict[str, Any]:
    try:
        raw = json.loads(path.read_text("utf-8"))
    except OSError as e:
        raise CheckpointError(f"{path}: cannot read ({e.strerror or e})") from None
    except UnicodeDecodeError:
        raise CheckpointError(f"{path}: not UTF-8 text") from None
    except ValueError as e:
        raise CheckpointError(f"{path}: not valid JSON ({e})") from None
    if not isinstance(raw, dict):
        raise CheckpointError(f"{path}: expected a JSON object, got {type(raw).__name__}")
    return raw


def find_chat_template(directory: Path) -> ChatTemplate:
    """chat_template.jinja, else tokenizer_config.json's chat_template; InputError when there is neither."""
    jinja_path = directory / CHAT_TEMPLATE_FILE
    if jinja_path.is_file():
        try:
            return ChatTemplate(jinja_path.read_text("utf-8"), jinja_path)
        except UnicodeDecodeError:
            raise CheckpointError(f"{jinja_path}: not UTF-8 text") from None
        except OSError as e:
            raise CheckpointError(f"{jinja_path}: cannot read ({e.strerror or e})") from None
    config_path = directory / TOKENIZER_CONFIG_FILE
    entry = _read_json(config_path).get("chat_template") if config_path.is_file() else None
    if entry is None:
        raise InputError(f"--chat: {directory} has no chat template (metrale looked for {jinja_path} and for "
                         f"\"chat_template\" in {config_path}); drop --chat to encode the prompt as plain text")
    if isinstance(entry, str):
        return ChatTemplate(entry, config_path)
    return _default_of_list(entry, config_path)


def _default_of_list(entry: Any, config_path: Path) -> ChatTemplate:
    """A list of {name, template}: transformers uses the one named "default" (without tools)."""
    if not isinstance(entry, list) or not all(
            isinstance(t, dict) and isinstance(t.get("name"), str) and isinstance(t.get("template"), str)
            for t in entry):
        raise CheckpointError(f"{config_path}: \"chat_template\" must be a string or a list of "
                              f"{{\"name\", \"template\"}} objects, got {json.dumps(entry)[:60]}")
    named = {t["name"]: t["template"] for t in entry}
    if "default" not in named:
        raise InputError(f"--chat: {config_path} names chat templates {sorted(named)} and none is 'default'")
    return ChatTemplate(named["default"], config_path, "default")


def _token_content(value: Any) -> str | None:
    """A special token as tokenizer_config.json stores it: a string or an AddedToken dict {"content": ...}."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


def special_tokens(directory: Path) -> dict[str, str]:
    """bos_token, eos_token, ... as the template sees them (transformers' special_tokens_map).

    They come from tokenizer_config.json; like transformers, the legacy special_tokens_map.json is read
    only when tokenizer_config.json has no added_tokens_decoder, and then its values win. Tokens that
    are null or absent are not passed (the template sees them undefined)."""
    config_path, map_path = directory / TOKENIZER_CONFIG_FILE, directory / SPECIAL_TOKENS_MAP_FILE
    config = _read_json(config_path) if config_path.is_file() else {}
    values = dict(config)
    if "added_tokens_decoder" not in config and map_path.is_file():
        values.update(_read_json(map_path))
    out = {name: _token_content(values.get(name)) for name in SPECIAL_TOKEN_NAMES}
    return {name: text for name, text in out.items() if text is not None}


# -- rendering ------------------------------------------------------------------------------------------------------


def render_chat(template: ChatTemplate, messages: list[dict[str, str]], special: dict[str, str]) -> str:
    """Render with add_generation_prompt=True and the variables apply_chat_template passes (tools and
    documents None); a template error becomes a one-line metrale error that names the template."""
    import jinja2  # only --chat needs it (start-up time)

    env, raised = _environment()
    try:
        compiled = env.from_string(template.text)
    except jinja2.TemplateSyntaxError as e:
        raise CheckpointError(f"{template.where}: chat template syntax error at line {e.lineno} of the "
                              f"template: {e.message}") from None
    try:
        return compiled.render(messages=messages, tools=None, documents=None, add_generation_prompt=True,
                               **special)
    except raised as e:
        raise InputError(f"the chat template in {template.where} refused the conversation: {e}") from None
    except Exception as e:  # template code is foreign: any failure in it is the template's, told in one line
        raise CheckpointError(f"the chat template in {template.where} failed: {type(e).__name__}: {e}") from None


def _environment() -> tuple[Any, type[Exception]]:
    """A jinja2 environment set up like transformers' _cached_compile_jinja_template, and the exception
    class its raise_exception raises (transformers raises a plain TemplateError; a subclass of it here,
    so a template's own refusal is told apart from a template that is broken)."""
    import jinja2
    import jinja2.ext
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class TemplateRaised(jinja2.exceptions.TemplateError):
        pass

    def raise_exception(message: str) -> None:
        raise TemplateRaised(message)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[_generation_extension(), jinja2.ext.loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = _strftime_now
    env.globals["dict"] = _TemplateDict()
    env.globals["namespace"] = _namespace_class()
    return env, TemplateRaised


def _tojson(x: Any, ensure_ascii: bool = False, indent: int | None = None, separators: Any = None,
            sort_keys: bool = False) -> str:
    # transformers' override: jinja's own tojson escapes <, >, & and ' for HTML, which chat text must keep.
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(format: str) -> str:
    return datetime.now().strftime(format)


class _TemplateDict:
    """`dict(...)` in a template, without exposing the dict type itself (as in transformers)."""

    def __call__(self, *args: Any, **kwargs: Any) -> dict:
        return dict(*args, **kwargs)

    def fromkeys(self, *args: Any, **kwargs: Any) -> dict:
        return dict.fromkeys(*args, **kwargs)


def _namespace_class() -> type:
    """jinja's namespace, refusing underscore-prefixed attributes (as transformers' TemplateNamespace)."""
    import jinja2.utils

    def check(name: Any) -> None:
        if isinstance(name, str) and name.startswith("_"):
            import jinja2.exceptions

            raise jinja2.exceptions.SecurityError(
                f"chat templates cannot store underscore-prefixed attributes on a namespace, got {name!r}")

    class TemplateNamespace(jinja2.utils.Namespace):
        def __init__(*args: Any, **kwargs: Any) -> None:  # jinja's signature trick: namespace(self=...) works
            self, args = args[0], args[1:]
            attrs = dict(*args, **kwargs)
            for name in attrs:
                check(name)
            jinja2.utils.Namespace.__init__(self, attrs)

        def __setitem__(self, name: str, value: Any) -> None:
            check(name)
            jinja2.utils.Namespace.__setitem__(self, name, value)

    return TemplateNamespace


def _generation_extension() -> type:
    """The `{% generation %}...{% endgeneration %}` tag (transformers marks assistant tokens with it); it
    renders its body unchanged, so templates that use it parse and render as in transformers."""
    import jinja2.ext
    import jinja2.nodes

    class GenerationTag(jinja2.ext.Extension):
        tags = {"generation"}

        def parse(self, parser: Any) -> Any:
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(["name:endgeneration"], drop_needle=True)
            return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

        def _body(self, caller: Any) -> str:
            return caller()

    return GenerationTag
