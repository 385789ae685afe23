"""Property tests: the simulator against a naive reference, and every solver method on random graphs.

Graphs come from :mod:`tests.strategies` (chains, chains with skip
connections, random DAGs, each with an autograd-like backward pass). The
runs are derandomized, so CI sees the same examples every time.
"""

from __future__ import annotations

from collections import defaultdict

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from solvers import (
    METHODS,
    InfeasibleBudgetError,
    InvalidPlanError,
    Plan,
    Problem,
    Step,
    min_feasible_budget,
    schedule,
    simulate,
    solve,
)
from solvers.chen import chen_sqrt, keep_all_plan
from solvers.chen import lowest_peak_plan as chen_lowest_peak
from solvers.hierarchical import lowest_peak_plan as hierarchical_lowest_peak
from solvers.simulator import honour_policies
from tests.strategies import training_problems


def fast(max_examples: int):
    return settings(
        max_examples=max_examples,
        derandomize=True,
        database=None,
        deadline=None,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
    )


# ------------------------------------------------------------ naive references
def reference_derived_schedule(problem: Problem, kept: frozenset[str], forget: tuple[bool, ...] = ()) -> list[Step]:
    """The derived schedule, written recursively and straight from the contract.

    ``forget[k]`` true: before the k-th backward node, forget every
    recomputed value, so later reads recompute it again (an explicit,
    still valid schedule with repeated recomputations).
    """
    forward = [n for n in problem.nodes if n.kind == "forward"]
    needed: set[str] = set()

    def need(name: str) -> None:
        if name not in needed and problem[name].kind == "forward":
            needed.add(name)
            for p in problem[name].preds:
                need(p)

    for n in forward:
        if n.output or n.name in kept:
            need(n.name)
    steps = [Step(n.name, "forward") for n in forward if n.name in needed]
    always = {n.name for n in forward if n.output or n.name in kept}
    have = set(always)
    parts: dict[str, list[str]] = {}
    for n in forward:
        if n.part_of is not None:
            parts.setdefault(n.part_of, []).append(n.name)

    def materialise(name: str) -> None:
        if problem[name].kind != "forward" or name in have:
            return
        for p in problem[name].preds:
            materialise(p)
        if name in have:
            return  # a part taken with its multi-output value, a pred of it
        have.add(name)
        steps.append(Step(name, "backward"))
        for part in parts.get(name, ()):  # a multi-output value's results are taken from it at once
            materialise(part)

    backward = [n for n in problem.nodes if n.kind == "backward"]
    for k, b in enumerate(backward):
        if k < len(forget) and forget[k]:
            have = set(always)
        for p in b.preds:
            materialise(p)
        steps.append(Step(b.name, "backward"))
    return steps


def reference_timeline(problem: Problem, steps: list[Step], kept: frozenset[str]) -> list[int]:
    """Live bytes after each allocation, recomputed from scratch at every step (O(steps^2)).

    Storages: a node allocates its own unless it is a view (``alias_of``: it
    pins its base's storage) or a getitem (``part_of``: it takes its bytes
    over from the multi-output value's storage, and lives at least as long as
    that storage).
    """
    n_forward = sum(1 for s in steps if s.phase == "forward")
    latest: dict[str, int] = {}
    readers: dict[int, list[int]] = defaultdict(list)
    storage_of: dict[int, int | None] = {}  # instance -> instance owning its storage
    taken_from: dict[int, int] = {}  # getitem storage -> the multi-output instance it came from
    extracted: dict[tuple[int, str], int] = {}  # (multi-output instance, getitem) -> first instance
    for i, (name, _) in enumerate(steps):
        node = problem[name]
        for p in node.preds:
            if problem[p].kind != "input":
                readers[latest[p]].append(i)
        if node.alias_of is not None:
            base = latest.get(node.alias_of)  # None: a view of an input, resident anyway
            storage_of[i] = None if base is None else storage_of[base]
        elif node.part_of is not None and node.bytes:
            whole = latest[node.part_of]
            if (whole, name) in extracted:
                storage_of[i] = storage_of[extracted[whole, name]]
            else:
                extracted[whole, name] = i
                storage_of[i] = i
                taken_from[i] = whole
        else:
            storage_of[i] = i if node.bytes else None
        latest[name] = i

    def instance_end(i: int) -> int:
        node = problem[steps[i].node]
        if node.output:
            return len(steps)
        end = max(readers[i], default=i)
        if i < n_forward and node.name in kept:
            end = max(end, n_forward - 1)
        return end

    storage_end: dict[int, int] = {}
    for i in range(len(steps)):
        s = storage_of[i]
        if s is not None:
            storage_end[s] = max(storage_end.get(s, -1), instance_end(i))
    for s, whole in taken_from.items():
        storage_end[s] = max(storage_end[s], storage_end[whole])

    def storage_bytes(s: int, t: int) -> int:
        taken = sum(problem[steps[g].node].bytes for g, w in taken_from.items() if w == s and g <= t)
        return problem[steps[s].node].bytes - taken

    timeline = []
    for t in range(len(steps)):
        live = [s for s, end in storage_end.items() if s <= t <= end]
        scratch = problem[steps[t].node].scratch
        timeline.append(problem.resident_bytes + scratch + sum(storage_bytes(s, t) for s in live))
    return timeline


