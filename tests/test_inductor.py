"""Issue 25: ``compiler="inductor"`` trains a transformers model of realistic shape like ``torch.compile``.

GPT-2 with 2 layers, 256 wide, batch 4 x 256 tokens, dropout off (Inductor's random
numbers are not eager's, so a plain ``torch.compile`` run is the reference only without
dropout; the dropout case is ``tests/test_backend_and_plans.py``'s).  Through
``ckptc.optimize``, a plan file and the ``torch.compile`` backend, the loss and every
gradient equal a plain ``torch.compile`` run's within fused-kernel tolerance, and the
measured peak is within the budget.  Inductor compiles are slow on 2 cores, so the
reference run and the capture are shared by the tests of this file (two layers, not the four the
issue measured: each layer is more kernels to compile, and two already repeat a block).
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import ckptc
from ckptc import _torch_internals as internals
from ckptc.meter import measure_peak, resident_bytes
from tests.helpers import assert_same_training, step
from tests.zoo import ModelCase, get_case, gpt2_without_dropout

LAYERS, WIDTH, HEADS, VOCAB, BATCH, SEQ = 2, 256, 4, 1024, 4, 256


def _gpt2(layers: int = LAYERS, width: int = WIDTH) -> torch.nn.Module:
    return gpt2_without_dropout(layers, width, VOCAB, heads=HEADS, positions=SEQ)


def _step(model: Any, ids: torch.Tensor, parameters: Any) -> torch.Tensor:
    for p in parameters:
        p.grad = None
    loss = model(ids, labels=ids).loss
    loss.backward()
    return loss.detach()


@pytest.fixture(scope="module")
def gpt2() -> dict[str, Any]:
    model = _gpt2()
    ids = torch.randint(0, VOCAB, (BATCH, SEQ), generator=torch.Generator().manual_seed(1))
    reference = copy.deepcopy(model)
    loss = _step(torch.compile(reference), ids, reference.parameters())
    return {"model": model, "ids": ids, "loss": loss, "grads": [p.grad for p in reference.parameters()]}


@pytest.fixture(scope="module")
def captured(gpt2: dict[str, Any]) -> ckptc.CapturedStep:
    return ckptc.capture(copy.deepcopy(gpt2["model"]), (gpt2["ids"],), {"labels": gpt2["ids"]}, compiler="inductor")


def test_planning_for_inductor_generates_no_kernels() -> None:
    # The capture traces the graphs Inductor would compile (the plan names their nodes) and runs
    # them op by op: kernels are generated only for the graphs that train.
    def no_kernels(*_: Any) -> Any:
        raise AssertionError("planning generated Inductor kernels")

    model, ids = _gpt2(layers=1, width=64), torch.randint(0, VOCAB, (2, 32))
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(internals, "inductor_compile", no_kernels)
        step = ckptc.capture(model, (ids,), {"labels": ids}, compiler="inductor")
        plan = step.plan(budget_bytes=step.floor_bytes)
    assert plan.values("recomputed") and plan.predicted_peak_bytes <= step.floor_bytes


def _midway(step: ckptc.CapturedStep) -> int:
    return (step.floor_bytes + step.unoptimized_peak_bytes) // 2


def _assert_like_torch_compile(gpt2: dict[str, Any], model: torch.nn.Module, loss: torch.Tensor) -> None:
    torch.testing.assert_close(loss, gpt2["loss"], rtol=1e-4, atol=1e-5)
    for p, expected in zip(model.parameters(), gpt2["grads"], strict=True):
        torch.testing.assert_close(p.grad, expected, rtol=1e-3, atol=1e-5)


def _measured_peak(gpt2: dict[str, Any], model: torch.nn.Module, optimized: Any) -> int:
    """The peak of one step from ``None`` gradients (allocator events plus resident tensors), its loss
    and gradients checked against torch.compile's."""
    for p in model.parameters():
        p.grad = None
    baseline = resident_bytes(model, gpt2["ids"])
    loss, measured = measure_peak(lambda: _step(optimized, gpt2["ids"], ()), baseline_bytes=baseline)
    _assert_like_torch_compile(gpt2, model, loss)
    return measured.peak_bytes


