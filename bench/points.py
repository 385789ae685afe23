"""One point of the benchmark: a training step measured under one alternative.

:func:`measure_point` configures a fresh copy of the model for an
:class:`~bench.alternatives.Alternative`, runs its first step (capture, solve,
compile), compares loss and every gradient with eager's, counts FLOPs, measures
the peak (allocator events, baseline ``resident_bytes(model, inputs)`` with
gradients set to None, after two warm-up steps) and times it against eager,
interleaved.  :func:`run_point` adds the time limit and turns every failure
into a result.  The helpers (one step, comparison with eager, time limits) are
shared with :mod:`bench.headline`.
"""

from __future__ import annotations

import contextlib
import copy
import gc
import signal
import statistics
import sys
import time
import traceback
from dataclasses import dataclass
from typing import Any, Callable, Iterator

import torch

import solvers
from bench.alternatives import Alternative, Runner, Skip, count_flops
from ckptc.meter import measure_peak, resident_bytes
from tests.zoo import ModelCase

SEED = 1234
RTOL, ATOL = 1e-4, 1e-5


@dataclass
class Reference:
    """Eager PyTorch's step on the model: what every point is compared with."""

    case: ModelCase
    loss: torch.Tensor
    grads: dict[str, torch.Tensor | None]
    flops: float
    every_op_flops: float = 0.0

    def eager_step(self) -> Callable[[], torch.Tensor]:
        return make_step(self.case, self.case.model, self.case.model)


# --------------------------------------------------------------------------- #
# One training step                                                            #
# --------------------------------------------------------------------------- #


def zero_grads(module: torch.nn.Module) -> None:
    for p in module.parameters():
        p.grad = None


def make_step(case: ModelCase, call: Callable[..., Any], module: torch.nn.Module) -> Callable[[], torch.Tensor]:
    def step() -> torch.Tensor:
        zero_grads(module)
        torch.manual_seed(SEED)
        loss = case.loss(call(*case.example_inputs, **case.example_kwargs))
        loss.backward()
        return loss.detach()

    return step


def timed(fn: Callable[[], Any]) -> tuple[Any, float]:
    start = time.perf_counter()
    result = fn()
    return result, time.perf_counter() - start


def grads_of(module: torch.nn.Module) -> dict[str, torch.Tensor | None]:
    return {n: (None if p.grad is None else p.grad.detach().clone()) for n, p in module.named_parameters()}


def compare(
    loss: torch.Tensor, module: torch.nn.Module, ref_loss: torch.Tensor, ref_grads: dict[str, torch.Tensor | None]
) -> dict[str, Any]:
    """Loss and every gradient against eager's, with the largest differences."""
    out: dict[str, Any] = {
        "loss_equal": bool(torch.allclose(loss, ref_loss, rtol=RTOL, atol=ATOL)),
        "loss_abs_diff": float((loss - ref_loss).abs().max()),
    }
    mismatched, worst, worst_name = [], 0.0, None
    for name, p in module.named_parameters():
        ref = ref_grads.get(name)
        if (p.grad is None) != (ref is None):
            mismatched.append(name)
            continue
        if ref is None:
            continue
        diff = float((p.grad - ref).abs().max())
        if diff > worst:
            worst, worst_name = diff, name
        if not torch.allclose(p.grad, ref, rtol=RTOL, atol=ATOL):
            mismatched.append(name)
    out.update(
        grads_equal=not mismatched,
        grad_mismatches=mismatched[:5],
        n_grad_mismatches=len(mismatched),
        grad_max_abs_diff=worst,
        grad_max_abs_diff_param=worst_name,
    )
    out["matches_eager"] = out["loss_equal"] and out["grads_equal"]
    return out


# --------------------------------------------------------------------------- #
# Time limits                                                                  #
# --------------------------------------------------------------------------- #


class PointTimeout(Exception):
    pass


@contextlib.contextmanager
def deadline(seconds: float | None) -> Iterator[None]:
    """Raise :class:`PointTimeout` in the main thread after ``seconds`` (between bytecodes)."""
    if not seconds or not hasattr(signal, "SIGALRM") or sys.platform == "win32":
        yield
        return

    def handler(signum: int, frame: Any) -> None:
        raise PointTimeout(f"point exceeded its time limit of {seconds:.0f} s")

    previous = signal.signal(signal.SIGALRM, handler)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def error_text(error: BaseException) -> str:
    text = f"{type(error).__name__}: {error}".strip()
    lines = [ln for ln in text.splitlines() if ln.strip()]
    return " ".join(lines[:3])[:400]


