"""The options of one ckptc configuration, validated once.

:class:`CheckpointOptions` is the one list of what can be configured:
:func:`ckptc.optimize`, :func:`ckptc.backend`, ``torch.compile(...,
backend="ckptc", options={...})``, :func:`ckptc.capture` and the CLI all build
it with :meth:`CheckpointOptions.from_user`, which refuses an unknown name
(naming the valid ones) and a bad value (quoting it) before anything runs.
The compiler and the planner read the validated fields and nothing else; what a
step holds besides its activations is :class:`ckptc.planning.account.StepAccount`'s, not an option.
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import numbers
from dataclasses import dataclass
from typing import Any, Mapping

import solvers
from ckptc.errors import ArgumentTypeError, InvalidArgumentError, UnknownOptionError

GiB = 1024**3
# Allocators count bytes in 64-bit integers: a larger budget is a mistake in
# units (budget_bytes given as GiB, a typo in the exponent), not a real limit.
MAX_BUDGET_BYTES = 2**63 - 1

#: Strategies (see :mod:`ckptc.planning.planner`): ``"auto"`` solves under the budget, the others are presets.
STRATEGY_NAMES = ("auto", "none", "layer", "segment", "selective")
COMPILER_NAMES = ("eager", "inductor")
#: Solvers for ``strategy="auto"``: ``"auto"`` and every method (``solvers.METHODS`` has ``"auto"`` too).
SOLVER_NAMES = tuple(dict.fromkeys(("auto", *sorted(solvers.METHODS))))
#: Names users give that are not fields: a budget in GiB and a plan file to apply.
EXTRA_USER_NAMES = ("budget_gb", "plan")


def budget_to_bytes(budget_gb: float | None, budget_bytes: int | None) -> int | None:
    """Validate the two ways of giving a budget and return bytes (or None)."""
    if budget_gb is not None and budget_bytes is not None:
        raise InvalidArgumentError("give either budget_gb or budget_bytes, not both")
    value, unit = (budget_gb, "budget_gb") if budget_gb is not None else (budget_bytes, "budget_bytes")
    if value is None:
        return None
    # numbers.Real, not (int, float): numpy's integers (numpy.int64) are budgets too.
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise ArgumentTypeError(f"{unit} must be a number, not {type(value).__name__}")
    value = int(value) if isinstance(value, numbers.Integral) else float(value)
    units = "GiB" if unit == "budget_gb" else "bytes"
    if math.isnan(value) or math.isinf(value):
        raise InvalidArgumentError(f"{unit} must be a finite number of {units}, got {value!r}")
    if value <= 0:
        raise InvalidArgumentError(f"{unit} must be positive, got {value!r}")
    # A float budget_gb of 1e300 overflows to inf here; that compares above the cap.
    scaled = value * GiB if unit == "budget_gb" else value
    if scaled > MAX_BUDGET_BYTES:
        raise InvalidArgumentError(
            f"{unit}={value!r} is more than any device's memory (over 2**63 bytes); "
            f"give the budget in {units}, e.g. budget_gb=40"
        )
    nbytes = int(scaled)
    if nbytes < 1:
        raise InvalidArgumentError(
            f"{unit}={value!r} is less than one byte; give the budget in {units} "
            "(budget_gb=40 means 40 GiB, as does budget_bytes=40 * 2**30)"
        )
    return nbytes


@dataclass(frozen=True)
class CheckpointOptions:
    """What to plan for and how.

    Attributes:
        budget_bytes: peak memory allowed for one forward+backward step, or
            None for no limit (``"auto"`` then keeps everything).
        strategy: one of :data:`STRATEGY_NAMES`.
        solver: solver method for ``strategy="auto"`` (``"auto"`` or a name in
            ``solvers.METHODS``).
        compiler: ``"eager"`` runs the rewritten graphs op by op; ``"inductor"``
            compiles them with Inductor.
        must_save / must_recompute: fnmatch patterns over stable node names.
        measure_time: price recomputation by measured seconds instead of FLOPs.
        measure_scratch: run each distinct op once on random data to measure the
            temporary memory it allocates (the budget counts it).
        hold_outputs: whether forward results other than what backward needs
            stay alive until backward ends (None: a training loop counts them held
            until a step shows; a capture decides per graph, see ``ckptc.optimize``).
        time_limit: seconds the "ilp" solver may spend (None: its default); "auto" and
            "hierarchical" stop at deterministic work limits and ignore it, so plans never
            depend on machine load.
    """

    budget_bytes: int | None = None
    strategy: str = "auto"
    solver: str = "auto"
    compiler: str = "eager"
    must_save: tuple[str, ...] = ()
    must_recompute: tuple[str, ...] = ()
    measure_time: bool = False
    measure_scratch: bool = True
    hold_outputs: bool | None = None
    time_limit: float | None = None

    def __post_init__(self) -> None:
        if self.budget_bytes is not None:
            object.__setattr__(self, "budget_bytes", budget_to_bytes(None, self.budget_bytes))
        _choice("strategy", self.strategy, STRATEGY_NAMES)
        _choice("solver", self.solver, SOLVER_NAMES)
        _choice("compiler", self.compiler, COMPILER_NAMES)
        for name in ("must_save", "must_recompute"):
            value = getattr(self, name)
            if isinstance(value, str) or not all(isinstance(p, str) for p in value):
                raise InvalidArgumentError(f"{name} must be a list of patterns (strings), got {value!r}")
            object.__setattr__(self, name, tuple(value))
        for name in ("measure_time", "measure_scratch"):
            if not isinstance(getattr(self, name), bool):
                raise InvalidArgumentError(f"{name} must be True or False, got {getattr(self, name)!r}")
        if not (self.hold_outputs is None or isinstance(self.hold_outputs, bool)):
            raise InvalidArgumentError(f"hold_outputs must be None, True or False, got {self.hold_outputs!r}")
        if self.time_limit is not None and (
            isinstance(self.time_limit, bool)
            or not isinstance(self.time_limit, (int, float))
            or not 0 < self.time_limit < math.inf
        ):
            raise InvalidArgumentError(
                f"time_limit must be a positive number of seconds or None, got {self.time_limit!r}"
            )

    @classmethod
    def user_names(cls) -> tuple[str, ...]:
        """Every name a user may give (``optimize``, ``backend``, ``options={...}``), sorted."""
        return tuple(sorted({*(f.name for f in dataclasses.fields(cls)), *EXTRA_USER_NAMES}))

    @classmethod
    def from_user(cls, options: Mapping[str, Any] | None = None, /, **more: Any) -> "CheckpointOptions":
        """Options from user-given names (``budget_gb`` converted; ``plan`` is not an option of planning
        and is refused here: :func:`ckptc.backend` takes it).

        Raises:
            UnknownOptionError: an unknown name (the message lists the valid ones).
            InvalidArgumentError / ArgumentTypeError: a bad value (quoted).
        """
        if options is not None and not isinstance(options, Mapping):
            raise ArgumentTypeError(f"ckptc options must be a dict of names to values, not {type(options).__name__}")
        given = {**(options or {}), **more}
        refuse_unknown("ckptc option", set(given) - set(cls.user_names()) | ({"plan"} & set(given)), cls.user_names())
        budget = budget_to_bytes(given.pop("budget_gb", None), given.pop("budget_bytes", None))
        return cls(budget_bytes=budget, **given)

    def replace(self, **changes: Any) -> "CheckpointOptions":
        """A copy with ``changes`` (validated again)."""
        return dataclasses.replace(self, **changes)

    def __repr__(self) -> str:
        budget = "none" if self.budget_bytes is None else solvers.format_bytes(self.budget_bytes)
        changed = [
            f"{f.name}={getattr(self, f.name)!r}"
            for f in dataclasses.fields(self)
            if f.name != "budget_bytes" and getattr(self, f.name) != _default(f)
        ]
        return f"CheckpointOptions(budget={budget}{''.join(', ' + c for c in changed)})"


def _default(f: dataclasses.Field) -> Any:
    if f.default is not dataclasses.MISSING:
        return f.default
    return f.default_factory()  # type: ignore[misc]


def _choice(name: str, value: Any, choices: tuple[str, ...]) -> None:
    if not isinstance(value, str) or value not in choices:
        raise InvalidArgumentError(f"unknown {name} {value!r}; choose one of {list(choices)}")


def refuse_unknown(what: str, unknown: Any, valid: Any, noun: str = "options") -> None:
    """Raise :class:`UnknownOptionError` for the names in ``unknown`` (if any), listing the ``valid``
    ones and the closest valid name to each (``budget_gbs``: did you mean ``budget_gb``?)."""
    unknown = sorted(str(u) for u in unknown)
    if not unknown:
        return
    valid = sorted(valid)
    close = {u: difflib.get_close_matches(u, valid, n=1) for u in unknown}
    hints = "".join(f" Did you mean {c[0]!r} for {u!r}?" for u, c in close.items() if c)
    raise UnknownOptionError(f"unknown {what}(s) {unknown}; valid {noun} are {valid}.{hints}")
