"""The alternatives ckptc is compared against, and ckptc itself, as runnable configurations.

Every alternative takes a fresh copy of the model (same weights) and returns a
:class:`Runner`: a callable with the model's signature plus the module whose
parameters receive gradients.  The benchmark (:mod:`bench.run`) drives all of
them through the same training step, meter and FLOP counter.

Families:

* ``eager``: plain PyTorch, no checkpointing (the reference).
* ``ckpt_every`` / ``ckpt_every_other``: per-block ``torch.utils.checkpoint``
  (``use_reentrant=False``).  For Hugging Face models "every block" is the
  library's own ``gradient_checkpointing_enable``; "every other block" (and
  both for other models) wraps block ``forward`` methods with
  :func:`wrap_blocks`.
* ``library_ckpt``: a library's own checkpointing switch where one exists and
  is not Hugging Face's (enformer-pytorch's ``use_checkpointing``, which
  checkpoints each transformer block with ``checkpoint_sequential``).
* ``aot_eager``: ``torch.compile(model, backend="aot_eager")`` with
  ``torch._functorch.config.activation_memory_budget`` (min-cut partitioner).
* ``ckptc``: ``ckptc.optimize`` with a solver at a byte budget, or a strategy.
"""

from __future__ import annotations

import collections
import contextlib
import copy
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator

import torch
from torch import nn
from torch.utils import flop_counter as _flop_counter

import ckptc
from ckptc.pricing.costs import op_flops
from tests.per_block import find_block_containers, wrap_blocks

# --------------------------------------------------------------------------- #
# Repeated blocks                                                              #
# --------------------------------------------------------------------------- #


# Per-block checkpointing as users write it lives with the tests (which may not import bench).


def is_hf_model(model: nn.Module) -> bool:
    return hasattr(model, "gradient_checkpointing_enable") and getattr(model, "supports_gradient_checkpointing", False)


# --------------------------------------------------------------------------- #
# FLOPs of one step, compiled graphs included                                  #
# --------------------------------------------------------------------------- #


class _Tally:
    """Stands in for ``FlopCounterMode`` behind ``_FlopCounterMode``: the same
    formulas (``torch.utils.flop_counter.flop_registry``) and the same
    decomposition of ops without one, summed into ``total``.

    ``every_op_total`` sums the same ops with ckptc's cost model
    (:func:`ckptc.pricing.costs.op_flops`): the same formulas, and every other
    op priced by the elements it reads and writes.  FlopCounterMode counts
    pointwise ops and reductions as 0, so a plan that recomputes only those
    (a scan written as a loop of pointwise ops, say) shows 0% recompute there
    whatever its cost; both sides of a comparison are counted both ways."""

    def __init__(self) -> None:
        self.flop_registry = dict(_flop_counter.flop_registry)
        self.flop_counts: dict[str, dict[Any, int]] = collections.defaultdict(lambda: collections.defaultdict(int))
        self.total = 0
        self.every_op_total = 0
        self.op: Any = None  # the overload being counted (FlopCounterMode passes only its packet)

    def _count_flops(self, packet: Any, out: Any, args: Any, kwargs: Any) -> Any:
        formula = self.flop_registry.get(packet)
        if formula is not None:
            self.total += int(formula(*args, **kwargs, out_val=out))
        if isinstance(self.op, torch._ops.OpOverload) and self.op.overloadpacket is packet:
            self.every_op_total += op_flops(self.op, args, kwargs or {}, out)
        return out


class _CompiledFlopMode(_flop_counter._FlopCounterMode):
    # ``FlopCounterMode`` as is makes torch.compile'd code fall back to eager while it
    # is active (a dispatch mode that does not ignore compile internals disables
    # Dynamo), so it would count eager FLOPs for aot_eager and ckptc.  Ignoring
    # compile internals keeps the compiled graphs running, and their aten ops,
    # recomputation included, still pass through this mode.  FlopCounterMode's
    # module tracker is left out on purpose: its hooks make Dynamo recompile.
    @classmethod
    def ignore_compile_internals(cls) -> bool:
        return True

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        # An op without a formula is decomposed inside the parent's dispatch and only its leaves
        # are counted, each right after it is recorded here.
        self.counter.op = func
        return super().__torch_dispatch__(func, types, args, kwargs)


