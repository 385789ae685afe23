"""Depth costs nothing extra (issue 21 item 5): what planning again does not redo, counted, at several depths.

Timing lives in ``bench/depth.py``; these tests count the work that used to grow
with depth: whole-graph replays of the same plan, nested DP tables built per
budget, and fill_budget simulations of prefixes that cannot fit.
"""

from __future__ import annotations

import dataclasses
import hashlib
import math
import random

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch._subclasses.fake_tensor import FakeTensorMode

import ckptc
import solvers
from solvers import nested, refine, simulator
from solvers.api import lowest_peak_plan
from solvers.hierarchical import build_menu
from solvers.problem import FORWARD_CODE
from solvers.refine import _held_after, _longest_prefix
from solvers.simulator import evaluate_mask, honour_policies_mask
from tests.graphs import layered_training_graph, random_training_graph
from tests.strategies import training_problems


class Counting:
    """Wraps a function and counts its calls."""

    def __init__(self, function):
        self.function, self.calls = function, 0

    def __call__(self, *args, **kwargs):
        self.calls += 1
        return self.function(*args, **kwargs)


def test_simulate_replays_a_plan_once_however_often_it_is_judged(monkeypatch):
    problem = layered_training_graph(6)
    replays = Counting(simulator._run)
    monkeypatch.setattr(simulator, "_run", replays)
    plan = solvers.Plan(kept=set(problem.forward_nodes[1::2]))  # a plan not judged yet
    first = solvers.simulate(problem, plan)
    again = solvers.simulate(problem, dataclasses.replace(plan, method="copy"))  # solve(), then the planner
    assert replays.calls == 1 and again is first
    other = solvers.Plan(kept=set(plan.kept) | set(problem.forward_nodes[:1]))
    assert solvers.simulate(problem, other).peak_bytes >= 0 and replays.calls == 2


