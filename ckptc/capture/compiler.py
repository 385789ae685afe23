"""The ``torch.compile`` backend: capture, price, solve and rewrite each graph.

Dynamo captures the model (graph breaks split it into several graphs), and
AOTAutograd traces each graph's joint forward+backward graph at aten level
with fake tensors, then calls our partitioner.  The partitioner prices the
joint graph (:mod:`ckptc.pricing.costs`), turns it into a solver problem
(:mod:`ckptc.pricing.problem`), asks the planner (:mod:`ckptc.planning.planner`) for a plan,
and rewrites the graph into forward and backward modules that follow the
plan's schedule (:mod:`ckptc.rewrite.rewriter`).  AOTAutograd's runtime then runs
them inside an ``autograd.Function``, handling input mutations (BatchNorm
statistics are updated once per step) and aliasing.  A graph planned again
keeps its priced joint graph and that function: the new plan is swapped in
behind it (:class:`GraphPlans`), nothing traced or priced again.

One budget covers the whole step: each graph's baseline (what the step holds
besides the graph's own activations) is the :class:`~ckptc.planning.account.StepAccount`'s,
passed to the compiler as an argument; graphs captured later see what earlier
graphs keep for their backward, including graphs of earlier calls of the model
in the same step (a siamese model; :mod:`ckptc.runtime.step` tracks steps).
"""

from __future__ import annotations

import contextlib
import logging
import time
import weakref
from typing import Any, Callable, Sequence

import torch
import torch.fx as fx

import solvers
from ckptc import _torch_internals as internals
from ckptc.capture.coverage import refuse_oversized
from ckptc.capture.rng import insert_rng_state_nodes
from ckptc.distributed import check_backend_context
from ckptc.errors import (
    ArgumentTypeError,
    CkptcError,
    InvalidArgumentError,
    UntraceableModelError,
    outside_stacklevel,
    warn_once,
)
from ckptc.meter import BACKWARD_STARTS, FORWARD_RETURNED, GRAPH_STARTS
from ckptc.options import CheckpointOptions
from ckptc.planning.account import StepAccount
from ckptc.planning.planner import decide
from ckptc.planning.policies import policies_from_patterns
from ckptc.planning.replan import Replans
from ckptc.plans import ModelPlan
from ckptc.pricing.costs import OpMemory, annotate_costs, measure_runtimes, measure_scratch, normalize_module_path
from ckptc.pricing.problem import joint_to_problem, with_later_results
from ckptc.records import GraphRecord, PlanSource, RecordLink
from ckptc.rewrite.lean_backward import (
    GradientSink,
    accumulate_into_parameters,
    drop_unread_batch_norm_statistics,
    reinplace,
)
from ckptc.rewrite.rewriter import rewrite
from ckptc.rewrite.unused_grads import ZeroGradBackward, zeros_buildable
from ckptc.runtime.tracker import StepEvents
from ckptc.runtime.watch import BackendStepCheck

log = logging.getLogger("ckptc.capture.compiler")


def has_symbolic_sizes(gm: fx.GraphModule, example_inputs: Sequence[Any]) -> bool:
    """Whether Dynamo's graph ``gm`` has symbolic sizes: dynamic inputs (``dynamic=True``, length
    buckets) or sizes that depend on data (``nonzero``, MoE routing).  Such a graph is not planned again
    in place: AOTAutograd run again outside Dynamo's compile specialized a length bucket's graph to
    one length, and cannot trace an op with a data-dependent output size at all."""
    return any(isinstance(a, torch.SymInt) for a in example_inputs) or any(
        internals.binds_unbacked_symbols(n) for n in gm.graph.nodes
    )


def refuse_compile_args(compile_args: dict[str, Any]) -> None:
    """Refuse ``torch.compile`` arguments that ckptc's backend cannot honour, naming what to pass instead."""
    mode = compile_args.pop("mode", None)
    if mode not in (None, "default"):
        raise InvalidArgumentError(
            f"torch.compile(..., backend=<ckptc's>, mode={mode!r}): ckptc has no compile modes; they configure "
            "Inductor. Pass options={'compiler': 'inductor', 'budget_gb': ...} to run ckptc's rewritten graphs "
            "under Inductor, or drop mode="
        )
    if compile_args:
        raise InvalidArgumentError(
            f"torch.compile passed {sorted(compile_args)} to ckptc's backend, which takes only options={{...}} "
            f"(valid names: {list(CheckpointOptions.user_names())})"
        )


