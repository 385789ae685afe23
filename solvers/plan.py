"""What a solver returns: which forward values to keep, and optionally an explicit schedule.

A :class:`Plan` is plain data. ``kept`` alone defines the *derived* schedule
(see :func:`solvers.schedule`); solvers that recompute values several times
(dp, ilp) also give an explicit ``schedule`` of :class:`Step`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Iterable, Mapping, NamedTuple

from solvers.errors import human_bytes

__all__ = ["Step", "Plan", "FORWARD_PHASE", "BACKWARD_PHASE"]

FORWARD_PHASE = "forward"
BACKWARD_PHASE = "backward"
PHASES = (FORWARD_PHASE, BACKWARD_PHASE)


class Step(NamedTuple):
    """Execute ``node`` in ``phase`` (``"forward"`` or ``"backward"``).

    A forward node executed in the backward phase is a recomputation.
    """

    node: str
    phase: str


@dataclass(frozen=True)
class Plan:
    """A checkpointing decision for one :class:`~solvers.Problem`.

    Parameters
    ----------
    kept : frozenset of str
        Forward nodes computed in forward and kept alive until their last use
        in backward. Lists and sets are converted.
    schedule : tuple of Step or None
        Explicit schedule; None means "derive it from kept". Pairs are
        converted to Step.
    method : str
        Name of the method that made it ("manual" if built by hand).
    budget_bytes : int or None
        The budget it was solved for.
    info : dict
        JSON-able details: predicted_peak_bytes, recompute_cost,
        solve_seconds, and method-specific entries (status, gap, bound...).

    Examples
    --------
    >>> plan = Plan(kept={"f2", "f1"}, method="manual")
    >>> Plan.from_dict(plan.to_dict()) == plan
    True
    """

    kept: frozenset[str] = frozenset()
    schedule: tuple[Step, ...] | None = None
    method: str = "manual"
    budget_bytes: int | None = None
    info: dict[str, Any] = field(default_factory=dict, hash=False)

    def __post_init__(self) -> None:
        if isinstance(self.kept, str):
            raise TypeError("kept must be a collection of node names, not a string")
        object.__setattr__(self, "kept", frozenset(self.kept))
        if self.schedule is not None:
            object.__setattr__(self, "schedule", tuple(Step(*s) for s in self.schedule))
        object.__setattr__(self, "info", dict(self.info))

    def to_dict(self) -> dict[str, Any]:
        """Plain JSON data with a deterministic key order and ``kept`` sorted."""
        return {
            "method": self.method,
            "budget_bytes": self.budget_bytes,
            "kept": sorted(self.kept),
            "schedule": None if self.schedule is None else [[s.node, s.phase] for s in self.schedule],
            "info": self.info,
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> "Plan":
        """Inverse of :meth:`to_dict` (also accepts data that went through JSON)."""
        schedule: Iterable[Any] | None = data.get("schedule")
        return cls(
            kept=frozenset(data.get("kept", ())),
            schedule=None if schedule is None else tuple(Step(*s) for s in schedule),
            method=data.get("method", "manual"),
            budget_bytes=data.get("budget_bytes"),
            info=dict(data.get("info") or {}),
        )

    def __repr__(self) -> str:
        sched = "derived" if self.schedule is None else f"{len(self.schedule)} steps"
        budget = "none" if self.budget_bytes is None else human_bytes(self.budget_bytes)
        extras = ""
        if "predicted_peak_bytes" in self.info:
            extras += f", peak={human_bytes(self.info['predicted_peak_bytes'])}"
        if "recompute_cost" in self.info:
            extras += f", recompute_cost={self.info['recompute_cost']:.4g}"
        return (
            f"Plan(method={self.method!r}, kept={len(self.kept)} nodes, schedule={sched}, "
            f"budget={budget}{extras})"
        )
