"""Turn a priced joint graph into a :class:`solvers.Problem`.

The solvers never see torch: this module is the bridge.  Node names in the
problem are the FX node names of the joint graph; ``JointProblem`` keeps the
mapping back to nodes and the stable, readable names used in plan files.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
from dataclasses import dataclass, field
from typing import Any, Iterable, Mapping

import torch
import torch.fx as fx
from torch.utils.checkpoint import CheckpointPolicy

import solvers
from ckptc._torch_internals import (
    INPUT_LAYOUT_COPY,
    is_mutable_op,
    is_tangent,
    is_view_op,
    op_schema_name,
    tree_leaves,
)
from ckptc.pricing.costs import BACKWARD, FORWARD, INPUT, NodeCost, priced_size, written_bytes
from ckptc.pricing.devices import MemoryModel, graph_device, memory_model
from ckptc.pricing.routing import routed_sizes
from ckptc.rewrite.lean_backward import in_place_targets
from ckptc.rewrite.unused_grads import ZERO, Folding, foldable_tangents
from solvers.graph import COPY_OPS

log = logging.getLogger("ckptc.pricing.problem")

# Ops whose recomputation would read state that the forward pass has already
# mutated are saved instead.  BatchNorm in training mode reads its running
# statistics only to produce their new values, so its output may be recomputed.
RETURN_PREFIX = "return:"
#: The node that prices the caller's loss between forward and backward (``loss_bytes``).
LOSS_NODE = "loss:outside"
#: The node that prices autograd's sum of two calls' gradients after backward (``gradient_sum_bytes``).
GRADIENT_SUM_NODE = "gradients:summed"
#: The node that prices the results of later graphs held through this graph's backward (:func:`with_later_results`).
LATER_RESULTS_NODE = "results:later"
# Nodes inside the model's own torch.utils.checkpoint regions carry these tags.
_RECOMPUTED_BY_THE_MODEL = (CheckpointPolicy.MUST_RECOMPUTE, CheckpointPolicy.PREFER_RECOMPUTE)

_READS_MUTATED_STATE_SAFELY = {
    "aten::_native_batch_norm_legit_functional",
}


@dataclass
class JointProblem:
    """A solver problem plus what is needed to map its plan back to the graph."""

    problem: solvers.Problem
    joint: fx.GraphModule
    num_fwd_outputs: int
    nodes: dict[str, fx.Node] = field(repr=False)
    stable_names: dict[str, str] = field(repr=False)
    holds_outputs: bool = False
    own_loss: bool = False  # the graph returns its own scalar loss (returns_own_loss)
    results: Mapping[str, int] = field(default_factory=dict)  # non-scalar forward results: node name -> bytes
    free_tangents: frozenset[str] = frozenset()  # gradients of results the loss does not use, priced as absent

    @functools.cached_property
    def memory(self) -> MemoryModel:
        """How the allocator of the device the graph runs on counts its memory."""
        return graph_memory(self.joint)

    @property
    def held_output_bytes(self) -> int:
        """Results counted as held by the caller until backward ends."""
        return sum(self.results.values()) if self.holds_outputs else 0

    @property
    def droppable_output_bytes(self) -> int:
        """Results counted held that the caller may drop before backward instead: those of a graph that
        computes its own loss (the others feed the caller's loss)."""
        return self.held_output_bytes if self.own_loss else 0

    def held_beside(self, kept: Iterable[str]) -> int:
        """Bytes of held results that a plan keeping ``kept`` does not also keep for backward
        (a result backward reads, or a view of it, is one tensor: counted once)."""
        if not self.holds_outputs:
            return 0
        saved = {
            self._storage_root(name)
            for name in kept
            if name in self.nodes and any(_kind(u) == BACKWARD for u in self.nodes[name].users)
        }
        return sum(nbytes for name, nbytes in self.results.items() if self._storage_root(name) not in saved)

    def _storage_root(self, name: str) -> str:
        """The node owning the storage that node ``name`` views."""
        while name in self.nodes and (alias := self.node_cost(name).alias_of) is not None:
            name = alias
        return name

    def node_cost(self, name: str) -> NodeCost:
        return self.nodes[name].meta["ckptc"]

    def graph_nodes(self, names: Iterable[str]) -> list[str]:
        """``names`` without the zero-byte markers that are not graph nodes."""
        return [n for n in names if n in self.nodes]

    # The one conversion between FX node names (this process's graph) and stable
    # names (``transformer.h.3.attn.mm_1``, the same in every process: plan files).
    def node_name(self, stable_name: str) -> str:
        """The node of this graph with ``stable_name`` (``KeyError`` if there is none)."""
        by_stable = self.__dict__.get("_by_stable")
        if by_stable is None:
            by_stable = self.__dict__["_by_stable"] = {s: n for n, s in self.stable_names.items()}
        return by_stable[stable_name]

    def plan_in_stable_names(self, plan: solvers.Plan) -> solvers.Plan:
        """``plan`` with every node named by its stable name."""
        stable = self.stable_names
        return dataclasses.replace(
            plan,
            kept=frozenset(stable[k] for k in plan.kept),
            schedule=None
            if plan.schedule is None
            else tuple(solvers.Step(stable[s.node], s.phase) for s in plan.schedule),
        )

    def plan_in_node_names(self, plan: solvers.Plan, field: str = "plan") -> solvers.Plan:
        """Inverse of :meth:`plan_in_stable_names`.

        Raises:
            KeyError: ``(stable name, field)`` of the first name this graph does not have,
                ``field`` being ``"<field>.kept"`` or ``"<field>.schedule[i]"``.
        """

        def node(name: str, where: str) -> str:
            try:
                return self.node_name(name)
            except KeyError:
                raise KeyError(name, where) from None

        return dataclasses.replace(
            plan,
            kept=frozenset(node(k, f"{field}.kept") for k in sorted(plan.kept)),
            schedule=None
            if plan.schedule is None
            else tuple(
                solvers.Step(node(s.node, f"{field}.schedule[{i}]"), s.phase) for i, s in enumerate(plan.schedule)
            ),
        )


def graph_memory(joint: fx.GraphModule) -> MemoryModel:
    """How the allocator of the device ``joint`` runs on counts its memory (from its inputs' device)."""
    values = [n.meta.get("val") for n in joint.graph.find_nodes(op="placeholder")]
    return memory_model(graph_device([v for v in values if isinstance(v, torch.Tensor)]))


def _size_groups(
    graph: fx.Graph, fields: dict[str, dict[str, Any]], memory: MemoryModel
) -> tuple[solvers.SizeGroup, ...]:
    """The data-dependent counts of ``graph`` that share a total (:func:`ckptc.pricing.routing.routed_sizes`),
    with the nodes whose bytes grow with each.  On an allocator that rounds blocks, a growing node's bytes
    gain the most its rounding can add at a smaller count (``fields`` is updated)."""
    groups = []
    for routed in routed_sizes(graph):
        growing: dict[Any, list[tuple[str, int]]] = {symbol: [] for symbol in routed.bounds}
        for name, (symbol, unit) in routed.growing.items():
            growing[symbol].append((name, unit))
        members = []
        for symbol, bound in routed.bounds.items():
            nodes = []
            top = routed.priced_at[symbol]
            for name, unit in growing[symbol]:
                node = _priced_at_ranges(fields, name, unit * top)
                if node is not None:
                    # Priced at the count's range; the mask bounds it lower (top-k: one token per row).
                    node["bytes"] += memory.rounding_slack(node["bytes"]) - unit * (top - bound)
                    nodes.append((name, unit))
            members.append((bound, tuple(nodes)))
        for name, units in routed.summed.items():
            priced = sum(unit * routed.priced_at[symbol] for symbol, unit in units.items())
            node = _priced_at_ranges(fields, name, priced)
            if node is not None:
                # Several counts of the group at once (their runs concatenated): at most their worst split.
                node["bytes"] += memory.rounding_slack(node["bytes"]) - (priced - routed.most_bytes(units))
        if any(nodes for _, nodes in members):
            groups.append(solvers.SizeGroup(total=routed.total, members=tuple(members)))
    if groups:
        log.debug("%d groups of routed counts priced at their worst split", len(groups))
    return tuple(groups)


def _priced_at_ranges(fields: dict[str, dict[str, Any]], name: str, priced: int) -> dict[str, Any] | None:
    """The fields of node ``name`` where its bytes are its own and were priced at its counts' ranges
    (``priced`` or more); None for a view, a part of a multi-output value, or a node priced otherwise (a
    gradient summed in place, a value never written)."""
    node = fields.get(name)
    if node is None or node["alias_of"] is not None or node["part_of"] is not None:
        return None
    return node if node["bytes"] and node["bytes"] >= priced else None


def joint_to_problem(
    joint: fx.GraphModule,
    num_fwd_outputs: int,
    *,
    baseline_bytes: int = 0,
    mutated_inputs: frozenset[str] = frozenset(),
    policies: dict[str, str] | None = None,
    hold_outputs: bool | None = False,
    free_unused_grads: bool = False,
    in_place_backward: bool = False,
    accumulated_gradients: frozenset[int] = frozenset(),
    loss_bytes: int = 0,
    gradient_sum_bytes: int = 0,
) -> JointProblem:
    """Build the solver problem of an annotated joint graph.

    Order: inputs, then forward nodes, then tangents and backward nodes, each in
    graph order (the joint graph interleaves a few tangent-independent nodes,
    such as transposes of weights, with backward; they count as forward).

    Args:
        joint: graph annotated by :func:`ckptc.pricing.costs.annotate_costs`.
        num_fwd_outputs: how many leading graph outputs belong to forward.
        baseline_bytes: memory held outside this graph for the whole step.
        mutated_inputs: placeholder names that forward mutates; forward nodes
            reading them are saved, since recomputing them would read new values.
        policies: extra ``node name -> "save" | "recompute"`` constraints.
        hold_outputs: count the forward results (logits, hidden states) as alive
            until backward ends, for callers that keep them (True), or let them
            die at the end of forward, as in ``loss = model(x).loss`` (False).
            None decides from the graph (:func:`returns_own_loss`): results are
            held unless the graph computes a scalar loss of its own.
        free_unused_grads: the backward receives no tensor for the gradient of a
            result nobody used (:mod:`ckptc.rewrite.unused_grads`).  Where the graph
            computes its own loss (:func:`returns_own_loss`) or its results are released
            (``hold_outputs`` False), the other results' gradients are priced as free, and
            ``add(gradient, g)`` as ``g`` itself: the loss does not use them, held or not.
        in_place_backward: the backward writes elementwise results into an
            operand they are the last reader of, as eager's gradient
            accumulation does (:mod:`ckptc.rewrite.lean_backward`); such ops are priced
            as views of that operand.
        accumulated_gradients: positions of inputs (parameters) whose gradient the
            backward adds into the resident ``.grad`` as soon as it is made
            (:class:`ckptc.rewrite.lean_backward.GradientSink`): such a gradient dies at its
            last read instead of living to the end of backward.
        loss_bytes: memory the caller's loss takes between this graph's forward and backward
            (:attr:`ckptc.planning.account.StepAccount.loss_bytes`): a transient node at the end of
            forward, after the results are released, that no backward node reads.
        gradient_sum_bytes: what autograd allocates as this graph's backward returns: where its parameter
            gradients meet another call's (:attr:`ckptc.planning.account.StepAccount.gradients_summed_by_autograd`),
            and the parameter-sized buffers of the gradients of parameter views it takes
            (:attr:`ckptc.records.GraphInputs.view_gradient_bytes`): a transient node after every backward
            node, while all the gradients are alive.
    """
    policies = _spread_over_views(joint, dict(policies or {}))
    output_node = next(iter(joint.graph.find_nodes(op="output")))
    forward_results = [a for a in tree_leaves(output_node.args[0][:num_fwd_outputs]) if isinstance(a, fx.Node)]
    gradients = list(output_node.args[0][num_fwd_outputs:])
    backward_results = [a for a in tree_leaves(gradients) if isinstance(a, fx.Node)]
    sunk = _sunk_gradients(gradients, accumulated_gradients)
    output_names = {n.name for n in backward_results if n.name not in sunk}
    own_loss = returns_own_loss(forward_results)
    if hold_outputs is None:
        hold_outputs = not own_loss
    # Scalars (the loss) stay alive: the caller holds the loss while calling backward on it.
    output_names |= {n.name for n in forward_results if hold_outputs or _numel(n) <= 1}

    mutated_inputs = frozenset(mutated_inputs) | _inputs_mutated_in_graph(joint)
    reads_mutated = _readers_of_mutated_inputs(joint, mutated_inputs)
    for node in joint.graph.nodes:
        state = node.meta.get("ckptc_rng_state")
        if state is not None:
            # Recomputing the state capture would capture a later state: save it.
            policies[state.name] = "save"
        if node.meta.get(INPUT_LAYOUT_COPY):
            # Inductor would not recompute it but reorder the input as unseen scratch (a ConvNet's first
            # step measured 4% over its prediction where a plan recomputed a weight's copy).
            policies[node.name] = "save"
    for name in _snapshots_of_fixed_inputs(joint, output_node, num_fwd_outputs):
        policies[name] = "save"
    differentiable = _differentiable_nodes(joint, output_node, num_fwd_outputs)
    unused = free_unused_grads and (own_loss or not hold_outputs)
    free_tangents: dict[str, Folding] = foldable_tangents(joint.graph) if unused else {}
    # node name -> (bytes, alias_of) for nodes that vanish when those gradients are absent,
    # or that write into an operand (in_place_backward).
    vanishing: dict[str, tuple[int, str | None]] = {}
    for folding in free_tangents.values():
        for node, value in folding.replaced.items():
            vanishing[node.name] = (0, node.meta["ckptc"].alias_of if value is ZERO else value.name)
    if in_place_backward:
        # A folded zero's readers read the value it folds into: leave folded nodes and those values alone.
        folding = set(vanishing) | {alias for _, alias in vanishing.values()}
        for node, operand in in_place_targets(joint.graph).items():
            if node.name not in folding and operand.name not in folding:
                vanishing[node.name] = (0, operand.name)
    region_outputs = _outputs_read_by_later_regions(joint)
    fields: dict[str, dict] = {}  # node name -> solvers.Node fields but its name and preds
    reads: dict[str, list[str]] = {}
    inputs, forward, backward = [], [], []
    nodes: dict[str, fx.Node] = {}
    for node in joint.graph.nodes:
        if node.op == "output":
            continue
        cost: NodeCost = node.meta["ckptc"]
        nodes[node.name] = node
        preds = list(dict.fromkeys(n.name for n in node.all_input_nodes))
        state = node.meta.get("ckptc_rng_state")
        if state is not None:
            preds.append(state.name)
        policy = policies.get(node.name)
        if cost.kind == FORWARD and isinstance(node.meta.get("val"), (tuple, list)):
            # A tuple cannot be saved for backward; its getitems can.
            policy = "recompute"
        elif cost.kind == FORWARD and _random_without_replay(node):
            # No captured generator state to replay it with: its output must be kept.
            policy = "save"
        if node.name in reads_mutated and policy != "save" and not isinstance(node.meta.get("val"), (tuple, list)):
            # Recomputed in backward, it would read the input's new values: a
            # silently wrong gradient.  Saving wins even over must_recompute.
            if policy == "recompute" and not _is_mutating(node):
                log.warning(
                    "%s reads a buffer that the forward pass updates in place; it is saved, not "
                    "recomputed (must_recompute is ignored for it)",
                    cost.stable_name,
                )
            policy = "save"
        nbytes, alias_of = vanishing.get(node.name, (cost.bytes, cost.alias_of))
        if cost.kind == FORWARD and cost.inlined:
            # Computed inside its readers' kernels, it is never written unless it is kept: recomputed
            # in backward like them, or, where it must be saved, priced at the bytes it is written at.
            if policy == "save":
                nbytes = written_bytes(node)
            elif policy is None:
                policy = "recompute"
        fields[node.name] = dict(
            bytes=nbytes,
            cost=cost.cost,
            kind=cost.kind,
            # Mutations (copy_ into a buffer) must run; "output" makes them run once, in forward.
            output=node.name in output_names or _is_mutating(node),
            alias_of=alias_of,
            policy=policy,
            scratch=cost.scratch_bytes,
            part_of=cost.part_of,
            module=cost.module,
            op=cost.op,
            differentiable=node in differentiable,
            checkpointed=node.meta.get("recompute") in _RECOMPUTED_BY_THE_MODEL and node not in region_outputs,
            fusion=cost.fusion,
        )
        reads[node.name] = preds
        {INPUT: inputs, FORWARD: forward, BACKWARD: backward}[cost.kind].append(node.name)

    stable_names = {name: n.meta["ckptc"].stable_name for name, n in nodes.items()}
    if not hold_outputs:
        # The caller receives the forward results and (as in `loss = model(x).loss`)
        # drops what it does not need before backward: a zero-byte marker at the
        # end of forward keeps each result alive exactly through the forward phase.
        for result in dict.fromkeys(r for r in forward_results if r.name not in output_names):
            marker = RETURN_PREFIX + result.name
            fields[marker] = dict(bytes=0, cost=0.0, kind=FORWARD, output=True)
            reads[marker] = [result.name]
            forward.append(marker)
            stable_names[marker] = RETURN_PREFIX + stable_names[result.name]
    if loss_bytes > 0 and forward_results:
        # Computed after every result and freed at once: it raises the end of forward by what the
        # loss takes there and nothing else.  Never kept ("recompute": no backward node reads it).
        loss = LOSS_NODE
        fields[loss] = dict(bytes=loss_bytes, cost=0.0, kind=FORWARD, policy="recompute")
        reads[loss] = [forward_results[0].name]
        marker = RETURN_PREFIX + loss
        fields[marker] = dict(bytes=0, cost=0.0, kind=FORWARD, output=True)
        reads[marker] = [loss]
        forward += [loss, marker]
        stable_names[loss], stable_names[marker] = loss, marker

    # Tangents are backward nodes without predecessors: put them first in backward.
    backward.sort(key=lambda name: nodes[name].op != "placeholder")
    if gradient_sum_bytes > 0 and backward_results:
        # Runs after the backward returns, all its gradients alive, and frees at once.
        fields[GRADIENT_SUM_NODE] = dict(bytes=gradient_sum_bytes, cost=0.0, kind=BACKWARD)
        reads[GRADIENT_SUM_NODE] = [r.name for r in backward_results]
        backward.append(GRADIENT_SUM_NODE)
        stable_names[GRADIENT_SUM_NODE] = GRADIENT_SUM_NODE
    order = inputs + forward + backward
    position = {name: i for i, name in enumerate(order)}
    size_groups = _size_groups(joint.graph, fields, graph_memory(joint))
    problem = solvers.Problem(
        nodes=tuple(
            # Preds in execution order, each once: what a plan file's fingerprint was made from.
            solvers.Node(name=name, preds=tuple(sorted(set(reads[name]), key=position.__getitem__)), **fields[name])
            for name in order
        ),
        baseline_bytes=baseline_bytes,
        size_groups=size_groups,
    )
    results = _result_bytes(problem, [r for r in forward_results if _numel(r) > 1 and "ckptc" in r.meta])
    return JointProblem(
        problem=problem,
        joint=joint,
        num_fwd_outputs=num_fwd_outputs,
        nodes=nodes,
        stable_names=stable_names,
        holds_outputs=bool(hold_outputs),
        own_loss=own_loss,
        results=results,
        free_tangents=frozenset(free_tangents),
    )


def _result_bytes(problem: solvers.Problem, forward_results: list[fx.Node]) -> dict[str, int]:
    """Forward results -> the bytes of the storage each holds: a result that views another value
    (``view(add)``) holds that value's storage, counted once however many results view it; a view of
    an input holds nothing more (inputs are resident)."""
    results: dict[str, int] = {}
    roots: set[str] = set()
    for result in forward_results:
        root = problem.alias_root(result.name)
        fresh = root not in roots and problem[root].kind != "input"
        roots.add(root)
        results[result.name] = problem[root].bytes if fresh else 0
    return results


def _primal_gradients(
    joint: fx.GraphModule, output_node: fx.Node, num_fwd_outputs: int
) -> list[tuple[fx.Node, Any]] | None:
    """Each primal input with the gradient the joint graph returns for it (None where it receives none),
    or None where the outputs do not line up with the primals."""
    primals = [n for n in joint.graph.nodes if n.op == "placeholder" and not is_tangent(n)]
    grads = list(output_node.args[0][num_fwd_outputs:])
    return list(zip(primals, grads, strict=True)) if len(grads) == len(primals) else None


def _differentiable_nodes(joint: fx.GraphModule, output_node: fx.Node, num_fwd_outputs: int) -> set[fx.Node]:
    """Nodes a gradient flows through: primals that receive a gradient, and what reads them.

    The joint graph returns one gradient per primal input (None where there is
    none) after the forward results. Forward values that depend on no such
    primal (masks, rotary tables) are fixed data for the solvers, not decisions.
    """
    gradients = _primal_gradients(joint, output_node, num_fwd_outputs)
    if gradients is None:  # unexpected layout: treat everything as differentiable
        return set(joint.graph.nodes)
    flowing = {p for p, g in gradients if g is not None}
    for node in joint.graph.nodes:
        if node.op == "call_function" and any(a in flowing for a in node.all_input_nodes):
            flowing.add(node)
    return flowing


def _snapshots_of_fixed_inputs(joint: fx.GraphModule, output_node: fx.Node, num_fwd_outputs: int) -> set[str]:
    """Copies (``clone``, ``contiguous``, ``_to_copy``...) of inputs that receive no gradient: buffers and
    the caller's data.  Such a copy is a snapshot of a value that can change before backward, where this
    graph cannot see it: a queue of keys the model updates after a graph break (MoCo), a buffer the
    caller updates between forward and backward.  Recomputed in backward it would read the new value
    (a raw autograd error where the change bumped the tensor's version, a silently wrong gradient
    through ``.data``), so it is saved, as eager autograd saves it.  Copies of parameters (autocast's
    low-precision weights) stay recomputable: nothing changes them before backward."""
    gradients = _primal_gradients(joint, output_node, num_fwd_outputs)
    fixed = {p for p, g in gradients or () if g is None}
    return {
        node.name
        for node in joint.graph.nodes
        if node.op == "call_function"
        and node.meta["ckptc"].op in COPY_OPS
        and bool(node.all_input_nodes)
        and node.all_input_nodes[0] in fixed
    }


def _outputs_read_by_later_regions(joint: fx.GraphModule) -> set[fx.Node]:
    """Values of the model's own checkpointed regions that forward code after the region reads.

    Two consecutive ``torch.utils.checkpoint`` calls share a value: the first
    region's output is the second's input, which ``checkpoint()`` saves; a
    region's output read by an op outside any region is saved by that op.
    Either way it is a boundary, not part of what the model recomputes
    (PyTorch's partitioner does the same in ``cleanup_recompute_tags``).
    """

    def in_region(node: fx.Node) -> bool:
        return node.meta.get("recompute") in _RECOMPUTED_BY_THE_MODEL

    found = set()
    for node in joint.graph.nodes:
        region = node.meta.get("ac_graph_id")
        if region is None or not in_region(node):
            continue
        for user in node.users:
            cost = user.meta.get("ckptc")
            if cost is None or cost.kind != FORWARD:
                continue
            if not in_region(user) or user.meta.get("ac_graph_id", region) > region:
                found.add(node)
                break
    return found


def _sunk_gradients(gradients: list[Any], positions: frozenset[int]) -> set[str]:
    """Names of the gradient nodes returned only at ``positions`` (each returned once)."""
    returned: dict[str, list[int]] = {}
    for i, g in enumerate(gradients):
        if isinstance(g, fx.Node):
            returned.setdefault(g.name, []).append(i)
    return {name for name, at in returned.items() if len(at) == 1 and at[0] in positions}


def _kind(node: fx.Node) -> int | None:
    cost = node.meta.get("ckptc")
    return None if cost is None else cost.kind


def returns_own_loss(forward_results: Iterable[fx.Node]) -> bool:
    """Whether a graph computes its own loss: a floating-point scalar it returns.

    A model that returns its loss (``model(x, labels=y).loss``) lets the caller
    drop the other results (logits) before backward.  A model that returns only
    logits leaves the loss to the caller, who holds the logits until backward
    ends (``loss = criterion(model(x), y); loss.backward()``), so they count
    through backward.
    """
    for node in forward_results:
        val = node.meta.get("val")
        if (
            node.op != "placeholder"
            and isinstance(val, torch.Tensor)
            and _numel(node) == 1
            and val.dtype.is_floating_point
        ):
            return True
    return False


def _spread_over_views(joint: fx.GraphModule, policies: dict[str, str]) -> dict[str, str]:
    """ "recompute" on a value applies to its views too: keeping a view keeps the storage."""
    if "recompute" not in policies.values():
        return policies
    root: dict[str, str] = {}
    for node in joint.graph.nodes:
        cost = node.meta.get("ckptc")
        if cost is not None:
            root[node.name] = root.get(cost.alias_of, cost.alias_of) if cost.alias_of else node.name
    doomed = {root[n] for n, p in policies.items() if p == "recompute" and n in root}
    for name, r in root.items():
        if r in doomed and policies.get(name) != "save":
            policies[name] = "recompute"
    return policies


def _random_without_replay(node: fx.Node) -> bool:
    source = node.args[0] if cost_of(node).part_of and node.args else node
    return isinstance(source, fx.Node) and cost_of(source).random and "ckptc_rng_state" not in source.meta


def cost_of(node: fx.Node) -> NodeCost:
    return node.meta["ckptc"]


def _numel(node: fx.Node) -> int:
    val = node.meta.get("val")
    return priced_size(val.numel(), f"the size of {node.name}") if isinstance(val, torch.Tensor) else 0


def _readers_of_mutated_inputs(joint: fx.GraphModule, mutated_inputs: frozenset[str]) -> set[str]:
    """Forward nodes that read an input the graph mutates, directly or through views.

    A view (``mean[None, :]``, ``mean.view(1, -1)``, chains of them) shares
    the input's storage, so it sees the update too: keeping the view protects
    nothing.  Every forward node reading the input or any view of it is
    returned (views included, and the getitems of a multi-output reader),
    so that its output, computed before the update, is what backward uses.
    """
    if not mutated_inputs:
        return set()
    aliases = set(mutated_inputs)  # the mutated inputs and every view of them
    readers: set[str] = set()
    for node in joint.graph.nodes:
        cost: NodeCost | None = node.meta.get("ckptc")
        if cost is None or node.op != "call_function":
            continue
        inputs = {n.name for n in node.all_input_nodes}
        is_view = cost.alias_of is not None or is_view_op(node.target)
        if is_view and (cost.alias_of in aliases or (cost.alias_of is None and inputs & aliases)):
            aliases.add(node.name)
        if cost.kind != FORWARD:
            continue
        if op_schema_name(node.target) in _READS_MUTATED_STATE_SAFELY:
            continue
        if inputs & aliases or cost.part_of in readers:
            readers.add(node.name)
    return readers


def _inputs_mutated_in_graph(joint: fx.GraphModule) -> frozenset[str]:
    """Placeholders that a mutating op (``copy_`` of new BatchNorm statistics) writes to."""
    return frozenset(
        node.args[0].name
        for node in joint.graph.nodes
        if _is_mutating(node) and node.args and isinstance(node.args[0], fx.Node) and node.args[0].op == "placeholder"
    )


def _is_mutating(node: fx.Node) -> bool:
    return is_mutable_op(node.target)


def with_later_results(jp: JointProblem, nbytes: int) -> JointProblem:
    """``jp`` with ``nbytes`` of results that later graphs of its call return and the caller holds until
    backward ends (:attr:`ckptc.planning.account.StepAccount.later_results_held`): made after this graph's
    forward and alive through its backward, which runs after theirs.  A forward node at the end of forward
    that no backward node reads and that never dies (an ``output``), so the forward's own peak is not
    raised by them.  Replaces what ``jp`` counted so before; ``jp`` itself where that is the same."""
    held_at = jp.problem.index.get(LATER_RESULTS_NODE)
    if nbytes == (0 if held_at is None else jp.problem.nodes[held_at].bytes):
        return jp
    nodes = [n for n in jp.problem.nodes if n.name != LATER_RESULTS_NODE]
    if nbytes <= 0:
        return dataclasses.replace(jp, problem=dataclasses.replace(jp.problem, nodes=tuple(nodes)))
    end = max((i for i, n in enumerate(nodes) if n.kind == FORWARD), default=-1) + 1
    held = solvers.Node(name=LATER_RESULTS_NODE, bytes=nbytes, cost=0.0, kind=FORWARD, output=True, policy="recompute")
    nodes.insert(end, held)
    return dataclasses.replace(
        jp,
        problem=dataclasses.replace(jp.problem, nodes=tuple(nodes)),
        stable_names={**jp.stable_names, LATER_RESULTS_NODE: LATER_RESULTS_NODE},
    )
