"""chat_template: a model's own chat template, rendered as the engine renders it, for the token
ids the engine caches of a chat request.

vLLM turns a chat request into a prompt with the model's Jinja chat template (from the
model's ``tokenizer_config.json``, or a ``chat_template.jinja`` beside it), the conversation
and ``add_generation_prompt`` true, then tokenizes that prompt without adding special tokens
(the template writes them). Given the same tokenizer.json and template, kvgate gets the same
ids, so a chat request can be matched against a node's KV cache events
(``signals/kv_events``, ``engine_blocks``) as exactly as a completions prompt.

The template is the operator's file; the conversation is client input, rendered in Jinja's
immutable sandbox. Anything the template refuses (``raise_exception``), or a conversation
kvgate does not render as the engine would (content parts, tool calls, names of roles the
template does not know: whatever makes it raise), gives None: the request is then placed by
kvgate's own record, never by a guess.
"""

from __future__ import annotations

import json
from datetime import datetime
from pathlib import Path
from typing import Any

# A template larger than this is not a chat template (the largest published ones are ~20 KB).
MAX_TEMPLATE_BYTES = 256 * 1024
# The tokens a template may name, from tokenizer_config.json.
_SPECIALS = ("bos_token", "eos_token", "unk_token", "pad_token")


class TemplateError(Exception):
    """TemplateError is a template's own refusal (``raise_exception``) or a failed render."""


class ChatTemplate:
    """ChatTemplate renders a conversation with a model's chat template (``render``).

    ``source`` is the template's text; ``specials`` the special tokens it may name
    (``bos_token`` ...), as in the model's tokenizer_config.json.
    """

    __slots__ = ("source", "specials", "_template")

    def __init__(self, source: str, specials: dict[str, str]) -> None:
        from jinja2 import ext
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                            extensions=[ext.loopcontrols])
        env.filters["tojson"] = _tojson
        env.globals["raise_exception"] = _raise
        env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
        self.source = source
        self.specials = specials
        self._template = env.from_string(source)

    def render(self, messages: list[dict[str, Any]]) -> str:
        """render is the prompt of ``messages`` (each a role and a string content) with the
        generation prompt added, as the engine renders a chat request. Raises TemplateError."""
        try:
            return self._template.render(messages=messages, add_generation_prompt=True, tools=None,
                                         documents=None, **self.specials)
        except TemplateError:
            raise
        except Exception as exc:  # the sandbox's SecurityError, an undefined name, a type error
            raise TemplateError(f"{type(exc).__name__}: {exc}") from None


def load_chat_template(tokenizer_json: Path) -> ChatTemplate | None:
    """load_chat_template is the chat template of the model whose tokenizer.json is
    ``tokenizer_json``: ``chat_template.jinja`` beside it, else ``chat_template`` in the
    ``tokenizer_config.json`` beside it (a string; a list of named templates gives its
    ``default``). None where there is none. Raises ValueError for a file that is there but
    unreadable, too large or not a template Jinja compiles."""
    folder = tokenizer_json.parent
    config = _read_json(folder / "tokenizer_config.json")
    source: Any = None
    jinja = folder / "chat_template.jinja"
    if jinja.is_file():
        source = _read_text(jinja)
    elif isinstance(config, dict):
        source = config.get("chat_template")
        if isinstance(source, list):
            source = next((t.get("template") for t in source
                           if isinstance(t, dict) and t.get("name") == "default"), None)
    if source is None:
        return None
    if not isinstance(source, str) or len(source.encode()) > MAX_TEMPLATE_BYTES:
        raise ValueError("chat_template: not a template string of at most 256 KiB")
    specials = {}
    for key in _SPECIALS:
        value = config.get(key) if isinstance(config, dict) else None
        if isinstance(value, dict):  # an AddedToken, as transformers saves one
            value = value.get("content")
        if isinstance(value, str):
            specials[key] = value
    try:
        return ChatTemplate(source, specials)
    except Exception as exc:  # jinja2's TemplateSyntaxError
        raise ValueError(f"chat_template does not compile: {exc}") from None


def conversation(messages: Any) -> list[dict[str, Any]] | None:
    """conversation is a chat request's ``messages`` as the template reads them, where kvgate
    renders them as the engine does: each a role and a string content (None otherwise:
    content parts, tool calls, anything else, which the engine reshapes first)."""
    if not isinstance(messages, list) or not messages:
        return None
    out = []
    for m in messages:
        if not isinstance(m, dict) or set(m) - {"role", "content"}:
            return None
        role, content = m.get("role"), m.get("content")
        if not isinstance(role, str) or not isinstance(content, str):
            return None
        out.append({"role": role, "content": content})
    return out


def _raise(message: str) -> None:
    raise TemplateError(message)


def _tojson(value: Any, indent: int | None = None) -> str:
    return json.dumps(value, ensure_ascii=False, indent=indent)


def _read_text(path: Path) -> str:
    if path.stat().st_size > MAX_TEMPLATE_BYTES:
        raise ValueError(f"{path.name}: larger than 256 KiB")
    return path.read_text(encoding="utf-8")


def _read_json(path: Path) -> Any:
    if not path.is_file():
        return None
    if path.stat().st_size > 16 * MAX_TEMPLATE_BYTES:
        raise ValueError(f"{path.name}: larger than 4 MiB")
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ValueError(f"{path.name}: not JSON: {exc}") from None
