"""Simulator semantics on small hand-built graphs, plus the solvers' plain-data API.

Every expected timeline below is worked out by hand in the comments: "+x"
is the step's allocation (sampled), "free y" what dies right after it.
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path

import networkx as nx
import pytest

from solvers import (
    METHODS,
    InfeasibleBudgetError,
    InvalidPlanError,
    Node,
    Plan,
    Problem,
    SolveInfo,
    SolverError,
    Step,
    min_feasible_budget,
    schedule,
    simulate,
    solve,
)
from solvers.api import lowest_peak_plan
from solvers.chen import chen_greedy, chen_sqrt, cut_points, keep_all_plan
from solvers.chen import lowest_peak_plan as chen_lowest_peak_plan
from solvers.refine import drop_unread, fill_budget
from solvers.simulator import honour_policies

REPO = Path(__file__).resolve().parents[1]


def fwd(name, nbytes, preds, cost=1.0, **kw):
    return Node(name, nbytes, cost, "forward", tuple(preds), **kw)


def bwd(name, nbytes, preds, **kw):
    return Node(name, nbytes, 1.0, "backward", tuple(preds), **kw)


def steps(*pairs):
    """steps("f1", "f2", "|", "b2") -> forward steps before "|", backward after."""
    phase, out = "forward", []
    for p in pairs:
        if p == "|":
            phase = "backward"
        else:
            out.append(Step(p, phase))
    return tuple(out)


# --------------------------------------------------------------------- fixtures
@pytest.fixture
def chain():
    """x(100, input) -> f1(10) -> f2(20) -> f3(1, loss); b3 reads f3,f2; b2 reads b3,f1; b1 reads b2,x."""
    return Problem(
        [
            Node("x", 100, 0.0, "input"),
            fwd("f1", 10, ["x"], cost=1.0),
            fwd("f2", 20, ["f1"], cost=2.0),
            fwd("f3", 1, ["f2"], cost=4.0, output=True),
            bwd("b3", 2, ["f3", "f2"]),
            bwd("b2", 4, ["b3", "f1"]),
            bwd("b1", 8, ["b2", "x"], output=True),
        ]
    )


@pytest.fixture
def residual():
    """a(4) = f(x); b(6) = g(a); c(2) = a + b (loss). Grads: gc, gb (reads a), acc_a = gc + gb, gx."""
    return Problem(
        [
            Node("x", 0, 0.0, "input"),
            fwd("a", 4, ["x"], cost=3.0),
            fwd("b", 6, ["a"]),
            fwd("c", 2, ["a", "b"], output=True),
            bwd("gc", 1, ["c"]),
            bwd("gb", 2, ["gc", "a"]),
            bwd("acc_a", 4, ["gc", "gb"]),
            bwd("gx", 1, ["acc_a", "x"], output=True),
        ]
    )


@pytest.fixture
def viewed():
    """a(4) = f(x); v = view(a); c(2, loss) = g(v); gc(3) reads c, v; ga(5, output) reads gc, x."""
    return Problem(
        [
            Node("x", 10, 0.0, "input"),
            fwd("a", 4, ["x"]),
            fwd("v", 0, ["a"], alias_of="a"),
            fwd("c", 2, ["v"], output=True),
            bwd("gc", 3, ["c", "v"]),
            bwd("ga", 5, ["gc", "x"], output=True),
        ]
    )


# -------------------------------------------------------------------- chains
def test_chain_keep_all(chain):
    r = simulate(chain, Plan(kept={"f1", "f2"}))
    # f1 +10 =110 | f2 +20 =130 | f3 +1 =131 | b3 +2 =133, free f2 | b2 +4 =117, free b3 f1
    # | b1 +8 =113
    assert r.timeline == (110, 130, 131, 133, 117, 113)
    assert (r.peak_bytes, r.peak_step) == (133, 3)
    assert r.recompute_cost == 0 and r.recompute_steps == 0
    assert r.forward_cost == 7.0
    assert r.forward_peak_bytes == 131
    assert r.kept_bytes == 30
    assert r.peak_node == "b3"


def test_chain_keep_none(chain):
    r = simulate(chain, Plan(kept=()))
    assert r.steps == steps("f1", "f2", "f3", "|", "f1", "f2", "b3", "b2", "b1")
    # f1 110 | f2 130, free f1 | f3 121, free f2 | f1 111 | f2 131 | b3 133, free f2
    # | b2 117, free b3 f1 | b1 113
    assert r.timeline == (110, 130, 121, 111, 131, 133, 117, 113)
    assert r.peak_bytes == 133 and r.peak_step == 5
    assert r.recompute_cost == 3.0 and r.recompute_steps == 2
    assert r.kept_bytes == 0


def test_chain_keep_first(chain):
    r = simulate(chain, Plan(kept={"f1"}))
    assert r.steps == steps("f1", "f2", "f3", "|", "f2", "b3", "b2", "b1")
    # f1 110 | f2 130 | f3 131, free f2 | f2 131 | b3 133, free f2 | b2 117 | b1 113
    assert r.timeline == (110, 130, 131, 131, 133, 117, 113)
    assert r.recompute_cost == 2.0
    assert r.kept_bytes == 10


def test_explicit_schedule_recomputes_twice(chain):
    # A dp-style schedule: f1 is recomputed twice so that it never overlaps f2's
    # second instance for long.
    sched = steps("f1", "f2", "f3", "|", "f1", "f2", "b3", "f1", "b2", "b1")
    r = simulate(chain, Plan(kept=(), schedule=sched))
    # f1 110 | f2 130, free f1 | f3 121, free f2 | f1 111 | f2 131, free f1 | b3 123, free f2
    # | f1 113 | b2 117, free b3 f1 | b1 113
    assert r.timeline == (110, 130, 121, 111, 131, 123, 113, 117, 113)
    assert r.peak_bytes == 131
    assert r.recompute_cost == 1.0 + 2.0 + 1.0 and r.recompute_steps == 3
    assert schedule(chain, Plan(kept=(), schedule=sched)) == sched


def test_baseline_and_inputs_are_resident(chain):
    shifted = Problem(chain.nodes, baseline_bytes=1000)
    a, b = simulate(chain, Plan(kept={"f1"})), simulate(shifted, Plan(kept={"f1"}))
    assert [t + 1000 for t in a.timeline] == list(b.timeline)
    assert shifted.resident_bytes == 1100


def test_empty_forward_only_problem():
    p = Problem([Node("x", 5, 0.0, "input")], baseline_bytes=3)
    r = simulate(p, Plan())
    assert r.timeline == () and r.peak_bytes == 8 and r.peak_step == -1


@pytest.mark.parametrize("method", METHODS)
def test_a_forward_without_a_result_has_no_block_chain_and_every_method_solves_it(method):
    """A graph whose forward returns nothing (its values reach only the backward) has no forward path,
    so no block: the hierarchical menu is its uniform plans (it indexed an empty list of blocks)."""
    p = Problem(
        nodes=(
            Node("x", 8, 0.0, "input"),
            Node("a", 8, 1.0, "forward", ("x",)),
            Node("b", 8, 1.0, "forward", ("a",)),
            Node("grad_b", 8, 1.0, "backward", ("b",)),
            Node("grad_x", 8, 1.0, "backward", ("grad_b", "a"), output=True),
        )
    )
    floor = min_feasible_budget(p)
    for budget in (floor, 10**6):
        assert simulate(p, solve(p, budget, method=method)).peak_bytes <= budget


def test_training_chain_helper_and_sqrt_beats_keep_all():
    p = Problem.training_chain(16)
    assert p.forward_nodes == tuple(f"f{i}" for i in range(1, 17))
    keep_all = simulate(p, keep_all_plan(p)).peak_bytes
    sqrt = simulate(p, chen_sqrt(p)).peak_bytes
    assert keep_all == 17  # 16 activations + the first gradient
    assert sqrt < keep_all


# ------------------------------------------------------------------ residual
def test_residual_cut_points(residual):
    # a -> c jumps over b, and a (4 bytes) is more than half of b (6 bytes).
    assert cut_points(residual) == ("a", "c")


def test_residual_keep_a(residual):
    r = simulate(residual, Plan(kept={"a"}))
    assert r.steps == steps("a", "b", "c", "|", "gc", "gb", "acc_a", "gx")
    # a 4 | b 10 | c 12, free b | gc 7 | gb 9, free a (kept, last read) | acc_a 9, free gc gb
    # | gx 7
    assert r.timeline == (4, 10, 12, 7, 9, 9, 7)
    assert r.recompute_cost == 0


def test_residual_keep_none(residual):
    r = simulate(residual, Plan(kept=()))
    assert r.steps == steps("a", "b", "c", "|", "gc", "a", "gb", "acc_a", "gx")
    # a 4 | b 10 | c 12, free a b | gc 3 | a 7 | gb 9, free a | acc_a 9, free gc gb | gx 7
    assert r.timeline == (4, 10, 12, 3, 7, 9, 9, 7)
    assert r.recompute_cost == 3.0


def test_small_value_read_by_every_block_does_not_hide_block_boundaries():
    # mask (2 bytes) is read by both blocks, like a causal mask; t1 is a
    # forward node only backward reads (a transpose), and is off the forward path.
    p = Problem(
        [
            Node("x", 0, 0.0, "input"),
            fwd("mask", 2, []),
            fwd("h1", 8, ["x", "mask"]),
            fwd("a1", 8, ["h1"]),
            fwd("h2", 8, ["a1", "mask"]),
            fwd("a2", 8, ["h2"], output=True),
            fwd("t1", 0, ["h1"], alias_of="h1"),
            bwd("g2", 8, ["a2", "h2"]),
            bwd("g1", 8, ["g2", "h1", "t1", "mask"], output=True),
        ]
    )
    # mask crosses h1, a1 and h2 but holds at most half of their bytes.
    assert cut_points(p) == ("mask", "h1", "a1", "h2", "a2")
    from solvers.chen import _checkpoint, _cut_structure

    cuts, extras = _cut_structure(p)
    mask = bytearray(len(p))
    _checkpoint(p, mask, p.index["a1"], extras)
    assert {p.nodes[i].name for i, m in enumerate(mask) if m} == {"a1", "mask"}


# -------------------------------------------------------------------- aliases
def test_alias_keep_none(viewed):
    r = simulate(viewed, Plan(kept=()))
    assert r.steps == steps("a", "v", "c", "|", "a", "v", "gc", "ga")
    # a 14 | v 14 (pins a) | c 16, free v -> a's storage | a 16 | v 16 | gc 19, free v (a's storage)
    # | ga 20
    assert r.timeline == (14, 14, 16, 16, 16, 19, 20)


def test_kept_view_pins_its_base(viewed):
    r = simulate(viewed, Plan(kept={"v"}))
    # a's instance dies after v (its last reader), but v is kept and pins a's 4
    # bytes until gc: a 14 | v 14 | c 16 (a still counted) | gc 19, free v -> a | ga 20
    assert r.timeline == (14, 14, 16, 19, 20)
    assert r.kept_bytes == 4
    assert r.recompute_cost == 0


def test_multi_output_getitems_share_storage():
    # op returns two tensors in one 12-byte allocation; keeping one getitem keeps all 12.
    p = Problem(
        [
            Node("x", 0, 0.0, "input"),
            fwd("op", 12, ["x"]),
            fwd("g0", 0, ["op"], alias_of="op"),
            fwd("g1", 0, ["op"], alias_of="op"),
            fwd("y", 1, ["g0", "g1"], output=True),
            bwd("dy", 2, ["y", "g1"], output=True),
        ]
    )
    r = simulate(p, Plan(kept={"g1"}))
    # op 12 | g0 12 | g1 12 | y 13, free g0 (op's storage still pinned by kept g1) | dy 15
    assert r.timeline == (12, 12, 12, 13, 15)
    assert r.kept_bytes == 12
    assert p.alias_root("g1") == "op"


def test_getitems_of_a_multi_output_op_take_over_their_bytes():
    # op allocates its two outputs (8 + 4 bytes); each getitem (part_of=op) takes
    # its output over, so the outputs die one by one.
    p = Problem(
        [
            Node("x", 0, 0.0, "input"),
            fwd("op", 12, ["x"]),
            fwd("g0", 8, ["op"], part_of="op"),
            fwd("g1", 4, ["op"], part_of="op"),
            fwd("y", 1, ["g0"], output=True),
            bwd("dy", 2, ["y", "g1"], output=True),
        ]
    )
    r = simulate(p, Plan(kept={"g1"}))
    # op 12 | g0 +8 -8 = 12 | g1 +4 -4 = 12, free op (nothing left) | y 13, free g0 | dy 4 + 1 + 2 = 7
    assert r.timeline == (12, 12, 12, 13, 7)
    assert r.kept_bytes == 4


def test_a_getitem_lives_as_long_as_its_multi_output_value():
    p = Problem(
        [
            Node("x", 0, 0.0, "input"),
            fwd("op", 12, ["x"]),
            fwd("g0", 8, ["op"], part_of="op"),
            fwd("y", 1, ["g0"]),
            fwd("z", 2, ["op", "y"], output=True),  # reads the whole tuple after g0's last reader
            bwd("dz", 1, ["z"], output=True),
        ]
    )
    r = simulate(p, Plan())
    # op 12 | g0 12 | y 13, g0 referenced by op until op dies | z 15, free op (4) and g0 (8) | dz 3
    assert r.timeline == (12, 12, 13, 15, 3)


def test_scratch_bytes_count_only_while_the_op_runs(chain):
    nodes = list(chain.nodes)
    nodes[2] = fwd("f2", 20, ["f1"], cost=2.0, scratch=50)
    p = Problem(nodes)
    r = simulate(p, Plan(kept=()))
    # as test_chain_keep_none, plus 50 at both executions of f2 (steps 1 and 4)
    assert r.timeline == (110, 180, 121, 111, 181, 133, 117, 113)
    assert r.peak_bytes == 181 and r.peak_step == 4


def test_view_of_input_costs_nothing():
    p = Problem(
        [
            Node("w", 64, 0.0, "input"),
            fwd("wt", 0, ["w"], alias_of="w"),
            fwd("y", 2, ["wt"], output=True),
            bwd("dy", 1, ["y", "wt"], output=True),
        ]
    )
    r = simulate(p, Plan(kept={"wt"}))
    assert r.timeline == (64, 66, 67)
    assert r.kept_bytes == 0


def test_backward_view_extends_a_saved_storage():
    # A backward node viewing a kept forward value keeps its storage until the view dies.
    p = Problem(
        [
            Node("x", 0, 0.0, "input"),
            fwd("a", 8, ["x"]),
            fwd("y", 1, ["a"], output=True),
            bwd("av", 0, ["a"], alias_of="a"),
            bwd("g1", 2, ["y"]),
            bwd("g2", 4, ["g1", "av"], output=True),
        ]
    )
    r = simulate(p, Plan(kept={"a"}))
    # a 8 | y 9 | av 9 (a's last read: storage pinned by av) | g1 11 | g2 15, free g1 av -> a
    assert r.timeline == (8, 9, 9, 11, 15)
    assert r.peak_bytes == 15


# --------------------------------------------------------------------- outputs
def test_forward_output_lives_to_the_end():
    p = Problem(
        [
            Node("x", 0, 0.0, "input"),
            fwd("h", 4, ["x"]),
            fwd("logits", 16, ["h"], output=True),  # returned to the user
            fwd("loss", 1, ["logits"], output=True),
            bwd("dl", 2, ["loss", "h"]),
            bwd("dh", 1, ["dl", "x"], output=True),
        ]
    )
    r = simulate(p, Plan(kept={"h"}))
    # h 4 | logits 20 | loss 21 | dl 23, free h | dh 20 (logits, loss, dl, dh), free dl
    assert r.timeline == (4, 20, 21, 23, 20)
    assert r.timeline[-1] >= 16 + 1 + 1  # logits, loss and dh still alive


def test_forward_value_only_backward_reads_is_computed_in_forward_only_when_kept():
    # wt = transpose(w) is a forward node that only backward reads.
    p = Problem(
        [
            Node("x", 0, 0.0, "input"),
            Node("w", 16, 0.0, "input"),
            fwd("y", 1, ["x", "w"], output=True),
            fwd("wt", 8, ["w"], cost=2.0),
            bwd("dx", 2, ["y", "wt"], output=True),
        ]
    )
    r = simulate(p, Plan())
    assert r.steps == steps("y", "|", "wt", "dx")
    assert r.timeline == (17, 25, 27) and r.recompute_cost == 2.0
    r = simulate(p, Plan(kept={"wt"}))
    assert r.steps == steps("y", "wt", "|", "dx")
    assert r.timeline == (17, 25, 27) and r.recompute_cost == 0.0


def test_unused_non_output_value_is_freed_at_once():
    p = Problem(
        [
            Node("x", 0, 0.0, "input"),
            fwd("y", 1, ["x"], output=True),
            bwd("junk", 50, []),  # e.g. a tangent nobody reads
            bwd("dy", 2, ["y"], output=True),
        ]
    )
    r = simulate(p, Plan())
    assert r.timeline == (1, 51, 3)


def test_reading_a_value_twice():
    # y = a * a reads a twice; the backward reads a twice too.
    p = Problem(
        [
            Node("x", 0, 0.0, "input"),
            fwd("a", 3, ["x"]),
            fwd("y", 1, ["a", "a"], output=True),
            bwd("da", 2, ["y", "a", "a"], output=True),
        ]
    )
    assert p.consumers["a"] == ("y", "da")
    r = simulate(p, Plan())
    # a 3 | y 4, free a | a 4 (recomputed once) | da 6, free a -> 3
    assert r.steps == steps("a", "y", "|", "a", "da")
    assert r.timeline == (3, 4, 4, 6)


# ------------------------------------------------------------------- policies
def test_policies_are_enforced(chain):
    nodes = list(chain.nodes)
    nodes[1] = fwd("f1", 10, ["x"], policy="save")
    nodes[2] = fwd("f2", 20, ["f1"], policy="recompute")
    p = Problem(nodes)
    with pytest.raises(InvalidPlanError, match="'f2' has policy 'recompute'"):
        simulate(p, Plan(kept={"f1", "f2"}))
    with pytest.raises(InvalidPlanError, match="recomputes 'f1', whose policy is 'save'"):
        simulate(p, Plan(kept=()))
    assert honour_policies(p, {"f2"}) == {"f1"}
    r = simulate(p, Plan(kept=honour_policies(p, ())))
    assert r.steps == steps("f1", "f2", "f3", "|", "f2", "b3", "b2", "b1")


def test_save_node_read_in_backward_without_being_kept(chain):
    nodes = list(chain.nodes)
    nodes[1] = fwd("f1", 10, ["x"], policy="save")
    p = Problem(nodes)
    sched = steps("f1", "f2", "f3", "|", "b3", "b2", "b1")
    with pytest.raises(InvalidPlanError, match=r"step 4 \('b2', backward\) reads 'f1'.*policy is 'save'"):
        simulate(p, Plan(kept={"f2"}, schedule=sched))


def test_policy_on_non_forward_node_is_ignored():
    p = Problem([Node("x", 1, 0.0, "input", policy="save"), fwd("y", 1, ["x"], output=True)])
    assert simulate(p, Plan()).peak_bytes == 2


# -------------------------------------------------------------- invalid plans
@pytest.mark.parametrize(
    "kept, sched, message",
    [
        (
            {"f1"},
            steps("f1", "f2", "f3", "|", "b3", "b2", "b1"),
            r"step 3 \('b3', backward\) reads 'f2', which has no live value",
        ),
        (
            (),
            steps("f2", "f1", "f3", "|", "f1", "f2", "b3", "b2", "b1"),
            r"step 0 \('f2', forward\) reads 'f1', which has not been computed",
        ),
        (
            (),
            steps("f1", "f2", "f3", "|", "f1", "f2", "b3", "b1", "b2"),
            r"step 6 \('b1', backward\) reads 'b2', which has not been computed",
        ),
        ((), steps("f1", "f2", "f3", "|", "f1", "f2", "b3", "b2"), "backward node 'b1' is never computed"),
        (
            (),
            steps("f1", "f2", "f3", "|", "f1", "f2", "b3", "b3", "b2", "b1"),
            r"step 6 \('b3', backward\) computes backward node 'b3' a second time",
        ),
        (
            (),
            steps("f1", "f1", "f2", "f3", "|", "f1", "f2", "b3", "b2", "b1"),
            r"step 1 \('f1', forward\) computes 'f1' a second time in the forward phase",
        ),
        (
            (),
            steps("x", "f1", "f2", "f3", "|", "f1", "f2", "b3", "b2", "b1"),
            r"step 0 \('x', forward\) computes an input node",
        ),
        (
            (),
            steps("f1", "f2", "f3", "b3", "|", "f1", "f2", "b2", "b1"),
            r"step 3 \('b3', forward\) computes a backward node in the forward phase",
        ),
        (
            (),
            steps("f1", "f2", "|", "f3", "f1", "f2", "b3", "b2", "b1"),
            "output node 'f3' is not computed in the forward phase",
        ),
        ({"f1"}, steps("f3x"), r"step 0 \('f3x', forward\): unknown node"),
        ({"b1"}, None, "kept names 'b1', a backward node; only forward nodes can be kept"),
        ({"nope"}, None, "kept names 'nope', which is not a node"),
    ],
)
def test_invalid_plans_are_rejected_with_clear_messages(chain, kept, sched, message):
    plan = Plan(kept=kept, schedule=sched)
    with pytest.raises(InvalidPlanError, match=message):
        simulate(chain, plan)
    with pytest.raises(InvalidPlanError, match=message):
        schedule(chain, plan)


def test_phase_order_and_phase_names_are_checked(chain):
    bad_order = (Step("f1", "forward"), Step("b3", "backward"), Step("f2", "forward"))
    with pytest.raises(InvalidPlanError, match="comes after a backward-phase step"):
        simulate(chain, Plan(schedule=bad_order))
    with pytest.raises(InvalidPlanError, match="phase must be 'forward' or 'backward'"):
        simulate(chain, Plan(schedule=[("f1", "fwd")]))


def test_kept_node_must_be_computed_in_forward():
    p = Problem(
        [
            Node("x", 0, 0.0, "input"),
            fwd("side", 3, ["x"]),
            fwd("y", 1, ["x"], output=True),
            bwd("dy", 1, ["y", "side"], output=True),
        ]
    )
    sched = steps("y", "|", "side", "dy")
    with pytest.raises(InvalidPlanError, match="kept node 'side' is not computed in the forward phase"):
        simulate(p, Plan(kept={"side"}, schedule=sched))
    assert simulate(p, Plan(schedule=sched)).recompute_cost == 1.0  # side is "recomputed" in backward


def test_invalid_plan_error_is_a_solver_error_and_value_error():
    assert issubclass(InvalidPlanError, SolverError) and issubclass(InvalidPlanError, ValueError)


# ---------------------------------------------------------- problem validation
@pytest.mark.parametrize(
    "nodes, message",
    [
        ([Node("x", 0, 0.0, "input"), Node("x", 0, 0.0, "input")], "duplicate node name 'x'"),
        ([fwd("a", 1, ["b"]), fwd("b", 1, [])], "node 'a' reads 'b', which is not an earlier node"),
        ([fwd("a", 1, []), bwd("g", 1, ["a"]), fwd("c", 1, ["a"])], "forward node 'c' comes after backward node 'g'"),
        ([Node("x", 0, 0.0, "input"), Node("y", 0, 0.0, "input", ("x",))], "input node 'y' must have no preds"),
        ([fwd("a", 1, []), fwd("v", 1, ["a"], alias_of="a")], "alias node 'v' must have bytes=0"),
        ([fwd("a", 1, []), fwd("v", 0, [], alias_of="a")], "alias_of 'a' is not in its preds"),
        ([fwd("v", 0, [], alias_of="zz")], "alias of 'zz', which is not an earlier node"),
        ([Node("a", 1, 0.0, "param")], "kind must be one of"),
        ([fwd("a", -1, [])], "bytes must be a non-negative int"),
        ([fwd("a", 1, [], cost=float("nan"))], "cost must be >= 0"),
        ([fwd("a", 1, [], policy="maybe")], "policy must be None, 'save' or 'recompute'"),
        ([fwd("a", 1, []), fwd("g", 1, [], part_of="a")], "part_of 'a' is not in its preds"),
        ([fwd("a", 1, [], scratch=-1)], "scratch must be a non-negative int"),
    ],
)
def test_problem_validation(nodes, message):
    with pytest.raises(ValueError, match=message):
        Problem(nodes)


def test_problem_derived_data_and_repr(residual):
    assert residual.forward_nodes == ("a", "b", "c")
    assert residual.backward_nodes == ("gc", "gb", "acc_a", "gx")
    assert residual.input_nodes == ("x",)
    assert residual.consumers["a"] == ("b", "c", "gb")
    assert residual.total_forward_cost == 5.0
    assert residual.forward_bytes == 12
    assert residual["b"].bytes == 6 and "b" in residual and len(residual) == 8
    assert repr(residual) == (
        "Problem(8 nodes: 1 input, 3 forward, 4 backward; forward 12 B, resident 0 B, baseline 0 B)"
    )


def test_problem_from_networkx_and_dict_round_trip(residual):
    g = nx.DiGraph()
    for n in residual.nodes:
        g.add_node(n.name, bytes=n.bytes, cost=n.cost, kind=n.kind, output=n.output)
    for n in reversed(residual.nodes):  # edge insertion order must not matter
        for p in n.preds:
            g.add_edge(p, n.name)
    order = [n.name for n in residual.nodes]
    # A DiGraph has no argument order: preds come back sorted by position.
    by_position = Problem(
        [dataclasses.replace(n, preds=tuple(sorted(n.preds, key=order.index))) for n in residual.nodes]
    )
    assert by_position["gb"].preds == ("a", "gc")
    assert Problem.from_networkx(g, order) == by_position
    assert Problem.from_networkx(residual.to_networkx(), order) == by_position
    assert Problem.from_dict(json.loads(json.dumps(residual.to_dict()))) == residual
    with pytest.raises(ValueError, match="order must list every graph node exactly once"):
        Problem.from_networkx(g, order[:-1])


# ------------------------------------------------------------------------ plan
def test_plan_json_round_trip():
    plan = Plan(
        kept=["f2", "f1"],
        schedule=[("f1", "forward"), ("f1", "backward")],
        method="dp",
        budget_bytes=123,
        info=SolveInfo(status="optimal", gap=0.0, solve_seconds=0.5, details={"variables": 7}),
    )
    data = plan.to_dict()
    assert list(data) == ["method", "budget_bytes", "kept", "schedule", "info"]
    assert data["kept"] == ["f1", "f2"]
    text = json.dumps(data)
    back = Plan.from_dict(json.loads(text))
    assert back == plan and back.info == plan.info
    assert "gap" in data["info"] and "bound" not in data["info"]  # only what the method set
    with pytest.raises(TypeError):
        Plan(info={"status": "optimal"})  # typed: a SolveInfo, not a dict
    assert back.schedule[1] == Step("f1", "backward") and isinstance(back.schedule[1], Step)
    assert json.dumps(Plan(kept={"f1", "f2"}).to_dict()) == json.dumps(Plan(kept=["f2", "f1"]).to_dict())
    assert Plan.from_dict(Plan().to_dict()) == Plan()
    assert "kept=2 nodes" in repr(plan) and "2 steps" in repr(plan)
    with pytest.raises(TypeError):
        Plan(kept="f1")


# ------------------------------------------------------------------- solve/api
def test_methods_registry():
    assert {"chen_sqrt", "chen_greedy", "auto"} <= set(METHODS)
    for optional in ("dp", "ilp"):
        assert (optional in METHODS) == (REPO / "solvers" / f"{optional}.py").exists()


def test_solve_fills_info_and_checks_arguments():
    p = Problem.training_chain(16)
    plan = solve(p, 12, "chen_greedy")
    assert plan.budget_bytes == 12 and plan.method == "chen_greedy"
    assert plan.info.predicted_peak_bytes == simulate(p, plan).peak_bytes <= 12
    assert plan.info.recompute_cost == simulate(p, plan).recompute_cost
    assert plan.info.solve_seconds >= 0
    json.dumps(plan.to_dict())
    with pytest.raises(ValueError, match="unknown method 'nope'"):
        solve(p, 12, "nope")
    with pytest.raises(ValueError, match="budget_bytes must be a non-negative int"):
        solve(p, -1)
    with pytest.raises(TypeError):
        solve(p, 12, "auto", no_such_option=1)


def test_infeasible_budget_error_message():
    p = Problem.training_chain(16, node_bytes=1 << 28)  # 256 MiB per activation
    lowest = chen_lowest_peak_plan(p).info.predicted_peak_bytes  # chen_greedy's own floor
    with pytest.raises(InfeasibleBudgetError) as info:
        solve(p, 1 << 30, "chen_greedy")
    err = info.value
    assert err.budget_bytes == 1 << 30 and err.min_feasible_bytes == lowest
    assert str(err) == (
        f"budget 1 GiB (1073741824 bytes) is below the smallest feasible budget "
        f"{lowest / (1 << 30):.3g} GiB ({lowest} bytes) for this graph"
    )
    import pickle

    again = pickle.loads(pickle.dumps(err))
    assert str(again) == str(err) and again.min_feasible_bytes == lowest


def test_min_feasible_budget_is_reached_by_auto_and_by_no_derived_family_below():
    from solvers.chen import lowest_peak_plan as chen_lowest

    p = Problem.training_chain(20)
    lowest = min_feasible_budget(p)
    assert lowest < simulate(p, keep_all_plan(p)).peak_bytes
    assert lowest <= chen_lowest(p).info.predicted_peak_bytes
    assert solve(p, lowest, "auto").info.predicted_peak_bytes <= lowest
    for method in ("chen_greedy", "hierarchical"):
        with pytest.raises(InfeasibleBudgetError):
            solve(p, lowest - 1, method)


def test_chen_sqrt_ignores_budget_but_checks_it():
    p = Problem.training_chain(16)
    plan = chen_sqrt(p)
    peak = simulate(p, plan).peak_bytes
    assert solve(p, peak, "chen_sqrt").kept == plan.kept
    with pytest.raises(InfeasibleBudgetError, match="chen_sqrt's plan peaks at"):
        solve(p, peak - 1, "chen_sqrt")


def test_auto_returns_keep_all_when_it_fits():
    p = Problem.training_chain(10)
    peak = simulate(p, keep_all_plan(p)).peak_bytes
    plan = solve(p, peak, "auto")
    assert plan.info.recompute_cost == 0
    assert plan.info.chosen == plan.method


def test_auto_survives_a_failing_optional_method(monkeypatch):
    import solvers.api as api

    def broken(problem, budget_bytes, **options):
        raise RuntimeError("boom")

    monkeypatch.setitem(api.METHODS, "hierarchical", broken)
    monkeypatch.setitem(api.METHODS, "ilp", lambda problem, budget_bytes, **options: Plan(kept={"nope"}))
    p = Problem.training_chain(12)
    chen_floor = chen_lowest_peak_plan(Problem.training_chain(12)).info.predicted_peak_bytes
    budget = max(min_feasible_budget(p), chen_floor) + 1  # chen_greedy fits
    plan = solve(p, budget, "auto")
    tried = plan.info.tried
    assert tried["hierarchical"]["status"] == "error" and "boom" in tried["hierarchical"]["error"]
    assert tried["ilp"]["status"] == "error" and "InvalidPlanError" in tried["ilp"]["error"]
    assert plan.method == "chen_greedy"
    with pytest.raises(RuntimeError):
        solve(p, budget, "hierarchical")


def test_progress_callback():
    calls = []
    p = Problem.training_chain(40)
    solve(
        p,
        chen_lowest_peak_plan(Problem.training_chain(40)).info.predicted_peak_bytes + 2,
        "chen_greedy",
        progress=lambda f, m: calls.append((f, m)),
    )
    assert calls and all(0.0 <= f <= 1.0 and isinstance(m, str) for f, m in calls)
    assert calls[-1][0] == 1.0


def test_chen_greedy_simulation_count_is_bounded():
    p = Problem.training_chain(500, node_bytes=[1 + (i * 7919) % 13 for i in range(500)])
    lowest = chen_lowest_peak_plan(p).info.predicted_peak_bytes  # chen_greedy's own floor
    for budget in (lowest, lowest + 40, 10**9):
        assert chen_greedy(p, budget).info.simulations <= 30


# ---------------------------------------------------------------- import/speed
def test_import_solvers_does_not_import_torch():
    code = (
        "import sys, solvers; "
        "bad = [m for m in ('torch', 'pulp', 'networkx', 'numpy') if m in sys.modules]; "
        "assert not bad, bad; print('ok')"
    )
    env = dict(os.environ, PYTHONPATH=str(REPO))
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "ok"


def test_large_chain_builds_and_simulates():
    # Speed is measured in bench/bench_solvers.py; here only that 35,001 nodes work (no recursion limit).
    n = 17_500
    p = Problem.training_chain(n)
    kept = {f"f{i}" for i in range(1, n + 1, 132)}
    r = simulate(p, Plan(kept=kept))
    assert len(p) == 35_001 and r.peak_bytes < 400


@pytest.mark.parametrize(
    "module",
    [
        "solvers",
        "solvers.problem",
        "solvers.plan",
        "solvers.simulator",
        "solvers.chen",
        "solvers.api",
        "solvers.errors",
        "solvers.graph",
        "solvers.blocks",
        "solvers.hierarchical",
    ],
)
def test_docstring_examples(module):
    import doctest
    import importlib

    failed, _ = doctest.testmod(importlib.import_module(module))
    assert failed == 0


def test_a_kept_value_no_backward_step_reads_is_not_kept_bytes():
    """f2 is read only by f3 in forward: keeping it (a checkpoint backward never needs) leaves nothing
    alive after the forward, since the rewritten graphs free it after its last use; ``kept_bytes``
    (what a graph leaves alive for later graphs of the step) must not count it."""
    problem = Problem(
        [
            Node("x", 100, 0.0, "input"),
            Node("f1", 10, 1.0, "forward", preds=("x",)),
            Node("f2", 20, 1.0, "forward", preds=("f1",)),
            Node("f3", 1, 1.0, "forward", preds=("f2",), output=True),
            Node("b3", 2, 0.0, "backward", preds=("f3",)),
            Node("b2", 4, 0.0, "backward", preds=("b3", "f1")),
            Node("b1", 8, 0.0, "backward", preds=("b2", "x"), output=True),
        ]
    )
    assert simulate(problem, Plan(kept={"f1", "f2"})).kept_bytes == 10
    assert simulate(problem, Plan(kept={"f1"})).kept_bytes == 10


def test_plans_drop_kept_values_no_backward_step_reads():
    """The same graph with a transient at the end of forward (a loss the caller computes): the
    simulator holds a kept value to the end of forward, so keeping f2 (read by f3 only) predicted
    the peak 20 bytes above what the run shows (the rewritten graphs do not save it).  Every
    method's plan drops it, and the floor too; the plan's prediction is then the run's peak."""
    problem = Problem(
        [
            Node("x", 100, 0.0, "input"),
            Node("f1", 10, 1.0, "forward", preds=("x",)),
            Node("f2", 20, 1.0, "forward", preds=("f1",)),
            Node("f3", 1, 1.0, "forward", preds=("f2",), output=True),
            Node("loss", 50, 0.0, "forward", preds=("f3",), policy="recompute"),
            Node("loss_done", 0, 0.0, "forward", preds=("loss",), output=True),
            Node("b3", 2, 0.0, "backward", preds=("f3",)),
            Node("b2", 4, 0.0, "backward", preds=("b3", "f1")),
            Node("b1", 8, 0.0, "backward", preds=("b2", "x"), output=True),
        ]
    )
    assert simulate(problem, Plan(kept={"f1", "f2"})).peak_bytes == simulate(problem, Plan(kept={"f1"})).peak_bytes + 20
    assert drop_unread(problem, Plan(kept={"f1", "f2"})).kept == {"f1"}
    for method in ("hierarchical", "chen_greedy", "chen_sqrt", "auto"):
        plan = solve(problem, 10_000, method=method)
        assert "f2" not in plan.kept, (method, plan.kept)
    assert "f2" not in lowest_peak_plan(problem).kept


