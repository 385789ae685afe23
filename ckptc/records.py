"""The records every stage shares: what was decided for one graph, and the callbacks that shape it.

:func:`ckptc.planning.planner.decide` makes a :class:`GraphRecord`; the compiler keeps
it beside the rewritten graphs, the step runtime tracks which ran, and plans,
coverage and the distributed checks read it.  This module sits below all of
them (it imports only :mod:`ckptc.pricing.problem` and :mod:`solvers`), so none of
them imports the stage that made the record.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping

import solvers
from ckptc._torch_internals import outside_user_compile
from ckptc.pricing.problem import JointProblem

#: Replaces the strategy (a plan file's decisions): given the graph index and problem, returns its plan.
PlanSource = Callable[[int, JointProblem], solvers.Plan]
#: ``(fraction, message)`` callback for long solves.
Progress = Callable[[float, str], None]


@dataclass(frozen=True)
class GraphInputs:
    """A graph's tensor inputs, by ``id`` of the real tensors it was captured with.

    Attributes:
        data: inputs that are not the model's state (a batch, a result of an
            earlier graph) -> their bytes.
        parameters: trainable parameters it takes -> their gradients' bytes.
        state: every input that is model state (parameters and buffers).
        handed: the data inputs that are results of an earlier compiled graph
            (counted by that graph, not by later ones).
        data_refs: weak references to the data inputs, by id: a data input freed since (a batch
            of an earlier step) has an id that can name a new tensor now.
        view_gradient_bytes: what autograd allocates outside the graph, as its backward returns, for the
            views of trainable parameters it takes (a slice of a weight taken by the caller or by eager
            code between graphs): each view's gradient is written into a zero buffer of its parameter's
            size (:func:`ckptc._torch_internals.gradient_scattered_into_own_buffer`: not for the whole
            parameter reshaped, nor for split/chunk pieces, which share one buffer made once).
    """

    data: Mapping[int, int] = field(default_factory=dict)
    parameters: Mapping[int, int] = field(default_factory=dict)
    state: frozenset[int] = frozenset()
    handed: frozenset[int] = frozenset()
    data_refs: Mapping[int, weakref.ref] = field(default_factory=dict, compare=False)
    view_gradient_bytes: int = 0

    @property
    def ids(self) -> frozenset[int]:
        return frozenset(self.data) | self.state

    def still_takes(self, data_id: int) -> bool:
        """Whether the live tensor of id ``data_id`` is one of these data inputs (not a new tensor
        that took the id of a freed one)."""
        ref = self.data_refs.get(data_id)
        return data_id in self.data and ref is not None and ref() is not None


@dataclass
class GraphRecord:
    """What ckptc decided for one captured graph.

    ``earlier`` are the graphs that ran before this one in the same step
    when it was planned: what they keep for backward is part of this graph's
    baseline (``baseline_bytes``), on top of its own (``own_baseline_bytes``).
    """

    index: int
    joint_problem: JointProblem = field(repr=False)
    plan: solvers.Plan
    result: solvers.SimResult = field(repr=False)
    baseline_bytes: int
    unoptimized_peak_bytes: int
    solve_seconds: float
    inputs: GraphInputs = field(default_factory=GraphInputs, repr=False)
    held_output_bytes: int = 0
    floor_peak_bytes: int = 0
    floor_kept_bytes: int = 0
    floor_held_output_bytes: int = 0  # held results beside what the lowest-peak plan keeps
    margin_bytes: int = 0  # planning_margin of the lowest-peak plan: the floor's (the solvers plan at a larger one)
    # What the graph keeps for backward when it keeps every value backward reads (no ckptc).
    unoptimized_kept_bytes: int = 0
    # What it leaves alive for the rest of the step keeping everything (kept and held results).
    unoptimized_step_bytes: int = 0
    # The step's floor up to this graph in each of two ways to run it (``min_feasible_bytes`` is the lower):
    # every graph so far at its lowest-peak plan, and every graph so far keeping everything.
    floor_at_lowest_bytes: int = 0
    floor_keeping_everything_bytes: int = 0
    infeasible: bool = False
    earlier: tuple["GraphRecord", ...] = field(default=(), repr=False)
    break_after: str | None = None  # why Dynamo ended this graph at a graph break, and where
    # A result whose gradient the plan counted as free (unused by the loss) received one.
    gradients_unexpected: bool = False
    # What earlier runs of this same graph in the step leave alive at its last run (StepAccount.repeat_bytes).
    repeat_bytes: int = 0
    # Held results of earlier graphs that its baseline does not count: a step showed them dead by the time
    # it runs (StepAccount.results_let_go).
    earlier_let_go_bytes: int = 0
    # Its baseline counts every parameter's gradient resident (StepAccount.gradients_resident).
    gradients_resident: bool = False
    # Its floor once the model's later calls in the step count, given the gradients' bytes by parameter
    # id (:func:`ckptc.planning.planner.floor_counting_later_calls`); set by the planner, which alone
    # simulates plans.
    later_calls_floor: Callable[[Mapping[int, int]], int] | None = field(default=None, repr=False, compare=False)

    @property
    def min_feasible_bytes(self) -> int:
        """The step's floor up to this graph: the lower of its two ways to run it (the budget below which
        the step cannot be planned, as far as the graphs so far show)."""
        return min(self.floor_at_lowest_bytes, self.floor_keeping_everything_bytes)

    @property
    def step_unoptimized_peak_bytes(self) -> int:
        """This graph's peak with it and every earlier graph of the step keeping everything: its own
        unoptimized peak is planned beside what the earlier graphs' chosen plans keep."""
        earlier_growth = sum(max(0, e.unoptimized_step_bytes - e.step_bytes) for e in self.earlier)
        return self.unoptimized_peak_bytes + earlier_growth

    @property
    def step_bytes(self) -> int:
        """What this graph leaves alive for the rest of the step after its forward:
        values kept for its backward plus the results the caller holds."""
        return self.result.kept_bytes + self.held_output_bytes

    @property
    def slack_bytes(self) -> int:
        """How much less this graph would leave alive for later graphs under its lowest-peak plan; negative
        where that plan keeps more (a model that checkpoints its own layers keeps only their inputs when
        ckptc keeps everything, and its lowest-peak plan may keep more to recompute less at once)."""
        return self.step_bytes - self.floor_kept_bytes - self.floor_held_output_bytes

    @property
    def growth_bytes(self) -> int:
        """How much more this graph would leave alive for later graphs under a larger budget, at most:
        keeping every value its backward reads."""
        return max(0, self.unoptimized_kept_bytes - self.result.kept_bytes)

    @property
    def own_baseline_bytes(self) -> int:
        """The baseline without what earlier graphs (and earlier runs of this one) of the step keep."""
        earlier = sum(e.step_bytes for e in self.earlier) - self.earlier_let_go_bytes
        return self.baseline_bytes - earlier - self.repeat_bytes

    @property
    def problem(self) -> solvers.Problem:
        return self.joint_problem.problem


class RecordLink:
    """Carries a graph's record to its backward compiler in the module's ``meta``.

    AOTAutograd may deep-copy the backward module; the link is shared, not copied.
    """

    def __init__(self, record: GraphRecord, gradient_sink: Any = None) -> None:
        self.record = record
        self.gradient_sink = gradient_sink  # ckptc.rewrite.lean_backward.GradientSink, or None
        self.plans: Any = None  # ckptc.capture.compiler.GraphPlans, where plans are swapped in place

    @outside_user_compile  # AOTAutograd compiles a backward (and copies its module) when it first runs
    def __deepcopy__(self, memo: dict[int, Any]) -> RecordLink:
        return self

    def __repr__(self) -> str:
        return f"RecordLink(graph {self.record.index})"