def random_kept(problem: Problem, data: st.DataObject) -> frozenset[str]:
    subset = data.draw(st.sets(st.sampled_from(problem.forward_nodes)), label="kept")
    return honour_policies(problem, subset)


# ------------------------------------------------------------------ simulator
@fast(150)
@given(problem=training_problems(), data=st.data())
def test_derived_schedule_and_memory_match_the_reference(problem, data):
    kept = random_kept(problem, data)
    plan = Plan(kept=kept)
    expected_steps = reference_derived_schedule(problem, kept)
    result = simulate(problem, plan)
    assert list(result.steps) == expected_steps
    assert schedule(problem, plan) == tuple(expected_steps)
    assert list(result.timeline) == reference_timeline(problem, expected_steps, kept)
    assert result.peak_bytes == max(result.timeline, default=problem.resident_bytes)
    assert result.timeline[result.peak_step] == result.peak_bytes
    recomputed = [s.node for s in expected_steps if s.phase == "backward" and problem[s.node].kind == "forward"]
    assert len(recomputed) == len(set(recomputed))  # the derived schedule recomputes at most once
    assert result.recompute_cost == sum(problem[n].cost for n in recomputed)
    assert result.forward_cost == sum(problem[s.node].cost for s in expected_steps if s.phase == "forward")


@fast(150)
@given(problem=training_problems(), data=st.data())
def test_explicit_schedules_with_repeated_recomputation_match_the_reference(problem, data):
    kept = random_kept(problem, data)
    forget = tuple(data.draw(st.lists(st.booleans(), max_size=len(problem.backward_nodes)), label="forget"))
    steps = reference_derived_schedule(problem, kept, forget)
    plan = Plan(kept=kept, schedule=steps)
    result = simulate(problem, plan)
    assert schedule(problem, plan) == tuple(steps)
    assert list(result.timeline) == reference_timeline(problem, steps, kept)


@fast(150)
@given(problem=training_problems(), data=st.data())
def test_broken_schedules_are_rejected_or_still_exact(problem, data):
    kept = random_kept(problem, data)
    steps = reference_derived_schedule(problem, kept)
    drop = data.draw(st.integers(0, len(steps) - 1), label="drop")
    broken = steps[:drop] + steps[drop + 1 :]
    try:
        result = simulate(problem, Plan(kept=kept, schedule=broken))
    except InvalidPlanError as e:
        assert "step" in str(e) or "never computed" in str(e) or "not computed" in str(e)
        return
    # Dropping a step that nothing needed (e.g. a dead forward value) is fine.
    assert list(result.timeline) == reference_timeline(problem, broken, kept)


# -------------------------------------------------------------------- methods
# Every method sees EXAMPLES random graphs. Cheap methods share one run
# (generation is paid once) and are checked at min_feasible_budget, the
# keep-all peak, a random budget between them and one below. MILP-backed
# methods (ilp, hierarchical, and auto, which calls both) get smaller graphs
# and one of those budgets per example, drawn, to keep the suite fast.
# 200: each example's floor (min_feasible_budget, MILPs of its own) is most of the time; 200 graphs
# still draw every shape, policies, views and multi-output ops many times over, and each
# MILP-backed method about 50 times at each of the four budgets.
EXAMPLES = 200
MAX_FORWARD = 8
MILP_MAX_FORWARD = 4
CHEAP = ("chen_sqrt", "chen_greedy")


def _may_fail(method: str, problem: Problem, budget: int, highest: int) -> bool:
    """Whether InfeasibleBudgetError is acceptable at a budget in [min_feasible_budget, keep-all peak]."""
    if method == "chen_sqrt":
        return budget < simulate(problem, chen_sqrt(problem)).peak_bytes
    if method == "chen_greedy":
        return budget < chen_lowest_peak(problem).info.predicted_peak_bytes
    if method == "hierarchical":
        return budget < hierarchical_lowest_peak(problem).info.predicted_peak_bytes
    if method == "auto":
        return False  # it reaches min_feasible_budget by definition
    # ilp: another schedule family; it must at least match keep-all.
    return budget < highest