def test_a_value_fill_budget_keeps_drops_a_kept_value_backward_no_longer_reads():
    """A plan keeping ``a`` recomputes ``r = relu(a)`` for the backward, which reads it through a view ``d``
    (a ``detach``).  ``fill_budget`` keeps the view first (no bytes of its own), which pins ``r``: then no
    backward step reads ``a``, the rewritten graphs do not save it, and the plan must not hold it to the end
    of forward (a 4-layer GNN's plan was predicted 17,670,152 B where it measured 15,142,152 B)."""
    problem = Problem(
        [
            Node("x", 100, 0.0, "input"),
            Node("a", 20, 10.0, "forward", preds=("x",)),
            Node("r", 20, 1.0, "forward", preds=("a",)),
            Node("d", 0, 0.0, "forward", preds=("r",), alias_of="r"),
            Node("out", 1, 1.0, "forward", preds=("r",), output=True),
            Node("loss", 50, 0.0, "forward", preds=("out",), policy="recompute"),
            Node("loss_done", 0, 0.0, "forward", preds=("loss",), output=True),
            Node("g_out", 1, 0.0, "backward", preds=("out",)),
            Node("g_a", 20, 1.0, "backward", preds=("g_out", "d")),
            Node("g_x", 8, 1.0, "backward", preds=("g_a", "x"), output=True),
        ]
    )
    filled = fill_budget(problem, Plan(kept={"a"}), 10_000)
    assert "d" in filled.kept and "a" not in filled.kept, filled.kept
    assert filled.info.predicted_peak_bytes == simulate(problem, drop_unread(problem, filled)).peak_bytes


