"""Results that the loss does not use get no gradient, instead of a tensor of zeros.

In ``loss = model(x, labels=y).loss; loss.backward()`` the model also returns
its logits.  Nothing uses them, so eager autograd never builds their gradient.
A compiled graph, though, runs inside one ``torch.autograd.Function``, and
autograd hands its backward a full-size tensor of zeros for every result that
received no gradient ("materialized" gradients).  The backward then adds this
tensor to the gradient that comes from the loss.  For a language model's
logits it is the largest tensor of the step, and it is alive from the start
of backward.

This module keeps the mechanism apart from the decision:

* :func:`fold_zeros` is the analysis.  Given placeholders known to be zero, it
  says which nodes are then zero (views, ``mul``, ``sum``, an activation's backward of a zero) or equal to
  another node (``add(zero, g)`` is ``g``).  It also says whether the zeros
  vanish completely, that is, whether no other op needs them as real tensors.
* :func:`foldable_tangents` names the tangents that vanish completely.
  :func:`ckptc.pricing.problem.joint_to_problem` prices them as free when the caller
  drops the graph's results after forward (the ``hold_outputs`` assumption).
* :class:`ZeroGradBackward` is the runtime.  The forward asks autograd to pass
  ``None`` for missing gradients (:func:`ckptc._torch_internals.
  pass_missing_grads_as_none`).  The backward, given ``None`` for tangents, runs a
  copy of its graph specialized for them (:func:`specialize`); it builds one copy per
  pattern of missing tangents.  The zeros fold away where :func:`fold_zeros` can;
  an op that needs one as a real tensor gets a tensor of zeros made just before it
  (the missing tangent itself, if that is what it reads).  An input's gradient that
  no present tangent reaches is ``None``, as eager leaves it: a backward is linear in
  its tangents, so it is zero, and eager's autograd, starting from the results that
  got a gradient, never reaches that input.  When a tangent that the plan priced as
  free arrives as a real tensor, the gradient is still exact, but memory may exceed
  the plan; the record is marked, and :mod:`ckptc.runtime.step` plans again with the
  results held.
"""

from __future__ import annotations

import logging
import math
import operator
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Protocol

import torch
import torch.fx as fx

from ckptc._torch_internals import graph_module, is_op_overload, is_tangent, is_view_op, mark_boxed
from ckptc.errors import CkptcError, UntraceableModelError, warn_once

log = logging.getLogger("ckptc.rewrite.unused_grads")

aten = torch.ops.aten

# Ops whose result is zero when their first argument is zero: linear in it (the backward of an
# activation, softmax or dropout is linear in the gradient it is given).  View ops count too.
_ZERO_IF_FIRST = {
    aten.clone.default,
    aten._unsafe_view.default,
    aten._to_copy.default,
    aten.neg.default,
    aten.div.Tensor,
    aten.div.Scalar,
    aten.mul.Scalar,
    aten.sum.default,
    aten.sum.dim_IntList,
    aten.mean.default,
    aten.mean.dim,
    aten.cumsum.default,
    aten.index_select.default,
    aten.gather.default,
    aten.flip.default,
    aten.roll.default,
    aten.repeat.default,
    aten.tanh_backward.default,
    aten.sigmoid_backward.default,
    aten.gelu_backward.default,
    aten.silu_backward.default,
    aten.threshold_backward.default,
    aten.hardtanh_backward.default,
    aten.leaky_relu_backward.default,
    aten.elu_backward.default,
    aten.softplus_backward.default,
    aten.mish_backward.default,
    aten.hardswish_backward.default,
    aten.hardsigmoid_backward.default,
    aten._softmax_backward_data.default,
    aten._log_softmax_backward_data.default,
    aten.native_dropout_backward.default,
    aten.select_backward.default,
    aten.slice_backward.default,
    aten.embedding_dense_backward.default,
}
# Ops with several results, each zero when their first argument (the gradient of their forward's
# output) is zero: a normalization's, convolution's or attention kernel's backward.  Their
# ``getitem``s are then zero too.
_ZEROS_IF_FIRST = {
    aten.native_layer_norm_backward.default,
    aten.native_group_norm_backward.default,
    aten.native_batch_norm_backward.default,
    aten.convolution_backward.default,
    aten._scaled_dot_product_flash_attention_for_cpu_backward.default,
    aten._scaled_dot_product_flash_attention_backward.default,
    aten._scaled_dot_product_efficient_attention_backward.default,
    aten._scaled_dot_product_cudnn_attention_backward.default,
}
# Ops whose result is zero when any argument is zero (a linear layer's backward: mm, bmm).
_ZERO_IF_ANY = {aten.mul.Tensor, aten.mm.default, aten.bmm.default}
# Ops joining a list of tensors: zero when every tensor of the list is zero (the gradient of a
# fused projection split into query, key and value).
_JOINS = {aten.cat.default, aten.stack.default}

