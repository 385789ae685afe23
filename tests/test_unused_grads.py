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
    """A backward-like graph: ``tangents_1`` (2x4), added to another result's gradient ``tangents_2`` (8)
    viewed as 2x4."""
    graph = fx.Graph()
    tangent = graph.placeholder("tangents_1")
    g = graph.placeholder("tangents_2")
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
        used = graph.call_function(aten.cat.default, ([tangent, viewed],))  # joins the zero with a tensor
        used.meta["val"] = torch.empty(4, 4)
        results.append(used)
    graph.output(tuple(results))
    nodes = {"tangents_1": tangent, "viewed": viewed, "t_view": t_view, "add": total}
    if real_use:
        nodes["cat"] = used
    return fx.GraphModule(torch.nn.Module(), graph), nodes


def test_zero_views_and_adds_of_zero_fold_away() -> None:
    gm, nodes = _graph()
    folding = fold_zeros(gm.graph, [nodes["tangents_1"]])
    assert folding.complete and folding.blocked_by is None
    assert folding.replaced[nodes["t_view"]] is ZERO
    assert folding.replaced[nodes["add"]] is nodes["viewed"]
    assert "tangents_1" in foldable_tangents(gm.graph)

    special, read = specialize(gm, ["tangents_1"])
    assert read == frozenset()  # the tangent is read by nothing: it can arrive as None
    ops = [n.target for n in special.graph.nodes if n.op == "call_function"]
    assert aten.add.Tensor not in ops and ops.count(aten.view.default) == 1
    g = torch.arange(8.0)
    (result,) = special(None, g)
    assert torch.equal(result, g.view(2, 4) * 2)


def test_a_zero_that_an_op_needs_as_a_tensor_does_not_fold() -> None:
    gm, nodes = _graph(real_use=True)
    folding = fold_zeros(gm.graph, [nodes["tangents_1"]])
    assert not folding.complete and folding.blocked_by is nodes["cat"] and folding.blocked == [nodes["cat"]]
    assert "tangents_1" not in foldable_tangents(gm.graph)

    gm, nodes = _graph(strides_match=False)  # add(zero, g) would hand on g with other strides
    assert not fold_zeros(gm.graph, [nodes["tangents_1"]]).complete


@pytest.mark.parametrize("strides_match", [True, False])
def test_a_backward_specialized_for_a_zero_that_does_not_fold_equals_the_original_given_zeros(
    strides_match: bool,
) -> None:
    """Where an op needs the zero as a tensor, the rest still folds: ``cat`` reads the tangent itself, and
    an ``add`` whose other side has other strides its view (a view costs no bytes): the tangent is then
    given as zeros."""
    g = torch.arange(8.0)
    for real_use in (True, False):
        gm, _ = _graph(strides_match=strides_match, real_use=real_use)
        special, read = specialize(gm, ["tangents_1"])
        assert read == (frozenset() if strides_match and not real_use else frozenset({"tangents_1"}))
        tangent = torch.zeros(2, 4) if read else None
        for got, want in zip(special(tangent, g), gm(torch.zeros(2, 4), g), strict=True):
            assert torch.equal(got, want)
        assert not [n for n in special.graph.nodes if n.target is aten.full.default]


def test_a_zero_computed_from_a_missing_tangent_is_made_where_an_op_needs_it() -> None:
    """``cat([t1 * 3, t2])`` with ``t1`` missing: zeros the size of ``t1 * 3`` are made just before the
    ``cat``, and ``t1`` is not read (it arrives as None)."""
    graph = fx.Graph()
    t1, t2 = graph.placeholder("tangents_1"), graph.placeholder("tangents_2")
    t1.meta["val"], t2.meta["val"] = torch.empty(2, 4), torch.empty(3, 4)
    scaled = graph.call_function(aten.mul.Tensor, (t1, 3.0))
    scaled.meta["val"] = torch.empty(2, 4)
    joined = graph.call_function(aten.cat.default, ([scaled, t2],))
    joined.meta["val"] = torch.empty(5, 4)
    graph.output((joined,))
    special, read = specialize(fx.GraphModule(torch.nn.Module(), graph), ["tangents_1"])
    assert read == frozenset()
    assert [n.target for n in special.graph.nodes if n.op == "call_function"] == [aten.full.default, aten.cat.default]
    (result,) = special(None, torch.ones(3, 4))
    assert torch.equal(result, torch.cat([torch.zeros(2, 4), torch.ones(3, 4)]))