def test_fill_budget_keeps_the_values_that_fit_after_many_ranked_first_that_do_not():
    """Six 100-byte branches save the most per byte but none fits the budget's room; twelve 2-byte
    branches ranked after them do (they are not alive when a large branch is recomputed, the peak).
    Every small branch is kept: a value that cannot fit is passed over, not the end of the search
    (the search by prefixes skipped one such value per round, four rounds, and kept nothing)."""
    nodes = [Node("x", 8, 0.0, "input")]
    branches = [(f"big{i}", 100, 1000.0) for i in range(6)] + [(f"small{j}", 2, 10.0) for j in range(12)]
    total = None
    for name, nbytes, cost in branches:  # each branch is summed into a running total in forward
        nodes.append(Node(name, nbytes, cost, "forward", preds=("x",)))
        nodes.append(Node(f"sum_{name}", 1, 1.0, "forward", preds=(name,) + ((total,) if total else ())))
        total = f"sum_{name}"
    nodes += [
        Node("loss", 1, 1.0, "forward", preds=(total,), output=True),
        Node("g_loss", 1, 0.0, "backward", ("loss",)),
    ]
    nodes += [Node(f"g_{name}", 1, 1.0, "backward", preds=("g_loss", name)) for name, _, _ in reversed(branches)]
    nodes.append(Node("g_x", 8, 1.0, "backward", preds=tuple(f"g_{name}" for name, _, _ in branches), output=True))
    problem = Problem(nodes)
    sparse = Plan(kept=set())
    base = simulate(problem, sparse)
    for room in (0, 50):
        filled = fill_budget(problem, sparse, base.peak_bytes + room)
        assert filled.kept == {f"small{j}" for j in range(12)}, (room, sorted(filled.kept))
        assert simulate(problem, filled).peak_bytes <= base.peak_bytes + room


