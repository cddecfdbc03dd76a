"""api: the OpenAI-compatible surface of the simulator, shaped like vLLM's server.

Parsing and validation of ``/v1/chat/completions`` and ``/v1/completions`` bodies, prompt
token counting with a real tokenizer, vLLM's error bodies, and the JSON of responses and
stream chunks. No HTTP here: the server calls these functions with bytes and numbers.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import orjson

# Chat template cost, OpenAI's recipe (tokens per message, per name, reply priming):
# kvgate counts prompts the same way by default, so its reservations match the node.
TOKENS_PER_MESSAGE = 3
TOKENS_PER_NAME = 1
TOKENS_REPLY_PRIMING = 3

# Token ids of the template's own tokens in ``prompt_ids`` (ChatML's <|im_start|>, the
# separator before a message's content, <|im_end|>, the mark before a name, and the role of
# the reply when the tokenizer does not spell "assistant" as one token). Negative, so they
# never equal a tokenizer's id.
IM_START, IM_SEP, IM_END, NAME_MARK, ASSISTANT_MARK = -1, -2, -3, -4, -5

# Each of these, with its leading space, is one cl100k token: generated text costs one
# token per word, as a real model's output does on average.
_WORDS = (" the of and to in is that it for on with as was at by be this from or are an have "
          "not but all which one can they their more will has would there when what been if so "
          "up out about into other time some could them only new its then these two may first "
          "also like any over such how our most well just where even very after back much good "
          "work should because through").split()
WORDS = tuple(" " + w for w in _WORDS)

# A request header that says how many tokens the model will generate before it stops
# (its end-of-sequence token), so a benchmark can replay a trace's true output lengths.
# Only the simulator reads it: a gateway cannot know when a model will stop.
OUTPUT_TOKENS_HEADER = "x-sim-output-tokens"
_OUTPUT_TOKENS_DIGITS = 18


class ApiError(Exception):
    """ApiError is a request the simulator refuses, answered as vLLM does.

    ``status`` is the HTTP status; ``error_type`` vLLM's error type name
    (``BadRequestError``, ``NotFoundError``...).
    """

    def __init__(self, status: int, message: str, error_type: str = "BadRequestError",
                 param: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.error_type = error_type
        self.param = param

    def body(self) -> bytes:
        """body is vLLM's JSON error body for this error."""
        return orjson.dumps({"error": {"message": self.message, "type": self.error_type,
                                       "param": self.param, "code": self.status}})


@dataclass(frozen=True, slots=True)
class CompletionRequest:
    """CompletionRequest is a validated request, prompt not yet counted.

    ``texts`` are the strings to tokenize (message contents, roles, names);
    ``fixed_tokens`` tokens that need no tokenizer (template overhead, or a prompt given
    as token ids); ``max_tokens`` None when the client set no cap. ``messages`` are a
    chat's (role, content, name) triples and ``token_ids`` a prompt given as ids, for
    ``prompt_ids``.
    """

    chat: bool
    model: str
    texts: tuple[str, ...]
    fixed_tokens: int
    max_tokens: int | None
    stream: bool
    include_usage: bool
    messages: tuple[tuple[str, str, str | None], ...] = ()
    token_ids: tuple[int, ...] | None = None

    def text_bytes(self) -> int:
        """text_bytes is the UTF-8 size of the text to tokenize, in bytes."""
        return sum(len(t.encode("utf-8", "surrogatepass")) for t in self.texts)


def _int_field(body: dict[str, Any], name: str, minimum: int) -> int | None:
    value = body.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise ApiError(400, f"{name} must be an integer, got {value!r}", param=name)
    if value < minimum:
        raise ApiError(400, f"{name} must be at least {minimum}, got {value}", param=name)
    return value


def _content_text(content: Any, where: str) -> str:
    if isinstance(content, str):
        return content
    if content is None:
        return ""
    if isinstance(content, list):
        parts = []
        for part in content:
            if not isinstance(part, dict):
                raise ApiError(400, f"{where}: content parts must be objects", param="messages")
            if part.get("type", "text") != "text":
                raise ApiError(400, f"{where}: only text content parts are supported, got "
                                    f"{str(part.get('type'))[:40]!r}", param="messages")
            text = part.get("text")
            if not isinstance(text, str):
                raise ApiError(400, f"{where}: a text part needs a string 'text'", param="messages")
            parts.append(text)
        return "".join(parts)
    raise ApiError(400, f"{where}: content must be a string or a list of parts", param="messages")


