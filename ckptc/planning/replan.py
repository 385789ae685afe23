"""The one replan loop: what a step shows its plans did not count becomes the account of the next plans.

A step is planned graph by graph, each graph under the step's
:class:`~ckptc.planning.account.StepAccount`.  What the whole step turns out to hold is
only known once its graphs ran (or were decided) together, and a measured step
can show more still.  :class:`Replans` holds the account of one step's plans and
turns each kind of evidence into the next account, within fixed limits:

* a graph that could not fit after earlier graphs' plans (``infeasible``):
  earlier graphs get tighter budgets of their own (:func:`tighter_graph_budgets`,
  at most :data:`MAX_STEP_RETRIES` times per planning run), searched back up while the
  step fits with room left (:meth:`Replans._loosened`);
* a graph run several times in the step (identical layers compiled once, a
  model called twice): count what earlier runs leave alive at its last run
  (:meth:`~ckptc.planning.account.StepAccount.counting_repeats`, at most
  :data:`MAX_STEP_RETRIES` times per planning run);
* a measured step above the budget: count what the prediction missed when the
  next step begins, at most :data:`MAX_REPLANS` times, then
  :class:`~ckptc.errors.BudgetExceededError` (unless the same step changed the
  account first: its new plans are measured again, not corrected on top);
* gradients resident while the step runs (accumulation, a second backward),
  results whose gradients the loss turned out to use, and what a measured step's loss
  held between forward and backward where its peak was;
* whether the caller holds the forward's results (logits) through backward: a
  training loop's first plans count them held, since ``out = model(**batch);
  out.loss.backward()`` and ``loss = model(**batch).loss; loss.backward()`` look the
  same to the graphs; a step whose results died before its backward ended lets them
  go (:meth:`Replans.observed_results`).

:func:`settle` is the loop itself, for paths that can run (or decide) a step
again at once: :class:`ckptc.planning.planner.CapturedStep` (deciding captured graphs
under a new budget) and a call of :class:`ckptc.runtime.step.StepRuntime` that plans.
Evidence seen only later (a measured step, a second backward) reaches the same
:class:`Replans` from :class:`ckptc.runtime.step.StepRuntime` and from the
``torch.compile`` backend's check (:class:`ckptc.runtime.watch.BackendStepCheck`); their
next call plans under the new account.
"""

from __future__ import annotations

import dataclasses
import logging
from collections import Counter
from typing import Callable, Iterable, Mapping, Sequence, TypeVar

import solvers
from ckptc.errors import BudgetExceededError, release_frames
from ckptc.meter import MemoryMeasurement
from ckptc.planning.account import StepAccount, budget_for_planning_floor
from ckptc.records import GraphRecord

log = logging.getLogger("ckptc.planning.replan")

#: How many times one planning run tightens earlier graphs' budgets, and counts repeated graphs again.
MAX_STEP_RETRIES = 2
#: How many times a plan is made again with a measured excess counted before the budget is refused.
MAX_REPLANS = 3
#: How many planning runs search tightened graph budgets back up (:meth:`Replans._loosened`).
LOOSENING_TRIALS = 3


@dataclasses.dataclass
class _Loosening:
    """A bisection over graph budgets from ``tight`` (0: where the step fits) towards ``loose`` (1: the
    graphs' budgets, or peaks, in the last run where a later graph did not fit)."""

    tight: dict[int, int]
    loose: dict[int, int]
    fits: float = 0.0
    fails: float = 1.0
    at: float = 0.0
    trials: int = 0

    def budgets(self, at: float) -> dict[int, int]:
        return {j: b + int(at * max(0, self.loose[j] - b)) for j, b in self.tight.items()}


T = TypeVar("T")


