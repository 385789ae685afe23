"""Optimal checkpointing of a chain of blocks by dynamic programming (rotor-style).

Problem
-------
Given a training step (:class:`~solvers.Problem`) and a memory budget, find an
explicit schedule (forward phase, then backward nodes in problem order with
recomputations inserted before them) whose peak, as measured by
:func:`solvers.simulate`, fits the budget and whose recomputation cost is
minimal.

Reference
---------
Olivier Beaumont, Lionel Eyraud-Dubois, Julien Herrmann, Alexis Joly, Alena
Shilova, "Optimal checkpointing for heterogeneous chains: how to train deep
neural networks with limited memory", ACM TOMS 2024 (arXiv:1911.13214, 2019).
The recursion below is their *persistent* dynamic program (checkpoint the
input of a sub-chain, or run one stage "keeping everything its backward
needs"), re-derived for this package's node-level memory model instead of
rotor's per-stage ``(x, x̄, δ, overhead)`` parameters.

How a graph becomes a chain
---------------------------
Forward cut points (no forward edge jumps over them; outputs and ``"save"``
nodes, which are resident anyway, do not count as jumping) split the forward
nodes into *blocks*; block ``j`` ends with its cut ``c_j`` and reads only
``c_{j-1}``, inputs and resident values. Backward nodes are assigned to the
block whose values they read; blocks are merged until the backward phase visits
them in strictly decreasing order (block L's backward first) and no alias group
straddles a cut. On a chain every node is its own block.

The dynamic program
-------------------
``B(s, t, τ)`` is the cheapest way to run the backward segments of blocks
``t, t-1, ..., s+1`` given that ``c_s`` is alive (and ``c_t`` too when
``τ = 1``), as a *front*: a step function "memory available -> least
recompute cost", stored as its Pareto points. Options:

* ``A``  recompute block ``s+1`` keeping what its backward reads (x̄), solve
  ``B(s+1, t, τ)`` with that memory held, then run block ``s+1``'s backward;
* ``S_k`` recompute blocks ``s+1..k`` keeping only ``c_k``, solve
  ``B(k, t, τ)`` with ``c_s`` held if it is read later, then ``B(s, k, τ_k)``;
* ``D``  block ``t``'s backward needs nothing that is not alive: run it, then
  ``B(s, t-1, 0)``.

``FW(s, kept)`` does the same for the forward phase, where keeping costs no
recomputation: keep block ``s+1``'s x̄, or a checkpoint ``c_k``, or nothing
more. Memory of every piece (peak right after each allocation, frees after
last reads, aliases pinning storage, the backward-phase gradients alive at each
point) is computed by small exact simulations of that piece, so on graphs with
one backward node per block the DP's peak is the simulator's peak.

Complexity
----------
With ``L`` blocks, window ``W`` (max span of a sub-chain, ``W = L`` for small
chains) and fronts of at most ``P`` points: O(n + L·W²·P) time, O(L·W·P)
memory. Memory is quantised into at most ``max_slots`` (default 256) levels of
the budget when the budget is large, and small graphs are solved exactly (one
byte per level). Graphs with more than ``max_blocks`` blocks are coarsened
by merging neighbouring blocks. Every plan is re-checked with
:func:`solvers.simulate`; if the model and the simulator disagree (aliases
shared with the backward phase, unusual policies) the DP retries with a
tighter internal budget.

Beyond rotor
------------
* a checkpoint need not persist: ``σ``/``τ`` let a sub-chain drop its base or
  top after their last read, to be recomputed later;
* the last block of a sub-chain may recompute its x̄ "just in time", right
  before each backward node that reads it (``J``), and the forward phase may
  keep all of a block's x̄ but the values cheapest to recompute per byte;
* values only backward reads (weight transposes, auxiliary outputs) are tried
  three ways: recomputed in each segment that reads them, kept from forward,
  or recomputed once; forward outputs and "save" nodes are resident.

Limits
------
Not exactly optimal, even on chains: recomputation goes only between blocks'
backward segments (and just in time inside the last block of a sub-chain), from
the current checkpoint of the recursion. On random chains with one backward
node per layer it matched the MILP on every sampled case at budgets between
the minimum and keep-all, but exhaustive search finds rare (~0.5% of budgets)
cheaper non-persistent schedules (drop a kept checkpoint, rebuild it later from
the input). With several backward nodes per block (parameter gradients), or
values several far-apart backward nodes read, the MILP can be noticeably
cheaper. Aliases and multi-output ops are counted conservatively (a getitem
holds its whole op's storage); simulate() has the last word. The plan that
keeps everything backward reads (PyTorch's default) is always a candidate, so
dp never fails where keep-all fits.

Example
-------
>>> from solvers import Problem, simulate
>>> p = Problem.training_chain(8)
>>> plan = dp(p, 6)
>>> simulate(p, plan).peak_bytes <= 6
True
"""

from __future__ import annotations

import bisect
import logging
import math
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable

from solvers.errors import InfeasibleBudgetError, format_bytes
from solvers.plan import BACKWARD_PHASE, FORWARD_PHASE, Plan, Step
from solvers.problem import Problem
from solvers.simulator import evaluate_mask, honour_policies_mask, names_of, schedule, simulate

__all__ = ["dp", "chain_of_blocks", "BlockChain"]

log = logging.getLogger("solvers.dp")

Progress = Callable[[float, str], None]

_INPUT, _FORWARD, _BACKWARD = 0, 1, 2
_SAVE, _RECOMPUTE = 1, 2
_INF = float("inf")

#: Default number of memory levels when the budget must be quantised.
MAX_SLOTS = 256
#: Budgets (in bytes above the resident set) up to this are solved byte-exactly.
EXACT_BYTES = 4096
#: Chains longer than this are coarsened by merging neighbouring blocks.
MAX_BLOCKS = 120
#: Rough number of (sub-chain, split) pairs the DP may examine; sets the window.
WORK_PAIRS = 12_000
#: How many times dp re-solves with a tighter internal budget when simulate() disagrees.
_RETRIES = 4


# ============================================================== chain of blocks
@dataclass
class BlockChain:
    """The forward graph collapsed into a chain of blocks (index 1..L; index 0 is "no block").

    Attributes
    ----------
    blocks : list of list of int
        ``blocks[j]`` = positions of the forward nodes of block j (problem order); ``blocks[0] = []``.
    cut : list of int
        ``cut[j]`` = position of the last node of block j (its cut point); ``cut[0] = -1``.
    segments : list of tuple of int
        ``segments[j]`` = positions of the backward nodes that belong to block j, in order.
    segment_start : list of int
        Backward stage (index into the backward nodes) at which block j's segment starts.
    pinned : bytearray
        Forward nodes that are resident from their forward computation on (outputs, "save"
        nodes and the alias bases of those): never recomputed, free to read.
    """

    blocks: list[list[int]]
    cut: list[int]
    segments: list[tuple[int, ...]]
    segment_start: list[int]
    pinned: bytearray
    relevant: bytearray
    #: Forward nodes outside every block: computable from inputs and resident values
    #: alone and read only in backward (e.g. a weight transpose); recomputed just in
    #: time inside each backward segment that reads them.
    floating: bytearray = field(default_factory=bytearray)
    #: Block nodes in the order the forward phase runs them: problem order, except that
    #: values only backward reads sit right after their last forward pred.
    order: list[int] = field(default_factory=list)
    #: Ancestors-or-self of pinned nodes: computed in the forward phase whatever the plan.
    forward_needed: bytearray = field(default_factory=bytearray)

    @property
    def length(self) -> int:
        return len(self.blocks) - 1


def storage_roots(problem: Problem) -> list[int]:
    """Per node, the node whose storage its bytes are counted in (conservatively).

    A view counts in its alias root's storage. A getitem of a multi-output op
    (``part_of``) is counted in the op's whole storage: the simulator moves
    the getitem's bytes out of the op's storage, so counting the whole op
    while either is alive over-estimates, never under-estimates. Cached.
    """
    cached = problem._cache.get("dp.storage_roots")
    if cached is not None:
        return cached
    alias_root, alias_of = problem._alias_root, problem._alias_of
    part_of = getattr(problem, "_part_of", None)
    roots = list(alias_root)
    if part_of is not None:
        nbytes = problem._bytes
        for v in range(len(roots)):
            # (a getitem of 0 bytes owns no storage and pins nothing)
            if alias_of[v] < 0 and part_of[v] >= 0 and nbytes[v] > 0:
                roots[v] = roots[part_of[v]]
            elif alias_of[v] >= 0:
                roots[v] = roots[alias_of[v]]
    problem._cache["dp.storage_roots"] = roots
    return roots


