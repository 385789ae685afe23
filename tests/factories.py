"""Factories for the CLI tests: ``ckptc plan tests/factories.py:gpt2`` and friends.

Each function is called with no arguments by ``ckptc`` and returns a model and
example inputs in one of the forms the CLI accepts.
"""

from __future__ import annotations

import torch
from torch import nn


def gpt2():
    """Hugging Face GPT-2 (tiny config, random weights) as a tests.zoo.ModelCase (object form)."""
    from tests.zoo import get_case

    case = get_case("gpt2")
    return case


def mlp() -> tuple[nn.Module, tuple[torch.Tensor]]:
    """A tiny MLP as (model, example_inputs); the CLI sums the output for a loss."""
    generator = torch.Generator().manual_seed(0)
    model = nn.Sequential(
        nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 64), nn.GELU(), nn.Linear(64, 64), nn.GELU(), nn.Linear(64, 10)
    )
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=generator) * 0.1)
    return model.train(), (torch.randn(16, 32, generator=generator),)


def mlp_dict() -> dict:
    """The same MLP in dict form, with an explicit loss."""
    model, (x,) = mlp()
    return {"model": model, "example_inputs": (x,), "loss": lambda out: out.pow(2).mean()}


def not_a_model() -> tuple[str, tuple]:
    """A broken factory: the "model" is a string."""
    return "not a model", ()


def wrong_shape() -> int:
    """A broken factory: returns neither a tuple, a dict nor a case."""
    return 42


def input_of_the_wrong_width() -> tuple[nn.Module, tuple[torch.Tensor]]:
    """A model given an input its first layer cannot take (a user's mistake, not ckptc's)."""
    return nn.Sequential(nn.Linear(32, 32), nn.Tanh(), nn.Linear(32, 1)), (torch.randn(4, 7),)


def mlp_dropout() -> tuple[nn.Module, tuple[torch.Tensor]]:
    """A tiny MLP with dropout, built deterministically, as (model, example_inputs).

    Dropout puts ckptc's generator-state captures into the graph, whose
    fingerprint must not depend on the process (plan files move between runs).
    """
    generator = torch.Generator().manual_seed(0)
    model = nn.Sequential(
        nn.Linear(32, 64), nn.GELU(), nn.Dropout(0.1), nn.Linear(64, 64), nn.GELU(), nn.Dropout(0.1), nn.Linear(64, 8)
    )
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=generator) * 0.1)
    return model.train(), (torch.randn(64, 32, generator=generator),)


def llama_on_meta() -> tuple[nn.Module, tuple[torch.Tensor], dict]:
    """A tiny Llama built on the meta device (no weights): planned offline (``ckptc plan --device cpu``)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=256,
        hidden_size=64,
        intermediate_size=172,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=32,
        use_cache=False,
    )
    with torch.device("meta"):
        model = LlamaForCausalLM(config).train()
    ids = torch.zeros(2, 32, dtype=torch.long, device="meta")
    return model, (ids,), {"labels": ids}