def test_optimize_with_inductor_trains_like_torch_compile_within_the_budget(
    gpt2: dict[str, Any], captured: ckptc.CapturedStep
) -> None:
    budget = _midway(captured)
    model = copy.deepcopy(gpt2["model"])
    optimized = ckptc.optimize(model, budget_bytes=budget, compiler="inductor")
    _assert_like_torch_compile(gpt2, model, _step(optimized, gpt2["ids"], model.parameters()))
    _step(optimized, gpt2["ids"], model.parameters())  # verified by ckptc against the budget
    assert _measured_peak(gpt2, model, optimized) <= budget
    plan = optimized.plan
    assert plan.values("recomputed"), "a budget midway to the floor recomputes something"


def test_plan_file_through_the_inductor_backend_trains_like_torch_compile(
    gpt2: dict[str, Any], captured: ckptc.CapturedStep, tmp_path: Path
) -> None:
    plan = captured.plan(budget_bytes=_midway(captured))
    path = tmp_path / "gpt2.ckptc.json"
    plan.save(path)
    model = copy.deepcopy(gpt2["model"])
    backend = ckptc.backend(plan=str(path), compiler="inductor")
    compiled = torch.compile(model, backend=backend, dynamic=False)
    _assert_like_torch_compile(gpt2, model, _step(compiled, gpt2["ids"], model.parameters()))
    assert backend.plan is not None
    assert backend.plan.values("kept") == plan.values("kept")


def test_inductor_plans_recompute_fused_chains_that_eager_plans_keep(captured: ckptc.CapturedStep) -> None:
    # With room to keep everything, the eager compiler keeps every activation; Inductor
    # recomputes pointwise outputs inside fused kernels (a read of their inputs) rather
    # than write and read them back, at no higher peak.
    roomy = captured.unoptimized_peak_bytes * 2
    for_inductor = captured.plan(budget_bytes=roomy)
    assert for_inductor.values("recomputed")
    assert for_inductor.predicted_peak_bytes <= captured.unoptimized_peak_bytes


def test_values_computed_inside_kernels_are_never_kept(captured: ckptc.CapturedStep) -> None:
    # A pointwise value whose readers are all fused kernels of its phase is computed inside them and
    # priced at 0 bytes; kept for backward it would be written, at bytes no plan counted.
    jp = captured.records[0].joint_problem
    costs = [jp.node_cost(name) for name in jp.nodes]
    inlined = {cost.stable_name for cost in costs if cost.inlined and cost.kind == "forward"}  # plans' names
    assert inlined, "the GPT-2 has pointwise chains Inductor computes inside their readers"
    for fraction in (0.0, 0.25, 0.5, 1.0):
        budget = captured.floor_bytes + int(fraction * (captured.unoptimized_peak_bytes - captured.floor_bytes))
        (graph,) = captured.plan(budget_bytes=budget).graphs
        assert not graph.plan.kept & inlined, f"at {fraction} of the range"


def test_the_first_planned_step_under_inductor_is_within_the_budget(
    gpt2: dict[str, Any], captured: ckptc.CapturedStep
) -> None:
    # Measured without ckptc's run-time check (verify=False), so no replan hides a prediction
    # that missed: keeping values Inductor computes inside kernels made this step 1.2x its budget (4 layers).
    budget = captured.floor_bytes + (captured.unoptimized_peak_bytes - captured.floor_bytes) // 4
    model = copy.deepcopy(gpt2["model"])
    # hold_outputs=False: the caller drops the logits (``.loss`` only), as the plan is told upfront; left to
    # watch (None), the first step's plan counts them held and the next step plans and compiles again.
    optimized = ckptc.optimize(model, budget_bytes=budget, compiler="inductor", verify=False, hold_outputs=False)
    _step(optimized, gpt2["ids"], model.parameters())
    peak = _measured_peak(gpt2, model, optimized)
    assert peak <= budget
    assert peak <= optimized.plan.predicted_peak_bytes


