"""Reports on plans: tables, summary lines, memory timelines and Pareto fronts.

The pieces are independent of the command line (:mod:`ckptc.cli` only parses
arguments and prints), so notebooks and benchmarks can call them directly:

* :func:`plan_table` / :func:`summary_line`: text views of a :class:`ModelPlan`.
* :func:`memory_timelines` runs one step with and without the plan and returns
  the predicted (simulator) and measured (allocator) timelines;
  :func:`memory_timeline_plot` draws them against the budget.
* :func:`pareto_points` plans one model under a range of budgets with several
  solvers; :func:`pareto_table` and :func:`pareto_plot` show the trade-off.

Plots use matplotlib's Agg canvas directly (no pyplot, no global backend
switch, no display needed); matplotlib is imported only when a plot is drawn.
"""

from __future__ import annotations

import logging
import math
import os
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

import solvers
from ckptc.api import _default_loss, capture, example_call, optimize, training_state_restored
from ckptc.errors import CkptcError, InvalidArgumentError
from ckptc.meter import measure_peak, resident_bytes
from ckptc.planning.planner import unoptimized_result
from ckptc.plans import KeptValue, ModelPlan
from solvers import format_bytes

log = logging.getLogger("ckptc.report")

Progress = Callable[[float, str], None]

#: Solvers compared by default in :func:`pareto_points`.
DEFAULT_PARETO_SOLVERS = ("chen_sqrt", "chen_greedy", "hierarchical", "auto")


class MissingDependencyError(CkptcError):
    """An optional dependency (matplotlib for plots) is not installed."""


# --------------------------------------------------------------------------- #
# Text: numbers and tables                                                     #
# --------------------------------------------------------------------------- #


