"""The run-time budget check of ``torch.compile(model, backend="ckptc")``.

:class:`ckptc.runtime.step.StepRuntime` sees every training call of ``ckptc.optimize``'s
model.  A ``torch.compile`` backend sees only its graphs, so it tracks the step
from them and plans each graph again on its next run when the step showed
something its plan did not count (the compiler keeps Dynamo's graph and runs
AOTAutograd and the planner on it again; Dynamo's guards and bytecode stay):

* a step begins with the first graph run after the last step's backward ended
  (a second call before one backward belongs to the same step) and ends when
  that backward ends (:class:`ckptc.runtime.tracker.StepTracker`, as for
  ``optimize``);
* a step that starts with gradients resident (accumulation,
  ``zero_grad(set_to_none=False)``) or a second backward of a step
  (``retain_graph=True``) makes the account count the gradients; a graph run
  several times in one step makes it count what earlier runs leave alive
  (:meth:`~ckptc.planning.account.StepAccount.counting_repeats`);
* the first plans count the graphs' results (logits) held through backward; a step whose
  results died before its backward ended, in a graph that computes its own loss, lets them go
  (:meth:`~ckptc.planning.replan.Replans.observed_results`), and results whose gradients the
  loss used after all are counted with their gradients;
* the first step of each plan and of each state (gradients resident at its
  start or not) is measured from its first graph's forward to the end of its
  backward (:class:`ckptc.meter.StepMeter`), unless a graph planned after its
  first graph ran (planning profiles ops, and profilers do not nest);
  above the budget, the account counts what the prediction missed and the
  graphs plan again, at most :data:`~ckptc.planning.replan.MAX_REPLANS` times; after
  that the next graph run raises :class:`ckptc.BudgetExceededError` naming the
  measured peak and what to do.

The account and the evidence that changes it are a :class:`ckptc.planning.replan.Replans`,
as for every other path that plans.
"""

from __future__ import annotations

import gc
import logging
from collections import Counter
from typing import Any, Callable, Sequence

import torch

from ckptc import _torch_internals as internals
from ckptc.errors import warn_once
from ckptc.meter import (
    MemoryMeasurement,
    allocated_bytes,
    gradient_of,
    resident_bytes,
    resident_storages,
    steps_to_verify,
)
from ckptc.planning.account import StepAccount, unnamed_gradient_bytes
from ckptc.planning.replan import Replans
from ckptc.records import GraphRecord
from ckptc.runtime.tracker import ResultLifetimes, StepTracker, warn_if_sparse_gradients_resident

log = logging.getLogger("ckptc.runtime.watch")


