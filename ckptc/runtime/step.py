"""The training step as the user writes it: tracked, measured and corrected at run time.

:class:`~ckptc.api.OptimizedModule` hands every training call to a
:class:`StepRuntime`, which

* keeps one plan per input signature (shapes, dtypes, devices) in a bounded
  LRU cache; each plan is its own ``torch.compile`` of the model with its own
  :class:`~ckptc.capture.compiler.CheckpointCompiler`, so one shape can be planned
  again without touching the others (when its account changes, its graphs plan
  again in place from Dynamo's kept graphs: no new ``torch.compile``);
* tracks the *step*: it begins with the first training call after a backward
  and ends when a backward pass that reaches the call's outputs finishes (a
  hook on the outputs queues a callback on the autograd engine).  Every graph
  run in between, of any shape and any number of calls, shares one account
  (``active``), so a second call before backward counts what the first keeps;
* measures the first step of every plan, from the start of forward to the end
  of backward (:class:`ckptc.meter.StepMeter`): the step that planned it when
  every graph planned before the first one ran (a model captured as one graph),
  from the start of that graph (planning profiles ops itself, and profilers do
  not nest), else the next step; if the peak exceeds the
  budget, the next call of that shape plans again with the measured excess
  added to every graph's baseline, at most :data:`~ckptc.planning.replan.MAX_REPLANS` times, then
  raises :class:`~ckptc.errors.BudgetExceededError` (each plan's account and what
  changed it is a :class:`ckptc.planning.replan.Replans`, the loop every path shares);
* refuses to run a training call without a plan: if no planned graph ran
  (Dynamo skipped the frame, hit its recompile limit, ...), it raises
  :class:`~ckptc.errors.UntraceableModelError` saying why and what to do.
"""

from __future__ import annotations

import dataclasses
import gc
import inspect
import itertools
import logging
import random
import sys
import weakref
from collections import Counter, OrderedDict
from typing import Any, Callable, Iterator, Sequence

import numpy
import torch

import solvers
from ckptc import _torch_internals as internals
from ckptc import distributed
from ckptc.capture import coverage
from ckptc.capture.compiler import CheckpointCompiler
from ckptc.errors import (
    BudgetExceededError,
    CkptcError,
    InvalidArgumentError,
    UnboundedSizeError,
    UntraceableModelError,
    models_own,
    release_frames,
    warn_once,
)
from ckptc.meter import MemoryMeasurement, resident_bytes, steps_to_verify
from ckptc.planning import policies
from ckptc.planning.account import StepAccount, gradients_resident, unnamed_gradient_bytes
from ckptc.planning.replan import Replans, room_needed, settle
from ckptc.records import GraphRecord
from ckptc.runtime.lengths import LengthBuckets
from ckptc.runtime.tracker import ResultLifetimes, StepEvents, StepTracker, warn_if_sparse_gradients_resident

log = logging.getLogger("ckptc.runtime.step")

MAX_DISTINCT_SIGNATURES = 256

#: What the run-time checks of earlier ``optimize`` calls learned about a model before refusing its budget,
#: by model and input signature: a later ``optimize`` of the same model (retried at the budget the refusal
#: named) starts from it (:meth:`ckptc.planning.replan.Replans.starting_from`) instead of running a step
#: over that budget to learn it again.
_LEARNED: "weakref.WeakKeyDictionary[torch.nn.Module, dict[tuple, StepAccount]]" = weakref.WeakKeyDictionary()
# New graphs for one planned shape after which a failing guard is named (train/eval, frozen or not: a few).
RECOMPILES_WARNED = 4
# Steps measured within the budget, beyond those that verify a shape's plans, that a loop which held its results
# on an earlier step is measured for while waiting for a step that holds them again; a loop that held them once
# (a first step read for a sanity check) is then no longer measured.
HELD_STEPS_AWAITED = 4