def _storage_parent(problem: Problem, v: int, alias_of: list[int], part_of: list[int]) -> int:
    """The node whose storage v's value lives in (-1: its own or none)."""
    if alias_of[v] >= 0:
        return alias_of[v]
    if part_of[v] >= 0 and problem._bytes[v] > 0:
        return part_of[v]
    return -1


def scratch_of(problem: Problem) -> list[int]:
    """Per node, transient bytes counted at its own step only (0 on older Problems)."""
    return getattr(problem, "_scratch", None) or [0] * len(problem.nodes)


def _ancestors_or_self(problem: Problem, seeds: Iterable[int], allowed: bytearray | None = None) -> bytearray:
    """Mark forward ancestors-or-self of ``seeds`` (through forward preds); O(n + edges)."""
    mark = bytearray(len(problem.nodes))
    for v in seeds:
        mark[v] = 1
    fwd_preds = problem._fwd_preds
    for v in reversed(problem._forward_idx):
        if mark[v]:
            for p in fwd_preds[v]:
                if allowed is None or allowed[p]:
                    mark[p] = 1
    return mark


def _pinned_and_relevant(problem: Problem, extra_pins: Iterable[int] = ()
                         ) -> tuple[bytearray, bytearray, bytearray, bytearray]:
    """(pinned, relevant, forward_needed, ordered) masks over node positions.

    ``extra_pins`` are kept from forward on as if they were "save" nodes;
    ``ordered`` marks the ancestors of outputs and "save" nodes, which run in
    problem order (everything else is placed after its last forward pred).
    """
    kind, output, policy = problem._kind, problem._output, problem._policy
    alias_of = problem._alias_of
    part_of = getattr(problem, "_part_of", None) or [-1] * len(problem.nodes)
    read_by_backward = problem._read_by_backward
    forward = problem._forward_idx
    backward_seeds = [v for v in forward if read_by_backward[v]]
    backward_relevant = _ancestors_or_self(problem, backward_seeds)
    pinned = bytearray(len(problem.nodes))
    for v in forward:
        # A "save" node may never be recomputed, so if backward can need it
        # (directly or to recompute something) it is kept from forward on.
        if output[v] or (policy[v] == _SAVE and backward_relevant[v]):
            pinned[v] = 1
            # An output view (or getitem) keeps its base's storage alive forever:
            # keeping the base itself then costs nothing and spares a second copy.
            a = _storage_parent(problem, v, alias_of, part_of)
            while a >= 0 and kind[a] == _FORWARD and not pinned[a]:
                if policy[a] != _RECOMPUTE:
                    pinned[a] = 1
                a = _storage_parent(problem, a, alias_of, part_of)
    ordered = _ancestors_or_self(problem, [v for v in forward if pinned[v]])
    fwd_preds = problem._fwd_preds
    for v in sorted(extra_pins):
        if kind[v] == _FORWARD and policy[v] != _RECOMPUTE:
            pinned[v] = 1
            # Computed from resident values only: it can run at its own place in
            # the forward order without holding anything else alive.
            if all(pinned[p] for p in fwd_preds[v]):
                ordered[v] = 1
    forward_needed = _ancestors_or_self(problem, [v for v in forward if pinned[v]])
    relevant = bytearray(len(problem.nodes))
    for v in forward:
        if forward_needed[v] or backward_relevant[v]:
            relevant[v] = 1
    return pinned, relevant, forward_needed, ordered


def _clean_cuts(problem: Problem, order: list[int], pinned: bytearray) -> list[int]:
    """Cut points of the relevant forward nodes ``order`` that no alias group straddles."""
    position = {v: k for k, v in enumerate(order)}
    kind, consumers = problem._kind, problem._consumers
    alias_root = storage_roots(problem)
    n = len(order)
    # An alias group whose storage is not resident pins its root's storage
    # until its last member dies: a cut inside the group would let a block's
    # values hold the previous block's storage.
    group_end: dict[int, int] = {}
    for k, v in enumerate(order):
        r = alias_root[v]
        if r != v and kind[r] == _FORWARD and not pinned[r] and r in position:
            group_end[r] = max(group_end.get(r, position[r]), k)
    blocked = [0] * (n + 1)
    for r, end in group_end.items():
        blocked[position[r]] += 1
        blocked[end] -= 1
    cuts = []
    reach = -1
    open_groups = 0
    for k, v in enumerate(order):
        open_groups += blocked[k]
        if reach <= k and open_groups == 0:
            cuts.append(v)
        if not pinned[v]:
            for c in consumers[v]:
                if kind[c] == _FORWARD and c in position and position[c] > reach:
                    reach = position[c]
    if not cuts or cuts[-1] != order[-1]:
        cuts.append(order[-1])
    return cuts



def chain_of_blocks(problem: Problem, *, max_blocks: int | None = None, extra_pins: Iterable[int] = ()) -> BlockChain:
    """Collapse ``problem`` into a chain of blocks through forward cut points.

    Blocks are merged until (a) every backward node reads forward values of a
    single block (plus that block's input cut) and (b) the backward nodes visit
    blocks in non-increasing order. With ``max_blocks``, neighbouring blocks
    are then merged (balancing forward bytes) until at most that many remain.
    O(n + edges).

    >>> chain = chain_of_blocks(Problem.training_chain(4))
    >>> chain.length, [len(s) for s in chain.segments[1:]]
    (4, [2, 1, 1, 0])
    """
    pinned, relevant, forward_needed, ordered = _pinned_and_relevant(problem, extra_pins)
    order, floating = _block_order(problem, pinned, relevant, forward_needed, ordered)
    if not order:
        return BlockChain([[]], [-1], [tuple(problem._backward_idx)], [0], pinned, relevant, floating, order,
                          forward_needed)
    cuts = _clean_cuts(problem, order, pinned)
    cut_rank = {c: j for j, c in enumerate(cuts, start=1)}
    block_of = [0] * len(problem.nodes)
    j = 1
    for v in order:
        block_of[v] = j
        if v in cut_rank:
            j += 1
    n_blocks = len(cuts)

    # Which block span each backward node needs; merge spans with a stack so
    # that the backward phase visits blocks in non-increasing order.
    fwd_preds = problem._fwd_preds
    is_cut = bytearray(len(problem.nodes))
    for c in cuts:
        is_cut[c] = 1
    stack: list[list[int]] = []  # [lo, hi] spans, decreasing from bottom to top
    spans: list[tuple[int, int] | None] = []
    for b in problem._backward_idx:
        reads = [v for v in fwd_preds[b] if relevant[v] and not pinned[v] and not floating[v]]
        internal = [block_of[v] for v in reads if not is_cut[v]]
        boundary = [block_of[v] for v in reads if is_cut[v]]
        if internal:
            lo, hi = min(internal), max(internal)
            for jb in boundary:
                if jb < lo - 1:
                    lo = jb + 1
                elif jb > hi:
                    hi = jb
            options = [(lo, hi)]
        elif boundary:
            j1, j2 = min(boundary), max(boundary)
            if j1 == j2:
                # Reading only c_j: as block j+1's input or as block j's own value.
                options = [(j1, j1), (j1 + 1, j1 + 1)] if j1 < n_blocks else [(j1, j1)]
            else:
                options = [(j1 + 1, j2)]
        else:
            spans.append(None)
            continue
        chosen = None
        for lo, hi in options:
            if not stack or hi < stack[-1][0] or (stack[-1][0] <= lo and hi <= stack[-1][1]):
                chosen = (lo, hi)
                break
        if chosen is None:
            chosen = options[-1]
        lo, hi = chosen
        if stack and stack[-1][0] <= lo and hi <= stack[-1][1]:
            pass
        elif not stack or hi < stack[-1][0]:
            stack.append([lo, hi])
        else:
            while stack and stack[-1][0] <= hi:
                plo, phi = stack.pop()
                lo, hi = min(lo, plo), max(hi, phi)
            stack.append([lo, hi])
        spans.append((lo, hi))

    # Merged partition: block ids -> group ids (consecutive).
    merge_to = list(range(n_blocks + 2))  # each block's group's first block
    for lo, hi in stack:
        for jb in range(lo, hi + 1):
            merge_to[jb] = lo
    firsts = sorted(set(merge_to[1 : n_blocks + 1]))
    group_index = {f: g for g, f in enumerate(firsts, start=1)}
    group_of_block = [0] + [group_index[merge_to[jb]] for jb in range(1, n_blocks + 1)]

    # Optional coarsening: merge neighbouring groups, balancing forward bytes.
    n_groups = len(firsts)
    if max_blocks is not None and n_groups > max_blocks:
        weight = [0] * (n_groups + 1)
        for v in order:
            weight[group_of_block[block_of[v]]] += problem._bytes[v] + 1
        total = sum(weight)
        coarse = [0] * (n_groups + 1)
        acc, g_new = 0, 1
        for g in range(1, n_groups + 1):
            if acc > 0 and acc + weight[g] > total * g_new / max_blocks and g_new < max_blocks:
                g_new += 1
            acc += weight[g]
            coarse[g] = g_new
        group_of_block = [0] + [coarse[group_of_block[jb]] for jb in range(1, n_blocks + 1)]
        n_groups = g_new

    blocks: list[list[int]] = [[] for _ in range(n_groups + 1)]
    for v in order:
        blocks[group_of_block[block_of[v]]].append(v)
    cut = [-1] + [blocks[g][-1] for g in range(1, n_groups + 1)]

    # Segments: each backward node goes to its span's group; nodes reading no
    # block value join the segment being run.
    segment_lists: list[list[int]] = [[] for _ in range(n_groups + 1)]
    current = n_groups
    assigned: list[int] = []
    for b, span in zip(problem._backward_idx, spans, strict=True):
        if span is not None:
            g = group_of_block[span[0]]
            g2 = group_of_block[span[1]]
            if g != g2 or g > current:
                log.debug("dp: block assignment fell back to a single block (%s: span %s, groups %d..%d, current %d)",
                          problem.nodes[b].name, span, g, g2, current)
                return _single_block(problem, order, pinned, relevant, floating, forward_needed)
            current = g
        assigned.append(current)
        segment_lists[current].append(b)
    segment_start = [0] * (n_groups + 2)
    stage = 0
    for g in range(n_groups, 0, -1):
        segment_start[g] = stage
        stage += len(segment_lists[g])
    segment_start[0] = stage
    segments = [tuple(s) for s in segment_lists]
    return BlockChain(blocks, cut, segments, segment_start, pinned, relevant, floating, order, forward_needed)