def test_a_saved_tensor_inductors_forward_lays_out_otherwise_reaches_a_backward_compiled_for_its_layout() -> None:
    """Llama's attention saves the keys its grouped-query heads share, an expanded view in the joint
    graph; under the halfway plan (nested recomputation) Inductor's forward returns it in another
    layout, and the backward, compiled for the joint graph's strides, failed its input check ("expected
    ... stride 1==0", every step).  Its kernels are now compiled on first use for the strides its inputs
    arrive with, as AOTAutograd restrides a backward to its forward's outputs.  One decoder layer of the
    zoo's tiny Llama (it has two) fails the same way, with fewer Inductor kernels to compile."""
    from transformers import LlamaForCausalLM

    tiny = get_case("llama", size="tiny")
    config = copy.deepcopy(tiny.model.config)
    config.num_hidden_layers = 1
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).train()
    case = ModelCase("llama", model, tiny.example_inputs, tiny.example_kwargs, loss=tiny.loss)
    reference = copy.deepcopy(case.model)
    captured = ckptc.capture(
        copy.deepcopy(case.model), case.example_inputs, case.example_kwargs, loss_fn=case.loss, compiler="inductor"
    )
    budget = (captured.floor_bytes + captured.unoptimized_peak_bytes) // 2
    # hold_outputs=False: ``step`` keeps only the loss, as the plan is told upfront (left to watch, the second
    # step plans and compiles again without the logits; test_optimize_with_inductor_... takes that path).
    fast = ckptc.optimize(case.model, budget_bytes=budget, compiler="inductor", hold_outputs=False)
    for _ in range(2):
        loss = step(case, fast)
    assert_same_training(case, reference, loss, step(case, reference), rtol=1e-3, atol=1e-4)
    assert fast.plan.measured_peak_bytes is not None and fast.plan.measured_peak_bytes <= budget


def test_moe_routing_is_planned_for_inductor() -> None:
    # Expert sizes depend on the routing (data-dependent sizes): pricing Inductor's fusions must not
    # compare them (a guard on them refused the capture).
    case = get_case("olmoe", size="tiny")
    step = ckptc.capture(case.model, case.example_inputs, case.example_kwargs, loss_fn=case.loss, compiler="inductor")
    assert step.plan(budget_bytes=step.floor_bytes).predicted_peak_bytes <= step.floor_bytes