@pytest.mark.parametrize("allowance", [0, 3, 6])
def test_fill_budget_counts_bytes_kept_beyond_an_allowance(allowance):
    """``kept_allowance``: the earlier runs in the baseline are counted at that many kept bytes each, so each
    byte a plan keeps beyond it counts ``kept_weight`` times more: a filled plan fits under that count and
    never costs more."""
    problem = Problem.training_chain(12)
    sparse = Plan(kept=set())
    base = simulate(problem, sparse)
    for room, weight in ((4, 1), (12, 2), (40, 3)):
        budget = base.peak_bytes + room
        filled = fill_budget(problem, sparse, budget, kept_weight=weight, kept_allowance=allowance)
        result = simulate(problem, filled)
        assert result.peak_bytes + weight * max(0, result.kept_bytes - allowance) <= budget, (room, filled.kept)
        assert result.recompute_cost <= base.recompute_cost


@pytest.mark.parametrize("weight", [0, 1, 3, 8])
def test_fill_budget_counts_each_byte_a_trial_keeps_once_more_per_kept_weight(weight):
    """``kept_weight``: every byte kept beyond the plan's also raises the peak by ``weight`` bytes (the
    graph's earlier runs in the step keep the same).  The filled plan fits under that count and is never
    costlier; the weight only ever makes a fill keep less (a chain whose peak keeping more does not raise
    keeps everything unweighted, and under a weight only what the budget's room pays for)."""
    problem = Problem.training_chain(12)
    sparse = Plan(kept=set())
    base = simulate(problem, sparse)
    for room in (0, 4, 12, 40):
        budget = base.peak_bytes + room
        filled = fill_budget(problem, sparse, budget, kept_weight=weight)
        result = simulate(problem, filled)
        assert result.peak_bytes + weight * (result.kept_bytes - base.kept_bytes) <= budget, (room, filled.kept)
        assert result.recompute_cost <= base.recompute_cost
        unweighted = fill_budget(problem, sparse, budget)
        if weight == 0:
            assert filled.kept == unweighted.kept
        elif room < weight * len(unweighted.kept):
            assert len(filled.kept) < len(unweighted.kept), (room, filled.kept)