def reset_compiler_state() -> None:
    torch.compiler.reset()
    gc.collect()


def measure_point(
    alt: Alternative, point: dict[str, Any], ref: Reference, *, reps: int, time_limit: float | None
) -> dict[str, Any]:
    """Run ``alt`` on a fresh copy of the model and fill ``point`` with what was measured."""
    case = ref.case
    reset_compiler_state()
    model = copy.deepcopy(case.model)
    runner: Runner = alt.build(model, time_limit=time_limit)
    point["how"] = runner.info
    step = make_step(case, runner.call, runner.module)
    loss, first_s = timed(step)  # capture/solve/compile happen here
    point["first_step_s"] = first_s
    point.update(compare(loss, runner.module, ref.loss, ref.grads))
    if runner.optimized is not None:
        plan = runner.optimized.plan
        records = runner.optimized.compiler.records
        point.update(
            predicted_peak_bytes=plan.predicted_peak_bytes,
            predicted_recompute_pct=plan.recompute_percent,
            plan_min_feasible_bytes=plan.min_feasible_bytes,
            plan_method=[g.plan.method for g in plan.graphs],
            kept=len(plan.values("kept")),
            recomputed=len(plan.values("recomputed")),
            partition_s=sum(r.solve_seconds for r in records),
            solve_s=sum(r.plan.info.solve_seconds or 0.0 for r in records),
            auto_choice=[g.plan.info.chosen for g in plan.graphs] if alt.solver == "auto" else None,
        )
        if "offline_predicted_peak_bytes" in point:
            # Scratch memory is measured by running ops, so predictions may differ by a few KiB.
            diff = plan.predicted_peak_bytes - point["offline_predicted_peak_bytes"]
            point["offline_peak_diff_bytes"] = diff
            point["offline_matches_run"] = abs(diff) <= max(64 * 1024, plan.predicted_peak_bytes // 1000)
    with count_flops() as tally:  # second warm-up step
        step()
    point["flops"] = tally.total
    point["recompute_pct"] = 100.0 * (tally.total - ref.flops) / ref.flops if ref.flops else 0.0
    point["every_op_flops"] = tally.every_op_total
    if ref.every_op_flops:
        point["recompute_pct_every_op"] = 100.0 * (tally.every_op_total - ref.every_op_flops) / ref.every_op_flops
    zero_grads(runner.module)
    baseline = resident_bytes(runner.module, case.example_inputs, case.example_kwargs)
    _, measurement = measure_peak(step, baseline_bytes=baseline)
    point.update(peak_bytes=measurement.peak_bytes, baseline_bytes=measurement.baseline_bytes)
    if alt.budget_bytes is not None:
        point["within_budget"] = measurement.peak_bytes <= alt.budget_bytes
    eager_times, times = [], []
    eager_step = ref.eager_step()
    for _ in range(reps):  # interleaved: machine noise hits both alike
        eager_times.append(timed(eager_step)[1])
        times.append(timed(step)[1])
    point.update(
        time_s=statistics.median(times),
        eager_time_s=statistics.median(eager_times),
        time_ratio=statistics.median(times) / statistics.median(eager_times),
        times_s=times,
        eager_times_s=eager_times,
        status="ok",
    )
    del runner, model
    return point


def run_point(
    alt: Alternative,
    point: dict[str, Any],
    ref: Reference,
    *,
    reps: int,
    time_limit: float | None,
    point_timeout: float | None,
) -> dict[str, Any]:
    """:func:`measure_point` within ``point_timeout`` seconds; a failure is a result with its status and error."""
    try:
        with deadline(point_timeout):
            return measure_point(alt, point, ref, reps=reps, time_limit=time_limit)
    except Skip as reason:
        return {**point, "status": "skipped", "reason": str(reason)}
    except Exception as error:  # noqa: BLE001 - every failure is a result
        status = (
            "timeout"
            if isinstance(error, PointTimeout)
            else ("infeasible" if isinstance(error, solvers.InfeasibleBudgetError) else "error")
        )
        return {
            **point,
            "status": status,
            "error": error_text(error),
            "traceback": traceback.format_exc(limit=-4)[-1500:],
        }
    finally:
        reset_compiler_state()
