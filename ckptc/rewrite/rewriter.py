"""Rewriter: apply a schedule to a joint graph, producing forward and backward graphs.

The rewriter does not know which solver chose the plan.  It executes the
schedule from :func:`solvers.schedule` literally: forward-phase steps become the
forward graph, backward-phase steps the backward graph in exactly the
scheduled order, where a forward node met in the backward phase is a
recomputation placed just before its first use.  FX code generation frees
every value right after its last use, and the boxed calling convention frees
each saved activation after its last use in backward, so the memory the
simulator predicts is the memory the graphs use.

Random ops recomputed in backward replay the generator state captured in
forward (see :mod:`ckptc.capture.rng`), so they reproduce the same masks.
"""

from __future__ import annotations

import logging
import operator
from typing import Sequence

import torch
import torch.fx as fx

import solvers
from ckptc import _torch_internals as internals
from ckptc._torch_internals import graph_module, split_joint_graph
from ckptc.capture.rng import replay_with_rng_state
from ckptc.pricing.costs import FORWARD

log = logging.getLogger("ckptc.rewrite.rewriter")


def rewrite(
    joint: fx.GraphModule,
    steps: Sequence[solvers.Step],
    kept: frozenset[str],
    num_fwd_outputs: int,
) -> tuple[fx.GraphModule, fx.GraphModule]:
    """Build AOTAutograd's forward and backward modules that follow ``steps``.

    Args:
        joint: the annotated joint graph (``node.meta["ckptc"]`` set).
        steps: the schedule, as returned by :func:`solvers.schedule`.
        kept: forward nodes the plan keeps for backward.
        num_fwd_outputs: how many leading outputs of ``joint`` belong to forward.
    """
    by_name = {n.name: n for n in joint.graph.nodes}
    new = fx.Graph()
    latest: dict[fx.Node, fx.Node] = {}
    created_in_forward: set[fx.Node] = set()
    forward_instance: dict[fx.Node, fx.Node] = {}

    for node in joint.graph.nodes:
        if node.op in ("placeholder", "get_attr"):
            latest[node] = new.node_copy(node)
            created_in_forward.add(latest[node])

    def current(n: fx.Node) -> fx.Node:
        try:
            return latest[n]
        except KeyError:
            raise RuntimeError(
                f"schedule reads {n.name} before computing it; the plan is invalid "
                "(solvers.simulate should have rejected it)"
            ) from None

    for step in steps:
        node = by_name.get(step.node)
        if node is None or node.op != "call_function":  # a marker, or a tangent placeholder
            continue
        is_recompute = step.phase == "backward" and node.meta["ckptc"].kind == FORWARD
        state = node.meta.get("ckptc_rng_state")
        if is_recompute and state is not None:
            copy = _replay_node(new, node, current(state), current)
        elif is_recompute and _batch_norm_reading_statistics(node):
            copy = _batch_norm_without_statistics(new, node, current)
        else:
            copy = new.node_copy(node, current)
        if is_recompute:
            copy.meta["ckptc_recompute_of"] = node.name
        latest[node] = copy
        if step.phase == "forward":
            created_in_forward.add(copy)
            forward_instance[node] = copy

    # Forward outputs are the forward-phase instances, even if a schedule later
    # recomputes the same node in backward.
    old_output = next(iter(joint.graph.find_nodes(op="output")))
    old_results = list(old_output.args[0])
    results = [
        fx.node.map_arg(r, (lambda n: forward_instance.get(n) or current(n)) if i < num_fwd_outputs else current)
        for i, r in enumerate(old_results)
    ]
    new_output = new.output(type(old_output.args[0])(results))
    new_output.meta = dict(old_output.meta)

    saved_values, saved_sym_nodes = _saved_for_backward(new, created_in_forward)
    new_joint = graph_module(joint, new)
    fw, bw = split_joint_graph(new_joint, saved_values, saved_sym_nodes, num_fwd_outputs)
    _drop_stray_forward_ops(bw)
    log.debug(
        "rewrote joint graph: %d saved values, %d recomputations",
        len(saved_values),
        sum(1 for n in bw.graph.nodes if "ckptc_recompute_of" in n.meta),
    )
    return fw, bw