class BackendStepCheck:
    """Tracks a backend's steps and the account its graphs are planned under (see the module docstring).

    Args:
        replans: the compiler's account and the evidence that changes it (its budget is the step's).
        model: the model, when the backend was given it (its parameters and gradients then count).

    Attributes:
        replans: the account every graph should be planned under now (``replans.account``; a graph
            planned under another plans again before it runs,
            :meth:`ckptc.capture.compiler.CheckpointCompiler.__call__`) and the evidence that changed it.
        measured_peak_bytes: the peak of the last step measured under the current plans (None before one).
        verified: how many measured steps of the current plans were within the budget, by state
            (gradients resident at its start or not) and the sizes of the first graph's inputs: a graph
            with symbolic sizes is planned at the sizes it was captured with and runs larger ones on
            the same plan, so the first steps of every size are measured (a state is verified after
            :func:`ckptc.meter.steps_to_verify` of them).
    """

    def __init__(self, replans: Replans, model_of: Callable[[], torch.nn.Module | None] = lambda: None) -> None:
        assert replans.budget_bytes is not None
        self.replans = replans
        # Its compiler's (CheckpointCompiler.model, held weakly there: Dynamo keeps backends for good), which
        # follows the model whose call runs the graphs.
        self._model_of = model_of
        self.measured_peak_bytes: int | None = None
        self.verified: Counter[tuple[bool, tuple]] = Counter()
        self._state: tuple[bool, tuple] = (False, ())
        self._measure = False
        self._tracker = StepTracker(self._ended, self._second_backward)
        self._counted: set[Any] = set()  # storages the meter holds already (in its baseline or its events)
        self._ran: list[GraphRecord] = []  # the graphs of the open (or last) step, in run order
        self._runs = _StepRuns()  # of the open step's graphs
        self._lifetimes = ResultLifetimes()  # of the open step's graphs' results
        # Whether a graph of the step keeps its first plan (symbolic sizes, ckptc.capture.compiler.has_symbolic_sizes):
        # a measured excess is then refused at once, since planning again would change nothing.
        self.fixed_plans = False
        self._first_runs_again = False  # a step ran the graph that began it again (left_behind)
        self._collected = False  # the open step collected garbage once (left_behind)
        self._refused_counting_gradients = False  # planning was refused with gradients counted resident
        self._first_graphs: set[int] = set()  # the graphs that began steps (left_behind)

    @property
    def model(self) -> torch.nn.Module | None:
        return self._model_of()

    @property
    def account(self) -> StepAccount:
        return self.replans.account

    @property
    def budget_bytes(self) -> int:
        budget = self.account.budget_bytes
        assert budget is not None  # a check is made only under a budget
        return budget

    def __repr__(self) -> str:
        return (
            f"BackendStepCheck(budget={self.budget_bytes}, verified={self.verified}, "
            f"measured_peak_bytes={self.measured_peak_bytes}, replans={self.replans.replans})"
        )

    @property
    def step_open(self) -> bool:
        """Whether a step is open: a graph of it ran and its backward has not ended."""
        return self._tracker.open

    def begin(self, args: Sequence[Any], index: int | None = None) -> bool:
        """Before graph ``index`` runs on ``args`` (the real tensors Dynamo passes, parameters included):
        open a step if none is open, counting what the last one showed (or raising
        :class:`~ckptc.BudgetExceededError` when the replans are used up).  True when it opened one."""
        # A step left behind that ends now, its meter running, ends inside this call, whose record-function
        # scopes opened under that meter's profiler: one started before they close gets their late ends
        # through freed memory (torch 2.13, :mod:`ckptc.runtime.tracker`), so the step opening now is not measured.
        unsafe_to_measure = self._tracker.measuring
        if self._tracker.open and not self.left_behind(index):
            return False
        state = any(isinstance(a, torch.nn.Parameter) and gradient_of(a) is not None for a in args)
        if not state and self._refused_counting_gradients and self.replans.not_counting_gradients():
            log.info("torch.compile(backend='ckptc'): a step starts without the gradients refused; planning again")
            self._replanned()
        self._refused_counting_gradients = False
        if state and not self.account.gradients_resident:
            log.info("torch.compile(backend='ckptc'): a step starts with gradients resident; planning again")
            # What the last step showed the baselines miss, now with the parameters' gradients resident.
            self.replans.counting_outside_baselines(
                self._runs.outside_baseline_bytes(model_known=self.model is not None, gradients_resident=True)
            )
            self._count_gradients()
        self._count_missed()
        self._tracker.begin()
        self._lifetimes.begin()
        self._lifetimes.warn_if_last_step_held(self, args, stacklevel=4)
        if state:
            warn_if_sparse_gradients_resident(self, args, stacklevel=4)
        self._collected = False
        if index is not None:
            self._first_graphs.add(index)
        self._ran = []
        self._runs = _StepRuns()
        sizes = tuple(
            tuple(a.shape) for a in args if isinstance(a, torch.Tensor) and not isinstance(a, torch.nn.Parameter)
        )
        self._state = (state, sizes)
        verified = self.verified[self._state] >= steps_to_verify(_device_of(args))
        profiled = not verified and internals.profiler_active()  # looked for only when a step is to be measured
        self._measure = not verified and not profiled and not unsafe_to_measure
        if not verified and profiled:
            # As ckptc.optimize says it (StepRuntime._measure): a loop profiled on every step would otherwise
            # run unverified plans (a size larger than any planned, say) over the budget without a word.
            warn_once(
                self,
                "profiler",
                "ckptc cannot verify this step's peak memory while torch.profiler runs (profilers do not nest); "
                "the step runs on the predicted plan, unchecked. Verification resumes on a step run outside "
                "the profiler: run a few steps without it before profiling, so that a plan that misses the "
                "budget is found and corrected.",
                stacklevel=4,
            )
        return True

    def left_behind(self, index: int | None = None) -> bool:
        """Whether the open step was left behind, its results garbage: checked when a graph compiles while
        it is open (``index`` None) and, once per step, when a graph that began a step runs (``index``; the
        failed call may have run a variant compiled for it), in a loop that has not shown a step running its
        first graph twice.

        A call that raised (an error in the user's forward or backward, caught by the loop) leaves its
        results in the exception's reference cycles, alive until the garbage collector runs: the next step's
        graphs joined that step as a second call, were planned beside it and refused at the budget the steps
        before had met, and so was every step after (each refusal leaving a step behind in turn).
        ``ckptc.optimize`` sees the call fail and ends the step; the backend sees only its graphs, so it
        collects garbage, and the step ends if its results died (:meth:`StepTracker._graph_died`)."""
        if not self._tracker.open or self._first_runs_again or not self._ran:
            return False
        if index is not None:
            if self._collected or index not in self._first_graphs:
                return False
            self._collected = True
        gc.collect()
        return not self._tracker.open

    def planned(self, new_graph: bool = False) -> None:
        """A graph plans (and profiles ops) now: a step one of whose graphs ran already is not measured;
        one that plans before its first graph runs is measured from that graph's start.  What was
        verified no longer stands: sizes verified on one graph may run on this one (Dynamo compiles a
        graph with symbolic sizes for a second size, and runs the first size on it too from then on)."""
        if self._ran:
            self._measure = False
        self.verified.clear()
        self._tracker.unmeasured()

    def graph_starts(self, record: GraphRecord, args: Sequence[Any]) -> None:
        """Graph ``record`` runs on ``args`` now, under its current plan."""
        self._ran.append(record)
        self._runs.add(record, args)
        if self._measure and not self._tracker.measuring:
            self._counted = set()
            device = _device_of(args)
            self._tracker.measure(device, 0)
            resident = [*args] if self.model is None else [self.model, *args]
            # The compiled call's own inputs on the measured device, which the caller holds: only eager code
            # may read one (a batch on the host that the forward moves counts where it is moved to).
            resident += [t for t in internals.compiled_call_inputs() if t.device == device]
            # Eager code before the step's first graph (Dynamo ran it outside every graph: a convolution
            # stem, an embedding) holds what autograd saved for its backward through the whole step, and
            # the parameters it used (with their gradients, when resident) are resident.
            resident += internals.tensors_held_for_backward([a for a in args if isinstance(a, torch.Tensor)])
            self._tracker.add_baseline(self._uncounted(resident))
        elif self._tracker.measuring:
            # A later graph's parameters were resident from the start.  Its leaf inputs may have been (a
            # second call's inputs, buffers of layers the first graph did not take) or made in the step (a
            # mask made between graphs): the meter tells (a tensor needing no gradient, or a leaf, has no
            # grad_fn).  Its other inputs were made in the step, and the meter's events hold them.
            self._tracker.add_baseline(self._uncounted([a for a in args if isinstance(a, torch.nn.Parameter)]))
            leaves = [
                a
                for a in args
                if isinstance(a, torch.Tensor) and not isinstance(a, torch.nn.Parameter) and a.grad_fn is None
            ]
            self._tracker.add_baseline_unless_allocated(resident_storages(leaves, self._counted))

    def results_beside(
        self, index: int, inputs: Sequence[Any], records: Sequence[GraphRecord]
    ) -> list[tuple[GraphRecord, int, int]]:
        """How many runs of earlier graphs have their results dead as graph ``index`` starts or plans
        (StepEvents)."""
        return self._lifetimes.results_beside(index, inputs, records)

    def saved_by_eager_code(self, inputs: Sequence[Any], model: torch.nn.Module | None) -> int:
        """What eager code of the open step saved upstream of a graph that plans (StepEvents)."""
        return self._lifetimes.saved_by_eager_code(inputs, model)

    def graph_returned(self, record: GraphRecord, outputs: Any) -> None:
        """After a graph ran: its results' backward ends the step."""
        self._lifetimes.graph_returned(record, outputs)
        tensors = [t for t in internals.tree_leaves(outputs) if isinstance(t, torch.Tensor)]
        if self._tracker.measuring:
            resident_bytes(*tensors, seen=self._counted)  # marked counted: the meter's events hold them
        self._tracker.returned([t for t in tensors if t.requires_grad])

    def abort(self) -> None:
        """Forget the step in progress (its call failed)."""
        self._tracker.abort()

    def refused(self) -> None:
        """Planning a graph of the step in progress was refused: the step is over, and a refusal made
        counting gradients resident does not refuse a step that starts without them (:meth:`begin`)."""
        self._refused_counting_gradients = self.account.gradients_resident
        self.abort()

    def stops_counting_gradients_it_lacks(self) -> bool:
        """A graph of the open step, which started without gradients, cannot be planned counting them
        resident: plan as before they were counted (whether the account changed).  A forward with
        gradients enabled between backward and ``zero_grad`` (a validation pass in ``eval()`` mode, its
        own graph) made every graph count them; the training step after it, from ``None`` gradients, was
        refused at a budget it meets.  A step that starts with them plans counting them again (:meth:`begin`)."""
        if self._state[0] or not self.replans.not_counting_gradients():
            return False
        log.info("torch.compile(backend='ckptc'): a step starts without the gradients the plans count; planning again")
        self._replanned()
        return True

    def backward_failed(self) -> None:
        """A graph's backward raised (StepEvents): the step ends unmeasured."""
        self._tracker.backward_failed()

    def _count_gradients(self, *, accumulate: bool = True) -> None:
        if self.replans.counting_gradients(accumulate_in_backward=accumulate):
            self._replanned()

    def _replanned(self) -> None:
        """The account changed: nothing is measured or verified under the new plans yet."""
        self.verified.clear()
        self.measured_peak_bytes = None

    def _count_missed(self) -> None:
        """Count what the last step measured above the budget showed the prediction missed, or refuse
        after MAX_REPLANS (at every step from then on: the budget does not hold)."""
        account = self.replans.account
        self.replans.count_measured()
        if self.replans.account is not account:
            self._replanned()

    def _uncounted(self, objects: list[Any]) -> int:
        """Bytes of ``objects`` (tensors, a module) and of their gradients resident at the start (they
        count for the whole step) that the meter's baseline does not hold yet."""
        grads = [g for a in objects if isinstance(a, torch.Tensor) and (g := gradient_of(a)) is not None]
        return resident_bytes(*objects, *grads, seen=self._counted)

    def _second_backward(self) -> None:
        """A second backward of the last step (retain_graph=True) ran with the first one's gradients."""
        if not self.account.gradients_resident:
            log.info("torch.compile(backend='ckptc'): a second backward of a step; planning again")
            self._count_gradients(accumulate=False)

    def _ended(self, measured: bool, measurement: MemoryMeasurement | None) -> None:
        if measured and self._ran and sum(r.index == self._ran[0].index for r in self._ran) > 1:
            self._first_runs_again = True  # a loop of two calls, a block run for every layer: no collecting
        outside = self._runs.outside_baseline_bytes(
            model_known=self.model is not None, gradients_resident=self._state[0]
        )
        changed = self.replans.counting_outside_baselines(outside)
        changed = self._count_repeats() or changed
        if any(r.gradients_unexpected for r in self._ran) and self.replans.counting_result_gradients():
            log.warning(
                "torch.compile(backend='ckptc'): the backward reached results of a graph other than the scalar "
                "taken for the loss (logits used by the caller's loss beside the model's own, auxiliary losses the "
                "forward stores on the module, or the model's own code after a graph break: a loss computed "
                "there); their gradients were priced as absent, so the graphs plan again counting them"
            )
            changed = True
        held = self._lifetimes.held_through_backward(self._ran)
        within = measurement is not None and measurement.peak_bytes <= self.budget_bytes
        if self.replans.observed_results(
            self._tracker.results_held, self._ran, held_bytes=held, measured_within_budget=within and not changed
        ):
            changed = True
        if changed:
            self._replanned()
        if measurement is None or changed:
            return  # planned again anyway: measured under the new plan
        peak = measurement.peak_bytes
        self.measured_peak_bytes = peak
        if peak <= self.budget_bytes:
            self.verified[self._state] += 1
            log.info("measured step peak %d bytes, within the budget of %d bytes", peak, self.budget_bytes)
            return
        predicted = max((r.result.peak_bytes for r in self._ran), default=0)
        account = self.replans.account
        counted = self.replans.measured_above_budget(measurement, self._ran, plans_again=not self.fixed_plans)
        if self.replans.account is not account:
            self._replanned()
        log.warning(
            "torch.compile(backend='ckptc'): the measured step peaked at %d bytes, above the budget of %d "
            "(predicted %d); the next call counts %s",
            peak,
            self.budget_bytes,
            predicted,
            counted,
        )

    def _count_repeats(self) -> bool:
        """A graph run several times in the step (two calls, layers compiled once): plan it for its last
        run.  Whether the account changed."""
        if self.model is None:
            return self.replans.after_run(self._ran, later_gradients_counted=False)
        return self.replans.after_run(self._ran, unnamed_gradient_bytes(self.model, self._ran))


