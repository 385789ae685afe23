"""Tokens routed to experts: counts that depend on the data and share a total are priced at their
worst split (:mod:`ckptc.pricing.routing`, :class:`solvers.SizeGroup`), never below any routing."""

from __future__ import annotations

import copy
import dataclasses
import itertools
import random

import pytest
import torch

import ckptc
from ckptc.meter import measure_peak, resident_bytes
from solvers import Node, Plan, Problem, SizeGroup, simulate
from tests.helpers import TINY_DECODER, assert_trains_like_eager_within, eager_peak, tiny_lm_batch
from tests.zoo import get_case


def _random_step(rng: random.Random) -> list[Node]:
    """A random training step: forward values reading earlier ones, a backward node per forward value."""
    nodes, forward = [Node("x", 8, 0.0, "input")], []
    for i in range(rng.randint(3, 7)):
        preds = tuple(rng.sample(["x", *forward], min(len(forward) + 1, rng.randint(1, 2))))
        nodes.append(Node(f"f{i}", rng.randint(1, 50), 1.0, "forward", preds))
        forward.append(f"f{i}")
    nodes.append(Node("loss", 1, 1.0, "forward", (forward[-1],), output=True))
    previous = "loss"
    for i in reversed(range(len(forward))):
        extra = (rng.choice(forward[: i + 1]),) if rng.random() < 0.5 else ()
        preds = tuple(dict.fromkeys((previous, f"f{i}", *extra)))
        nodes.append(Node(f"g{i}", rng.randint(1, 50), 1.0, "backward", preds, output=rng.random() < 0.3))
        previous = f"g{i}"
    return nodes


def _at_counts(nodes: list[Node], growing: dict[str, tuple[int, int]], bound: int, counts: tuple[int, ...]) -> Problem:
    """``nodes`` with each growing node's bytes at its member's count instead of the bound."""
    changed = []
    for node in nodes:
        if node.name in growing:
            member, unit = growing[node.name]
            node = dataclasses.replace(node, bytes=node.bytes - unit * bound + unit * counts[member])
        changed.append(node)
    return Problem(tuple(changed))


def test_the_worst_split_bounds_every_routing_and_never_exceeds_the_bounds() -> None:
    """On 200 random steps and plans, a group's simulated peak is at least the peak of every split of its
    total among its members (brute force) and at most the peak with every member at its bound."""
    rng = random.Random(0)
    tighter = 0
    for _ in range(200):
        nodes = _random_step(rng)
        members, bound = rng.randint(2, 3), rng.randint(1, 4)
        total = rng.randint(1, members * bound)
        names = rng.sample([n.name for n in nodes if n.kind != "input" and n.name != "loss"], 4)
        growing = {name: (rng.randrange(members), rng.randint(1, 3)) for name in names}
        nodes = [
            dataclasses.replace(n, bytes=max(n.bytes, growing[n.name][1] * bound)) if n.name in growing else n
            for n in nodes
        ]
        group = SizeGroup(
            total, tuple((bound, tuple((n, u) for n, (m, u) in growing.items() if m == k)) for k in range(members))
        )
        forward = [n.name for n in nodes if n.kind == "forward" and n.name != "loss"]
        plan = Plan(kept=set(rng.sample(forward, rng.randint(0, len(forward)))))
        worst = simulate(Problem(tuple(nodes), size_groups=(group,)), plan).peak_bytes
        at_bounds = simulate(Problem(tuple(nodes)), plan).peak_bytes
        every_split = max(
            simulate(_at_counts(nodes, growing, bound, counts), plan).peak_bytes
            for counts in itertools.product(range(bound + 1), repeat=members)
            if sum(counts) <= total
        )
        assert every_split <= worst <= at_bounds
        tighter += worst < at_bounds
    assert tighter > 50  # the group changes the price


