"""The step account: the one place that says what a step's budget counts.

A budget bounds everything one training step holds on the device, from the
start of its first forward to the end of its last backward.  Each captured
graph is planned for its own activations; everything else the step holds while
that graph runs is the graph's *baseline*, and this module computes it:

* the model's parameters and buffers that the graph does not take as input;
* gradients: those resident when the step began (gradient accumulation,
  ``zero_grad(set_to_none=False)``) or made by an earlier backward of the same
  step (``retain_graph=True``) for the whole step, and those of parameters
  no graph run so far uses (their backward runs first, so they exist while this
  graph's backward runs);
* what earlier graphs of the step keep for their backward and the results the
  caller holds (:attr:`ckptc.records.GraphRecord.step_bytes`), less the results
  a graph break hands to this graph as inputs (counted by the graph), and the
  data earlier graphs took as inputs (a first call's batch);
* for a graph run several times in the step, what its earlier runs leave alive
  (one plan serves every run: :attr:`StepAccount.repeat_bytes`);
* a small reserve for results of graphs after a break (the loss, a few scalars),
  not known yet when earlier graphs are planned;
* per-rank extras under DDP/FSDP2 (:class:`ckptc.distributed.RankContext`);
* the device's own step overhead (cuBLAS workspaces, :mod:`ckptc.pricing.devices`);
* a correction measured at run time: what a measured step showed the
  prediction missed (eager code between graphs, allocator effects);

and, not for the whole step but where it happens, what a measured step held
while the caller's loss ran between the forward and the backward (a loss
computed outside the model, its temporaries and its backward):
:attr:`StepAccount.loss_bytes`, priced as a transient at the end of each graph's
forward (:func:`ckptc.pricing.problem.joint_to_problem`);

and the planning margin (:func:`planning_margin`): solvers plan a little below
the budget, sized from what the plan controls.

A :class:`StepAccount` also carries the budget itself.  The budget is validated
once, where the user gives it (:class:`~ckptc.options.CheckpointOptions`), and
enters an account once per step: :meth:`ckptc.runtime.step.ShapePlan.first` (``optimize``,
``capture``), :meth:`ckptc.planning.planner.CapturedStep.plan`, or a ``torch.compile``
backend's compiler.  From there the account is the argument that carries it: the
replan loop (:class:`ckptc.planning.replan.Replans`) turns evidence into the next account,
the compiler hands the account to :func:`ckptc.planning.planner.decide`, and the planner
gives the solvers a planning budget (:func:`planning_budget`).
"""

from __future__ import annotations

import dataclasses
import weakref
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Collection, Mapping, Sequence

import torch

import solvers
from ckptc._torch_internals import gradient_scattered_into_own_buffer, made_by_compiled_graph, views_of
from ckptc.meter import allocated_bytes, gradient_of, resident_bytes
from ckptc.pricing.devices import MemoryModel, graph_device, memory_model
from ckptc.records import GraphInputs, GraphRecord

#: Results of graphs after a break (the loss, a few scalars) that earlier graphs cannot see yet.
HELD_RESULTS_RESERVE_BYTES = 1024
#: The margin is 1/200 of the activations kept for backward and 1/32 of the largest scratch, and on a caching
#: allocator a further share of the activations (see planning_margin).
PLANNING_MARGIN_DIVISOR = 200
SCRATCH_UNCERTAINTY_DIVISOR = 32
NO_CACHE = MemoryModel("cpu")