def _single_block(problem: Problem, order: list[int], pinned: bytearray, relevant: bytearray,
                  floating: bytearray, forward_needed: bytearray) -> BlockChain:
    backward = tuple(problem._backward_idx)
    return BlockChain([[], list(order)], [-1, order[-1]], [(), backward], [len(backward), 0], pinned, relevant,
                      floating, order, forward_needed)


def _block_order(problem: Problem, pinned: bytearray, relevant: bytearray,
                 forward_needed: bytearray, ordered: bytearray) -> tuple[list[int], bytearray]:
    """(block nodes in forward-phase order, floating mask); see :class:`BlockChain`.

    A value that only backward reads, placed late in the problem order but
    reading an early activation, would otherwise jump over every cut point.
    """
    fwd_preds = problem._fwd_preds
    forward = problem._forward_idx
    floating = bytearray(len(problem.nodes))
    for v in forward:
        if relevant[v] and not forward_needed[v] and all(
            pinned[p] or floating[p] or not relevant[p] for p in fwd_preds[v]
        ):
            floating[v] = 1
    # A block node must never read a floating value (blocks recompute from their cut).
    for v in reversed(forward):
        if relevant[v] and not floating[v]:
            for p in fwd_preds[v]:
                floating[p] = 0
    main: list[int] = []
    rank: dict[int, tuple[int, int, int]] = {}
    hoisted: list[int] = []
    for v in forward:
        if not relevant[v] or floating[v]:
            continue
        if ordered[v]:
            rank[v] = (len(main), 0, 0)
            main.append(v)
            continue
        anchors = [rank[p] for p in fwd_preds[v] if p in rank]
        anchor = max(anchors)[0] if anchors else 0
        rank[v] = (anchor, 1, v)
        hoisted.append(v)
    order = sorted(main + hoisted, key=rank.__getitem__)
    return order, floating