@dataclasses.dataclass
class ShapePlan:
    """The plan of one input signature and what running it taught us."""

    key: tuple
    compiler: CheckpointCompiler
    compiled: Any = dataclasses.field(repr=False)
    # The account the next plans are made under and what changed it; the compiler's account
    # differs from it when the shape must be planned again.
    replans: Replans = dataclasses.field(default_factory=lambda: Replans(StepAccount()))
    # Steps measured within the budget, by state: False (from None gradients), True (gradients resident);
    # a state is verified after ckptc.meter.steps_to_verify of them.
    steps_within_budget: Counter[bool] = dataclasses.field(default_factory=Counter)
    # Whether a step of this shape held its results through backward, and whether one that held them was
    # measured within the budget under the current plans: a loop that holds them on some steps only
    # (a metric read from the logits every few steps) is verified on such a step too.
    held_results: bool = False
    held_results_verified: bool = False
    # The measured peak of each set of the current plans' graphs a step ran (by their records' ids):
    # a step whose graphs changed (parameters frozen, then unfrozen) runs another set.
    measured_peaks: dict[frozenset[int], int] = dataclasses.field(default_factory=dict, repr=False)
    last_records: list[GraphRecord] = dataclasses.field(default_factory=list, repr=False)
    eager: coverage.EagerForward | None = dataclasses.field(default=None, repr=False)
    # How many graphs torch.compile compiled for this shape after it was planned (a guard failed), and
    # Dynamo's recompiles for tensor sizes when the first of them came (internals.size_recompiles).
    recompiled: int = 0
    size_recompiles_before: dict[str, tuple[int, str]] = dataclasses.field(default_factory=dict, repr=False)
    # Whether a call of it is planning now (plan_call): graphs compiled then are ckptc's own doing.
    planning: bool = False
    # Whether Dynamo keeps .item() and data-dependent shapes in the graph (internals.compile_config):
    # turned off, once, for a model it fails to trace with them on.
    scalar_outputs: bool = True
    # The buffers and inputs (ForwardState's keys) calls that planned changed in place; None before
    # the first: a call that plans again copies only these to put them back.
    changed_in_forward: set[str] | None = dataclasses.field(default=None, repr=False)

    @classmethod
    def first(
        cls,
        key: tuple,
        template: CheckpointCompiler,
        ranks: distributed.RankContext | None,
        *,
        gradients: bool = False,
        watch_outputs: bool = False,
    ) -> "ShapePlan":
        """A shape not planned yet, its account from ``template``'s options, this rank's extras
        (``ranks``) and whether the step starts with gradients resident; ``watch_outputs``: its steps
        will show whether the caller holds the results through backward (a training loop), so count
        them held until then where the options leave it open (:class:`~ckptc.planning.replan.Replans`;
        not for a plan file, made under ``ckptc.capture``'s choice)."""
        budget = template.options.budget_bytes
        account = StepAccount(
            budget_bytes=budget,
            gradients_resident=gradients,
            accumulate_in_backward=gradients and ranks is None,
            rank_bytes=ranks.baseline_bytes if ranks else 0,
            hold_outputs=template.options.hold_outputs,
            # Results the caller says it holds may feed its loss (an auxiliary loss on the logits).
            result_gradients=template.options.hold_outputs is True,
            defer_infeasible=budget is not None,
        )
        return cls(
            key=key,
            compiler=template,
            compiled=None,
            replans=Replans(account, watch_outputs=watch_outputs and template.plan_source is None),
        )

    @property
    def account(self) -> StepAccount:
        return self.replans.account

    @property
    def measured_peak_bytes(self) -> int | None:
        """The measured peak of a step that ran the graphs the last step ran, under the current plans
        (None until one is measured)."""
        return self.measured_peaks.get(self._graphs_ran())

    def measured(self, peak_bytes: int) -> None:
        """The last step, which ran :attr:`last_records`, measured ``peak_bytes``."""
        self.measured_peaks[self._graphs_ran()] = peak_bytes

    def _graphs_ran(self) -> frozenset[int]:
        return frozenset(id(r) for r in self.last_records)

    @property
    def planned(self) -> bool:
        """Its graphs are planned under its current account: a call runs them without planning."""
        return bool(self.compiler.records) and not self.needs_replan

    @property
    def needs_replan(self) -> bool:
        """The account changed since the current plans were made (each graph plans again, in place,
        when it next runs)."""
        planned = self.compiler.planned_account
        return planned is not None and planned != self.replans.account and not self.replans.plans_stand(planned)

    def compile(
        self,
        model: torch.nn.Module,
        template: CheckpointCompiler,
        step: list[GraphRecord],
        events: StepEvents | None = None,
    ) -> None:
        """A fresh compiler with ``template``'s options under :attr:`replans`' account, appending the
        graphs it runs to ``step`` and telling ``events`` when they plan and start, and a
        ``torch.compile`` of ``model`` with it (it plans on its next call).  Made once per shape: when
        the account changes, the graphs plan again in place."""
        # Checked where a capture is prepared, not on every call: it walks every module.
        coverage.refuse_before_capture(model)
        # A skip mark left by an earlier compile under another configuration (a plain torch.compile
        # without allow_rnn gives up on a frame it cannot resume) would run every call unplanned.
        internals.unskip_forwards(model)
        self.compiler = template.for_step(self.replans, step, events)
        self.compiled = internals.compile_module(model, self.compiler)
        self.new_plans()

    def new_plans(self) -> None:
        """The plans are made (again): nothing measured or verified under them yet."""
        self.unverified()
        self.measured_peaks = {}

    def unverified(self) -> None:
        """No step counts as verifying the plans any more (what each set of graphs measured stands)."""
        self.steps_within_budget = Counter()
        self.held_results_verified = False

    def plan_call(
        self,
        model: torch.nn.Module,
        template: CheckpointCompiler,
        step: list[GraphRecord],
        args: tuple,
        kwargs: dict,
        *,
        reference: bool = True,
        started: ForwardState | None = None,
    ) -> Any:
        """Run a call that plans (the compiler has planned nothing yet, or the account changed), again
        until the plans of its graphs fit together (:func:`ckptc.planning.replan.settle`); the graphs that ran
        are appended to ``step``.

        Graphs after a break are captured only when the forward reaches them, so an earlier graph
        is planned without knowing what later ones need, and a graph run several times (layers
        compiled once) is planned for its first run.  A compiler planning under a budget plans a
        graph that cannot fit at its lowest peak and marks it (``defer_infeasible``); the call then
        knows every graph.  When the account changes, the forward's effects on buffers, inputs and
        the random state are undone and the call runs again (each graph plans again as it runs).  ``reference``:
        also make the coverage report's reference (:class:`ckptc.capture.coverage.EagerForward`) and, when
        the call fails, run the forward eagerly to tell the model's own error (raised as it is) from a
        failure of the captured step (:class:`UntraceableModelError`).  ``started``: the caller's record of
        the call's state (versions only), told what a failed call put back (:meth:`ForwardState.put_back_by`).
        """
        known = self.changed_in_forward
        saved = ForwardState(model, copied=lambda key: known is None or key in known)
        # A forward may update its inputs in place (x.mul_(2)); a retry and the reference start from
        # the inputs as the caller gave them, so they change exactly once.
        saved.save_inputs(args, kwargs)
        self.planning = True
        try:
            return self._plan_call(model, template, step, args, kwargs, saved, reference=reference)
        except Exception:
            if started is not None:
                started.put_back_by(saved)
            raise
        finally:
            self.planning = False
            self.changed_in_forward = (known or set()) | saved.changed()

    def _plan_call(
        self,
        model: torch.nn.Module,
        template: CheckpointCompiler,
        step: list[GraphRecord],
        args: tuple,
        kwargs: dict,
        saved: ForwardState,
        *,
        reference: bool,
    ) -> Any:
        before = len(step)
        breaks_before = internals.graph_break_reasons()
        attempts = 0

        def run(account: StepAccount) -> tuple[Any, list[GraphRecord]]:
            nonlocal attempts
            if attempts:  # the account changed: undo the last attempt first
                del step[before:]
                saved.restore()
                saved.refuse_lost()
                if self.compiler.symbolic:
                    # Not planned again in place (see CheckpointCompiler).
                    self.compile(model, template, step, self.compiler.step_events)
            attempts += 1
            return run_compiled(model, self.compiled, args, kwargs, scalar_outputs=self.scalar_outputs), step[before:]

        while True:
            try:
                output = settle(run, self.replans, lambda ran: unnamed_gradient_bytes(model, ran))
                break
            except Exception as error:
                if internals.raised_running_eagerly(error, run_compiled.__name__):
                    # The model's own code raised it, running as Python (a hook rejecting a batch, say):
                    # raised as eager PyTorch raises it, not taken for a capture failure and tried again,
                    # which ran the forward again and could go on without it (one that raises only once).
                    # The buffers and random state stay as the code before the error left them, as eager's.
                    internals.unskip_forwards(model)
                    models_own(error)
                    raise
                saved.restore()  # a refused call leaves the buffers, inputs and random state as they were
                if reference and not isinstance(error, (CkptcError, MemoryError, torch.OutOfMemoryError)):
                    own = _eager_error(model, saved, args, kwargs, error)
                    if own is not None:
                        internals.unskip_forwards(model)
                        raise models_own(own) from None  # the model's own error, as eager PyTorch raises it
                if (_failed_to_trace(error) or isinstance(error, UnboundedSizeError)) and self.scalar_outputs:
                    # Dynamo fails on some models with .item() kept in the graph where plain
                    # torch.compile (which breaks the graph there) traces them, and a size read with
                    # .item() has no price (Jamba's causal mask, cache_position[-1] + 1 long): once more without.
                    log.info("capture failed with scalar outputs in the graph (%s); again with graph breaks", error)
                    release_frames(error)
                    self.scalar_outputs = False
                    del step[before:]
                    self.compile(model, template, step, self.compiler.step_events)
                    attempts = 0
                    continue
                internals.unskip_forwards(model)  # see StepRuntime._call
                if isinstance(error, CkptcError) or not reference:
                    raise
                # The forward runs eagerly on these inputs: the captured step failed, not the model.
                raise UntraceableModelError.from_exception(model, error) from error
        if reference and self.eager is None:
            self.eager = self._reference(model, saved, args, kwargs, step[before:], breaks_before)
        if self.eager is not None:
            self.eager.capture_ended(model, step[before:])
        return output

    def _reference(
        self,
        model: torch.nn.Module,
        saved: ForwardState,
        args: tuple,
        kwargs: dict,
        ran: list[GraphRecord],
        breaks_before: dict[str, int],
    ) -> coverage.EagerForward | None:
        """The coverage report's reference for this call.  A call Dynamo captured without a graph break
        is its own; after a break, the forward runs eagerly once more on the inputs as given (what
        the graphs leave out runs only there), and the buffers and random state it changes are put back.
        None where the forward cannot run that way (the report is optional, training is not)."""
        breaks = coverage.breaks_since(breaks_before)
        if not breaks:
            return coverage.EagerForward.whole(ran)
        if self.compiler.step_events is not None:
            self.compiler.step_events.planned()  # not measured across the reference run
        after = ForwardState(model)
        try:
            eager = coverage.EagerForward.measure(model, *saved.inputs_as_given(args, kwargs))
        except Exception:
            log.info(
                "no coverage report for %s: its forward did not run under ckptc's op counter",
                type(model).__name__,
                exc_info=True,
            )
            return None
        finally:
            after.restore()
        eager.breaks = breaks
        return eager