def _skewed(case_model: torch.nn.Module) -> torch.nn.Module:
    """The model with every token routed to the same two experts (the router's logits raised for them)."""
    model = copy.deepcopy(case_model)
    for layer in model.model.layers:
        favoured = torch.zeros(layer.mlp.gate.out_features)
        favoured[:2] = torch.tensor([100.0, 99.0])
        layer.mlp.gate.register_forward_hook(lambda module, args, out, favoured=favoured: out + favoured)
    return model


@pytest.fixture(scope="module")
def olmoe_captured() -> ckptc.CapturedStep:
    """The tiny OLMoE case's step, captured once for the tests that read it (a capture of its experts' data-dependent
    sizes is a third of a test's time)."""
    case = get_case("olmoe", size="tiny")
    return ckptc.capture(copy.deepcopy(case.model), case.example_inputs, case.example_kwargs)


def test_tokens_routed_to_experts_are_priced_at_their_worst_routing_and_every_routing_fits(
    olmoe_captured: ckptc.CapturedStep,
) -> None:
    """OLMoE (top-2 of 4 experts, 32 tokens): each expert's count was priced at its bound (64, the slice of
    the one-hot mask it reads), the layer's tokens four times over.  Now the four counts share one total (64:
    one per token and choice) and each is at most 32 (top-2 picks two distinct experts per token).  A plan
    halfway between the floor and the unoptimized peak trains within its budget, measured independently, under
    uniform routing and with every token routed to the same two experts (the worst case), and so does keeping
    everything at the unoptimized peak under the worst case; gradients equal eager's."""
    case, step = get_case("olmoe", size="tiny"), olmoe_captured
    (record,) = step.records
    problem = record.joint_problem.problem
    (group,) = problem.size_groups
    assert group.total == 64 and [bound for bound, _ in group.members] == [32, 32, 32, 32]
    at_bounds = Problem(problem.nodes, problem.baseline_bytes)
    keep_all = Plan(kept={n.name for n in problem.nodes if n.kind == "forward" and n.policy != "recompute"})
    assert simulate(problem, keep_all).peak_bytes < 0.9 * simulate(at_bounds, keep_all).peak_bytes
    halfway, skewed = (step.floor_bytes + step.unoptimized_peak_bytes) // 2, _skewed(case.model)
    for budget, reference in ((halfway, case.model), (halfway, skewed), (step.unoptimized_peak_bytes, skewed)):
        eager, model = copy.deepcopy(reference), copy.deepcopy(reference)
        # The loop drops the results before backward, said upfront: found by watching (hold_outputs=None), the
        # step is planned again, which captures the graph of data-dependent sizes again (a third of this test's
        # time) for a plan that prices the routing as the first did.
        fast = ckptc.optimize(model, budget_bytes=budget, hold_outputs=False)
        for _ in range(2):  # the step that plans, then one on its plan (verified: the CPU measures one)
            for net, params in ((fast, model), (eager, eager)):
                params.zero_grad(set_to_none=True)
                case.loss(net(*case.example_inputs, **case.example_kwargs)).backward()
        for p, q in zip(model.parameters(), eager.parameters(), strict=True):
            torch.testing.assert_close(p.grad, q.grad, rtol=1e-4, atol=1e-5)
        model.zero_grad(set_to_none=True)
        baseline = resident_bytes(model, case.example_inputs, case.example_kwargs)
        _, measured = measure_peak(
            lambda fast=fast: case.loss(fast(*case.example_inputs, **case.example_kwargs)).backward(),
            baseline_bytes=baseline,
        )
        assert measured.peak_bytes <= budget, (measured.peak_bytes, budget)


