"""openai_shapes: the prompt-bearing fields of an OpenAI request body, validated and counted.

``chat_shape`` validates chat ``messages`` (and ``tools``), ``prompt_shape`` a completions
``prompt`` or embeddings ``input``, ``responses_shape`` a Responses API ``input``: each
into a shape that holds what the model reads, then counted exactly under a pool's
tokenizer (``count_shape``, ``count_prompt_shape``). Every malformed field is a
RequestError (400) whose ``param`` names it. ``openai_api.parse_request`` calls these.

Chat requests are counted as the model sees them: the text of every message plus the
tokens its chat template wraps around each message (``TEMPLATES``). Image parts cannot be
measured without fetching and decoding the image, so they follow OpenAI's published tile
rule at a fixed size: ``detail: "low"`` costs 85 tokens, anything else 765 tokens (the
high-detail cost of a 1024x1024 image: 85 + 4 tiles x 170).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import orjson

from extproc.errors import RequestError
from extproc.tokens import Tokenizer

IMAGE_TOKENS_LOW = 85
"""IMAGE_TOKENS_LOW is the token cost of an image part with ``detail: "low"``."""
IMAGE_TOKENS_DEFAULT = 765
"""IMAGE_TOKENS_DEFAULT is the token cost of any other image part (1024x1024, high detail)."""


# --- chat templates ---------------------------------------------------------------

@dataclass(frozen=True, slots=True)
class ChatTemplate:
    """ChatTemplate is the token overhead a model's chat template adds, in tokens.

    ``per_message``: tokens wrapped around each message; ``count_role``: whether the role
    is counted as text on top of that (OpenAI's recipe) or is one of those tokens;
    ``per_name``: extra tokens for a message carrying ``name``; ``reply``: tokens that
    open the assistant's reply (plus any fixed prefix); ``default_system``: a system
    prompt the template inserts when the conversation has none.
    """

    name: str
    per_message: int
    count_role: bool
    per_name: int
    reply: int
    default_system: str | None = None


TEMPLATES: dict[str, ChatTemplate] = {
    # OpenAI cookbook recipe: <|start|>{role/name}\n{content}<|end|>\n, reply primed with 3.
    "openai": ChatTemplate("openai", per_message=3, count_role=True, per_name=1, reply=3),
    # <|start_header_id|>{role}<|end_header_id|>\n\n{content}<|eot_id|>; reply adds
    # <|begin_of_text|> and the assistant header (4).
    "llama3": ChatTemplate("llama3", per_message=5, count_role=False, per_name=0, reply=5),
    # <|im_start|>{role}\n{content}<|im_end|>\n; reply <|im_start|>assistant\n.
    "qwen2": ChatTemplate("qwen2", per_message=5, count_role=False, per_name=0, reply=3,
                          default_system="You are Qwen, created by Alibaba Cloud. You are a helpful assistant."),
    "none": ChatTemplate("none", per_message=0, count_role=False, per_name=0, reply=0),
}

_ONE_TOKEN_ROLES = frozenset({"system", "developer", "user", "assistant", "tool"})
_TEXT_PARTS = frozenset({"text", "refusal"})
_IMAGE_PARTS = frozenset({"image_url"})


@dataclass(slots=True)
class ChatShape:
    """ChatShape is what a validated chat conversation costs, before tokenizing.

    ``texts``: every string the model reads (contents, names, tool calls, tools);
    ``roles``: one per message; ``names``: messages with a name; ``image_tokens``: fixed
    image cost; ``has_system``: whether a system (or developer) message is present;
    ``message_ends``: per message, the index in ``texts`` after its last string (the
    tools' schema, when any, follows the last message's).
    """

    texts: list[str]
    roles: list[str]
    names: int
    image_tokens: int
    has_system: bool
    message_ends: list[int]


def _bad(message: str, param: str) -> RequestError:
    return RequestError(message, status=400, param=param)


def _content_parts(parts: list[Any], param: str, texts: list[str]) -> int:
    """_content_parts validates a multi-part content list, collects its text, returns image tokens."""
    image_tokens = 0
    for j, part in enumerate(parts):
        p = f"{param}[{j}]"
        if not isinstance(part, dict):
            raise _bad(f"Invalid type for '{p}': expected an object.", p)
        kind = part.get("type")
        if kind in _TEXT_PARTS:
            text = part.get(kind)
            if not isinstance(text, str):
                raise _bad(f"Invalid type for '{p}.{kind}': expected a string.", f"{p}.{kind}")
            texts.append(text)
        elif kind in _IMAGE_PARTS:
            image = part.get("image_url")
            if isinstance(image, dict):
                url, detail = image.get("url"), image.get("detail")
            else:
                url, detail = image, None
            if not isinstance(url, str):
                raise _bad(f"Invalid type for '{p}.image_url.url': expected a string.", f"{p}.image_url.url")
            if detail is not None and detail not in ("low", "high", "auto"):
                raise _bad(f"Invalid value for '{p}.image_url.detail': expected 'low', 'high' or 'auto'.",
                           f"{p}.image_url.detail")
            image_tokens += IMAGE_TOKENS_LOW if detail == "low" else IMAGE_TOKENS_DEFAULT
        else:
            raise _bad(f"Invalid value for '{p}.type': {kind!r} is not supported "
                       "(supported: 'text', 'refusal', 'image_url').", f"{p}.type")
    return image_tokens


def _tool_calls(calls: Any, param: str, texts: list[str]) -> None:
    if not isinstance(calls, list):
        raise _bad(f"Invalid type for '{param}': expected an array.", param)
    for k, call in enumerate(calls):
        p = f"{param}[{k}]"
        if not isinstance(call, dict):
            raise _bad(f"Invalid type for '{p}': expected an object.", p)
        fn = call.get("function")
        if not isinstance(fn, dict):
            raise _bad(f"Invalid type for '{p}.function': expected an object.", f"{p}.function")
        for field in ("name", "arguments"):
            value = fn.get(field)
            if value is None:
                continue
            if not isinstance(value, str):
                raise _bad(f"Invalid type for '{p}.function.{field}': expected a string.", f"{p}.function.{field}")
            texts.append(value)
        call_id = call.get("id")
        if isinstance(call_id, str):
            texts.append(call_id)


def _message_extras(msg: dict[str, Any], p: str, texts: list[str]) -> int:
    """_message_extras collects a message's name, tool calls and tool call id into ``texts``
    (``p``: the message's parameter path); returns 1 if it has a name, else 0."""
    names = 0
    name = msg.get("name")
    if name is not None:
        if not isinstance(name, str):
            raise _bad(f"Invalid type for '{p}.name': expected a string.", f"{p}.name")
        texts.append(name)
        names = 1
    if "tool_calls" in msg and msg["tool_calls"] is not None:
        _tool_calls(msg["tool_calls"], f"{p}.tool_calls", texts)
    fc = msg.get("function_call")
    if isinstance(fc, dict):
        _tool_calls([{"function": fc}], f"{p}.function_call", texts)
    call_id = msg.get("tool_call_id")
    if call_id is not None:
        if not isinstance(call_id, str):
            raise _bad(f"Invalid type for '{p}.tool_call_id': expected a string.", f"{p}.tool_call_id")
        texts.append(call_id)
    return names


def chat_shape(messages: Any, tools: Any = None) -> ChatShape:
    """chat_shape validates a chat ``messages`` list (and ``tools``) and collects what is counted.

    Raises RequestError (400, with ``param`` naming the field) for a non-list or empty
    list, a message that is not an object, a missing or non-string role, content that is
    not a string, null or list of known parts, or malformed names and tool calls.
    """
    if not isinstance(messages, list):
        raise _bad("Invalid type for 'messages': expected an array of message objects.", "messages")
    if not messages:
        raise _bad("Invalid 'messages': empty array. Expected an array with minimum length 1.", "messages")
    texts: list[str] = []
    roles: list[str] = []
    names = 0
    image_tokens = 0
    has_system = False
    message_ends: list[int] = []
    for i, msg in enumerate(messages):
        if not isinstance(msg, dict):
            p = f"messages[{i}]"
            raise _bad(f"Invalid type for '{p}': expected an object.", p)
        role = msg.get("role")
        if not isinstance(role, str) or not role:
            p = f"messages[{i}]"
            raise _bad(f"Missing or invalid '{p}.role': expected a non-empty string.", f"{p}.role")
        roles.append(role)
        if role in ("system", "developer"):
            has_system = True
        content = msg.get("content")
        if isinstance(content, str):
            texts.append(content)
        elif isinstance(content, list):
            image_tokens += _content_parts(content, f"messages[{i}].content", texts)
        elif content is not None:
            p = f"messages[{i}]"
            raise _bad(f"Invalid type for '{p}.content': expected a string or an array of content parts.",
                       f"{p}.content")
        # Most messages hold a role and a content and nothing else: nothing more to read.
        if len(msg) != 2 or "content" not in msg:
            names += _message_extras(msg, f"messages[{i}]", texts)
        message_ends.append(len(texts))
    if tools is not None:
        if not isinstance(tools, list):
            raise _bad("Invalid type for 'tools': expected an array.", "tools")
        if tools:
            # Templates render tool schemas into the prompt; their compact JSON is a fair count.
            try:
                texts.append(orjson.dumps(tools).decode())
            except orjson.JSONEncodeError:  # orjson reads 1024 levels but writes only 254
                raise _bad("Invalid 'tools': nested too deeply.", "tools") from None
    return ChatShape(texts, roles, names, image_tokens, has_system, message_ends)


def count_shape(shape: ChatShape, tokenizer: Tokenizer, template: ChatTemplate) -> int:
    """count_shape returns the prompt tokens of a validated conversation under ``template``."""
    count = tokenizer.count
    n = shape.image_tokens + template.reply
    n += len(shape.roles) * template.per_message + shape.names * template.per_name
    for text in shape.texts:
        if text:
            n += count(text)
    if template.count_role:
        for role in shape.roles:
            n += count(role)
    else:
        # per_message holds one token for the role: true of the standard roles only.
        for role in shape.roles:
            if role not in _ONE_TOKEN_ROLES:
                n += max(0, count(role) - 1)
    if template.default_system is not None and not shape.has_system:
        n += template.per_message + count(template.default_system)
    return n


# --- completions / embeddings prompts ----------------------------------------------

_MAX_TOKEN_ID = 1 << 32


@dataclass(slots=True)
class PromptShape:
    """PromptShape is a validated ``prompt`` / ``input``: texts to tokenize and given ids.

    ``texts`` and ``id_lists`` hold one entry per prompt; ``prompts`` is how many
    prompts the request carries (each gets its own completions).
    """

    texts: list[str]
    id_lists: list[int]
    prompts: int


def _is_token_id(x: Any) -> bool:
    return type(x) is int and 0 <= x < _MAX_TOKEN_ID


def prompt_shape(prompt: Any, param: str = "prompt") -> PromptShape:
    """prompt_shape validates a prompt: str, list[str], list[int] or list[list[int]].

    Raises RequestError (400, ``param``) for any other shape, an empty list, or a token
    id that is not an integer in [0, 2**32).
    """
    if isinstance(prompt, str):
        return PromptShape([prompt], [], 1)
    if not isinstance(prompt, list):
        raise _bad(f"Invalid type for '{param}': expected a string, an array of strings, "
                   "an array of token ids or an array of arrays of token ids.", param)
    if not prompt:
        raise _bad(f"Invalid '{param}': empty array. Expected an array with minimum length 1.", param)
    first = prompt[0]
    if isinstance(first, str):
        for j, x in enumerate(prompt):
            if not isinstance(x, str):
                raise _bad(f"Invalid type for '{param}[{j}]': expected a string.", f"{param}[{j}]")
        return PromptShape(list(prompt), [], len(prompt))
    if type(first) is int:
        for j, x in enumerate(prompt):
            if not _is_token_id(x):
                raise _bad(f"Invalid value for '{param}[{j}]': expected a token id (integer >= 0).",
                           f"{param}[{j}]")
        return PromptShape([], [len(prompt)], 1)
    if isinstance(first, list):
        lengths: list[int] = []
        for j, ids in enumerate(prompt):
            if not isinstance(ids, list) or not ids:
                raise _bad(f"Invalid '{param}[{j}]': expected a non-empty array of token ids.", f"{param}[{j}]")
            for k, x in enumerate(ids):
                if not _is_token_id(x):
                    raise _bad(f"Invalid value for '{param}[{j}][{k}]': expected a token id (integer >= 0).",
                               f"{param}[{j}][{k}]")
            lengths.append(len(ids))
        return PromptShape([], lengths, len(prompt))
    raise _bad(f"Invalid type for '{param}[0]': expected a string, a token id or an array of token ids.",
               f"{param}[0]")


def count_prompt_shape(shape: PromptShape, tokenizer: Tokenizer) -> list[int]:
    """count_prompt_shape returns the token count of each prompt of a validated shape."""
    counts = [tokenizer.count(t) if t else 0 for t in shape.texts]
    counts.extend(shape.id_lists)
    return counts


# --- Responses API input --------------------------------------------------------------

# Keys of Responses API input items whose strings are labels, not text the model reads.
_RESPONSES_LABELS = frozenset({"type", "role", "id", "status", "call_id", "detail", "format"})


def responses_shape(items: Any, instructions: str | None) -> PromptShape:
    """responses_shape validates a Responses API ``input`` and counts it with ``instructions``.

    The prompt is every text string of ``input`` (messages, content parts, tool outputs),
    labels left out, after the instructions: one prompt, a bound that errs on the high side
    of the model's chat template. Raises RequestError (400, ``input``) for an input that is
    neither a string nor a non-empty array.
    """
    texts: list[str] = [] if instructions is None else [instructions]
    if isinstance(items, str):
        texts.append(items)
    elif isinstance(items, list) and items:
        _strings(items, texts)
    else:
        raise _bad("Invalid type for 'input': expected a string or a non-empty array of items.",
                   "input")
    return PromptShape(["\n".join(texts)], [], 1)


def _strings(node: Any, out: list[str]) -> None:
    """_strings appends the text strings under ``node`` to ``out`` (depth is bounded by
    the JSON parser's own limit)."""
    if isinstance(node, str):
        out.append(node)
    elif isinstance(node, list):
        for x in node:
            _strings(x, out)
    elif isinstance(node, dict):
        for key, x in node.items():
            if key not in _RESPONSES_LABELS:
                _strings(x, out)