class StepRuntime:
    """Runs training calls of one model under one budget (see the module docstring).

    Args:
        model: the model being trained.
        template: the compiler whose options every plan uses.
        verify: measure the first step of every plan and correct it.
        max_plans: how many input signatures keep their plan (LRU).
    """

    def __init__(
        self, model: torch.nn.Module, template: CheckpointCompiler, *, verify: bool = True, max_plans: int = 8
    ) -> None:
        if isinstance(max_plans, bool) or not isinstance(max_plans, int) or max_plans < 1:
            raise InvalidArgumentError(f"max_plans must be a positive integer, got {max_plans!r}")
        self.model = model
        self.template = template
        self.verify = bool(verify)
        self.max_plans = max_plans
        self.plans: OrderedDict[tuple, ShapePlan] = OrderedDict()
        self.signatures_seen: set[int] = set()
        # Shapes refused after steps of them ran, and whether that refusal counted gradients resident (_forget).
        self._refused: dict[tuple, tuple[BaseException, bool]] = {}
        self.active: list[GraphRecord] = []  # every graph run in the current step, in order
        self.last: ShapePlan | None = None
        self._tracker = StepTracker(self._end_step, self._second_backward)
        self._lifetimes = ResultLifetimes()  # of the current step's graphs' results
        self._step_plans: list[ShapePlan] = []
        self._step_keys: list[tuple] = []
        self._step_compiled = False
        self._pending: BaseException | None = None
        self._step_state = False  # whether the current step began with gradients resident
        self._step_inputs: tuple[tuple, dict] | None = None  # the open step's first call's inputs
        self.lengths = LengthBuckets()
        self.ranks: distributed.RankContext | None = None  # set on the first call (DDP wraps after optimize)
        self._ranks_known = False
        self._last_new_plan: tuple[dict[str, int | float], tuple] | None = None  # see _warn_if_only_numbers_changed
        self._bucketed_call: ForwardState | None = None  # see _call

    # -- public ----------------------------------------------------------------
    @property
    def compiler(self) -> CheckpointCompiler:
        """The compiler of the most recently used plan (the template before any call)."""
        return self.last.compiler if self.last is not None else self.template

    def step_records(self) -> list[GraphRecord]:
        """Graphs of the current (or last) step, in the order they ran."""
        return list(self.active)

    def call(self, args: tuple, kwargs: dict) -> Any:
        """One training call of the model under its plan (its length bucket's, see :mod:`ckptc.runtime.lengths`)."""
        try:
            try:
                return self._call(args, kwargs)
            except Exception as error:
                before = self._bucketed_call
                if not self.lengths.fall_back(error):
                    raise
                if before is None or before.changed():
                    # Its forward ran (a later call of the step was refused after it) and changed buffers or
                    # inputs in place: run again, they would change twice.
                    raise
                before.restore()  # the random state: run again, it draws what it drew (dropout masks)
                return self._call(args, kwargs)  # the same call, planned for its exact sizes
            finally:
                self._bucketed_call = None  # it holds the call's inputs
        except CkptcError as refusal:
            # ckptc's frames in the traceback hold the refusal (a reference cycle): the step's earlier
            # calls' results, and their activations, would outlive the caller's handling of it, until the
            # garbage collector runs, and the step would stay open.
            release_frames(refusal)
            raise

    def _call(self, args: tuple, kwargs: dict) -> Any:
        if self._pending is not None:
            error, self._pending = self._pending, None
            raise error
        self._refuse_dispatch_modes()
        self._refuse_checkpoint_region()
        breaks = internals.graph_breaks_found()
        if self._tracker.results_died():
            self._tracker.end(measured=False)  # the last step's results died without a backward
        elif self._tracker.backward_raised():
            self._tracker.abort()  # the last step's backward raised: this call begins a new step
        opened = not self._tracker.open
        if not self._ranks_known:
            self.ranks, self._ranks_known = distributed.rank_context(self.model), True
        if opened:
            self._step_keys = []
        # A second call before backward gets its own plan, made while the first
        # call's graphs are in the step's account (what they keep is counted).
        called = _as_called(self.model, args, kwargs)
        signature = self.lengths.key(*called, _signature(*called) + (_model_signature(self.model),))
        if self.lengths.last_bucket is not None:
            # A bucket that cannot be planned runs the call again for its exact sizes (``call``): what the
            # call changes, to run it as it was (versions only, no copy).
            self._bucketed_call = ForwardState(self.model, copied=lambda key: False)
            self._bucketed_call.save_inputs(args, kwargs)
        key = (signature, self._step_keys.count(signature))
        self._step_keys.append(signature)
        if key not in self.plans and key not in self._refused:
            self._warn_if_only_numbers_changed(args, kwargs)
        # A later call of the step runs in the step's state: its backward runs with the gradients the
        # step started with resident, as the first call's does.
        resident = gradients_resident(self.model) if opened else self._step_state  # walks every parameter
        shape = self._plan_for(key, gradients=resident)
        if opened:
            self._count_measured()
            self._begin_step(args, kwargs, shape, resident)
        elif self._tracker.measuring:
            self._tracker.add_baseline(resident_bytes(args, kwargs))
        if shape not in self._step_plans:
            self._step_plans.append(shape)
        self.last = shape
        before = len(self.active)
        was_planned = shape.planned
        try:
            try:
                output = self._run(shape, args, kwargs)
            except solvers.InfeasibleBudgetError as error:
                refusal = shape.replans.refusal(error)
                if refusal is error:
                    if len(self.signatures_seen) > 1:  # which of the shapes seen does not fit
                        error.message = f"{error.message}\nThe call planned: inputs {_describe_inputs(args, kwargs)}."
                        error.args = (error.message,)
                    raise
                # Planning again with the measured excess counted no longer fits.
                self._forget(shape, refusal)
                raise refusal from error
            except BudgetExceededError as error:  # the same, found where a graph plans again in place
                self._forget(shape, error)
                raise
            if not self.active[before:] and _needs_no_gradient(output):
                # Nothing it returned needs a gradient (no trainable parameter reached it, as after
                # merging LoRA adapters): there is no backward, so nothing to checkpoint or measure.
                log.info("%s's call returned nothing that requires grad: ran as is", type(self.model).__name__)
                if opened:
                    self._tracker.abort()
                return output
            refuse_unplanned(self.model, self.active[before:], shape.eager, output)
            if was_planned:
                self._refuse_late_infeasible(shape, self.active[before:])
            if not opened:
                self._account_for_earlier_calls(shape, self.active[before:], planned=not was_planned)
        except BaseException:
            # A failed call returned nothing: its graphs are no earlier graphs of a call made next (the
            # same call planned for its exact sizes, say).
            del self.active[before:]
            # Dynamo marks a frame that raised to be skipped from then on (every later call would run
            # without a plan); a call that plans and tries again after a failure leaves the mark alone.
            internals.unskip_forwards(self.model)
            if opened:
                self._tracker.abort()
            raise
        # More references than ``output`` and getrefcount's argument, after a graph break met in this call:
        if sys.getrefcount(output) > 2 and internals.graph_breaks_found() > breaks:
            # Dynamo meets a graph break by raising and catching an exception while it compiles: its traceback
            # holds the frames of the call (ckptc's and Dynamo's, finished by now), which keep their locals
            # (this call's results among them) in a reference cycle until the garbage collector runs.  The
            # results outlived the caller's loop (told as the last step's results): collected now, on a call
            # that met a graph break and whose results something else holds (a full collection, 0.1 s in a
            # large process: on every call that compiled, it put the suite at 845 s).
            gc.collect()
        returned = [t for t in _tensors_in(output) if t.requires_grad]
        if not returned:
            self._warn_once(
                "no-outputs",
                f"ckptc: {type(self.model).__name__} returned no tensor that requires grad where ckptc looks "
                f"(a {type(output).__name__}; it looks in tensors, tuples, lists, dicts, dataclasses and objects' "
                "attributes), so it cannot tell when the step's backward ends: the step is not measured and the "
                "budget is not verified. What to do: return the loss or the outputs as tensors, or in one of those "
                "containers.",
            )
        self._tracker.returned(returned)
        return output

    def _warn_if_only_numbers_changed(self, args: tuple, kwargs: dict) -> None:
        """Warn once when a call needs a new plan only because an int or float argument changed value:
        torch.compile specializes its graph on such values, so each one is captured and planned anew."""
        numbers, rest = _numbers_and_rest(args, kwargs)
        previous, self._last_new_plan = self._last_new_plan, (numbers, rest)
        if previous is None or previous[1] != rest:
            return
        changed = [
            f"{name} {previous[0][name]!r} -> {value!r}"
            for name, value in numbers.items()
            if name in previous[0] and previous[0][name] != value
        ]
        if changed:
            self._warn_once(
                "number-arguments",
                f"ckptc: {type(self.model).__name__} was called with {', '.join(changed)} and otherwise the same "
                "inputs. torch.compile specializes its graph on the value of an int or float argument, so ckptc "
                "captures and plans the step again for every new value (seconds to minutes each; beyond "
                f"{self.max_plans} values the oldest plans are forgotten and made again). What to do: pass an "
                "argument that changes between steps as a tensor (torch.tensor(value)), or keep it constant.",
            )

    def _account_for_earlier_calls(self, shape: ShapePlan, ran: list[GraphRecord], *, planned: bool) -> None:
        """After a call of ``shape`` that ran the graphs ``ran`` after earlier calls of the same step (the
        model called again before one backward: siamese, contrastive), whose plans were made before this
        call was seen (``planned``: this call planned).

        Its backward runs before theirs, so their backwards run with the parameters' gradients made: they
        count gradients resident, and return theirs at their end as usual (both calls' gradients of a
        parameter meet in the autograd engine's buffer, summed when the last of them arrives, and reach
        ``.grad`` only then: nothing is resident in ``.grad`` to add into).  A graph of this call
        that could not fit beside what they keep ran at its floor
        (:meth:`~ckptc.planning.replan.Replans.after_run`): they plan again keeping less, once their
        plans count what they hold.  Either way this call plans again after them, and a step predicted
        over the budget is said to be."""
        earlier = self._step_plans[: self._step_plans.index(shape)]
        recounted = [
            s for s in earlier if s.replans.counting_gradients(accumulate_in_backward=False, summed_by_autograd=True)
        ]
        short = [r for r in ran if r.infeasible] if planned else []
        budget = self.template.budget_bytes
        if short and budget is not None:
            need = room_needed(short, budget)
            for call in earlier:
                if call in recounted:  # plans again counting the gradients: room is made from those plans
                    call.replans.make_room_when_planning_again(need)
                    continue
                mine = {id(r) for r in call.compiler.records}
                call.replans.make_room_for_later_calls(need, [r for r in self.active if id(r) in mine])
        if not (recounted or short):
            return
        log.info("a later call of the step ran after earlier calls' plans: they plan again, then it does")
        shape.replans.planning_after_earlier_calls_again()
        predicted = max((r.result.peak_bytes for r in short), default=0)
        if budget is not None and predicted > budget:
            self._warn_once(
                "later-call",
                f"ckptc: {type(self.model).__name__} was called again before backward (several calls in one "
                "step), and the plans of the step's earlier calls, made before ckptc saw this one, leave it too "
                f"little of the budget of {budget} bytes: this step runs it at its lowest peak, predicted "
                f"{predicted} bytes ({predicted - budget} bytes over the budget). The next steps plan the earlier "
                "calls again to leave it room, and the first step under the new plans is measured as usual.",
            )

    def _refuse_late_infeasible(self, shape: ShapePlan, ran: list[GraphRecord]) -> None:
        """A graph torch.compile compiled anew in a call of a planned shape (a guard changed) that
        cannot fit beside the step's other plans was run at its floor: forget the shape's plans, so
        the next call plans the whole step again (or refuses it), and say so."""
        late = [r for r in ran if r.infeasible]
        if not late or not shape.planned:
            return
        self.plans.pop(shape.key, None)
        self._warn_once(
            "late-infeasible",
            f"ckptc: torch.compile compiled a new graph of {type(self.model).__name__} in the middle of "
            "training (one of its guards changed: a module attribute, a parameter's dtype or device), and "
            f"that graph needs more than the budget of {self.template.budget_bytes} bytes leaves it beside "
            "the step's other plans; this step ran it at its lowest peak and may exceed the budget. The "
            "next call plans the whole step again (or raises InfeasibleBudgetError naming the floor).",
        )

    # -- the compiler's events (ckptc.runtime.tracker.StepEvents) -------------------
    def planned(self, new_graph: bool = False) -> None:
        """A graph of the open step plans (again) now: planning profiles ops (scratch memory) with its
        own torch.profiler session, and profilers do not nest, so the step is not measured across it
        (:meth:`graph_starts` may measure it from its first graph's start)."""
        self._step_compiled = True
        self._tracker.unmeasured()
        if self.last is not None and self.last.planned and not self.last.planning:
            # torch.compile compiled a new graph for a shape planned before (one of its guards
            # changed; not ckptc planning the call again, which compiles anew where sizes are
            # symbolic): the next step runs graphs not measured yet, so it is measured.  What steps of
            # the other graphs measured stands (their plans did not change).
            self.last.unverified()
            # Only graphs torch.compile compiles anew after the shape's first step count: within it,
            # code shared by several callers (an encoder's and a decoder's layers) compiles once per
            # caller, and graphs planned again in place are no recompiles.
            if not (new_graph and self.last.last_records):
                return
            self.last.recompiled += 1
            if self.last.recompiled == 1:
                self.last.size_recompiles_before = internals.size_recompiles()
            if self.last.recompiled == RECOMPILES_WARNED:
                self._warn_once("recompiles", self._recompiles_message(self.last))

    def _recompiles_message(self, shape: ShapePlan) -> str:
        """Why graphs keep compiling for inputs of one shape: a size made inside forward that depends on
        the data (Dynamo's failed guards say so), or else a guard on Python state."""
        head = (
            f"ckptc: torch.compile compiled {type(self.model).__name__}'s step again {RECOMPILES_WARNED} times "
            "for inputs of the same shapes, and ckptc plans every new graph (seconds each)"
        )
        before = {where: count for where, (count, _) in shape.size_recompiles_before.items()}
        grown = {
            where: (count - before.get(where, 0), reason)
            for where, (count, reason) in internals.size_recompiles().items()
            if count > before.get(where, 0)
        }
        if grown:
            where, (_, reason) = max(grown.items(), key=lambda item: item[1][0])
            return (
                f"{head}: a frame inside forward ({where}, after a graph break) keeps compiling again for new "
                f"sizes of a tensor it is given ({reason}), a size that depends on the data, such as a "
                "mixture of experts' tokens per expert run expert by expert. ckptc compiles exact sizes, so "
                "steps that compile are not measured, and the budget stays unverified while new sizes come. "
                "What to do: train with torch.compile(model, backend='ckptc', options=...), where Dynamo makes "
                "such sizes dynamic after their second value and ckptc plans and verifies them, or use an "
                "implementation whose expert loop does not break the graph."
            )
        return (
            f"{head}: a guard on Python state keeps failing (a module attribute changed in forward, such as a "
            "call counter, a global, a flag toggled between steps, or a Python number or string inside the "
            "inputs that forward reads, such as a batch dict's scale). What to do: run with "
            "TORCH_LOGS=recompiles to see the guard, then keep that state in a tensor (a buffer, or "
            "torch.tensor(value) in the batch) or out of forward."
        )

    def graph_starts(self, record: GraphRecord, args: Sequence[Any]) -> None:
        """A graph of the open step starts.  When the step planned before any of its graphs ran (the
        first call of a shape whose model is one graph, or its graphs planned again from the first),
        the step is measured from here: nothing it holds was allocated yet beyond what the baseline
        counts, so this is the measurement of the whole step, made on the step that planned instead
        of the one after it (which then runs verified plans, or plans again with the excess counted).
        Not a step whose meter stopped when it planned (:class:`~ckptc.runtime.tracker.StepTracker`)."""
        if self.active or not self._step_compiled or not self._tracker.open or self._tracker.measuring:
            return
        if self._step_inputs is not None and self.last is not None:
            self._measure(self.last, *self._step_inputs)

    def graph_returned(self, record: GraphRecord, outputs: Any) -> None:
        """A graph of the open step returned ``outputs``."""
        self._lifetimes.graph_returned(record, outputs)
        self._tracker.results_of_a_graph([t for t in internals.tree_leaves(outputs) if isinstance(t, torch.Tensor)])

    def results_beside(
        self, index: int, inputs: Sequence[Any], records: Sequence[GraphRecord]
    ) -> list[tuple[GraphRecord, int, int]]:
        """How many runs of earlier graphs have their results dead as graph ``index`` starts or plans
        (StepEvents)."""
        return self._lifetimes.results_beside(index, inputs, records)

    def backward_failed(self) -> None:
        """A graph's backward raised (StepEvents): the step ends unmeasured."""
        self._tracker.backward_failed()

    def saved_by_eager_code(self, inputs: Sequence[Any], model: torch.nn.Module | None) -> int:
        """What the open step's eager code saved upstream of a graph that plans (StepEvents)."""
        return self._lifetimes.saved_by_eager_code(inputs, model)

    def _refuse_dispatch_modes(self) -> None:
        """torch.compile runs no compiled graph under a dispatch mode (FlopCounterMode): refuse before
        Dynamo sees the call (it would skip the frame and fall back to eager without a plan)."""
        modes = internals.dispatch_modes_disabling_compile()  # offline capture's FakeTensorMode is not one
        if modes:
            raise UntraceableModelError(
                f"ckptc could not run the training step of {type(self.model).__name__} under a plan: it "
                f"was called under {', '.join(modes)} (a torch dispatch mode), and torch.compile runs "
                "no compiled graph under a dispatch mode, so nothing would be checkpointed and the "
                "budget would not hold.\nWhat to do: count FLOPs on the model without ckptc (a copy, "
                "or model.original_module), or use torch.profiler(with_flops=True) around ckptc's step."
            )

    def _refuse_checkpoint_region(self) -> None:
        """A non-reentrant ``torch.utils.checkpoint`` region around the call drops what it saves for backward
        and runs it again in backward: refuse before planning (Dynamo failed inside it, naming its own state)."""
        if internals.inside_checkpoint_region():
            raise UntraceableModelError(
                f"ckptc could not run the training step of {type(self.model).__name__} under a plan: it was "
                "called inside a torch.utils.checkpoint region (use_reentrant=False), which drops what the call "
                "saves for backward and runs the call again during backward, so neither what ckptc's plan keeps "
                "nor the memory it budgets would be what runs.\nWhat to do: remove the checkpoint around the "
                "optimized module (ckptc decides what it recomputes, within the budget), or optimize the whole "
                "model with ckptc instead of this part of it."
            )

    def _run(self, shape: ShapePlan, args: tuple, kwargs: dict) -> Any:
        if shape.planned:
            return run_compiled(self.model, shape.compiled, args, kwargs, scalar_outputs=shape.scalar_outputs)
        if shape.compiler.symbolic:
            self._compile(shape)  # symbolic sizes are not planned again in place: a new torch.compile
        shape.new_plans()
        before = len(self.active)
        try:
            # No reference forward under DDP/FSDP2: it would run collectives and leave FSDP2 expecting a backward.
            output = shape.plan_call(
                self.model,
                self.template,
                self.active,
                args,
                kwargs,
                reference=self.ranks is None,
                started=self._bucketed_call,
            )
        except solvers.InfeasibleBudgetError as error:
            self._forget(shape, error)  # no half-made plan stays behind
            raise
        self._check_patterns(self.active[before:])
        return output

    # -- plans -----------------------------------------------------------------
    def _forget(self, shape: ShapePlan, refusal: BaseException) -> None:
        """Drop ``shape``'s plans after ``refusal``.  Once steps of it ran (a measured step's
        :class:`BudgetExceededError`, or any refusal after a step of it ended), what they showed stands:
        a later call of the shape raises the refusal again rather than planning afresh without that
        evidence (which would run a step over the budget before refusing again).  A refusal counting
        gradients resident (accumulation, ``zero_grad(set_to_none=False)``) does not refuse a step that starts
        without them, as its message suggests: that step plans afresh from what was measured."""
        self.plans.pop(shape.key, None)
        if shape.last_records or isinstance(refusal, BudgetExceededError):
            self._refused[shape.key] = (refusal, shape.account.gradients_resident)
            _LEARNED.setdefault(self.model, {})[shape.key] = shape.account

    def _plan_for(self, key: tuple, *, gradients: bool) -> ShapePlan:
        """The plan of ``key``, planned again once if this step starts with gradients resident
        and the plan counted none (a plan counting them also serves steps from None gradients).

        Raises:
            BudgetExceededError, solvers.InfeasibleBudgetError: ``key`` was refused after steps of it ran.
        """
        refusal, with_gradients = self._refused.get(key, (None, False))
        if refusal is not None and (gradients or not with_gradients):
            raise refusal.with_traceback(None)
        shape = self.plans.get(key)
        if shape is None:
            digest = hash(key)
            if digest not in self.signatures_seen and len(self.signatures_seen) >= MAX_DISTINCT_SIGNATURES:
                raise UntraceableModelError(
                    f"{type(self.model).__name__} was called with more than {MAX_DISTINCT_SIGNATURES} distinct "
                    "input shapes; each new shape is captured and planned again, and torch.compile stops "
                    "compiling after its recompile limit (the step would then run without a plan).\n"
                    "What to do: pad or bucket inputs to a few shapes (for example sequence lengths rounded "
                    "up to a multiple of 64)."
                )
            self.signatures_seen.add(digest)
            shape = ShapePlan.first(key, self.template, self.ranks, gradients=gradients, watch_outputs=True)
            learned = _LEARNED.get(self.model, {}).get(key)
            if learned is not None and self.template.plan_source is None:
                shape.replans.starting_from(learned)
            self._compile(shape)
            self.plans[key] = shape
            while len(self.plans) > self.max_plans:
                evicted_key, evicted = self.plans.popitem(last=False)
                log.info("forgetting the plan of input signature %s (max_plans=%d)", evicted_key, self.max_plans)
        else:
            self.plans.move_to_end(key)
            if gradients and shape.replans.counting_gradients(accumulate_in_backward=self.ranks is None):
                log.info("step starts with gradients resident (accumulation): planning again counting them")
        return shape

    def _compile(self, shape: ShapePlan) -> None:
        shape.compile(self.model, self.template, self.active, self)

    # -- steps -----------------------------------------------------------------
    def _begin_step(self, args: tuple, kwargs: dict, shape: ShapePlan, gradients: bool) -> None:
        """Open a step of ``shape`` (``gradients``: it starts with gradients resident)."""
        self._tracker.begin()
        self._lifetimes.begin()
        self._lifetimes.warn_if_last_step_held(self, (self.model, args, kwargs), stacklevel=7)
        if gradients:
            warn_if_sparse_gradients_resident(self, self.model.parameters(), stacklevel=7)
        self.active.clear()
        self._step_plans = []
        self._step_compiled = False
        self._step_state = gradients
        self._step_inputs = (args, kwargs)
        # Not a step that plans (again): planning profiles ops itself, and profilers do not nest.
        if shape.planned:
            self._measure(shape, args, kwargs)

    def _measure(self, shape: ShapePlan, args: tuple, kwargs: dict) -> None:
        """Measure the open step from now on unless ``shape``'s plans are verified in its state (gradients
        resident or not: :func:`ckptc.meter.steps_to_verify` steps within the budget; where a step held the
        results through backward, also one that held them, or :data:`HELD_STEPS_AWAITED` more steps); ``args``,
        ``kwargs``: the inputs of its first call."""
        device = _device_of(self.model)
        within = shape.steps_within_budget[self._step_state]
        verified = within >= steps_to_verify(device) and (
            shape.held_results_verified
            or not shape.held_results
            or within >= steps_to_verify(device) + HELD_STEPS_AWAITED
        )
        if not self.verify or self.template.budget_bytes is None or verified:
            return
        if internals.profiler_active() and device.type == "cpu":
            self._warn_once(
                "profiler",
                "ckptc cannot verify this step's peak memory while torch.profiler runs (profilers do not "
                "nest); the step runs on the predicted plan. Verification resumes on a later step.",
            )
            return
        baseline = resident_bytes(self.model, args, kwargs) + (self.ranks.resident_bytes if self.ranks else 0)
        self._tracker.measure(device, baseline)

    def _count_measured(self) -> None:
        """Before a step begins: what the last step measured above the budget showed its plans missed is
        counted (they plan again on their next call), or refused after the replans are used up."""
        for shape in self._step_plans:  # the last step's: _begin_step starts the new list
            try:
                shape.replans.count_measured()
            except BudgetExceededError as error:
                self._forget(shape, error)
                raise

    def _second_backward(self) -> None:
        """A backward of a step that already ended its first: plan again counting the gradients."""
        for shape in self._step_plans:  # the ended step's: the tracker reports this before the next begins
            if shape.replans.counting_gradients(accumulate_in_backward=False):
                log.info("a second backward of the step ran with the first one's gradients: planning again")

    def _end_step(self, measured: bool, measurement: MemoryMeasurement | None) -> None:
        """The step ended (:class:`~ckptc.runtime.tracker.StepTracker`): ``measured``, a backward ended it
        undisturbed; ``measurement``, its peak when it was measured."""
        self._step_inputs = None  # the step's batch is the caller's to free
        if self.ranks is not None and measured and (self._step_compiled or measurement is not None):
            # Steps that plan or are measured: every rank checks that all ran the same plans and
            # decides from the largest peak of any rank (steady-state steps add no collective).
            try:
                agreed = self.ranks.agree(self.active, None if measurement is None else measurement.peak_bytes)
            except distributed.DistributedPlanMismatchError as error:
                log.error("%s", error)
                self._pending = error
                return
            if measurement is not None and agreed is not None:
                measurement = dataclasses.replace(measurement, peak_bytes=agreed)
        for shape in self._step_plans:
            mine = {id(r) for r in shape.compiler.records}
            shape.last_records = [r for r in self.active if id(r) in mine]
        self._check_gradient_assumption()
        budget = self.template.budget_bytes
        held_by_shape: dict[int, bool] = {}
        for shape in self._step_plans:
            held_bytes = self._lifetimes.held_through_backward(shape.last_records)
            held_by_shape[id(shape)] = bool(self._tracker.results_held) or any(held_bytes.values())
            shape.held_results |= held_by_shape[id(shape)]
            shape.replans.observed_results(
                self._tracker.results_held,
                shape.last_records,
                loss_bytes=None if measurement is None else measurement.loss_bytes,
                held_bytes=held_bytes,
                measured_within_budget=measurement is not None and (budget is None or measurement.peak_bytes <= budget),
            )
        if measurement is None:
            return
        peak = measurement.peak_bytes
        for shape in self._step_plans:
            shape.measured(peak)
        if budget is None or peak <= budget:
            for shape in self._step_plans:
                shape.steps_within_budget[self._step_state] += 1
                shape.held_results_verified |= held_by_shape[id(shape)]
            log.info("measured step peak %d bytes, within the budget of %s bytes", peak, budget)
            return
        predicted = max((r.result.peak_bytes for r in self.active), default=0)
        counted = "nothing more"
        for shape in self._step_plans:
            if shape.needs_replan:
                # Planned again anyway (its results turned out to be held): measured again under that plan.
                counted = "what changed in the step (held results, gradients), then measures it again"
                continue
            counted = shape.replans.measured_above_budget(measurement, self.active)
        log.warning(
            "ckptc: the measured training step of %s peaked at %d bytes, %d bytes above the budget of %d bytes "
            "(predicted %d bytes); the next call plans again counting %s.",
            type(self.model).__name__,
            peak,
            peak - budget,
            budget,
            predicted,
            counted,
        )

    def _check_gradient_assumption(self) -> None:
        """A plan of a graph computing its own loss priced its other results' gradients as absent
        (:mod:`ckptc.rewrite.unused_grads`); if the loss used them after all, plan again counting them."""
        if not any(r.gradients_unexpected for r in self.active):
            return
        changed = [s for s in self._step_plans if s.replans.counting_result_gradients()]
        if changed:
            self._warn_once(
                "unused-grads",
                f"ckptc: {type(self.model).__name__}'s forward makes a scalar that ckptc took for its loss "
                "(`.loss`, a scalar result, or one it stores on the module, such as an auxiliary loss), but the "
                "backward also reached its other results (logits, hidden states, auxiliary outputs: used by the "
                "caller's loss, or by the model's own code after a graph break); the plan had priced their "
                "gradients as absent, so the next call plans again with them held until backward ends and their "
                "gradients counted.",
            )

    def _check_patterns(self, ran: list[GraphRecord]) -> None:
        """Warn once per pattern of ``must_save``/``must_recompute`` that matches nothing in the step."""
        policies.warn_unmatched_patterns(
            self.model, type(self.model).__name__, [r.joint_problem for r in ran], self.template.options
        )

    def _warn_once(self, key: str, message: str) -> None:
        warn_once(self, key, message, stacklevel=6)  # past _warn_once, call(), _call()