@dataclass(frozen=True)
class StepAccount:
    """The budget of one step and what it holds besides the activations the plans decide (see the
    module docstring).

    Attributes:
        budget_bytes: the step's budget, as the user gave it (validated once, by
            :class:`~ckptc.options.CheckpointOptions`; None: no limit).  Every stage below the entry
            points reads it here, from the account it is given.
        gradients_resident: parameters' gradients are allocated while the step's
            graphs run: the step starts with them (accumulation,
            ``zero_grad(set_to_none=False)``) or a second backward of the step runs
            after the first made them (``retain_graph=True``). They count for the
            whole step, at their parameters' sizes where not allocated yet.
        correction_bytes: what a measured step showed the prediction missed.
        rank_bytes: what this rank holds outside the graphs' view (DDP buckets, FSDP2 buffers).
        hold_outputs: whether the caller holds forward results until backward
            ends (None: decided per graph, see :func:`ckptc.pricing.problem.joint_to_problem`).
            False with ``result_gradients``: a step showed that the caller drops them once its loss
            has used them (:attr:`results_dropped_by_caller`).
        outputs_assumed_held: ``hold_outputs`` is True only until a step shows whether the caller
            holds the results (a training loop that was not told,
            :meth:`ckptc.planning.replan.Replans.observed_results`).  Not compared: an account
            that learns the caller does hold them prices the same and plans nothing again.
        result_gradients: the loss uses results other than the model's own scalar loss
            (``out.loss + f(out.logits)``), so their gradients arrive as tensors; otherwise a graph
            that returns its own loss prices them as absent (:mod:`ckptc.rewrite.unused_grads`).
        graph_budgets: budgets of single graphs by index, lower than the step's
            (earlier graphs keeping less for later ones; set by the replan loop).
        defer_infeasible: plan a graph that cannot fit at its lowest peak and
            mark it, so the whole step is seen before deciding.
        accumulate_in_backward: the backward adds each parameter gradient into the
            resident ``.grad`` as it is made (:class:`ckptc.rewrite.lean_backward.GradientSink`;
            with gradients resident, not under DDP/FSDP2).
        gradients_summed_by_autograd: this call's parameter gradients meet a later call's in
            autograd's buffer when its backward returns them (the model called again before one
            backward): the engine adds each pair out of place, so the largest of them is allocated
            once more on top of both (eager PyTorch does the same).
        loss_bytes: what a measured step held, above its forward's end, between its last graph's
            forward and its first graph's backward (the caller's loss and its backward,
            :attr:`ckptc.meter.MemoryMeasurement.loss_bytes`): priced at the end of forward.
        repeat_runs: by graph index, for a graph run several times in one step (identical
            layers compiled once, a break inside the layer loop, the model called twice before
            one backward), how many runs of each graph (by index) are alive at its last run
            beyond those alive at its first, which its plan was made for (:func:`repeat_bytes`):
            one plan serves every run.  Each leaves alive what its graph's current plan keeps
            (:meth:`repeated_runs_bytes`); its own earlier runs keep what its own plan keeps,
            so the planner chooses that plan with them counted at its own bytes
            (:func:`ckptc.planning.planner.decide`).
        repeat_bytes: by graph index, the gradients counted at such a graph's first run
            that do not exist yet at its last (zero or negative bytes).
        outside_baseline_bytes: by graph index, what the step holds beside the graph at its first
            and at its last run that its baseline does not count, learned from a step that ran under
            a torch.compile backend (:class:`ckptc.runtime.watch.BackendStepCheck`): the parameters of
            runs its baseline does not name (a backend not given the model knows parameters only from
            the graphs that take them, and a record names those of the run it was compiled for), and
            the gradients of the parameters later runs take, made by their backwards, which run before
            this run's (a baseline of a backend given the model counts all but those taken again: the
            model called twice before one backward, a shared block).
        earlier_calls_planned: how many times earlier calls of the step (the model called again
            before one backward) planned again to leave this call room
            (:meth:`ckptc.planning.replan.Replans.make_room_for_later_calls`): this call's graphs,
            whose baselines count what those keep, plan again after them.
        eager_bytes_after: by graph index, what a measured step held above its level as that graph's
            forward returned, while eager code ran before the step's next graph (a graph break's
            code: a mask, a mix of the result, what it saves for its own backward): priced, as
            ``loss_bytes`` is, at the end of that graph's forward, where the graph's kept values are
            alive beside it (a flat correction would not grow with what the plan keeps there).
        results_let_go: by pair ``(earlier, later)`` of graph indices, how many runs of the earlier
            graph in the step had their results dead (or handed on as the later graph's inputs) when the
            later graph of the same call started (the eager code after a graph break used them and let
            them go, as ``hidden = embeddings + positions`` does): the later graph's baseline does not
            count those runs' results held (:meth:`earlier_bytes`,
            :meth:`ckptc.planning.replan.Replans.observed_results_let_go`).
        eager_saved_before: by graph index, what eager code of the step (a graph break's, or before
            the first graph) saved for its own backward upstream of that graph, seen as it planned
            (a dropout mask, a norm's input: :meth:`ckptc.runtime.tracker.ResultLifetimes.saved_by_eager_code`):
            alive until that code's backward, after this graph's and every later graph's, so counted in
            their baselines (not compared: graphs planned before it need no new plan).
        later_results_held: by graph index, the results of later graphs of the call that a step showed the
            caller holding until backward ends (a loop keeping the output object: its logits, an encoder's
            last state), alive while this earlier graph's backward runs after theirs
            (:meth:`counting_later_results`): from the end of its forward through its backward
            (:func:`ckptc.pricing.problem.with_later_results`).
    """

    budget_bytes: int | None = None
    gradients_resident: bool = False
    correction_bytes: int = 0
    rank_bytes: int = 0
    hold_outputs: bool | None = None
    result_gradients: bool = False
    outputs_assumed_held: bool = field(default=False, compare=False)
    graph_budgets: Mapping[int, int] = field(default_factory=dict)
    defer_infeasible: bool = False
    repeat_bytes: Mapping[int, int] = field(default_factory=dict)
    repeat_runs: Mapping[int, Mapping[int, int]] = field(default_factory=dict)
    outside_baseline_bytes: Mapping[int, tuple[int, int]] = field(default_factory=dict)
    accumulate_in_backward: bool = False
    gradients_summed_by_autograd: bool = False
    loss_bytes: int = 0
    earlier_calls_planned: int = 0
    eager_bytes_after: Mapping[int, int] = field(default_factory=dict)
    results_let_go: Mapping[tuple[int, int], int] = field(default_factory=dict, compare=False)
    eager_saved_before: Mapping[int, int] = field(default_factory=dict, compare=False)
    later_results_held: Mapping[int, int] = field(default_factory=dict)

    @property
    def results_dropped_by_caller(self) -> bool:
        """A step showed that the caller drops the results once its loss has used them
        (``loss = loss_fn(model(x), y)``): they die at the end of forward, their gradients arrive in
        backward (:meth:`ckptc.planning.replan.Replans.observed_results`; a caller's own
        ``hold_outputs=False`` prices their gradients as absent instead)."""
        return self.hold_outputs is False and self.result_gradients

    def replace(self, **changes: Any) -> "StepAccount":
        return dataclasses.replace(self, **changes)

    def beyond_a_plain_step(self, held_output_bytes: int | None = None) -> list[str]:
        """What this account counts that a plain step (``capture``'s figures) does not, each with what
        the caller can do about it, in words (empty for a plain step).  ``held_output_bytes``: what the
        results counted held weigh in the graph refused (``JointProblem.held_output_bytes``), where known;
        0 leaves them unsaid (a model returning only its scalar loss: holding it changes no floor)."""
        said = []
        if self.gradients_resident:
            said.append(
                "the parameters' gradients, resident while the step runs (gradient accumulation, "
                "zero_grad(set_to_none=False), a second backward, a forward with gradients enabled "
                "between backward and zero_grad, or the model called again before one backward, whose "
                "later call's backward makes them before the earlier calls' run): zero them with "
                "zero_grad(set_to_none=True) before a step that does not accumulate, run evaluation "
                "forwards under torch.no_grad(), and, where the loss allows it, run a backward after each call"
            )
        if self.eager_bytes_after:
            said.append(
                f"{max(self.eager_bytes_after.values())} bytes held by eager code between graphs (the model's own "
                "code after a graph break, or the caller's code between two calls of the model), beside what the "
                "graph before it keeps: remove the break (the coverage report in ckptc.optimize(...).plan names "
                "it) to bring that code into a plan, or free what the caller's code holds before the next call"
            )
        if self.loss_bytes:
            said.append(
                f"{self.loss_bytes} bytes allocated after the last captured graph's forward and held until "
                "backward (a loss or metrics computed by the caller, the model's own code that runs "
                "eagerly after a graph break, or saved-tensor hooks around the call, which pack copies of "
                "what the graphs keep): compute the loss inside the model, free them earlier, remove the "
                "graph break (the coverage report in ckptc.optimize(...).plan names it) or the hooks"
            )
        results_weigh = held_output_bytes != 0
        if results_weigh and self.result_gradients:
            said.append(
                "the forward's results (logits), held until backward ends with their gradients "
                "(hold_outputs=True, or a loss that uses them beside the model's own loss)"
            )
        elif results_weigh and self.hold_outputs and self.outputs_assumed_held:
            said.append(
                "the forward's results (logits), assumed held until backward ends, as a caller that reads them "
                "after backward would (no step of this input shape, dtype and set of trainable parameters has "
                "shown what this loop does yet): pass hold_outputs=False if the loop drops them before backward "
                "(loss = loss_fn(model(x)), or loss = model(...).loss); a loss computed outside the model is then "
                "measured on the first step and planned for"
            )
        elif results_weigh and self.hold_outputs and not self.outputs_assumed_held:
            said.append(
                "the forward's results (logits), held until backward ends: drop them before backward "
                "(loss = model(...).loss, or del the output object before loss.backward()); where the model "
                "itself keeps them (a forward hook storing a layer's output in an attribute), clear them once "
                "its loss has used them.  A graph's results that the model's own code reads after a graph break "
                "(its loss) are counted so too, whether or not the caller holds them (ckptc.optimize breaks no "
                "graph at logging calls, where torch.compile(backend=...) breaks transformers' loss functions)"
            )
        if self.repeat_runs:
            said.append(
                "what earlier runs of graphs run several times in one step (layers compiled once, the model "
                "called again before one backward) leave alive until their backward"
            )
        if self.correction_bytes:
            said.append(f"{self.correction_bytes} bytes a measured step showed the prediction missed")
        if self.rank_bytes:
            said.append(
                f"{self.rank_bytes} bytes DDP or FSDP2 hold beside the graphs on this rank (gradient buckets, "
                "gathered parameters): smaller buckets (DDP's bucket_cap_mb) leave more for activations"
            )
        return said

    def explained_refusal(
        self, error: solvers.InfeasibleBudgetError, lead: str, held_output_bytes: int | None = None
    ) -> solvers.InfeasibleBudgetError:
        """``error`` with what this account counts beyond a plain step (:meth:`beyond_a_plain_step`, with
        ``held_output_bytes``) and what to do, after ``lead``; ``error`` itself when it counts nothing more
        or was explained already."""
        held = self.beyond_a_plain_step(held_output_bytes)
        floor = error.min_feasible_bytes
        if floor is None or getattr(error, "_explained", False):
            return error
        if not held:
            return below_the_floor(error)
        explained = solvers.InfeasibleBudgetError(
            error.budget_bytes,
            floor,
            f"{error}{lead}:\n- "
            + "\n- ".join(held)
            + f"\nWhat to do: give a budget of at least {floor} bytes, or change the loop as said above.",
        )
        explained._explained = True  # type: ignore[attr-defined]  # a caller up the stack adds nothing more
        return explained

    def graph_budget(self, index: int) -> int | None:
        """The budget graph ``index`` is planned under: the step's, or a lower one of its own
        (:attr:`graph_budgets`)."""
        if self.budget_bytes is None:
            return None
        return min(self.budget_bytes, self.graph_budgets.get(index, self.budget_bytes))

    def counting_repeats(
        self, ran: Sequence[GraphRecord], unnamed_gradient_bytes: int = 0, *, later_gradients_counted: bool = True
    ) -> "StepAccount":
        """This account with :attr:`repeat_bytes` raised to what the step ``ran`` showed
        (:func:`repeat_bytes`; ``later_gradients_counted``: whether graph baselines count the gradients
        later graphs make); ``self`` when nothing grew."""
        correction, runs = repeat_bytes(
            ran,
            corrects_gradients=later_gradients_counted and not self.gradients_resident,
            unnamed_gradient_bytes=unnamed_gradient_bytes,
        )
        latest = {r.index: r for r in ran}
        worse = [
            i
            for i in runs
            if i not in self.repeat_runs
            or _priced(runs[i], correction[i], latest)
            > _priced(self.repeat_runs[i], self.repeat_bytes.get(i, 0), latest)
        ]
        if not worse:
            return self
        return self.replace(
            repeat_bytes={**self.repeat_bytes, **{i: correction[i] for i in worse}},
            repeat_runs={**self.repeat_runs, **{i: runs[i] for i in worse}},
        )

    def counting_later_results(self, ran: Sequence[GraphRecord], held: Mapping[int, int]) -> "StepAccount":
        """This account with :attr:`later_results_held` as a step of the call whose graphs ``ran`` (in run
        order) showed it: ``held``, by position in ``ran``, the bytes of each run's results the caller held
        through backward (:meth:`ckptc.runtime.tracker.ResultLifetimes.held_through_backward`), counted for
        every run before it (by graph index, the most over its runs).  ``self`` when that is what it counts
        already.  Never less than an earlier step showed: a loop that holds the results on some steps only
        (a metric read from the logits every few steps) keeps them counted, as a single graph's held results
        stay counted (before, each step planned again for what it showed, and a step holding them ran on
        the plans of the step before, which did not: a tiny Yoso, six graphs, at 1.055x its budget)."""
        later: dict[int, int] = dict(self.later_results_held)
        after = 0  # held by the runs after position k
        for k in reversed(range(len(ran))):
            if after > later.get(ran[k].index, 0):
                later[ran[k].index] = after
            after += held.get(k, 0)
        if later == dict(self.later_results_held):
            return self
        return self.replace(later_results_held=later)

    def repeated_runs_bytes(self, index: int, current: Mapping[int, GraphRecord]) -> int:
        """What the runs of other graphs counted for graph ``index``'s last run (:attr:`repeat_runs`)
        leave alive under their ``current`` plans (by graph index; its own runs are counted by the
        planner at its own plan's bytes), with the gradient correction of :attr:`repeat_bytes`."""
        counts = self.repeat_runs.get(index, {})
        others = sum(n * current[j].step_bytes for j, n in counts.items() if j != index and j in current)
        return others + self.repeat_bytes.get(index, 0)

    def earlier_bytes(
        self, earlier: Sequence[GraphRecord], index: int, earlier_calls: Collection[int] = frozenset()
    ) -> int:
        """What the graphs ``earlier`` in the step leave alive while graph ``index`` runs: what each keeps
        for its backward and the results the caller holds (:attr:`GraphRecord.step_bytes`), less the
        results a step showed dead by then (:attr:`results_let_go`; graphs of this call only, not those
        of ``earlier_calls``, the ids of earlier calls' records)."""
        return _left_alive(earlier, self._let_go(earlier, index, earlier_calls))

    def _let_go(self, earlier: Sequence[GraphRecord], index: int, earlier_calls: Collection[int]) -> set[int]:
        """Positions in ``earlier`` of the runs whose results are let go beside graph ``index``."""
        if not self.results_let_go:
            return set()
        left = dict(self.results_let_go)
        positions = set()
        for k, r in enumerate(earlier):
            pair = (r.index, index)
            if left.get(pair, 0) > 0 and id(r) not in earlier_calls:
                left[pair] -= 1
                positions.add(k)
        return positions

    def graph_baseline(
        self,
        model: torch.nn.Module | None,
        graph_inputs: Sequence[Any],
        placeholders: Sequence[Any],
        earlier: Sequence[GraphRecord],
        *,
        index: int,
        earlier_calls: Collection[int] = frozenset(),
    ) -> tuple[int, GraphInputs]:
        """The baseline of graph ``index`` taking ``graph_inputs`` (real tensors) whose joint graph's
        placeholder values are ``placeholders`` (fake tensors), after the graphs ``earlier``
        in the same step, at its first run in the step (its later runs: :meth:`repeated_runs_bytes`).
        Also returns the graph's tensor inputs (:attr:`ckptc.records.GraphRecord.inputs`).
        ``earlier_calls``: the ids of the records in ``earlier`` run by earlier calls of the step (the
        model called again before one backward), whose backwards run after this graph's.

        A graph counts its own inputs; of earlier graphs' data inputs it counts those it
        does not take (the caller holds a first call's batch until backward), and from what
        earlier graphs leave alive it takes away their results that it takes as inputs
        (a graph break hands one graph's result to the next: one tensor, counted once).
        """
        tensors = list(dict.fromkeys(t for t in graph_inputs if isinstance(t, torch.Tensor)))
        if model is not None:
            params = {id(p): p for p in model.parameters()}
            state_tensors = [*params.values(), *model.buffers()]
        else:  # a torch.compile backend not given the model: its parameters are those the graphs take
            params = {id(t): t for t in tensors if isinstance(t, torch.nn.Parameter) and t.requires_grad}
            state_tensors = list(params.values())
        # A view of a parameter taken in eager code between graphs (one expert's slice of a weight that
        # stacks every expert's) is the model's state too, not data the caller holds (counted as data, each
        # graph taking one counted the whole weight again): the graph takes that parameter.
        viewed = views_of(tensors, state_tensors)
        state_ids = {id(t) for t in state_tensors} | set(viewed)
        taken = [t for t in tensors if id(t) in state_ids and id(t) not in viewed] + list(viewed.values())
        inputs = GraphInputs(
            data={id(t): resident_bytes(t) for t in tensors if id(t) not in state_ids},
            parameters={id(t): allocated_bytes(t) for t in taken if id(t) in params and t.requires_grad},
            state=frozenset({id(t) for t in tensors if id(t) in state_ids} | {id(t) for t in taken}),
            handed=frozenset(id(t) for t in tensors if id(t) not in state_ids and made_by_compiled_graph(t)),
            data_refs={id(t): weakref.ref(t) for t in tensors if id(t) not in state_ids},
            view_gradient_bytes=sum(
                allocated_bytes(owner)
                for t in tensors
                if (owner := viewed.get(id(t))) is not None
                and id(owner) in params
                and owner.requires_grad
                and gradient_scattered_into_own_buffer(t, owner)
            ),
        )
        outside = 0
        if model is not None:
            state = resident_bytes(*state_tensors)
            in_graph = resident_bytes(*[t for t in tensors if id(t) in state_ids])
            # The gradients made before this graph's backward are those of the parameters that later
            # graphs of its own call take: earlier calls' backwards run after it.
            this_call = [r for r in earlier if id(r) not in earlier_calls]
            seen = inputs.ids.union(*(r.inputs.ids for r in this_call))
            grads = later = 0
            for i, p in params.items():
                if not p.requires_grad:
                    # Frozen after zero_grad(set_to_none=False): its zeroed gradient stays allocated.
                    frozen_gradient = gradient_of(p)
                    grads += allocated_bytes(frozen_gradient) if frozen_gradient is not None else 0
                    continue
                if self.gradients_resident:
                    grads += allocated_bytes(_gradient_or(p))
                elif i not in seen:
                    later += allocated_bytes(p)  # made by a later graph's backward, which runs first
            # A graph run again for another block takes parameters its record does not name (those of
            # the run it was compiled for): as many of the unnamed ones ran already, not later.
            runs: dict[int, int] = {}
            for record in this_call:
                runs[id(record)] = runs.get(id(record), -1) + 1
                if runs[id(record)]:
                    later -= min(later, sum(record.inputs.parameters.values()))
            outside = max(0, state - in_graph) + grads + later
        else:
            # Earlier graphs' parameters stay resident; with gradients resident, so do their gradients
            # (at their parameters' sizes) and this graph's own.
            earlier_params: dict[int, int] = {}
            for record in earlier:
                earlier_params.update(record.inputs.parameters)
            other = sum(n for i, n in earlier_params.items() if i not in inputs.parameters)
            outside = other
            if self.gradients_resident:
                own = sum(allocated_bytes(_gradient_or(p)) for p in params.values())
                outside += other + own
        earlier_data: dict[int, int] = {}
        for record in earlier:
            # A result an earlier graph handed on is counted by the graph that made it.
            earlier_data.update(
                (i, n)
                for i, n in record.inputs.data.items()
                if not (i in inputs.data and record.inputs.still_takes(i)) and i not in record.inputs.handed
            )
        # Held results are in step_bytes under any plan (kept for backward or held beside): a bound
        # that does not depend on the plans, so CapturedStep can plan earlier graphs again.
        let_go = self._let_go(earlier, index, earlier_calls)
        held_by_earlier = sum(r.joint_problem.held_output_bytes for k, r in enumerate(earlier) if k not in let_go)
        # Results handed on by a graph whose results are let go beside this one are counted by neither.
        let_go_bytes = sum(earlier[k].held_output_bytes for k in let_go)
        handed_on = max(0, sum(inputs.data[i] for i in inputs.handed) - let_go_bytes)
        device = graph_device([v for v in placeholders if isinstance(v, torch.Tensor)])
        return (
            max(
                0,
                outside
                + sum(earlier_data.values())
                + _left_alive(earlier, let_go)
                - min(handed_on, held_by_earlier)
                + sum(nbytes for j, nbytes in self.eager_saved_before.items() if j <= index)
                + HELD_RESULTS_RESERVE_BYTES
                + self.rank_bytes
                + self.correction_bytes
                + memory_model(device).step_overhead_bytes,
            ),
            inputs,
        )


