"""A prompt's prefix chain (extproc.prefix), against what an engine with prefix caching shares:
the token ids of the engine's own template and tokenizer, in whole blocks."""

from __future__ import annotations

import random

import pytest

from extproc import openai_api as oai
from extproc.admission.sharing import Prefixes
from extproc.admission.types import MAX_KEYS
from extproc.openai_shapes import TEMPLATES, chat_shape
from extproc.prefix import chat_chain, prefix_of, prompt_chain
from extproc.tokens import Tokenizer
from tests.unit.real_tokenizers import cl100k, llama_tt  # noqa: F401  (fixtures)

LLAMA3 = TEMPLATES["llama3"]
BLOCK = 16


def words(seed: int, n: int) -> str:
    rnd = random.Random(seed)
    vocab = ["kv", "cache", "node", "prefill", "decode", "token", "block", "gateway", "tenant",
             "the", "a", "of", "and", "Envoy", "vLLM", "route", "budget", "42", "7", "request."]
    return " ".join(rnd.choice(vocab) for _ in range(n))


SYSTEM = words(1, 2_500)
DOCUMENT = words(2, 1_800)


def conversation(question: str) -> list[dict[str, str]]:
    # The same system prompt and document; the questions differ after the document.
    return [{"role": "system", "content": SYSTEM},
            {"role": "user", "content": DOCUMENT + "\n\nQuestion: " + question}]


def engine_ids(messages: list[dict[str, str]], encode) -> list[int]:
    """engine_ids renders ``messages`` as Llama 3's template does, its special tokens as
    ids above the text's (what the engine hashes its blocks over)."""
    bos, start, end, eot = -1, -2, -3, -4
    ids = [bos]
    for m in messages:
        ids += [start, *encode(m["role"]), end, *encode("\n\n" + m["content"]), eot]
    return ids + [start, *encode("assistant"), end, *encode("\n\n")]


def shared_whole_blocks(a: list[int], b: list[int], block: int) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n - n % block


def credit_of_second(tok: Tokenizer, first, second) -> int:
    ledger = Prefixes(BLOCK)
    a = chat_chain(chat_shape(first), tok, LLAMA3)
    b = chat_chain(chat_shape(second), tok, LLAMA3)
    assert a is not None and b is not None
    ledger.add(a)
    return ledger.credit(b)


def test_with_the_engines_tokenizer_the_credit_is_what_the_engine_shares_less_a_piece(llama_tt):  # noqa: F811
    import tiktoken
    from tests.unit.real_tokenizers import LLAMA_MODEL
    from extproc.tokens import read_rank_file
    enc = tiktoken.Encoding("llama3-test", pat_str=r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+""",
                            mergeable_ranks=read_rank_file(LLAMA_MODEL), special_tokens={})
    first, second = conversation("what fits?"), conversation("which node?")
    engine = shared_whole_blocks(engine_ids(first, enc.encode_ordinary),
                                 engine_ids(second, enc.encode_ordinary), BLOCK)
    credit = credit_of_second(llama_tt, first, second)
    assert credit <= engine                       # never more than the engine shares
    assert credit >= engine - 400                 # at most about a piece (~256 tokens) and a block less


def test_with_another_tokenizer_the_credit_stays_below_the_engines_share(cl100k, llama_tt):  # noqa: F811
    """kvgate counting with cl100k before a Llama 3 engine: the credit, in cl100k tokens, is
    at most cl100k's count of the text whose blocks the engine shares."""
    first, second = conversation("what fits?"), conversation("which node?")
    credit = credit_of_second(cl100k, first, second)
    common = SYSTEM + DOCUMENT
    assert 0 < credit <= cl100k.count(common) + 20


def test_different_system_prompts_share_nothing_and_tools_join_the_first_key(cl100k):  # noqa: F811
    a = chat_chain(chat_shape(conversation("q")), cl100k, LLAMA3)
    other = [{"role": "system", "content": "x " + SYSTEM}, {"role": "user", "content": DOCUMENT}]
    b = chat_chain(chat_shape(other), cl100k, LLAMA3)
    tools = [{"type": "function", "function": {"name": "f", "parameters": {}}}]
    c = chat_chain(chat_shape(conversation("q"), tools), cl100k, LLAMA3)
    assert a is not None and b is not None and c is not None
    assert a.keys[1] != b.keys[1] and a.keys[0] != c.keys[0]    # keys[0]: the system role's header
    ledger = Prefixes(BLOCK)
    ledger.add(a)
    assert ledger.credit(b) == 0 and ledger.credit(c) == 0
    assert list(a.ends) == sorted(a.ends) and len(a.keys) == len(a.ends)
    # The ends stay within the counted prompt.
    assert a.ends[-1] <= oai.count_prompt_tokens(
        oai.parse_request(oai.Endpoint.CHAT, b'{"model":"m","messages":' + __import__("json").dumps(
            conversation("q")).encode() + b'}', "application/json"), cl100k, LLAMA3)


def test_a_long_prompt_chains_at_most_max_keys_and_token_ids_or_batches_not_at_all(cl100k):  # noqa: F811
    huge = chat_chain(chat_shape([{"role": "user", "content": words(3, 200_000)}]), cl100k, LLAMA3)
    assert huge is not None and len(huge.keys) == MAX_KEYS
    assert prompt_chain(oai.prompt_shape([1, 2, 3]), cl100k) is None
    assert prompt_chain(oai.prompt_shape(["a b c", "d e f"]), cl100k) is None
    one = prompt_chain(oai.prompt_shape(SYSTEM), cl100k)
    assert one is not None and one.ends[-1] == cl100k.count(SYSTEM)


def test_a_completions_suffix_is_not_chained(cl100k):  # noqa: F811
    body = b'{"model":"m","prompt":"' + SYSTEM[:2000].encode() + b'","suffix":"end"}'
    req = oai.parse_request(oai.Endpoint.COMPLETIONS, body, "application/json")
    assert req.suffix == "end" and prefix_of(req, cl100k, LLAMA3) is None


@pytest.mark.parametrize("n", [1, 5])
def test_requests_with_one_conversation_share_it_n_minus_one_times(cl100k, n):  # noqa: F811
    ledger = Prefixes(BLOCK)
    for i in range(n):
        chain = chat_chain(chat_shape(conversation(f"question {i}")), cl100k, LLAMA3)
        assert chain is not None
        ledger.add(chain)
    assert (ledger.shared > 0) is (n > 1)