def _gradient_only_a_missing_tangent_reaches() -> fx.GraphModule:
    """``pad(t1)`` (an op the folding does not know: it needs ``t1`` as a tensor) returned negated, and
    multiplied by the present ``t2``."""
    graph = fx.Graph()
    t1, t2 = graph.placeholder("tangents_1"), graph.placeholder("tangents_2")
    t1.meta["val"], t2.meta["val"] = torch.empty(3), torch.empty(5)
    padded = graph.call_function(aten.constant_pad_nd.default, (t1, [1, 1]))
    padded.meta["val"] = torch.empty(5)
    only_t1 = graph.call_function(aten.neg.default, (padded,))
    only_t1.meta["val"] = torch.empty(5)
    both = graph.call_function(aten.mul.Tensor, (padded, t2))
    both.meta["val"] = torch.empty(5)
    graph.output((only_t1, both))
    return fx.GraphModule(torch.nn.Module(), graph)


def test_an_input_gradient_only_missing_tangents_reach_is_none() -> None:
    """A backward is linear in its tangents: a gradient that no present tangent reaches is zero, and eager's
    autograd, starting from the results that got a gradient, never reaches its input (``.grad`` None)."""
    gm = _gradient_only_a_missing_tangent_reaches()
    assert not fold_zeros(gm.graph, [next(iter(gm.graph.nodes))]).complete
    special, read = specialize(gm, ["tangents_1"])
    assert read == frozenset({"tangents_1"})
    first, second = special(torch.zeros(3), torch.ones(5))
    assert first is None and torch.equal(second, torch.zeros(5))


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


class _SplitCache(torch.nn.Module):
    """Returns, beside its output, the key and value halves of a fused projection (as a cache does): their
    gradients are strided views of one tensor, and a loss on ``h`` reaches neither them nor the output."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.kv, self.c = torch.nn.Linear(32, 32), torch.nn.Linear(32, 64), torch.nn.Linear(32, 32)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        h = torch.tanh(self.a(x))
        k, v = self.kv(h).split(32, dim=-1)
        return h, k, v, self.c(h + k * v)


class _WithScalar(torch.nn.Module):
    """Returns a scalar (a statistic of its output) beside its features: a loss on the features leaves
    the scalar's gradient missing too."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.c = torch.nn.Linear(32, 32), torch.nn.Linear(32, 32)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        h = torch.tanh(self.a(x))
        out = self.c(h)
        return h, out, out.mean()


@pytest.mark.parametrize(
    "make", [_TwoHeads, _PooledHead, _SplitCache, _WithScalar], ids=["two_heads", "pooler", "split_cache", "scalar"]
)
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


def test_a_loss_on_an_inner_hidden_state_trains_like_eager() -> None:
    """GPT-2 returning its cache and every hidden state, a loss on the first block's output: the missing
    gradients of the later blocks' results (cache halves joined by ``cat``) fold only together; each
    parameter's gradient equals eager's, ``None`` where eager's is."""
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.compiler.reset()
    torch.manual_seed(0)
    config = GPT2Config(vocab_size=300, n_embd=64, n_layer=2, n_head=4, n_positions=64, use_cache=True)
    reference = GPT2LMHeadModel(config).train()
    eager, model = copy.deepcopy(reference), copy.deepcopy(reference)
    fast = ckptc.optimize(model, budget_gb=1)
    ids = torch.randint(0, 300, (2, 32), generator=torch.Generator().manual_seed(1))
    for step_ in range(2):
        for run, net in ((eager, eager), (fast, model)):
            torch.manual_seed(step_)  # the same dropout masks
            net.zero_grad(set_to_none=True)
            run(input_ids=ids, output_hidden_states=True).hidden_states[1].square().mean().backward()
        for (name, p), q in zip(model.named_parameters(), eager.parameters(), strict=True):
            assert (p.grad is None) == (q.grad is None), name
            if q.grad is not None:
                torch.testing.assert_close(p.grad, q.grad, msg=name)
    assert any(p.grad is None for p in eager.parameters())