# -------------------------------------------------------- fusing compilers (Node.fusion)
def _fusion_problem(*, fusion: str, readers: int) -> Problem:
    """x -> m (a matmul, kept) -> f (pointwise, recomputed) -> backward readers of f."""
    nodes = [
        Node("x", 0, 0.0, "input"),
        fwd("m", 100, ["x"], cost=10.0),
        fwd("f", 100, ["m"], fusion=fusion),
        fwd("loss", 1, ["f"], output=True),
        bwd("dl", 1, []),
    ]
    nodes += [bwd(f"b{i}", 150, ["f", "dl"], fusion="pointwise") for i in range(readers)]
    nodes.append(bwd("dm", 1, ["m", f"b{readers - 1}"], output=True))  # m stays alive through the readers
    return Problem(nodes)


def test_a_recomputed_pointwise_value_with_one_fusing_reader_allocates_nothing():
    plan = Plan(kept={"m"})
    unfused = simulate(_fusion_problem(fusion="", readers=1), plan)
    fused = simulate(_fusion_problem(fusion="pointwise", readers=1), plan)
    assert unfused.recompute_cost == fused.recompute_cost == 1.0
    assert unfused.peak_bytes - fused.peak_bytes == 100  # f is computed inside b0's kernel
    # Read by two kernels, it is written once and read by both.
    twice = [simulate(_fusion_problem(fusion=fusion, readers=2), plan).peak_bytes for fusion in ("", "pointwise")]
    assert twice[0] == twice[1] == unfused.peak_bytes


