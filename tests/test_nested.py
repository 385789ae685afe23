"""Nested recomputation across blocks (rotor's checkpoint-and-continue on the block chain).

* The DP of :mod:`solvers.nested` is exact on its chain model: it equals an
  exhaustive enumeration of every nested schedule on random chains of up to 8
  blocks with option menus (at one byte per memory unit).
* Its plans are explicit schedules that recompute values more than once; the
  simulator accepts them, and on a random chain they lower the hierarchical
  solver's floor below what keeping every block input allows.
* ckptc plans one and runs it: a tiny GPT-2 with dropout at its floor (a
  nested plan) trains with loss and every gradient equal to eager, measured
  peak within the budget.
"""

from __future__ import annotations

import copy
import random
from collections import Counter

import numpy as np
import pytest

import ckptc
import solvers
import solvers.nested as nested
from solvers.hierarchical import lowest_peak_plan
from solvers.nested import ChainModel, decisions, nested_cost, nested_dp
from solvers.problem import clear_shared_caches
from tests.graphs import random_training_graph
from tests.helpers import assert_same_training, get_case, measure, step


def _random_model(rng: random.Random, n: int, options: int) -> ChainModel:
    kept = [np.array([rng.randint(0, 6) for _ in range(rng.randint(1, options))]) for _ in range(n)]
    need = [np.array([rng.randint(1, 10) for _ in k]) for k in kept]
    cost = [np.array([float(rng.randint(0, 9)) for _ in k]) for k in kept]
    crossing = np.zeros((n + 1, n + 1), dtype=np.int64)
    for a in range(n + 1):
        for j in range(a + 1, n + 1):
            crossing[a][j] = rng.randint(0, 4)
    return ChainModel(
        kept,
        need,
        cost,
        np.array([float(rng.randint(1, 9)) for _ in range(n)]),
        np.array([int(min(x)) for x in need]),
        crossing,
    )


def _brute_force(m: ChainModel, budget: int) -> float:
    """Least recompute cost over every nested schedule, replayed in bytes (no table)."""

    def segments(a: int, b: int, held: int, first: bool):
        """Yield the cost of each feasible way to do blocks a..b with ``held`` bytes held."""
        if a > b:
            yield 0.0
            return
        for o in range(len(m.kept[a])):
            if held + m.need[a][o] > budget or held + m.kept[a][o] > budget:
                continue
            here = m.cost[a][o] + (0.0 if first else m.forward_cost[a])
            for rest in segments(a + 1, b, held + int(m.kept[a][o]), first):
                yield here + rest
        for j in range(a + 1, b + 1):
            if any(held + m.crossing[a][k] + m.forward_need[k] > budget for k in range(a, j)):
                continue
            if held + m.crossing[a][j] > budget:
                continue
            here = 0.0 if first else float(sum(m.forward_cost[a:j]))
            later = list(segments(j, b, held + int(m.crossing[a][j]), first))
            if not later:
                continue
            earlier = list(segments(a, j - 1, held, False))
            if earlier:
                yield here + min(later) + min(earlier)

    return min(segments(0, len(m.kept) - 1, 0, True), default=float("inf"))


@pytest.mark.parametrize(("blocks", "options", "cases"), [(8, 1, 6), (6, 2, 10), (5, 3, 12)])
def test_nested_dp_equals_brute_force_on_random_chains(blocks: int, options: int, cases: int):
    rng = random.Random(blocks * 100 + options)
    nested_seen = 0
    for _ in range(cases):
        n = rng.randint(2, blocks)
        m = _random_model(rng, n, options)
        budget = rng.randint(8, 22)
        tables = nested_dp(m, budget, units=budget)  # one byte per unit: exact
        assert tables.quantum == 1
        assert nested_cost(tables) == pytest.approx(_brute_force(m, budget))
        found = decisions(tables)
        nested_seen += found is not None and any(h < 0 for _, _, h in found)
        # One table answers every smaller budget.
        smaller = budget - rng.randint(1, 4)
        assert nested_cost(tables, smaller) == pytest.approx(_brute_force(m, smaller))
    assert nested_seen, "no random chain took a checkpoint-and-continue step: the test checks nothing new"


