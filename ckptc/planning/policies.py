"""Presets as small named policies, and the user's patterns.

As JAX's ``checkpoint_policies``, a policy only says what may be kept: each
takes a :class:`~ckptc.pricing.problem.JointProblem` and returns the forward values it
keeps, as an unscored :class:`solvers.Plan` (a kept set and a method name).
It neither solves nor simulates.  :mod:`ckptc.planning.planner` is the one place that
applies them (under which strategy name, at which budget), solves (``"auto"``,
and ``"segment"``, Chen's solver), and scores every plan with the one
simulator, :func:`solvers.simulate`.
"""

from __future__ import annotations

import fnmatch
import logging
from typing import Any, Iterable

import solvers
from ckptc.errors import InvalidArgumentError, warn_once
from ckptc.pricing.problem import JointProblem
from solvers.chen import keep_all_plan
from solvers.hierarchical import per_block_plan

log = logging.getLogger("ckptc.planning.policies")


def everything_saveable(jp: JointProblem) -> solvers.Plan:
    """No ckptc: what the model does by itself.

    Keep every forward value that backward reads, as eager autograd does,
    except inside the model's own ``torch.utils.checkpoint`` regions (Hugging
    Face's ``gradient_checkpointing_enable``), which recompute as written.
    """
    return keep_all_plan(jp.problem, own_checkpoints=True)


def block_inputs_saveable(jp: JointProblem) -> solvers.Plan:
    """Per-block checkpointing, as Hugging Face's ``gradient_checkpointing_enable``.

    Blocks are those of :func:`solvers.blocks.find_blocks` (the modules at the
    repeated level of the hierarchy, e.g. ``transformer.h.3``, and the parts
    around them); only the values that cross blocks are kept.
    """
    return per_block_plan(jp.problem)


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


def dots_saveable(op: str) -> bool:
    """Whether Megatron-style selective recompute keeps the result of ``op`` (a short op name):
    matrix multiplies of weights (``mm``/``addmm``/convolutions) and anything not cheap to recompute."""
    return op in ("mm", "addmm", "convolution", "linear", "embedding") or not op.startswith(_CHEAP_TO_RECOMPUTE)


def selective(jp: JointProblem) -> solvers.Plan:
    """Megatron-style selective recompute: keep matmul outputs, recompute the rest.

    Matrix multiplies of weights are kept (:func:`dots_saveable`); attention
    internals (batched matmuls, softmax, dropout) and pointwise ops are
    recomputed from them.
    """
    problem = jp.problem
    kept = {name for name in jp.graph_nodes(problem.forward_nodes) if dots_saveable(jp.node_cost(name).op)}
    return solvers.Plan(kept=_backward_read_closure(jp, kept), method="selective")


def _backward_read_closure(jp: JointProblem, kept: Iterable[str]) -> set[str]:
    """Respect policies: save what must be saved, drop what must be recomputed."""
    problem = jp.problem
    kept = {k for k in kept if problem[k].policy != solvers.RECOMPUTE}
    for name in problem.forward_nodes:
        if problem[name].policy == solvers.SAVE:
            kept.add(name)
    return kept


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


def warn_unmatched_patterns(owner: object, model_name: str, problems: Iterable[JointProblem], options: Any) -> None:
    """Warn once (per ``owner`` and pattern) for each ``must_save``/``must_recompute`` pattern of ``options``
    that matches no value of the step's graphs ``problems``."""
    problems = list(problems)
    for option in ("must_save", "must_recompute"):
        for pattern in unmatched_patterns(problems, getattr(options, option)):
            warn_once(
                owner,
                f"{option}:{pattern}",
                f"ckptc: the {option} pattern {pattern!r} matches no value of {model_name}'s training step, so it "
                "changes nothing. Patterns match stable names 'module.path.op_ordinal' (e.g. "
                "'transformer.h.*.attn.*', '*.softmax*'); `ckptc show` on a saved plan lists them.",
                stacklevel=4,
            )