@pytest.mark.parametrize("name", ["vit", "convnet"])
def test_convolutions_are_planned_in_the_layout_inductor_runs_them(name: str) -> None:
    # On CPU Inductor runs 2-d convolutions channels-last: it copies the input image and the weights,
    # saves the copies for the backward, and oneDNN reorders what comes in another layout.  Unpriced,
    # a ViT's first step measured 1.16x its prediction.
    from tests.helpers import measure, step

    case = get_case(name, size="tiny")
    # One block of the tiny case's two (the ViT's encoder layer, the convnet's residual block): the convolutions
    # (the ViT's patch embedding, the convnet's stem and its block's) are all still there, with fewer kernels.
    if name == "vit":
        case.model.vit.encoder.layer = case.model.vit.encoder.layer[:1]
    else:
        case.model.blocks = case.model.blocks[:1]
    config = getattr(case.model, "config", None)  # the ViT's (transformers); the convnet has none
    if config is not None and config.problem_type is None:
        # transformers sets it on a classifier's first call, the value it sets here (integer labels, 10
        # classes); Dynamo guards on it, so every compile of the model (the reference, capture, ckptc's
        # plan) would be made again on the step after its first.
        config.problem_type = "single_label_classification"
    # Inductor draws dropout's numbers per graph: with dropout on, the partitions' streams differ, and
    # the torch.compile reference (an Inductor compile of its own) would go unused.
    compared = not any(isinstance(m, torch.nn.Dropout) and m.p > 0 for m in case.model.modules())
    reference = copy.deepcopy(case.model)
    expected_loss = step(case, torch.compile(reference)) if compared else None
    captured = ckptc.capture(
        copy.deepcopy(case.model), case.example_inputs, case.example_kwargs, loss_fn=case.loss, compiler="inductor"
    )
    budget = (captured.floor_bytes + captured.unoptimized_peak_bytes) // 2
    model = copy.deepcopy(case.model)
    optimized = ckptc.optimize(model, budget_bytes=budget, compiler="inductor", verify=False)
    planned = type(case)(case.name, model, case.example_inputs, case.example_kwargs, loss=case.loss)
    loss = step(planned, optimized)
    if compared:
        torch.testing.assert_close(loss, expected_loss, rtol=1e-4, atol=1e-5)
        for p, q in zip(model.parameters(), reference.parameters(), strict=True):
            torch.testing.assert_close(p.grad, q.grad, rtol=1e-3, atol=1e-5)
    peak = measure(planned, optimized).peak_bytes
    assert peak <= budget
    # Within 1%: the copies of graph inputs (the image, the weights) are kept.  Inductor does not recompute
    # one for the backward but reorders the original as scratch in the backward convolution: plans that
    # recomputed a weight's copy measured the convnet 3.5-5% over their predictions, over the budget at
    # the floor and at the unoptimized peak.
    assert abs(peak - optimized.plan.predicted_peak_bytes) <= 0.01 * peak


_MAX_POOL_SCRIPT = """
import copy, torch, torch.nn as nn, torch.nn.functional as F
import ckptc

class Pooled(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv, self.head = nn.Conv1d(4, 8, 3, padding=1), nn.Linear(8, 1)

    def forward(self, x):
        return self.head(F.max_pool1d(torch.tanh(self.conv(x)), 2).mean(-1)).square().mean()

torch.manual_seed(0)
model, x = Pooled(), torch.randn(2, 4, 64)
reference = copy.deepcopy(model)
ckptc.optimize(model, budget_gb=1, compiler="inductor")(x).backward()
reference(x).backward()
for p, q in zip(model.parameters(), reference.parameters()):
    torch.testing.assert_close(p.grad, q.grad, rtol=1e-4, atol=1e-5)
print("trained")
"""


def test_a_model_with_max_pool_plans_for_inductor_in_a_fresh_process(tmp_path: Path) -> None:
    """Inductor's max_pool decomposition reads its lowerings, which ckptc imported only after compile_fx
    had run once in the process: a fresh process failed (AttributeError: torch._inductor.lowering)."""
    import subprocess
    import sys

    script = tmp_path / "pooled.py"
    script.write_text(_MAX_POOL_SCRIPT)
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0 and "trained" in done.stdout, done.stderr[-2000:]


