"""The ``torch.compile`` backend: capture, price, solve and rewrite each graph.

Dynamo captures the model (graph breaks split it into several graphs), and
AOTAutograd traces each graph's joint forward+backward graph at aten level
with fake tensors, then calls our partitioner.  The partitioner prices the
joint graph (:mod:`ckptc.costs`), turns it into a solver problem
(:mod:`ckptc.problem`), asks a strategy (:mod:`ckptc.policies`) for a plan,
and rewrites the graph into forward and backward modules that follow the
plan's schedule (:mod:`ckptc.rewriter`).  AOTAutograd's runtime then runs
them inside an ``autograd.Function``, handling input mutations (BatchNorm
statistics are updated once per step) and aliasing.

One budget covers the whole step: graphs captured later see the memory that
earlier graphs keep for their backward (and the results they hold) as part of
their baseline, including graphs of earlier calls of the model in the same step
(a siamese model; :mod:`ckptc.step` tracks steps); and a correction measured
at run time can be added to every graph's baseline.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Sequence

import torch
import torch.fx as fx

import solvers
from ckptc import _torch_internals as internals
from ckptc.costs import annotate_costs, measure_runtimes, measure_scratch
from ckptc.distributed import check_backend_context, local_nbytes
from ckptc.meter import resident_bytes
from ckptc.policies import STRATEGIES, policies_from_patterns
from ckptc.problem import JointProblem, joint_to_problem
from ckptc.rewriter import rewrite
from ckptc.rng import insert_rng_state_nodes

if TYPE_CHECKING:
    from ckptc.plans import ModelPlan

log = logging.getLogger("ckptc.compiler")

# After a graph break, later graphs return results that the caller holds while
# earlier graphs run backward (the loss, a few scalars); those graphs are not
# known yet when earlier graphs are planned, so every graph reserves this much.
HELD_RESULTS_RESERVE_BYTES = 1024
PLANNING_MARGIN_DIVISOR = 200  # plan for 99.5% of the budget, see planning_budget


@dataclass
class GraphRecord:
    """What ckptc decided for one captured graph."""

    index: int
    joint_problem: JointProblem = field(repr=False)
    plan: solvers.Plan
    result: solvers.SimResult = field(repr=False)
    baseline_bytes: int
    unoptimized_peak_bytes: int
    min_feasible_bytes: int
    solve_seconds: float
    input_ids: frozenset[int] = field(default=frozenset(), repr=False)
    held_output_bytes: int = 0
    floor_peak_bytes: int = 0
    floor_kept_bytes: int = 0
    infeasible: bool = False
    break_after: str | None = None  # why Dynamo ended this graph at a graph break, and where

    @property
    def step_bytes(self) -> int:
        """What this graph leaves alive for the rest of the step after its forward:
        values kept for its backward plus the results the caller holds."""
        return self.result.kept_bytes + self.held_output_bytes

    @property
    def slack_bytes(self) -> int:
        """How much less this graph would leave alive for later graphs under its lowest-peak plan."""
        return max(0, self.result.kept_bytes - self.floor_kept_bytes)

    @property
    def problem(self) -> solvers.Problem:
        return self.joint_problem.problem


PlanSource = Callable[[int, JointProblem], solvers.Plan]


class CheckpointCompiler:
    """A ``torch.compile`` backend that makes each captured graph fit a budget.

    Args:
        budget_bytes: peak memory allowed for one forward+backward step, or
            None for no limit (``strategy="none"`` behaviour for ``"auto"``).
        strategy: a name in :data:`ckptc.policies.STRATEGIES`.
        solver: solver method for ``strategy="auto"`` (see ``solvers.METHODS``).
        model: the model being compiled, if known; its parameters, buffers and
            gradients outside a graph count in that graph's baseline.
        compiler: ``"eager"`` runs the rewritten graphs op by op; ``"inductor"``
            compiles them with Inductor.
        must_save / must_recompute: patterns over stable node names.
        plan_source: replaces the strategy; given the graph index and problem,
            returns a plan (used to apply plan files).
        measure_time: price recomputation by measured seconds instead of FLOPs.
        measure_scratch: run each distinct op once on random data to measure the
            temporary memory it allocates (on by default: the budget counts it).
        hold_outputs: count forward results other than what backward needs as
            alive until backward ends (True: callers that keep logits through
            backward), release them after forward (False: ``model(x).loss``),
            or decide per graph (None, the default): held unless the graph
            returns a scalar loss of its own.
        extra_baseline_bytes: memory added to every graph's baseline: the
            excess a measured step showed over the prediction (eager code
            between graphs, memory the cost model misses).
        progress: ``(fraction, message)`` callback for long solves.
        graph_budgets: budgets of single graphs (by index in the step), lower
            than ``budget_bytes``: set by :class:`ckptc.step.StepRuntime` when
            an earlier graph kept so much that a later one could not fit.
        defer_infeasible: when a graph cannot fit, plan it at its lowest peak,
            mark its record ``infeasible`` and go on, so the whole step is seen
            before deciding (:class:`ckptc.step.StepRuntime` sets this).
    """

    def __init__(
        self,
        budget_bytes: int | None = None,
        *,
        strategy: str = "auto",
        solver: str = "auto",
        model: torch.nn.Module | None = None,
        compiler: str = "eager",
        must_save: Sequence[str] = (),
        must_recompute: Sequence[str] = (),
        plan_source: PlanSource | None = None,
        measure_time: bool = False,
        measure_scratch: bool = True,
        hold_outputs: bool | None = None,
        time_limit: float | None = None,
        progress: Callable[[float, str], None] | None = None,
        extra_baseline_bytes: int = 0,
        graph_budgets: dict[int, int] | None = None,
        defer_infeasible: bool = False,
    ) -> None:
        if strategy not in STRATEGIES:
            raise ValueError(f"unknown strategy {strategy!r}; choose one of {sorted(STRATEGIES)}")
        if solver not in solvers.METHODS and solver != "auto":
            raise ValueError(f"unknown solver {solver!r}; choose one of {sorted(solvers.METHODS)}")
        if compiler not in ("eager", "inductor"):
            raise ValueError(f"compiler must be 'eager' or 'inductor', not {compiler!r}")
        self.budget_bytes = budget_bytes
        self.strategy = strategy
        self.solver = solver
        self.model = model
        self.compiler = compiler
        self.must_save = tuple(must_save)
        self.must_recompute = tuple(must_recompute)
        self.plan_source = plan_source
        self.measure_time = measure_time
        self.measure_scratch = measure_scratch
        self.hold_outputs = hold_outputs
        self.time_limit = time_limit
        self.progress = progress
        self.extra_baseline_bytes = int(extra_baseline_bytes)
        self.graph_budgets = dict(graph_budgets or {})
        self.defer_infeasible = defer_infeasible
        # Set by ckptc.step.StepRuntime, which ends steps when backward ends;
        # without it a graph running again means a new step began.
        self.track_steps = False
        self.records: list[GraphRecord] = []
        # Graphs whose forward ran in the current step, in order (a graph run
        # twice before one backward appears twice when steps are tracked).
        self.active: list[GraphRecord] = []
        self._just_planned: GraphRecord | None = None

    _CONFIG = ("budget_bytes", "strategy", "solver", "model", "compiler", "must_save", "must_recompute",
               "plan_source", "measure_time", "measure_scratch", "hold_outputs", "time_limit", "progress",
               "extra_baseline_bytes", "graph_budgets", "defer_infeasible")

    def spawn(self, **changes: Any) -> "CheckpointCompiler":
        """A fresh compiler with this one's options (and ``changes``), no graphs planned."""
        options = {name: getattr(self, name) for name in self._CONFIG}
        options.update(changes)
        budget = options.pop("budget_bytes")
        return CheckpointCompiler(budget, **options)

    def __getstate__(self) -> dict[str, Any]:
        # Planned graphs hold FX graphs and fake tensors: keep only the options.
        state = {name: getattr(self, name) for name in self._CONFIG}
        state["track_steps"] = self.track_steps
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        track = state.pop("track_steps", False)
        budget = state.pop("budget_bytes")
        self.__init__(budget, **state)  # type: ignore[misc]
        self.track_steps = track

    def __repr__(self) -> str:
        budget = "none" if self.budget_bytes is None else solvers.format_bytes(self.budget_bytes)
        return (
            f"CheckpointCompiler(budget={budget}, strategy={self.strategy!r}, "
            f"solver={self.solver!r}, compiler={self.compiler!r}, graphs={len(self.records)})"
        )

    @property
    def plan(self) -> ModelPlan | None:
        """The plan of every graph this backend has planned (None before the first).

        Under ``torch.compile(model, backend=b)`` with ``b = ckptc.backend(...)``,
        ``b.plan`` is how to read what was kept and recomputed.
        """
        if not self.records:
            return None
        from ckptc.plans import ModelPlan  # plans imports this module

        return ModelPlan.from_records(self.records, self)

    def reset(self) -> None:
        """Forget the graphs planned so far (new input shapes plan again)."""
        self.records.clear()
        self.active.clear()

    # -- torch.compile backend entry point ---------------------------------
    def __call__(self, gm: fx.GraphModule, example_inputs: Sequence[Any]) -> Callable:
        if not self.track_steps:
            check_backend_context()  # torch.compile(DDP(model), backend="ckptc") is refused
        def partition(joint: fx.GraphModule, joint_inputs: Any, **kw: Any) -> Any:
            outside, input_ids = self._bytes_outside_graph(example_inputs)
            parts = self.partition(joint, outside=outside, input_ids=input_ids, **kw)
            if self._just_planned is not None:
                self._just_planned.break_after = internals.graph_break_after(gm)
            return parts

        backend = internals.aot_backend(
            fw_compiler=self._compile_forward,
            bw_compiler=self._compile_graph,
            partition_fn=partition,
            for_inductor=self.compiler == "inductor",
        )
        return backend(gm, example_inputs)

    def _compile_forward(self, gm: fx.GraphModule, example_inputs: Sequence[Any]) -> Callable:
        compiled = self._compile_graph(gm, example_inputs)
        record = self._just_planned
        self._just_planned = None
        if record is None:  # an inference graph: nothing planned
            return compiled

        def forward(args: list[Any]) -> Any:
            # Track which graphs run in this step, in order: graphs planned later
            # count what these keep for backward in their baseline.
            if record in self.active and not self.track_steps:
                self.active.clear()
            self.active.append(record)
            return compiled(args)

        forward._boxed_call = True  # type: ignore[attr-defined]
        return forward

    def _compile_graph(self, gm: fx.GraphModule, example_inputs: Sequence[Any]) -> Callable:
        if self.compiler == "inductor":
            return internals.inductor_compile(gm, example_inputs)
        return internals.boxed(gm)

    def _bytes_outside_graph(self, example_inputs: Sequence[Any]) -> tuple[int, frozenset[int]]:
        """Model state this graph does not take as input, and gradients that exist
        while its backward runs: those of trainable parameters that no graph run
        so far in this step (this one included) uses, since graphs run backward in
        reverse order.  Also returns the ids of this graph's trainable parameters.
        """
        graph_tensors = [t for t in example_inputs if isinstance(t, torch.Tensor)]
        graph_ids = frozenset(id(t) for t in graph_tensors)
        if self.model is None:
            return 0, graph_ids
        params = {id(p): p for p in self.model.parameters()}
        state_ids = set(params) | {id(b) for b in self.model.buffers()}
        state = resident_bytes(*params.values(), *self.model.buffers())
        in_graph = resident_bytes(*[t for t in graph_tensors if id(t) in state_ids])
        seen = set(graph_ids).union(*(r.input_ids for r in self.active))
        later_grads = sum(
            local_nbytes(p) for i, p in params.items() if p.requires_grad and i not in seen
        )
        return max(0, state - in_graph) + later_grads, graph_ids

    # -- the partitioner --------------------------------------------------
    def partition(
        self,
        joint: fx.GraphModule,
        *,
        outside: int = 0,
        input_ids: frozenset[int] = frozenset(),
        num_fwd_outputs: int,
        **_: Any,
    ) -> tuple[fx.GraphModule, fx.GraphModule]:
        """AOTAutograd ``partition_fn``: plan this joint graph and rewrite it."""
        start = time.perf_counter()
        if self.compiler == "eager":
            # Inductor cannot lower the Python calls that replay generator state,
            # so under Inductor random ops keep their outputs instead.
            insert_rng_state_nodes(joint.graph)
            joint.recompile()
        annotate_costs(joint)
        if self.measure_scratch:
            measure_scratch(joint)
        if self.measure_time:
            measure_runtimes(joint)
        earlier = sum(r.step_bytes for r in self.active)
        policies = policies_from_patterns(
            {n.name: n for n in joint.graph.nodes}, self.must_save, self.must_recompute
        )
        index = len(self.records)
        baseline = outside + earlier + HELD_RESULTS_RESERVE_BYTES + self.extra_baseline_bytes
        jp = joint_to_problem(
            joint,
            num_fwd_outputs,
            baseline_bytes=baseline,
            policies=policies,
            hold_outputs=self.hold_outputs,
        )
        floor_plan = solvers.lowest_peak_plan(jp.problem)
        floor_result = solvers.simulate(jp.problem, floor_plan)
        # The step's floor at this graph: earlier graphs at their own lowest-peak
        # plans leave `slack` fewer bytes alive than they do under their plans.
        step_floor = max(
            [budget_for_planning_floor(floor_result.peak_bytes - sum(r.slack_bytes for r in self.active))]
            + [r.min_feasible_bytes for r in self.active]
        )
        infeasible = False
        try:
            plan = self._decide(index, jp)
        except solvers.InfeasibleBudgetError as error:
            fits_alone = floor_result.peak_bytes <= planning_budget(self.budget_bytes or 0)
            if index in self.graph_budgets and fits_alone:
                plan = floor_plan  # asked to keep less than its budget allows: as little as it can
            elif self.defer_infeasible and self.plan_source is None:
                infeasible = True
                plan = floor_plan
            else:
                raise solvers.InfeasibleBudgetError(error.budget_bytes, step_floor) from None
        result = floor_result if plan is floor_plan else solvers.simulate(jp.problem, plan)
        unoptimized = solvers.simulate(jp.problem, STRATEGIES["none"](jp)).peak_bytes
        record = GraphRecord(
            index=index,
            joint_problem=jp,
            plan=plan,
            result=result,
            baseline_bytes=jp.problem.baseline_bytes,
            unoptimized_peak_bytes=unoptimized,
            min_feasible_bytes=step_floor,
            solve_seconds=time.perf_counter() - start,
            input_ids=input_ids,
            held_output_bytes=jp.held_output_bytes,
            floor_peak_bytes=floor_result.peak_bytes,
            floor_kept_bytes=floor_result.kept_bytes,
            infeasible=infeasible,
        )
        self.records.append(record)
        self._just_planned = record
        log.info(
            "graph %d: %d nodes, kept %d forward values, predicted peak %s (unoptimized %s), "
            "recompute cost %.3g",
            index,
            len(jp.problem),
            len(plan.kept),
            solvers.format_bytes(result.peak_bytes),
            solvers.format_bytes(unoptimized),
            result.recompute_cost,
        )
        steps = solvers.schedule(jp.problem, plan)
        return rewrite(joint, steps, plan.kept, num_fwd_outputs)

    def _decide(self, index: int, jp: JointProblem) -> solvers.Plan:
        if self.plan_source is not None:
            return self.plan_source(index, jp)
        options: dict[str, Any] = {}
        if self.strategy == "auto":
            options["solver"] = self.solver
            options["progress"] = self.progress
            if self.time_limit is not None:
                options["time_limit"] = self.time_limit
        if self.budget_bytes is None:
            return STRATEGIES[self.strategy](jp, None, **options)
        budget = min(self.budget_bytes, self.graph_budgets.get(index, self.budget_bytes))
        try:
            return STRATEGIES[self.strategy](jp, planning_budget(budget), **options)
        except solvers.InfeasibleBudgetError as error:
            floor = error.min_feasible_bytes
            raise solvers.InfeasibleBudgetError(
                self.budget_bytes, None if floor is None else budget_for_planning_floor(floor)
            ) from None


def planning_budget(budget_bytes: int) -> int:
    """The budget solvers plan for: 0.5% below the user's.

    Kernels' scratch memory varies a little between runs (measured once per
    op, on random data); plans that fill the budget exactly would sometimes
    exceed it by a few kilobytes.
    """
    return budget_bytes - budget_bytes // PLANNING_MARGIN_DIVISOR


def budget_for_planning_floor(floor: int) -> int:
    """The smallest user budget whose planning budget reaches ``floor``."""
    budget = floor + floor // (PLANNING_MARGIN_DIVISOR - 1)
    while planning_budget(budget) < floor:
        budget += 1
    return budget


def _is_model_state(tensor: torch.Tensor, model: torch.nn.Module) -> bool:
    ids = getattr(model, "_ckptc_state_ids", None)
    if ids is None:
        ids = {id(t) for t in model.parameters()} | {id(t) for t in model.buffers()}
    return id(tensor) in ids
