"""``torch.compile`` backend entry points.

After ``pip install``, ``torch.compile(model, backend="ckptc", options={...})``
works without importing ckptc first: the package declares
:func:`ckptc_backend` in the ``torch_dynamo_backends`` entry-point group.
``ckptc.backend(budget_gb=..., compiler=...)`` returns a configured backend
object instead.

Options (both ways): ``budget_gb`` or ``budget_bytes``, ``solver``,
``strategy``, ``plan`` (a plan file or :class:`~ckptc.plans.ModelPlan`),
``must_save``, ``must_recompute``, ``compiler`` (``"eager"`` or
``"inductor"``), ``hold_outputs``, ``measure_time``, ``time_limit``.

One budget covers all graphs of one ``torch.compile`` call (graph breaks
included): Dynamo calls the backend once per graph with the same options, and
the graphs of one call share one :class:`~ckptc.compiler.CheckpointCompiler`.
"""

from __future__ import annotations

import math
from typing import Any, Callable, Sequence

import torch
import torch.fx as fx

from ckptc.compiler import CheckpointCompiler
from ckptc.errors import PlanMismatchError
from ckptc.plans import ModelPlan, load_plan, plan_source_for
from solvers import format_bytes

GiB = 1024**3
# Allocators count bytes in 64-bit integers: a larger budget is a mistake in
# units (budget_bytes given as GiB, a typo in the exponent), not a real limit.
MAX_BUDGET_BYTES = 2**63 - 1


def budget_to_bytes(budget_gb: float | None, budget_bytes: int | None) -> int | None:
    """Validate the two ways of giving a budget and return bytes (or None)."""
    if budget_gb is not None and budget_bytes is not None:
        raise ValueError("give either budget_gb or budget_bytes, not both")
    value, unit = (budget_gb, "budget_gb") if budget_gb is not None else (budget_bytes, "budget_bytes")
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{unit} must be a number, not {type(value).__name__}")
    units = "GiB" if unit == "budget_gb" else "bytes"
    if math.isnan(value) or math.isinf(value):
        raise ValueError(f"{unit} must be a finite number of {units}, got {value!r}")
    if value <= 0:
        raise ValueError(f"{unit} must be positive, got {value!r}")
    # A float budget_gb of 1e300 overflows to inf here; that compares above the cap.
    scaled = value * GiB if unit == "budget_gb" else value
    if scaled > MAX_BUDGET_BYTES:
        raise ValueError(
            f"{unit}={value!r} is more than any device's memory (over 2**63 bytes); "
            f"give the budget in {units}, e.g. budget_gb=40"
        )
    nbytes = int(scaled)
    if nbytes < 1:
        raise ValueError(
            f"{unit}={value!r} is less than one byte; give the budget in {units} "
            "(budget_gb=40 means 40 GiB, as does budget_bytes=40 * 2**30)"
        )
    return nbytes


_OPTION_NAMES = {
    "budget_gb",
    "budget_bytes",
    "solver",
    "strategy",
    "plan",
    "must_save",
    "must_recompute",
    "compiler",
    "hold_outputs",
    "measure_time",
    "time_limit",
}

# One compiler per options dict: Dynamo passes the same dict for every graph of
# one torch.compile call.  The dict is kept alive with its compiler so its id
# is never reused while the entry exists.
_compilers: dict[int, tuple[dict[str, Any], CheckpointCompiler]] = {}


def backend(
    budget_gb: float | None = None,
    *,
    budget_bytes: int | None = None,
    solver: str = "auto",
    strategy: str = "auto",
    plan: str | ModelPlan | None = None,
    must_save: Sequence[str] = (),
    must_recompute: Sequence[str] = (),
    compiler: str = "eager",
    hold_outputs: bool | None = None,
    measure_time: bool = False,
    time_limit: float | None = None,
    model: torch.nn.Module | None = None,
    progress: Callable[[float, str], None] | None = None,
) -> CheckpointCompiler:
    """A configured ``torch.compile`` backend.

    ``model``, when given, lets each graph count the parameters, buffers and
    gradients that it does not see (after a graph break) in its baseline.

    Example:
        >>> compiled = torch.compile(model, backend=ckptc.backend(budget_gb=40))  # doctest: +SKIP
    """
    budget = budget_to_bytes(budget_gb, budget_bytes)
    source = None
    if plan is not None:
        model_plan = plan if isinstance(plan, ModelPlan) else load_plan(plan)
        if budget is not None and model_plan.predicted_peak_bytes > budget:
            # A plan does not adapt to a budget: it would silently break the promise.
            raise PlanMismatchError(
                f"the plan predicts a peak of {format_bytes(model_plan.predicted_peak_bytes)} "
                f"({model_plan.predicted_peak_bytes} bytes), over the budget given with it, "
                f"{format_bytes(budget)} ({budget} bytes). Plan again for this budget, or "
                "apply the plan without a budget."
            )
        # An explicit budget is also checked against each graph as applied (the
        # peak is simulated again on the captured graph).
        source = plan_source_for(model_plan, budget)
        if budget is None:
            budget = model_plan.budget_bytes
    return CheckpointCompiler(
        budget,
        strategy=strategy,
        solver=solver,
        compiler=compiler,
        must_save=must_save,
        must_recompute=must_recompute,
        plan_source=source,
        hold_outputs=hold_outputs,
        measure_time=measure_time,
        time_limit=time_limit,
        model=model,
        progress=progress,
    )


def ckptc_backend(
    gm: fx.GraphModule, example_inputs: Sequence[Any], options: dict[str, Any] | None = None
) -> Callable:
    """The ``backend="ckptc"`` entry point: plans each graph under ``options``."""
    options = options or {}
    unknown = set(options) - _OPTION_NAMES
    if unknown:
        raise ValueError(
            f"unknown ckptc option(s) {sorted(unknown)}; valid options are {sorted(_OPTION_NAMES)}"
        )
    entry = _compilers.get(id(options))
    if entry is None or entry[0] is not options:
        entry = (options, backend(**options))
        _compilers[id(options)] = entry
    return entry[1](gm, example_inputs)