class CheckpointCompiler:
    """A ``torch.compile`` backend that makes each captured graph fit a budget.

    Args:
        options: a :class:`~ckptc.options.CheckpointOptions`, or the budget in
            bytes (None: no limit) with the other options as keywords
            (``CheckpointCompiler(2**30, solver="ilp")``).
        model: the model being compiled, if known; its parameters, buffers and
            gradients outside a graph count in that graph's baseline.
        plan_source: replaces the strategy; given the graph index and problem,
            returns a plan (used to apply plan files).
        progress: ``(fraction, message)`` callback for long solves.
        replans: where the account graphs are planned under comes from (:class:`ckptc.planning.replan.Replans`,
            the step runtime's for one input shape; its :class:`~ckptc.planning.account.StepAccount` holds the
            budget and what the step holds besides each graph's activations): when its account changes,
            each graph plans again when it next runs, from its priced joint graph behind the same
            AOTAutograd function (:class:`GraphPlans`; Dynamo's guards and bytecode stay), or from
            Dynamo's graph where that cannot be.  Default: ``options``' budget, a step from ``None`` gradients.
        generate_kernels: under ``compiler="inductor"``, compile the graphs with
            Inductor (False: :func:`ckptc.capture` traces them as Inductor would
            and runs them op by op, since planning needs no kernels).
        step: the list of graphs run in the current step, kept by a caller that
            tracks steps (:class:`ckptc.runtime.step.StepRuntime`, :func:`ckptc.capture`);
            the compiler appends each graph as it runs.  None: the compiler tracks
            steps itself (a graph running again begins a new step, or the run-time
            check of :mod:`ckptc.runtime.watch` under a budget).

    Each graph's decision is :func:`ckptc.planning.planner.decide`'s.
    """

    def __init__(
        self,
        options: CheckpointOptions | int | None = None,
        *,
        model: torch.nn.Module | None = None,
        plan_source: PlanSource | None = None,
        progress: Callable[[float, str], None] | None = None,
        generate_kernels: bool = True,
        step: list[GraphRecord] | None = None,
        replans: Replans | None = None,
        step_events: StepEvents | None = None,
        **option_values: Any,
    ) -> None:
        if not isinstance(options, CheckpointOptions):
            options = CheckpointOptions(budget_bytes=options, **option_values)
        elif option_values:
            options = options.replace(**option_values)
        self.options = options
        self.model = model  # held weakly: see the property
        self._model_given = model is not None  # by the caller, not found on the stack (follow_the_called_model)
        self.plan_source = plan_source
        self.progress = progress
        self.generate_kernels = generate_kernels
        # Whether a caller tracks steps (ending them when backward ends); without one
        # a graph running again means a new step began.
        self.track_steps = step is not None
        if replans is None:
            # A backend's own run-time check sees the whole step before earlier graphs plan again
            # for a later one that cannot fit (ckptc.runtime.watch), as the step runtime does.
            checked = self._checks_own_steps(options.budget_bytes)
            account = StepAccount(
                budget_bytes=options.budget_bytes,
                hold_outputs=options.hold_outputs,
                result_gradients=options.hold_outputs is True,  # held results may feed the caller's loss
                defer_infeasible=checked,
            )
            # Results counted held until a checked step shows whether the caller holds them (a plan
            # file was made under ckptc.capture's choice: applied under it).
            replans = Replans(account, watch_outputs=checked and plan_source is None)
        self.replans = replans
        # The account of the latest plan made (None before the first).
        self.planned_account: StepAccount | None = None
        self.plans_made = 0  # graphs planned so far, counting those planned again
        # Whether a graph has symbolic sizes (:func:`has_symbolic_sizes`): not planned again in place.
        self.symbolic = False
        # What each op signature showed run on random data (scratch, oversized outputs), measured once
        # for every graph this compiler plans (again).
        self._scratch: dict[tuple, OpMemory] = {}
        # The largest size each input dimension of its graphs took, by (placeholder, dimension) (see _sizes_seen).
        self._largest_sizes: dict[tuple[str, int], int] = {}
        self.records: list[GraphRecord] = []
        # What Dynamo runs for each graph this compiler planned; Dynamo's caches (the compiled frame's
        # module globals) hold only a weak trampoline to it (see __call__).
        self._graph_runs: list[Callable] = []
        # Graphs whose forward ran in the current step, in order (a graph run
        # twice before one backward appears twice when steps are tracked).
        self.active: list[GraphRecord] = step if step is not None else []
        self._just_planned: GraphRecord | None = None
        self._told_saved_tensor_hooks = False  # see _warn_saved_tensor_hooks
        # The swap slot of the graph just planned, and its backward module, for its forward compiler.
        self._just_planned_slot: tuple[GraphPlans, fx.GraphModule] | None = None
        # Graph index -> its plans, where they are swapped in place (GraphPlans).
        self.graph_plans: dict[int, GraphPlans] = {}
        # Under torch.compile(backend=...), what a measured step showed (ckptc.runtime.watch).
        self.step_check: BackendStepCheck | None = None
        # Under ckptc.optimize, the step runtime's side of the same events (ckptc.runtime.step).
        self.step_events = step_events

    @property
    def budget_bytes(self) -> int | None:
        """The step's budget, from the account graphs are planned under."""
        return self.account.budget_bytes

    @property
    def account(self) -> StepAccount:
        """The account graphs are planned under now (``replans.account``)."""
        return self.replans.account

    @property
    def strategy(self) -> str:
        return self.options.strategy

    @property
    def solver(self) -> str:
        return self.options.solver

    @property
    def model(self) -> torch.nn.Module | None:
        """The model whose graphs this compiler plans, when known; None once the caller let it go.

        Held weakly: Dynamo keeps every backend a ``torch.compile`` call was given until
        ``torch.compiler.reset()`` (``torch._dynamo.eval_frame.cached_backends``), so a compiler holding
        its model kept every optimized model, and its weights on the device, alive for the whole process."""
        return self._model() if self._model is not None else None

    @model.setter
    def model(self, model: torch.nn.Module | None) -> None:
        self._model = weakref.ref(model) if model is not None else None

    def for_step(
        self, replans: Replans, step: list[GraphRecord], events: StepEvents | None = None
    ) -> "CheckpointCompiler":
        """A fresh compiler with this one's options, no graphs planned, planning under ``replans``'
        account, appending the graphs it runs to ``step`` and telling ``events`` when a graph plans
        or starts (see the class docstring)."""
        return CheckpointCompiler(
            self.options,
            model=self.model,
            plan_source=self.plan_source,
            progress=self.progress,
            generate_kernels=self.generate_kernels,
            step=step,
            replans=replans,
            step_events=events,
        )

    def __getstate__(self) -> dict[str, Any]:
        # Planned graphs hold FX graphs and fake tensors: keep only the options.
        return {
            "options": self.options,
            "model": self.model,
            "plan_source": self.plan_source,
            "progress": self.progress,
            "replans": Replans(self.account),
            "generate_kernels": self.generate_kernels,
            "track_steps": self.track_steps,
        }

    def __setstate__(self, state: dict[str, Any]) -> None:
        track = state.pop("track_steps", False)
        self.__init__(**state)  # type: ignore[misc]
        self.track_steps = track

    def __repr__(self) -> str:
        budget = "none" if self.budget_bytes is None else solvers.format_bytes(self.budget_bytes)
        return (
            f"CheckpointCompiler(budget={budget}, strategy={self.strategy!r}, "
            f"solver={self.solver!r}, compiler={self.options.compiler!r}, graphs={len(self.records)})"
        )

    @property
    def plan(self) -> ModelPlan | None:
        """The plan of every graph this backend has planned (None before the first).

        Under ``torch.compile(model, backend=b)`` with ``b = ckptc.backend(...)``,
        ``b.plan`` is how to read what was kept and recomputed, and
        ``b.plan.measured_peak_bytes`` the peak of a step measured under the current plans.
        """
        if not self.records:
            return None
        plan = ModelPlan.from_records(self.records, self.options, self.model)
        if self.step_check is not None:
            plan.measured_peak_bytes = self.step_check.measured_peak_bytes
        return plan

    def reset(self) -> None:
        """Forget the graphs planned so far (new input shapes plan again)."""
        self.records.clear()
        self.active.clear()
        self.graph_plans.clear()

    # -- torch.compile backend entry point ---------------------------------
    def __call__(self, gm: fx.GraphModule, example_inputs: Sequence[Any], **compile_args: Any) -> Callable:
        try:
            refuse_compile_args(compile_args)  # torch.compile(mode=...) reaches a backend object too
            run = self._plan_dynamo_graph(gm, example_inputs)
        except BaseException as error:
            runs_eagerly = not isinstance(error, CkptcError) and internals.dynamo_runs_eagerly_after(error)
            if self.step_check is not None and runs_eagerly:
                # Dynamo breaks the graph there and the call goes on, its code run eagerly: so does the
                # step, unmeasured.  Ended here, the next graph of the call would open a step and start a
                # profiler inside the record-function scopes opened under the one stopped now, and
                # torch 2.13 writes their late ends through freed memory (a crash at the next step).
                self.step_check.planned()
            elif self.step_check is not None:
                # The step this graph was compiled in fails with it.  Left open, it would count as another
                # model's open step for every later model's (none of them then measured).
                self.step_check.abort()
            if isinstance(error, CkptcError):
                # Dynamo would hand it to the caller wrapped in its BackendCompilerFailed: not a CkptcError.
                raise internals.raised_through_dynamo(error) from error.__cause__
            if not self.track_steps and runs_eagerly:
                name = self._model_name("the compiled function")
                warn_once(
                    self,
                    "graph-run-eagerly",
                    f"ckptc: a graph of {name} could not be planned ({type(error).__name__}: "
                    f"{str(error).splitlines()[0][:200] if str(error) else 'no message'}), and Dynamo runs its "
                    "code eagerly instead (its 'Backend compiler exception' log): unplanned and unmeasured, so "
                    "the budget does not hold for it. What to do: train the model through ckptc.optimize, whose "
                    "graphs keep data-dependent ops (nonzero, boolean-mask indexing, .item()), or remove them.",
                    stacklevel=2,
                )
            raise
        # Dynamo keeps what a backend returns in the compiled frame's module globals for the whole
        # process; what it runs reaches this compiler, its step and the model (weights on the device).
        self._graph_runs.append(run)
        return internals.called_weakly(run)

    def _plan_dynamo_graph(self, gm: fx.GraphModule, example_inputs: Sequence[Any]) -> Callable:
        control_flow = internals.control_flow_ops(gm)
        if (
            control_flow
            and torch.is_grad_enabled()
            and any(isinstance(t, torch.Tensor) and t.requires_grad for t in example_inputs)
        ):  # a graph that trains (an inference graph runs as compiled)
            raise UntraceableModelError(
                f"ckptc cannot plan a graph that calls {', '.join(control_flow)}: its branches are subgraphs "
                "that ckptc's rewrite does not split into what backward keeps and what it recomputes.\n"
                "What to do: write the branch as a plain Python `if` (Dynamo compiles the branch taken, and "
                "again when the other is), or train this model with plain torch.compile."
            )
        if not self.track_steps:
            check_backend_context()  # torch.compile(DDP(model), backend="ckptc") is refused
            # torch.compile(model, backend="ckptc") names no model: the one being compiled is found, so the
            # baselines count what its graphs do not take (eager code's parameters, frozen ones); a backend
            # compiling several models plans each one's graphs counting that one.
            self._follow_the_called_model()
            self._warn_at_the_recompile_limit()
            self._warn_if_part_of_a_larger_model(example_inputs)
        events = self.step_check or self.step_events
        if events is not None:
            events.planned(new_graph=True)  # planning profiles ops
        refuse_oversized(gm, self._model_name("the model"))
        if self.step_check is not None and self.step_check.left_behind():
            log.info("torch.compile(backend='ckptc'): the last step's results died without a backward")
        if self.step_check is not None and not self.step_check.step_open:
            # Compiled before the step's first graph runs (a new input shape): the graphs of the last
            # step are not earlier graphs of this one.
            self.active.clear()
        index = len(self.records)
        at_least = self._sizes_seen(gm, example_inputs)
        symbolic = has_symbolic_sizes(gm, example_inputs)
        self.symbolic = self.symbolic or symbolic
        # A backend's graph with symbolic sizes is not planned again (see ``run``): one that cannot fit is
        # refused now, not run at its floor to see the whole step first.
        final = symbolic and not self.track_steps
        try:
            compiled, record, plans = self._plan_graph(gm, example_inputs, index, final=final, at_least=at_least)
        except solvers.InfeasibleBudgetError as error:
            if not (self.replans.letting_results_go_for_room(error) or self.replans.back_to_standing_plans(error)):
                raise
            compiled, record, plans = self._plan_graph(gm, example_inputs, index, final=final, at_least=at_least)
        if record is None:
            return compiled  # an inference graph: nothing planned
        # Results nobody uses get no gradient tensor (ckptc.rewrite.unused_grads).
        no_zeros = zeros_buildable(record.joint_problem.joint.graph)
        check = self._backend_check()
        if check is not None and symbolic:
            check.fixed_plans = True
        if not no_zeros and check is None and not self.track_steps:
            return compiled
        planned_under = self.account
        events = check or self.step_events
        read_inside = results_read_inside(gm)

        def run(*args: Any) -> Any:
            nonlocal compiled, record, planned_under, plans
            if check is not None and not check.step_open:
                self._follow_the_called_model()
            if check is not None and check.begin(args, index):
                self.active.clear()  # a new step: no graph of it has run yet
            account = self.account
            if account is not planned_under and self.replans.plans_stand(planned_under):
                planned_under = account  # a measured step within the budget showed what it adds
            if account is not planned_under and account != planned_under and not symbolic:
                # The step showed what this graph's plan did not count: plan it again, in place behind
                # its AOTAutograd function or else from Dynamo's graph (guards and bytecode stay as they are).
                if events is not None:
                    events.planned()
                # Planned again on this call's inputs (the graph's guards held: the same structure as the
                # example inputs), not the example inputs, which would keep the first call's tensors (the
                # weights, under torch.compile(backend=...)) alive as long as Dynamo keeps this backend.
                inputs = list(args)
                while True:
                    try:
                        again = self._plan_again(plans, gm, inputs, index) if plans is not None else None
                        if again is not None:
                            record = again
                        else:
                            compiled, record, plans = self._plan_graph(gm, inputs, index, at_least=at_least)
                    except solvers.InfeasibleBudgetError as error:
                        if check is not None and check.stops_counting_gradients_it_lacks():
                            account = self.account
                            continue
                        # Not run on its old plan, made for an account the step showed wrong (unless a step
                        # measured within the budget ran it): every later call plans again, and is refused
                        # again unless the account changed.
                        if not self.replans.keeps_measured_plans(planned_under, error):
                            if check is not None:
                                check.refused()
                            refusal = self.replans.refusal(error)
                            if refusal is error:
                                raise
                            raise refusal from error
                    break
                planned_under = account
            if events is not None:
                # Results of earlier graphs the eager code between let go: not counted held from the next plan.
                self.replans.observed_results_let_go(events.results_beside(record.index, args, self.records))
                events.graph_starts(record, args)
            internals.profiler_mark(GRAPH_STARTS)  # a measured step's region of eager code ends (ckptc.meter)
            try:
                outputs = compiled(*args)
            except BaseException:
                if check is not None:
                    check.abort()
                raise
            # A measured step's region of eager code (or the caller's loss) begins (ckptc.meter).
            internals.profiler_mark(f"{FORWARD_RETURNED}:{record.index}")
            if no_zeros:
                internals.pass_missing_grads_as_none(outputs, args)
            if read_inside:
                _tell_hooks_on_results_read_inside(self, outputs, read_inside, record.index)
            if events is not None:
                events.graph_returned(record, outputs)
            return outputs

        return run

    def _warn_at_the_recompile_limit(self) -> None:
        """Say once, when Dynamo compiles a frame for the last time, that later calls its graphs do not
        cover will run eagerly: past its recompile limit Dynamo compiles that code no more and runs such a
        call without the backend, unplanned and unmeasured, with only a log line (a budget sweep compiling
        a fresh model per trial, each with its own backend, ran its ninth trial at 1.115x its budget)."""
        compiles = internals.frame_compiles()
        if compiles is None or compiles[0] + 1 < compiles[1]:  # (the one compiling now makes an entry too)
            return
        name = self._model_name("the compiled function")
        warn_once(
            type(self.model) if self.model is not None else self,
            "recompile-limit",
            f"ckptc: Dynamo compiled {name}'s code {compiles[0] + 1} times now, its recompile limit "
            f"(torch._dynamo.config.recompile_limit = {compiles[1]}): a later call that none of those graphs' "
            "guards pass (a new input shape, another model of this class compiled with another backend) runs "
            "eagerly, without ckptc's plan and unmeasured, so the budget does not hold for it.\n"
            "What to do: in a sweep, call torch.compiler.reset() before compiling each trial's model; else "
            "raise torch._dynamo.config.recompile_limit, or train through ckptc.optimize, whose compiles do "
            "not count against the limit.",
            stacklevel=2,
        )

    def _model_name(self, unknown: str) -> str:
        """The class name of the model this compiler counts, for messages (``unknown`` when none is known)."""
        return type(self.model).__name__ if self.model is not None else unknown

    def _warn_if_part_of_a_larger_model(self, example_inputs: Sequence[Any]) -> None:
        """Say once when the model found for a backend given no ``model=`` takes, in its first graph, a
        tensor that eager code made from parameters that are not its own: a part of a larger model compiled
        on its own (each layer compiled separately, torchtitan-style).  The
        budget is the whole step's, but only that part's parameters are counted: the rest of the model's
        parameters and gradients are counted nowhere, and the check read a tiny Llama's steps as within
        the budget while they measured 1.04x it independently."""
        if self._model_given or self.model is None or self.records or not torch.is_grad_enabled():
            return
        own = {id(p) for p in self.model.parameters()}
        made = [
            t
            for t in example_inputs
            if isinstance(t, torch.Tensor)
            and t.grad_fn is not None
            and not internals.made_by_compiled_graph(t)
            and any(
                isinstance(leaf, torch.nn.Parameter) and id(leaf) not in own for leaf in internals.leaves_reached(t)
            )
        ]
        if not made:
            return
        name = type(self.model).__name__
        warn_once(
            self.model,
            "part-of-a-larger-model",
            f"ckptc: the backend compiles {name} on a tensor made from parameters that are not {name}'s (its "
            f"gradient node is {made[0].grad_fn.name()}): {name} looks like a part of a larger model compiled on "
            f"its own (a layer compiled per block). The budget is the whole step's, but without model= this "
            f"backend counts only {name}'s parameters: the rest of the model's parameters and gradients are "
            "counted nowhere, and steps can run over the budget while ckptc's check reads them as within.\n"
            "What to do: pass ckptc.backend(..., model=<the whole model>) to every compile of its parts, or "
            "compile the whole model.",
            stacklevel=4,
        )

    def _follow_the_called_model(self) -> None:
        """Count the model whose call compiles or runs the graphs now, where it is not the one known.

        One backend may compile several models (two models sharing a backend object), and Dynamo runs a
        compiled graph for any module whose call passes its guards: another instance of the model's class
        (a budget sweep building a fresh model per trial with one backend object, or with a new one that
        Dynamo took for the last, freed one).  Counting the earlier model, or none once it was freed, put
        the new one's parameters outside every graph, or the other model's beside them (budgets each model
        met alone were refused).  A model given as ``model=`` is followed only once it was freed."""
        known = self.model
        if self._model_given and known is not None:
            return
        called = internals.compiled_module_called()
        if called is None or called is known:
            return
        if known is not None or self._model_given:
            log.info("torch.compile(backend='ckptc'): the graphs run for another %s now", type(called).__name__)
        self.model = called  # (its step check reads it from here)

    def _plan_graph(
        self,
        gm: fx.GraphModule,
        example_inputs: Sequence[Any],
        index: int,
        *,
        final: bool = False,
        at_least: dict[Any, int],
    ) -> tuple[Callable, GraphRecord | None, GraphPlans | None]:
        """AOTAutograd on Dynamo's graph ``gm`` with ckptc's partitioner: the compiled graph, the
        record of its plan as graph ``index`` of the step (None for an inference graph), and where
        its later plans are swapped in (None where they cannot be: :meth:`_plan_again`).
        ``final``: the plan will not be made again (see :meth:`_plan_priced`); ``at_least``: sizes its
        dynamic dimensions are priced at least at (:meth:`_sizes_seen`)."""
        planned: list[GraphRecord] = []
        slots: list[GraphPlans] = []

        def partition(joint: fx.GraphModule, joint_inputs: Any, *, num_fwd_outputs: int, **_: Any) -> Any:
            start = time.perf_counter()
            written_back = internals.inputs_written_back(joint)
            with self._pricing_sizes(at_least):
                joint = self._price(joint, num_fwd_outputs)
                forward, backward = self._plan_priced(
                    joint,
                    num_fwd_outputs,
                    gm,
                    example_inputs,
                    index=index,
                    final=final,
                    start=start,
                    written_back=written_back,
                )
            if self._just_planned is not None:
                planned.append(self._just_planned)
                if not final and self._swaps_plans(forward, num_fwd_outputs):
                    slots.append(GraphPlans(joint, num_fwd_outputs, self._backward_kernels, written_back))
                    self.graph_plans[index] = slots[-1]
                    backward.meta["ckptc_record"].plans = slots[-1]
                    self._just_planned_slot = (slots[-1], backward)
            return forward, backward

        backend = internals.aot_backend(
            fw_compiler=self._compile_forward,
            bw_compiler=self._compile_backward,
            partition_fn=partition,
            for_inductor=self.options.compiler == "inductor",
        )
        compiled = backend(gm, example_inputs)
        return compiled, (planned[-1] if planned else None), (slots[-1] if slots else None)

    def _swaps_plans(self, forward: fx.GraphModule, num_fwd_outputs: int) -> bool:
        """Whether a graph's later plans can run behind its first AOTAutograd function
        (:class:`GraphPlans`): under the eager compiler (Inductor compiles inside AOTAutograd's
        context), with a forward that saves tensors only."""
        return self.options.compiler == "eager" and internals.saves_tensors_only(forward, num_fwd_outputs)

    def _plan_again(
        self, plans: GraphPlans, gm: fx.GraphModule, example_inputs: Sequence[Any], index: int
    ) -> GraphRecord | None:
        """Plan graph ``index`` again under the current account, from its priced joint graph, and
        swap the plan in behind its AOTAutograd function: neither Dynamo's graph nor the joint graph
        is traced again, nor priced.  None (after planning) if the new plan cannot run there."""
        with self._pricing_sizes({}):  # no graph with symbolic sizes is planned again in place
            forward, backward = self._plan_priced(
                plans.joint,
                plans.num_fwd_outputs,
                gm,
                example_inputs,
                index=index,
                final=False,
                start=time.perf_counter(),
                written_back=plans.written_back,
            )
        record, self._just_planned = self._just_planned, None
        if record is None or not self._swaps_plans(forward, plans.num_fwd_outputs):
            return None
        backward.meta["ckptc_record"].plans = plans
        plans.add(record, self._compile_graph(forward, example_inputs), backward)
        log.debug("graph %d planned again in place (plan %d of it)", index, plans.version)
        return record

    def _gradient_sink(self, example_inputs: Sequence[Any], placeholders: Sequence[Any]) -> GradientSink | None:
        """Where the backward adds parameter gradients as they are made (``ckptc.rewrite.lean_backward``),
        when the step account asks for it; the graph's inputs must line up with the joint graph's."""
        if not self.account.accumulate_in_backward or self.options.compiler != "eager":
            return None
        if len(example_inputs) > len(placeholders):
            return None
        for real, fake in zip(example_inputs, placeholders[: len(example_inputs)], strict=True):
            if isinstance(real, torch.nn.Parameter) and real.requires_grad:
                if not isinstance(fake, torch.Tensor) or tuple(fake.shape) != tuple(real.shape):
                    return None  # AOTAutograd reordered the inputs: leave accumulation to autograd
        sink = GradientSink(example_inputs)
        return sink if sink.positions else None

    def _pricing_sizes(self, at_least: dict[Any, int]) -> Any:
        """How dynamic sizes are priced: a backend prices them at the sizes it captured, or at the sizes
        ``at_least`` gives them (the largest an earlier graph took there, :meth:`_sizes_seen`; its check
        measures the first step of every size), ``optimize`` at the top of their length bucket."""
        if self.track_steps:
            return contextlib.nullcontext()
        return internals.dynamic_sizes_at_hints(at_least)

    def _sizes_seen(self, gm: fx.GraphModule, example_inputs: Sequence[Any]) -> dict[Any, int]:
        """Record the sizes of Dynamo's graph ``gm``'s inputs, and return, for each of its dynamic
        dimensions, the largest size an earlier graph took at the same input and dimension.

        Dynamo compiles a graph with a symbolic size once a second size runs (its automatic dynamic
        shapes: an epoch's smaller last batch, a second call half as long) and runs the first size on
        it too from then on, so its plan is priced at the larger size.  Inputs are matched by Dynamo's
        placeholder names (they name the source: ``L_input_ids_``); a local of the same name in another
        frame can only raise a price."""
        at_least: dict[Any, int] = {}
        placeholders = list(gm.graph.find_nodes(op="placeholder"))
        for node, value in zip(placeholders, example_inputs, strict=False):
            if not isinstance(value, torch.Tensor):
                continue
            name = node.target
            traced = internals.dynamo_example_value(node, value)
            for dim, symbol in internals.symbols_of_sizes(traced.shape):
                seen = self._largest_sizes.get((name, dim))
                if seen is not None:
                    at_least[symbol] = max(seen, at_least.get(symbol, 0))
            for dim, size in enumerate(value.shape):
                concrete = internals.size_hint(size)
                if concrete is not None:
                    key = (name, dim)
                    self._largest_sizes[key] = max(concrete, self._largest_sizes.get(key, 0))
        return at_least

    def _checks_own_steps(self, budget_bytes: int | None) -> bool:
        """Whether this compiler runs a backend's run-time check of its steps: no caller tracks them
        (``ckptc.optimize``'s step runtime does), a budget is set, and the plans run (a capture's do not)."""
        return not self.track_steps and budget_bytes is not None and self.generate_kernels

    def _backend_check(self) -> BackendStepCheck | None:
        """The run-time check of a ``torch.compile`` backend's steps (one for all its graphs); none
        under ``ckptc.optimize``, whose step runtime checks and plans again, or without a budget."""
        if not self._checks_own_steps(self.budget_bytes):
            return None
        if self.step_check is None:
            self.step_check = BackendStepCheck(self.replans, lambda: self.model)
        return self.step_check

    def _compile_forward(self, gm: fx.GraphModule, example_inputs: Sequence[Any]) -> Callable:
        record = self._just_planned
        self._just_planned = None
        slot, self._just_planned_slot = self._just_planned_slot, None
        # A graph planned only to see the whole step runs once and is planned again: no kernels for it.
        compiled = self._compile_graph(gm, example_inputs, kernels=record is None or not record.infeasible)
        if record is None:  # an inference graph: nothing planned
            return compiled
        plans = None
        if slot is not None:
            plans, backward = slot
            plans.add(record, compiled, backward)
            internals.donate_no_saved_tensors()  # the next plans' backwards run behind this function

        def forward(args: list[Any]) -> Any:
            # Track which graphs run in this step, in order: graphs planned later
            # count what these keep for backward in their baseline.
            # Without a step tracker, a graph running again means a new step began.
            running = plans.record if plans is not None else record
            if not self._told_saved_tensor_hooks and internals.callers_saved_tensor_hooks():
                self._told_saved_tensor_hooks = True  # the caller's frame is found once, not on every call
                self._warn_saved_tensor_hooks()
            if not self.track_steps and self.step_check is None and any(r is running for r in self.active):
                self.active.clear()
            self.active.append(running)
            return plans.run_forward(args) if plans is not None else compiled(args)

        return internals.mark_boxed(forward)

    def _warn_saved_tensor_hooks(self) -> None:
        name = type(self.model).__name__ if self.model is not None else "the model"
        warn_once(
            self.model if self.model is not None else self,
            "saved-tensor-hooks",
            f"ckptc: {name} was trained under saved-tensor hooks of the caller's "
            "(torch.autograd.graph.saved_tensors_hooks, save_on_cpu). They pack what ckptc's plan keeps for "
            "backward, and each graph's backward unpacks all of it as it starts, so: the values the plan "
            "recomputes are recomputed from what the hooks unpack, and hooks that change values (packing to a "
            "lower precision) give gradients that differ from eager PyTorch's under the same hooks; hooks that "
            "keep copies on the model's device add memory the plan does not count (the run-time check measures "
            "it, plans again, and may refuse the budget); hooks that offload (save_on_cpu on a GPU) free nothing "
            "while a graph's backward runs. What to do: train the model without the hooks around it: the budget "
            "already bounds what is kept for backward (a lower budget keeps less).",
            stacklevel=outside_stacklevel(),
        )

    def _compile_backward(self, gm: fx.GraphModule, example_inputs: Sequence[Any]) -> Callable:
        link = gm.meta.get("ckptc_record")
        plans = link.plans if link is not None else None
        run = plans.run_backward if plans is not None else self._backward_kernels(gm)

        def backward(args: list[Any]) -> Any:
            internals.profiler_mark(BACKWARD_STARTS)  # a measured step's loss region ends (ckptc.meter)
            try:
                # The backward of whichever plan's forward ran (GraphPlans: compiled on first use), or this one's.
                return run(args)
            except BaseException:
                events = self.step_check or self.step_events
                if events is not None:
                    events.backward_failed()  # no meter of ckptc's outlives the failed step
                raise

        return internals.mark_boxed(backward)

    def _backward_kernels(self, gm: fx.GraphModule) -> Callable:
        link = gm.meta.get("ckptc_record")
        record = link.record if link is not None else None
        free = record.joint_problem.free_tangents if record is not None else ()
        sink = link.gradient_sink if link is not None else None

        def compile_graph(graph: fx.GraphModule, args: list[Any]) -> Callable:
            if self._generates_kernels():
                # For the layouts the saved tensors arrive in (Inductor's forward chooses them), as
                # AOTAutograd restrides a backward's inputs to its forward's outputs.
                return _inductor_on_read_inputs(graph, internals.placeholder_values_laid_out_as(graph, args))
            graph = reinplace(graph)
            return internals.boxed(accumulate_into_parameters(graph, sink) if sink is not None else graph)

        return ZeroGradBackward(gm, compile_graph, free=free, record=record)

    def _compile_graph(self, gm: fx.GraphModule, example_inputs: Sequence[Any], *, kernels: bool = True) -> Callable:
        if kernels and self._generates_kernels():
            return internals.inductor_compile(gm, example_inputs)
        return internals.boxed(gm)

    def _generates_kernels(self) -> bool:
        """Whether graphs get Inductor kernels (not when captured only to plan: :func:`ckptc.capture`)."""
        return self.options.compiler == "inductor" and self.generate_kernels

    # -- the partitioner: price once, plan per account ------------------
    def _price(self, joint: fx.GraphModule, num_fwd_outputs: int) -> fx.GraphModule:
        """The joint graph as the compiler will run it (random state replayed, Inductor's rewrites),
        every node priced (``node.meta["ckptc"]``): done once per graph, whatever its plans."""
        if self.options.compiler == "eager":
            # Inductor cannot lower the Python calls that replay generator state,
            # so under Inductor random ops keep their outputs instead.
            insert_rng_state_nodes(joint.graph)
        refuse_products_of_two_dtypes(joint)
        drop_unread_batch_norm_statistics(joint.graph)
        joint.recompile()
        if self.options.compiler == "inductor":
            joint = internals.inductor_joint_passes(joint)
        annotate_costs(joint, self.options.compiler, num_fwd_outputs)
        if self.options.measure_scratch:
            measure_scratch(joint, self._scratch)
        if self.options.measure_time:
            measure_runtimes(joint)
        return joint

    def _plan_priced(
        self,
        joint: fx.GraphModule,
        num_fwd_outputs: int,
        gm: fx.GraphModule,
        example_inputs: Sequence[Any],
        *,
        index: int,
        final: bool,
        start: float,
        written_back: frozenset[str] = frozenset(),
    ) -> tuple[fx.GraphModule, fx.GraphModule]:
        """Plan a priced joint graph of Dynamo's graph ``gm`` as graph ``index`` of the step (a graph
        planned again keeps its index and replaces its record), under the step account (what the step
        holds outside it: its baseline), and rewrite it into AOTAutograd's forward and backward modules.
        A ``final`` plan is not made again: a graph that cannot fit is refused, never deferred.
        ``written_back``: inputs AOTAutograd writes new values into after the forward
        (:func:`ckptc._torch_internals.inputs_written_back`): what reads them is saved, never recomputed."""
        placeholders = [n.meta.get("val") for n in joint.graph.find_nodes(op="placeholder")]
        mine = {id(r) for r in self.records}
        earlier_calls = {id(r) for r in self.active if id(r) not in mine}
        events = self.step_check or self.step_events
        if events is not None:  # as at every run (see ``run``), before this graph's plan is made
            self.replans.observed_results_let_go(events.results_beside(index, example_inputs, self.records))
            self.replans.observed_eager_saves(index, events.saved_by_eager_code(example_inputs, self.model))
        baseline_bytes, inputs = self.account.graph_baseline(
            self.model, example_inputs, placeholders, self.active, index=index, earlier_calls=earlier_calls
        )
        # What runs of graphs between its first and last run in the step leave alive (a graph run several times).
        repeated = self.account.repeated_runs_bytes(index, {r.index: r for r in self.records})
        gradient_sink = self._gradient_sink(example_inputs, placeholders)
        policies = policies_from_patterns(
            {n.name: n for n in joint.graph.nodes}, self.options.must_save, self.options.must_recompute
        )
        jp = joint_to_problem(
            joint,
            num_fwd_outputs,
            baseline_bytes=max(0, baseline_bytes + repeated),
            mutated_inputs=written_back,
            policies=policies,
            hold_outputs=self.account.hold_outputs,
            free_unused_grads=not self.account.result_gradients,
            in_place_backward=self.options.compiler == "eager",
            accumulated_gradients=gradient_sink.positions if gradient_sink is not None else frozenset(),
            loss_bytes=max(self.account.loss_bytes, self.account.eager_bytes_after.get(index, 0)),
            gradient_sum_bytes=inputs.view_gradient_bytes
            + (max(inputs.parameters.values(), default=0) if self.account.gradients_summed_by_autograd else 0),
        )
        jp = with_later_results(jp, self.account.later_results_held.get(index, 0))
        account = self.account.replace(defer_infeasible=False) if final else self.account
        record = decide(
            jp,
            self.options,
            account,
            index=index,
            earlier=self.active,
            plan_source=self.plan_source,
            progress=self.progress,
            inputs=inputs,
            started=start,
            repeat_bytes=repeated,
        )
        record.break_after = internals.graph_break_after(gm)
        record.earlier_let_go_bytes = sum(e.step_bytes for e in self.active) - self.account.earlier_bytes(
            self.active, index, earlier_calls
        )
        if index < len(self.records):
            self.records[index] = record
        else:
            self.records.append(record)
        self.planned_account = self.account
        self.plans_made += 1
        self._just_planned = record
        steps = solvers.schedule(jp.problem, record.plan)
        forward, backward = rewrite(joint, steps, record.plan.kept, num_fwd_outputs)
        backward.meta["ckptc_record"] = RecordLink(record, gradient_sink)
        return forward, backward