class Replans:
    """The account a step's plans are made under, and the evidence that changed it (module docstring).

    Args:
        account: the account of the first plans, the step's budget in it (None: no limit, nothing
            to correct).
        watch_outputs: the caller did not say whether it holds the forward's results through
            backward (``hold_outputs=None``) and its steps will show it (a training loop): count
            them held until then (:attr:`StepAccount.outputs_assumed_held`, :meth:`observed_results`).

    Attributes:
        account: the account the next plans are made under.
        replans: how many measured excesses were counted.
        over_budget_peak_bytes: the last measured peak above the budget (0 before one).
    """

    def __init__(self, account: StepAccount, *, watch_outputs: bool = False) -> None:
        if watch_outputs and account.hold_outputs is None:
            account = account.replace(hold_outputs=True, outputs_assumed_held=True)
        self.account = account
        self.replans = 0
        self.over_budget_peak_bytes = 0
        # A measured excess not counted yet: peak, the graphs of its step, whether they can plan again.
        self._measured: tuple[int, tuple[GraphRecord, ...], bool] | None = None
        self._tightened = 0
        self._repeats = 0
        # Graphs' budgets (or peaks) in the last run of this planning run that did not fit, and the search
        # back up from the budgets that fit (_loosened).
        self._did_not_fit: dict[int, int] = {}
        self._loosening: _Loosening | None = None
        self._budgets_at_start: Mapping[int, int] = account.graph_budgets  # this planning run's, as it began
        # The account the last run's plans were judged under (after_run): a step that changed it since starts
        # a new planning run.
        self._judged_under: StepAccount | None = None
        # Only a planning run (settle) plans again at once; under the backend each trial would be a step.
        self._plans_at_once = False
        self._room_made = 0  # times later calls of the step asked these graphs to keep less
        # Bytes a later call of the step needs these graphs to keep less, asked while they plan again for
        # another reason (counting that call's gradients): applied to the plans made for that reason.
        self._room_pending = 0
        self._fewest_dead: dict[tuple[int, int], int] = {}  # see observed_results_let_go
        # Plans made under the first account that stand under the second (see plans_stand).
        self._standing: tuple[StepAccount, StepAccount] | None = None
        # Plans made under the first account that stand under the second where none made again fits
        # (see keeps_measured_plans).
        self._measured_plans: tuple[StepAccount, StepAccount] | None = None

    #: What steps showed that an account carries on to a later ``optimize`` of the same model
    #: (:meth:`starting_from`): measured evidence, not the budget, the gradients' state or the
    #: decisions made from them (graph budgets, room left to later calls).
    EVIDENCE = (
        "correction_bytes",
        "hold_outputs",
        "result_gradients",
        "outputs_assumed_held",
        "loss_bytes",
        "eager_bytes_after",
        "eager_saved_before",
        "results_let_go",
        "repeat_bytes",
        "repeat_runs",
        "outside_baseline_bytes",
    )

    def starting_from(self, learned: StepAccount) -> None:
        """Start from what the steps of an earlier ``optimize`` of the same model showed (``learned``,
        the account it refused a budget under): the budget that refusal named then holds from the first
        verified step, instead of running a step over it to learn the same again."""
        self.account = self.account.replace(**{name: getattr(learned, name) for name in self.EVIDENCE})
        log.info("starting from what an earlier optimize of this model measured (%d bytes)", learned.correction_bytes)

    @property
    def budget_bytes(self) -> int | None:
        """The step's budget (:attr:`StepAccount.budget_bytes`): no replan changes it."""
        return self.account.budget_bytes

    def __repr__(self) -> str:
        return f"Replans(budget={self.budget_bytes}, replans={self.replans}, account={self.account})"

    def new_planning_run(self) -> None:
        """A new planning run begins (a call that plans, a plan under a new budget): its retries start at 0."""
        self._tightened = self._repeats = 0
        self._did_not_fit, self._loosening = {}, None
        self._plans_at_once = True
        self._budgets_at_start = self.account.graph_budgets

    def after_run(
        self, ran: Sequence[GraphRecord], unnamed_gradient_bytes: int = 0, *, later_gradients_counted: bool = True
    ) -> bool:
        """After the graphs ``ran`` (in run order) under :attr:`account`: whether the step must be
        planned again (the account changed).  Earlier graphs are first asked to keep less for a graph
        that did not fit, then repeats are counted: counted first, they can leave the first graph
        unable to fit at its floor (its earlier runs keeping what the tighter budgets would not), a
        refusal where keeping less fits.  ``later_gradients_counted``: whether the graphs' baselines
        count the gradients later graphs make (:meth:`StepAccount.counting_repeats`).

        A run under an account that a step changed since the last run was judged (resident gradients,
        held results, a measured excess) begins a new planning run: its retries start over.  The backend's
        check judges every step here and never starts one otherwise (``settle`` does, for each call that
        plans): its earlier graphs were asked, on the first change after one retry, to keep as little as
        they can (a GPT-2 split by a graph break, under accumulation at its halfway budget: its first graph
        recomputed all of its forward, 5,200,064 FLOPs, where leaving the later graph room for its floor
        recomputes 2,196,736).

        Raises:
            solvers.InfeasibleBudgetError: a graph cannot fit even with earlier graphs keeping as
                little as they can (the message gives the step's floor), or the retries are used up.
        """
        if self._judged_under is not None and self.account != self._judged_under:
            self.new_planning_run()
        try:
            return self._judged(ran, unnamed_gradient_bytes, later_gradients_counted)
        finally:
            self._judged_under = self.account

    def _judged(self, ran: Sequence[GraphRecord], unnamed_gradient_bytes: int, later_gradients_counted: bool) -> bool:
        if self._room_pending and not any(r.infeasible for r in ran):
            need, self._room_pending = self._room_pending, 0
            self.make_room_for_later_calls(need, ran)
            return True
        if any(r.infeasible for r in ran):
            assert self.budget_bytes is not None  # only a budget makes graphs infeasible
            if self._loosening is not None and self._loosening_failed():
                return True
            if any(r.joint_problem.droppable_output_bytes for r in ran):
                if self._let_results_go_for_room():
                    return True  # planned again before earlier graphs are asked to keep less
            if self._left_to_earlier_calls(ran):
                return False  # run at its floor; the step runtime asks earlier calls to keep less
            try:
                budgets = tighter_graph_budgets(ran, self.budget_bytes, self._tightened, self.account.graph_budgets)
            except solvers.InfeasibleBudgetError as error:
                if "What to do" in str(error):
                    raise
                # Say what the step holds beyond a plain one: the results another graph made (logits before a
                # loss a graph break splits off) weigh in the floor although the graph refused holds none.
                raise self.account.explained_refusal(
                    error,
                    "; its floor counts what the step holds beyond its graphs' activations",
                    sum(r.held_output_bytes for r in ran),
                ) from None
            # Where the graphs stood in this run, which did not fit: their budgets, or their peaks where
            # they had none (the upper end of the search back up, _loosened).
            peaks = {r.index: r.result.peak_bytes for r in ran}
            self._did_not_fit = {j: self.account.graph_budgets.get(j, peaks.get(j, b)) for j, b in budgets.items()}
            self._tightened += 1
            self.account = self.account.replace(graph_budgets=budgets)
            log.info("a later graph did not fit after earlier graphs' plans; earlier graphs keep less: %s", budgets)
            return True
        if self._repeats < MAX_STEP_RETRIES:
            counted = self.account.counting_repeats(
                ran, unnamed_gradient_bytes, later_gradients_counted=later_gradients_counted
            )
            if counted is not self.account:
                self._repeats += 1
                newly = set(counted.repeat_runs) - set(self.account.repeat_runs)
                self.account = counted
                log.info(
                    "graphs %s run several times in a step: planned for their last run", sorted(counted.repeat_runs)
                )
                if newly and self._tightened and self._plans_at_once and self._loosening is None:
                    self._tightened_before_repeats()
                elif newly and self._tightened and not self._plans_at_once:
                    self._budgets_counting_repeats(newly, ran)
                return True
        return self._loosened(ran)

    def _budgets_counting_repeats(self, newly: set[int], ran: Sequence[GraphRecord]) -> None:
        """Graph budgets of graphs ``newly`` found to run several times, set before their earlier runs were
        counted (under the backend, where starting over costs a step run unmeasured per planning run), raised
        by what those runs keep under the plan that fit the budget: that plan still fits it beside them,
        and the search for the size each run keeps starts from there (a 6-layer GPT-2 with a break in every
        block, at 0.6 of its range under the backend: 9.6% of the step recomputed, as at its floor, now 2.3%)."""
        latest = {r.index: r for r in ran}
        raised = {
            j: budget + self.account.repeat_runs[j].get(j, 0) * latest[j].step_bytes
            for j, budget in self.account.graph_budgets.items()
            if j in newly and j in latest and self.account.repeat_runs[j].get(j, 0)
        }
        if raised:
            log.info("budgets of graphs run several times raised by what their earlier runs keep: %s", raised)
            self.account = self.account.replace(graph_budgets={**self.account.graph_budgets, **raised})

    def _tightened_before_repeats(self) -> None:
        """Graph budgets this planning run tightened before it knew that some graphs run several times
        were sized for peaks that count none of their earlier runs; with those runs counted, each such
        budget asks far less of the graph (a block compiled once for six layers of GPT-2, a break in the
        layer loop, kept as little as it could at any budget: 21% recompute at 0.9 of the range where
        one graph recomputes 0.1%).  The run starts over from the budgets it began with, repeats counted.
        Only within :func:`settle`: under the backend each planning run is a step run unmeasured."""
        log.info("graph budgets tightened before repeated graphs were counted: tightened again with them counted")
        self.account = self.account.replace(graph_budgets=self._budgets_at_start)
        self._tightened = 0
        self._did_not_fit = {}

    def _loosened(self, ran: Sequence[GraphRecord]) -> bool:
        """After a step whose graphs all fit: whether to plan again with graph budgets tightened in this
        planning run loosened, where the step leaves room.

        Tightening lowers each earlier graph's peak by its share of what a later graph lacked, and a
        graph's kept bytes fall faster than its peak: a tiny XGLM (a graph per layer, its head's graph
        short of room) kept 6 of 27 values per layer and recomputed 18.4% of the step at 80% of its
        budget.  So the budgets are searched back up by bisection, from each graph's peak under the plan
        that fits towards its budget (or peak) in the last run that did not (:data:`LOOSENING_TRIALS`
        trials, each a planning run; a trial that does not fit goes back to the last that did).  Only
        within :func:`settle`, which plans again at once: the backend's plans change one step at a time,
        and each trial would be a step run unmeasured."""
        assert all(not r.infeasible for r in ran)
        search = self._loosening
        if search is None:
            if not self._tightened or not self._plans_at_once or self.budget_bytes is None:
                return False
            # From where each graph's plan stands (a budget below its floor plans the same as its floor's
            # peak) up to where the step did not fit.
            peaks = {r.index: r.result.peak_bytes for r in ran}
            tight = {j: max(b, peaks.get(j, b)) for j, b in self.account.graph_budgets.items()}
            loose = {j: self._did_not_fit.get(j, b) for j, b in tight.items()}
            if all(loose[j] <= b for j, b in tight.items()):
                return False
            search = self._loosening = _Loosening(tight, loose)
        else:
            search.fits = search.at
        room = self.budget_bytes - max(r.result.peak_bytes for r in ran)
        if search.trials >= LOOSENING_TRIALS or room <= self.budget_bytes // 100:
            return False
        return self._loosening_trial((search.fits + search.fails) / 2)

    def _loosening_failed(self) -> bool:
        """A loosening trial did not fit: whether the step plans again (a narrower trial, or the budgets
        that fit); False where the budgets that fit no longer do (the search ends)."""
        search = self._loosening
        assert search is not None
        if search.at == search.fits:
            self._loosening = None
            return False
        search.fails = search.at
        if search.trials >= LOOSENING_TRIALS:
            self._set_loosened(search.fits)
            return True
        return self._loosening_trial((search.fits + search.fails) / 2)

    def _loosening_trial(self, at: float) -> bool:
        search = self._loosening
        assert search is not None
        search.trials += 1
        self._repeats = 0  # the trial's plans keep more: what earlier runs of a graph keep is counted again
        self._set_loosened(at)
        log.info(
            "graphs keep less than the step's budget allows: their budgets loosened to %s", self.account.graph_budgets
        )
        return True

    def _set_loosened(self, at: float) -> None:
        search = self._loosening
        assert search is not None
        search.at = at
        self.account = self.account.replace(graph_budgets={**self.account.graph_budgets, **search.budgets(at)})

    def _left_to_earlier_calls(self, ran: Sequence[GraphRecord]) -> bool:
        """Whether only graphs of earlier calls of the step (a model called twice before one backward)
        can keep less for the first graph of ``ran`` that did not fit, and keeping less there can make
        it fit: nothing before it in this call, or less than it needs even if those graphs kept
        nothing; and the step's floor within the budget, or earlier calls counted results held that
        they may let go (their floor is then lower than the records say).  Those calls' graphs ran
        already, so this call runs at its floor and the step runtime asks them to keep less in the
        next step (:meth:`make_room_for_later_calls`), where a floor still above the budget is refused
        naming the floor with what the caller was seen to hold."""
        assert self.budget_bytes is not None
        mine = {id(r) for r in ran}
        if max(r.min_feasible_bytes for r in ran) > self.budget_bytes and not any(
            e.joint_problem.droppable_output_bytes for r in ran for e in r.earlier if id(e) not in mine
        ):
            return False
        # In the order the graphs ran: a graph compiled again (a guard failed) has a later index.
        position = next(i for i, r in enumerate(ran) if r.infeasible)
        if position == 0:
            return True
        first = ran[position]
        after_earlier_calls = any(id(e) not in mine for e in first.earlier)
        room_here = sum(r.step_bytes for r in ran[:position])  # each run keeps its own
        return after_earlier_calls and room_here < room_needed([first], self.budget_bytes)

    def make_room_for_later_calls(self, need: int, ran: Sequence[GraphRecord]) -> None:
        """A later call of the step (the model called again before one backward) could not fit beside
        what this plan's graphs ``ran`` keep: they plan again keeping ``need`` bytes less, and the second
        time as little as they can.

        Raises:
            solvers.InfeasibleBudgetError: asked :data:`MAX_STEP_RETRIES` times already.
        """
        assert self.budget_bytes is not None
        if self._room_made >= MAX_STEP_RETRIES:
            raise solvers.InfeasibleBudgetError(
                self.budget_bytes,
                None,
                "ckptc could not make the calls of this step (the model called again before one backward) fit "
                f"together in {solvers.format_bytes(self.budget_bytes)} ({self.budget_bytes} bytes) after "
                f"{MAX_STEP_RETRIES} retries with the earlier calls keeping less. What to do: give a few percent "
                "more budget, or run one backward per call.",
            )
        indices = sorted({r.index for r in ran})
        budgets = _budgets_keeping_less(
            ran, indices, need, self.budget_bytes, self._room_made, self.account.graph_budgets
        )
        self._room_made += 1
        self._measured = None
        self.account = self.account.replace(graph_budgets={**self.account.graph_budgets, **budgets})
        log.info("a later call of the step did not fit beside this call's plans; its graphs keep less: %s", budgets)

    def make_room_when_planning_again(self, need: int) -> None:
        """As :meth:`make_room_for_later_calls`, for graphs that plan again anyway under an account a
        step changed (:meth:`counting_gradients`: the later call's backward runs before theirs): the
        budgets that keep ``need`` bytes less are set from the plans made under that account, in the same
        planning run, so the step after the one that found the later call short fits it (budgets from the
        plans before, which the new account may change, would wait for one more step to run it short)."""
        self._room_pending = max(self._room_pending, need)

    def planning_after_earlier_calls_again(self) -> None:
        """The step's earlier calls plan again (:meth:`make_room_for_later_calls`): this call's graphs,
        whose baselines count what those keep, plan again after theirs."""
        self._measured = None
        self.account = self.account.replace(earlier_calls_planned=self.account.earlier_calls_planned + 1)

    def measured_above_budget(
        self, measurement: MemoryMeasurement, ran: Sequence[GraphRecord], *, plans_again: bool = True
    ) -> str:
        """A step of the graphs ``ran`` under the current plans measured ``measurement``, its peak above
        the budget; returns what the next plans count, in words.

        If the peak was reached while the caller's loss ran between forward and backward, what the
        loss held there is priced there at once (:meth:`counting_loss`).  Otherwise what the
        prediction missed is counted for the whole step when the next step begins
        (:meth:`count_measured`), unless the account changes first for something the same step
        showed (a second backward's gradients, results held through backward): the new plans are
        then measured again rather than corrected on top of a correction that may cover the same
        bytes.  ``plans_again=False``: the graphs keep their plans (a backend's graphs with symbolic
        sizes), so the excess is refused when the next step begins.
        """
        peak_bytes = measurement.peak_bytes
        assert self.budget_bytes is not None and peak_bytes > self.budget_bytes
        self.over_budget_peak_bytes = peak_bytes
        loss = measurement.loss_bytes
        if plans_again and measurement.peak_in_loss and loss and self.counting_loss(loss):
            return (
                f"the {loss} bytes the loss held between forward and backward (a loss computed outside the "
                "model, or code run eagerly after the last graph)"
            )
        # Eager code between graphs is priced where it runs whether or not the peak was there: a budget
        # that fits this step's plans with the excess counted flat must also fit plans that keep more
        # before that code (as a retried budget's do).
        if plans_again and self.counting_eager_code(measurement.eager_after) and measurement.peak_after is not None:
            held = measurement.eager_after[measurement.peak_after]
            return f"the {held} bytes eager code held after graph {measurement.peak_after} (a graph break's)"
        self._measured = (peak_bytes, tuple(ran), plans_again)
        if not plans_again:
            return "nothing: graphs with symbolic sizes keep their plans, so the next call raises BudgetExceededError"
        return f"the {missed_bytes(peak_bytes, self.budget_bytes, ran)} bytes the prediction missed"

    def count_measured(self) -> None:
        """Before a step begins: count what the last step measured above the budget showed its plans
        missed (:meth:`measured_above_budget`), if nothing changed the account since, or refuse it
        when its graphs cannot plan again.

        What the prediction missed (eager code between graphs, allocator effects) is counted in
        full: correcting by the excess over the budget alone under-counts whenever the plan did
        not fill the budget, and the loop would creep.

        Raises:
            BudgetExceededError: :data:`MAX_REPLANS` corrections were counted already.
        """
        if self._measured is None:
            return
        peak_bytes, ran, plans_again = self._measured  # kept while refused: every later step is refused too
        assert self.budget_bytes is not None
        missed = missed_bytes(peak_bytes, self.budget_bytes, ran)
        if self.replans >= MAX_REPLANS or not plans_again:
            floor = max((r.min_feasible_bytes for r in ran), default=self.budget_bytes)
            # Never below the measured peak: a larger budget's plans keep at least as much, and a budget
            # retried is planned without the excess counted (a new account), so any budget under what this
            # step measured fails again (an eager backward's temporary between graphs, corrected flat,
            # named a budget below the one refused: 11,103,077 B refused naming 10,129,571 B).
            suggested = max(floor + missed, peak_bytes)
            if not plans_again:
                advice = f"give a budget of at least {suggested} bytes, "
                what_to_do = (
                    "and torch.compile(backend='ckptc') cannot plan again a graph with symbolic sizes "
                    "(dynamic=True, Dynamo's automatic dynamic shapes once a second input size ran, such as a "
                    "smaller last batch, or sizes that depend on data): its plan was priced at the sizes it was "
                    f"compiled with. What to do: {advice}compile with dynamic=False (each input size then gets a "
                    "plan of its own; or drop the last partial batch), or train through ckptc.optimize, which "
                    "plans such a step again with the excess counted.  Sizes that depend on the data (tokens "
                    "routed to experts) stay symbolic with dynamic=False: if the step holds what a fresh plan "
                    "does not count (gradients resident under accumulation, the model called twice), every "
                    "budget named is refused again up to the unoptimized peak; train that loop through "
                    "ckptc.optimize."
                )
                raise BudgetExceededError(peak_bytes, self.budget_bytes, suggested, self.replans, what_to_do)
            raise BudgetExceededError(peak_bytes, self.budget_bytes, suggested, self.replans)
        self._measured = None
        self.replans += 1
        self.account = self.account.replace(correction_bytes=self.account.correction_bytes + missed)

    def counting_gradients(self, *, accumulate_in_backward: bool, summed_by_autograd: bool = False) -> bool:
        """Gradients are resident while the step runs (whether the account changed);
        ``summed_by_autograd``: see :attr:`StepAccount.gradients_summed_by_autograd`."""
        if self.account.gradients_resident:
            return False
        self._measured = None
        self._room_made = 0
        self.account = self.account.replace(
            gradients_resident=True,
            accumulate_in_backward=accumulate_in_backward,
            gradients_summed_by_autograd=summed_by_autograd,
            graph_budgets={},
        )
        return True

    def not_counting_gradients(self) -> bool:
        """Plan as before gradients were counted resident (whether the account changed): a step starts
        without them after plans counting them were refused (a loop that zeroed in place once, then sets
        them to None, as the refusal suggests)."""
        if not self.account.gradients_resident:
            return False
        self._measured = None
        self._room_made = 0
        self.account = self.account.replace(
            gradients_resident=False, accumulate_in_backward=False, gradients_summed_by_autograd=False, graph_budgets={}
        )
        return True

    def counting_outside_baselines(self, outside: Mapping[int, tuple[int, int]]) -> bool:
        """A step showed, by graph index, what it holds beside the graph at its first and last run that
        its baseline does not count (:attr:`StepAccount.outside_baseline_bytes`): count it, never less
        than counted before (whether the account changed)."""
        counted = dict(self.account.outside_baseline_bytes)
        for index, (first, last) in outside.items():
            was = counted.get(index, (0, 0))
            if first > was[0] or last > was[1]:
                counted[index] = (max(first, was[0]), max(last, was[1]))
        if counted == self.account.outside_baseline_bytes:
            return False
        self._measured = None
        self.account = self.account.replace(outside_baseline_bytes=counted)
        return True

    def counting_eager_code(self, after: Mapping[int, int]) -> bool:
        """A measured step showed what eager code between graphs held after each graph's forward
        (:attr:`StepAccount.eager_bytes_after`): count it there, never less than counted before
        (whether the account changed).  A flat correction, if the same step asks for one, is still
        counted (:meth:`count_measured`)."""
        counted = dict(self.account.eager_bytes_after)
        for index, nbytes in after.items():
            if nbytes > counted.get(index, 0):
                counted[index] = nbytes
        if counted == self.account.eager_bytes_after:
            return False
        self.account = self.account.replace(eager_bytes_after=counted)
        return True

    def counting_loss(self, nbytes: int) -> bool:
        """A measured step's caller held ``nbytes`` for its loss between forward and backward, where
        its peak was (:attr:`ckptc.meter.MemoryMeasurement.loss_bytes`): price them there (whether
        the account changed).  Counted in place of the step's excess, which they explain."""
        if nbytes <= self.account.loss_bytes:
            return False
        self._measured = None
        self.account = self.account.replace(loss_bytes=nbytes)
        return True

    def counting_result_gradients(self) -> bool:
        """The loss used results besides the model's own loss: count them held and their gradients as
        tensors (whether the account changed)."""
        account = self.account
        if account.result_gradients and account.hold_outputs is True and not account.outputs_assumed_held:
            return False
        self._measured = None
        self.account = account.replace(hold_outputs=True, result_gradients=True, outputs_assumed_held=False)
        return True

    def observed_results(
        self,
        held: bool | None,
        ran: Sequence[GraphRecord],
        loss_bytes: int | None = None,
        held_bytes: Mapping[int, int] | None = None,
        *,
        measured_within_budget: bool = False,
    ) -> bool:
        """A step of the graphs ``ran`` showed whether its caller held the forward's results until its
        backward ended (``held``; None: no backward showed it); whether the plans must be made again.

        Results only assumed held (:attr:`StepAccount.outputs_assumed_held`) that died are let go:
        graphs computing their own loss plan again with them dropped after forward.  A single graph
        whose results feed the caller's loss (``loss = loss_fn(model(x), y)``) plans again with them
        dropped once the caller's loss has run, their gradients arriving in backward, when the step
        was measured (``loss_bytes``: what the caller's loss held between forward and backward, priced
        there; :attr:`StepAccount.results_dropped_by_caller`).  Results counted dropped that outlived
        the backward (a loop that keeps the output object) are counted held from now on: the step's
        excess is theirs, and a budget without room for them is refused saying so.  A caller's
        ``hold_outputs=True``/``False`` is never changed.  Results of a call split by graph breaks that the
        caller held (``held_bytes``: by position in ``ran``, their bytes) are counted beside the graphs before
        the one that made them, whose backward runs while they are alive
        (:meth:`StepAccount.counting_later_results`).

        Results held on a step ``measured_within_budget`` are counted without planning again: that step
        ran the current plans holding them and fitted (:meth:`plans_stand`).  Plans made again for them
        could only keep less, and at a budget near the floor, where the prediction is a little above
        what steps measure, be refused although the loop's steps fit (a ViT at the floor a refusal
        named: its first step measured 250,344 bytes within 252,710, then the plans made again counting
        its 40 bytes of logits were refused, naming 252,750).
        """
        before = self.account
        changed = self._observed(held, ran, loss_bytes, held_bytes)
        if changed and held and measured_within_budget:
            # Every change a step holding its results makes counts more bytes held (letting results go
            # needs ``not held``), and the measured step already held them.
            log.info(
                "the caller holds the forward's results through backward; the step that showed it held them "
                "within the budget: its plans stand"
            )
            self._standing = (before, self.account)
            return False
        if changed and measured_within_budget:
            self._measured_plans = (before, self.account)
        return changed

    def plans_stand(self, planned_under: StepAccount | None) -> bool:
        """Whether plans made under ``planned_under`` stand under the current account without planning
        again: a step measured within the budget ran them and showed everything the current account
        counts beyond ``planned_under`` (:meth:`observed_results`)."""
        standing = self._standing
        return standing is not None and standing[0] == planned_under and standing[1] == self.account

    def keeps_measured_plans(self, planned_under: StepAccount | None, error: solvers.InfeasibleBudgetError) -> bool:
        """Whether a graph planned under ``planned_under`` keeps its plan where the plan made again under the
        current account cannot fit (``error``): a step measured within the budget ran it, and the account
        changed only for what that step showed (:meth:`observed_results`: results let go after the caller's
        loss).  The plans made again are tried first, as they may keep more; but the floor moves with what
        the lowest-peak plan keeps (its margin, :func:`ckptc.planning.account.planning_margin`), which can
        be a few bytes more under the new account at the same peak, and a loop whose steps fit was refused
        at ``ckptc.capture``'s ``floor_bytes`` after its first step."""
        measured = self._measured_plans
        if measured is None or measured != (planned_under, self.account):
            return False
        release_frames(error)
        self._standing, self._measured_plans = measured, None  # every graph's plan stands (plans_stand)
        log.info(
            "the plan made again for what the measured step showed cannot fit the budget (%s); "
            "the plan that step ran within the budget stands",
            error.min_feasible_bytes,
        )
        return True

    def _observed(
        self,
        held: bool | None,
        ran: Sequence[GraphRecord],
        loss_bytes: int | None,
        held_bytes: Mapping[int, int] | None,
    ) -> bool:
        if held is not None and held_bytes is not None:
            counted = self.account.counting_later_results(ran, held_bytes if held else {})
            if counted is not self.account:
                log.info("results of the last graph held through backward, counted beside earlier graphs")
                self.account = counted
                self._measured = None
                self._observed_holding(held, ran, loss_bytes)
                return True
        return self._observed_holding(held, ran, loss_bytes)

    def _observed_holding(self, held: bool | None, ran: Sequence[GraphRecord], loss_bytes: int | None) -> bool:
        """:meth:`observed_results` for the graphs' own results."""
        account = self.account
        if held and account.results_dropped_by_caller:
            log.info("the caller holds the forward's results through backward: planning again counting them")
            self._measured = None
            self.account = account.replace(hold_outputs=True, result_gradients=False)
            return True
        if held is None or account.hold_outputs is False:
            return False
        releases = any(r.joint_problem.own_loss and r.joint_problem.results for r in ran)
        if not held and account.outputs_assumed_held and not releases and len(ran) == 1 and loss_bytes is not None:
            log.info("the caller drops the forward's results after its loss: planning again without them")
            self._measured = None
            self.account = account.replace(
                hold_outputs=False,
                result_gradients=True,
                outputs_assumed_held=False,
                loss_bytes=max(account.loss_bytes, loss_bytes),
            )
            return True
        if held and account.hold_outputs is None and releases:
            log.info("the caller holds the forward's results through backward: planning again counting them")
            self._measured = None
            self.account = account.replace(hold_outputs=True)
            return True
        if not account.outputs_assumed_held:
            return False
        if held or not releases:
            self.account = account.replace(outputs_assumed_held=False)  # prices the same: no new plan
            return False
        log.info("the caller drops the forward's results before backward: planning again without them")
        self._measured = None
        self.account = account.replace(hold_outputs=None, outputs_assumed_held=False)
        return True

    def observed_results_let_go(self, verdicts: Iterable[tuple[GraphRecord, int, int]]) -> None:
        """How many runs of earlier graphs had their results dead as a later graph of the step started or
        planned (``verdicts``: ``(earlier, later index, dead runs)``,
        :class:`ckptc.runtime.tracker.ResultLifetimes`).  Results counted held that were dead (the eager
        code after a graph break used them and let them go) are let go beside that later graph: its
        baseline stops counting them, from its next plan (:attr:`StepAccount.results_let_go`, not
        compared: no plan is made again for it alone).  The fewest dead runs any step showed for a pair
        count (no plan flips back and forth)."""
        let_go = dict(self.account.results_let_go)
        for earlier, later, dead in verdicts:
            pair = (earlier.index, later)
            fewest = self._fewest_dead.get(pair, dead)
            self._fewest_dead[pair] = fewest = min(fewest, dead)
            if fewest and earlier.held_output_bytes:
                let_go[pair] = fewest
            else:
                let_go.pop(pair, None)
        if let_go != self.account.results_let_go:
            log.debug("runs of earlier graphs whose results are dead beside later ones: %s", sorted(let_go.items()))
            self.account = self.account.replace(results_let_go=let_go)

    def observed_eager_saves(self, index: int, nbytes: int) -> None:
        """Eager code of the step saved ``nbytes`` for its backward upstream of graph ``index`` as it
        planned (:meth:`ckptc.runtime.tracker.ResultLifetimes.saved_by_eager_code`; negative where graph
        ``index`` takes as inputs what earlier graphs counted so): counted in its baseline and later
        graphs', never less than a step showed before (:attr:`StepAccount.eager_saved_before`, not
        compared: graphs planned before it are not planned again for it)."""
        counted = self.account.eager_saved_before
        if nbytes and (index not in counted or nbytes > counted[index]):
            log.debug("eager code saved %d bytes upstream of graph %d", nbytes, index)
            self.account = self.account.replace(eager_saved_before={**self.account.eager_saved_before, index: nbytes})

    def letting_results_go_for_room(self, error: solvers.InfeasibleBudgetError) -> bool:
        """Whether to plan again after ``error``: the graph that could not fit computes its own loss
        and counted its results held, which the account only assumed
        (:attr:`StepAccount.outputs_assumed_held`).  The account then counts them dropped before
        backward (:meth:`_let_results_go_for_room`), and the failed attempt's frames are cleared: the
        traceback's reference cycles would otherwise keep the tensors its planning made alive
        through the step."""
        if not getattr(error, "held_result_bytes", 0) or not self._let_results_go_for_room():
            return False
        release_frames(error)
        return True

    def back_to_standing_plans(self, error: solvers.InfeasibleBudgetError) -> bool:
        """Whether to plan again after ``error`` under the account the standing plans were made under
        (:meth:`plans_stand`): the graph that could not fit counted the results a step showed held,
        which that step held within the budget on those plans.  Such a graph is one torch.compile
        compiled anew for the step (a guard on a Python attribute failed: transformers sets
        ``config.problem_type`` on a classifier's first call); planned as the standing plans were, its
        first step is measured again, and a step over the budget is corrected or refused as any is."""
        standing = self._standing
        if standing is None or standing[1] != self.account or not getattr(error, "held_result_bytes", 0):
            return False
        release_frames(error)
        self.account, self._standing = standing[0], None
        log.info(
            "a graph compiled anew cannot fit beside the results the step holds; planned as the plans a step "
            "measured within the budget holding them were"
        )
        return True

    def _let_results_go_for_room(self) -> bool:
        """Plan as if the caller drops the results before backward, as ``loss = model(...).loss``
        does, where the account only assumed them held, and say so (whether the account changed)."""
        if not self.account.outputs_assumed_held:
            return False
        self.account = self.account.replace(hold_outputs=None, outputs_assumed_held=False)
        # Not a warning: the common loop drops them and fits; a loop that holds them is measured over
        # the budget on this step (a warning then) and planned holding them, or refused saying so.
        log.info(
            "the budget of %s bytes leaves no room to hold the step's results (logits) through backward; "
            "planning as if the caller drops them before backward (loss = model(...).loss)",
            self.budget_bytes,
        )
        return True

    def refusal(self, error: solvers.InfeasibleBudgetError) -> BaseException:
        """What to raise when a plan made again no longer fits: after counted corrections, the
        measured step's :class:`~ckptc.errors.BudgetExceededError`; otherwise ``error`` itself."""
        if not self.account.correction_bytes or error.min_feasible_bytes is None:
            return self.account.explained_refusal(
                error,
                "\nThis step was planned again counting what the calls before it showed it holds beyond a plain "
                "step (so its floor is above ckptc.capture's floor_bytes)",
                getattr(error, "held_output_bytes", None),
            )
        peak = self.over_budget_peak_bytes
        # Never below what the step measured (see count_measured): a budget retried starts uncorrected.
        suggested = max(error.min_feasible_bytes, peak)
        held = [line for line in self.account.beyond_a_plain_step() if "measured step showed" not in line]
        what_to_do = None
        if held:  # say what else the step holds: the caller may change that rather than the budget
            what_to_do = (
                f"after replanning {self.replans} time(s) with the measured excess counted. The smallest budget "
                f"expected to work is {suggested} bytes. Besides the excess, the step holds:\n- "
                + "\n- ".join(held)
                + f"\nWhat to do: pass budget_bytes=... at least {suggested}, or change the loop as said above."
            )
        return BudgetExceededError(peak, error.budget_bytes, suggested, self.replans, what_to_do)