# -- helpers -----------------------------------------------------------------
def run_compiled(
    model: torch.nn.Module, compiled: Any, args: tuple, kwargs: dict, *, scalar_outputs: bool = True
) -> Any:
    """Run ``torch.compile``'s module on a call, with ckptc's own errors surfaced, not Dynamo's wrappers
    (``scalar_outputs``: see :func:`ckptc._torch_internals.compile_config`)."""
    with internals.compile_config(scalar_outputs=scalar_outputs):
        try:
            return compiled(*args, **kwargs)
        except Exception as error:
            if isinstance(error, internals.BackendCompilerFailed):
                # Our own backend raised (an infeasible budget, a plan that does
                # not match): surface that error, not Dynamo's wrapper.
                inner = getattr(error, "inner_exception", None)
                if inner is None:
                    raise UntraceableModelError.from_exception(model, error) from error
                if isinstance(inner, CkptcError):
                    raise inner from None
                # Anything else failing inside capture or planning: one error family, the cause chained.
                raise UntraceableModelError.from_exception(model, inner) from inner
            if isinstance(error, internals.DynamoError) and not isinstance(error, CkptcError):
                raise UntraceableModelError.from_exception(model, error) from error
            raise


def _eager_error(
    model: torch.nn.Module, saved: ForwardState, args: tuple, kwargs: dict, error: Exception
) -> Exception | None:
    """The error the forward run eagerly on the inputs as given raises, where it is ``error``'s (its type,
    and its message, which Dynamo extends with "from user code: ..." where it traced the line): then it is
    the model's own error, not the capture's, and the buffers and random state stay as that eager run left
    them, as after eager PyTorch's call (a later step draws eager's dropout masks).  None otherwise, with
    them put back (``saved``)."""
    try:
        coverage.EagerForward.measure(model, *saved.inputs_as_given(args, kwargs))
    except Exception as eager_error:
        if type(eager_error) is type(error) and str(error).startswith(str(eager_error)):
            return eager_error
    saved.restore()
    return None