def test_a_problem_with_size_groups_round_trips_through_plain_data_and_refuses_bad_members() -> None:
    nodes = (
        Node("x", 8, 0.0, "input"),
        Node("a", 40, 1.0, "forward", ("x",)),
        Node("b", 40, 1.0, "forward", ("x",)),
        Node("loss", 1, 1.0, "forward", ("a", "b"), output=True),
        Node("g", 8, 1.0, "backward", ("loss", "a", "b"), output=True),
    )
    group = SizeGroup(10, ((10, (("a", 4),)), (10, (("b", 4),))))
    problem = Problem(nodes, size_groups=(group,))
    assert Problem.from_dict(problem.to_dict()) == problem
    # Both experts kept to the end of forward: 4 bytes per token, 10 tokens in all (not 20).
    assert simulate(problem, Plan(kept={"a", "b"})).peak_bytes == 8 + 40 + 1 + 8
    with pytest.raises(ValueError, match="exceed its 40 bytes"):
        Problem(nodes, size_groups=(SizeGroup(10, ((11, (("a", 4),)),)),))


def test_a_mixture_of_experts_built_on_meta_is_planned_offline(olmoe_captured: ckptc.CapturedStep) -> None:
    """Offline capture ran the graph under a fake-tensor mode without a shape environment, where ``nonzero``
    (tokens routed to an expert) has no size to give: ``UntraceableModelError: DynamicOutputShapeException``.
    Now OLMoE built on ``meta`` captures with its routed counts, and prices its step as with real weights."""
    case, real = get_case("olmoe", size="tiny"), olmoe_captured
    with torch.device("meta"):
        model = type(case.model)(case.model.config).train()
    ids = case.example_inputs[0].to("meta")
    offline = ckptc.capture(model, (ids,), {"labels": ids}, device="cpu")
    (group,) = offline.records[0].joint_problem.problem.size_groups
    assert group.total == 64
    assert abs(offline.unoptimized_peak_bytes - real.unoptimized_peak_bytes) <= 0.001 * real.unoptimized_peak_bytes
    assert abs(offline.floor_bytes - real.floor_bytes) <= 0.001 * real.floor_bytes


class _ExpertsAlone(torch.nn.Module):
    """One mixture-of-experts layer and nothing around it: its result is a view of the ``index_add``
    the experts write into, which AOTAutograd's joint graph traces after the backward began."""

    def __init__(self) -> None:
        super().__init__()
        self.router = torch.nn.Linear(64, 4)
        self.experts = torch.nn.ModuleList(
            torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.GELU(), torch.nn.Linear(128, 64)) for _ in range(4)
        )

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        batch, length, width = h.shape
        h = h.view(-1, width)
        weights, chosen = torch.topk(torch.softmax(self.router(h), dim=1), 2, dim=-1)
        out = torch.zeros_like(h)
        mask = torch.nn.functional.one_hot(chosen, num_classes=4).permute(2, 1, 0)
        for e, expert in enumerate(self.experts):
            which, tokens = torch.where(mask[e])
            out.index_add_(0, tokens, expert(h[None, tokens].reshape(-1, width)) * weights[tokens, which, None])
        return out.view(batch, length, width)


@pytest.mark.parametrize("entry", ["optimize", "backend"])
def test_a_layer_whose_result_is_traced_after_backward_began_is_planned_as_a_forward_result(entry: str) -> None:
    """The result (a view of the experts' ``index_add``) came after backward began in the joint graph, so
    it was priced as a backward op: the forward had no result, hence no block chain (the hierarchical
    solver indexed an empty list), and a plan releasing the result read it before it was made; the model
    was refused ("ran the call without any captured graph").  Now it plans and trains within a halfway
    budget, measured independently, with eager's gradients."""
    torch.manual_seed(0)
    reference, x = _ExpertsAlone(), torch.randn(2, 32, 64)
    step = ckptc.capture(copy.deepcopy(reference), (x,), loss_fn=lambda out: out.square().mean())
    budget = (step.floor_bytes + step.unoptimized_peak_bytes) // 2
    assert_trains_like_eager_within(reference, budget, (x,), loss=lambda out: out.square().mean(), entry=entry, steps=3)