def _device_of(args: Sequence[Any]) -> torch.device:
    for arg in args:
        if isinstance(arg, torch.Tensor):
            return arg.device
    return torch.device("cpu")


class _StepRuns:
    """The graph runs of one step, in order, with the trainable parameters each took (the real tensors
    Dynamo passes): what :attr:`StepAccount.outside_baseline_bytes` is learned from."""

    def __init__(self) -> None:
        self._runs: list[tuple[GraphRecord, frozenset[int]]] = []  # (graph, parameter ids)
        self._bytes: dict[int, int] = {}  # parameter (and gradient) bytes by parameter id

    def add(self, record: GraphRecord, args: Sequence[Any]) -> None:
        taken = [a for a in args if isinstance(a, torch.nn.Parameter) and a.requires_grad]
        self._bytes.update((id(a), allocated_bytes(a)) for a in taken)
        self._runs.append((record, frozenset(id(a) for a in taken)))

    def outside_baseline_bytes(
        self, *, model_known: bool, gradients_resident: bool = False
    ) -> dict[int, tuple[int, int]]:
        """By graph index, what the step holds beside it at its first and at its last run that its
        baseline does not count (:attr:`StepAccount.outside_baseline_bytes`; ``model_known``: the
        baselines count every parameter, and the gradients of those no run up to that one took).
        With ``gradients_resident`` (a step that starts with them: accumulation) the baselines count
        the gradients of the parameters they name, and no gradient is made later: a parameter no
        record names is held with its gradient."""
        positions: dict[int, list[int]] = {}
        for k, (record, _) in enumerate(self._runs):
            positions.setdefault(record.index, []).append(k)
        wanted = {k for ks in positions.values() for k in (ks[0], ks[-1])}
        # Parameters taken after, and up to, each wanted run: one pass each way.
        after: dict[int, set[int]] = {}
        taken_after: set[int] = set()
        for k in range(len(self._runs) - 1, -1, -1):
            if k in wanted:
                after[k] = set(taken_after)
            taken_after |= self._runs[k][1]
        everything = taken_after
        seen: set[int] = set()
        for k, (_, taken) in enumerate(self._runs):
            seen |= taken
            if k in wanted and model_known:
                after[k] &= seen

        def nbytes(ids: set[int]) -> int:
            return sum(self._bytes[i] for i in ids)

        outside = {}
        for index, ks in positions.items():
            record = self._runs[ks[-1]][0]
            named = set(record.inputs.parameters).union(*(e.inputs.parameters for e in record.earlier))
            unnamed = 0 if model_known else nbytes(everything - named)
            if gradients_resident:
                outside[index] = (2 * unnamed, 2 * unnamed)
            else:
                outside[index] = (unnamed + nbytes(after[ks[0]]), unnamed + nbytes(after[ks[-1]]))
        return outside
