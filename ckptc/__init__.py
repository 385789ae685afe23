"""ckptc: automatic activation checkpointing for PyTorch training.

Capture a training step as a joint forward+backward graph, price every node,
solve which activations to keep under a byte budget, and rewrite the graph so
backward recomputes the rest just before it is needed.

    >>> import ckptc                                        # doctest: +SKIP
    >>> fast = ckptc.optimize(model, budget_gb=40)
    >>> fast(batch).loss.backward()
    >>> fast.plan                                           # what is kept / recomputed
"""

from ckptc.api import OptimizedModule, capture, optimize, plan
from ckptc.backend import backend
from ckptc.errors import (
    ArgumentTypeError,
    BudgetExceededError,
    CkptcError,
    CkptcWarning,
    CorruptPlanError,
    DistributedPlanMismatchError,
    InvalidArgumentError,
    PlanFileNotFoundError,
    PlanMismatchError,
    UnknownOptionError,
    UntraceableModelError,
    WrapOrderError,
)
from ckptc.inplace import applied, apply, remove
from ckptc.options import CheckpointOptions
from ckptc.planning.planner import CapturedStep
from ckptc.plans import ModelPlan, load_plan
from solvers import InfeasibleBudgetError

__version__ = "0.1.0"
# No NullHandler: without logging configured, Python's last-resort handler shows ckptc's
# warnings on stderr (configure logging.getLogger("ckptc") to route or silence them).  What a
# user must act on is also a ckptc.CkptcWarning through `warnings`, once.

__all__ = [
    "optimize",
    "apply",
    "applied",
    "remove",
    "backend",
    "plan",
    "capture",
    "CapturedStep",
    "CheckpointOptions",
    "load_plan",
    "OptimizedModule",
    "ModelPlan",
    "CkptcError",
    "CkptcWarning",
    "InvalidArgumentError",
    "ArgumentTypeError",
    "UnknownOptionError",
    "BudgetExceededError",
    "CorruptPlanError",
    "PlanFileNotFoundError",
    "PlanMismatchError",
    "UntraceableModelError",
    "InfeasibleBudgetError",
    "WrapOrderError",
    "DistributedPlanMismatchError",
]