# ============================================================== exact piece simulations
class _Model:
    """Per-block memory profiles and costs of the pieces the DP composes."""

    def __init__(self, problem: Problem, chain: BlockChain, float_once: bool = False) -> None:
        self.problem = problem
        self.chain = chain
        # float_once: a floating value is recomputed once, before its first backward
        # reader, and lives until its last (instead of once per segment reading it).
        self.float_once = float_once
        L = chain.length
        self.L = L
        kind, nbytes = problem._kind, problem._bytes
        alias_root = storage_roots(problem)
        pinned = chain.pinned
        self.block_of = block_of = [0] * len(problem.nodes)
        for j in range(1, L + 1):
            for v in chain.blocks[j]:
                block_of[v] = j

        floating = chain.floating

        def storage_backward(v: int) -> int:
            r = alias_root[v]
            if kind[r] != _FORWARD or pinned[r] or nbytes[r] == 0 or (float_once and floating[r]):
                return -1
            return r

        self.storage = storage_backward
        self.x = [0] * (L + 1)  # bytes of c_j's storage (0: resident or none)
        for j in range(1, L + 1):
            s = storage_backward(chain.cut[j])
            self.x[j] = nbytes[s] if s >= 0 else 0

        # What each segment reads: x̄_j (block j values) and whether it reads c_{j-1}.
        fwd_preds = problem._fwd_preds
        self.xbar: list[list[int]] = [[] for _ in range(L + 1)]
        self.reads_in = [False] * (L + 2)
        for j in range(1, L + 1):
            seen: dict[int, None] = {}
            for b in chain.segments[j]:
                for v in fwd_preds[b]:
                    if pinned[v] or not chain.relevant[v]:
                        continue
                    if block_of[v] == j:
                        seen[v] = None
                    elif j > 1 and v == chain.cut[j - 1]:
                        self.reads_in[j] = True
            self.xbar[j] = list(seen)
        # λ(j): block j's backward reads c_j, so c_j survives everything above it.
        self.lam = [False] * (L + 2)
        for j in range(1, L + 1):
            c = chain.cut[j]
            self.lam[j] = (not pinned[c]) and c in self.xbar[j]
        self.xbar_other = [[v for v in self.xbar[j] if v != chain.cut[j]] for j in range(L + 1)]
        # Prefix counts for "does sub-chain (s, k] need anything recomputed".
        # A block below the top needs recomputing if its backward reads any of its values.
        self.cnt_inner_needs = [0] * (L + 1)
        self.cnt_xbar_other = [0] * (L + 1)
        self.cnt_reads_in = [0] * (L + 2)
        self.cnt_segments = [0] * (L + 1)
        for j in range(1, L + 1):
            self.cnt_xbar_other[j] = self.cnt_xbar_other[j - 1] + (1 if self.xbar_other[j] else 0)
            self.cnt_inner_needs[j] = self.cnt_inner_needs[j - 1] + (1 if self.xbar[j] else 0)
            self.cnt_reads_in[j] = self.cnt_reads_in[j - 1] + (1 if self.reads_in[j] else 0)
            self.cnt_segments[j] = self.cnt_segments[j - 1] + (1 if chain.segments[j] else 0)

        self._background()
        self._pieces()

    # ---------------------------------------------------------------- queries
    def needs(self, s: int, k: int, tau: int) -> bool:
        """Does B(s, k, tau) have to recompute anything (hence read c_s)?"""
        if k <= s:
            return False
        if self.reads_in[s + 1]:
            return True
        if self.cnt_inner_needs[k - 1] - self.cnt_inner_needs[s]:
            return True
        if self.xbar_other[k]:
            return True
        if self.cnt_reads_in[k] - self.cnt_reads_in[s + 1]:
            return True
        return self.lam[k] and not tau

    def storages_bytes(self, nodes: Iterable[int], exclude: int = -1) -> int:
        seen = set()
        total = 0
        nbytes = self.problem._bytes
        for v in nodes:
            s = self.storage(v)
            if s >= 0 and s != exclude and s not in seen:
                seen.add(s)
                total += nbytes[s]
        return total

    # ---------------------------------------------------------- background
    def _background(self) -> None:
        """Bytes alive in the backward phase that do not depend on the plan.

        ``G[q]``: at backward node q's allocation; ``H[q]``: just before any
        recomputation inserted before node q (``H[B]``: after the last node).
        Both include every resident forward value (outputs, pinned nodes).
        """
        problem, chain = self.problem, self.chain
        kind, nbytes, output = problem._kind, problem._bytes, problem._output
        alias_root, consumers = storage_roots(problem), problem._consumers
        backward = problem._backward_idx
        stage = {b: q for q, b in enumerate(backward)}
        B = len(backward)
        birth: dict[int, int] = {}
        death: dict[int, int] = {}
        # Resident forward storages: outputs for ever, other pinned values until
        # their last backward read (a kept instance dies then).
        for v in problem._forward_idx:
            if not chain.pinned[v]:
                continue
            r = alias_root[v]
            if kind[r] != _FORWARD or nbytes[r] == 0:
                continue
            if output[v]:
                d = B
            else:
                d = max([-1] + [stage[c] for c in consumers[v] if kind[c] == _BACKWARD])
            if d < 0:
                continue
            birth[r] = 0
            death[r] = max(death.get(r, -1), d)
        self.first_reader: dict[int, int] = {}
        if self.float_once:
            for v in problem._forward_idx:
                if not chain.floating[v]:
                    continue
                readers = [stage[c] for c in consumers[v] if kind[c] == _BACKWARD]
                if readers:
                    self.first_reader[v] = min(readers)
                r = alias_root[v]
                if not readers or kind[r] != _FORWARD or nbytes[r] == 0 or not chain.floating[r]:
                    continue
                # Alive from just before its first reader's stage to its last reader.
                birth[r] = min(birth.get(r, B), min(readers))
                death[r] = max(death.get(r, -1), max(readers))
        for q, b in enumerate(backward):
            r = alias_root[b]
            if kind[r] != _BACKWARD or nbytes[r] == 0:
                continue
            if output[b]:
                d = B
            else:
                d = q
                for c in consumers[b]:
                    if kind[c] == _BACKWARD and stage[c] > d:
                        d = stage[c]
            birth.setdefault(r, stage[r])
            death[r] = max(death.get(r, -1), d)
        delta = [0] * (B + 2)
        # (born at stage 0 but alive before it: not "born" by node 0's allocation)
        resident_forward = {r for r in birth if kind[r] == _FORWARD}  # counted in H at their birth stage too
        born = [0] * (B + 1)
        for r, b0 in birth.items():
            delta[b0] += nbytes[r]
            delta[death[r] + 1] -= nbytes[r]
            if r not in resident_forward:
                born[b0] += nbytes[r]
        G = [0] * (B + 1)
        live = 0
        for q in range(B + 1):
            live += delta[q]
            G[q] = live
        self.H = [G[q] - born[q] for q in range(B + 1)]
        scratch = scratch_of(problem)
        for q, b in enumerate(backward):
            G[q] += scratch[b]
        self.G = G
        self.stage_of = stage

    def bg_before(self, t: int) -> int:
        """Background while recomputing before block t's segment."""
        return self.H[self.chain.segment_start[t]]

    # ------------------------------------------------------------- pieces
    def _profile(self, steps: list[int], base: int, base_after: bool, keep: set[int],
                 pre_live: tuple[int, ...] = (), forward_phase: bool = False) -> int:
        """Peak bytes (above everything outside the piece) of running ``steps``.

        ``base`` is alive at the start and dies after its last read here unless
        ``base_after``; ``pre_live`` values are alive throughout; ``keep``
        values survive the piece. In the forward phase, pinned values computed
        here count from their step on.
        """
        problem = self.problem
        n = len(steps)
        if n == 0:
            return 0
        preds, nbytes, kind = problem._preds, problem._bytes, problem._kind
        alias_root, pinned = storage_roots(problem), self.chain.pinned
        index = {v: i for i, v in enumerate(steps)}
        last_read: dict[int, int] = {}
        for i, v in enumerate(steps):
            for p in preds[v]:
                last_read[p] = i
        end = n

        def storage_of(v: int) -> int:
            r = alias_root[v]
            if kind[r] != _FORWARD or nbytes[r] == 0:
                return -1
            if pinned[r] and not (forward_phase and r in index):
                return -1
            return r

        birth: dict[int, int] = {}
        death: dict[int, int] = {}

        def add(v: int, b: int, d: int) -> None:
            s = storage_of(v)
            if s < 0:
                return
            if s not in birth or b < birth[s]:
                birth[s] = b
            if s not in death or d > death[s]:
                death[s] = d

        for v in pre_live:
            add(v, -1, end)
        if base >= 0:
            d = end if base_after else last_read.get(base, -1)
            if d >= 0:
                add(base, -1, d)
        for i, v in enumerate(steps):
            if v in keep or (forward_phase and pinned[v]):
                d = end
            else:
                d = max(i, last_read.get(v, i))
            add(v, i, d)
        delta = [0] * (n + 1)
        for s, b in birth.items():
            b = max(b, 0)
            d = min(death[s], n - 1)
            if d >= b:
                delta[b] += nbytes[s]
                delta[d + 1] -= nbytes[s]
        scratch = scratch_of(problem)
        peak = live = 0
        for i in range(n):
            live += delta[i]
            m = live + scratch[steps[i]]
            if m > peak:
                peak = m
        return peak

    def _segment_steps(self, j: int, jit_block: bool, tau: int,
                       alive: Iterable[int] = ()) -> tuple[list[int], list[int]]:
        """Block j's backward segment with just-in-time recomputations: (nodes, background per step).

        Floating values are always recomputed right before their first reader
        in the segment; with ``jit_block`` block j's values are too (from
        c_{j-1}, which must be alive; c_j counts as alive when ``tau``).
        """
        chain, problem = self.chain, self.problem
        fwd_preds = problem._fwd_preds
        pinned, floating, block_of = chain.pinned, chain.floating, self.block_of
        q0 = chain.segment_start[j]
        base = chain.cut[j - 1] if j > 1 else -1
        done: set[int] = {base, *alive}
        if tau:
            done.add(chain.cut[j])
        nodes: list[int] = []
        bgs: list[int] = []

        once, first_reader = self.float_once, self.first_reader
        q = q0

        def wanted(p: int) -> bool:
            if p in done or pinned[p]:
                return False
            if floating[p]:
                return not once or first_reader.get(p) == q
            return jit_block and block_of[p] == j

        for i, b in enumerate(chain.segments[j]):
            q = q0 + i
            for p in fwd_preds[b]:
                if not wanted(p):
                    continue
                stack = [(p, 0)]
                while stack:
                    v, k = stack[-1]
                    preds = fwd_preds[v]
                    while k < len(preds) and not wanted(preds[k]):
                        k += 1
                    if k < len(preds):
                        stack[-1] = (v, k + 1)
                        stack.append((preds[k], 0))
                    else:
                        stack.pop()
                        if v not in done:
                            done.add(v)
                            nodes.append(v)
                            bgs.append(self.H[q])
            nodes.append(b)
            bgs.append(self.G[q])
        return nodes, bgs

    def _seq_profile(self, nodes: list[int], bgs: list[int], alive_until_read: Iterable[int] = (),
                     base: int = -1, base_alive: bool = False, base_after: bool = False) -> int:
        """Peak of a step sequence in the backward phase (background included).

        ``alive_until_read`` values are alive at the start and die after their
        last read here; ``base`` likewise when ``base_alive``, or lives
        throughout when ``base_after``. Forward nodes in ``nodes`` allocate and
        die after their last read here.
        """
        n = len(nodes)
        if n == 0:
            return 0
        problem = self.problem
        preds, nbytes, kind = problem._preds, problem._bytes, problem._kind
        last_read: dict[int, int] = {}
        for i, v in enumerate(nodes):
            for p in preds[v]:
                last_read[p] = i
        birth: dict[int, int] = {}
        death: dict[int, int] = {}

        def add(v: int, b: int, d: int) -> None:
            st = self.storage(v)
            if st < 0 or d < 0:
                return
            if st not in birth or b < birth[st]:
                birth[st] = b
            if st not in death or d > death[st]:
                death[st] = d

        for v in alive_until_read:
            add(v, 0, last_read.get(v, -1))
        if base >= 0 and (base_alive or base_after):
            add(base, 0, n - 1 if base_after else last_read.get(base, -1))
        for i, v in enumerate(nodes):
            if kind[v] == _FORWARD:
                add(v, i, max(i, last_read.get(v, i)))
        delta = [0] * (n + 1)
        for st, b in birth.items():
            d = min(death[st], n - 1)
            if d >= b:
                delta[b] += nbytes[st]
                delta[d + 1] -= nbytes[st]
        scratch = scratch_of(problem)
        peak = live = 0
        for i in range(n):
            live += delta[i]
            v = nodes[i]
            m = bgs[i] + live + (scratch[v] if kind[v] == _FORWARD else 0)
            if m > peak:
                peak = m
        return peak

    def _closure(self, j: int, targets: Iterable[int], skip: Iterable[int] = ()) -> list[int]:
        """Non-pinned nodes of block j needed to compute ``targets`` (problem order)."""
        block = self.chain.blocks[j]
        pinned = self.chain.pinned
        skip = set(skip)
        mark = {v for v in targets if not pinned[v] and v not in skip}
        fwd_preds, block_of = self.problem._fwd_preds, self.block_of
        for v in reversed(block):
            if v in mark:
                for p in fwd_preds[v]:
                    if block_of[p] == j and not pinned[p] and p not in skip:
                        mark.add(p)
        return [v for v in block if v in mark]

    def _forward_steps(self, j: int, targets: Iterable[int]) -> list[int]:
        block = self.chain.blocks[j]
        mark = set(targets)
        fwd_preds, block_of = self.problem._fwd_preds, self.block_of
        forward_needed = self.forward_needed
        for v in reversed(block):
            if v in mark or forward_needed[v]:
                mark.add(v)
                for p in fwd_preds[v]:
                    if block_of[p] == j:
                        mark.add(p)
        return [v for v in block if v in mark]

    def _pieces(self) -> None:
        problem, chain, L = self.problem, self.chain, self.L
        cost = problem._cost
        self.forward_needed = chain.forward_needed
        pinned = chain.pinned
        self.tr_steps = [[] for _ in range(L + 1)]
        self.tr_cost = [0.0] * (L + 1)
        self.tr_peak = [[0, 0] for _ in range(L + 1)]
        self.fa_steps = [[] for _ in range(L + 1)]
        self.fa_cost = [0.0] * (L + 1)
        self.fa_peak = [[0, 0] for _ in range(L + 1)]
        self.leaf_steps = [[[], []] for _ in range(L + 1)]
        self.leaf_cost = [[0.0, 0.0] for _ in range(L + 1)]
        self.leaf_peak = [[[0, 0], [0, 0]] for _ in range(L + 1)]
        self.bw_peak = [[0, 0, 0] for _ in range(L + 1)]
        self.bw_top = [[0, 0] for _ in range(L + 1)]
        self.bw_steps: list[list[int]] = [[] for _ in range(L + 1)]
        self.jit_steps = [[[], []] for _ in range(L + 1)]
        self.jit_cost = [[0.0, 0.0] for _ in range(L + 1)]
        self.jit_peak = [[[0, 0], [0, 0]] for _ in range(L + 1)]
        self.xbar_extra = [0] * (L + 1)  # x̄ bytes held besides c_j's storage
        self.xbar_all = [0] * (L + 1)
        self.fwd_tr_peak = [[0, 0] for _ in range(L + 1)]
        # Forward-phase "keep part of x̄, recompute the rest just in time" options per block.
        self.partial: list[list[_Partial]] = [[] for _ in range(L + 1)]
        self.fwd_fa_peak = [[0, 0] for _ in range(L + 1)]
        self.out_before = [0] * (L + 2)
        self.fwd_pinned = [0] * (L + 1)
        nbytes, alias_root = problem._bytes, storage_roots(problem)
        for j in range(1, L + 1):
            c = chain.cut[j]
            base = chain.cut[j - 1] if j > 1 else -1
            xbar = self.xbar[j]
            tr = self._closure(j, [c])
            self.tr_steps[j] = tr
            self.tr_cost[j] = sum(cost[v] for v in tr)
            for ba in (0, 1):
                self.tr_peak[j][ba] = self._profile(tr, base, bool(ba), {c})
            fa = self._closure(j, [*xbar, c])
            self.fa_steps[j] = fa
            self.fa_cost[j] = sum(cost[v] for v in fa)
            keep_fa = set(xbar) | {c}
            for ba in (0, 1):
                self.fa_peak[j][ba] = self._profile(fa, base, bool(ba), keep_fa)
            for tau in (0, 1):
                if tau and not self.lam[j]:
                    self.leaf_steps[j][1] = self.leaf_steps[j][0]
                    self.leaf_cost[j][1] = self.leaf_cost[j][0]
                    self.leaf_peak[j][1] = list(self.leaf_peak[j][0])
                    continue
                skip = [c] if tau else []
                leaf = self._closure(j, xbar, skip)
                self.leaf_steps[j][tau] = leaf
                self.leaf_cost[j][tau] = sum(cost[v] for v in leaf)
                for ba in (0, 1):
                    self.leaf_peak[j][tau][ba] = self._profile(leaf, base, bool(ba), set(xbar),
                                                               pre_live=(c,) if tau else ())
            seg_nodes, seg_bgs = self._segment_steps(j, False, 0)
            self.bw_steps[j] = seg_nodes
            for mode in (0, 1, 2):
                self.bw_peak[j][mode] = self._seq_profile(seg_nodes, seg_bgs, xbar, base, mode >= 1, mode == 2)
            self.bw_top[j][0] = self._seq_profile(seg_nodes, seg_bgs)
            self.bw_top[j][1] = self._seq_profile(seg_nodes, seg_bgs, [c] if self.lam[j] else [])
            for tau in (0, 1):
                jit_nodes, jit_bgs = self._segment_steps(j, True, tau and self.lam[j])
                self.jit_steps[j][tau] = jit_nodes
                self.jit_cost[j][tau] = sum(cost[v] for v in jit_nodes if self.block_of[v] == j)
                top_live = [c] if tau and self.lam[j] else []
                for ba in (0, 1):
                    self.jit_peak[j][tau][ba] = self._seq_profile(jit_nodes, jit_bgs, top_live, base, True, bool(ba))
            self.xbar_extra[j] = self.storages_bytes(xbar, exclude=self.storage(c))
            self.xbar_all[j] = self.storages_bytes(xbar)
            # Forward phase: everything the outputs need is computed anyway.
            ftr = self._forward_steps(j, [c])
            ffa = self._forward_steps(j, [*xbar, c])
            for ba in (0, 1):
                self.fwd_tr_peak[j][ba] = self._profile(ftr, base, bool(ba), {c}, forward_phase=True)
                self.fwd_fa_peak[j][ba] = self._profile(ffa, base, bool(ba), keep_fa, forward_phase=True)
            self.partial[j] = self._partial_keeps(j, base, c)
            for v in chain.blocks[j]:
                # Each resident storage once, in its root's block (roots of pinned views are pinned).
                if pinned[v] and alias_root[v] == v:
                    self.fwd_pinned[j] += nbytes[v]
        for j in range(1, L + 2):
            self.out_before[j] = self.out_before[j - 1] + (self.fwd_pinned[j - 1] if j - 1 >= 1 else 0)

    def _partial_keeps(self, j: int, base: int, c: int) -> list["_Partial"]:
        """Keep all of block j's x̄ but the values cheapest to recompute per byte.

        Nested candidates: drop the 1, 2, 3, half and all of the other x̄ values
        (ranked by the cost of recomputing each, closure included, per byte);
        those are recomputed in the segment just before their first reader.
        """
        others = self.xbar_other[j]
        if not others:
            return []
        problem = self.problem
        cost, nbytes = problem._cost, problem._bytes
        ratio = {}
        for v in others:
            closure = self._closure(j, [v], skip=[w for w in self.xbar[j] if w != v])
            st = self.storage(v)
            ratio[v] = sum(cost[u] for u in closure) / max(1, nbytes[st] if st >= 0 else 0)
        ranked = sorted(others, key=lambda v: (ratio[v], v))
        sizes = sorted({k for k in (1, 2, 3, len(ranked) // 2, len(ranked)) if 1 <= k <= len(ranked)})
        out = []
        for k in sizes:
            dropped = set(ranked[:k])
            kept = [v for v in self.xbar[j] if v not in dropped]
            steps = self._forward_steps(j, [*kept, c])
            keep = set(kept) | {c}
            fwd = [self._profile(steps, base, bool(ba), keep, forward_phase=True) for ba in (0, 1)]
            nodes, bgs = self._segment_steps(j, True, 0, alive=kept)
            reads_base = base >= 0 and any(base in problem._preds[v] for v in nodes)
            bw = [self._seq_profile(nodes, bgs, kept, base, bool(mode), mode == 2) for mode in (0, 1, 2)]
            recompute = sum(cost[v] for v in nodes if self.block_of[v] == j)
            out.append(_Partial(kept, nodes, fwd, bw, recompute, reads_base or self.reads_in[j],
                                self.storages_bytes(kept, exclude=self.storage(c)), self.storages_bytes(kept)))
        return out

    def bw_mode(self, j: int, base_live_after: bool) -> int:
        """Base mode of block j's backward when c_{j-1} is alive at its start iff read there or later."""
        if base_live_after:
            return 2
        return 1 if self.reads_in[j] else 0


@dataclass
class _Partial:
    """A forward-phase option for one block: keep ``kept`` of its x̄, recompute the rest in backward."""

    kept: list[int]
    backward_steps: list[int]  # the segment with just-in-time recomputations
    forward_peak: list[int]  # by "c_{j-1} kept" flag
    backward_peak: list[int]  # by base mode (0 dead, 1 until last read, 2 throughout)
    cost: float
    reads_base: bool  # the segment (or its recomputations) reads c_{j-1}
    extra_without_cut: int  # bytes of kept storages other than c_j's
    extra_with_cut: int


# ============================================================== fronts
# A front is (reqs, costs, tags): reqs strictly increasing, costs strictly
# decreasing; "with at least reqs[i] bytes available, cost costs[i] is
# reachable by the option tags[i]".
_EMPTY: tuple[list[int], list[float], list[Any]] = ([], [], [])


class _Fronts:
    def __init__(self, quantum: int, cap: int) -> None:
        self.q = quantum
        self.cap = cap

    def up(self, r: int) -> int:
        q = self.q
        if q <= 1:
            return r
        return -(-r // q) * q

    def single(self, r0: int, c0: float, tag: Any, out: list) -> None:
        r = self.up(max(r0, 0))
        if r <= self.cap:
            out.append((r, c0, tag))

    def one(self, r0: int, c0: float, f, e: int, tag: Any, out: list) -> None:
        reqs, costs = f[0], f[1]
        cap, up = self.cap, self.up
        for i in range(len(reqs)):
            r = reqs[i] + e
            if r < r0:
                r = r0
            r = up(r)
            if r > cap:
                break
            out.append((r, c0 + costs[i], tag))

    def two(self, r0: int, c0: float, f1, e1: int, f2, e2: int, tag: Any, out: list) -> None:
        a, ca = f1[0], f1[1]
        b, cb = f2[0], f2[1]
        na, nb = len(a), len(b)
        cap, q = self.cap, self.q
        if not na or not nb or r0 > cap:
            return
        i = j = 0
        best = _INF
        append = out.append
        while i < na or j < nb:
            ra = a[i] + e1 if i < na else _INF
            rb = b[j] + e2 if j < nb else _INF
            if ra <= rb:
                r = ra
                i += 1
                if rb == ra:
                    j += 1
            else:
                r = rb
                j += 1
            if i == 0 or j == 0:
                continue
            if r < r0:
                r = r0
            if q > 1:
                r = -(-r // q) * q
            if r > cap:
                break
            c = c0 + ca[i - 1] + cb[j - 1]
            if c < best:
                best = c
                append((r, c, tag))

    @staticmethod
    def envelope(points: list) -> tuple[list[int], list[float], list[Any]]:
        if not points:
            return _EMPTY
        points.sort()
        reqs: list[int] = []
        costs: list[float] = []
        tags: list[Any] = []
        best = _INF
        for r, c, tag in points:
            if c < best - 1e-12:
                if reqs and reqs[-1] == r:
                    costs[-1], tags[-1] = c, tag
                else:
                    reqs.append(r)
                    costs.append(c)
                    tags.append(tag)
                best = c
        return reqs, costs, tags


def _lookup(front, m: int) -> int:
    """Index of the cheapest point of ``front`` needing at most m bytes, or -1."""
    return bisect.bisect_right(front[0], m) - 1


# ============================================================== the DP
@dataclass
class _Solution:
    kept: set[int]
    backward_steps: list[int]
    predicted_req: int
    predicted_cost: float


class _ChainDP:
    """The recursion over sub-chains; fronts keyed by (s, t, τ, σ) and (s, kept, σ).

    τ: c_t is alive when the sub-chain starts (only if block t's backward reads it).
    σ: c_s must still be alive when the sub-chain ends (block s's backward reads it);
    with σ = 0 the base dies after its last read inside, and whoever needs it later
    recomputes it: checkpoints need not persist.
    """

    def __init__(self, model: _Model, cap: int, quantum: int, window: int,
                 progress: Progress | None = None) -> None:
        self.m = model
        self.f = _Fronts(quantum, cap)
        self.W = max(1, window)
        self.B: dict[tuple[int, int, int, int], Any] = {}
        self.FW: dict[tuple[int, int, int], Any] = {}
        self.progress = progress

    def key(self, s: int, t: int, tau: int, sigma: int) -> tuple[int, int, int, int]:
        m = self.m
        return (s, t, 1 if tau and m.lam[t] else 0, 1 if sigma and s >= 1 and m.lam[s] else 0)

    def solve(self) -> None:
        m, L, W = self.m, self.m.L, self.W
        top = min(W, L)
        for d in range(1, top + 1):
            for s in range(0, L - d + 1):
                t = s + d
                for tau in ((0, 1) if m.lam[t] else (0,)):
                    for sigma in ((0, 1) if s >= 1 and m.lam[s] else (0,)):
                        self.B[(s, t, tau, sigma)] = self._backward_front(s, t, tau, sigma)
            if self.progress is not None:
                self.progress(0.8 * d / top, f"dp: sub-chains of {d} blocks")
        for s in range(L, -1, -1):
            for kb in (0, 1):
                for sigma in ((0, 1) if s >= 1 and m.lam[s] else (0,)):
                    self.FW[(s, kb, sigma)] = self._forward_front(s, kb, sigma)

    # ------------------------------------------------------------------ B
    def _backward_front(self, s: int, t: int, tau: int, sigma: int):
        m, F, B = self.m, self.f, self.B
        out: list = []
        bg = m.bg_before(t)
        x_s = m.x[s] if s >= 1 else 0
        top = m.x[t] if tau else 0
        # A: run block s+1 keeping its x̄, then the rest, then its backward.
        j = s + 1
        base_after = m.reads_in[j] or bool(sigma)
        bw = m.bw_peak[j][m.bw_mode(j, bool(sigma))]
        if t == j:
            r0 = max(m.leaf_peak[j][tau][base_after] + bg, bw)
            F.single(r0, m.leaf_cost[j][tau], ("A",), out)
            # J: recompute each x̄ value just before its first reader instead.
            if m.xbar[j]:
                F.single(m.jit_peak[j][tau][1 if sigma else 0], m.jit_cost[j][tau], ("J",), out)
        else:
            child = B.get(self.key(j, t, tau, 1))
            if child is not None and child[0]:
                r0 = max(m.fa_peak[j][base_after] + bg + top, bw)
                e = m.xbar_extra[j] + (x_s if base_after else 0)
                F.one(r0, m.fa_cost[j], child, e, ("A",), out)
        # S_k: checkpoint c_k; it outlives B(k, t) only if we choose so (tau_k).
        if t - s >= 2:
            segs_t = m.cnt_segments[t]
            tr_cost = 0.0
            peak_first = m.tr_peak[j]
            peak_rest = 0
            for k in range(s + 1, t):
                if k > s + 1 and m.tr_peak[k][0] > peak_rest:
                    peak_rest = m.tr_peak[k][0]
                tr_cost += m.tr_cost[k]
                if segs_t == m.cnt_segments[k]:
                    break  # nothing above k runs backward: c_k would be made twice in one stage
                for tau_k in ((1, 0) if m.lam[k] else (0,)):
                    c1 = B.get(self.key(k, t, tau, tau_k))
                    c2 = B.get(self.key(s, k, tau_k, sigma))
                    if c1 is None or c2 is None or not c1[0] or not c2[0]:
                        continue
                    live_after = bool(sigma) or m.needs(s, k, tau_k)
                    r_tr = max(peak_first[live_after], peak_rest + (x_s if live_after else 0)) + bg + top
                    F.two(r_tr, tr_cost, c1, x_s if live_after else 0, c2, 0, ("S", k, tau_k), out)
        # D: block t's backward needs nothing recomputed.
        if t - s >= 2 and not m.xbar_other[t] and not m.reads_in[t] and (tau or not m.lam[t]):
            child = B.get(self.key(s, t - 1, 0, sigma))
            if child is not None and child[0]:
                live_s = bool(sigma) or m.needs(s, t - 1, 0)
                r0 = m.bw_top[t][tau] + (x_s if live_s else 0)
                F.one(r0, 0.0, child, 0, ("D",), out)
        return F.envelope(out)

    # ----------------------------------------------------------------- FW
    def _forward_front(self, s: int, kb: int, sigma: int):
        m, F, L = self.m, self.f, self.m.L
        if s == L:
            return ([0], [0.0], [("END",)])
        out: list = []
        policy, pinned = m.problem._policy, m.chain.pinned
        ba = bool(kb and s >= 1)
        x_s = m.x[s] if ba else 0
        j = s + 1
        c_j = m.chain.cut[j]
        # FA: keep block s+1's x̄ in forward (no recomputation for it).
        if (ba or not m.reads_in[j]) and not any(policy[v] == _RECOMPUTE for v in m.xbar[j]):
            bw = m.bw_peak[j][m.bw_mode(j, bool(sigma)) if ba else 0]
            r_fwd = m.fwd_fa_peak[j][ba] + m.out_before[j]
            must_keep = m.lam[j] or (j + 1 <= L and m.reads_in[j + 1])
            for kb_next in (0, 1):
                if kb_next == 0 and must_keep:
                    continue
                if kb_next == 1 and policy[c_j] == _RECOMPUTE and not pinned[c_j]:
                    continue
                child = self.FW.get((j, kb_next, 1 if m.lam[j] else 0))
                if child is None or not child[0]:
                    continue
                e = (m.xbar_extra[j] if kb_next else m.xbar_all[j]) + x_s
                F.one(max(r_fwd, bw), 0.0, child, e, ("FA", kb_next), out)
                for n_partial, part in enumerate(m.partial[j]):
                    if part.reads_base and not ba:
                        continue
                    mode = m.bw_mode(j, bool(sigma)) if ba else 0
                    if part.reads_base and mode == 0:
                        mode = 1
                    r0 = max(part.forward_peak[ba] + m.out_before[j], part.backward_peak[mode])
                    e = (part.extra_without_cut if kb_next else part.extra_with_cut) + x_s
                    F.one(r0, part.cost, child, e, ("FP", kb_next, n_partial), out)
        # TR_k / END need c_s as the base of recomputation.
        if s == 0 or kb:
            peak_rest = 0
            first = m.fwd_tr_peak[j][1 if ba else 0] + m.out_before[j]
            for k in range(j, min(L, s + self.W) + 1):
                if k > j:
                    p = m.fwd_tr_peak[k][0] + m.out_before[k] + x_s
                    if p > peak_rest:
                        peak_rest = p
                r_fwd = max(first, peak_rest)
                c_k = m.chain.cut[k]
                if not (policy[c_k] == _RECOMPUTE and not pinned[c_k]):
                    for tau_k in ((1, 0) if m.lam[k] else (0,)):
                        back = self.B.get(self.key(s, k, tau_k, sigma))
                        child = self.FW.get((k, 1, tau_k))
                        if back is not None and back[0] and child is not None and child[0]:
                            F.two(r_fwd, 0.0, child, x_s, back, 0, ("TR", k, tau_k), out)
                if k == L:
                    back = self.B.get(self.key(s, L, 0, sigma))
                    if back is not None and back[0]:
                        F.one(r_fwd, 0.0, back, 0, ("END",), out)
        return F.envelope(out)

    # ------------------------------------------------------- reconstruction
    def plan_at(self, budget_room: int) -> _Solution | None:
        top = self.FW.get((0, 0, 0))
        if top is None:
            return None
        i0 = _lookup(top, budget_room)
        if i0 < 0:
            return None
        m, B = self.m, self.B
        kept: set[int] = set()
        steps: list[int] = []
        # Explicit stack (chains can be long): ("FW", s, kb, σ, room) |
        # ("B", s, t, τ, σ, room) | ("BW", j) | ("RUN", nodes)
        tasks: list[tuple] = [("FW", 0, 0, 0, budget_room)]
        while tasks:
            task = tasks.pop()
            kind = task[0]
            if kind == "RUN":
                steps.extend(task[1])
            elif kind == "BW":
                steps.extend(m.bw_steps[task[1]])
            elif kind == "FW":
                _, s, kb, sigma, room = task
                if s == m.L:
                    continue
                front = self.FW[(s, kb, sigma)]
                i = _lookup(front, room)
                assert i >= 0, "dp reconstruction lost its front"
                tag = front[2][i]
                x_s = m.x[s] if s >= 1 and kb else 0
                if tag[0] == "FA":
                    j, kb_next = s + 1, tag[1]
                    kept.update(m.xbar[j])
                    if kb_next:
                        kept.add(m.chain.cut[j])
                    e = (m.xbar_extra[j] if kb_next else m.xbar_all[j]) + x_s
                    tasks.append(("BW", j))
                    tasks.append(("FW", j, kb_next, 1 if m.lam[j] else 0, room - e))
                elif tag[0] == "FP":
                    j, kb_next, part = s + 1, tag[1], m.partial[s + 1][tag[2]]
                    kept.update(part.kept)
                    if kb_next:
                        kept.add(m.chain.cut[j])
                    e = (part.extra_without_cut if kb_next else part.extra_with_cut) + x_s
                    tasks.append(("RUN", part.backward_steps))
                    tasks.append(("FW", j, kb_next, 1 if m.lam[j] else 0, room - e))
                elif tag[0] == "TR":
                    k, tau_k = tag[1], tag[2]
                    kept.add(m.chain.cut[k])
                    tasks.append(("B",) + self.key(s, k, tau_k, sigma) + (room,))
                    tasks.append(("FW", k, 1, tau_k, room - x_s))
                else:  # END
                    tasks.append(("B",) + self.key(s, m.L, 0, sigma) + (room,))
            else:  # "B"
                _, s, t, tau, sigma, room = task
                if t <= s:
                    continue
                front = B[(s, t, tau, sigma)]
                i = _lookup(front, room)
                assert i >= 0, "dp reconstruction lost its front"
                tag = front[2][i]
                x_s = m.x[s] if s >= 1 else 0
                if tag[0] == "J":
                    tasks.append(("RUN", m.jit_steps[s + 1][tau]))
                elif tag[0] == "A":
                    j = s + 1
                    base_after = m.reads_in[j] or bool(sigma)
                    tasks.append(("BW", j))
                    if t == j:
                        tasks.append(("RUN", m.leaf_steps[j][tau]))
                    else:
                        e = m.xbar_extra[j] + (x_s if base_after else 0)
                        tasks.append(("B",) + self.key(j, t, tau, 1) + (room - e,))
                        tasks.append(("RUN", m.fa_steps[j]))
                elif tag[0] == "S":
                    k, tau_k = tag[1], tag[2]
                    live_after = bool(sigma) or m.needs(s, k, tau_k)
                    run = [v for jj in range(s + 1, k + 1) for v in m.tr_steps[jj]]
                    tasks.append(("B",) + self.key(s, k, tau_k, sigma) + (room,))
                    tasks.append(("B",) + self.key(k, t, tau, tau_k) + (room - (x_s if live_after else 0),))
                    tasks.append(("RUN", run))
                else:  # D
                    tasks.append(("B",) + self.key(s, t - 1, 0, sigma) + (room,))
                    tasks.append(("BW", t))
        return _Solution(kept, steps, top[0][i0], top[1][i0])


# ============================================================== public entry
def _build_plan(problem: Problem, model: _Model, solution: _Solution, budget_bytes: int | None,
                info: dict[str, Any]) -> Plan:
    chain = model.chain
    output = problem._output
    kept = {v for v in solution.kept if not chain.pinned[v]}
    kept |= {v for v in problem._forward_idx if chain.pinned[v] and not output[v]}
    needed = _ancestors_or_self(problem, [*kept, *(v for v in problem._forward_idx if chain.pinned[v])])
    names = problem.nodes
    steps = [Step(names[v].name, FORWARD_PHASE) for v in chain.order if needed[v]]
    steps += [Step(names[v].name, BACKWARD_PHASE) for v in solution.backward_steps]
    return Plan(kept=frozenset(names[v].name for v in kept), schedule=tuple(steps), method="dp",
                budget_bytes=budget_bytes, info=info)


def _keep_all_candidate(problem: Problem) -> tuple[Plan, Any]:
    """Keep everything backward reads (PyTorch's default), with policies honoured."""
    mask = bytearray(len(problem.nodes))
    read = problem._read_by_backward
    for v in problem._forward_idx:
        if read[v]:
            mask[v] = 1
    if any(problem._policy):
        mask = honour_policies_mask(problem, mask)
    core = evaluate_mask(problem, mask)
    return Plan(kept=names_of(problem, mask), method="dp"), core


def _choose_resolution(room_cap: int, n_blocks: int, exact: bool, max_slots: int) -> tuple[int, int]:
    quantum = 1 if (exact and room_cap <= EXACT_BYTES) else max(1, -(-room_cap // max_slots))
    window = n_blocks if n_blocks <= 40 else max(6, int(math.sqrt(WORK_PAIRS / n_blocks)))
    return quantum, min(window, max(1, n_blocks))


def dp(
    problem: Problem,
    budget_bytes: int,
    *,
    progress: Progress | None = None,
    time_limit: float | None = None,
    max_slots: int = MAX_SLOTS,
    max_blocks: int = MAX_BLOCKS,
    window: int | None = None,
    exact: bool = True,
) -> Plan:
    """Cheapest schedule of the chain-of-blocks family that fits ``budget_bytes``.

    Problem: minimise the recomputation cost of an explicit schedule whose
    simulated peak is at most ``budget_bytes`` (see the module docstring for
    the family of schedules and the recursion, after Beaumont et al. 2019).

    Parameters
    ----------
    problem : Problem
    budget_bytes : int
        Peak budget, resident bytes and ``baseline_bytes`` included.
    progress : callable(fraction, message) or None
    time_limit : float or None
        Accepted for a uniform signature; the DP's run time is bounded by its
        resolution (``max_slots``, ``max_blocks``, ``window``) instead.
    max_slots : int
        Memory levels used when the budget is too large to solve byte-exactly.
    max_blocks : int
        Chains with more blocks are coarsened to this many.
    window : int or None
        Longest sub-chain (in blocks) the recursion considers; default: all of
        them for chains of up to 40 blocks, else ~sqrt(12,000 / blocks).
    exact : bool
        Solve byte-exactly when the budget is small (<= 4 KiB above resident).

    Returns
    -------
    Plan
        With an explicit schedule; ``info`` has predicted_peak_bytes,
        recompute_cost (both from simulate), solve_seconds, blocks, window,
        quantum_bytes and candidate ("dp" or "keep_all").

    Raises
    ------
    InfeasibleBudgetError
        If no schedule of the family fits; ``min_feasible_bytes`` is the
        simulated peak of the lowest-memory schedule the DP builds.

    Complexity: O(n + edges + L·W²·P) for L blocks, window W, fronts of P <= max_slots points.

    Examples
    --------
    >>> p = Problem.training_chain(10)
    >>> plan = dp(p, 5)
    >>> plan.info["predicted_peak_bytes"] <= 5, plan.schedule is not None
    (True, True)
    """
    started = time.perf_counter()
    keep_all, keep_all_core = _keep_all_candidate(problem)
    if keep_all_core.peak_bytes <= budget_bytes and keep_all_core.recompute_cost == 0:
        # Nothing recomputed: no schedule can be cheaper.
        return _finish(problem, keep_all, budget_bytes, started, {"candidate": "keep_all"})

    best: tuple[float, int, Plan] | None = None
    if keep_all_core.peak_bytes <= budget_bytes:
        best = (keep_all_core.recompute_cost, keep_all_core.peak_bytes, keep_all)
    details: dict[str, Any] = {}
    lowest: tuple[int, Plan] = (keep_all_core.peak_bytes, keep_all)
    variants = _chain_variants(problem, max_blocks)
    for n_variant, (chain, float_once) in enumerate(variants):
        model = _Model(problem, chain, float_once)
        found = _solve_chain(problem, model, budget_bytes, exact, max_slots, window,
                             progress if n_variant == 0 else None)
        if found is None:
            peak, plan = _lowest_peak(problem, model, model.L, max_slots, lowest)
            if peak < lowest[0]:
                lowest = (peak, plan)
            if peak <= budget_bytes:
                found = (simulate(problem, plan).recompute_cost, peak, plan, {})
        if found is not None and (best is None or found[0] < best[0] - 1e-12):
            best = found[:3]
            details = {**found[3], "blocks": model.L, "variant": n_variant}
    if best is None:
        peak = lowest[0]
        raise InfeasibleBudgetError(
            budget_bytes,
            peak,
            f"dp: budget {format_bytes(budget_bytes)} ({budget_bytes} bytes) is below the smallest "
            f"feasible budget {format_bytes(peak)} ({peak} bytes) that the chain-of-blocks "
            f"dynamic program reaches for this graph",
        )
    plan = best[2]
    details["candidate"] = "keep_all" if plan is keep_all else "dp"
    if progress is not None:
        progress(1.0, "dp: done")
    return _finish(problem, plan, budget_bytes, started, details)


def _chain_variants(problem: Problem, max_blocks: int) -> list[tuple[BlockChain, bool]]:
    """(chain of blocks, float_once) variants for the values only backward reads.

    As they are: floating ones recomputed in every segment reading them, the
    others merging the blocks between their readers; all kept from forward on;
    and the others kept while floating ones are recomputed once and kept.
    """
    chain = chain_of_blocks(problem, max_blocks=max_blocks)
    _, _, _, ordered = _pinned_and_relevant(problem)
    shared = [v for v in problem._forward_idx if chain.relevant[v] and not ordered[v]
              and problem._read_by_backward[v]]
    if not shared:
        return [(chain, False)]
    variants = [(chain, False), (chain_of_blocks(problem, max_blocks=max_blocks, extra_pins=shared), False)]
    if any(chain.floating[v] for v in shared):
        grounded = [v for v in shared if not chain.floating[v]]
        variants.append((chain_of_blocks(problem, max_blocks=max_blocks, extra_pins=grounded), True))
    return variants


def _solve_chain(problem: Problem, model: _Model, budget_bytes: int, exact: bool, max_slots: int,
                 window: int | None, progress: Progress | None) -> tuple[float, int, Plan, dict] | None:
    """Best DP plan on one chain of blocks that simulate() confirms, or None."""
    resident = problem.resident_bytes
    L = model.L
    cap = budget_bytes - resident
    if cap < 0 or L < 1:
        return None
    for attempt in range(_RETRIES):
        quantum, W = _choose_resolution(max(cap, 1), L, exact, max_slots)
        if window is not None:
            W = max(1, min(window, L))
        solver = _ChainDP(model, cap, quantum, W, progress)
        solver.solve()
        solution = solver.plan_at(cap)
        if solution is None:
            return None
        plan = _build_plan(problem, model, solution, budget_bytes, {})
        result = simulate(problem, plan)
        if result.peak_bytes <= budget_bytes:
            return (result.recompute_cost, result.peak_bytes, plan,
                    {"window": W, "quantum_bytes": quantum, "attempts": attempt + 1})
        # The block model under-counted (e.g. aliases shared with the backward
        # phase): ask the DP for the excess less.
        log.debug("dp: model predicted %d bytes, simulate() says %d; retrying tighter",
                  solution.predicted_req + resident, result.peak_bytes)
        cap -= max(result.peak_bytes - budget_bytes, quantum)
        if cap < 0:
            return None
    return None


def _lowest_peak(problem: Problem, model: _Model, L: int, max_slots: int,
                 keep_all: tuple[int, Plan]) -> tuple[int, Plan]:
    """(peak, plan) of the lowest-memory schedule dp knows: keep-all or the DP's minimum-memory plan."""
    best = keep_all
    if L < 1:
        return best
    cap = max(keep_all[0] - problem.resident_bytes, 1)
    quantum, W = _choose_resolution(cap, L, True, max_slots)
    solver = _ChainDP(model, cap, quantum, W)
    solver.solve()
    top = solver.FW.get((0, 0, 0))
    if top and top[0]:
        solution = solver.plan_at(top[0][0])
        if solution is not None:
            plan = _build_plan(problem, model, solution, None, {})
            peak = simulate(problem, plan).peak_bytes
            if peak < best[0]:
                best = (peak, plan)
    return best


def _finish(problem: Problem, plan: Plan, budget_bytes: int, started: float, details: dict[str, Any]) -> Plan:
    if plan.schedule is None:  # keep-all: spell its derived schedule out
        plan = Plan(kept=plan.kept, schedule=schedule(problem, plan), method="dp")
    result = simulate(problem, plan)
    info = {
        **details,
        "predicted_peak_bytes": result.peak_bytes,
        "recompute_cost": result.recompute_cost,
        "solve_seconds": time.perf_counter() - started,
    }
    log.info("dp: peak %s (%d bytes) within %s, recompute cost %g, %.3f s", format_bytes(result.peak_bytes),
             result.peak_bytes, format_bytes(budget_bytes), result.recompute_cost, info["solve_seconds"])
    return Plan(kept=plan.kept, schedule=plan.schedule, method="dp", budget_bytes=budget_bytes, info=info)