@pytest.mark.parametrize("layers", [4, 16])
def test_planning_a_graph_again_builds_no_nested_table_at_any_budget_above_half_its_range(monkeypatch, layers):
    problem = layered_training_graph(layers)
    floor = lowest_peak_plan(problem).info.predicted_peak_bytes  # at capture: the floor and its tables
    top = next(peak for name, _, peak, _ in build_menu(problem).uniform if name == "keep everything")
    builds = Counting(nested.nested_dp)
    monkeypatch.setattr(nested, "nested_dp", builds)
    for fraction in (0.0, 0.5, 0.75, 1.0):
        budget = max(floor + int((top - floor) * fraction), (top + 1) // 2)
        plan = solvers.solve(problem, budget, method="hierarchical")
        assert plan.info.predicted_peak_bytes <= budget
    assert builds.calls == 0


@pytest.mark.parametrize("seed", range(6))
def test_fill_budgets_lower_bound_never_exceeds_the_simulated_peak(seed):
    rng = random.Random(seed)
    problem = random_training_graph(120, shape=rng.choice(["chain", "skip"]), seed=seed)
    mask = bytearray(len(problem.nodes))
    for v in problem._forward_idx:
        mask[v] = rng.random() < 0.3
    mask = honour_policies_mask(problem, mask)
    nodes, n_fwd = simulator.derived_schedule(problem, mask)
    candidates = list(dict.fromkeys(v for v in nodes[n_fwd:] if problem._kind[v] == FORWARD_CODE))
    rng.shuffle(candidates)
    held = _held_after(problem, mask, candidates)
    for k in range(0, len(candidates) + 1, max(1, len(candidates) // 7)):
        trial = bytearray(mask)
        for v in candidates[:k]:
            trial[v] = 1
        assert held[k] <= evaluate_mask(problem, honour_policies_mask(problem, trial)).peak_bytes


def _tiny_llama(layers: int) -> tuple[torch.nn.Module, torch.Tensor]:
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=128,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=32,
        use_cache=False,
        attn_implementation="sdpa",
    )
    return LlamaForCausalLM(config).train(), torch.randint(0, 128, (1, 32))


def test_a_plan_replays_the_whole_graph_as_often_at_4_layers_as_at_2(monkeypatch):
    counts = {}
    for layers in (2, 4):
        torch._dynamo.reset()
        with FakeTensorMode():
            model, ids = _tiny_llama(layers)
            step = ckptc.capture(model, (ids,), {"labels": ids})
        budget = (step.floor_bytes + step.unoptimized_peak_bytes) // 2
        replays, tables = Counting(simulator._resolve), Counting(nested.nested_dp)
        fingerprints = Counting(hashlib.sha256)
        monkeypatch.setattr(simulator, "_resolve", replays)
        monkeypatch.setattr(nested, "nested_dp", tables)
        monkeypatch.setattr(hashlib, "sha256", fingerprints)
        plan = step.plan(budget_bytes=budget)
        monkeypatch.undo()
        assert plan.graphs[0].predicted_peak_bytes <= budget
        counts[layers] = (replays.calls, tables.calls, fingerprints.calls)
    # One replay per method auto tries (hierarchical, chen_greedy); the floor, the unoptimized
    # plan and the judges after auto read what was simulated before.  The capture built the
    # nested tables and the fingerprint.
    assert counts[2] == counts[4] and counts[4][0] <= 2 and counts[4][1:] == (0, 0), counts


def test_the_longest_prefix_search_finds_the_last_fitting_prefix_in_log_calls():
    # fill_budget's fallback where the values its timeline estimate took do not fit together.
    for n in range(0, 40):
        for k in range(0, n + 1):
            fits = Counting(k.__ge__)  # fits(m): m <= k
            assert _longest_prefix(fits, n) == k
            assert fits.calls <= math.ceil(math.log2(n + 1))


def test_fill_budget_simulates_about_as_many_prefixes_at_64_layers_as_at_8():
    counts = {}
    for layers in (8, 64):
        problem = layered_training_graph(layers)
        per_block = ["embed", "mask"] + [f"o{i}" for i in range(layers)]
        base = solvers.Plan(kept=simulator.honour_policies(problem, per_block))
        low = solvers.simulate(problem, base).peak_bytes
        top = solvers.simulate(problem, solvers.Plan(kept=simulator.honour_policies(problem, problem.forward_nodes)))
        simulations = Counting(refine.evaluate_mask_schedule)
        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(refine, "evaluate_mask_schedule", simulations)
            for fraction in (0.1, 0.3, 0.5, 0.7, 0.9):
                budget = low + int((top.peak_bytes - low) * fraction)
                plan = refine.fill_budget(problem, base, budget)
                assert solvers.simulate(problem, plan).peak_bytes <= budget
        counts[layers] = simulations.calls
    assert counts[64] <= 1.25 * counts[8], counts


@settings(max_examples=60, deadline=None)
@given(training_problems(), st.integers(0, 2**32 - 1))
def test_the_array_structure_check_agrees_with_the_step_walk(problem, seed):
    # simulate() checks a schedule's structure in array passes and walks it step by step only to
    # name the broken rule: both must agree on every schedule, broken ones included.
    rng = random.Random(seed)
    mask = bytearray(len(problem.nodes))
    for v in problem._forward_idx:
        mask[v] = rng.random() < 0.4
    nodes, n_fwd = simulator.derived_schedule(problem, mask)
    for _ in range(6):
        steps, forward = list(nodes), n_fwd
        if steps:
            i = rng.randrange(len(steps))
            edit = rng.randrange(4)
            if edit == 0:
                del steps[i]
                forward = min(forward, len(steps))
            elif edit == 1:
                steps.insert(rng.randrange(len(steps) + 1), steps[i])
            elif edit == 2:
                steps.insert(rng.randrange(len(steps) + 1), rng.randrange(len(problem.nodes)))
            else:
                j = rng.randrange(len(steps))
                steps[i], steps[j] = steps[j], steps[i]
        holds = simulator._structure_holds(problem, steps, forward, mask)
        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(simulator, "_structure_holds", lambda *args: False)  # walk every step
            try:
                simulator._check_structure(problem, steps, forward, mask)
                walked = True
            except solvers.InvalidPlanError:
                walked = False
        assert holds == walked


def test_a_block_class_is_solved_once_per_process(monkeypatch):
    """A block class's options (its MILPs) are found once: the same graph under another baseline (a
    graph planned again) solves none and gets the same options."""
    from solvers import hierarchical
    from solvers.blocks import find_blocks
    from tests.zoo import get_case

    case = get_case("llama", size="tiny")
    step = ckptc.capture(case.model, case.example_inputs, case.example_kwargs, loss_fn=case.loss)
    problem = step.records[0].joint_problem.problem
    hierarchical.forget_solved_classes()
    solves = Counting(hierarchical._BlockMilp.solve)
    monkeypatch.setattr(hierarchical._BlockMilp, "solve", lambda self, **kw: solves(self, **kw))
    first = hierarchical.block_options(problem, find_blocks(problem))
    solved = solves.calls
    assert solved > 0, "the Llama's blocks are large enough for MILP options"
    moved = dataclasses.replace(problem, baseline_bytes=problem.baseline_bytes + 12345)
    assert hierarchical.block_options(moved, find_blocks(moved)) == first
    assert solves.calls == solved