def _left_alive(earlier: Sequence[GraphRecord], let_go: Collection[int]) -> int:
    """What the runs ``earlier`` leave alive (:attr:`GraphRecord.step_bytes`), less the held results of
    those at the positions ``let_go``."""
    return sum(r.step_bytes - (r.held_output_bytes if k in let_go else 0) for k, r in enumerate(earlier))


def repeat_bytes(
    ran: Sequence[GraphRecord], *, corrects_gradients: bool = True, unnamed_gradient_bytes: int = 0
) -> tuple[dict[int, int], dict[int, dict[int, int]]]:
    """For each graph run more than once in a step (``ran``, in run order, graphs by ``record.index``),
    what the step holds outside it at its worst later run beyond what it held at its first, which its
    plan was made for: the runs of graphs in between, its own earlier runs among them, each of which
    leaves alive what its graph's plan keeps (counted by graph index, so each is priced at its graph's
    current plan), and a correction in bytes (zero or negative) for the gradients counted at the first
    run that do not exist yet at the later one.

    Those gradients are of parameters no graph had taken yet (whose backward runs first) taken by the
    runs in between.  A record names the parameters of the run it was compiled for; a later run of it
    takes its own (layers compiled once) or the same (a shared block, the model called again), so later
    runs are taken to use parameters no record names (``unnamed_gradient_bytes``, their gradients'
    bytes) until there are none left.  Without ``corrects_gradients`` (gradients resident from the
    step's start, or baselines that count none made later) the correction is zero.  Of the later runs,
    the one that holds the most under the plans that ran is counted.
    """
    latest = {r.index: r for r in ran}  # each graph's plan that ran
    first: dict[int, tuple[Counter[int], frozenset[int], int]] = {}
    correction: dict[int, int] = {}
    runs: dict[int, dict[int, int]] = {}
    alive: Counter[int] = Counter()  # runs so far, by graph index
    taken_unnamed = 0
    seen: set[int] = set()
    grad_bytes: dict[int, int] = {}
    for record in ran:
        i = record.index
        grad_bytes.update(record.inputs.parameters)
        seen |= record.inputs.ids
        if i in first:
            own = sum(record.inputs.parameters.values())
            taken_unnamed += min(own, unnamed_gradient_bytes - taken_unnamed)
            alive_then, seen_then, taken_then = first[i]
            not_yet = sum(grad_bytes.get(j, 0) for j in seen - seen_then) + taken_unnamed - taken_then
            fewer = -not_yet if corrects_gradients else 0
            counts = dict(alive - alive_then)
            if i not in runs or _priced(counts, fewer, latest) > _priced(runs[i], correction[i], latest):
                correction[i], runs[i] = fewer, counts
        else:
            first[i] = (Counter(alive), frozenset(seen), taken_unnamed)
        alive[i] += 1
    return correction, runs


