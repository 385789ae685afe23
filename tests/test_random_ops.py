"""Random factory ops (rand, randn, randint, normal, randperm) called with keyword
arguments are recomputed in backward with the numbers they drew in forward."""

from __future__ import annotations

import copy
from typing import Callable

import pytest
import torch
from torch import nn

import ckptc

# Each draws a random tensor shaped like ``h`` (or its last dimension) with the
# keyword arguments users write: device=, dtype=, size=.
DRAWS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "rand": lambda h: h * torch.rand(h.shape, device=h.device, dtype=h.dtype),
    "randn": lambda h: h * torch.randn(h.shape, device=h.device, dtype=h.dtype),
    "randint": lambda h: h * torch.randint(0, 3, h.shape, device=h.device, dtype=h.dtype),
    "normal": lambda h: h * torch.normal(0.0, 1.0, size=h.shape, device=h.device, dtype=h.dtype),
    "randperm": lambda h: h[:, torch.randperm(h.shape[-1], device=h.device)],
}


class _Noise(nn.Module):
    def __init__(self, draw: Callable[[torch.Tensor], torch.Tensor]) -> None:
        super().__init__()
        self.draw = draw

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return self.draw(h)


class _Noisy(nn.Module):
    def __init__(self, draw: Callable[[torch.Tensor], torch.Tensor]) -> None:
        super().__init__()
        self.a = nn.Linear(16, 16)
        self.noise = _Noise(draw)
        self.b = nn.Linear(16, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(torch.tanh(self.noise(self.a(x)))).square().mean()


@pytest.mark.parametrize("op", sorted(DRAWS))
def test_random_factory_op_with_keyword_arguments_is_recomputed_like_eager(op: str) -> None:
    torch.manual_seed(0)
    model = _Noisy(DRAWS[op])
    reference = copy.deepcopy(model)
    x = torch.randn(8, 16)
    optimized = ckptc.optimize(model, strategy="none", must_recompute=[f"noise.{op}*"])
    results = []
    for m in (optimized, reference):
        torch.manual_seed(1)
        loss = m(x)
        loss.backward()
        # the step leaves the program's random stream where eager leaves it
        results.append((loss.detach(), torch.rand(4)))
    (loss, after), (ref_loss, ref_after) = results
    recomputed = [v.name for v in optimized.plan.values("recomputed")]
    assert any(name.startswith(f"noise.{op}") for name in recomputed), recomputed
    assert torch.equal(loss, ref_loss)
    assert torch.equal(after, ref_after)
    for (name, p), q in zip(model.named_parameters(), reference.parameters(), strict=False):
        assert torch.allclose(p.grad, q.grad, rtol=1e-5, atol=1e-7), name


class _OwnGenerator(nn.Module):
    """Noise drawn from a generator the module owns (``torch.rand(..., generator=self.gen)``)."""

    def __init__(self) -> None:
        super().__init__()
        self.inner = nn.Linear(32, 64)
        self.outer = nn.Linear(64, 4)
        self.gen = torch.Generator().manual_seed(1234)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.inner(x))
        return self.outer(h * (torch.rand(h.shape, generator=self.gen) > 0.3))


def test_a_generator_the_model_owns_draws_eagers_numbers_on_every_step() -> None:
    """The call that plans runs the forward twice and puts back torch's, numpy's and Python's random state:
    a module's own generator was left advanced, so every later step drew other noise than eager's (loss
    -155.87 against eager's -164.69 on the second step, gradients 11.6 apart), without a word; and
    ``ckptc.capture`` left it advanced too."""
    torch.manual_seed(0)
    reference = _OwnGenerator()
    model = copy.deepcopy(reference)
    fast = ckptc.optimize(model, budget_gb=1)
    x = torch.randn(256, 32)
    for _ in range(3):
        for m, call in ((reference, reference), (model, fast)):
            m.zero_grad(set_to_none=True)
            call(x).sum().backward()
        for p, q in zip(model.parameters(), reference.parameters(), strict=True):
            torch.testing.assert_close(p.grad, q.grad)
    assert torch.equal(model.gen.get_state(), reference.gen.get_state())
    state = model.gen.get_state()
    ckptc.capture(model, x)
    assert torch.equal(model.gen.get_state(), state)