def _failed_to_trace(error: BaseException) -> bool:
    """Whether a planning call failed inside Dynamo's or AOTAutograd's tracing, not in ckptc's
    planning (a budget, a plan file) or the device (out of memory)."""
    if isinstance(error, (MemoryError, torch.OutOfMemoryError)):
        return False
    if isinstance(error, UntraceableModelError):
        return error.__cause__ is not None and not isinstance(error.__cause__, CkptcError)
    return not isinstance(error, CkptcError)


def refuse_unplanned(
    model: torch.nn.Module, ran: list[GraphRecord], eager: coverage.EagerForward | None, output: Any = None
) -> None:
    """Refuse a training call that ran without a planned graph, or left an RNN to eager code.

    Raises:
        InvalidArgumentError: no graph ran and nothing the call returned (``output``) requires grad.
        UntraceableModelError: saying why and what to do.
    """
    coverage.refuse_uncaptured(model, ran, eager)
    if not ran and _needs_no_gradient(output):
        raise InvalidArgumentError(
            f"{type(model).__name__}'s call returned nothing that requires grad: no trainable parameter (and no "
            "input that requires grad) reaches its outputs, so there is no backward to plan. What to do: "
            "call it with the parameters it trains in use (unmerged adapters, say), or set requires_grad on "
            "the parameters it uses."
        )
    if not ran and eager is not None and eager.breaks:
        reason = eager.breaks[0][0].rstrip(".")
        raise UntraceableModelError(
            f"ckptc could not run the training step of {type(model).__name__} under a plan: "
            "torch.compile ran the call without any captured graph, so nothing would be checkpointed and the "
            f"budget would not hold. Dynamo gave up on the forward at a graph break: {reason}.\n"
            "What to do: remove that construct from the forward (TORCH_LOGS=graph_breaks shows its line), "
            "or train without ckptc."
        )
    if not ran and internals.dynamo_disabled():
        raise UntraceableModelError(
            f"ckptc could not run the training step of {type(model).__name__} under a plan: torch.compile is "
            "turned off in this process (TORCH_COMPILE_DISABLE=1, or torch._dynamo.config.disable = True), so "
            "Dynamo captured no graph, nothing would be checkpointed and the budget would not hold.\n"
            "What to do: unset TORCH_COMPILE_DISABLE (ckptc captures the step through Dynamo), or train without ckptc."
        )
    if not ran:
        raise UntraceableModelError(
            f"ckptc could not run the training step of {type(model).__name__} under a plan: "
            "torch.compile ran the call without any captured graph (Dynamo skipped the frame, "
            "for example after reaching its recompile limit, or the forward is wrapped in "
            "torch.compiler.disable), so nothing would be checkpointed and the budget would not hold.\n"
            "What to do: run the step with TORCH_LOGS=recompiles,graph_breaks to see why; keep the "
            "number of distinct input shapes small (pad or bucket them); or train without ckptc."
        )