def settle(
    run: Callable[[StepAccount], tuple[T, Sequence[GraphRecord]]],
    replans: Replans,
    unnamed_gradient_bytes: Callable[[Sequence[GraphRecord]], int] = lambda ran: 0,
) -> T:
    """Run (or decide) a step under ``replans.account`` until its graphs' plans fit together.

    ``run(account)`` plans and runs (or only decides) every graph of the step under
    ``account`` and returns its result with the graphs in the order they ran; it is
    called again under each new account (:meth:`Replans.after_run`), its earlier
    result dropped first.  ``unnamed_gradient_bytes(ran)`` gives the gradient bytes
    of parameters no graph names (see :func:`ckptc.planning.account.repeat_bytes`).
    """
    replans.new_planning_run()
    while True:
        try:
            result, ran = run(replans.account)
        except solvers.InfeasibleBudgetError as error:
            if replans.letting_results_go_for_room(error):
                continue
            raise
        if not replans.after_run(ran, unnamed_gradient_bytes(ran)):
            return result
        del result, ran  # the next run must not hold this one's activations


def missed_bytes(peak_bytes: int, budget_bytes: int, ran: Sequence[GraphRecord]) -> int:
    """What a step measured at ``peak_bytes`` showed its plans' prediction missed (see
    :meth:`Replans.after_measured`)."""
    predicted = max((r.result.peak_bytes for r in ran), default=0)
    return max(peak_bytes - budget_bytes, peak_bytes - predicted)


