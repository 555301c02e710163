"""The tier's models: a ``config.json`` each (a small Llama), run with
``load_format="dummy"`` (vLLM fills the weights itself, the same in every
process: the same seed), no tokenizer, nothing downloaded."""

from __future__ import annotations

import json
import os

_LLAMA = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 128,
    "intermediate_size": 256,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "num_hidden_layers": 2,
    "vocab_size": 2048,
    "max_position_embeddings": 512,
    "rms_norm_eps": 1e-5,
    "torch_dtype": "float32",
    "bos_token_id": 1,
    "eos_token_id": 2,
    "tie_word_embeddings": False,
    "rope_theta": 10000.0,
}

MODELS = {
    "tiny": _LLAMA,
    # a context (8192) that the tier's KV cache cannot hold: auto-fit
    # max_model_len shrinks it
    "long": {**_LLAMA, "max_position_embeddings": 8192},
}


def write_model(root: str, name: str) -> str:
    """The folder of model ``name`` under ``root`` (written if missing)."""
    path = os.path.join(root, name)
    os.makedirs(path, exist_ok=True)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(MODELS[name], f, indent=1)
    return path