def _generators_of(model: torch.nn.Module) -> list[torch.Generator]:
    """The ``torch.Generator`` objects the model's modules hold as attributes (or in a list, tuple or dict
    attribute)."""
    found: dict[int, torch.Generator] = {}
    for module in model.modules():
        for value in vars(module).values():
            items = (
                value.values() if isinstance(value, dict) else value if isinstance(value, (list, tuple)) else (value,)
            )
            for item in items:
                if isinstance(item, torch.Generator):
                    found.setdefault(id(item), item)
    return list(found.values())


class ForwardState:
    """What a forward pass may change outside its results: buffers (running
    statistics), the call's input tensors and the random state.  Saved before a call that plans, so
    the call can run again as if the first attempt never happened, and around
    :func:`ckptc.plan`'s trial step.

    A copy of every buffer and input is memory the user's step holds while it plans (an image
    batch's copy put one step 8% above its budget), so ``copied`` (a key: ``"buffer:<name>"`` or
    ``"input:<position>"``) may leave out those no earlier forward of the same call changed; a
    forward that then changes one cannot be run again and :meth:`restore` says so.
    """

    def __init__(self, model: torch.nn.Module, copied: Callable[[str], bool] = lambda key: True) -> None:
        self.copied = copied
        # key -> [tensor, version when saved or restored, its value or None (not copied)]: only a
        # tensor that changed is written back, so a buffer another call's graph saved for backward
        # (position ids) keeps its version and that backward still runs.
        self.saved: dict[str, list[Any]] = {}
        seen: set[int] = set()
        for name, buffer in model.named_buffers():
            self._save(f"buffer:{name}", buffer, seen)
        self.versions_at_start = {key: entry[1] for key, entry in self.saved.items()}
        self.cpu_rng = torch.random.get_rng_state()
        self.cuda_rng = torch.cuda.get_rng_state_all() if torch.cuda.is_initialized() else None
        # A forward may draw from numpy's or Python's generators too (a SpecAugment mask): a call run
        # again must draw what it drew the first time.
        self.numpy_rng = numpy.random.get_state()
        self.python_rng = random.getstate()
        # A module's own torch.Generator (noise drawn with generator=self.gen) too: left advanced by the
        # first attempt, every later step drew other numbers than eager's, without a word.
        self.generators = {id(g): (g, g.get_state()) for g in _generators_of(model)}

    def _save(self, key: str, tensor: torch.Tensor, seen: set[int]) -> None:
        if id(tensor) in seen:
            return
        seen.add(id(tensor))
        value = tensor.detach().clone() if self.copied(key) else None
        self.saved[key] = [tensor, internals.version_counter(tensor), value]

    def save_inputs(self, args: tuple, kwargs: dict) -> None:
        """Also put back the call's input tensors that a forward updates in place (their version
        counter tells which did).  Inputs that require grad are left alone: autograd refuses in-place
        updates of leaves, and restoring a non-leaf would not undo its recorded history."""
        seen = {id(entry[0]) for entry in self.saved.values()}
        for position, leaf in enumerate(internals.tree_leaves((args, kwargs))):
            if isinstance(leaf, torch.Tensor) and not leaf.requires_grad:
                self._save(f"input:{position}", leaf, seen)
            elif isinstance(leaf, torch.Generator):
                self.generators.setdefault(id(leaf), (leaf, leaf.get_state()))
        self.versions_at_start = {key: entry[1] for key, entry in self.saved.items()}

    def put_back_by(self, other: ForwardState) -> None:
        """Count the tensors ``other`` put back (:meth:`restore`) as unchanged since this state was saved.

        ``other`` saved them at the versions this state did and holds copies: its restore wrote their
        values back through ``.data``, which leaves the versions the forward moved, so the versions alone
        (all this state keeps when it copies nothing) would call them changed.  A tensor changed again
        after the restore still counts as changed.
        """
        for key, (tensor, version, value) in other.saved.items():
            mine = self.saved.get(key)
            if (
                mine is not None
                and mine[0] is tensor
                and value is not None
                and other.versions_at_start[key] == self.versions_at_start[key]
                and internals.version_counter(tensor) == version
            ):
                self.versions_at_start[key] = version

    def changed(self) -> set[str]:
        """The keys of the buffers and inputs changed in place since they were saved."""
        return {key for key in self.saved if self._differs(key, self.versions_at_start[key])}

    def _differs(self, key: str, version: int) -> bool:
        """Whether ``key``'s tensor changed since it had ``version``: an eager kernel may update a
        buffer without moving its version (BatchNorm's running statistics), so a copied value is
        compared too."""
        tensor, _, value = self.saved[key]
        if internals.version_counter(tensor) != version:
            return True
        if value is None or internals.is_storeless(tensor) or tensor.layout != torch.strided:
            return False  # no values to compare (torch.equal takes no sparse tensor)
        return not torch.equal(tensor, value)

    def inputs_as_given(self, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        """Copies of the call's inputs with the values they had when saved (a reference forward's
        in-place updates stay in the copies).

        Raises:
            UntraceableModelError: an input changed in place was not copied.
        """
        self.refuse_lost()
        given = {id(tensor): value for tensor, _, value in self.saved.values() if value is not None}

        def copy(leaf: Any) -> Any:
            if isinstance(leaf, torch.Tensor) and id(leaf) in given:
                return given[id(leaf)].clone()
            return _detached_copy(leaf)

        return internals.tree_map(copy, (args, kwargs))

    def restore(self) -> None:
        """Put back what the forward changed, except the values not copied (:meth:`refuse_lost`)."""
        with torch.no_grad():
            for key, entry in self.saved.items():
                tensor, version, value = entry
                if value is not None and self._differs(key, version):
                    # Through ``.data``: the version stays, as the eager kernel that changed the value
                    # (BatchNorm) may have saved the tensor for a backward still to run.  A tensor the
                    # forward resized (a quantization observer's min/max, empty until its first call)
                    # gets its old shape back with its value.
                    if tensor.shape == value.shape and tensor.stride() == value.stride():
                        tensor.data.copy_(value)
                    else:
                        tensor.data = value.clone()
                    entry[1] = internals.version_counter(tensor)
        torch.random.set_rng_state(self.cpu_rng)
        if self.cuda_rng is not None:
            torch.cuda.set_rng_state_all(self.cuda_rng)
        numpy.random.set_state(self.numpy_rng)
        random.setstate(self.python_rng)
        for generator, state in self.generators.values():
            generator.set_state(state)

    def refuse_lost(self) -> None:
        """Raise if a buffer or input changed in place since it was saved was not copied.

        Raises:
            UntraceableModelError: saying which and what to do.
        """
        lost = [
            key
            for key, (tensor, version, value) in self.saved.items()
            if value is None and internals.version_counter(tensor) != version
        ]
        if lost:
            raise UntraceableModelError(
                "ckptc had to run a training call again while planning it (its graphs' plans changed while it ran), "
                f"but its forward changed {', '.join(lost)} in place, which earlier calls of this shape "
                "left unchanged, so ckptc kept no copy: those changes stay, made once by this call's forward. "
                "Later calls of this shape keep a copy while they plan. What to do: call again with the inputs as "
                "they should be (put the changed buffers back if they matter), or make the forward leave its inputs "
                "and buffers unchanged, or train without ckptc."
            )


def _detached_copy(leaf: Any) -> Any:
    """A copy of an input tensor for a reference forward (so its in-place updates stay there)."""
    if not isinstance(leaf, torch.Tensor):
        return leaf
    return leaf.detach().clone().requires_grad_(leaf.requires_grad)


def _device_of(model: torch.nn.Module) -> torch.device:
    for p in model.parameters():
        return p.device
    return torch.device("cpu")


def _needs_no_gradient(output: Any) -> bool:
    """Whether no tensor in a call's ``output`` requires grad: no backward can run through it."""
    return not any(t.requires_grad for t in _tensors_in(output))


def _tensors_in(obj: Any, depth: int = 0) -> Iterator[torch.Tensor]:
    """Tensors in a model output: nested tuples, lists, dicts (ModelOutput), dataclasses and plain
    objects' attributes (``types.SimpleNamespace``, a class of the model's own)."""
    if depth > 6:
        return
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, dict):
        for v in obj.values():
            yield from _tensors_in(v, depth + 1)
    elif isinstance(obj, (list, tuple)):
        for v in obj:
            yield from _tensors_in(v, depth + 1)
    elif dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        for f in dataclasses.fields(obj):
            yield from _tensors_in(getattr(obj, f.name, None), depth + 1)
    elif not isinstance(obj, (type, torch.nn.Module)) and isinstance(getattr(obj, "__dict__", None), dict):
        for v in list(vars(obj).values()):
            yield from _tensors_in(v, depth + 1)