@contextlib.contextmanager
def count_flops() -> Iterator[_Tally]:
    """``with count_flops() as tally: step()`` then ``tally.total``: FlopCounterMode's exact count."""
    tally = _Tally()
    with _CompiledFlopMode(tally):  # type: ignore[arg-type]
        yield tally


# --------------------------------------------------------------------------- #
# Alternatives                                                                 #
# --------------------------------------------------------------------------- #


@dataclass
class Runner:
    """A configured model: call it like the model; ``module`` owns the parameters."""

    call: Callable[..., Any]
    module: nn.Module
    info: dict[str, Any] = field(default_factory=dict)
    # ckptc's OptimizedModule (to read its plan after the first step)
    optimized: Any = None


class Skip(Exception):
    """This alternative does not apply to this model (the message says why)."""


@dataclass(frozen=True)
class Alternative:
    """One point to measure: ``family`` and its settings."""

    family: str  # eager | ckpt_every | ckpt_every_other | library_ckpt | aot_eager | ckptc | ckptc_strategy
    label: str
    solver: str | None = None
    strategy: str | None = None
    budget_bytes: int | None = None
    budget_fraction: float | None = None  # aot_eager's activation_memory_budget, or ckptc's place in [floor, unopt]
    budget_kind: str | None = None  # "below_floor", "range"
    compiled: bool = False

    def to_dict(self) -> dict[str, Any]:
        return {k: v for k, v in self.__dict__.items()}

    def build(self, model: nn.Module, *, time_limit: float | None = None) -> Runner:
        """Configure ``model`` (a fresh copy, modified in place) for this alternative."""
        if self.family == "eager":
            return Runner(model, model)
        if self.family == "ckpt_every":
            if is_hf_model(model):
                model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
                return Runner(model, model, {"how": "Hugging Face gradient_checkpointing_enable(use_reentrant=False)"})
            wrapped, how = wrap_blocks(model, every=1)
            if not wrapped:
                raise Skip(how)
            return Runner(model, model, {"how": how, "wrapped": wrapped})
        if self.family == "ckpt_every_other":
            wrapped, how = wrap_blocks(model, every=2)
            if not wrapped:
                raise Skip(how)
            return Runner(model, model, {"how": how, "wrapped": wrapped})
        if self.family == "library_ckpt":
            if hasattr(model, "use_checkpointing") and hasattr(model, "trunk_checkpointed"):
                model.use_checkpointing = True
                return Runner(
                    model,
                    model,
                    {"how": "enformer-pytorch use_checkpointing=True (checkpoint_sequential over transformer blocks)"},
                )
            raise Skip("the model's library has no checkpointing switch of its own (other than Hugging Face's)")
        if self.family == "aot_eager":
            compiled = torch.compile(model, backend="aot_eager")
            budget = self.budget_fraction

            def call(*args: Any, **kwargs: Any) -> Any:
                # The partition happens at the first call; patching every call keeps
                # a recompilation (new guards) under the same budget.
                with torch._functorch.config.patch(activation_memory_budget=budget):
                    return compiled(*args, **kwargs)

            return Runner(call, model, {"activation_memory_budget": budget})
        if self.family in ("ckptc", "ckptc_strategy"):
            fast = ckptc.optimize(model, **self.ckptc_options(time_limit))
            return Runner(fast, model, {}, optimized=fast)
        raise ValueError(f"unknown family {self.family!r}")

    def ckptc_options(self, time_limit: float | None = None) -> dict[str, Any]:
        """How this point configures ckptc: the options of ``ckptc.optimize`` and of the offline
        plan (:meth:`ckptc.CapturedStep.plan`) alike, so both decide the same plan."""
        if self.family == "ckptc":
            options: dict[str, Any] = {
                "budget_bytes": self.budget_bytes,
                "strategy": "auto",
                "solver": self.solver or "auto",
            }
            if time_limit is not None and self.solver in ("ilp", "auto"):
                options["time_limit"] = time_limit
            return options
        if self.family == "ckptc_strategy":
            return {"budget_bytes": self.budget_bytes, "strategy": self.strategy or "auto"}
        raise ValueError(f"{self.family!r} is not a ckptc point")


