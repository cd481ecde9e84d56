"""A tiny model directory SGLang can serve on a CPU with dummy weights (``load_format="dummy"``): what the demo on
the real engine, the plugin's tests and its benchmark run.

- ``dense``: a 2-layer ``LlamaForCausalLM`` (hidden 64, 4 heads, 2 KV heads, head_dim 16, intermediate 128).
- ``swa``: the same with SGLang's hybrid sliding-window layout (``is_hybrid_swa``, every other layer a 32-token
  window): SGLang then builds its real ``SWATokenToKVPoolAllocator`` and evicts out-of-window KV.

The vocabulary has 32000 entries (SGLang's benchmarks draw token ids up to 10000; a smaller one fails), with a
``tokenizers`` WordLevel tokenizer: ``<unk>`` 0, ``<s>`` 1, ``</s>`` 2, then ``w3`` .. ``w31999``. Standard library
only: the files are written as JSON.
"""

from __future__ import annotations

import json
import os

VOCAB = 32000
WINDOW = 32
KINDS = ("dense", "swa")


def config(kind: str) -> dict:
    if kind not in KINDS:
        raise ValueError(f"kind: expected one of {KINDS}, got {kind!r}")
    cfg = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "vocab_size": VOCAB,
        "max_position_embeddings": 4096,
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "bos_token_id": 1,
        "eos_token_id": 2,
        "torch_dtype": "float32",
        "tie_word_embeddings": False,
        "hidden_act": "silu",
    }
    if kind == "swa":
        # SGLang 0.5.23 reads this form (with layer_types its HybridSWAPoolConfigurator fails).
        cfg.update({"is_hybrid_swa": True, "hybrid_layer_pattern": [1, 0], "sliding_window": WINDOW})
    return cfg


def _tokenizer() -> dict:
    specials = (("<unk>", 0), ("<s>", 1), ("</s>", 2))
    vocab = {c: i for c, i in specials}
    vocab.update({f"w{i}": i for i in range(len(specials), VOCAB)})
    return {
        "version": "1.0",
        "truncation": None,
        "padding": None,
        "added_tokens": [
            {
                "id": i,
                "content": c,
                "single_word": False,
                "lstrip": False,
                "rstrip": False,
                "normalized": False,
                "special": True,
            }
            for c, i in specials
        ],
        "normalizer": None,
        "pre_tokenizer": {"type": "Whitespace"},
        "post_processor": None,
        "decoder": None,
        "model": {"type": "WordLevel", "vocab": vocab, "unk_token": "<unk>"},
    }


def write(directory: str, kind: str = "dense") -> str:
    """Write the model's files into ``directory`` (created if needed); returns its path."""
    cfg = config(kind)
    os.makedirs(directory, exist_ok=True)
    files = {
        "config.json": cfg,
        "tokenizer.json": _tokenizer(),
        "tokenizer_config.json": {
            "tokenizer_class": "PreTrainedTokenizerFast",
            "bos_token": "<s>",
            "eos_token": "</s>",
            "unk_token": "<unk>",
            "model_max_length": cfg["max_position_embeddings"],
        },
        "generation_config.json": {"bos_token_id": 1, "eos_token_id": 2},
    }
    for name, content in files.items():
        with open(os.path.join(directory, name), "w", encoding="utf-8") as f:
            json.dump(content, f)
    return directory
