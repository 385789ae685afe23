"""A backward that holds no more than eager's: two passes over the joint graph.

**Unread statistics.**  In training mode ``native_batch_norm_backward`` reads
the batch's saved mean and inverse deviation, never the running statistics;
the traced backward still passes it the *new* running statistics, which are
then saved for backward where eager saves nothing new (the buffers
themselves).  :func:`drop_unread_batch_norm_statistics` passes ``None``
(which the op accepts) instead.

**Backward arithmetic that writes into an operand it is the last reader of.**

Eager autograd sums the gradients of a value used several times in place: its
input buffer adds each new contribution into the running sum.  AOTAutograd's
traced backward spells the same sum as ``add(running, new)``, a fresh tensor,
so for one op the old sum, the new contribution and the new sum are all alive
(a ``select`` inside a scan loop: three full-size tensors where eager holds
two).  The same holds for any elementwise ``add``/``sub``/``mul``/``div`` in
backward whose operand dies at that op, and for the scatters functionalization
makes of eager's in-place writes into a slice: eager's ``slice`` backward
writes the gradient into a slice of a zero tensor, and the traced backward
spells it ``slice_scatter(zeros, copy(zeros[...], grad))``, two more full-size
tensors (an FFT convolution's padding: three tensors of the padded length
where eager holds one; a parallel scan's ``select_scatter`` chains).  Such a
scatter writes ``src`` into the slice of its base in place, and a ``copy``
read only by it is not made: the scatter copies the copy's source directly.

:func:`in_place_targets` finds, in graph order, the backward ops that may
write into such an operand: the operand is a backward value that owns its
storage, has the op's shape, dtype and strides, is read by nobody after the op
(nor through a view), is not a graph result, and does not overlap the other
operand.  The pricing (:func:`ckptc.pricing.problem.joint_to_problem`) counts such an
op as an alias of that operand, and :func:`reinplace` rewrites the final
backward graph with the in-place variants (``add_``), checking the same
conditions on that graph, so the memory the simulator predicts is what runs.

**Gradients added into the resident** ``.grad`` **as they are made.**  Under
gradient accumulation eager's ``AccumulateGrad`` adds each parameter's new
gradient into its ``.grad`` as soon as backward makes it; a compiled backward
returns all of its parameters' gradients at its end, so a micro-batch after the
first would hold a second copy of the graph's gradients on top of the resident
ones.  :func:`accumulate_into_parameters` makes the backward graph hand each
parameter gradient to a :class:`GradientSink` right after the op that makes it:
the sink adds it into the parameter's ``.grad`` (when one is resident, with the
same layout, and no hook is registered on the parameter) and the graph returns
``None`` for it, so autograd accumulates nothing more.  The pricing
(``accumulated_gradients`` of :func:`ckptc.pricing.problem.joint_to_problem`) lets such
a gradient die at its last read.  Only under ``ckptc.optimize`` without DDP or
FSDP2, whose hooks on the parameters' gradient accumulators must see every
gradient, and only for steps planned with gradients resident.

Only the eager compiler gets these: Inductor plans its own buffer reuse.
"""

from __future__ import annotations

import bisect
import heapq
import logging
from collections import ChainMap
from typing import Any, Mapping, Sequence

import torch
import torch.fx as fx

from ckptc._torch_internals import (
    backward_accumulates,
    graph_module,
    has_gradient_hooks,
    outside_fake_mode,
    running_gradient_accumulator,
)
from ckptc.pricing.costs import BACKWARD

log = logging.getLogger("ckptc.rewrite.lean_backward")

aten = torch.ops.aten

# op -> (its in-place variant, whether the second operand may be the one written into).
_IN_PLACE: dict[Any, tuple[Any, bool]] = {
    aten.add.Tensor: (aten.add_.Tensor, True),
    aten.mul.Tensor: (aten.mul_.Tensor, True),
    aten.sub.Tensor: (aten.sub_.Tensor, False),
    aten.div.Tensor: (aten.div_.Tensor, False),
}


def _write_slice(
    base: torch.Tensor, src: torch.Tensor, dim: int = 0, start: int | None = None, end: int | None = None, step: int = 1
) -> torch.Tensor:
    """``aten.slice_scatter`` written into ``base`` (see :func:`reinplace`)."""
    aten.slice.Tensor(base, dim, start, end, step).copy_(src)
    return base