def test_a_value_computed_inside_its_readers_kernels_keeps_what_it_reads_alive():
    # i (pointwise, 0 bytes: never written) reads a and is read by c after b: a lives until c runs.
    def problem(fusion: str) -> Problem:
        return Problem(
            [
                Node("x", 0, 0.0, "input"),
                fwd("a", 50, ["x"]),
                fwd("i", 0, ["a"], fusion=fusion),
                fwd("b", 30, ["x"]),
                fwd("c", 5, ["i", "b"], output=True, fusion="pointwise"),
            ]
        )

    assert simulate(problem(""), Plan(kept=())).peak_bytes == 50  # a dies at i, before b
    assert simulate(problem("pointwise"), Plan(kept=())).peak_bytes == 85  # a is read at c
    assert simulate(problem("absorbed"), Plan(kept=())).peak_bytes == 85


def test_fusion_survives_the_problem_round_trip_and_is_checked():
    p = _fusion_problem(fusion="pointwise", readers=1)
    assert Problem.from_dict(json.loads(json.dumps(p.to_dict()))) == p
    with pytest.raises(ValueError, match="fusion"):
        Problem([Node("x", 0, 0.0, "input"), fwd("f", 1, ["x"], fusion="fused")])


def test_solve_answers_a_problem_of_the_same_content_at_the_same_budget_from_memory(monkeypatch) -> None:
    """A graph planned again (a replan, a layer compiled as its own graph once per layer, a budget sweep) is
    built as a new problem of the same content: solve answers it without solving, refusals included, and
    keeps no frame of the refused caller alive (a remembered error's traceback kept a training step's
    tensors, and so changed what ckptc measured)."""
    import gc
    import weakref

    import solvers.api

    calls: list[int] = []
    hierarchical = solvers.api.METHODS["hierarchical"]

    def counted(problem: Problem, budget_bytes: int, **options):
        calls.append(budget_bytes)
        return hierarchical(problem, budget_bytes, **options)

    monkeypatch.setitem(solvers.api.METHODS, "hierarchical", counted)
    first = solve(Problem.training_chain(12), 9, method="hierarchical")
    assert solve(Problem.training_chain(12), 9, method="hierarchical") == first
    assert calls == [9]
    solve(Problem.training_chain(12), 10, method="hierarchical")
    solve(Problem.training_chain(13), 9, method="hierarchical")
    assert calls == [9, 10, 9]

    class Held:
        pass

    def refused() -> tuple[weakref.ref, InfeasibleBudgetError]:
        held = Held()
        try:
            solve(Problem.training_chain(12), 1, method="hierarchical")
        except InfeasibleBudgetError as error:
            return weakref.ref(held), error
        raise AssertionError("budget 1 was not refused")

    held, error = refused()
    del error
    gc.collect()
    assert held() is None, "the remembered refusal keeps its caller's frame alive"
    _, again = refused()
    assert calls == [9, 10, 9, 1]
    assert again.min_feasible_bytes == min_feasible_budget(Problem.training_chain(12))