ZERO = None
"""The value :func:`fold_zeros` gives a node that is all zeros."""


@dataclass
class Folding:
    """What :func:`fold_zeros` found.

    Attributes:
        replaced: node -> ``ZERO`` (the node is all zeros) or the argument it equals
            (which may itself be replaced: follow the chain).
        blocked: every node that needs a zero as a real tensor, in graph order.
    """

    replaced: dict[fx.Node, fx.Node | None] = field(default_factory=dict)
    blocked: list[fx.Node] = field(default_factory=list)

    @property
    def complete(self) -> bool:
        """No op needs one of the zeros as a real tensor: they vanish."""
        return not self.blocked

    @property
    def blocked_by(self) -> fx.Node | None:
        """The first node that needs a zero as a real tensor (None if complete)."""
        return self.blocked[0] if self.blocked else None


def fold_zeros(graph: fx.Graph, zeros: Iterable[fx.Node]) -> Folding:
    """Which nodes of ``graph`` are zero, or equal to another node, when ``zeros`` are zero.

    Walks the nodes once, in order.  A node is zero when it is a view of a zero,
    one of the zero-preserving ops applied to a zero (an activation's backward
    given a zero gradient), a ``mul`` with a zero, or a result of a multi-result
    backward op (layer norm, convolution, attention) given a zero gradient.
    ``add(a, zero)``, ``add(zero, b)`` (``alpha=1``) and ``sub(a, zero)`` equal their
    other argument when it has the result's shape, strides and dtype.  A zero
    returned is returned as ``None`` (an input's gradient that is all zeros: no
    gradient, as in eager, where a parameter nothing reached keeps ``.grad=None``).
    Every other use of a zero needs it as a real tensor: the result is then not
    ``complete`` (``blocked_by`` is the first such node, ``blocked`` all of them), and
    the walk goes on with that node's result taken as real.
    Pure analysis; the graph is not changed.
    """
    folding = Folding()
    zero_set = set(zeros)
    replaced = folding.replaced
    for z in zero_set:
        replaced[z] = ZERO

    def is_zero(arg: Any) -> bool:
        return isinstance(arg, fx.Node) and arg in replaced and replaced[arg] is ZERO

    for node in graph.nodes:
        if node in zero_set:
            continue
        zero_inputs = [a for a in node.all_input_nodes if is_zero(a)]
        if not zero_inputs:
            continue
        if node.op == "output":
            continue  # a zero gradient returned is returned as None: no gradient, as in eager
        target = node.target
        first = node.args[0] if node.args else None
        if node.op == "call_function" and (
            (
                (is_view_op(target) or target in _ZERO_IF_FIRST or target in _ZEROS_IF_FIRST)
                and is_zero(first)
                and len(zero_inputs) == 1
            )
            or target in _ZERO_IF_ANY
            or target is operator.getitem  # of a zero's results: ``first`` is the only node
            or (target in _JOINS and all(is_zero(a) for a in first))
        ):
            replaced[node] = ZERO
            continue
        if node.op == "call_function" and target in (aten.add.Tensor, aten.sub.Tensor) and len(node.args) == 2:
            a, b = node.args
            alpha = node.kwargs.get("alpha", 1)
            if is_zero(a) and is_zero(b):
                replaced[node] = ZERO
                continue
            other = a if is_zero(b) else (b if target is aten.add.Tensor and alpha == 1 else None)
            if other is not None and _same_layout(other, node):
                replaced[node] = other
                continue
        folding.blocked.append(node)
    return folding


