"""Blocks: cut a training graph's forward part into the chain a hierarchical solver works on.

Problem. Given a :class:`~solvers.Problem`, split its differentiable forward
values into consecutive *blocks* (a transformer layer, a U-Net stage, the
embedding, the head and loss) such that per-block decisions compose: the values
that cross from one block to another are *fixed* (always kept, exactly what a
hand-written ``torch.utils.checkpoint`` per block keeps), and so are the values
no gradient flows through (masks, rotary tables: data, not decisions).
Identical blocks are grouped into classes so a solver handles each class once.

Method.

1. Blocks follow the module tree where it has repeated parts: a node's block
   key is its module path up to the first integer component
   (``transformer.h.3.attn`` -> ``transformer.h.3``); consecutive forward-path
   nodes with the same key form a block, and the nodes around them (embedding,
   head) form their own blocks.
2. A block that still holds most of the graph (a model without repeated
   modules) is split at the forward graph's cut points (a frontier sweep over
   the forward path, as Rockmate's ``find_cutting_points``), into about
   sqrt(n) pieces of equal cost, Chen et al.'s classic segment length.
3. Forward values off the forward path (transposes that only backward reads)
   join the block of their latest input.
4. A block's class is a hash of its ops, bytes, costs, policies and relative
   wiring (Rockmate's anonymized clusters): members of one class can take the
   same decisions position by position.
5. ``inside=True`` also cuts each block where one value carries everything
   after it on the forward path (pieces of at least a fifth of its bytes): the
   finer chain on which nested recomputation frees a block's first part during
   its second part's backward.

Complexity: O(nodes + edges). Reference: Zhao et al., "Rockmate: an Efficient,
Fast, Automatic and Generic Tool for Re-materialization in PyTorch", ICML 2023.

Example:
    >>> from solvers import Problem
    >>> chain = find_blocks(Problem.training_chain(9))
    >>> [len(block.nodes) for block in chain.blocks]   # no modules: split at cut points
    [3, 3, 3]
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field

from solvers.graph import forward_path
from solvers.problem import BACKWARD_CODE, Problem

__all__ = ["Block", "BlockChain", "find_blocks", "block_key"]

_INPUT, _FORWARD = 0, 1
_RECOMPUTE = 2
# A block holding more than this share of the forward path (and at least
# _SPLIT_MIN_NODES nodes) is split at graph cut points.
_SPLIT_SHARE = 0.5
_SPLIT_MIN_NODES = 8
_MAX_PIECES = 64
# A block is cut inside (``find_blocks(inside=True)``) only into pieces holding at least this share of its bytes.
_INSIDE_MIN_SHARE = 0.2

_INTEGER_PART = re.compile(r"^(.*?(?:^|\.)\d+)(?:\.|$)")


def block_key(module: str) -> str | None:
    """The repeated module a node belongs to: its path up to the first integer part.

    >>> block_key("transformer.h.3.attn.c_attn"), block_key("4"), block_key("lm_head")
    ('transformer.h.3', '4', None)
    """
    match = _INTEGER_PART.match(module)
    return match.group(1) if match else None


@dataclass(frozen=True)
class Block:
    """Consecutive forward values that are decided together.

    Attributes:
        index: position in the chain.
        label: the module key (``"layers.3"``) or a description.
        nodes: problem indices of its forward nodes, in problem order.
        start: position on the forward path of its first node (where its
            forward begins).
        klass: index of its structural class in :attr:`BlockChain.classes`.
    """

    index: int
    label: str
    nodes: tuple[int, ...]
    start: int
    klass: int = -1


@dataclass(frozen=True)
class BlockChain:
    """The chain of blocks of a problem.

    Attributes:
        blocks: in forward order.
        fixed: forward nodes kept by every plan built on this chain: values
            read across blocks and non-differentiable values backward reads.
        block_of: problem index -> block index, -1 for nodes in no block.
        classes: class -> indices of the blocks that share its structure.
    """

    blocks: tuple[Block, ...]
    fixed: frozenset[int]
    block_of: tuple[int, ...] = field(repr=False)
    classes: tuple[tuple[int, ...], ...]

    def __repr__(self) -> str:
        sizes = [len(b.nodes) for b in self.blocks]
        return (
            f"BlockChain({len(self.blocks)} blocks in {len(self.classes)} classes, "
            f"{min(sizes, default=0)}-{max(sizes, default=0)} nodes per block, {len(self.fixed)} fixed values)"
        )


def find_blocks(problem: Problem, *, inside: bool = False) -> BlockChain:
    """Split ``problem``'s forward values into a chain of blocks (see the module docstring).

    ``inside``: also cut each block where one value carries everything that
    follows (a transformer layer's residual stream between attention and MLP):
    the finer chain on which nested recomputation frees a block's first part
    while the backward of its second part runs (a lean backward inside a block).
    """
    key = "blocks.chain_inside" if inside else "blocks.chain"
    cached = problem._cache.get(key)
    if cached is not None:
        return cached
    nodes = problem.nodes
    decided = _decided_nodes(problem)
    path = [v for v in forward_path(problem) if decided[v]]
    runs = _module_runs(problem, path)
    runs = [piece for run in runs for piece in _split_large(problem, run, len(path))]
    if inside:
        runs = _split_at_path_cuts(problem, runs, path)

    block_of = [-1] * len(nodes)
    members: list[list[int]] = []
    starts: list[int] = []
    position = {v: k for k, v in enumerate(path)}
    for b, run in enumerate(runs):
        members.append(list(run))
        starts.append(position[run[0]])
        for v in run:
            block_of[v] = b
    # Off-path values join the block of their latest input (the block whose
    # backward reads them); with no block input they join the first block.
    for v in problem._forward_idx:
        if decided[v] and block_of[v] < 0:
            b = max((block_of[u] for u in problem._fwd_preds[v]), default=-1)
            b = max(b, 0) if members else -1
            if b >= 0:
                block_of[v] = b
                members[b].append(v)

    fixed = _fixed_values(problem, block_of, decided)
    labels = [_label(problem, run) for run in runs]
    signatures: dict[tuple, int] = {}
    klass_of = []
    for nodes_b in members:
        nodes_b.sort()
        sig = _signature(problem, nodes_b, fixed)
        klass_of.append(signatures.setdefault(sig, len(signatures)))
    classes: list[list[int]] = [[] for _ in signatures]
    for b, k in enumerate(klass_of):
        classes[k].append(b)
    chain = BlockChain(
        blocks=tuple(Block(b, labels[b], tuple(members[b]), starts[b], klass_of[b]) for b in range(len(members))),
        fixed=frozenset(fixed),
        block_of=tuple(block_of),
        classes=tuple(tuple(c) for c in classes),
    )
    problem._cache[key] = chain
    return chain


# ------------------------------------------------------------------ helpers
def _decided_nodes(problem: Problem) -> bytearray:
    """Forward nodes a plan decides about: differentiable values with storage of their own.

    Views of inputs (a weight's transpose) pin resident storage, and values no
    gradient flows through are data: neither is a decision.
    """
    flags = bytearray(len(problem.nodes))
    kind, root = problem._kind, problem._alias_root
    for v in problem._forward_idx:
        if problem.nodes[v].differentiable and kind[root[v]] != _INPUT:
            flags[v] = 1
    return flags


def _module_runs(problem: Problem, path: list[int]) -> list[list[int]]:
    """Consecutive forward-path nodes with the same block key."""
    runs: list[list[int]] = []
    previous: object = object()
    for v in path:
        node = problem.nodes[v]
        key = block_key(node.module) if node.module else None
        # Zero-byte markers and nodes without a module stay with their neighbours.
        if runs and (key == previous or (not node.module and node.bytes == 0)):
            runs[-1].append(v)
            continue
        runs.append([v])
        previous = key
    return _merge_tiny_runs(problem, runs)


def _merge_tiny_runs(problem: Problem, runs: list[list[int]]) -> list[list[int]]:
    """Runs without a block key between two keyed runs join the previous run.

    Module metadata is sometimes missing on single nodes (a getitem, a view);
    such a stray node must not cut a layer in two.
    """
    merged: list[list[int]] = []
    for run in runs:
        keyed = any(block_key(problem.nodes[v].module) for v in run)
        if merged and not keyed and len(run) <= 2:
            merged[-1].extend(run)
        else:
            merged.append(run)
    return merged


def _split_large(problem: Problem, run: list[int], path_length: int) -> list[list[int]]:
    """Split a run holding most of the graph at cut points into ~sqrt(n) equal-cost pieces."""
    if len(run) < _SPLIT_MIN_NODES or len(run) <= _SPLIT_SHARE * path_length:
        return [run]
    cuts = _cut_positions(problem, run)
    pieces = min(_MAX_PIECES, max(2, round(math.sqrt(len(run)))))
    if len(cuts) < 2:
        return [run]
    cost = problem._cost
    total = sum(cost[v] for v in run) or 1.0
    chosen: list[int] = []
    running, target = 0.0, total / pieces
    cut_set = set(cuts)
    for k, v in enumerate(run[:-1]):
        running += cost[v]
        if k in cut_set and running >= target * (len(chosen) + 1):
            chosen.append(k)
    out, begin = [], 0
    for k in chosen:
        out.append(run[begin : k + 1])
        begin = k + 1
    out.append(run[begin:])
    return [p for p in out if p]


def _split_at_path_cuts(problem: Problem, runs: list[list[int]], path: list[int]) -> list[list[int]]:
    """Each run cut at the path's cut points inside it, into pieces of at least
    :data:`_INSIDE_MIN_SHARE` of the run's forward bytes (so a piece is worth a decision)."""
    cut_after = {path[k] for k in _cut_positions(problem, path)}  # k: nothing before path[k] is read after it
    nbytes = problem._bytes
    out: list[list[int]] = []
    for run in runs:
        total = sum(nbytes[v] for v in run)
        least = _INSIDE_MIN_SHARE * total
        piece: list[int] = []
        done = started = 0
        for v in run:
            piece.append(v)
            done += nbytes[v]
            if v in cut_after and done - started >= least and total - done >= least:
                out.append(piece)
                piece, started = [], done
        if piece:
            out.append(piece)
    return out


def _cut_positions(problem: Problem, run: list[int]) -> list[int]:
    """Positions k of ``run`` where no value computed before run[k] is read after it.

    A frontier sweep: keeping run[k] then lets everything after it be
    recomputed without reaching back before it.
    """
    position = {v: k for k, v in enumerate(run)}
    cuts = []
    reach = -1  # the latest position read by a value computed before k
    for k, v in enumerate(run):
        if reach <= k:
            cuts.append(k)
        for c in problem._consumers[v]:
            j = position.get(c, -1)
            if j > reach:
                reach = j
    return cuts


def _fixed_values(problem: Problem, block_of: list[int], decided: bytearray) -> set[int]:
    """Values every plan keeps: those read by another block's forward, and data backward reads."""
    fixed: set[int] = set()
    read_by_backward, output, policy = problem._read_by_backward, problem._output, problem._policy
    for v in problem._forward_idx:
        if output[v] or policy[v] == _RECOMPUTE:
            continue
        if not decided[v]:
            if read_by_backward[v] and problem._kind[problem._alias_root[v]] != _INPUT:
                fixed.add(v)
            continue
        b = block_of[v]
        if any(block_of[c] >= 0 and block_of[c] != b for c in problem._consumers[v]):
            fixed.add(v)
    return fixed


def _label(problem: Problem, run: list[int]) -> str:
    keys = [block_key(problem.nodes[v].module) for v in run]
    key = next((k for k in keys if k), None)
    if key is not None:
        return key
    modules = [problem.nodes[v].module for v in run if problem.nodes[v].module]
    return modules[0].split(".")[0] if modules else "(top level)"


def _signature(problem: Problem, members: list[int], fixed: set[int]) -> tuple:
    """Structure of a block: equal signatures mean position-wise identical decisions."""
    local = {v: k for k, v in enumerate(members)}
    nbytes, root = problem._bytes, problem._alias_root
    parts = []
    for v in members:
        node = problem.nodes[v]
        preds = tuple(("in", local[u]) if u in local else ("out", nbytes[root[u]]) for u in problem._preds[v])
        readers = sum(1 for c in problem._consumers[v] if problem._kind[c] == BACKWARD_CODE)
        parts.append(
            (
                node.op,
                node.bytes,
                round(node.cost, 6),
                node.policy,
                node.output,
                v in fixed,
                preds,
                readers,
                local.get(problem._alias_of[v], -1),
                node.scratch,
            )
        )
    return tuple(parts)