def _write_select(base: torch.Tensor, src: torch.Tensor, dim: int, index: int) -> torch.Tensor:
    """``aten.select_scatter`` written into ``base`` (see :func:`reinplace`)."""
    aten.select.int(base, dim, index).copy_(src)
    return base


# A scatter -> (the function that writes its source into its base in place, the view of the base it writes).
_SCATTERS: dict[Any, tuple[Any, Any]] = {
    aten.slice_scatter.default: (_write_slice, aten.slice.Tensor),
    aten.select_scatter.default: (_write_select, aten.select.int),
}


def in_place_targets(graph: fx.Graph) -> dict[fx.Node, fx.Node]:
    """``op -> operand`` for every backward op of ``graph`` whose result lives in that operand's storage.

    An elementwise op or a scatter maps to the operand it overwrites; a ``copy``
    read only by such a scatter maps to its source (the scatter copies the source
    itself, see the module docstring).  Reads ``node.meta["ckptc"]``
    (:func:`ckptc.pricing.costs.annotate_costs`) for each node's kind and storage.
    The ops are taken in graph order and an operand already written into is not
    chosen twice, so the result is what :func:`reinplace` does to the same graph.
    Runs in O(nodes + edges), plus, for a scatter whose storage is read after it,
    the views of its write-backs replayed on meta tensors.
    """
    order = {node: i for i, node in enumerate(graph.nodes)}
    parent: dict[fx.Node, fx.Node] = {}  # a view -> what it views; an op written in place -> its operand

    def storage(node: fx.Node) -> fx.Node:
        while node in parent:
            node = parent[node]
        return node

    views: set[fx.Node] = set()
    view_base: dict[fx.Node, fx.Node] = {}  # a view -> the node it views directly
    reads: dict[fx.Node, list[int]] = {}  # storage -> positions of its readers through any view, in order

    def last_read(own: fx.Node) -> int | None:
        positions = reads.get(own)
        return positions[-1] if positions else None

    for node in graph.nodes:
        cost = node.meta.get("ckptc")
        alias_of = cost.alias_of if cost is not None else None
        if alias_of is not None:
            views.add(node)  # even when what it views is not in this graph (a saved activation)
        base = _viewed(node, alias_of) if alias_of else None
        if base is not None:
            parent[node] = storage(base)
            view_base[node] = base
        for arg in node.all_input_nodes:  # the output node reads the results: they are never written into
            reads.setdefault(storage(arg), []).append(order[node])

    # A copy read only by a scatter is not made if the scatter is written in place: its source is then
    # read at the scatter, so nothing before the scatter may write into the source.
    copies = {node: next(iter(node.users)) for node in graph.nodes if _foldable_copy(node)}
    for copied, scatter in copies.items():
        bisect.insort(reads.setdefault(storage(copied.args[1]), []), order[scatter])

    chosen: dict[fx.Node, fx.Node] = {}
    write_backs: set[fx.Node] = set()  # scatters that copy a region onto itself (see _write_backs)
    for node in graph.nodes:
        if node.op != "call_function" or len(node.args) < 2 or not _is_backward(node):
            continue
        entry = _IN_PLACE.get(node.target)
        if entry is None and node.target not in _SCATTERS:
            continue
        copied = node.args[1] if node.target in _SCATTERS and node.args[1] in copies else None
        candidates = node.args[:2] if entry is not None and entry[1] else node.args[:1]
        for i, operand in enumerate(candidates):
            other = copied.args[1] if copied is not None else node.args[1 - i]
            if not isinstance(operand, fx.Node):
                continue
            own = storage(operand)
            dies_here = last_read(own) == order[node]
            backs: list[fx.Node] = []
            if not dies_here and entry is None:
                # Plain meta tensors: inside AOTAutograd's fake mode each replayed view costs a fake dispatch.
                with outside_fake_mode():
                    backs = _write_backs(node, own, chosen, view_base, order, reads.get(own, []))
                dies_here = bool(backs) and last_read(own) == order[backs[-1]]
            if (
                # A scatter may write through a view (a scan's nested in-place updates): its result is
                # that view, whose layout the traced result has (checked below), gaps included.
                (operand not in views or (entry is None and operand in view_base))
                and own not in views
                and _is_backward(own)
                and own.op == "call_function"
                and dies_here
                and (
                    node in write_backs
                    or not (isinstance(other, fx.Node) and other is not operand and storage(other) is own)
                )
                and _same_layout(operand, node, dense=entry is not None)
            ):
                chosen[node] = operand
                write_backs.update(backs)
                # The result's readers read the operand's storage from now on.
                reads[own] = list(heapq.merge(reads.get(own, []), reads.pop(node, [])))
                parent[node] = own
                if copied is not None:
                    chosen[copied] = copied.args[1]
                break
    return chosen