# Kernels that refuse operands of two dtypes when they run, though the meta kernels tracing uses
# take them (a float64 batch into a float32 linear layer traces, then fails at its first run).
_ONE_DTYPE_KERNELS = frozenset(
    {
        torch.ops.aten.mm.default,
        torch.ops.aten.addmm.default,
        torch.ops.aten.bmm.default,
        torch.ops.aten.baddbmm.default,
        torch.ops.aten.convolution.default,
    }
)


def refuse_products_of_two_dtypes(joint: fx.GraphModule) -> None:
    """Raise where the joint graph multiplies tensors of two dtypes, as eager PyTorch would when it ran.

    Planning such a graph would refuse a budget, or run out of memory, before the step showed the
    real error (a float64 batch given to a float32 model).

    Raises:
        ckptc.ArgumentTypeError: naming the op, the module and the dtypes.
    """
    for node in joint.graph.nodes:
        if node.op != "call_function" or node.target not in _ONE_DTYPE_KERNELS:
            continue
        vals = [a.meta.get("val") for a in node.args if isinstance(a, fx.Node)]
        dtypes = sorted({str(v.dtype).replace("torch.", "") for v in vals if isinstance(v, torch.Tensor)})
        if len(dtypes) > 1:
            stack = node.meta.get("nn_module_stack") or {}
            where = f" in module {normalize_module_path(list(stack.values())[-1][0])!r}" if stack else ""
            raise ArgumentTypeError(
                f"the model's step computes {node.target}{where} of tensors of dtypes {' and '.join(dtypes)}; "
                "PyTorch's kernel refuses that when it runs (eager raises the same error for this call). Give "
                "the model inputs of its parameters' dtype (inputs.to(dtype), or model.to(dtype)), or run the "
                "step under torch.autocast."
            )