def tighter_graph_budgets(
    ran: Sequence[GraphRecord], budget_bytes: int, attempt: int, current: Mapping[int, int]
) -> dict[int, int]:
    """Budgets for the graphs before the last one that could not fit (``infeasible``) in ``ran``.

    The first retry asks earlier graphs to leave room for what the later graph
    needs at its floor; the second to keep as little as they can.

    Raises:
        solvers.InfeasibleBudgetError: the step's floor is above the budget
            (the message gives it), or the retries are used up.
    """
    short = [r for r in ran if r.infeasible]
    floor = max(r.min_feasible_bytes for r in ran)
    # The graphs that ran before the last short one, by run order: a graph compiled again (a guard
    # failed: an attribute the forward reads changed) has a later index than the graphs after it.
    last = max(i for i, r in enumerate(ran) if r.infeasible)
    before_last = sorted({r.index for r in ran[:last]} - {ran[last].index})
    # The step's floor is above the budget: planning again cannot help.  (A short first graph of a call,
    # within it, is left to the earlier calls of the step: Replans._left_to_earlier_calls.)
    if floor > budget_bytes:
        mine = {id(r) for r in ran}
        earlier_calls = {id(e): e for r in short for e in r.earlier if id(e) not in mine}
        if not earlier_calls:
            raise solvers.InfeasibleBudgetError(budget_bytes, floor)  # explained by the caller (Replans._judged)
        parameters: dict[int, int] = {}
        for record in [*ran, *earlier_calls.values()]:
            parameters.update(record.inputs.parameters)
        floor = max(
            [floor]
            + [e.later_calls_floor(parameters) for e in earlier_calls.values() if e.later_calls_floor is not None]
        )
        raise solvers.InfeasibleBudgetError(
            budget_bytes,
            floor,
            f"budget {solvers.format_bytes(budget_bytes)} ({budget_bytes} bytes) is below this step's floor of "
            f"{solvers.format_bytes(floor)} ({floor} bytes): the model is called again before one backward (two "
            "calls per step), so the earlier calls' activations stay alive through this call, and their backwards "
            "run after this call's with the parameters' gradients made. What to do: give a budget of at least "
            f"{floor} bytes, or, where the loss allows it, run a backward after each call (gradient accumulation).",
        )
    if attempt >= MAX_STEP_RETRIES:
        # The last retry had the graphs before the short ones keep as little as they can: the short ones
        # fit at their floors beside them once the budget leaves the room they still lacked.
        needed = budget_bytes + max(0, room_needed(short, budget_bytes))
        raise solvers.InfeasibleBudgetError(
            budget_bytes,
            needed if needed > budget_bytes else None,
            "ckptc could not make the graphs of this step fit together in "
            f"{solvers.format_bytes(budget_bytes)} ({budget_bytes} bytes) after {MAX_STEP_RETRIES} retries, "
            f"although each graph's floor with the graphs before it at theirs is at most {floor} bytes: with "
            f"the graphs before it keeping as little as they can, the last graph that did not fit needs "
            f"{needed} bytes. What to do: give a budget of at least {needed} bytes, or pass solver='auto' if "
            "another solver was chosen.",
        )
    return _budgets_keeping_less(ran, before_last, room_needed(short, budget_bytes), budget_bytes, attempt, current)