SOLVERS = ("chen_sqrt", "chen_greedy", "hierarchical", "ilp", "auto")
STRATEGIES = ("layer", "segment", "selective")
AOT_BUDGETS = (0.0, 0.25, 0.5, 0.75, 1.0)


def fmt_mib(nbytes: int | float | None) -> str:
    """MiB with three significant digits at least (tiny models have sub-MiB budgets)."""
    if nbytes is None:
        return "-"
    value = nbytes / 2**20
    return f"{value:.1f}" if value >= 100 else f"{value:.3g}"


def ckptc_budgets(
    unopt: int, floor: int, fractions: tuple[float, ...], below: tuple[float, ...], lower: int | None = None
) -> list[tuple[str, float, int]]:
    """(kind, fraction, bytes): budgets in [floor, unopt] at ``fractions``, and
    budgets under the floor at ``below`` fractions of the way from the floor down
    to ``lower`` (``floor - f * (floor - lower)``), where ilp may still
    find plans: the floor is the Chen family's lowest peak, not the true minimum.
    ``lower`` is a hard bound such as parameters + inputs + gradients
    (default: half the floor)."""
    span = max(unopt - floor, 1)
    lower = floor // 2 if lower is None else min(lower, floor)
    out = [("range", f, int(floor + f * span)) for f in fractions]
    out += [("below_floor", -f, int(floor - f * (floor - lower))) for f in below]
    return out


def alternatives_for(
    model: nn.Module,
    unopt: int,
    floor: int,
    *,
    solvers: tuple[str, ...] = SOLVERS,
    fractions: tuple[float, ...] = (0.0, 1 / 3, 2 / 3, 1.0),
    below: tuple[float, ...] = (0.5, 0.85),
    aot_budgets: tuple[float, ...] = AOT_BUDGETS,
    strategies: tuple[str, ...] = STRATEGIES,
    lower: int | None = None,
) -> list[Alternative]:
    """Every alternative to run on ``model``, eager first."""
    alts = [
        Alternative("eager", "eager"),
        Alternative("ckpt_every", "ckpt every block"),
        Alternative("ckpt_every_other", "ckpt every other block"),
    ]
    if hasattr(model, "use_checkpointing") and hasattr(model, "trunk_checkpointed"):
        alts.append(Alternative("library_ckpt", "enformer use_checkpointing"))
    for b in aot_budgets:
        alts.append(Alternative("aot_eager", f"aot_eager budget={b:g}", budget_fraction=b, compiled=True))
    for kind, frac, nbytes in ckptc_budgets(unopt, floor, fractions, below, lower):
        for s in solvers:
            floor_note = " (floor)" if kind == "range" and frac == 0 else ""
            alts.append(
                Alternative(
                    "ckptc",
                    f"ckptc {s} @{fmt_mib(nbytes)}MiB{floor_note}",
                    solver=s,
                    budget_bytes=nbytes,
                    budget_fraction=frac,
                    budget_kind=kind,
                    compiled=True,
                )
            )
    for s in strategies:
        alts.append(Alternative("ckptc_strategy", f"ckptc strategy={s}", strategy=s, compiled=True))
    return alts


def fresh_copy(model: nn.Module) -> nn.Module:
    return copy.deepcopy(model)


__all__ = [
    "Alternative",
    "Runner",
    "Skip",
    "SOLVERS",
    "STRATEGIES",
    "AOT_BUDGETS",
    "alternatives_for",
    "ckptc_budgets",
    "count_flops",
    "find_block_containers",
    "wrap_blocks",
    "is_hf_model",
    "fresh_copy",
    "fmt_mib",
]