class GraphPlans:
    """The plans of one Dynamo graph, run behind the one AOTAutograd function traced for it.

    A graph planned again (the step showed what its plan did not count) keeps AOTAutograd's
    function: the new plan's forward and backward run behind it, so the call that plans again
    neither traces nor prices the graph again (:meth:`CheckpointCompiler._plan_again`).
    AOTAutograd saves the forward's outputs after its results as one open-ended run of tensors
    (:func:`ckptc._torch_internals.saves_tensors_only`); the forward puts first among them an
    empty tensor whose shape names its plan, and the backward runs that plan's backward: one
    pending across a new plan (two calls per step, ``retain_graph``) gets the tensors its
    forward saved.

    Attributes:
        joint: the priced joint graph every plan is made from.
        num_fwd_outputs: how many of a forward's outputs are results (the saved tensors follow).
        written_back: the joint graph's inputs AOTAutograd writes new values into after the forward.
        records: each plan's record, in order; the last is the current plan.
    """

    def __init__(
        self,
        joint: fx.GraphModule,
        num_fwd_outputs: int,
        compile_backward: Callable[[fx.GraphModule], Callable],
        written_back: frozenset[str] = frozenset(),
    ) -> None:
        self.joint = joint
        self.num_fwd_outputs = num_fwd_outputs
        self.written_back = written_back
        self.records: list[GraphRecord] = []
        self._compile_backward = compile_backward
        self._forwards: list[Callable | None] = []
        self._backward_modules: list[fx.GraphModule] = []
        self._backwards: dict[int, Callable] = {}

    @property
    def version(self) -> int:
        """The current plan's index in :attr:`records`."""
        return len(self.records) - 1

    @property
    def record(self) -> GraphRecord:
        """The current plan's record."""
        return self.records[-1]

    def add(self, record: GraphRecord, forward: Callable, backward: fx.GraphModule) -> None:
        """Make ``record``'s plan current: ``forward`` compiled (boxed), ``backward`` compiled on first use."""
        if self._forwards:
            self._forwards[-1] = None  # never run again; its backward may still be, for a pending step
        self.records.append(record)
        self._forwards.append(forward)
        self._backward_modules.append(backward)

    def run_forward(self, args: list[Any]) -> list[Any]:
        version = self.version
        outputs = list(self._forwards[version](args))
        # Zero elements: the mark allocates nothing.
        outputs.insert(self.num_fwd_outputs, torch.empty((0, version)))
        return outputs

    def run_backward(self, args: list[Any]) -> Any:
        version = args[0].shape[1]  # the mark its forward saved first
        del args[0]
        backward = self._backwards.get(version)
        if backward is None:
            backward = self._backwards[version] = self._compile_backward(self._backward_modules[version])
        return backward(args)

    def __repr__(self) -> str:
        return f"GraphPlans(plans={len(self.records)}, current=graph {self.record.index})"