def parse_request(raw: bytes, *, chat: bool, served_model: str) -> CompletionRequest:
    """parse_request validates a request body (JSON bytes) of either endpoint.

    Raises ``ApiError`` (400 malformed, 404 unknown model) with vLLM's wording where it
    has one.
    """
    try:
        body = orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        raise ApiError(400, f"request body is not valid JSON: {exc}") from None
    if not isinstance(body, dict):
        raise ApiError(400, "request body must be a JSON object")
    model = body.get("model", served_model)
    if model is None:
        model = served_model
    if not isinstance(model, str):
        raise ApiError(400, "model must be a string", param="model")
    if model != served_model:
        raise ApiError(404, f"The model `{model[:200]}` does not exist.", "NotFoundError", "model")
    max_tokens = _int_field(body, "max_completion_tokens", 1) if chat else None
    if max_tokens is None:
        max_tokens = _int_field(body, "max_tokens", 1)
    n = _int_field(body, "n", 1)
    if n is not None and n != 1:
        raise ApiError(400, "the simulator generates one choice per request (n=1)", param="n")
    stream = body.get("stream", False)
    if stream is None:
        stream = False
    if not isinstance(stream, bool):
        raise ApiError(400, "stream must be true or false", param="stream")
    options = body.get("stream_options")
    include_usage = False
    if options is not None:
        if not isinstance(options, dict):
            raise ApiError(400, "stream_options must be an object", param="stream_options")
        if not stream:
            raise ApiError(400, "Stream options can only be defined when `stream=True`.",
                           param="stream_options")
        include_usage = bool(options.get("include_usage", False))
    texts: list[str] = []
    fixed = 0
    triples: list[tuple[str, str, str | None]] = []
    token_ids: tuple[int, ...] | None = None
    if chat:
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            raise ApiError(400, "messages must be a non-empty list", param="messages")
        for i, msg in enumerate(messages):
            where = f"messages[{i}]"
            if not isinstance(msg, dict):
                raise ApiError(400, f"{where} must be an object", param="messages")
            role = msg.get("role")
            if not isinstance(role, str) or not role:
                raise ApiError(400, f"{where}.role must be a non-empty string", param="messages")
            texts.append(role)
            content = _content_text(msg.get("content"), where)
            texts.append(content)
            name = msg.get("name")
            if name is not None:
                if not isinstance(name, str):
                    raise ApiError(400, f"{where}.name must be a string", param="messages")
                texts.append(name)
                fixed += TOKENS_PER_NAME
            fixed += TOKENS_PER_MESSAGE
            triples.append((role, content, name))
        fixed += TOKENS_REPLY_PRIMING
    else:
        prompt = body.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
            prompt = prompt[0]
        if isinstance(prompt, str):
            texts.append(prompt)
        elif isinstance(prompt, list) and prompt and all(
                isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in prompt):
            fixed = len(prompt)
            token_ids = tuple(prompt)
        else:
            raise ApiError(400, "prompt must be a string, a list of token ids, or a list with "
                                "one of those (one prompt per request)", param="prompt")
    return CompletionRequest(chat=chat, model=model, texts=tuple(texts), fixed_tokens=fixed,
                             max_tokens=max_tokens, stream=stream, include_usage=include_usage,
                             messages=tuple(triples), token_ids=token_ids)


def parse_output_tokens(values: Sequence[str]) -> int | None:
    """parse_output_tokens reads the ``x-sim-output-tokens`` header's values: the output length in tokens.

    None when the header is absent. Raises ``ApiError`` (400) for a repeated header or a
    value that is not a whole number >= 1 (at most 18 digits).
    """
    if not values:
        return None
    if len(values) > 1:
        raise ApiError(400, f"{OUTPUT_TOKENS_HEADER} must be sent once, got {len(values)} values")
    value = values[0].strip()
    if not (value.isascii() and value.isdigit()) or len(value) > _OUTPUT_TOKENS_DIGITS or int(value) < 1:
        raise ApiError(400, f"{OUTPUT_TOKENS_HEADER} must be a whole number of tokens >= 1, "
                            f"got {value[:40]!r}")
    return int(value)


def count_prompt(req: CompletionRequest, encode: Callable[[str], Sequence[int]]) -> int:
    """count_prompt returns the request's prompt tokens: its texts through ``encode`` plus template overhead."""
    return req.fixed_tokens + sum(len(encode(t)) for t in req.texts if t)


def prompt_ids(req: CompletionRequest, encode: Callable[[str], Sequence[int]]) -> list[int]:
    """prompt_ids returns the prompt's token ids after the chat template; as many as ``count_prompt`` counts.

    A chat is laid out as ChatML: per message <|im_start|>, the role, (a name mark and the
    name), a separator, the content, <|im_end|>; then the reply's priming <|im_start|>
    assistant separator. So a reply's tokens follow the same ids as that reply sent back
    as an assistant message, and a later turn shares the blocks of the earlier one.
    """
    if req.token_ids is not None:
        return list(req.token_ids)
    if not req.chat:
        return [t for text in req.texts if text for t in encode(text)]
    ids: list[int] = []
    for role, content, name in req.messages:
        ids.append(IM_START)
        ids += encode(role) if role else ()
        if name is not None:
            ids.append(NAME_MARK)
            ids += encode(name) if name else ()
        ids.append(IM_SEP)
        ids += encode(content) if content else ()
        ids.append(IM_END)
    assistant = encode("assistant")
    ids += (IM_START, assistant[0] if len(assistant) == 1 else ASSISTANT_MARK, IM_SEP)
    return ids


