"""Presets: small named functions that give a plan without solving, and the user's patterns.

A preset takes a :class:`~ckptc.problem.JointProblem` and a budget in bytes
(or None, recorded in the plan) and returns a :class:`solvers.Plan`.  The
presets reproduce what users compare against, planned and measured by the
same machinery; which one is used, or a solver under the budget, is decided
in :mod:`ckptc.planner`.  Every plan is scored by the one simulator,
:func:`solvers.simulate`.
"""

from __future__ import annotations

import dataclasses
import fnmatch
import logging
from typing import Callable, Iterable

import solvers
from ckptc.errors import InvalidArgumentError
from ckptc.problem import JointProblem
from solvers.chen import keep_all_plan
from solvers.graph import own_checkpoint_mask
from solvers.hierarchical import per_block_plan
from solvers.simulator import honour_policies, names_of

log = logging.getLogger("ckptc.policies")

Strategy = Callable[..., solvers.Plan]


def keep_everything(jp: JointProblem, budget_bytes: int | None = None, **_: object) -> solvers.Plan:
    """No ckptc: what the model does by itself.

    Keep every forward value that backward reads, as eager autograd does,
    except inside the model's own ``torch.utils.checkpoint`` regions (Hugging
    Face's ``gradient_checkpointing_enable``), which recompute as written.
    """
    own = own_checkpoint_mask(jp.problem)
    if own is None:
        plan = keep_all_plan(jp.problem)
    else:
        plan = solvers.Plan(kept=names_of(jp.problem, own))
    return _finish(jp, dataclasses.replace(plan, method="none", budget_bytes=budget_bytes))


def keep_module_inputs(jp: JointProblem, budget_bytes: int | None = None, **_: object) -> solvers.Plan:
    """Per-block checkpointing, as Hugging Face's ``gradient_checkpointing_enable``.

    Blocks are those of :func:`solvers.blocks.find_blocks` (the modules at the
    repeated level of the hierarchy, e.g. ``transformer.h.3``, and the parts
    around them); only the values that cross blocks are kept.
    """
    plan = per_block_plan(jp.problem)
    return _finish(jp, dataclasses.replace(plan, method="layer", budget_bytes=budget_bytes))


_CHEAP_TO_RECOMPUTE = (
    "softmax",
    "dropout",
    "gelu",
    "relu",
    "silu",
    "tanh",
    "sigmoid",
    "mul",
    "add",
    "div",
    "sub",
    "exp",
    "where",
    "masked_fill",
    "pow",
    "rsqrt",
    "mean",
    "neg",
    "clone",
    "_to_copy",
    "native_layer_norm",
    "native_dropout",
    "baddbmm",
    "bmm",
    "scaled_dot_product",
)


def selective(jp: JointProblem, budget_bytes: int | None = None, **_: object) -> solvers.Plan:
    """Megatron-style selective recompute: keep matmul outputs, recompute the rest.

    Matrix multiplies of weights (``mm``/``addmm``/convolutions) are kept;
    attention internals (batched matmuls, softmax, dropout) and pointwise ops are
    recomputed from them.
    """
    problem = jp.problem
    kept = set()
    for name in jp.graph_nodes(problem.forward_nodes):
        node = jp.nodes[name]
        op = str(getattr(node.target, "_opname", node.target))
        if op in ("mm", "addmm", "convolution", "linear", "embedding") or not op.startswith(_CHEAP_TO_RECOMPUTE):
            kept.add(name)
    plan = solvers.Plan(kept=_backward_read_closure(jp, kept), method="selective", budget_bytes=budget_bytes)
    return _finish(jp, plan)


def chen_segments(jp: JointProblem, budget_bytes: int | None = None, **_: object) -> solvers.Plan:
    """Chen et al.'s sqrt(n) segments (the solver ``chen_sqrt``), without a budget check."""
    return solvers.solve(jp.problem, budget_bytes if budget_bytes is not None else 2**62, method="chen_sqrt")


def _backward_read_closure(jp: JointProblem, kept: Iterable[str]) -> set[str]:
    """Respect policies: save what must be saved, drop what must be recomputed."""
    problem = jp.problem
    kept = {k for k in kept if problem[k].policy != solvers.RECOMPUTE}
    for name in problem.forward_nodes:
        if problem[name].policy == solvers.SAVE:
            kept.add(name)
    return kept


def _finish(jp: JointProblem, plan: solvers.Plan) -> solvers.Plan:
    if plan.schedule is None:
        plan = dataclasses.replace(plan, kept=honour_policies(jp.problem, plan.kept))
    result = solvers.simulate(jp.problem, plan)
    info = plan.info.replace(predicted_peak_bytes=result.peak_bytes, recompute_cost=result.recompute_cost)
    return solvers.Plan(
        kept=plan.kept, schedule=plan.schedule, method=plan.method, budget_bytes=plan.budget_bytes, info=info
    )


#: The presets by strategy name; ``"auto"`` (a solver under the budget) is decided in :mod:`ckptc.planner`.
PRESETS: dict[str, Strategy] = {
    "none": keep_everything,
    "layer": keep_module_inputs,
    "segment": chen_segments,
    "selective": selective,
}


def policies_from_patterns(
    jp_nodes: dict, must_save: Iterable[str] = (), must_recompute: Iterable[str] = ()
) -> dict[str, str]:
    """Map user patterns (``"layers.*.attn.*"``, ``"*.softmax*"``) to node policies.

    A pattern matches a node's stable name (``module.op_ordinal``).  A node
    matched by both lists is an error.
    """
    policies: dict[str, str] = {}
    for patterns, policy in ((must_save, "save"), (must_recompute, "recompute")):
        for pattern in patterns:
            for name, node in jp_nodes.items():
                cost = node.meta.get("ckptc")
                if cost is None or cost.kind != "forward":
                    continue
                if fnmatch.fnmatchcase(cost.stable_name, pattern):
                    if policies.get(name, policy) != policy:
                        raise InvalidArgumentError(
                            f"{cost.stable_name} is matched by both must_save and must_recompute "
                            f"(pattern {pattern!r}); remove it from one of them"
                        )
                    policies[name] = policy
    return policies


def unmatched_patterns(problems: Iterable[JointProblem], patterns: Iterable[str]) -> list[str]:
    """The patterns that match no forward value's stable name in any of ``problems`` (a whole step:
    a pattern may match in one graph of a step split by graph breaks and not in the others)."""
    names = [jp.stable_names[n] for jp in problems for n in jp.problem.forward_nodes if n in jp.stable_names]
    return [p for p in dict.fromkeys(patterns) if not any(fnmatch.fnmatchcase(name, p) for name in names)]
