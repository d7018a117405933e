"""A decoder's chat template: the Jinja template of transformers' tokenizer_config.json
(`chat_template`, or `chat_template.jinja` beside it, where transformers 4.43 and later save it)
that turns OpenAI-style messages into the prompt text the model was trained on.

Rendered as transformers' `apply_chat_template` renders it (transformers/utils/
chat_template_utils.py): a jinja2 ImmutableSandboxedEnvironment (templates from the Hub are
untrusted code) with trim_blocks, lstrip_blocks and the loopcontrols extension, the globals
`raise_exception` and `strftime_now`, a `tojson` filter that does not escape HTML, and the
variables `messages`, `add_generation_prompt` and the tokenizer's special tokens (bos_token,
eos_token, ...). The `{% generation %}` tag of transformers' assistant-mask tracking is not
provided: a template that uses it is refused when the worker loads it.
"""
from __future__ import annotations

import json
import os
from datetime import datetime
from typing import Optional

from handlers.errors import LoadError, RequestError

CONFIG_FILE = "tokenizer_config.json"
JINJA_FILE = "chat_template.jinja"
SPECIAL = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")


def _raise(message):
    import jinja2

    raise jinja2.exceptions.TemplateError(message)


def _tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _token(value) -> Optional[str]:
    """A special token as tokenizer_config.json writes it: a string, or an AddedToken's dict."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


def template_source(config: dict, jinja_path: Optional[str]) -> Optional[str]:
    """The template's text: the config's chat_template (a string, or a list of {name, template}
    whose "default" one is taken), else the .jinja file's; None when there is none."""
    source = config.get("chat_template")
    if isinstance(source, list):
        source = next((t.get("template") for t in source if isinstance(t, dict) and t.get("name") == "default"), None)
    if not isinstance(source, str) and jinja_path and os.path.isfile(jinja_path):
        with open(jinja_path, encoding="utf-8") as f:
            source = f.read()
    return source if isinstance(source, str) and source.strip() else None


class ChatTemplate:
    def __init__(self, source: str, config: dict):
        import jinja2
        from jinja2.ext import loopcontrols
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
        env.filters["tojson"] = _tojson
        env.globals["raise_exception"] = _raise
        env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
        try:
            self.template = env.from_string(source)
        except jinja2.exceptions.TemplateError as e:
            raise LoadError(f"the archive's chat template does not compile ({type(e).__name__}: {e})") from None
        self.special = {k: t for k in SPECIAL if (t := _token(config.get(k))) is not None}

    @classmethod
    def in_dir(cls, model_dir: str) -> Optional["ChatTemplate"]:
        """The archive's template (tokenizer_config.json at its top level), or None."""
        path = os.path.join(model_dir, CONFIG_FILE)
        config = {}
        if os.path.isfile(path):
            with open(path, encoding="utf-8") as f:
                config = json.load(f)
        source = template_source(config, os.path.join(model_dir, JINJA_FILE))
        return cls(source, config) if source is not None else None

    def render(self, messages: list) -> str:
        """The prompt text of `messages` ([{role, content: str}]) with the assistant's turn opened;
        RequestError where the template refuses them (its raise_exception, a missing field)."""
        import jinja2

        try:
            return self.template.render(messages=messages, add_generation_prompt=True, tools=None, documents=None,
                                        **self.special)
        except jinja2.exceptions.TemplateError as e:
            raise RequestError(f"messages: the model's chat template refused them: {e}") from None
        except Exception as e:  # noqa: BLE001  (a template's own fault on these messages: the client's to fix)
            raise RequestError(f"messages: the model's chat template failed on them ({type(e).__name__}: {e})") from None
