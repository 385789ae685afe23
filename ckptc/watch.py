"""The run-time budget check of ``torch.compile(model, backend="ckptc")``.

:class:`ckptc.step.StepRuntime` sees every training call of ``ckptc.optimize``'s
model and plans again when a measured step exceeds the budget.  A
``torch.compile`` backend sees only its graphs, and Dynamo keeps what it was
handed: the backend cannot plan again.  It can still measure, so a budget is
never exceeded without a word:

* a step begins with the first graph run after the last step's backward ended
  (a second call before one backward belongs to the same step) and ends when
  that backward ends;
* the first step of each plan is measured from its first graph's forward to
  the end of its backward (:class:`ckptc.meter.StepMeter`);
* within the budget, the plan is verified for that state of the step (with or
  without gradients resident at its start: accumulation) and no later step in
  that state is measured; above
  it, the next graph run raises :class:`ckptc.BudgetExceededError` naming the
  measured peak and what to do (``ckptc.optimize`` plans again with the excess
  counted; the backend needs a lower budget).
"""

from __future__ import annotations

import logging
from typing import Any, Sequence

import torch

from ckptc import _torch_internals as internals
from ckptc.errors import BudgetExceededError
from ckptc.meter import StepMeter, after_backward_returns, resident_bytes
from ckptc.records import GraphRecord

log = logging.getLogger("ckptc.watch")


class BackendStepCheck:
    """Measures a backend's steps until one is within ``budget_bytes`` (see the module docstring).

    Attributes:
        measured_peak_bytes: the peak of the last measured step (None before one).
        verified: the step states (gradients resident at its start or not) a measured step
            was within the budget in.
    """

    def __init__(self, budget_bytes: int, model: torch.nn.Module | None = None) -> None:
        self.budget_bytes = budget_bytes
        self.model = model
        self.measured_peak_bytes: int | None = None
        self.verified: set[bool] = set()
        self._state = False
        self._open = False
        self._meter: StepMeter | None = None
        self._counted: set[Any] = set()  # storages already in the meter's baseline
        self._handles: list[Any] = []
        self._predicted = 0
        self._pending: BudgetExceededError | None = None
        self._end_scheduled = False  # the step ends on the first Python event after backward returns

    def __repr__(self) -> str:
        return (
            f"BackendStepCheck(budget={self.budget_bytes}, verified={self.verified}, "
            f"measured_peak_bytes={self.measured_peak_bytes})"
        )

    def graph_starts(self, record: GraphRecord, args: Sequence[Any]) -> None:
        """Before graph ``record`` runs on ``args`` (the real tensors Dynamo passes, parameters included)."""
        if self._pending is not None:
            error, self._pending = self._pending, None
            raise error
        self._predicted = max(self._predicted if self._open else 0, record.result.peak_bytes)
        if not self._open:
            self._open = True
            self._state = any(isinstance(a, torch.nn.Parameter) and a.grad is not None for a in args)
            if self._state in self.verified or internals.profiler_active():
                return  # nothing to measure, or profilers would nest
            self._counted = set()
            self._meter = StepMeter(_device_of(args), 0).start()
            resident = [*args] if self.model is None else [self.model, *args]
            self._meter.add_baseline(self._uncounted(resident))
        elif self._meter is not None:
            # A later graph's parameters were resident from the start; its other inputs were made in the step.
            self._meter.add_baseline(self._uncounted([a for a in args if isinstance(a, torch.nn.Parameter)]))

    def graph_returned(self, outputs: Any) -> None:
        """After a graph ran: its results' backward ends the step."""
        tensors = [t for t in internals.tree_leaves(outputs) if isinstance(t, torch.Tensor) and t.requires_grad]
        if tensors:
            self._handles.append(internals.on_backward_end(tensors, self._backward_ended))
        elif not self._handles:
            self._end(measured=False)  # no backward will come (an inference call)

    def _uncounted(self, objects: list[Any]) -> int:
        """Bytes of ``objects`` (tensors, a module) and of their gradients resident at the start (they
        count for the whole step) that the meter's baseline does not hold yet."""
        grads = [a.grad for a in objects if isinstance(a, torch.Tensor) and a.grad is not None]
        return resident_bytes(*objects, *grads, seen=self._counted)

    def _backward_ended(self) -> None:
        if not self._open or self._end_scheduled:
            return  # a second call's results reach the same backward: one end per step
        if self._meter is None or self._meter.device.type != "cpu":
            self._end(measured=True)
        elif after_backward_returns(lambda: self._end(measured=True)):
            self._end_scheduled = True
        else:
            self._end(measured=False)

    def _end(self, *, measured: bool) -> None:
        if not self._open:
            return
        self._open = False
        self._end_scheduled = False
        for handle in self._handles:
            handle.remove()
        self._handles = []
        meter, self._meter = self._meter, None
        if meter is None:
            return
        peak = meter.stop().peak_bytes
        if not measured:
            return
        self.measured_peak_bytes = peak
        if peak <= self.budget_bytes:
            self.verified.add(self._state)
            log.info("measured step peak %d bytes, within the budget of %d bytes", peak, self.budget_bytes)
            return
        missed = max(0, peak - self._predicted)
        log.warning("torch.compile(backend='ckptc'): measured step peak %d bytes > budget %d", peak, self.budget_bytes)
        self._pending = BudgetExceededError(
            peak,
            self.budget_bytes,
            peak,
            0,
            what_to_do=(
                f"measured by torch.compile(backend='ckptc')'s run-time check. The plan predicted "
                f"{self._predicted} bytes; the step holds {missed} bytes it did not see "
                "(gradients resident across calls, several calls or backwards per step, eager code between "
                "graphs). torch.compile(backend='ckptc') plans each graph once and cannot plan again: use "
                "ckptc.optimize(model, budget_bytes=...), which counts what a measured step shows and plans "
                f"again, or give the backend a budget of about {max(1, self.budget_bytes - missed)} bytes "
                "to leave room for it."
            ),
        )

    def abort(self) -> None:
        """Forget the step in progress (its call failed)."""
        if self._meter is not None:
            self._meter.abort()
            self._meter = None
        self._end(measured=False)


def _device_of(args: Sequence[Any]) -> torch.device:
    for arg in args:
        if isinstance(arg, torch.Tensor):
            return arg.device
    return torch.device("cpu")