def _same_layout(a: Any, b: fx.Node) -> bool:
    va, vb = getattr(a, "meta", {}).get("val"), b.meta.get("val")
    return (
        isinstance(va, torch.Tensor)
        and isinstance(vb, torch.Tensor)
        and va.dtype == vb.dtype
        and va.device == vb.device
        and tuple(va.shape) == tuple(vb.shape)
        and tuple(va.stride()) == tuple(vb.stride())
    )


def _static_size(node: fx.Node) -> bool:
    val = node.meta.get("val")
    return isinstance(val, torch.Tensor) and all(isinstance(s, int) for s in (*val.shape, *val.stride()))


def zeros_buildable(graph: fx.Graph) -> bool:
    """Whether every tangent of ``graph`` has a static size, so zeros can be built for any that does not fold.

    Only then may its backward receive ``None`` for missing gradients.
    """
    return all(_static_size(n) for n in graph.nodes if n.op == "placeholder" and is_tangent(n))


def foldable_tangents(graph: fx.Graph) -> dict[str, Folding]:
    """The tangents of ``graph`` that vanish completely when they are zero, with their folding.

    Only tangents with more than one element (a scalar's gradient, the
    loss's, costs nothing), and none at all unless every tangent has a static
    size (:func:`zeros_buildable`): a graph with a dynamic one keeps autograd's zeros.
    """
    found: dict[str, Folding] = {}
    if not zeros_buildable(graph):
        return found  # the backward keeps receiving zeros
    for node in graph.nodes:
        if node.op != "placeholder" or not is_tangent(node):
            continue
        if math.prod(node.meta["val"].shape) <= 1:
            continue
        folding = fold_zeros(graph, [node])
        if folding.complete:
            found[node.name] = folding
    return found


def specialize(gm: fx.GraphModule, zero_names: Iterable[str]) -> tuple[fx.GraphModule, frozenset[str]]:
    """A copy of ``gm`` in which the tangents ``zero_names`` are zero, with the tangents it still reads.

    The zeros fold away where :func:`fold_zeros` can.  An op that needs one of them
    as a real tensor reads a tensor of zeros made just before it, or, where that
    zero is a tangent itself or its size is not static, the tangent, given as zeros
    by the caller: those tangents are returned.  An input's gradient that only
    missing tangents reach is returned as ``None`` (see the module's docstring), and
    what computed it only for that is removed.  The placeholders stay (a tangent not
    returned receives ``None``).
    """
    zero_names = frozenset(zero_names)
    graph = fx.Graph()
    graph.output(graph.graph_copy(gm.graph, {}))  # graph_copy leaves out the output node
    tangents = [n for n in graph.find_nodes(op="placeholder") if is_tangent(n)]
    zeros = [n for n in tangents if n.name in zero_names]
    only_missing = _reached(graph, zeros) - _reached(graph, [n for n in tangents if n.name not in zero_names])
    folding = fold_zeros(graph, zeros)
    needed = _real_zeros_needed(folding)
    made = {z: users for z, users in needed.items() if z.op != "placeholder" and not is_view_op(z.target)}
    if not all(_static_size(z) for z in made):
        # A zero of symbolic size cannot be made here: the zeros come in as tangents and nothing folds.
        folding, made = Folding(replaced={z: ZERO for z in zeros}), {}
    position = {node: i for i, node in enumerate(graph.nodes)}
    for z, users in made.items():
        val = z.meta["val"]
        with graph.inserting_before(min(users, key=position.__getitem__)):
            # ``full``, not ``zeros``: Inductor lowers the one and expects the other decomposed.
            real = graph.call_function(
                aten.full.default, (list(val.shape), 0), {"dtype": val.dtype, "device": val.device}
            )
        real.meta["val"] = _zeros_value(val)
        for user in users:
            user.replace_input_with(z, real)
    resolved: dict[fx.Node, fx.Node | None] = {}
    for node, value in folding.replaced.items():
        while value is not ZERO and folding.replaced.get(value, value) is not value:
            value = folding.replaced[value]
        resolved[node] = value
        if value is not ZERO and node.op != "placeholder":
            node.replace_all_uses_with(value)
    output = next(iter(graph.find_nodes(op="output")))
    output.args = fx.node.map_arg(
        output.args, lambda n: None if resolved.get(n, n) is ZERO or n in only_missing else resolved.get(n, n)
    )
    for node in reversed(list(graph.nodes)):
        # Only aten ops without side effects: ckptc's own calls (random state, frees) stay where they are.
        if not node.users and node.op == "call_function" and is_op_overload(node.target) and not node.is_impure():
            graph.erase_node(node)
    graph.lint()
    read = frozenset(n.name for n in zeros if n.users)
    return graph_module(gm, graph), read


