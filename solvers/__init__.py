"""Activation-checkpointing planners for ckptc (pure Python, never imports torch).

Model a training step as a :class:`Problem`, ask :func:`solve` for a
:class:`Plan` that fits a memory budget, and check any plan with
:func:`simulate`, the one judge of memory and recomputation cost.

>>> import solvers
>>> problem = solvers.Problem.training_chain(16)          # 16 forward nodes of 1 byte
>>> plan = solvers.solve(problem, budget_bytes=12)
>>> solvers.simulate(problem, plan).peak_bytes <= 12
True
"""

# Order matters: solvers.api (and the solvers.hierarchical / solvers.ilp it
# registers) may import the core names from this package, so they come first.
from solvers.errors import InfeasibleBudgetError, InvalidPlanError, SolverError, format_bytes
from solvers.plan import Plan, SolveInfo, Step
from solvers.problem import BACKWARD, FORWARD, INPUT, RECOMPUTE, SAVE, Node, Problem, SizeGroup
from solvers.simulator import SimResult, schedule, simulate

# isort: split
from solvers.api import METHODS, lowest_peak_plan, min_feasible_budget, solve

__all__ = [
    "Node",
    "Problem",
    "SizeGroup",
    "Plan",
    "SolveInfo",
    "Step",
    "SimResult",
    "simulate",
    "schedule",
    "solve",
    "METHODS",
    "min_feasible_budget",
    "lowest_peak_plan",
    "InfeasibleBudgetError",
    "InvalidPlanError",
    "SolverError",
    "format_bytes",
    "INPUT",
    "FORWARD",
    "BACKWARD",
    "SAVE",
    "RECOMPUTE",
]