def _priced(counts: Mapping[int, int], correction: int, plans: Mapping[int, GraphRecord]) -> int:
    """What runs of graphs (``counts`` by index) leave alive under ``plans``, with ``correction``."""
    return sum(n * plans[j].step_bytes for j, n in counts.items() if j in plans) + correction


def unnamed_gradient_bytes(model: torch.nn.Module, ran: Sequence[GraphRecord]) -> int:
    """Gradient bytes of ``model``'s trainable parameters that no graph in ``ran`` names as an input."""
    named = set().union(*(r.inputs.ids for r in ran))
    return sum(allocated_bytes(p) for p in model.parameters() if p.requires_grad and id(p) not in named)


def planning_margin(problem: solvers.Problem, result: solvers.SimResult, memory: MemoryModel = NO_CACHE) -> int:
    """How far below the user's budget a plan of this graph whose simulation is ``result`` must peak.

    What can differ between the prediction and a run is what the plan moves
    (activations kept for backward, whose kernels' scratch memory is measured
    once per op on random data and varies a little between runs), not the
    weights and gradients, which are exact.  So the margin is a share of the
    plan's kept bytes plus a share of the largest scratch: a
    billion-parameter model whose weights dwarf its activations keeps its
    whole useful range (floor to unoptimized peak) plannable, which a share
    of the whole budget would swallow.  On a device whose allocator serves
    blocks from a cache (``memory``, :data:`ckptc.pricing.devices.CACHE_REUSE_DIVISOR`),
    a further share of the kept bytes allows for cached blocks counted above
    their priced size.

    The solvers plan at the unoptimized plan's margin (the largest: no plan keeps more); the floor is
    the lowest-peak plan's peak with that plan's own margin, and a budget between the two gets a plan
    that fits within its own (:func:`ckptc.planning.planner.decide_at`).
    """
    uncertainty = result.kept_bytes // PLANNING_MARGIN_DIVISOR + problem.largest_scratch // SCRATCH_UNCERTAINTY_DIVISOR
    return uncertainty + cache_allowance(result, memory)