def _write_backs(
    scatter: fx.Node,
    own: fx.Node,
    chosen: Mapping[fx.Node, fx.Node],
    view_base: Mapping[fx.Node, fx.Node],
    order: Mapping[fx.Node, int],
    reads: list[int],
) -> list[fx.Node]:
    """The scatters that write ``scatter``'s result back where it came from, if that is all that follows.

    Functionalization spells an in-place update of a view of a view (``x.view(...)[:, 0].mul_(y)``) as
    a scatter into the inner view, then scatters of that result back into each outer one.  Written in
    place, the first scatter changes its storage ``own`` before the others read it; that is harmless
    when they are the only later readers of ``own`` and each copies exactly the region the one before
    it wrote onto itself (same elements, checked on meta tensors replaying the views from ``own``).
    Returns them in order, or ``[]``.
    """
    in_place = ChainMap({}, chosen)  # as if ``scatter`` and its write-backs were written in place
    backs: list[fx.Node] = []
    current = scatter
    while True:
        in_place[current] = current.args[0]
        back = _written_back_by(current, own, in_place, view_base)
        if back is None:
            break
        backs.append(back)
        current = back
    at = {order[back] for back in backs}
    if not backs or any(p not in at for p in reads if p > order[scatter]):
        return []  # someone else reads the storage after the first scatter
    return backs


def _viewed(view: fx.Node, alias_of: str) -> fx.Node | None:
    """The node ``view`` views: its input named ``alias_of`` (the joint graph's name), or its first
    argument where the graph was rewritten since and renamed it."""
    named = next((n for n in view.all_input_nodes if n.name == alias_of), None)
    if named is not None:
        return named
    first = view.args[0] if view.args else None
    return first if isinstance(first, fx.Node) and len(view.all_input_nodes) == 1 else None


def _written_back_by(
    scatter: fx.Node, own: fx.Node, in_place: Mapping[fx.Node, fx.Node], view_base: Mapping[fx.Node, fx.Node]
) -> fx.Node | None:
    """The scatter that copies ``scatter``'s result (written in place) onto the same elements, if it is the
    result's only reader (through views)."""
    source = scatter
    while len(source.users) == 1:
        (user,) = source.users
        if view_base.get(user) is not source:
            break
        source = user  # a view of the result
    if len(source.users) != 1:
        return None
    (back,) = source.users
    if back.target not in _SCATTERS or len(back.args) < 2 or back.args[1] is not source or not _is_backward(back):
        return None
    target = _region(back.args[0], own, in_place, view_base)
    written = _region(source, own, in_place, view_base)
    if target is None or written is None:
        return None
    try:
        target = _SCATTERS[back.target][1](target, *back.args[2:])
    except Exception:  # noqa: BLE001 - arguments a meta tensor cannot take: not a write-back
        return None
    same = (tuple(target.shape), target.stride(), target.storage_offset()) == (
        tuple(written.shape),
        written.stride(),
        written.storage_offset(),
    )
    return back if same else None


def _region(
    node: fx.Node, own: fx.Node, in_place: Mapping[fx.Node, fx.Node], view_base: Mapping[fx.Node, fx.Node]
) -> torch.Tensor | None:
    """The elements of storage ``own`` that ``node`` refers to, as a meta tensor viewing a meta ``own``:
    the views from ``own`` to ``node`` replayed (ops written in place are their operand)."""
    chain = []
    while node is not own:
        if node in in_place:
            node = in_place[node]
        elif node in view_base and node.args and node.args[0] is view_base[node]:
            chain.append(node)
            node = view_base[node]
        else:
            return None
    root = own.meta.get("val")
    if not isinstance(root, torch.Tensor) or not all(isinstance(d, int) for d in (*root.shape, *root.stride())):
        return None
    region = torch.empty_strided(tuple(root.shape), root.stride(), dtype=root.dtype, device="meta")
    try:
        for view in reversed(chain):
            region = view.target(region, *view.args[1:], **view.kwargs)
    except Exception:  # noqa: BLE001 - a view a meta tensor cannot replay: not a known region
        return None
    return region if isinstance(region, torch.Tensor) else None


