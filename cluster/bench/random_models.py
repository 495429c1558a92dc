"""Randomly initialised generators of named shapes, built from a config (no download).

The benchmarks (``ralmspec bench batching --random-model``, ``ralmspec gpu-check``) use them to
measure the cost structure of a bigger model than the demo one; their tokens mean nothing.
The same name, dtype and tokenizer always give the same weights (seed 0).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Shape:
    family: str  # "gpt2" or "llama"
    layers: int
    width: int
    intermediate: int
    heads: int
    kv_heads: int
    positions: int


SHAPES: dict[str, Shape] = {
    "llama-1b": Shape("llama", 16, 2048, 8192, 32, 8, 2048),  # Llama-3.2-1B's shape
    "gpt2-124m": Shape("gpt2", 12, 768, 3072, 12, 12, 1024),
    "gpt2-355m": Shape("gpt2", 24, 1024, 4096, 16, 16, 1024),
    "llama-tiny": Shape("llama", 2, 64, 128, 4, 2, 2048),  # CPU smoke runs
    "gpt2-tiny": Shape("gpt2", 2, 64, 256, 4, 4, 2048),
}


def random_model(name: str, tokenizer, dtype: Any = None, device: Any = "cpu"):
    """A model of shape ``name`` with ``tokenizer``'s vocabulary and EOS, in ``dtype`` on
    ``device``, in eval mode."""
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM

    s = SHAPES[name]
    common = {
        "vocab_size": len(tokenizer),
        "eos_token_id": tokenizer.eos_token_id,
        "bos_token_id": tokenizer.eos_token_id,
    }
    torch.manual_seed(0)
    if s.family == "gpt2":
        cfg: Any = GPT2Config(
            n_layer=s.layers, n_embd=s.width, n_inner=s.intermediate, n_head=s.heads, n_positions=s.positions, **common
        )
        cls: Any = GPT2LMHeadModel
    else:
        cfg = LlamaConfig(
            num_hidden_layers=s.layers,
            hidden_size=s.width,
            intermediate_size=s.intermediate,
            num_attention_heads=s.heads,
            num_key_value_heads=s.kv_heads,
            max_position_embeddings=s.positions,
            **common,
        )
        cls = LlamaForCausalLM
    with torch.device(device):
        model = cls(cfg)
    return (model.to(dtype) if dtype is not None else model).eval()
