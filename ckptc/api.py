"""Public API: ``ckptc.optimize`` and ``ckptc.plan``.

``optimize(model, budget_gb=40)`` returns a module that trains like ``model``
within the budget.  Its first training call captures the step, solves and
rewrites; later calls with the same input shapes reuse the plan; new shapes
plan again.  Calls under ``torch.no_grad()`` or in ``eval()`` mode run the
original model eagerly: nothing to plan, nothing to recompute.
"""

from __future__ import annotations

import contextlib
import logging
from typing import Any, Callable, Iterator, Sequence

import torch

from ckptc import _torch_internals as internals
from ckptc.backend import backend
from ckptc.compiler import CheckpointCompiler
from ckptc.errors import UntraceableModelError
from ckptc.plans import ModelPlan

log = logging.getLogger("ckptc.api")

class OptimizedModule(torch.nn.Module):
    """``model`` with activation checkpointing planned for a memory budget.

    Shares ``model``'s parameters, buffers and submodules (so ``state_dict()``
    has the same keys and an optimizer over either module's parameters trains
    both).  After the first training call, :attr:`plan` describes what is kept
    and what is recomputed.
    """

    def __init__(self, model: torch.nn.Module, compiler: CheckpointCompiler) -> None:
        super().__init__()
        # Share the registries instead of registering `model` as a child, so
        # parameter names and state_dict keys stay exactly the model's.
        self._parameters = model._parameters
        self._buffers = model._buffers
        self._modules = model._modules
        object.__setattr__(self, "_ckptc_model", model)
        object.__setattr__(self, "_ckptc_compiler", compiler)
        object.__setattr__(
            self, "_ckptc_compiled", torch.compile(model, backend=compiler, dynamic=False)
        )
        self.training = model.training

    @property
    def original_module(self) -> torch.nn.Module:
        return self._ckptc_model

    @property
    def compiler(self) -> CheckpointCompiler:
        return self._ckptc_compiler

    @property
    def plan(self) -> ModelPlan | None:
        """The plan of the last training call (None before the first one)."""
        records = self._ckptc_compiler.active
        if not records:
            return None
        return ModelPlan.from_records(records, self._ckptc_compiler)

    def train(self, mode: bool = True) -> "OptimizedModule":
        self._ckptc_model.train(mode)
        self.training = mode
        return self

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        model = self._ckptc_model
        if not torch.is_grad_enabled() or not model.training or not any(
            p.requires_grad for p in model.parameters()
        ):
            return model(*args, **kwargs)
        self._ckptc_compiler.active.clear()  # a new step begins
        with internals.compile_limits():
            try:
                return self._ckptc_compiled(*args, **kwargs)
            except internals.BackendCompilerFailed as error:
                # Our own backend raised (an infeasible budget, a plan that does
                # not match): surface that error, not Dynamo's wrapper.
                inner = getattr(error, "inner_exception", None)
                if inner is None:
                    raise
                raise inner from None
            except internals.DynamoError as error:
                raise UntraceableModelError.from_exception(model, error) from error

    def __repr__(self) -> str:
        return f"OptimizedModule({self._ckptc_compiler!r}, module={type(self._ckptc_model).__name__})"


