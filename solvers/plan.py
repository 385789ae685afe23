"""What a solver returns: which forward values to keep, and optionally an explicit schedule.

A :class:`Plan` is plain data. ``kept`` alone defines the *derived* schedule
(see :func:`solvers.schedule`); solvers that recompute values several times
(dp, ilp) also give an explicit ``schedule`` of :class:`Step`.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Iterable, Mapping, NamedTuple

from solvers.errors import human_bytes

__all__ = ["Step", "Plan", "SolveInfo", "FORWARD_PHASE", "BACKWARD_PHASE"]

FORWARD_PHASE = "forward"
BACKWARD_PHASE = "backward"
PHASES = (FORWARD_PHASE, BACKWARD_PHASE)


class Step(NamedTuple):
    """Execute ``node`` in ``phase`` (``"forward"`` or ``"backward"``).

    A forward node executed in the backward phase is a recomputation.
    """

    node: str
    phase: str


Scalar = str | int | float | bool | None


@dataclass(frozen=True)
class SolveInfo:
    """What is known about how a plan was found, judged by :func:`solvers.simulate`.

    Every method fills what applies to it; the rest stays at its default.

    Attributes
    ----------
    predicted_peak_bytes, recompute_cost :
        The plan's simulated peak and recompute cost.
    solve_seconds :
        Wall time of the solve.
    status, gap, bound, objective :
        The MILP's outcome (``status``: "optimal", "time_limit" or "fallback").
    candidate, threshold_bytes, simulations :
        Chen's family: which candidate won, the greedy's threshold, how many plans were simulated.
    refined :
        :func:`solvers.refine.fill_budget` kept more where the budget allowed.
    applied_from_file :
        The plan was read from a plan file, not solved.
    chosen, tried :
        ``auto``: the method whose plan won, and each method's outcome.
    details :
        Method-specific scalars (the MILP's size and timings, the block counts).
    """

    predicted_peak_bytes: int | None = None
    recompute_cost: float | None = None
    solve_seconds: float | None = None
    status: str | None = None
    gap: float | None = None
    bound: float | None = None
    objective: float | None = None
    candidate: str | None = None
    threshold_bytes: int | None = None
    simulations: int | None = None
    refined: bool = False
    applied_from_file: bool = False
    chosen: str | None = None
    tried: Mapping[str, Mapping[str, Scalar]] = field(default_factory=dict, compare=False)
    details: Mapping[str, Scalar] = field(default_factory=dict)

    def replace(self, **changes: Any) -> "SolveInfo":
        return dataclasses.replace(self, **changes)

    def to_dict(self, *, timings: bool = True) -> dict[str, Any]:
        """The fields that differ from their defaults, as JSON data; ``timings=False`` drops every
        wall-clock figure (and ``tried``, which holds them), so the same plan gives the same data."""
        out: dict[str, Any] = {}
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if value == _default(f) or (not timings and (f.name == "tried" or f.name.endswith("seconds"))):
                continue
            if f.name == "details":
                value = {k: v for k, v in sorted(value.items()) if timings or not k.endswith("seconds")}
                if not value:
                    continue
            elif f.name == "tried":
                value = {k: dict(v) for k, v in value.items()}
            out[f.name] = value
        return out

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> "SolveInfo":
        """Inverse of :meth:`to_dict` (unknown keys are an error: ``TypeError`` naming them)."""
        return cls(**data)


def _default(f: dataclasses.Field) -> Any:
    return f.default if f.default is not dataclasses.MISSING else f.default_factory()  # type: ignore[misc]


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
    info : SolveInfo
        How it was found: predicted peak and recompute cost, solve time,
        and what applies to the method (status, gap, bound...).

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
    info: SolveInfo = field(default_factory=SolveInfo, hash=False)

    def __post_init__(self) -> None:
        if isinstance(self.kept, str):
            raise TypeError("kept must be a collection of node names, not a string")
        object.__setattr__(self, "kept", frozenset(self.kept))
        if self.schedule is not None and not (
            type(self.schedule) is tuple and all(type(s) is Step for s in self.schedule)
        ):  # a copy (dataclasses.replace) keeps the same tuple: simulate() remembers it by identity
            object.__setattr__(self, "schedule", tuple(Step(*s) for s in self.schedule))
        if not isinstance(self.info, SolveInfo):
            raise TypeError(f"info must be a SolveInfo, not {type(self.info).__name__}")

    def to_dict(self) -> dict[str, Any]:
        """Plain JSON data with a deterministic key order and ``kept`` sorted."""
        return {
            "method": self.method,
            "budget_bytes": self.budget_bytes,
            "kept": sorted(self.kept),
            "schedule": None if self.schedule is None else [[s.node, s.phase] for s in self.schedule],
            "info": self.info.to_dict(),
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
            info=SolveInfo.from_dict(data.get("info") or {}),
        )

    def __repr__(self) -> str:
        sched = "derived" if self.schedule is None else f"{len(self.schedule)} steps"
        budget = "none" if self.budget_bytes is None else human_bytes(self.budget_bytes)
        extras = ""
        if self.info.predicted_peak_bytes is not None:
            extras += f", peak={human_bytes(self.info.predicted_peak_bytes)}"
        if self.info.recompute_cost is not None:
            extras += f", recompute_cost={self.info.recompute_cost:.4g}"
        return f"Plan(method={self.method!r}, kept={len(self.kept)} nodes, schedule={sched}, budget={budget}{extras})"
