"""Plans do not depend on the machine's load: the same problem and budget give the same plan.

Every rank of a DDP/FSDP2 job plans on its own and plan files are promised
byte-identical across processes, so no search may be cut by the clock.
``auto`` and ``hierarchical`` stop their MILPs at deterministic work limits;
``time_limit`` does not change their plans.  A tiny time limit stands in for
a heavily loaded machine: on today's main it cut the MILPs and gave another
plan.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import torch

import ckptc
from solvers import simulate, solve
from solvers.api import lowest_peak_plan
from solvers.chen import keep_all_plan
from solvers.hierarchical import hierarchical
from tests.graphs import random_training_graph


def _budget(problem) -> int:
    from solvers import min_feasible_budget

    lowest = min_feasible_budget(problem)
    return (3 * lowest + simulate(problem, keep_all_plan(problem)).peak_bytes) // 4


def _same(plan_a, plan_b) -> None:
    assert plan_a.kept == plan_b.kept
    assert plan_a.schedule == plan_b.schedule
    assert plan_a.info.to_dict(timings=False) == plan_b.info.to_dict(timings=False)


def test_auto_gives_the_same_plan_under_a_tiny_and_a_normal_time_limit():
    plans = []
    for time_limit in (1e-3, 60.0):
        problem = random_training_graph(60, shape="dag", seed=0)  # fresh: menus are cached per problem
        plans.append(solve(problem, _budget(problem), method="auto", time_limit=time_limit))
    _same(*plans)
    # The MILP took part (and won): the case where a clock used to change the answer.
    assert plans[0].info.chosen == "ilp" and plans[0].info.tried["ilp"]["status"] == "fits"


def test_hierarchical_menus_do_not_depend_on_the_time_limit():
    plans = []
    for time_limit in (1e-3, 60.0):
        problem = random_training_graph(200, shape="dag", seed=1)  # MILP options in its menu
        plans.append(hierarchical(problem, _budget(problem), time_limit=time_limit))
    _same(*plans)


def _mlp() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(*[torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.GELU()) for _ in range(6)])


def test_plan_files_are_identical_under_a_tiny_and_a_normal_time_limit(tmp_path):
    step = ckptc.capture(_mlp(), (torch.randn(64, 64),))
    budget = (step.floor_bytes * 3 + step.unoptimized_peak_bytes) // 4
    paths = []
    for time_limit in (1e-3, 60.0):
        paths.append(tmp_path / f"plan_{time_limit:g}.json")
        step.plan(budget_bytes=budget, time_limit=time_limit).save(paths[-1])
    assert paths[0].read_bytes() == paths[1].read_bytes()


def test_a_highs_solve_made_elsewhere_in_the_process_first_does_not_change_the_plan():
    # A user's (or a test's) pulp model solved by HiGHS with its default thread count, before
    # ckptc's first solve, starts HiGHS's process-wide scheduler; ckptc's one-thread block MILPs
    # then failed without a solution and the floor lost its nested plan (test_nested.py after
    # test_hierarchical.py in one process).  A fresh process, so that this solve comes first.
    script = """
import pulp
from solvers.api import lowest_peak_plan
from tests.graphs import random_training_graph
model = pulp.LpProblem("elsewhere", pulp.LpMinimize)
x = model.add_variable("x", cat="Binary")
model += 1.0 * x
model.solve(pulp.HiGHS(msg=False))
plan = lowest_peak_plan(random_training_graph(300, shape="skip", seed=2))
print(plan.info.candidate, plan.info.predicted_peak_bytes)
"""
    root = Path(__file__).resolve().parent.parent
    env = {**os.environ, "PYTHONPATH": str(root)}
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, cwd=root, env=env)
    assert done.returncode == 0, done.stderr
    alone = lowest_peak_plan(random_training_graph(300, shape="skip", seed=2))
    assert done.stdout.splitlines()[-1].split() == [str(alone.info.candidate), str(alone.info.predicted_peak_bytes)]
    assert alone.info.candidate == "nested"