def optimize(
    model: torch.nn.Module,
    budget_gb: float | None = None,
    *,
    budget_bytes: int | None = None,
    solver: str = "auto",
    strategy: str = "auto",
    plan: str | ModelPlan | None = None,
    must_save: Sequence[str] = (),
    must_recompute: Sequence[str] = (),
    compiler: str = "eager",
    measure_time: bool = False,
    hold_outputs: bool = False,
    time_limit: float | None = None,
    progress: Callable[[float, str], None] | None = None,
) -> OptimizedModule:
    """Return a module that trains like ``model`` within a memory budget.

    Args:
        model: any ``nn.Module`` with trainable parameters.
        budget_gb / budget_bytes: peak memory of one forward+backward step on the
            model's device: parameters, buffers, inputs, gradients, activations
            and temporaries (not optimizer state).  Give one of them, or neither
            for ``strategy="none"``-like behaviour with ``"auto"``.
        solver: ``"auto"`` or a name in ``solvers.METHODS``.
        strategy: ``"auto"`` (solver under the budget), ``"none"``, ``"layer"``,
            ``"segment"`` or ``"selective"``.
        plan: a plan file path or :class:`ModelPlan` to apply without solving.
        must_save / must_recompute: patterns over stable node names such as
            ``"transformer.h.*.attn.*"`` or ``"*.softmax*"``.
        compiler: ``"eager"`` (default) or ``"inductor"``.
        hold_outputs: set it if you keep large forward results (logits) alive
            through backward; by default they count only during forward, as in
            ``loss = model(x).loss; loss.backward()``.

    Raises:
        TypeError: ``model`` is not an ``nn.Module``.
        ValueError: the budget is not a positive finite number, or the model has
            no trainable parameters.
        solvers.InfeasibleBudgetError: (on the first training call) the budget is
            below the smallest feasible budget, which the message gives.

    Example:
        >>> fast = ckptc.optimize(model, budget_gb=40)      # doctest: +SKIP
        >>> loss = fast(input_ids, labels=labels).loss; loss.backward()
    """
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"ckptc.optimize expects an nn.Module, got {type(model).__name__}")
    if isinstance(model, OptimizedModule):
        raise TypeError("this module is already optimized; pass its original_module instead")
    if not any(p.requires_grad for p in model.parameters()):
        raise ValueError(
            f"{type(model).__name__} has no trainable parameters (none requires grad); "
            "there is nothing to checkpoint"
        )
    compiler_ = backend(
        budget_gb,
        budget_bytes=budget_bytes,
        solver=solver,
        strategy=strategy,
        plan=plan,
        must_save=must_save,
        must_recompute=must_recompute,
        compiler=compiler,
        hold_outputs=hold_outputs,
        measure_time=measure_time,
        time_limit=time_limit,
        model=model,
        progress=progress,
    )
    return OptimizedModule(model, compiler_)


def plan(
    model: torch.nn.Module,
    example_inputs: Sequence[Any] = (),
    example_kwargs: dict[str, Any] | None = None,
    budget_gb: float | None = None,
    *,
    budget_bytes: int | None = None,
    loss_fn: Callable[[Any], torch.Tensor] | None = None,
    **options: Any,
) -> ModelPlan:
    """Plan one training step of ``model`` without training it.

    Runs one forward and backward pass on the example inputs (to capture every
    graph, including those after graph breaks) and restores the parameters'
    gradients and the buffers (BatchNorm statistics) afterwards, so the model
    is left exactly as it was.
    """
    optimized = optimize(model, budget_gb, budget_bytes=budget_bytes, **options)
    with training_state_restored(model):
        for p in model.parameters():
            p.grad = None
        output = optimized(*example_inputs, **(example_kwargs or {}))
        loss = loss_fn(output) if loss_fn is not None else _default_loss(output)
        loss.backward()
    result = optimized.plan
    assert result is not None
    return result


@contextlib.contextmanager
def training_state_restored(model: torch.nn.Module) -> Iterator[None]:
    """Run trial steps on ``model`` and then put back its gradients, buffers
    (BatchNorm statistics) and the global random state, so nothing is lost."""
    saved_grads = {p: p.grad for p in model.parameters()}
    saved_buffers = {name: b.detach().clone() for name, b in model.named_buffers()}
    rng = torch.random.get_rng_state()
    try:
        yield
    finally:
        with torch.no_grad():
            for p, g in saved_grads.items():
                p.grad = g
            for name, b in model.named_buffers():
                b.copy_(saved_buffers[name])
        torch.random.set_rng_state(rng)


def _default_loss(output: Any) -> torch.Tensor:
    """The model's own loss if it returns one, else the sum of its first output."""
    loss = getattr(output, "loss", None)
    if isinstance(loss, torch.Tensor):
        return loss
    if isinstance(output, dict) and isinstance(output.get("loss"), torch.Tensor):
        return output["loss"]
    if isinstance(output, (tuple, list)):
        output = output[0]
    if isinstance(output, torch.Tensor):
        return output.float().sum()
    raise TypeError(
        f"cannot derive a loss from a {type(output).__name__}; pass loss_fn=... to ckptc.plan"
    )