def _reached(graph: fx.Graph, sources: Iterable[fx.Node]) -> set[fx.Node]:
    """The nodes of ``graph`` whose value depends on one of ``sources`` (themselves included)."""
    reached = set(sources)
    for node in graph.nodes:
        if node not in reached and any(a in reached for a in node.all_input_nodes):
            reached.add(node)
    return reached


def _real_zeros_needed(folding: Folding) -> dict[fx.Node, list[fx.Node]]:
    """Each zero that an op of ``folding.blocked`` reads as a real tensor, with the nodes reading it.

    A view of a zero is still taken of its base (a view costs no bytes, a tensor of zeros made for it
    would): its base is then needed, read by the view.
    """
    needed: dict[fx.Node, list[fx.Node]] = {}
    for node in folding.blocked:
        for arg in node.all_input_nodes:
            if folding.replaced.get(arg, arg) is ZERO:
                needed.setdefault(arg, []).append(node)
    views = [z for z in needed if z.op == "call_function" and is_view_op(z.target)]
    while views:
        view = views.pop()
        base = view.args[0]
        if isinstance(base, fx.Node) and folding.replaced.get(base, base) is ZERO:
            if base not in needed and base.op == "call_function" and is_view_op(base.target):
                views.append(base)
            needed.setdefault(base, []).append(view)
    return needed


def _zeros_value(val: torch.Tensor) -> torch.Tensor:
    """The ``meta["val"]`` of a tensor of zeros shaped as ``val`` (contiguous), made as ``val`` was."""
    mode = getattr(val, "fake_mode", None)
    if mode is None:
        return torch.zeros(val.shape, dtype=val.dtype, device="meta")
    with mode:
        return torch.zeros(val.shape, dtype=val.dtype, device=val.device)


class WatchedGraph(Protocol):
    """What the backward reads and marks of its graph's record (:class:`ckptc.records.GraphRecord`)."""

    index: int
    gradients_unexpected: bool


_BACKWARD_UNDER_OTHER_AUTOCAST = (
    "ckptc: backward() runs under other torch.autocast settings than the forward did (autocast around "
    "backward() only, say): the values the plan recomputes in backward are computed under them (in "
    "bfloat16, say), where eager PyTorch reads the forward's own values, so the gradients differ from eager's "
    "(0.3% on the recomputed layers of a 3-layer MLP) or backward fails.  What to do: call backward() "
    "outside torch.autocast, as PyTorch's automatic mixed precision guide says (the forward and the loss go "
    "inside it), or train this step without ckptc."
)


def autocast_settings() -> tuple[tuple[str, bool, torch.dtype], ...]:
    """Whether torch.autocast is on, and at which dtype, for each device type it applies to here."""
    devices = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
    return tuple((d, torch.is_autocast_enabled(d), torch.get_autocast_dtype(d)) for d in devices)


