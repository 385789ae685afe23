"""Results the loss does not use get no gradient tensor (ckptc/rewrite/unused_grads.py).

``loss = model(x, labels=y).loss`` leaves the logits unused; a compiled graph's
backward would otherwise receive a full-size tensor of zeros for them and add
it to the loss's gradient.
"""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
import torch.fx as fx

import ckptc
from ckptc.capture.compiler import CheckpointCompiler
from ckptc.rewrite.unused_grads import ZERO, fold_zeros, foldable_tangents, specialize
from tests.helpers import assert_same_training, budget_bounds, get_case, measure, step
from tests.zoo import ModelCase

aten = torch.ops.aten


def _graph(strides_match: bool = True, real_use: bool = False) -> tuple[fx.GraphModule, dict[str, fx.Node]]:
    """A backward-like graph: ``tangents_1`` (2x4), added to a gradient ``g`` (8) viewed as 2x4."""
    graph = fx.Graph()
    tangent = graph.placeholder("tangents_1")
    g = graph.placeholder("g")
    tangent.meta["val"] = torch.empty(2, 4)
    g.meta["val"] = torch.empty(8)
    viewed = graph.call_function(aten.view.default, (g, [2, 4]))
    viewed.meta["val"] = torch.empty(2, 4) if strides_match else torch.empty(4, 2).t()
    t_view = graph.call_function(aten.view.default, (tangent, [2, 4]))
    t_view.meta["val"] = torch.empty(2, 4)
    total = graph.call_function(aten.add.Tensor, (t_view, viewed))
    total.meta["val"] = torch.empty(2, 4)
    out = graph.call_function(aten.mul.Tensor, (total, 2.0))
    out.meta["val"] = torch.empty(2, 4)
    results = [out]
    if real_use:
        used = graph.call_function(aten.exp.default, (tangent,))  # exp(0) is 1: the zero is needed
        used.meta["val"] = torch.empty(2, 4)
        results.append(used)
    graph.output(tuple(results))
    nodes = {"tangents_1": tangent, "viewed": viewed, "t_view": t_view, "add": total}
    if real_use:
        nodes["exp"] = used
    return fx.GraphModule(torch.nn.Module(), graph), nodes


def test_zero_views_and_adds_of_zero_fold_away() -> None:
    gm, nodes = _graph()
    folding = fold_zeros(gm.graph, [nodes["tangents_1"]])
    assert folding.complete and folding.blocked_by is None
    assert folding.replaced[nodes["t_view"]] is ZERO
    assert folding.replaced[nodes["add"]] is nodes["viewed"]
    assert set(foldable_tangents(gm.graph)) == {"tangents_1"}

    special = specialize(gm, ["tangents_1"])
    ops = [n.target for n in special.graph.nodes if n.op == "call_function"]
    assert aten.add.Tensor not in ops and ops.count(aten.view.default) == 1
    g = torch.arange(8.0)
    (result,) = special(None, g)
    assert torch.equal(result, g.view(2, 4) * 2)


def test_a_zero_that_an_op_needs_as_a_tensor_does_not_fold() -> None:
    gm, nodes = _graph(real_use=True)
    folding = fold_zeros(gm.graph, [nodes["tangents_1"]])
    assert not folding.complete and folding.blocked_by is nodes["exp"]
    assert foldable_tangents(gm.graph) == {}

    gm, nodes = _graph(strides_match=False)  # add(zero, g) would hand on g with other strides
    assert not fold_zeros(gm.graph, [nodes["tangents_1"]]).complete