def _model_signature(model: torch.nn.Module) -> int:
    """The dtypes and devices of ``model``'s parameters and buffers and the hooks on its modules, hashed:
    after ``model.double()`` or ``.to(device)`` every activation changes size, and a hook added after
    a graph was traced would not run in it (torch.compile does not guard on module hooks), so a plan
    made before does not apply."""
    tensors = itertools.chain(model.parameters(), model.buffers())
    return hash((tuple((t.dtype, t.device) for t in tensors), internals.module_hooks(model)))


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _numbers_and_rest(args: tuple, kwargs: dict) -> tuple[dict[str, int | float], tuple]:
    """A call's int and float arguments by name (top level), and the signature of everything else."""
    numbers = {f"argument {i}": a for i, a in enumerate(args) if _is_number(a)}
    numbers.update({f"{k}=": v for k, v in kwargs.items() if _is_number(v)})
    rest = _signature(
        tuple("<number>" if _is_number(a) else a for a in args),
        {k: "<number>" if _is_number(v) else v for k, v in kwargs.items()},
    )
    return numbers, rest


def _describe_inputs(args: tuple, kwargs: dict) -> str:
    """The call's top-level tensors as ``name (sizes) dtype``, for messages."""
    named = [(f"argument {i}", a) for i, a in enumerate(args)] + list(kwargs.items())
    parts = [
        f"{name} {tuple(t.shape)} {str(t.dtype).removeprefix('torch.')}"
        for name, t in named
        if isinstance(t, torch.Tensor)
    ]
    return ", ".join(parts) or "without tensors at the top level"