class ZeroGradBackward:
    """The backward of one graph, run with ``None`` for gradients nobody computed.

    Args:
        gm: the rewritten backward module (tangent placeholders last).
        compile_graph: turns a module into a boxed callable, given the arguments of its first run
            (kernels are compiled for their layouts: a compiled forward may save a tensor in another
            layout than the joint graph traced).
        free: tangents the plan priced as free (they should arrive as ``None``).
        record: the graph's record, marked when a free tangent arrives as a tensor.
    """

    def __init__(
        self,
        gm: fx.GraphModule,
        compile_graph: Callable[[fx.GraphModule, list[Any]], Callable],
        *,
        free: Iterable[str] = (),
        record: WatchedGraph | None = None,
    ) -> None:
        placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
        self.tangents = {i: n for i, n in enumerate(placeholders) if is_tangent(n)}
        self.free = frozenset(free)
        self.record = record
        self.gm = gm
        self.compile_graph = compile_graph
        # Built while its forward is traced, under the autocast settings the forward runs with (Dynamo
        # compiles again under others); what the backward recomputes is that forward's code.
        self.recomputes = any("ckptc_recompute_of" in node.meta for node in gm.graph.nodes)
        self.forward_autocast = autocast_settings()
        # Compiled on first use: under Inductor a variant no step runs would cost a compile.
        self.variants: dict[frozenset[str], tuple[Callable, frozenset[str]]] = {}
        mark_boxed(self)  # in the instance dict: wrappers copy it (functools.wraps), not class attributes

    def __repr__(self) -> str:
        return (
            f"ZeroGradBackward(tangents={len(self.tangents)}, free={sorted(self.free)}, variants={len(self.variants)})"
        )

    def __call__(self, args: list[Any]) -> Any:
        missing = set()
        for i, node in self.tangents.items():
            if args[i] is not None:
                if node.name in self.free and self.record is not None and not self.record.gradients_unexpected:
                    self.record.gradients_unexpected = True
                    # Said at info level: the step's check warns once with what it does about it.
                    log.info(
                        "graph %d: the result of %s received a gradient; the plan counted it as unused "
                        "(the graph returns a scalar taken for the loss, and a caller reading only it drops "
                        "the other results), so memory may exceed the plan in this step",
                        self.record.index,
                        node.name,
                    )
                continue
            missing.add(node.name)
        key = frozenset(missing)
        variant = self.variants.get(key)
        if variant is None:
            gm, read = specialize(self.gm, key) if key else (self.gm, frozenset())
            if key:
                log.debug("backward specialized for unused results %s (given as zeros: %s)", sorted(key), sorted(read))
            self._give_zeros(args, read)
            variant = self.variants[key] = (self.compile_graph(gm, args), read)
        else:
            self._give_zeros(args, variant[1])
        run = variant[0]
        other_autocast = self.recomputes and autocast_settings() != self.forward_autocast
        if other_autocast:
            warn_once(self, "backward-under-other-autocast", _BACKWARD_UNDER_OTHER_AUTOCAST)
        try:
            return run(args)
        except (CkptcError, MemoryError, torch.OutOfMemoryError):
            raise  # ckptc's own, or the step did not fit the device: not a capture that failed
        except Exception as error:
            graph = "a graph" if self.record is None else f"graph {self.record.index}"
            if other_autocast:
                raise UntraceableModelError(
                    f"{graph}'s backward failed ({type(error).__name__}: {error}). {_BACKWARD_UNDER_OTHER_AUTOCAST}"
                ) from error
            raise UntraceableModelError.from_exception(f"the model ({graph}'s backward)", error, "run") from error

    def _give_zeros(self, args: list[Any], names: frozenset[str]) -> None:
        """Tensors of zeros for the missing tangents ``names`` (a specialized backward still reads them)."""
        for i, node in self.tangents.items():
            if node.name in names:
                val = node.meta["val"]
                args[i] = torch.empty_strided(val.shape, val.stride(), dtype=val.dtype, device=val.device).zero_()