def check_context(prompt_tokens: int, max_tokens: int | None, max_model_len: int) -> None:
    """check_context raises vLLM's 400 when the prompt, or prompt + max_tokens, exceeds ``max_model_len`` tokens."""
    if prompt_tokens >= max_model_len:
        raise ApiError(400, f"This model's maximum context length is {max_model_len} tokens. "
                            f"However, your request has {prompt_tokens} input tokens. Please "
                            "reduce the length of the input messages.")
    if max_tokens is not None and prompt_tokens + max_tokens > max_model_len:
        raise ApiError(400, f"'max_tokens' or 'max_completion_tokens' is too large: {max_tokens}. "
                            f"This model's maximum context length is {max_model_len} tokens and "
                            f"your request has {prompt_tokens} input tokens ({max_tokens} > "
                            f"{max_model_len} - {prompt_tokens}).", param="max_tokens")


def word_index(seq_id: int, index: int) -> int:
    """word_index is which of ``WORDS`` is output token ``index`` of sequence ``seq_id``."""
    return (seq_id * 7 + index) % len(WORDS)


def words(seq_id: int, start: int, count: int) -> str:
    """words returns output tokens ``start .. start+count-1`` of sequence ``seq_id``: cheap, deterministic text."""
    return "".join(WORDS[word_index(seq_id, i)] for i in range(start, start + count))


def word_ids(encode: Callable[[str], Sequence[int]]) -> tuple[int, ...] | None:
    """word_ids returns the token id of each of ``WORDS`` under ``encode``, or None if one is not one token."""
    ids = [encode(w) for w in WORDS]
    if any(len(i) != 1 for i in ids):
        return None
    return tuple(i[0] for i in ids)


class Responder:
    """Responder builds the JSON a vLLM server sends for one request.

    ``request_id`` is the response ``id``; ``created`` a Unix time in seconds.
    """

    __slots__ = ("req", "request_id", "created", "_object_chunk")

    def __init__(self, req: CompletionRequest, request_id: str, created: int | None = None) -> None:
        self.req = req
        self.request_id = request_id
        self.created = int(time.time()) if created is None else created
        self._object_chunk = "chat.completion.chunk" if req.chat else "text_completion"

    def usage(self, prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
        """usage is the OpenAI ``usage`` object, in tokens."""
        return {"prompt_tokens": prompt_tokens, "total_tokens": prompt_tokens + completion_tokens,
                "completion_tokens": completion_tokens}

    def _chunk(self, choices: list[dict[str, Any]], usage: dict[str, int] | None = None) -> bytes:
        obj: dict[str, Any] = {"id": self.request_id, "object": self._object_chunk,
                               "created": self.created, "model": self.req.model,
                               "choices": choices}
        if usage is not None:
            obj["usage"] = usage
        return b"data: " + orjson.dumps(obj) + b"\n\n"

    def role_chunk(self) -> bytes:
        """role_chunk is a chat stream's first event: the assistant role, empty content."""
        return self._chunk([{"index": 0, "delta": {"role": "assistant", "content": ""},
                             "logprobs": None, "finish_reason": None}])

    def text_chunk(self, text: str, finish_reason: str | None) -> bytes:
        """text_chunk is one stream event carrying ``text`` (and the finish reason on the last)."""
        if self.req.chat:
            choice = {"index": 0, "delta": {"content": text}, "logprobs": None,
                      "finish_reason": finish_reason}
        else:
            choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason}
        return self._chunk([choice])

    def usage_chunk(self, prompt_tokens: int, completion_tokens: int) -> bytes:
        """usage_chunk is the final event of a stream with ``include_usage``: no choices, usage."""
        return self._chunk([], self.usage(prompt_tokens, completion_tokens))

    @staticmethod
    def error_chunk(message: str, status: int = 500, error_type: str = "InternalServerError") -> bytes:
        """error_chunk is the event vLLM sends when a stream fails after it started."""
        return b"data: " + orjson.dumps({"error": {"message": message, "type": error_type,
                                                   "param": None, "code": status}}) + b"\n\n"

    DONE = b"data: [DONE]\n\n"

    def full(self, text: str, finish_reason: str, prompt_tokens: int, completion_tokens: int) -> bytes:
        """full is the non-streaming response body."""
        if self.req.chat:
            choice: dict[str, Any] = {"index": 0,
                                      "message": {"role": "assistant", "content": text},
                                      "logprobs": None, "finish_reason": finish_reason}
            obj = "chat.completion"
        else:
            choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason}
            obj = "text_completion"
        return orjson.dumps({"id": self.request_id, "object": obj, "created": self.created,
                             "model": self.req.model, "choices": [choice],
                             "usage": self.usage(prompt_tokens, completion_tokens)})
