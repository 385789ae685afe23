"""Shared helpers for tests that train real models: run a step, compare with eager, measure."""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any

import torch

import ckptc
from ckptc.meter import MemoryMeasurement, measure_peak, resident_bytes
from tests.zoo import ModelCase, get_case

#: The sizes of the tiny decoder-only transformers models tests build from a config (Llama-style names).
TINY_DECODER = dict(
    vocab_size=300,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
)


def tiny_lm_batch(vocab_size: int = 300) -> dict[str, torch.Tensor]:
    """A causal LM's training batch for those models: two sequences of 32 tokens, their own labels."""
    ids = torch.randint(0, vocab_size, (2, 32))
    return {"input_ids": ids, "labels": ids}


def step(case: ModelCase, model: Any, seed: int = 1234) -> torch.Tensor:
    """One forward+backward from zeroed gradients, with a fixed RNG seed (dropout)."""
    for p in model.parameters():
        p.grad = None
    torch.manual_seed(seed)
    loss = case.loss(model(*case.example_inputs, **case.example_kwargs))
    loss.backward()
    return loss.detach()


def assert_same_training(
    case: ModelCase,
    reference: torch.nn.Module,
    loss: torch.Tensor,
    ref_loss: torch.Tensor,
    rtol: float = 1e-4,
    atol: float = 1e-5,
) -> None:
    """Loss, every gradient and every buffer of ``case.model`` equal ``reference``'s."""
    assert torch.allclose(loss, ref_loss, rtol=rtol, atol=atol), (loss, ref_loss)
    ours = dict(case.model.named_parameters())
    for name, ref in reference.named_parameters():
        mine = ours[name]
        assert (mine.grad is None) == (ref.grad is None), f"{name}: grad presence differs"
        if ref.grad is not None:
            assert torch.allclose(mine.grad, ref.grad, rtol=rtol, atol=atol), (
                f"{name}: max abs diff {(mine.grad - ref.grad).abs().max().item():.3g}"
            )
    our_buffers = dict(case.model.named_buffers())
    for name, ref in reference.named_buffers():
        mine = our_buffers[name]
        assert torch.equal(mine, ref) or torch.allclose(mine.float(), ref.float(), rtol=rtol, atol=atol), name


@dataclass
class Bounds:
    unoptimized: int
    floor: int

    def at(self, fraction: float) -> int:
        # the floor is a budget (it includes ckptc's planning margin), so it can
        # exceed the unoptimized *peak* when nothing can be saved
        return int(self.floor + fraction * max(0, self.unoptimized - self.floor))


_bounds_cache: dict[tuple, Bounds] = {}


def budget_bounds(case: ModelCase) -> Bounds:
    """Unoptimized peak and smallest feasible budget, planned on a copy of the model.

    Cases are built deterministically, so the bounds are cached per model,
    input shapes, trainable parameters and autocast state (it saves a compile
    per test).
    """
    key = (
        case.name,
        tuple(tuple(t.shape) for t in [*case.example_inputs, *case.example_kwargs.values()]),
        tuple(p.requires_grad for p in case.model.parameters()),
        torch.is_autocast_enabled("cpu"),
    )
    if key not in _bounds_cache:
        plan = ckptc.plan(
            copy.deepcopy(case.model), case.example_inputs, case.example_kwargs, strategy="none", loss_fn=case.loss
        )
        _bounds_cache[key] = Bounds(plan.unoptimized_peak_bytes, plan.min_feasible_bytes)
    return _bounds_cache[key]


def measure(case: ModelCase, model: Any) -> MemoryMeasurement:
    """Peak of one step after a warm-up step, from zeroed gradients."""
    step(case, model)
    for p in case.model.parameters():
        p.grad = None
    baseline = resident_bytes(case.model, case.example_inputs, case.example_kwargs)
    _, measurement = measure_peak(lambda: step(case, model), baseline_bytes=baseline)
    return measurement


def eager_peak(
    reference: torch.nn.Module, args: tuple = (), kwargs: dict | None = None, loss=lambda out: out.loss
) -> int:
    """The peak of an eager step of a copy of ``reference`` after a warm-up step (allocator events plus the
    resident parameters and inputs)."""
    kwargs = kwargs or {}
    eager = copy.deepcopy(reference)
    loss(eager(*args, **kwargs)).backward()
    eager.zero_grad(set_to_none=True)
    baseline = resident_bytes(eager, args, kwargs)
    return measure_peak(lambda: loss(eager(*args, **kwargs)).backward(), baseline_bytes=baseline)[1].peak_bytes


def assert_trains_like_eager_within(
    reference: torch.nn.Module,
    budget: int,
    args: tuple = (),
    kwargs: dict | None = None,
    loss=lambda out: out.loss,
    *,
    entry: str = "optimize",
    steps: int = 2,
) -> None:
    """A copy of ``reference`` behind ``ckptc.optimize`` (``entry="backend"``: ``torch.compile`` with ckptc's
    backend) trains ``steps`` steps with every gradient equal to an eager copy's, then one more step measured
    independently of ckptc's check (allocator events plus the resident parameters and inputs) is at most
    ``budget``."""
    kwargs = kwargs or {}
    eager, model = copy.deepcopy(reference), copy.deepcopy(reference)
    if entry == "optimize":
        fast = ckptc.optimize(model, budget_bytes=budget)
    else:
        torch.compiler.reset()
        fast = torch.compile(model, backend=ckptc.backend(budget_bytes=budget, model=model))
    for _ in range(steps):
        for net, params in ((fast, model), (eager, eager)):
            params.zero_grad(set_to_none=True)
            loss(net(*args, **kwargs)).backward()
    for p, q in zip(model.parameters(), eager.parameters(), strict=True):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-4, atol=1e-5)
    model.zero_grad(set_to_none=True)
    baseline = resident_bytes(model, args, kwargs)
    _, measured = measure_peak(lambda: loss(fast(*args, **kwargs)).backward(), baseline_bytes=baseline)
    assert measured.peak_bytes <= budget, (measured.peak_bytes, budget)


__all__ = [
    "step",
    "assert_same_training",
    "assert_trains_like_eager_within",
    "budget_bounds",
    "eager_peak",
    "measure",
    "get_case",
    "Bounds",
]
