"""Issue 22: what a hostile user tries.  Inputs updated in place change once per call, every error is a
``CkptcError``, warnings reach the user, the floor never exceeds the unoptimized peak, and a capture
that would eat the machine is refused before it does.

Tiny models only: the whole module runs in seconds.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import ckptc


# -- inputs updated in place -------------------------------------------------------------------
class _ScalesItsInput(nn.Module):
    """A forward that updates the caller's tensor in place, optionally across a graph break."""

    def __init__(self, graph_break: bool) -> None:
        super().__init__()
        self.a = nn.Linear(8, 8)
        self.b = nn.Linear(8, 1)
        self.graph_break = graph_break

    def forward(self, x: torch.Tensor, seen: torch.Tensor) -> torch.Tensor:
        x.mul_(2)
        h = torch.tanh(self.a(x))
        if self.graph_break:
            torch._dynamo.graph_break()
        seen.add_(1)  # a step counter the caller keeps
        return self.b(h * seen).pow(2).mean()


@pytest.mark.parametrize("graph_break", [False, True], ids=["one-graph", "graph-break"])
def test_an_input_updated_in_place_changes_once_per_call_planning_calls_included(graph_break: bool) -> None:
    torch.manual_seed(0)
    model = _ScalesItsInput(graph_break)
    reference = copy.deepcopy(model)
    fast = ckptc.optimize(model, budget_bytes=10**9)
    x0 = torch.randn(4, 8)
    ours, eager = (x0.clone(), torch.zeros(())), (x0.clone(), torch.zeros(()))
    for call in range(2):  # the first call plans, the second runs the plan
        for p, q in zip(model.parameters(), reference.parameters(), strict=True):
            p.grad = q.grad = None
        loss, ref_loss = fast(*ours), reference(*eager)
        loss.backward()
        ref_loss.backward()
        assert torch.equal(ours[0], eager[0]) and torch.equal(ours[1], eager[1]), (call, ours[1], eager[1])
        assert torch.allclose(loss, ref_loss), (call, loss, ref_loss)
        for p, q in zip(model.parameters(), reference.parameters(), strict=True):
            assert torch.allclose(p.grad, q.grad, rtol=1e-5, atol=1e-6)
    # ckptc.plan runs the step once, as the caller would: the input changes once.
    planned = (x0.clone(), torch.zeros(()))
    ckptc.plan(copy.deepcopy(reference), planned, budget_bytes=10**9)
    assert torch.equal(planned[0], x0 * 2) and planned[1].item() == 1