def cache_allowance(result: solvers.SimResult, memory: MemoryModel = NO_CACHE) -> int:
    """Bytes a caching allocator (``memory``) may count above the priced blocks of a plan keeping at most what
    the plan simulated as ``result`` keeps: blocks served from its cache
    (:data:`ckptc.pricing.devices.CACHE_REUSE_DIVISOR`).  Part of the planning margin, and of what keeping
    everything peaks at there; 0 without a cache."""
    return result.kept_bytes // memory.cache_reuse_divisor if memory.cache_reuse_divisor else 0


def below_the_floor(error: solvers.InfeasibleBudgetError) -> solvers.InfeasibleBudgetError:
    """``error`` (a budget below a plain step's floor, :attr:`~solvers.InfeasibleBudgetError.min_feasible_bytes`)
    saying what to do; ``error`` itself where it says so already or names no floor."""
    floor = error.min_feasible_bytes
    if floor is None or "What to do" in str(error):
        return error
    return solvers.InfeasibleBudgetError(
        error.budget_bytes,
        floor,
        f"{error}: no plan of this training step (its weights, gradients and inputs included) peaks lower. "
        f"What to do: give a budget of at least {floor} bytes ({solvers.format_bytes(floor)}), or make the step "
        "smaller (a smaller batch, shorter sequences); ckptc.capture(model, example_inputs).floor_bytes gives a "
        "shape's floor before training through ckptc.optimize (under torch.compile(backend=...) Dynamo may split "
        "the step into more graphs, at data-dependent ops such as torch.unique or boolean-mask indexing, each "
        "counting what the others hold, and the floor is then higher).",
    )


def planning_budget(budget_bytes: int, margin: int) -> int:
    """The budget solvers plan for: ``margin`` (:func:`ckptc.planning.account.planning_margin`) below the user's.

    Plans that fill the budget exactly would sometimes exceed it by a few
    kilobytes (kernels' scratch memory varies a little between runs).
    """
    return max(0, budget_bytes - margin)


def budget_for_planning_floor(floor: int, margin: int) -> int:
    """The smallest user budget whose planning budget reaches ``floor``."""
    return floor + margin


def _gradient_or(parameter: torch.Tensor) -> torch.Tensor:
    """``parameter``'s resident gradient, or the parameter itself where it has none (a gradient of its size)."""
    gradient = gradient_of(parameter)
    return gradient if gradient is not None else parameter


def gradients_resident(model: torch.nn.Module) -> bool:
    """Whether any trainable parameter of ``model`` has a gradient allocated."""
    return any(gradient_of(p) is not None for p in model.parameters() if p.requires_grad)