class _ConvBatchNormResidual(nn.Module):
    """A ResNet-style block: two Conv2d + BatchNorm2d + ReLU, the second added to the first."""

    def __init__(self) -> None:
        super().__init__()
        self.c1, self.b1 = nn.Conv2d(3, 16, 3, padding=1), nn.BatchNorm2d(16)
        self.c2, self.b2 = nn.Conv2d(16, 16, 3, padding=1), nn.BatchNorm2d(16)
        self.fc = nn.Linear(16, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.relu(self.b1(self.c1(x)))
        x = F.relu(self.b2(self.c2(x))) + x
        return self.fc(x.mean((2, 3)))


@pytest.mark.parametrize("layout", [torch.contiguous_format, torch.channels_last])
def test_a_recomputation_inductor_writes_beside_finished_kernels_on_cpu_is_freed_as_planned(
    layout: torch.memory_format,
) -> None:
    # On CPU Inductor writes the kernels between two extern calls into one C++ function and frees what
    # they read when it returns: the block's backward recomputed its first activation in the function
    # that finished with the second's, held all three, and ran at its unoptimized peak, 1.21x the plan's
    # prediction (2,842,920 B against 2,347,552 B; channels-last 2,733,672 against 2,238,304 B).
    torch.manual_seed(0)
    model = _ConvBatchNormResidual().to(memory_format=layout)
    x = torch.randn(8, 3, 32, 32).to(memory_format=layout)
    y = torch.randint(0, 10, (8,))

    def loss_fn(logits: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(logits, y)

    captured = ckptc.capture(copy.deepcopy(model), (x,), loss_fn=loss_fn, compiler="inductor")
    budget = (captured.floor_bytes + captured.unoptimized_peak_bytes) // 2
    eager, planned = copy.deepcopy(model), copy.deepcopy(model)
    optimized = ckptc.optimize(planned, budget_bytes=budget, compiler="inductor", verify=False)
    for _ in range(2):
        for m, run in ((eager, eager), (planned, optimized)):
            m.zero_grad(set_to_none=True)
            loss_fn(run(x)).backward()
        for p, q in zip(planned.parameters(), eager.parameters(), strict=True):
            torch.testing.assert_close(p.grad, q.grad, rtol=1e-3, atol=1e-4)
    assert optimized.plan.values("recomputed"), "the plan must recompute something for the test to mean anything"
    planned.zero_grad(set_to_none=True)
    _, measured = measure_peak(lambda: loss_fn(optimized(x)).backward(), baseline_bytes=resident_bytes(planned, x))
    assert measured.peak_bytes <= budget
    assert abs(measured.peak_bytes - optimized.plan.predicted_peak_bytes) <= 0.01 * measured.peak_bytes


class _SlicedResidualMlp(nn.Module):
    """Its backward adds a matrix product to a slice's gradient (``slice_backward``, a pointwise kernel):
    Inductor makes the two one ``addmm``, which reads the slice's gradient from memory."""

    def __init__(self, width: int = 64, hidden: int = 256) -> None:
        super().__init__()
        self.width = width
        self.l1, self.l2 = nn.Linear(width, hidden), nn.Linear(hidden, width)
        self.l3, self.l4 = nn.Linear(width, hidden), nn.Linear(hidden, width)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        h = self.l2(F.gelu(self.l1(x))) + x
        h = F.gelu(self.l3(h))
        return F.mse_loss(self.l4(h) + h[:, : self.width], y)


@pytest.mark.parametrize("where", [0.5, 1.0], ids=["midway", "at the unoptimized peak"])
def test_the_operand_an_add_of_a_matrix_product_reads_is_written_as_inductor_runs_it(where: float) -> None:
    # Inductor turns mm + add into one extern addmm, whose other operand (here the slice's gradient, computed
    # by a fused kernel) must be written to memory; priced as computed inside the add, every budget from the
    # floor's to 80% of the way to the unoptimized peak ran 7-10% over (midway: 2,951,944 B measured against a
    # 2,694,831 B budget, 2,493,968 B predicted), and the verified loop refused it after two such steps.
    torch.manual_seed(0)
    model = _SlicedResidualMlp()
    x, y = torch.randn(512, 64), torch.randn(512, 64)
    captured = ckptc.capture(copy.deepcopy(model), (x, y), compiler="inductor")
    budget = captured.floor_bytes + int(where * (captured.unoptimized_peak_bytes - captured.floor_bytes))
    eager, planned = copy.deepcopy(model), copy.deepcopy(model)
    optimized = ckptc.optimize(planned, budget_bytes=budget, compiler="inductor", verify=False)
    for m, run in ((eager, eager), (planned, optimized)):
        m.zero_grad(set_to_none=True)
        run(x, y).backward()
    for p, q in zip(planned.parameters(), eager.parameters(), strict=True):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-3, atol=1e-5)
    planned.zero_grad(set_to_none=True)
    _, measured = measure_peak(lambda: optimized(x, y).backward(), baseline_bytes=resident_bytes(planned, x, y))
    assert measured.peak_bytes <= min(budget, optimized.plan.predicted_peak_bytes)