def _foldable_copy(node: fx.Node) -> bool:
    """A backward ``copy(dst, src)`` read only as the source of a scatter, casting to the scatter's dtype:
    the scatter may copy ``src`` itself."""
    if node.op != "call_function" or node.target != aten.copy.default or not _is_backward(node):
        return False
    if len(node.users) != 1 or len(node.args) < 2 or not isinstance(node.args[1], fx.Node):
        return False
    (scatter,) = node.users
    if scatter.target not in _SCATTERS or len(scatter.args) < 2 or scatter.args[1] is not node:
        return False
    copied, into = node.meta.get("val"), scatter.meta.get("val")
    return isinstance(copied, torch.Tensor) and isinstance(into, torch.Tensor) and copied.dtype == into.dtype


def reinplace(gm: fx.GraphModule) -> fx.GraphModule:
    """``gm`` with each op of :func:`in_place_targets` replaced by its in-place variant.

    The written operand becomes the op's first argument (``add``/``mul`` are
    commutative; ``sub``/``div`` are only ever written into their first); a
    scatter becomes a copy into the slice of its base, from its copy's source
    where that copy was folded (the copy is erased).
    ``gm`` is left unchanged when there is nothing to rewrite; otherwise a new
    module is returned.
    """
    targets = in_place_targets(gm.graph)
    if not targets:
        return gm
    graph = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    graph.output(graph.graph_copy(gm.graph, env))
    for node, operand in targets.items():
        new = env[node]
        if node.target == aten.copy.default:
            continue  # its scatter copies ``operand`` itself; the copy is erased below
        if node.target in _SCATTERS:
            source = node.args[1]
            if isinstance(source, fx.Node) and source.target == aten.copy.default and source in targets:
                source = targets[source]  # the folded copy's source
            new.target = _SCATTERS[node.target][0]
            new.args = fx.node.map_arg((operand, source, *node.args[2:]), lambda n: env[n])
            continue
        in_place, _ = _IN_PLACE[node.target]
        first, second = node.args[0], node.args[1]
        args = (operand, second if first is operand else first, *node.args[2:])
        new.target = in_place
        new.args = fx.node.map_arg(args, lambda n: env[n])
    for node in targets:
        if node.target == aten.copy.default:
            graph.erase_node(env[node])
    graph.lint()
    log.debug("backward: %d ops write into an operand they are the last reader of", len(targets))
    return graph_module(gm, graph)


class GradientSink:
    """Adds a parameter's new gradient into its resident ``.grad`` (see the module docstring).

    Called from the backward graph as ``sink(gradient, position)``, where
    ``position`` is the parameter's position among the graph's inputs; returns
    ``None`` when it added the gradient, else the gradient (returned by the
    graph, accumulated by autograd as usual).

    The parameter is the one the running backward node hands that position's
    gradient to, not the one the graph was compiled with: a graph compiled once
    runs for every layer (a graph break inside the layer loop), each run on its
    own layer's parameters.
    """

    def __init__(self, graph_inputs: Sequence[Any]) -> None:
        """``graph_inputs``: the inputs the graph was compiled with; the sink takes the gradients of its
        parameters."""
        tensors = [i for i, t in enumerate(graph_inputs) if isinstance(t, torch.Tensor)]
        self._edges = len(tensors)  # the backward node's edges: one per tensor input, in order
        self._edge = {i: k for k, i in enumerate(tensors)}
        # What the compiled-for parameter at each position looks like: a run's parameter there must match.
        self._compiled_for = {
            i: (t.shape, t.dtype, t.device)
            for i, t in enumerate(graph_inputs)
            if isinstance(t, torch.nn.Parameter) and t.requires_grad
        }
        self.positions = frozenset(self._compiled_for)
        self.added = 0  # gradients added in place so far (for tests and logs)
        self.__name__ = "gradient_sink"  # FX names a call_function target's global after it

    def __repr__(self) -> str:
        return f"GradientSink(parameters={len(self._compiled_for)}, added={self.added})"

    def __call__(self, gradient: torch.Tensor | None, position: int) -> torch.Tensor | None:
        if gradient is None or position not in self._compiled_for:
            return gradient
        accumulator = running_gradient_accumulator(self._edge[position], self._edges)
        if accumulator is None:
            return gradient
        parameter = accumulator.variable
        resident = parameter.grad
        if (
            (parameter.shape, parameter.dtype, parameter.device) != self._compiled_for[position]
            or resident is None
            or resident.shape != gradient.shape
            or resident.dtype != gradient.dtype
            or resident.device != gradient.device
            or resident.stride() != gradient.stride()
            or has_gradient_hooks(parameter)
            or not backward_accumulates(accumulator)  # torch.autograd.grad
        ):
            return gradient
        with torch.no_grad():
            resident.add_(gradient)
        self.added += 1
        return None


