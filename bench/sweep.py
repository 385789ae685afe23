"""ckptc's budget sweep, decided on one capture: the range of budgets and each point's plan before it runs.

The step is captured once per model (:func:`ckptc.capture`): that gives the
budget range (the floor and the unoptimized peak) and, for every ckptc point,
the plan ckptc will make at its first training step, decided by ckptc's own
planner (:meth:`ckptc.CapturedStep.plan`, configured exactly as
:meth:`bench.alternatives.Alternative.ckptc_options` configures
``ckptc.optimize``).  So the bench never calls a budget infeasible that ckptc
would plan, and a point whose plan equals one already measured shares that
measurement (``same_plan_as``).  Models captured as several graphs are
planned the same way (the planner plans the whole step).
"""

from __future__ import annotations

import copy
import time
from dataclasses import dataclass, field
from typing import Any

import ckptc
import solvers
from bench.alternatives import Alternative
from bench.points import reset_compiler_state, timed
from tests.zoo import ModelCase

#: Fields of a measured point that a point with the same plan shares.
SHARED_FIELDS = (
    "peak_bytes",
    "baseline_bytes",
    "flops",
    "recompute_pct",
    "time_ratio",
    "time_s",
    "eager_time_s",
    "matches_eager",
    "loss_equal",
    "grads_equal",
    "grad_max_abs_diff",
    "predicted_peak_bytes",
    "predicted_recompute_pct",
    "kept",
    "recomputed",
)


@dataclass
class Probe:
    """What one capture of the step told us."""

    step: ckptc.CapturedStep
    capture_s: float
    graphs: int
    nodes: list[int]
    floor_bytes: int
    unoptimized_peak_bytes: int
    predicted_step_flops: float

    def to_dict(self) -> dict[str, Any]:
        return {
            "status": "ok",
            "capture_s": self.capture_s,
            "graphs": self.graphs,
            "nodes": self.nodes,
            "unoptimized_peak_bytes": self.unoptimized_peak_bytes,
            "min_feasible_bytes": self.floor_bytes,
            "predicted_step_flops": self.predicted_step_flops,
        }


@dataclass
class OfflineDecision:
    """ckptc's plan for one point, decided on the probe's capture (or why there is none)."""

    kind: str  # "plan", "infeasible" or "error"
    seconds: float
    plan: ckptc.ModelPlan | None = None
    error: BaseException | None = None

    @property
    def signature(self) -> tuple[Any, ...] | None:
        """What makes two plans the same plan: every graph's kept set and schedule (stable names)."""
        if self.plan is None:
            return None
        return tuple(
            (frozenset(g.plan.kept), None if g.plan.schedule is None else tuple(g.plan.schedule))
            for g in self.plan.graphs
        )


@dataclass
class Sweep:
    """The probe and the measured plans, by signature, for deduplication."""

    probe: Probe
    time_limit: float | None
    measured: dict[tuple[Any, ...], dict[str, Any]] = field(default_factory=dict)

    def decide(self, alt: Alternative) -> OfflineDecision:
        """The plan ckptc makes for ``alt`` at its first step, without running the model."""
        start = time.perf_counter()
        try:
            plan = self.probe.step.plan(**alt.ckptc_options(self.time_limit))
        except solvers.InfeasibleBudgetError as error:
            return OfflineDecision("infeasible", time.perf_counter() - start, error=error)
        except Exception as error:  # noqa: BLE001 - measured (and recorded) when the point runs
            return OfflineDecision("error", time.perf_counter() - start, error=error)
        return OfflineDecision("plan", time.perf_counter() - start, plan=plan)

    def shared(self, signature: tuple[Any, ...], point: dict[str, Any]) -> dict[str, Any] | None:
        """``point`` completed from an earlier measurement of the same plan, if there is one."""
        first = self.measured.get(signature)
        if first is None:
            return None
        return {
            **point,
            **{k: first[k] for k in SHARED_FIELDS if k in first},
            "status": "ok",
            "same_plan_as": first["label"],
        }


def capture_step(case: ModelCase) -> Probe:
    """Capture ``case``'s step once (on a copy of the model)."""
    reset_compiler_state()
    model = copy.deepcopy(case.model)
    step, seconds = timed(lambda: ckptc.capture(model, case.example_inputs, case.example_kwargs, loss_fn=case.loss))
    unoptimized = step.plan(strategy="none")
    result = Probe(
        step=step,
        capture_s=seconds,
        graphs=step.graphs,
        nodes=[len(r.problem) for r in step.records],
        floor_bytes=step.floor_bytes,
        unoptimized_peak_bytes=step.unoptimized_peak_bytes,
        predicted_step_flops=unoptimized.step_flops,
    )
    reset_compiler_state()
    return result


__all__ = ["Probe", "OfflineDecision", "Sweep", "capture_step"]