def test_zeros_made_for_an_op_that_needs_them_compile_under_inductor() -> None:
    """The zeros a specialized backward makes (``aten.full``: Inductor refused ``aten.zeros``, which it
    expects decomposed) run in Inductor's kernels: a loss on the key half of a returned cache leaves the
    output's gradient missing, and ``add(zero, gradient of a strided half)`` needs it as a tensor."""
    torch.compiler.reset()
    torch.manual_seed(0)
    reference = _SplitCache()
    eager, model = copy.deepcopy(reference), copy.deepcopy(reference)
    fast = ckptc.optimize(model, budget_gb=1, compiler="inductor")
    x = torch.randn(4, 16, 32)
    for run in (eager, fast):
        run(x)[1].square().mean().backward()
    for (name, p), q in zip(model.named_parameters(), eager.parameters(), strict=True):
        assert (p.grad is None) == (q.grad is None), name
        if q.grad is not None:
            torch.testing.assert_close(p.grad, q.grad, rtol=1e-4, atol=1e-5, msg=name)
    assert model.c.weight.grad is None


class _LossAfterABreak(torch.nn.Module):
    """Layers, a scalar (an auxiliary loss) beside their output, then a graph break and the loss computed
    from that output: under ``torch.compile`` the first graph returns the scalar and the output, and the
    output's gradient comes from the model's own code after the break."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = torch.nn.Sequential(
            *(torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Tanh()) for _ in range(4))
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.layers(x)
        auxiliary = h.mean()
        torch._dynamo.graph_break()
        return h.square().mean() + auxiliary


def test_a_loss_the_model_computes_after_a_graph_break_is_told_once_as_the_models_own(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """``torch.compile(backend=ckptc.backend(..., hold_outputs=False))``: the caller reads only the model's
    loss, but the model computes it after a graph break from a graph's non-scalar result, whose gradient
    the first plan priced as absent.  The step warned twice (once from inside the backward, once from
    the check), saying that the caller's loss used the results.  Now one warning names the model's own
    code after a graph break among the causes, the steps train like eager's and are verified within the
    budget."""
    torch.compiler.reset()
    torch.manual_seed(0)
    reference = _LossAfterABreak()
    x = torch.randn(128, 64)
    captured = ckptc.capture(copy.deepcopy(reference), (x,))
    budget = (captured.floor_bytes + captured.unoptimized_peak_bytes) // 2
    eager, model = copy.deepcopy(reference), copy.deepcopy(reference)
    backend = ckptc.backend(budget_bytes=budget, model=model, hold_outputs=False, solver="hierarchical")
    compiled = torch.compile(model, backend=backend)
    with caplog.at_level("WARNING", logger="ckptc"):
        for _ in range(3):
            for net, params in ((compiled, model), (eager, eager)):
                params.zero_grad(set_to_none=True)
                net(x).backward()
            for p, q in zip(model.parameters(), eager.parameters(), strict=True):
                torch.testing.assert_close(p.grad, q.grad, rtol=1e-4, atol=1e-5)
    told = [r.getMessage() for r in caplog.records if r.name.startswith("ckptc") and r.levelname == "WARNING"]
    assert len(told) == 1 and "after a graph break" in told[0], told
    assert backend.step_check is not None and backend.step_check.verified, backend.step_check
    assert backend.step_check.measured_peak_bytes <= budget
