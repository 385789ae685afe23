"""Tokens routed to experts: data-dependent sizes that share a total.

A mixture-of-experts layer routes each token to k of its E experts and runs
each expert on the tokens routed to it.  ``torch.where(expert_mask[e])``
(aten ``nonzero`` of one slice of a one-hot mask) gives each expert a count
that depends on the data.  Each count alone may reach its whole slice (the
bound Dynamo gives it), but the slices are disjoint, so together the counts
are at most the mask's nonzeros, and a one-hot mask holds one nonzero per
index it encodes (``one_hot(indices, E)``, decomposed into ``indices[...,
None] == arange(E)``, ``iota`` under Inductor); where the indices are
``topk``'s, k distinct per token, a class's slice holds at most one per
token.  Priced at their ranges the layer's experts count its tokens E times
over; :func:`routed_sizes` finds such counts and the nodes whose bytes grow
with each, so that the simulator prices the worst routing instead
(:class:`solvers.SizeGroup`).  Sizes computed from the data that split one
dimension (``x.split(expert_size.tolist())``: GraniteMoE's experts each take a
run of the tokens sorted by expert) share that dimension's size as their total
in the same way.  What is not recognised stays at its range.

Example: OLMoE (top-2 of 4 experts) has four counts ``u0..u3``, each at
most ``2 * tokens`` by Dynamo's range and ``tokens`` by top-2, together at
most ``2 * tokens``.  Paper trail: the worst split is the greedy solution of
a fractional knapsack at each step of the schedule (the members' bytes per
unit sorted, each filled to its bound until the total is spent).
"""

from __future__ import annotations

import logging
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any, Mapping

import sympy
import torch
import torch.fx as fx

from ckptc._torch_internals import op_name, size_expression, storage_size_expression, upper_bound

__all__ = ["RoutedSizes", "routed_sizes"]

log = logging.getLogger("ckptc.pricing.routing")

# Ops whose result holds the same values as their first argument (so the same nonzeros).
_SAME_VALUES = frozenset(
    {
        "permute",
        "view",
        "_unsafe_view",
        "reshape",
        "transpose",
        "t",
        "squeeze",
        "unsqueeze",
        "alias",
        "clone",
        "_to_copy",
        "convert_element_type",
        "contiguous",
    }
)


@dataclass(frozen=True)
class RoutedSizes:
    """Counts of one mask's disjoint slices: together at most ``total``.

    Attributes:
        total: the mask's nonzeros at most.
        bounds: by count symbol, its own bound.
        growing: by node name, the count symbol its bytes grow with and its bytes per unit.
        priced_at: by count symbol, the bound the graph's sizes were priced at (Dynamo's range of the
            count), above ``bounds`` where the mask says more (top-k indices: one per row).
        summed: by node name, the bytes per unit of each of several counts its bytes grow with (the
            experts' outputs concatenated again: ``unit * (u0 + u1 + ...)``); at most what the worst
            split of the total gives them (:meth:`most_bytes`).
    """

    total: int
    bounds: Mapping[Any, int]
    growing: Mapping[str, tuple[Any, int]]
    priced_at: Mapping[Any, int]
    summed: Mapping[str, Mapping[Any, int]] = field(default_factory=dict)

    def most_bytes(self, units: Mapping[Any, int]) -> int:
        """The most ``sum(units[c] * c)`` can be over the counts ``c`` of ``units``: the largest units
        filled first, each count to its bound, until the total is spent (a fractional knapsack)."""
        left, most = self.total, 0
        for count, unit in sorted(units.items(), key=lambda item: -item[1]):
            taken = min(left, self.bounds[count])
            most, left = most + unit * taken, left - taken
        return most


