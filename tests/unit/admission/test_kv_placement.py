"""Placement by what a node's KV events say it caches: exact where the view is live (it
overrides kvgate's own record, both ways), beside the record where events were missed, the
record alone without events; and the engine token ids kvgate can know for a request."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from extproc import openai_api as oai
from extproc.admission.nodes import PoolNodes, cached_guess
from extproc.admission.types import Chain, NodeReport
from extproc.engine_blocks import token_keys
from extproc.prefix import prompt_ids
from extproc.tokens import HFTokenizer, load_tokenizer
from tests.unit.admission.helpers import T0, config
from tests.unit.admission.test_nodes import CAP, nodes_pool


@pytest.mark.parametrize(("recorded", "seen", "want"), [
    (500, None, 500),            # no events: kvgate's record
    (500, (0, True), 0),         # events exact: evicted, whatever the record says
    (0, (320, True), 320),       # events exact: cached, though kvgate never sent it there
    (500, (320, False), 500),    # events partial: the larger
    (100, (320, False), 320),
])
def test_the_guess_follows_the_events_where_they_are_exact(recorded, seen, want):
    assert cached_guess(recorded, seen) == want


def two_nodes() -> PoolNodes:
    pool = PoolNodes(config(pool=nodes_pool(2, shared_prefix=True, prefix_affinity=1.0)).pools["default"], 3.0)
    for name in ("n0", "n1"):
        pool.report(name, NodeReport(kv_usage=0.0, capacity_tokens=CAP, at=T0))
    return pool


def test_live_events_override_the_record_of_a_prefix_that_ended_on_another_node():
    pool = two_nodes()
    chain = Chain((11, 22), (4000, 8000))
    first = pool.pick("standard", 8000, 100, 1.0, T0, chain=chain)
    assert hasattr(first, "node")
    pool.release(first, 100, True, T0)                       # kvgate's record: n? may cache it
    recorded = first.node.name
    other = "n1" if recorded == "n0" else "n0"
    # The engine of the recorded node evicted it; the other node's events say it caches it.
    said = {recorded: (0, True), other: (8000, True)}
    again = pool.pick("standard", 8000, 100, 1.0, T0, chain=chain, seen=said.get)
    assert again.node.name == other
    pool.release(again, 100, True, T0)
    # Its events down, the recorded node is taken on kvgate's record again, though the other
    # node (events live, exact) says it caches nothing now.
    said = {recorded: None, other: (0, True)}
    for _ in range(2):
        back = pool.pick("standard", 8000, 100, 1.0, T0, chain=chain, seen=said.get)
        assert back.node.name == recorded
        pool.release(back, 100, True, T0)


def parse(body: dict, endpoint: oai.Endpoint = oai.Endpoint.COMPLETIONS) -> oai.ParsedRequest:
    return oai.parse_request(endpoint, json.dumps(body).encode(), "application/json")


def bos_tokenizer(folder: Path) -> Path:
    """bos_tokenizer writes a word-level tokenizer.json whose post-processor adds a BOS (id 1)."""
    from tokenizers import Tokenizer, models, pre_tokenizers, processors
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, "the": 3, "quick": 4, "brown": 5, "fox": 6}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    path = folder / "tokenizer.json"
    tok.save(str(path))
    return path


def test_prompt_ids_are_known_for_token_id_prompts_and_for_text_with_a_tokenizer_json(tmp_path: Path):
    counter = load_tokenizer("cl100k_base")
    assert prompt_ids(parse({"model": "m", "prompt": [5, 6, 7]}), counter) == [5, 6, 7]
    assert prompt_ids(parse({"model": "m", "prompt": [[5, 6, 7]]}), counter) == [5, 6, 7]
    assert prompt_ids(parse({"model": "m", "prompt": [[5], [6]]}), counter) is None      # a batch
    assert prompt_ids(parse({"model": "m", "prompt": "hello"}), counter) is None        # counts only
    assert prompt_ids(parse({"model": "m", "prompt": "hello", "suffix": "x"}), counter) is None
    chat = parse({"model": "m", "messages": [{"role": "user", "content": "hi"}]}, oai.Endpoint.CHAT)
    assert prompt_ids(chat, counter) is None                                            # not rendered
    hf = load_tokenizer(f"hf:{bos_tokenizer(tmp_path)}")
    assert isinstance(hf, HFTokenizer)
    text = "the quick brown fox " * 20
    ids = prompt_ids(parse({"model": "m", "prompt": text}), hf)
    # As vLLM tokenizes a completions prompt: with the special tokens the file's post-processor
    # adds (here a BOS), which the count leaves out.
    assert ids == [1] + [3, 4, 5, 6] * 20 and hf.count(text) == 80
    assert len(token_keys(ids)) == len(ids) // 16


def test_the_exchange_keys_a_prompts_token_ids_only_where_the_pool_reads_kv_events():
    from extproc.configparse import parse_config
    from extproc.request.admit import _evaluate
    from extproc.gate import PoolRuntime
    from extproc.openai_shapes import TEMPLATES

    def runtime(kv_events: bool) -> PoolRuntime:
        raw = nodes_pool(1)
        if kv_events:
            raw["picking"]["kv_events"] = {"port": 5557}
        return PoolRuntime(parse_config({"pools": {"default": raw}}).pools["default"],
                           load_tokenizer("cl100k_base"), TEMPLATES["openai"])

    ids = list(range(40))
    body = json.dumps({"model": "m", "prompt": ids, "max_tokens": 5}).encode()
    parsed, tokens = _evaluate(oai.Endpoint.COMPLETIONS, body, "application/json", runtime(True))
    assert tokens == 40 and parsed.blocks == token_keys(ids) and len(parsed.blocks) == 2
    parsed, _ = _evaluate(oai.Endpoint.COMPLETIONS, body, "application/json", runtime(False))
    assert parsed.blocks is None
