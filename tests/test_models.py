"""Smoke tests for the model zoo in ``tests.zoo`` (tiny sizes only; a few seconds in total)."""

from __future__ import annotations

import math

import pytest
import torch

from tests.hyena import HyenaConfig, HyenaDNA, fft_causal_conv
from tests.zoo import MODEL_SIZES, MODELS, ModelCase, get_case

ALL_MODELS = sorted(MODELS)
HF_ATTENTION_MODELS = ["gpt2", "llama", "bert", "vit"]


@pytest.mark.parametrize("name", ALL_MODELS)
def test_tiny_case_trains_eagerly(name: str) -> None:
    torch.manual_seed(0)  # dropout in the forward pass draws from the global RNG
    case = get_case(name)
    assert isinstance(case, ModelCase) and case.name == name
    assert case.model.training
    assert all(isinstance(t, torch.Tensor) for t in (*case.example_inputs, *case.example_kwargs.values()))

    loss = case.forward_loss()
    assert loss.dim() == 0 and math.isfinite(loss.item())
    loss.backward()

    grads = [p.grad for p in case.model.parameters() if p.requires_grad]
    assert any(g is not None for g in grads), "no parameter received a gradient"
    assert all(torch.isfinite(g).all() for g in grads if g is not None)


@pytest.mark.parametrize("name", ALL_MODELS)
def test_construction_is_deterministic_and_leaves_global_rng_alone(name: str) -> None:
    torch.manual_seed(1234)
    rng_before = torch.get_rng_state()
    first, second = get_case(name, seed=3), get_case(name, seed=3)
    assert torch.equal(rng_before, torch.get_rng_state())
    for a, b in zip(first.model.state_dict().values(), second.model.state_dict().values(), strict=True):
        assert torch.equal(a, b)
    for a, b in zip(first.example_inputs, second.example_inputs, strict=True):
        assert torch.equal(a, b)


def test_registry_lists_tiny_for_every_model() -> None:
    assert set(MODEL_SIZES) == set(MODELS)
    assert all("tiny" in sizes for sizes in MODEL_SIZES.values())


@pytest.mark.parametrize("name", HF_ATTENTION_MODELS)
def test_sdpa_matches_eager_attention(name: str) -> None:
    # eval() disables dropout so the two attention kernels see identical inputs.
    eager, sdpa = get_case(name, attn_implementation="eager"), get_case(name, attn_implementation="sdpa")
    eager.model.eval()
    sdpa.model.eval()
    with torch.no_grad():
        torch.testing.assert_close(sdpa.forward_loss(), eager.forward_loss(), rtol=1e-4, atol=1e-5)


def test_gpt2_has_active_dropout() -> None:
    case = get_case("gpt2")
    torch.manual_seed(0)
    first = case.forward_loss()
    second = case.forward_loss()
    assert not torch.equal(first, second), "train-mode GPT-2 should be stochastic (dropout on)"


def test_bert_decoder_is_tied_to_word_embeddings() -> None:
    model = get_case("bert").model
    assert model.cls.predictions.decoder.weight is model.bert.embeddings.word_embeddings.weight


@pytest.mark.parametrize(
    ("name", "kwargs"),
    [
        ("gpt2", {"size": "no-such-size"}),
        ("vit", {"seq_len": 15}),  # number of patches must be a perfect square
        ("enformer", {"seq_len": 1000}),  # must be a multiple of 128 bp
        ("mlp", {"seq_len": 8}),  # no sequence dimension
        ("hyena", {"batch": 0}),
    ],
)
def test_invalid_arguments_raise(name: str, kwargs: dict) -> None:
    with pytest.raises(ValueError):
        get_case(name, **kwargs)


def test_unknown_model_raises_key_error() -> None:
    with pytest.raises(KeyError):
        get_case("resnet9000")


def test_fft_causal_conv_matches_direct_convolution() -> None:
    torch.manual_seed(0)
    u, k, skip = torch.randn(2, 3, 20, dtype=torch.float64), torch.randn(3, 20, dtype=torch.float64), torch.randn(3)
    # Causal conv == cross-correlation with the flipped kernel over a left-padded input.
    direct = torch.nn.functional.conv1d(torch.nn.functional.pad(u, (19, 0)), k.flip(-1)[:, None], groups=3)
    torch.testing.assert_close(fft_causal_conv(u, k, skip.double()), direct + u * skip.double()[:, None])


def test_hyena_is_causal() -> None:
    torch.manual_seed(0)
    model = HyenaDNA(HyenaConfig(d_model=16, n_layer=2, max_seq_len=64, filter_width=16)).eval()
    tokens = torch.randint(0, 4, (1, 64))
    changed = tokens.clone()
    changed[0, 40] = (changed[0, 40] + 1) % 4
    with torch.no_grad():
        before, after = model(tokens), model(changed)
    torch.testing.assert_close(before[:, :40], after[:, :40], rtol=0, atol=1e-5)
    assert not torch.allclose(before[:, 40:], after[:, 40:])