def room_needed(short: Sequence[GraphRecord], budget_bytes: int) -> int:
    """How many bytes the graphs ``short`` (planned at their floors, ``infeasible``) need earlier
    graphs to keep less so that they fit ``budget_bytes`` with their planning margin."""
    return max(budget_for_planning_floor(r.floor_peak_bytes, r.margin_bytes) - budget_bytes for r in short)


def _budgets_keeping_less(
    ran: Sequence[GraphRecord],
    indices: Sequence[int],
    need: int,
    budget_bytes: int,
    attempt: int,
    current: Mapping[int, int],
) -> dict[int, int]:
    """Budgets for the graphs ``indices`` (of those that ``ran``) so that they keep ``need`` bytes less:
    on the first ``attempt`` each lowers its peak by its share of ``need``, then each keeps as little as
    it can (budget 0); never above a budget in ``current``."""
    if attempt == 0:
        # Each graph lowers its own peak (keeping less) by its share of `need` (the budget alone
        # would not bind a graph whose peak is well below it); a graph run for several layers
        # (blocks compiled once) keeps its bytes once per run.
        runs = Counter(r.index for r in ran if r.index in indices)
        peaks = {r.index: r.result.peak_bytes for r in ran}
        shares = {j: -(-need // runs.get(j, 1)) for j in indices}  # ceil(need / runs)
        tighter = {j: max(0, min(budget_bytes, peaks.get(j, budget_bytes)) - shares[j]) for j in indices}
    else:
        tighter = {j: 0 for j in indices}
    return {j: min(b, current.get(j, b)) for j, b in tighter.items()}
