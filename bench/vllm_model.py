"""vllm_model: builds the tiny model that ``bench/bench_vllm.py`` serves with the real vLLM.

Run with the vLLM virtualenv's Python (it needs ``torch``, ``transformers`` and
``tokenizers``, which vLLM brings). Nothing is downloaded: the tokenizer is a byte-level BPE
trained here on this Python's standard-library sources, and the model is a Llama
architecture with random weights. Its output is noise; what the benchmark needs of it is
real: vLLM's scheduling, KV-cache accounting, preemption and metrics.

The tokenizer adds no special tokens to a prompt, so a prompt's token count is the same for
vLLM and for kvgate (which loads the same ``tokenizer.json``).
"""

from __future__ import annotations

import argparse
import json
import sysconfig
from pathlib import Path

# One description of the model: a folder built from other values is rebuilt.
SPEC = {
    "vocab_size": 4096,
    "hidden_size": 128,
    "intermediate_size": 256,
    "num_hidden_layers": 2,
    "num_attention_heads": 2,
    "num_key_value_heads": 2,
    "head_dim": 64,
    "max_position_embeddings": 16384,
    "seed": 0,
    "corpus_bytes": 3_000_000,
}
SPECIALS = ["<unk>", "<s>", "</s>"]          # ids 0, 1, 2
CHAT_TEMPLATE = ("{% for m in messages %}<s>{{ m['role'] }}\n{{ m['content'] }}</s>\n{% endfor %}"
                 "{% if add_generation_prompt %}<s>assistant\n{% endif %}")
SPEC_FILE = "kvgate-model-spec.json"


def corpus(limit_bytes: int) -> list[str]:
    """corpus is up to ``limit_bytes`` of this Python's standard-library sources, in a fixed order."""
    texts: list[str] = []
    total = 0
    for path in sorted(Path(sysconfig.get_paths()["stdlib"]).rglob("*.py")):
        try:
            text = path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError):
            continue
        texts.append(text)
        total += len(text)
        if total >= limit_bytes:
            break
    return texts


def build_tokenizer(out: Path) -> None:
    """build_tokenizer trains the byte-level BPE and saves it as a transformers tokenizer in ``out``."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=SPEC["vocab_size"], special_tokens=SPECIALS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tok.train_from_iterator(corpus(SPEC["corpus_bytes"]), trainer=trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>",
                                   eos_token="</s>", pad_token="</s>")
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(str(out))


def build_model(out: Path) -> None:
    """build_model saves a Llama model with random weights (bf16, about 1.4 M parameters) in ``out``."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(SPEC["seed"])
    cfg = LlamaConfig(
        vocab_size=SPEC["vocab_size"], hidden_size=SPEC["hidden_size"],
        intermediate_size=SPEC["intermediate_size"], num_hidden_layers=SPEC["num_hidden_layers"],
        num_attention_heads=SPEC["num_attention_heads"],
        num_key_value_heads=SPEC["num_key_value_heads"], head_dim=SPEC["head_dim"],
        max_position_embeddings=SPEC["max_position_embeddings"],
        bos_token_id=SPECIALS.index("<s>"), eos_token_id=SPECIALS.index("</s>"),
        pad_token_id=SPECIALS.index("</s>"), tie_word_embeddings=True, torch_dtype="bfloat16")
    LlamaForCausalLM(cfg).to(torch.bfloat16).save_pretrained(str(out))


def ensure(out: Path) -> bool:
    """ensure builds the model folder unless it already holds this SPEC; True when it built."""
    spec_path = out / SPEC_FILE
    if spec_path.exists() and json.loads(spec_path.read_text()) == SPEC:
        return False
    out.mkdir(parents=True, exist_ok=True)
    build_tokenizer(out)
    build_model(out)
    spec_path.write_text(json.dumps(SPEC, indent=1))
    return True


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, required=True, help="folder for the model and tokenizer")
    args = ap.parse_args(argv)
    built = ensure(args.out)
    print(f"{'built' if built else 'reused'} {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