def test_memos_of_problems_no_longer_alive_keep_their_arrays_within_a_byte_cap(monkeypatch) -> None:
    """Problems of the same content share their memo while any is alive, and the most recently built
    contents keep theirs after; the floor's nested-DP tables (about 50 MB for a 64-block chain) are let go
    from the oldest beyond a byte cap, their plans and floors kept."""
    import gc

    import solvers.problem as problem_module
    from tests.graphs import random_training_graph

    monkeypatch.setattr(problem_module, "SHARED_CACHES_BYTES", 2**20)
    floors = []
    for seed in range(6):
        problem = random_training_graph(120, seed=seed)
        floors.append(min_feasible_budget(problem))
        assert random_training_graph(120, seed=seed)._cache is problem._cache  # shared while alive
    del problem
    gc.collect()
    memos = list(problem_module._recent_caches.values())
    assert len(memos) == 6
    assert sum(problem_module._array_bytes(memo) for memo in memos[:-1]) <= 2**20
    assert sum(problem_module._array_bytes(memo) for memo in memos) > 2**20, "the test builds no tables"
    # The oldest memo kept its floor: a problem built again from that graph reads it without solving.
    assert random_training_graph(120, seed=0)._cache.get("api.lowest_peak_plan") is not None
    assert [min_feasible_budget(random_training_graph(120, seed=s)) for s in range(6)] == floors
