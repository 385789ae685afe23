"""State-space models train through ckptc: transformers' Mamba.

It runs transformers' slow Mamba path (no CUDA kernels), whose backward hits a
PyTorch 2.13 bug under every AOTAutograd backend: the fake-tensor kernel of
``aten.softplus_backward`` predicts other strides than the eager kernel
produces, and a later ``view`` fails at run time.  ckptc traces with a
decomposition of that op (``ckptc._torch_internals.workaround_decompositions``).
The tests below check, separately: that the bug is still in PyTorch (when one
of them fails, PyTorch fixed it and the workaround can go), that the
workaround alone fixes it, and that the model trains through ckptc like eager
PyTorch within a budget.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch._dynamo.backends.common import aot_autograd
from torch._functorch.aot_autograd import make_boxed_func
from torch._subclasses.fake_tensor import FakeTensorMode

import ckptc
from ckptc._torch_internals import workaround_decompositions
from tests.helpers import assert_same_training, budget_bounds, get_case, measure, step

SSM_MODELS = ["mamba"]
BUG = "view size is not compatible with input tensor's size and stride"
FIXED = ("PyTorch {} fixed the softplus_backward stride bug: remove aten.softplus_backward from "
         "ckptc._torch_internals.workaround_decompositions, this test, and the README's known-limits note")


def test_pytorch_softplus_backward_fake_strides_still_differ_from_eager() -> None:
    """The bug at its smallest: a transposed gradient, a contiguous input."""
    grad = torch.randn(2, 8, 4).transpose(1, 2)
    x = torch.randn(2, 4, 8)
    eager = torch.ops.aten.softplus_backward(grad, x, 1.0, 20.0)
    with FakeTensorMode() as mode:
        fake = torch.ops.aten.softplus_backward(mode.from_tensor(grad), mode.from_tensor(x), 1.0, 20.0)
    assert fake.stride() != eager.stride(), FIXED.format(torch.__version__)


def _boxed(gm: torch.fx.GraphModule, example_inputs: list) -> object:
    return make_boxed_func(gm.forward)


def test_aot_eager_fails_without_the_workaround_and_trains_with_it() -> None:
    name = "mamba"
    plain = get_case(name)
    with pytest.raises(RuntimeError, match=BUG):
        plain.forward_loss(torch.compile(plain.model, backend="aot_eager")).backward()
    torch._dynamo.reset()

    case = get_case(name)
    reference = copy.deepcopy(case.model)
    backend = aot_autograd(fw_compiler=_boxed, decompositions=workaround_decompositions())
    loss = step(case, torch.compile(case.model, backend=backend))
    assert_same_training(case, reference, loss, step(case, reference))


@pytest.mark.parametrize("name", SSM_MODELS)
def test_trains_through_ckptc_like_eager_within_a_halfway_budget(name: str) -> None:
    case = get_case(name)
    reference = copy.deepcopy(case.model)
    bounds = budget_bounds(case)
    assert bounds.floor < bounds.unoptimized, bounds
    budget = bounds.at(0.5)

    optimized = ckptc.optimize(case.model, budget_bytes=budget)
    loss = step(case, optimized)
    assert_same_training(case, reference, loss, step(case, reference))

    plan = optimized.plan
    assert plan.predicted_peak_bytes <= budget
    assert plan.values("recomputed"), "a halfway budget must force some recomputation"
    measured = measure(case, optimized)
    assert measured.peak_bytes <= budget, (measured.peak_bytes, budget)
    assert abs(measured.peak_bytes - plan.predicted_peak_bytes) <= 0.05 * plan.predicted_peak_bytes, (
        measured.peak_bytes, plan.predicted_peak_bytes)