def _as_called(model: torch.nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    """``args`` and ``kwargs`` bound to ``model.forward``'s parameters, by name in their order (what a
    ``**kwargs`` parameter collects after them, by sorted name): the same call spelled positionally or by
    keyword, in any order, with a default or without it, runs one compiled frame and selects one plan.  A call
    that does not bind (eager raises for it) is left as it is."""
    try:
        signature = inspect.signature(model.forward)
        parameters, bound = signature.parameters, signature.bind(*args, **kwargs)
    except (TypeError, ValueError):
        return args, kwargs
    bound.apply_defaults()  # ``fast(x)`` is ``fast(x, gate=None)``
    named: dict[str, Any] = {}
    for name, value in bound.arguments.items():
        kind = parameters[name].kind
        if kind is inspect.Parameter.VAR_POSITIONAL:
            named.update((f"*{name}[{i}]", v) for i, v in enumerate(value))
        elif kind is inspect.Parameter.VAR_KEYWORD:
            named.update(sorted(value.items()))
        else:
            named[name] = value
    return (), named


def _signature(args: tuple, kwargs: dict) -> tuple:
    """What selects a plan: structure, shapes, dtypes, devices of the inputs, autocast, and the values of
    the call's own Python numbers, strings and flags.  Such values inside a container (a batch dict's
    example id, a list of names) count by type only: the model rarely reads them, and each new value
    would otherwise be captured and planned afresh, its first step unverified (a per-batch id kept every
    step 1.23x over the budget); where forward reads one, torch.compile guards on it and compiles again,
    and that graph is planned in place."""
    leaves, spec, top_level = internals.call_leaves(args, kwargs)
    described: list[Any] = [str(spec)]
    for leaf, own in zip(leaves, top_level, strict=True):
        if isinstance(leaf, torch.Tensor):
            described.append((tuple(leaf.shape), leaf.dtype, leaf.device, leaf.requires_grad))
        elif own and isinstance(leaf, (int, float, bool, str, type(None))):
            described.append(leaf)
        else:
            described.append(type(leaf).__name__)
    described.append(tuple(torch.is_autocast_enabled(d) for d in ("cpu", "cuda")))
    return tuple(described)