def _inductor_on_read_inputs(gm: fx.GraphModule, example_inputs: Sequence[Any]) -> Callable:
    """Inductor kernels for ``gm`` without the inputs it never reads (a backward specialized for
    unused results receives ``None`` there, which Inductor's input checks cannot take); boxed,
    called with every input."""
    placeholders = list(gm.graph.find_nodes(op="placeholder"))
    read = [i for i, node in enumerate(placeholders) if node.users]
    if len(read) == len(placeholders):
        return internals.inductor_compile(gm, example_inputs)
    graph = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    graph.output(graph.graph_copy(gm.graph, env))
    for old in placeholders:
        if not old.users:
            graph.erase_node(env[old])
    compiled = internals.inductor_compile(fx.GraphModule(gm, graph), [example_inputs[i] for i in read])

    def run(args: list[Any]) -> Any:
        inputs = [args[i] for i in read]
        args.clear()  # boxed: the kernels free inputs as they go
        return compiled(inputs)

    return internals.mark_boxed(run)


# Reads of a result that pass no gradient back to it.
_READS_WITHOUT_GRADIENT = frozenset({"size", "dim", "stride", "numel", "detach", "sym_size", "sym_numel", "sym_stride"})


def results_read_inside(gm: fx.GraphModule) -> tuple[int, ...]:
    """Positions of ``gm``'s results that its own code reads too (a hidden state returned and fed on, logits
    a loss computed inside the model reads): their gradient from that use is summed inside the compiled
    backward, so a gradient hook or ``retain_grad()`` on the result sees only the part from outside."""
    output = next((node for node in reversed(gm.graph.nodes) if node.op == "output"), None)
    results = output.args[0] if output is not None and output.args else ()
    if not isinstance(results, (tuple, list)):
        results = (results,)

    def passes_gradient(user: fx.Node) -> bool:
        name = user.target if isinstance(user.target, str) else getattr(user.target, "__name__", str(user.target))
        return user.op != "output" and str(name).split(".")[0] not in _READS_WITHOUT_GRADIENT

    return tuple(
        i
        for i, result in enumerate(results)
        if isinstance(result, fx.Node) and result.op != "placeholder" and any(map(passes_gradient, result.users))
    )


