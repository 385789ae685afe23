"""Exceptions raised by the solvers package.

All of them derive from :class:`SolverError`, so callers that only want to
know "did checkpoint planning work?" can catch that one class.  SolverError
derives from :class:`CkptcError`, the one base class of every error that
ckptc and its solvers raise (``ckptc.CkptcError`` is this class): it lives
here so that ``solvers`` stays importable without ckptc and torch.

Errors about the value of an argument (a budget no plan fits, a plan that
breaks the rules) are also :class:`ValueError`, so ``except ValueError``
catches them as it catches a negative budget.
"""

from __future__ import annotations

__all__ = [
    "CkptcError",
    "SolverError",
    "InvalidPlanError",
    "InfeasibleBudgetError",
    "format_bytes",
    "human_bytes",
]

_GIB = 1 << 30


def format_bytes(num_bytes: int | float) -> str:
    """Render a byte count in GiB with three significant digits, e.g. ``"1.5 GiB"``.

    Error messages always quote GiB *and* the exact byte count, because
    budgets are given in bytes but people think in GiB.
    """
    return f"{num_bytes / _GIB:.3g} GiB"


def human_bytes(num_bytes: int | float) -> str:
    """Render a byte count with the largest fitting binary unit, e.g. ``"12 B"``, ``"3.5 MiB"`` (for reprs)."""
    for unit, size in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if num_bytes >= size:
            return f"{num_bytes / size:.3g} {unit}"
    return f"{num_bytes:g} B"


class CkptcError(Exception):
    """Base class of every error raised by ckptc and by :mod:`solvers`.

    Re-exported as ``ckptc.CkptcError``; ``except ckptc.CkptcError`` catches
    budget, plan-file, capture and solver errors alike.
    """


class SolverError(CkptcError):
    """Base class of every error raised by :mod:`solvers`."""


class InvalidPlanError(SolverError, ValueError):
    """A plan or schedule breaks the execution rules of :func:`solvers.simulate`.

    The message names the offending step (its index, node and phase) and the
    value that was missing or the rule that was broken.
    """


class InfeasibleBudgetError(SolverError, ValueError):
    """No plan the chosen method can build fits in ``budget_bytes``.

    A :class:`ValueError` too: the budget argument is too small.

    Attributes
    ----------
    budget_bytes : int
        The budget that was asked for.
    min_feasible_bytes : int or None
        The smallest budget for which the package knows a plan (see
        :func:`solvers.min_feasible_budget`), or None if unknown.
    """

    def __init__(
        self,
        budget_bytes: int,
        min_feasible_bytes: int | None,
        message: str | None = None,
    ) -> None:
        self.budget_bytes = budget_bytes
        self.min_feasible_bytes = min_feasible_bytes
        if message is None:
            if min_feasible_bytes is None:
                message = (
                    f"budget {format_bytes(budget_bytes)} ({budget_bytes} bytes) "
                    "is below the smallest feasible budget for this graph"
                )
            else:
                message = (
                    f"budget {format_bytes(budget_bytes)} ({budget_bytes} bytes) "
                    f"is below the smallest feasible budget "
                    f"{format_bytes(min_feasible_bytes)} ({min_feasible_bytes} bytes) "
                    "for this graph"
                )
        self.message = message
        super().__init__(message)

    def __reduce__(self):
        # Exceptions pickle as cls(*args); ours takes three arguments, not the message.
        return (type(self), (self.budget_bytes, self.min_feasible_bytes, self.message))