def test_counts_that_split_the_sorted_tokens_share_their_total_and_so_do_their_runs_concatenated() -> None:
    """GraniteMoE sorts the tokens by expert and splits them by ``expert_size.tolist()``: four counts from the
    data, each up to all 128 token choices, together exactly 128.  Each expert's values and the experts' outputs
    concatenated again (``unit * (u0 + u1 + u2 + u3)``) were priced at every count's top: keeping everything was
    predicted at 4,266,532 B where eager measures 2,718,536 B (1.57x).  Now the split's counts share the size they
    split and a value growing with several of them is priced at their worst split: within 1% of eager's peak, and a
    plan halfway to it trains within its budget, measured independently, with eager's gradients."""
    from transformers import GraniteMoeConfig, GraniteMoeForCausalLM

    config = GraniteMoeConfig(
        **TINY_DECODER,
        max_position_embeddings=64,
        num_local_experts=4,
        num_experts_per_tok=2,
    )
    torch.manual_seed(0)
    reference = GraniteMoeForCausalLM(config).train()
    batch = tiny_lm_batch()
    step = ckptc.capture(copy.deepcopy(reference), (), batch)
    (record,) = step.records
    groups = record.joint_problem.problem.size_groups
    assert len(groups) == 2 and all(g.total == 128 and [b for b, _ in g.members] == [128] * 4 for g in groups)

    peak = eager_peak(reference, (), batch)
    assert abs(step.unoptimized_peak_bytes - peak) <= 0.01 * peak, (step.unoptimized_peak_bytes, peak)
    budget = (step.floor_bytes + step.unoptimized_peak_bytes) // 2
    assert_trains_like_eager_within(reference, budget, (), batch)


def test_slices_of_a_weight_stacking_every_expert_are_counted_as_the_weight_not_as_data() -> None:
    """DBRX keeps every expert's weights in one parameter and breaks the graph in its expert loop (``if
    token_idx.shape[0] == 0: continue``): each expert's graph takes its slice, a view made in eager code.
    Those slices were counted as data the caller holds, the whole weight again for every expert graph, and
    their parameters' gradients as made before every graph's backward: keeping everything was predicted at
    5,539,012 B where eager measures 2,319,944 B (2.39x), and a halfway plan measured 0.42 of its budget.
    Now a slice is the weight it views: within 1% of eager's peak, and a plan between the floor and that peak
    trains within its budget, measured independently, with eager's gradients."""
    from transformers import DbrxConfig, DbrxForCausalLM

    config = DbrxConfig(
        vocab_size=300,
        d_model=64,
        n_heads=4,
        n_layers=2,
        max_seq_len=64,
        attn_config={"kv_n_heads": 2},
        ffn_config={"ffn_hidden_size": 128, "moe_num_experts": 4, "moe_top_k": 2},
    )
    torch.manual_seed(0)
    reference = DbrxForCausalLM(config).train()
    batch = tiny_lm_batch()
    step = ckptc.capture(copy.deepcopy(reference), (), batch)
    assert len(step.records) > 2  # the expert loop's graph breaks

    peak = eager_peak(reference, (), batch)
    assert abs(step.unoptimized_peak_bytes - peak) <= 0.01 * peak, (step.unoptimized_peak_bytes, peak)
    # Three quarters of the way up: capture does not price the 30,000 B eager code holds between the expert
    # loop's graphs until a step shows them, and the floor that step teaches (2,304,623 B in one CI run) sat
    # at the halfway budget (2,303,699 B there, 2,305,877 B in a process of its own): refused after one replan
    # in some runs.  Three steps before the one measured independently: the plan's first measured step, and
    # one more where that step showed an excess (the promise holds from the first verified step).
    budget = step.floor_bytes + 3 * (step.unoptimized_peak_bytes - step.floor_bytes) // 4
    assert_trains_like_eager_within(reference, budget, (), batch, steps=3)