def _tell_hooks_on_results_read_inside(owner: Any, outputs: Any, positions: tuple[int, ...], index: int) -> None:
    """Warn once, when backward reaches them, if the caller put a gradient hook or ``retain_grad()`` on a result
    the graph reads too (:func:`results_read_inside`): it sees only the gradient from outside the graph
    (as under plain ``torch.compile``), where eager PyTorch's sees the sum."""
    if not isinstance(outputs, (tuple, list)):
        return
    for i in positions:
        result = outputs[i] if i < len(outputs) else None
        if not isinstance(result, torch.Tensor) or result.grad_fn is None:
            continue
        ref = weakref.ref(result)

        def check(grad: Any, ref: weakref.ref = ref, i: int = i) -> None:
            tensor = ref()
            if tensor is None or not (tensor.retains_grad or internals.user_gradient_hook_count(tensor)):
                return
            warn_once(
                owner,
                "hook-on-a-result-read-inside",
                f"ckptc: a gradient hook or retain_grad() on result {i} of graph #{index + 1} "
                f"({tuple(tensor.shape)}), which the graph's own code reads too (a hidden state a later layer "
                "reads, logits a loss computed inside the model reads), receives only the gradient from outside "
                "the graph: the compiled backward adds the part from the graph's own use inside, as under plain "
                "torch.compile.  Its .grad, the hook's input, and the parameters' gradients where the hook "
                "changes the gradient differ from eager PyTorch's, where the hook sees the sum.  What to do: "
                "read the gradient of a result the model does not use itself (compute the loss outside the "
                "model), or train this step without ckptc.",
            )

        result.register_hook(check)