def test_nested_plans_recompute_twice_are_valid_and_lower_the_floor(monkeypatch):
    with_nested = lowest_peak_plan(random_training_graph(300, shape="skip", seed=2))
    problem = random_training_graph(300, shape="skip", seed=2)
    assert with_nested.schedule is not None and with_nested.info.candidate == "nested"
    result = solvers.simulate(problem, with_nested)
    assert result.peak_bytes == with_nested.info.predicted_peak_bytes
    recomputed = Counter(s.node for s in with_nested.schedule if s.phase == "backward")
    forward = {n.name for n in problem.nodes if n.kind == "forward"}
    assert max(c for name, c in recomputed.items() if name in forward) >= 2, "no value recomputed twice"
    monkeypatch.setattr(nested, "MAX_NESTED_BLOCKS", 0)
    clear_shared_caches()  # the constant is not part of the memoised floor's key
    without = lowest_peak_plan(random_training_graph(300, shape="skip", seed=2))
    assert without.schedule is None
    assert with_nested.info.predicted_peak_bytes < without.info.predicted_peak_bytes


def test_gpt2_at_its_floor_runs_a_nested_schedule_like_eager_within_the_budget():
    # At seq 128 the floor is a nested plan: 3.53 MB, where keeping every block input reaches 3.77 MB.
    case = get_case("gpt2", seq_len=128)
    reference = copy.deepcopy(case.model)
    budget = ckptc.capture(case.model, case.example_inputs, case.example_kwargs, loss_fn=case.loss).floor_bytes
    optimized = ckptc.optimize(case.model, budget_bytes=budget)
    loss = step(case, optimized)
    assert_same_training(case, reference, loss, step(case, reference))
    plan = optimized.plan.graphs[0].plan
    assert plan.schedule is not None and plan.info.candidate == "nested"
    assert max(Counter(s.node for s in plan.schedule if s.phase == "backward").values()) >= 2
    assert measure(case, optimized).peak_bytes <= budget


def test_a_layer_cut_inside_frees_its_attention_during_its_mlp_backward_and_lowers_the_floor(monkeypatch):
    # A pre-norm Llama layer has one value between attention and MLP (the residual stream): on the chain
    # cut there, nested recomputation holds only the layer's input through the MLP's backward and
    # recomputes the attention after it.  Measured on this model: 1,086,283 B against 1,127,243 B.
    import solvers.hierarchical as hierarchical
    from solvers.blocks import find_blocks

    case = get_case("llama")
    reference = copy.deepcopy(case.model)
    captured = ckptc.capture(copy.deepcopy(case.model), case.example_inputs, case.example_kwargs, loss_fn=case.loss)
    problem = captured.records[0].problem
    layers = find_blocks(problem).blocks
    cut = find_blocks(problem, inside=True).blocks
    for layer in (block.label for block in layers if ".layers." in block.label):
        assert sum(block.label == layer for block in cut) == 2, layer  # attention, then MLP
    budget = captured.floor_bytes

    monkeypatch.setattr(hierarchical, "nested_menus", lambda problem: (hierarchical.build_menu(problem),))
    clear_shared_caches()  # what the patch changes is not part of the memoised floor's key
    blocks_only = ckptc.capture(copy.deepcopy(case.model), case.example_inputs, case.example_kwargs, loss_fn=case.loss)
    assert budget < blocks_only.floor_bytes
    monkeypatch.undo()
    clear_shared_caches()

    optimized = ckptc.optimize(case.model, budget_bytes=budget)
    loss = step(case, optimized)
    assert_same_training(case, reference, loss, step(case, reference))
    plan = optimized.plan.graphs[0].plan
    assert plan.schedule is not None and plan.info.candidate == "nested"
    assert measure(case, optimized).peak_bytes <= budget