def _drop_stray_forward_ops(backward: fx.GraphModule) -> int:
    """Remove forward ops that the split copied into ``backward`` although the schedule never runs them there.

    AOTAutograd's split copies into the backward every forward op whose inputs the backward has,
    and its dead-code pass keeps the impure ones: a dropout whose input is saved for its replay
    ran a second time in backward, unused, and moved the random stream (the masks of the next
    steps then differed from eager's, and its output and mask took memory no plan counted).  The
    schedule's recomputations are marked ``ckptc_recompute_of``; any other forward op here is a stray.
    Returns how many were removed.
    """
    removed = 0
    for node in reversed(list(backward.graph.nodes)):
        cost = node.meta.get("ckptc")
        stray = node.op == "call_function" and cost is not None and cost.kind == FORWARD
        if stray and not node.users and "ckptc_recompute_of" not in node.meta:
            backward.graph.erase_node(node)
            removed += 1
    if removed:
        backward.recompile()
        log.debug("backward: %d forward ops the split had copied in removed", removed)
    return removed


def _replay_node(graph: fx.Graph, node: fx.Node, state: fx.Node, current) -> fx.Node:
    device = _device_of(node)
    args = fx.node.map_arg(node.args, current)
    kwargs = fx.node.map_arg(node.kwargs, current)
    replay = graph.call_function(replay_with_rng_state, (state, device, node.target, *args), kwargs)
    replay.meta = dict(node.meta)
    return replay


def _batch_norm_reading_statistics(node: fx.Node) -> bool:
    """Whether ``node`` is BatchNorm in training mode whose recomputation would read the running statistics
    and no backward node reads the new statistics it returns (outputs 3 and 4, through their getitems)."""
    if not internals.is_training_batch_norm(node.target, node.args):
        return False
    statistics = [user for user in node.users if user.target is operator.getitem and user.args[1] >= 3]
    return not any(_in_backward(reader) for getitem in statistics for reader in getitem.users)


def _in_backward(node: fx.Node) -> bool:
    cost = node.meta.get("ckptc")
    return cost is not None and cost.kind != FORWARD


def _batch_norm_without_statistics(graph: fx.Graph, node: fx.Node, current) -> fx.Node:
    """The recomputation of training-mode BatchNorm ``node`` without its running statistics.

    In training mode its output, mean and inverse deviation (outputs 0-2) come from the batch alone; the
    statistics go in only to be updated, which the forward did.  Read in backward, they would be saved for it,
    and a later call of the step updates them in place before this backward runs (a discriminator called on
    real and fake data, then one backward): autograd then refused the backward ("modified by an inplace
    operation").  :func:`ckptc._torch_internals.batch_norm_without_statistics` computes outputs 0-2 with the
    same kernel.
    """
    x, weight, bias, _mean, _var, training, momentum, eps = fx.node.map_arg(node.args, current)
    copy = graph.call_function(internals.batch_norm_without_statistics(), (x, weight, bias, training, momentum, eps))
    copy.meta = dict(node.meta)
    copy.meta["val"] = tuple(node.meta["val"][:3])
    return copy


def _device_of(node: fx.Node) -> torch.device:
    val = node.meta.get("val")
    example = val[0] if isinstance(val, (tuple, list)) else val
    return example.device


def _is_sym(node: fx.Node) -> bool:
    return isinstance(node.meta.get("val"), (torch.SymInt, torch.SymFloat, torch.SymBool))


def _saved_for_backward(graph: fx.Graph, created_in_forward: set[fx.Node]) -> tuple[list[fx.Node], list[fx.Node]]:
    """Forward values (and primals) that backward-phase nodes read."""
    saved: dict[fx.Node, None] = {}
    for node in graph.nodes:
        if node in created_in_forward or node.op == "output":
            continue
        for arg in node.all_input_nodes:
            if arg in created_in_forward and not (arg.op == "placeholder" and "tangents" in str(arg.target)):
                saved[arg] = None
    values = [n for n in saved if not _is_sym(n)]
    syms = [n for n in saved if _is_sym(n)]
    return values, syms