class _TwoHeads(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body = torch.nn.Sequential(torch.nn.Linear(32, 32), torch.nn.Tanh(), torch.nn.Linear(32, 32))
        self.head_a, self.head_b = torch.nn.Linear(32, 4), torch.nn.Linear(32, 4)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h = self.body(x)
        return self.head_a(h), self.head_b(h)


class _PooledHead(torch.nn.Module):
    """A body with a language-model head and a pooler the loss never uses (as BigBird's masked LM):
    the pooler's result passes through attention, layer norm, GELU, dropout and tanh, whose backward
    ops would need its gradient as a tensor unless they fold."""

    def __init__(self) -> None:
        super().__init__()
        self.body = torch.nn.Sequential(torch.nn.Linear(32, 32), torch.nn.Tanh(), torch.nn.Linear(32, 32))
        self.head_a = torch.nn.Linear(32, 4)
        self.qkv = torch.nn.Linear(32, 96)
        self.head_b = torch.nn.Sequential(
            torch.nn.LayerNorm(32), torch.nn.Linear(32, 32), torch.nn.GELU(), torch.nn.Dropout(0.1)
        )
        self.pool = torch.nn.Linear(32, 32)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h = self.body(x)
        q, k, v = self.qkv(h).unflatten(-1, (3, 2, 16)).permute(2, 0, 3, 1, 4)
        attended = torch.nn.functional.scaled_dot_product_attention(q, k, v).transpose(1, 2).flatten(-2)
        pooled = torch.tanh(self.pool(self.head_b(attended)[:, 0]))
        return self.head_a(h), pooled


@pytest.mark.parametrize("make", [_TwoHeads, _PooledHead], ids=["two_heads", "pooler"])
@pytest.mark.parametrize("entry", ["optimize", "backend"])
def test_a_parameter_no_gradient_reaches_keeps_grad_none_as_in_eager(entry: str, make: type) -> None:
    """A loss on one of two results: eager leaves the other's parameters' ``.grad`` None, and so does
    ckptc (their gradient folds away to None instead of a tensor of zeros, which AdamW's weight decay
    would then apply to: plain ``torch.compile`` differs there), also through the backward of an
    activation, attention, layer norm or dropout.  Parameters equal eager's after AdamW steps."""
    torch.compiler.reset()
    torch.manual_seed(0)
    reference = make()
    eager, model = copy.deepcopy(reference), copy.deepcopy(reference)
    fast = (
        ckptc.optimize(model, budget_gb=1)
        if entry == "optimize"
        else torch.compile(model, backend=ckptc.backend(budget_gb=1, model=model))
    )
    optimizers = [torch.optim.AdamW(m.parameters(), weight_decay=0.1) for m in (eager, model)]
    for step_ in range(3):
        x = torch.randn(16, 8, 32, generator=torch.Generator().manual_seed(step_))
        for run, optimizer in zip((eager, fast), optimizers, strict=True):
            torch.manual_seed(step_)
            optimizer.zero_grad(set_to_none=True)
            run(x)[0].square().mean().backward()
            optimizer.step()
        unused = [name for name, p in eager.named_parameters() if p.grad is None]
        assert unused and [name for name, p in model.named_parameters() if p.grad is None] == unused
        for (name, p), q in zip(model.named_parameters(), eager.parameters(), strict=True):
            torch.testing.assert_close(p, q, msg=name)


def test_unused_logits_cost_no_gradient_tensor() -> None:
    """Tiny Llama returning its loss: the logits' gradient is priced as free and never built.

    If the backward received a tensor of zeros for the logits, the measured
    peak would exceed the prediction by the logits' size (64 KiB here).
    """
    case = get_case("llama")
    reference = copy.deepcopy(case.model)
    compiler = CheckpointCompiler(None, strategy="none", model=case.model)
    compiled = torch.compile(case.model, backend=compiler)
    assert_same_training(case, reference, step(case, compiled), step(case, reference))
    (record,) = compiler.records
    assert record.joint_problem.free_tangents
    predicted = compiler.plan.predicted_peak_bytes
    measured = measure(case, compiled).peak_bytes
    logits = case.model.config.vocab_size * case.example_inputs[0].numel() * 4
    assert measured <= predicted + logits // 4, (measured, predicted)
    assert not record.gradients_unexpected


def _loss_using_logits(case: ModelCase) -> ModelCase:
    def loss(out) -> torch.Tensor:
        return out.loss + 1e-3 * out.logits.float().square().mean()

    return ModelCase("llama-loss-and-logits", case.model, case.example_inputs, case.example_kwargs, loss=loss)


def test_a_loss_that_also_uses_the_logits_is_exact_and_plans_again() -> None:
    case = _loss_using_logits(get_case("llama"))
    budget = budget_bounds(case).at(0.5)
    reference = copy.deepcopy(case.model)
    optimized = ckptc.optimize(case.model, budget_bytes=budget)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert_same_training(case, reference, step(case, optimized), step(case, reference))
    assert any("took for its loss" in str(w.message) for w in caught)
    # The next call plans again with the logits held through backward, and still trains exactly.
    assert_same_training(case, reference, step(case, optimized), step(case, reference))
    assert measure(case, optimized).peak_bytes <= budget


@pytest.mark.parametrize("name", ["llama", "gpt2", "bert"])
def test_keeping_everything_costs_no_more_than_eager(name: str) -> None:
    """Keep-everything holds eager's saved set: no zeros for the logits' gradient, and ops traced
    in backward (RMSNorm's backward re-deriving ``x * rsqrt``) run in backward, not kept from forward."""
    case = get_case(name)
    reference = copy.deepcopy(case.model)
    eager = measure(ModelCase(name, reference, case.example_inputs, case.example_kwargs, loss=case.loss), reference)
    optimized = ckptc.optimize(case.model, strategy="none")
    assert_same_training(case, reference, step(case, optimized), step(case, reference))
    assert measure(case, optimized).peak_bytes <= eager.peak_bytes