def accumulate_into_parameters(gm: fx.GraphModule, sink: GradientSink) -> fx.GraphModule:
    """``gm`` (a backward graph) handing each gradient at ``sink.positions`` of its results to ``sink``
    right after the op that makes it.  A gradient returned at several positions is left alone.
    ``gm`` is left unchanged when there is nothing to rewrite; otherwise a new module is returned."""
    graph = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    graph.output(graph.graph_copy(gm.graph, env))
    output = next(iter(graph.find_nodes(op="output")))
    results = list(output.args[0])
    counts: dict[fx.Node, int] = {}
    for r in results:
        if isinstance(r, fx.Node):
            counts[r] = counts.get(r, 0) + 1
    rewritten = 0
    for i in sorted(sink.positions):
        gradient = results[i] if i < len(results) else None
        if not isinstance(gradient, fx.Node) or counts[gradient] > 1 or gradient.op == "placeholder":
            continue
        with graph.inserting_after(gradient):
            results[i] = graph.call_function(sink, (gradient, i))
        rewritten += 1
    if not rewritten:
        return gm
    output.args = (type(output.args[0])(results),)
    graph.lint()
    log.debug("backward: %d parameter gradients added into the resident .grad as they are made", rewritten)
    return graph_module(gm, graph)


def drop_unread_batch_norm_statistics(graph: fx.Graph) -> int:
    """Pass ``None`` for the running statistics of every training-mode batch-norm backward.

    Returns how many arguments were dropped.  Run it on the joint graph before
    pricing, so that nothing is saved for them.
    """
    dropped = 0
    for node in graph.find_nodes(op="call_function", target=aten.native_batch_norm_backward.default):
        args = list(node.args)
        train = args[7] if len(args) > 7 else node.kwargs.get("train")
        if train is not True or len(args) < 5:
            continue
        dropped += sum(isinstance(a, fx.Node) for a in args[3:5])
        args[3] = args[4] = None
        node.args = tuple(args)
    return dropped


def _is_backward(node: fx.Node) -> bool:
    cost = node.meta.get("ckptc")
    return cost is not None and cost.kind == BACKWARD and "ckptc_recompute_of" not in node.meta


def _same_layout(operand: fx.Node, node: fx.Node, *, dense: bool = True) -> bool:
    """The op's result has exactly the operand's shape, strides and dtype, all static, on one device
    (and, where ``dense``, no gaps or overlaps)."""
    a, b = operand.meta.get("val"), node.meta.get("val")
    if not isinstance(a, torch.Tensor) or not isinstance(b, torch.Tensor):
        return False
    if a.dtype != b.dtype or a.device != b.device or a.is_sparse or b.is_sparse:
        return False
    sizes = (*a.shape, *b.shape, *a.stride(), *b.stride())
    if not all(isinstance(s, int) for s in sizes):
        return False
    return tuple(a.shape) == tuple(b.shape) and tuple(a.stride()) == tuple(b.stride()) and (_dense(a) or not dense)


def _dense(t: torch.Tensor) -> bool:
    """Non-overlapping and dense: an in-place elementwise op then writes every element once."""
    expected = 1
    for size, stride in sorted(zip(t.shape, t.stride(), strict=True), key=lambda p: p[1]):
        if size == 1:
            continue
        if stride != expected:
            return False
        expected *= size
    return True