def routed_sizes(graph: fx.Graph) -> list[RoutedSizes]:
    """The groups of data-dependent counts in ``graph`` that share a total (see the module docstring).

    O(nodes): one pass to find the counts, one to find the nodes that grow with them.
    """
    slices: dict[tuple[fx.Node, int], list[tuple[Any, fx.Node]]] = defaultdict(list)
    for node in graph.nodes:
        if _op(node) != "nonzero":
            continue
        sliced = _same_values_source(node.args[0])
        if _op(sliced) == "select" and isinstance(sliced.args[0], fx.Node):
            base, dim, index = sliced.args[:3]
            slices[(base, dim)].append((index, node))
    groups = []
    for (base, dim), counts in slices.items():
        indices = [index for index, _ in counts]
        if len(counts) < 2 or len(set(indices)) != len(indices) or not all(isinstance(i, int) for i in indices):
            continue  # one slice, or slices that may overlap
        mask = _one_hot_mask(base)
        if mask is None:
            continue
        # A slice of one class holds one nonzero per index equal to it: with top-k indices, one per row.
        per_slice = mask.per_class if mask.class_dim is not None and dim % _ndim(base) == mask.class_dim else None
        bounds, priced_at = {}, {}
        for _, nonzero in counts:
            value = nonzero.meta.get("val")
            count = size_expression(value.shape[0]) if isinstance(value, torch.Tensor) else None
            top = upper_bound(value.shape[0]) if isinstance(value, torch.Tensor) else None
            if not isinstance(count, sympy.Symbol) or top is None:
                break
            bounds[count], priced_at[count] = (top if per_slice is None else min(top, per_slice)), top
        else:
            if mask.total < sum(bounds.values()):
                groups.append(RoutedSizes(mask.total, bounds, {}, priced_at))
    groups += _split_sizes(graph, {symbol for group in groups for symbol in group.bounds})
    if not groups:
        return []
    return _with_growing_nodes(graph, groups)


def _split_sizes(graph: fx.Graph, taken: set[Any]) -> list[RoutedSizes]:
    """Groups of counts that split one dimension: ``x.split(sizes)`` with ``sizes`` computed from the data
    (``expert_size.tolist()``, as GraniteMoE's experts take their sorted tokens) sum to ``x``'s size there,
    so together they are at most that size, each at most its own bound.  Counts already in a group
    (``taken``) are left to it."""
    groups = []
    for node in graph.nodes:
        if _op(node) != "split_with_sizes" or not isinstance(node.args[0], fx.Node):
            continue
        source, sizes = node.args[0].meta.get("val"), node.args[1]
        dim = node.args[2] if len(node.args) > 2 else node.kwargs.get("dim", 0)
        total = size_expression(source.shape[dim]) if isinstance(source, torch.Tensor) else None
        if not isinstance(total, int) or not isinstance(sizes, (list, tuple)) or len(sizes) < 2:
            continue
        bounds, priced_at = {}, {}
        for size in sizes:
            value = size.meta.get("val") if isinstance(size, fx.Node) else size
            count, top = size_expression(value), upper_bound(value)
            if not isinstance(count, sympy.Symbol) or top is None or count in taken or count in bounds:
                break
            bounds[count], priced_at[count] = min(top, total), top
        else:
            if total < sum(bounds.values()):
                taken.update(bounds)
                groups.append(RoutedSizes(total, bounds, {}, priced_at))
    return groups


def _with_growing_nodes(graph: fx.Graph, groups: list[RoutedSizes]) -> list[RoutedSizes]:
    """``groups`` with the nodes whose storage bytes are ``unit * count + fixed`` for one of their counts."""
    group_of = {symbol: g for g, group in enumerate(groups) for symbol in group.bounds}
    growing: list[dict[str, tuple[Any, int]]] = [{} for _ in groups]
    summed: list[dict[str, dict[Any, int]]] = [{} for _ in groups]
    for node in graph.nodes:
        value = node.meta.get("val")
        if node.op == "output" or not isinstance(value, torch.Tensor):
            continue  # multi-output values (their parts take their bytes over) stay at their bounds
        expression = storage_size_expression(value)
        if not isinstance(expression, sympy.Expr) or not expression.free_symbols:
            continue
        symbols = expression.free_symbols
        owners = {group_of.get(symbol) for symbol in symbols}
        if len(owners) != 1 or None in owners:
            continue  # counts of several groups, or a size the groups do not cover
        (g,) = owners
        polynomial = sympy.Poly(sympy.expand(expression), *symbols)
        if polynomial.total_degree() != 1:
            continue
        units = {symbol: polynomial.coeff_monomial(symbol) for symbol in symbols}
        if not all(unit.is_Integer and int(unit) > 0 for unit in units.values()):
            continue
        if len(units) == 1:
            ((symbol, unit),) = units.items()
            growing[g][node.name] = (symbol, int(unit))
        else:
            summed[g][node.name] = {symbol: int(unit) for symbol, unit in units.items()}
    return [
        RoutedSizes(group.total, group.bounds, growing[g], group.priced_at, summed[g]) for g, group in enumerate(groups)
    ]