def _check_fits(method: str, problem: Problem, budget: int, highest: int) -> None:
    try:
        plan = solve(problem, budget, method)
    except InfeasibleBudgetError:
        assert _may_fail(method, problem, budget, highest), f"{method} failed at feasible budget {budget}"
        return
    result = simulate(problem, plan)
    assert result.peak_bytes <= budget
    assert plan.info.predicted_peak_bytes == result.peak_bytes
    assert plan.info.recompute_cost == result.recompute_cost
    assert plan.budget_bytes == budget


def _check_below(method: str, problem: Problem, below: int, lowest: int) -> None:
    if method in ("chen_sqrt", "chen_greedy"):
        with pytest.raises(InfeasibleBudgetError) as info:
            solve(problem, below, method)
        assert info.value.min_feasible_bytes >= lowest
        assert f"({info.value.min_feasible_bytes} bytes)" in str(info.value)
        return
    # Schedules with repeated recomputation may go below the Chen family's bound.
    try:
        plan = solve(problem, below, method)
    except InfeasibleBudgetError as e:
        assert e.min_feasible_bytes is not None
    else:
        assert simulate(problem, plan).peak_bytes <= below


def _budgets(problem: Problem, data: st.DataObject) -> tuple[int, int, int, int | None]:
    lowest = min_feasible_budget(problem)
    highest = simulate(problem, keep_all_plan(problem)).peak_bytes
    assert lowest <= highest
    between = data.draw(st.integers(lowest, highest), label="budget")
    below = data.draw(st.integers(0, lowest - 1), label="below") if lowest > 0 else None
    return lowest, between, highest, below


@fast(EXAMPLES)
@given(problem=training_problems(max_forward=MAX_FORWARD), data=st.data())
def test_cheap_methods_fit_every_feasible_budget(problem, data):
    lowest, between, highest, below = _budgets(problem, data)
    for method in [m for m in CHEAP if m in METHODS]:
        for budget in sorted({lowest, between, highest}):
            _check_fits(method, problem, budget, highest)
        if below is not None:
            _check_below(method, problem, below, lowest)


@fast(EXAMPLES)
@given(problem=training_problems(max_forward=MILP_MAX_FORWARD), data=st.data())
def test_milp_backed_methods_fit_every_feasible_budget(problem, data):
    lowest, between, highest, below = _budgets(problem, data)
    for method in [m for m in sorted(METHODS) if m not in CHEAP]:
        choice = data.draw(st.sampled_from(["lowest", "between", "highest", "below"]), label=method)
        if choice == "below":
            if below is not None:
                _check_below(method, problem, below, lowest)
        else:
            budgets = {"lowest": lowest, "between": between, "highest": highest}
            _check_fits(method, problem, budgets[choice], highest)


@fast(60)
@given(problem=training_problems(shapes=("chain",), min_forward=8, max_forward=24, policies=False))
def test_chen_greedy_is_never_worse_than_keep_all_or_sqrt(problem):
    lowest = min_feasible_budget(problem)
    assert lowest <= simulate(problem, keep_all_plan(problem)).peak_bytes
    assert lowest <= simulate(problem, chen_sqrt(problem)).peak_bytes
    sqrt = chen_sqrt(problem)
    sqrt_peak = simulate(problem, sqrt).peak_bytes
    greedy = solve(problem, sqrt_peak, "chen_greedy")
    assert greedy.info.recompute_cost <= simulate(problem, sqrt).recompute_cost


@fast(60)
@given(problem=training_problems(max_forward=MAX_FORWARD), data=st.data())
def test_chens_threshold_is_recorded_in_whole_bytes_as_plan_files_read_it(problem, data):
    # A plan file records a plan's SolveInfo and reads back whole numbers where it declares them: chen_greedy
    # wrote its threshold as the float its search bisected (4216.84...), and the file of a plan whose graph
    # ran Chen's lowest-peak plan (a budget at the floor) was refused as damaged when applied.
    _, between, _, _ = _budgets(problem, data)
    lowest = chen_lowest_peak(problem)
    floor = lowest.info.predicted_peak_bytes  # Chen's own: the families' lowest may be another's
    plans = [lowest, solve(problem, floor, "chen_greedy"), solve(problem, max(between, floor), "chen_greedy")]
    for plan in plans:
        assert plan.info.threshold_bytes is None or type(plan.info.threshold_bytes) is int, plan.info
