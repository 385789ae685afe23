"""State-space models train through ckptc: transformers' Mamba and our Caduceus-style BiMamba.

Both run transformers' slow Mamba path (no CUDA kernels), whose backward hits a
PyTorch 2.13 bug under every AOTAutograd backend: the fake-tensor kernel of
``aten.softplus_backward`` predicts other strides than the eager kernel
produces, and a later ``view`` fails at run time.  ckptc traces with a
decomposition of that op (``ckptc._torch_internals.workaround_decompositions``).
The tests below check, separately: that the bug is still in PyTorch (when one
of them fails, PyTorch fixed it and the workaround can go), that the
workaround alone fixes it, and that both models train through ckptc like eager
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
from tests.caduceus import TOKEN_ID, VOCAB, BiMambaDNA, complement_table, encode
from tests.helpers import assert_same_training, budget_bounds, get_case, measure, step

SSM_MODELS = ["mamba", "caduceus"]
BUG = "view size is not compatible with input tensor's size and stride"
FIXED = (
    "PyTorch {} fixed the softplus_backward stride bug: remove aten.softplus_backward from "
    "ckptc._torch_internals.workaround_decompositions, these two tests, and the README's notes on it"
)


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
    """On Mamba (Caduceus runs the same mixer; its ckptc test below fails without the workaround too)."""
    name = "mamba"
    plain = get_case(name, seq_len=8)  # the bug shows at any length; tracing the scan loop costs per step
    try:
        plain.forward_loss(torch.compile(plain.model, backend="aot_eager")).backward()
    except RuntimeError as error:
        assert BUG in str(error), error
    else:
        pytest.fail(FIXED.format(torch.__version__))
    torch.compiler.reset()

    case = get_case(name, seq_len=8)
    reference = copy.deepcopy(case.model)
    backend = aot_autograd(fw_compiler=_boxed, decompositions=workaround_decompositions())
    loss = step(case, torch.compile(case.model, backend=backend))
    assert_same_training(case, reference, loss, step(case, reference))


@pytest.mark.parametrize("name", SSM_MODELS)
def test_trains_through_ckptc_like_eager_within_a_halfway_budget(name: str) -> None:
    # The slow path unrolls its scan loop into the graph (~7 ops per step per layer, twice for Caduceus's
    # two strands), which capture and planning pay for per step; 8 steps still fail without the workaround.
    case = get_case(name, seq_len=8)
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
        measured.peak_bytes,
        plan.predicted_peak_bytes,
    )


def test_caduceus_vocabulary_and_reverse_complement() -> None:
    assert len(VOCAB) == 12
    table = complement_table()
    assert torch.equal(table[table], torch.arange(len(VOCAB)))  # complementing twice is the identity
    case = get_case("caduceus")
    model: BiMambaDNA = case.model
    assert torch.equal(model.reverse_complement(encode("AACGTN")[None]), encode("NACGTT")[None])
    ids = case.example_inputs[0]
    assert ids.min() >= 0 and ids.max() < len(VOCAB)
    assert (ids == TOKEN_ID["[MASK]"]).any()


def test_caduceus_sees_both_directions() -> None:
    """Changing the last nucleotide changes the first position's logits (a causal Mamba's would not)."""
    case = get_case("caduceus")
    model = case.model.eval()
    ids = case.example_inputs[0][:1].clone()
    changed = ids.clone()
    changed[0, -1] = TOKEN_ID["A"] if ids[0, -1] != TOKEN_ID["A"] else TOKEN_ID["C"]
    with torch.no_grad():
        first, second = model(ids), model(changed)
        causal_first = model.backbone(input_ids=ids).last_hidden_state
        causal_second = model.backbone(input_ids=changed).last_hidden_state
    assert torch.allclose(causal_first[0, 0], causal_second[0, 0])  # the backbone alone is causal
    assert not torch.allclose(first[0, 0], second[0, 0])