def _op(node: Any) -> str | None:
    return op_name(node.target) if isinstance(node, fx.Node) and node.op == "call_function" else None


def _same_values_source(node: Any) -> Any:
    """The node whose values ``node`` holds, through views and copies."""
    while _op(node) in _SAME_VALUES:
        node = node.args[0]
    return node


@dataclass(frozen=True)
class _Mask:
    """A one-hot mask: at most ``total`` nonzeros, at most ``per_class`` in the slice of one class, whose
    dimension is ``class_dim`` (None where the ops between the encoding and the mask move it untracked)."""

    total: int
    per_class: int
    class_dim: int | None


def _one_hot_mask(node: fx.Node) -> _Mask | None:
    """``node`` as a one-hot mask, where its ops say it is one (``indices[..., None] == arange(E)``, which
    ``one_hot(indices, E)`` decomposes into); None otherwise."""
    path = []
    source = node
    while _op(source) in _SAME_VALUES:
        path.append(source)
        source = source.args[0]
    name = _op(source)
    result = source.meta.get("val") if isinstance(source, fx.Node) else None
    if not isinstance(result, torch.Tensor):
        return None
    if name == "eq" and len(source.args) >= 2:
        indices, class_dim = None, None
        a, b = source.args[:2]
        for values, other in ((a, b), (b, a)):
            if not _distinct_values(_same_values_source(values)) or not isinstance(other, fx.Node):
                continue
            # The arange runs along one dimension of the result, where the other operand has size 1: each of
            # the other's elements equals at most one of its (distinct) values.
            along = [d for d in range(result.dim()) if _broadcast_size(values, d, result.dim()) != 1]
            if len(along) == 1 and _broadcast_size(other, along[0], result.dim()) == 1:
                indices, class_dim = other, along[0]
                break
        if indices is None:
            return None
    else:
        return None
    total = upper_bound(indices.meta["val"].numel()) if isinstance(indices.meta.get("val"), torch.Tensor) else None
    if total is None:
        return None
    return _Mask(total, total // _distinct_per_row(indices), _moved_dim(class_dim, reversed(path)))


def _distinct_per_row(indices: fx.Node) -> int:
    """How many distinct values each row of ``indices`` holds, for the indices ``topk`` returns (``k``); 1
    for anything else.  A value then occurs at most once per row: at most ``numel / k`` times."""
    source = _same_values_source(indices)
    if _op(source) == "getitem" and source.args[1] == 1 and _op(source.args[0]) == "topk":
        k = source.args[0].args[1]
        return k if isinstance(k, int) and k > 0 else 1
    return 1


def _moved_dim(dim: int | None, ops: Any) -> int | None:
    """Where dimension ``dim`` of a value ends after ``ops`` (in order); None once an op moves it untracked."""
    for op in ops:
        if dim is None:
            return None
        name, value = _op(op), op.meta.get("val")
        before = op.args[0].meta.get("val") if isinstance(op.args[0], fx.Node) else None
        if not isinstance(value, torch.Tensor) or not isinstance(before, torch.Tensor):
            return None
        if name == "permute":
            order = [d % before.dim() for d in op.args[1]]
            dim = order.index(dim)
        elif name == "transpose":
            a, b = (d % before.dim() for d in op.args[1:3])
            dim = b if dim == a else a if dim == b else dim
        elif name == "unsqueeze":
            at = op.args[1] % value.dim()
            dim = dim + 1 if at <= dim else dim
        elif name in ("clone", "_to_copy", "convert_element_type", "alias", "contiguous"):
            pass
        else:
            return None
    return dim


def _ndim(node: fx.Node) -> int:
    value = node.meta.get("val")
    return value.dim() if isinstance(value, torch.Tensor) else 1


def _distinct_values(node: Any) -> bool:
    """Whether ``node`` is a range of distinct values (``arange``, or ``iota`` as Inductor decomposes it)."""
    name = _op(node)
    if name == "iota":
        return node.kwargs.get("step", 1) != 0
    return name == "arange" and (len(node.args) < 3 or node.args[2] != 0)


def _broadcast_size(node: fx.Node, dim: int, ndim: int) -> int | None:
    """The size of ``node``'s value at dimension ``dim`` of a broadcast result of ``ndim`` dimensions."""
    value = node.meta.get("val")
    if not isinstance(value, torch.Tensor):
        return None
    offset = ndim - value.dim()
    size = 1 if dim < offset else size_expression(value.shape[dim - offset])
    return size if isinstance(size, int) else None