def format_flops(flops: float) -> str:
    """FLOPs with an SI prefix and three significant digits, e.g. ``"65.5 kFLOP"``."""
    for prefix, scale in (("P", 1e15), ("T", 1e12), ("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if abs(flops) >= scale:
            return f"{flops / scale:.3g} {prefix}FLOP"
    return f"{flops:.3g} FLOP"


def format_table(headers: Sequence[str], rows: Iterable[Sequence[str]], *, left_columns: int = 1) -> str:
    """A plain-text table: the first ``left_columns`` columns left-aligned, the rest right-aligned."""
    rows = [list(map(str, row)) for row in rows]
    widths = [max([len(h), *(len(row[i]) for row in rows)]) for i, h in enumerate(headers)]

    def line(cells: Sequence[str]) -> str:
        return "  ".join(
            cell.ljust(width) if i < left_columns else cell.rjust(width)
            for i, (cell, width) in enumerate(zip(cells, widths, strict=False))
        ).rstrip()

    rule = "  ".join("-" * width for width in widths)
    return "\n".join([line(headers), rule, *(line(row) for row in rows)])


@dataclass
class ModuleRow:
    """What a plan does with the forward values of one module."""

    module: str
    kept_values: int = 0
    kept_bytes: int = 0
    recomputed_values: int = 0
    recomputed_bytes: int = 0
    recompute_flops: int = 0
    other_values: int = 0  # decisions other than kept/recomputed (e.g. "free" views)

    @property
    def decision(self) -> str:
        """``"keep"``, ``"recompute"`` or ``"mixed"``: the module's values' decisions taken together.

        Judged by bytes, so zero-byte views (a transposed weight recomputed for
        free) do not turn a module that keeps its activations into "mixed";
        counts decide only for modules whose values are all zero-byte.
        """
        kept, recomputed = self.kept_bytes, self.recomputed_bytes
        if not kept and not recomputed:
            kept, recomputed = self.kept_values, self.recomputed_values
        if kept and recomputed:
            return "mixed"
        if kept:
            return "keep"
        if recomputed:
            return "recompute"
        return "free"

    def add(self, value: KeptValue) -> None:
        if value.decision == "kept":
            self.kept_values += 1
            self.kept_bytes += value.bytes
        elif value.decision == "recomputed":
            self.recomputed_values += 1
            self.recomputed_bytes += value.bytes
            self.recompute_flops += value.flops
        else:
            self.other_values += 1


def module_rows(model_plan: ModelPlan) -> list[ModuleRow]:
    """Forward values grouped by module, modules in the order the step first reaches them.

    Graph breaks split a model into several graphs; a module seen in several
    graphs gets one row with the sums.
    """
    rows: dict[str, ModuleRow] = {}
    for value in model_plan.values():
        module = value.module or "(top level)"
        rows.setdefault(module, ModuleRow(module)).add(value)
    return list(rows.values())


def plan_table(model_plan: ModelPlan) -> str:
    """A table per module: values and bytes kept, values and bytes recomputed, recompute FLOPs, decision.

    Recompute FLOPs count each recomputed value once; the summary line's
    percentage uses the plan's own total, which counts a value as often as a
    schedule recomputes it.
    """
    rows = module_rows(model_plan)
    total = ModuleRow("total")
    for row in rows:
        for name in ("kept_values", "kept_bytes", "recomputed_values", "recomputed_bytes", "recompute_flops"):
            setattr(total, name, getattr(total, name) + getattr(row, name))

    def cells(row: ModuleRow, decision: str) -> list[str]:
        return [
            row.module,
            str(row.kept_values),
            format_bytes(row.kept_bytes),
            str(row.recomputed_values),
            format_bytes(row.recomputed_bytes),
            format_flops(row.recompute_flops),
            decision,
        ]

    headers = ["module", "kept", "bytes kept", "recomputed", "bytes recomputed", "recompute FLOPs", "decision"]
    body = [cells(row, row.decision) for row in rows] + [cells(total, "")]
    return format_table(headers, body, left_columns=1)


def summary_line(model_plan: ModelPlan) -> str:
    """One line: parameters, gradients, kept activations, peaks, budget and recompute share.

    Parameters and gradients are shown when the plan records them (plans made
    by this version do; older files say "?").
    """

    def optional_bytes(value: int | None) -> str:
        return "?" if value is None else format_bytes(value)

    kept = model_plan.values("kept")
    recomputed = model_plan.values("recomputed")
    budget = "none" if model_plan.budget_bytes is None else format_bytes(model_plan.budget_bytes)
    methods = "/".join(dict.fromkeys(g.plan.method for g in model_plan.graphs))
    return (
        f"parameters {optional_bytes(model_plan.parameter_bytes)}, "
        f"gradients {optional_bytes(model_plan.gradient_bytes)}, "
        f"kept activations {format_bytes(sum(v.bytes for v in kept))} ({len(kept)} values, "
        f"{len(recomputed)} recomputed), "
        f"predicted peak {format_bytes(model_plan.predicted_peak_bytes)} "
        f"(unoptimized {format_bytes(model_plan.unoptimized_peak_bytes)}, budget {budget}), "
        f"recompute {model_plan.recompute_percent:.1f}% of step FLOPs "
        f"[{len(model_plan.graphs)} graph(s), method {methods}]"
    )


# --------------------------------------------------------------------------- #
# Memory timelines                                                             #
# --------------------------------------------------------------------------- #


@dataclass(frozen=True)
class TimelineSeries:
    """Memory over one step: bytes after each event (simulator step or allocator event)."""

    label: str
    values: tuple[int, ...]
    optimized: bool  # the plan (True) or keep-everything (False)
    measured: bool  # allocator (True) or simulator (False)

    @property
    def peak_bytes(self) -> int:
        return max(self.values, default=0)


@dataclass
class TimelineReport:
    """Predicted and measured memory of one training step, with and without the plan."""

    model_plan: ModelPlan
    budget_bytes: int | None
    series: list[TimelineSeries]

    def get(self, *, optimized: bool, measured: bool) -> TimelineSeries | None:
        for series in self.series:
            if series.optimized == optimized and series.measured == measured:
                return series
        return None


def step_timeline(results: Sequence[solvers.SimResult]) -> list[int]:
    """The simulator timelines of a step's graphs, in the order the step runs them.

    With graph breaks, forwards run in graph order and backwards in reverse
    order, so each graph's timeline is split at its first backward step.  Each
    graph's timeline already counts what the others hold (its baseline), so
    the pieces line up.
    """
    forwards: list[list[int]] = []
    backwards: list[list[int]] = []
    for result in results:
        split = next((i for i, s in enumerate(result.steps) if s.phase == "backward"), len(result.steps))
        forwards.append(list(result.timeline[:split]))
        backwards.append(list(result.timeline[split:]))
    timeline: list[int] = []
    for part in forwards + backwards[::-1]:
        timeline.extend(part)
    return timeline


def resample_peaks(values: Sequence[int], points: int) -> list[int]:
    """``values`` on ``points`` equal slices of the step, keeping each slice's maximum.

    A maximum, not a sample, so a short spike (the peak) survives resampling;
    fewer values than points repeat as a step function.
    """
    n = len(values)
    if n == 0 or points <= 0:
        return []
    resampled = []
    for i in range(points):
        lo = i * n // points
        hi = max(lo + 1, (i + 1) * n // points)
        resampled.append(max(values[lo:hi]))
    return resampled


def _training_step(
    model: Callable[..., Any],
    example_inputs: Sequence[Any],
    example_kwargs: Mapping[str, Any],
    loss_fn: Callable[[Any], torch.Tensor],
) -> Callable[[], torch.Tensor]:
    """One forward+backward.  Callers clear gradients *before* measuring it: freeing old
    gradients inside the measured call would show up as a drop in the timeline."""

    def step() -> torch.Tensor:
        loss = loss_fn(model(*example_inputs, **example_kwargs))
        loss.backward()
        return loss.detach()

    return step


def _clear_gradients(parameters: Iterable[torch.nn.Parameter]) -> None:
    """Start the next step from ``None`` gradients, as after ``zero_grad(set_to_none=True)``."""
    for p in parameters:
        p.grad = None


def memory_timelines(
    model: torch.nn.Module,
    example_inputs: Sequence[Any] | torch.Tensor = (),
    example_kwargs: Mapping[str, Any] | None = None,
    *,
    budget_bytes: int | None = None,
    loss_fn: Callable[[Any], torch.Tensor] | None = None,
    **options: Any,
) -> TimelineReport:
    """Plan ``model`` under the budget, run one step with and without the plan, and collect timelines.

    Four series: keep-everything and the plan, each predicted (simulator) and
    measured (allocator events on CPU; accelerators give peaks only, so no
    measured series).  The unoptimized measurement is eager PyTorch, the
    baseline users compare against.  Each measured step follows a warm-up
    step, since first runs allocate one-time buffers.  Gradients, buffers and
    the RNG state are restored afterwards, as :func:`ckptc.plan` does.

    ``options`` go to :func:`ckptc.optimize` (solver, strategy, must_save, ...).

    Raises:
        solvers.InfeasibleBudgetError: the budget is below the smallest feasible one.
    """
    example_inputs, example_kwargs = example_call(example_inputs, example_kwargs)
    loss_fn = loss_fn or _default_loss
    parameters = list(model.parameters())
    device = parameters[0].device if parameters else torch.device("cpu")
    optimized = optimize(model, budget_bytes=budget_bytes, **options)

    with training_state_restored(model, example_inputs, example_kwargs):
        optimized_step = _training_step(optimized, example_inputs, example_kwargs, loss_fn)
        eager_step = _training_step(model, example_inputs, example_kwargs, loss_fn)
        _clear_gradients(parameters)
        optimized_step()  # first call: capture, solve, rewrite
        for warm_up in (optimized_step, eager_step):
            _clear_gradients(parameters)
            warm_up()
        _clear_gradients(parameters)
        baseline = resident_bytes(model, example_inputs, example_kwargs)
        _, measured_plan = measure_peak(optimized_step, baseline_bytes=baseline, device=device)
        # The plan of the step measured: the warm-up may have planned again (results the step drops,
        # a measured excess), and the report shows what ran.
        records = list(optimized.compiler.active)
        model_plan = optimized.plan
        assert model_plan is not None
        _clear_gradients(parameters)
        _, measured_eager = measure_peak(eager_step, baseline_bytes=baseline, device=device)

    unoptimized_results = [unoptimized_result(r.joint_problem) for r in records]
    series = [
        TimelineSeries(
            "unoptimized, predicted", tuple(step_timeline(unoptimized_results)), optimized=False, measured=False
        ),
        TimelineSeries(
            "plan, predicted", tuple(step_timeline([r.result for r in records])), optimized=True, measured=False
        ),
    ]
    for measurement, label, is_plan in (
        (measured_eager, "unoptimized (eager PyTorch), measured", False),
        (measured_plan, "plan, measured", True),
    ):
        if measurement.timeline:
            values = tuple(measurement.baseline_bytes + level for level in measurement.timeline)
            series.append(TimelineSeries(label, values, optimized=is_plan, measured=True))
        else:
            log.info(
                "%s: the device reports no allocator timeline, only its peak %s",
                label,
                format_bytes(measurement.peak_bytes),
            )
    return TimelineReport(model_plan=model_plan, budget_bytes=budget_bytes, series=series)


# --------------------------------------------------------------------------- #
# Pareto front: recompute overhead against peak memory                         #
# --------------------------------------------------------------------------- #


@dataclass(frozen=True)
class ParetoPoint:
    """One solver at one budget; ``predicted_peak_bytes`` is None if it found no plan."""

    solver: str
    budget_bytes: int
    predicted_peak_bytes: int | None
    recompute_percent: float | None
    smallest_feasible_bytes: int | None = None  # what the solver reported when it found no plan

    @property
    def feasible(self) -> bool:
        return self.predicted_peak_bytes is not None


@dataclass
class ParetoResult:
    """Points of :func:`pareto_points` and the range of budgets they span."""

    points: list[ParetoPoint]
    min_feasible_bytes: int
    unoptimized_peak_bytes: int
    budgets: list[int] = field(default_factory=list)

    def curve(self, solver: str) -> list[ParetoPoint]:
        """The solver's feasible points, by predicted peak."""
        found = [p for p in self.points if p.solver == solver and p.feasible]
        return sorted(found, key=lambda p: (p.predicted_peak_bytes, p.budget_bytes))

    @property
    def solvers(self) -> list[str]:
        return list(dict.fromkeys(p.solver for p in self.points))


def budget_range(low: int, high: int, points: int) -> list[int]:
    """``points`` evenly spaced budgets from ``low`` to ``high`` inclusive (distinct, ascending)."""
    if points < 1:
        raise InvalidArgumentError(f"points must be at least 1, got {points}")
    if points == 1 or high <= low:
        return [max(low, high)]
    return sorted({round(low + (high - low) * i / (points - 1)) for i in range(points)})


def pareto_points(
    model: torch.nn.Module,
    example_inputs: Sequence[Any] = (),
    example_kwargs: Mapping[str, Any] | None = None,
    *,
    loss_fn: Callable[[Any], torch.Tensor] | None = None,
    solver_names: Sequence[str] = DEFAULT_PARETO_SOLVERS,
    points: int = 6,
    progress: Progress | None = None,
    **options: Any,
) -> ParetoResult:
    """Plan ``model`` under ``points`` budgets, smallest feasible to unoptimized peak, with each solver.

    The step is captured once (:func:`ckptc.capture`), which gives the range;
    then every (solver, budget) pair is planned on that capture.  A solver
    that cannot fit a budget skips that point (recorded as infeasible).
    ``options`` go to :func:`ckptc.capture` (must_save, must_recompute, ...).
    ``progress(fraction, message)`` reports the whole sweep.
    """
    unknown = [s for s in solver_names if s not in solvers.METHODS]
    if unknown:
        raise InvalidArgumentError(f"unknown solver(s) {', '.join(unknown)}; choose from {', '.join(solvers.METHODS)}")
    total = 1 + points * len(solver_names)

    def report(done: float, message: str) -> None:
        if progress is not None:
            progress(min(1.0, done / total), message)

    report(0, "capturing the step")
    step = capture(model, example_inputs, example_kwargs, loss_fn=loss_fn, **options)
    budgets = budget_range(step.floor_bytes, step.unoptimized_peak_bytes, points)
    result = ParetoResult([], step.floor_bytes, step.unoptimized_peak_bytes, budgets)
    done = 1
    for solver in solver_names:
        for budget in budgets:
            message = f"{solver} at {format_bytes(budget)}"
            report(done, message)
            start = done
            inner = (
                None
                if progress is None
                else (lambda f, m, start=start, message=message: report(start + f, f"{message}: {m}"))
            )
            try:
                model_plan = step.plan(budget_bytes=budget, solver=solver, strategy="auto", progress=inner)
            except solvers.InfeasibleBudgetError as error:
                log.info("pareto: %s found no plan within %s", solver, format_bytes(budget))
                result.points.append(ParetoPoint(solver, budget, None, None, error.min_feasible_bytes))
            else:
                result.points.append(
                    ParetoPoint(solver, budget, model_plan.predicted_peak_bytes, model_plan.recompute_percent)
                )
            done += 1
    report(total, "done")
    return result


def pareto_table(result: ParetoResult) -> str:
    """The points as a table, infeasible ones included (marked)."""
    rows = []
    for point in result.points:
        if point.feasible:
            rows.append(
                [
                    point.solver,
                    format_bytes(point.budget_bytes),
                    format_bytes(point.predicted_peak_bytes),
                    f"{point.recompute_percent:.1f}%",
                    "",
                ]
            )
        else:
            note = "no plan"
            if point.smallest_feasible_bytes is not None:
                note += f" (needs {format_bytes(point.smallest_feasible_bytes)})"
            rows.append([point.solver, format_bytes(point.budget_bytes), "-", "-", note])
    return format_table(["solver", "budget", "predicted peak", "recompute", "note"], rows, left_columns=1)


# --------------------------------------------------------------------------- #
# Plots                                                                        #
# --------------------------------------------------------------------------- #


def _new_figure(width: float = 9.0, height: float = 5.0) -> Any:
    """A matplotlib Figure on an Agg canvas (no pyplot state, no display)."""
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError:
        raise MissingDependencyError(
            "plots need matplotlib, which is not installed: pip install matplotlib (or ckptc[plot])"
        ) from None
    figure = Figure(figsize=(width, height), dpi=100)
    FigureCanvasAgg(figure)
    return figure


def _byte_unit(largest: float) -> tuple[str, int]:
    """The binary unit that keeps axis labels readable for ``largest`` bytes."""
    for unit, size in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if largest >= size:
            return unit, size
    return "bytes", 1


def memory_timeline_plot(
    report: TimelineReport,
    path: str | os.PathLike[str],
    *,
    points: int = 500,
    title: str | None = None,
) -> Path:
    """Draw the report's timelines over one step (x: fraction of the step) with the budget line.

    Every series is resampled to ``points`` slices of the step with
    :func:`resample_peaks`, so simulator steps and allocator events share an
    axis and peaks stay visible.  Returns the path written.
    """
    figure = _new_figure(9.0, 6.0)
    axes = figure.add_subplot(1, 1, 1)
    largest = max([s.peak_bytes for s in report.series] + [report.budget_bytes or 0])
    unit, scale = _byte_unit(largest)
    x = [(i + 0.5) / points for i in range(points)]
    for series in report.series:
        color = "tab:blue" if series.optimized else "tab:orange"
        style = (
            dict(linestyle="--", linewidth=1.0, alpha=0.85) if series.measured else dict(linestyle="-", linewidth=1.8)
        )
        values = resample_peaks(series.values, points)
        axes.plot(
            x,
            [v / scale for v in values],
            color=color,
            label=f"{series.label} (peak {format_bytes(series.peak_bytes)})",
            **style,
        )
    if report.budget_bytes is not None:
        axes.axhline(
            report.budget_bytes / scale,
            color="tab:red",
            linestyle=":",
            linewidth=1.5,
            label=f"budget {format_bytes(report.budget_bytes)}",
        )
    axes.set_xlim(0, 1)
    axes.set_ylim(bottom=0)
    axes.set_xlabel("fraction of the training step (forward, then backward)")
    axes.set_ylabel(f"memory ({unit})")
    axes.set_title(title or "Memory over one training step")
    axes.grid(True, alpha=0.3)
    # Below the axes: inside, it would hide the peaks it labels.
    axes.legend(loc="upper center", bbox_to_anchor=(0.5, -0.14), ncol=2, fontsize="small", frameon=False)
    figure.tight_layout()
    figure.savefig(path)
    return Path(path)


def pareto_plot(result: ParetoResult, path: str | os.PathLike[str], *, title: str | None = None) -> Path:
    """Recompute overhead (% of step FLOPs) against predicted peak, one curve per solver.

    Vertical lines mark the smallest feasible budget and the unoptimized peak.
    Returns the path written.
    """
    figure = _new_figure(8.0, 5.0)
    axes = figure.add_subplot(1, 1, 1)
    unit, scale = _byte_unit(result.unoptimized_peak_bytes)
    markers = "osD^vP*X"
    for i, solver in enumerate(result.solvers):
        curve = result.curve(solver)
        if not curve:
            continue
        axes.plot(
            [p.predicted_peak_bytes / scale for p in curve],
            [p.recompute_percent for p in curve],
            marker=markers[i % len(markers)],
            label=solver,
            linewidth=1.5,
            alpha=0.85,
        )
    for value, label, color in (
        (result.min_feasible_bytes, "smallest feasible", "tab:gray"),
        (result.unoptimized_peak_bytes, "unoptimized peak", "black"),
    ):
        axes.axvline(value / scale, color=color, linestyle=":", linewidth=1.2, label=f"{label} {format_bytes(value)}")
    axes.set_xlabel(f"predicted peak memory ({unit})")
    axes.set_ylabel("recompute (% of step FLOPs)")
    axes.set_ylim(bottom=0)
    axes.set_title(title or "Recompute overhead against peak memory")
    axes.grid(True, alpha=0.3)
    axes.legend(loc="upper right", fontsize="small")  # curves fall from top left to bottom right
    figure.tight_layout()
    figure.savefig(path)
    return Path(path)


def relative_difference(measured: int, predicted: int) -> str:
    """``measured`` against ``predicted`` as a signed percentage, e.g. ``"+1.5%"``."""
    if predicted == 0:
        return "n/a"
    difference = 100.0 * (measured - predicted) / predicted
    return f"{difference:+.1f}%" if math.isfinite(difference) else "n/a"
