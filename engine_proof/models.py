"""The tier's models: small Llamas with random weights, written once per
run (``python models.py DIR``; transformers initializes them from a fixed
seed and saves them as safetensors), loaded by vLLM from that folder: no
tokenizer, nothing downloaded. The weights are large enough
(``initializer_range``) that the next-token distributions are far from
uniform: sampling, penalties and logprobs all depend on the state."""

from __future__ import annotations

import os
import sys

_LLAMA = dict(
    hidden_size=128,
    intermediate_size=256,
    num_attention_heads=4,
    num_key_value_heads=2,
    num_hidden_layers=2,
    vocab_size=2048,
    max_position_embeddings=512,
    rms_norm_eps=1e-5,
    tie_word_embeddings=False,
    rope_theta=10000.0,
    bos_token_id=1,
    eos_token_id=2,
    initializer_range=0.5,
)

MODELS = {
    "tiny": _LLAMA,
    # a context (8192) that the tier's KV cache cannot hold: auto-fit
    # max_model_len shrinks it
    "long": {**_LLAMA, "max_position_embeddings": 8192},
}


def model_dir(root: str, name: str) -> str:
    """The folder of model ``name`` under ``root`` (see :func:`write_models`)."""
    path = os.path.join(root, name)
    if not os.path.exists(os.path.join(path, "model.safetensors")):
        raise FileNotFoundError(f"{path}: no model there (python engine_proof/models.py {root} writes them)")
    return path


def write_models(root: str) -> None:
    """Every model of :data:`MODELS` under ``root``, from seed 0."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    for name, cfg in MODELS.items():
        torch.manual_seed(0)
        model = LlamaForCausalLM(LlamaConfig(**cfg, torch_dtype="float32"))
        model.save_pretrained(os.path.join(root, name))


if __name__ == "__main__":
    write_models(sys.argv[1])
