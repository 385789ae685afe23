"""Nested recomputation across blocks: rotor's checkpoint-and-continue on the block chain, with option menus.

Problem. The chain DP of :mod:`solvers.hierarchical` keeps every block's inputs
from forward to backward, so its plans can never go below what per-block
checkpointing pays for them.  Rotor (Beaumont et al., "Optimal checkpointing
for heterogeneous chains", ACM TOMS 2021; Rockmate's ``rk_rotor``) also lets a
block's input be dropped and recomputed during backward from an earlier kept
one, recursively.

Model (per block ``k`` of the chain, from the priced :class:`~solvers.hierarchical.Menu`):
option ``o`` keeps ``K[k][o]`` bytes (its kept set and its crossing outputs), needs
``N[k][o]`` bytes above what is held before it and recomputes ``C[k][o]`` in its
backward; running the block forward costs ``F[k]`` and needs ``P[k]`` (its least
need over options, an upper bound on its forward-only need); the values made in
blocks ``a..j-1`` that blocks ``>= j`` read hold ``X[a][j]`` bytes.  With ``u``
bytes held, the segment ``a..b`` (whose input is held, and whose forward must be
run) costs

* ``F[a] + C[a][o] + opt(a+1, b, u + K[a][o])`` -- run block ``a`` with option
  ``o``, keep what it keeps, do the rest, then its backward; allowed when
  ``u + N[a][o]`` fits;
* ``F[a..j-1] + opt(j, b, u + X[a][j]) + opt(a, j-1, u)`` -- run ``a..j-1``
  forward keeping only what crosses ``j`` (checkpoint and continue), do
  ``j..b``, then recompute ``a..j-1`` from the held input; allowed when
  ``u + X[a][k] + P[k]`` fits for every ``k`` in ``a..j-1``.

The least total over ``opt(0, L-1, 0)`` minus ``sum(F)`` (the first forward is
not a recomputation) is the optimum of this model; always taking the first
choice is the non-nested chain DP, so the nested space contains it.  Memory is
discretized in ``units`` rounded up, vectorized over ``u`` with numpy:
O(L^2 (L + options)) array operations of ``units`` entries.

:func:`nested_schedule` turns the DP's decisions into an explicit schedule
(:class:`~solvers.Plan` with ``schedule``, values may be recomputed several
times), which :func:`solvers.simulate` judges like every plan.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import numpy as np

from solvers.plan import Step
from solvers.problem import FORWARD_CODE, INPUT_CODE, RECOMPUTE_CODE, SAVE_CODE

__all__ = ["ChainModel", "nested_dp", "NestedTables", "decisions", "nested_cost", "chain_model", "nested_schedule"]

log = logging.getLogger("solvers.nested")

NESTED_UNITS = 1024
# Above this many blocks the O(L^3) table is not built (seconds in numpy).
MAX_NESTED_BLOCKS = 96


@dataclass(frozen=True)
class ChainModel:
    """Rotor's chain with option menus, in bytes (see the module docstring)."""

    kept: list[np.ndarray]  # K[k][o]
    need: list[np.ndarray]  # N[k][o]
    cost: list[np.ndarray]  # C[k][o]
    forward_cost: np.ndarray  # F[k]
    forward_need: np.ndarray  # P[k]
    crossing: np.ndarray  # X[a][j], shape (L + 1, L + 1)


@dataclass(frozen=True)
class NestedTables:
    """``opt[(a, b)][u]`` and its decision ``how[(a, b)][u]`` (``o >= 0``: option; ``-j``: continue at j)."""

    opt: dict[tuple[int, int], np.ndarray]
    how: dict[tuple[int, int], np.ndarray]
    quantum: int
    model: ChainModel
    capacity: int

    @property
    def nbytes(self) -> int:
        """Bytes of its arrays (what a problem's memo holds for it: :data:`solvers.problem.SHARED_CACHES_BYTES`)."""
        return sum(a.nbytes for a in self.opt.values()) + sum(a.nbytes for a in self.how.values())

    def start(self, budget_bytes: int | None) -> int:
        """The held units that leave ``budget_bytes`` (rounded down) of the table's capacity free.

        Every constraint reads ``u + ... <= capacity``, so ``opt[(a, b)][u]`` is the answer for a
        budget of ``capacity - u`` units: one table serves every smaller budget at its quantum.
        """
        if budget_bytes is None:
            return 0
        return self.capacity - min(self.capacity, budget_bytes // self.quantum)


def nested_dp(model: ChainModel, budget_bytes: int, units: int = NESTED_UNITS) -> NestedTables:
    """The checkpoint-and-continue DP over the chain, exact for :class:`ChainModel` at ``quantum`` bytes.

    Each candidate updates only the prefix of held units it allows, in place (no
    temporary full-size arrays): O(L^2 (L + options)) numpy calls on ``units`` entries.
    Ties go to the first candidate (options before continue points, then smaller ``j``).
    """
    quantum = max(1, -(-budget_bytes // units))
    cap = budget_bytes // quantum
    size = cap + 1
    n = len(model.kept)
    up = lambda x: -(-np.asarray(x, dtype=np.int64) // quantum)  # noqa: E731
    K = [up(k).tolist() for k in model.kept]
    N = [up(k).tolist() for k in model.need]
    P = up(model.forward_need).tolist()
    X = up(model.crossing).tolist()
    F = np.asarray(model.forward_cost, dtype=np.float64)
    prefix_f = np.concatenate([[0.0], np.cumsum(F)])
    zeros = np.zeros(size)
    opt: dict[tuple[int, int], np.ndarray] = {}
    how: dict[tuple[int, int], np.ndarray] = {}
    cand = np.empty(size)
    better = np.empty(size, dtype=bool)

    def offer(best: np.ndarray, arg: np.ndarray, top: int, code: int) -> None:
        """Take ``cand[:top + 1]`` where it is strictly better than ``best``."""
        c, w = cand[: top + 1], better[: top + 1]
        np.less(c, best[: top + 1], out=w)
        np.copyto(best[: top + 1], c, where=w)
        np.copyto(arg[: top + 1], code, where=w)

    for length in range(1, n + 1):
        for a in range(0, n - length + 1):
            b = a + length - 1
            best = np.full(size, np.inf)
            arg = np.full(size, n + 1, dtype=np.int32)
            rest = opt[(a + 1, b)] if a < b else zeros
            for o, (k, need) in enumerate(zip(K[a], N[a], strict=True)):
                top = cap - max(k, need)
                if top < 0:
                    continue
                np.add(F[a] + model.cost[a][o], rest[k : k + top + 1], out=cand[: top + 1])
                offer(best, arg, top, o)
            fwd_peak = 0  # max over k in a..j-1 of X[a][k] + P[k]
            for j in range(a + 1, b + 1):
                fwd_peak = max(fwd_peak, X[a][j - 1] + P[j - 1])
                x = X[a][j]
                top = cap - max(fwd_peak, x)
                if top < 0:
                    continue
                c = cand[: top + 1]
                np.add(prefix_f[j] - prefix_f[a], opt[(j, b)][x : x + top + 1], out=c)
                np.add(c, opt[(a, j - 1)][: top + 1], out=c)
                offer(best, arg, top, -j)
            opt[(a, b)], how[(a, b)] = best, arg
    return NestedTables(opt, how, quantum, model, cap)


def decisions(tables: NestedTables, budget_bytes: int | None = None) -> list[tuple[int, int, int]] | None:
    """The optimum's decisions as ``(a, b, how)`` in recursion order, or None when nothing fits.

    ``how >= 0``: block ``a`` runs with option ``how``; ``how < 0``: continue at block ``-how``.
    ``budget_bytes`` (at most the table's) reads a smaller budget off the same table.
    """
    n = len(tables.model.kept)
    if n == 0:
        return []
    u0 = tables.start(budget_bytes)
    if not np.isfinite(tables.opt[(0, n - 1)][u0]):
        return None
    K = [-(-np.asarray(k, dtype=np.int64) // tables.quantum) for k in tables.model.kept]
    X = -(-np.asarray(tables.model.crossing, dtype=np.int64) // tables.quantum)
    out: list[tuple[int, int, int]] = []
    stack = [(0, n - 1, u0)]
    while stack:
        a, b, u = stack.pop()
        if a > b:
            continue
        h = int(tables.how[(a, b)][u])
        out.append((a, b, h))
        if h >= 0:
            stack.append((a + 1, b, u + int(K[a][h])))
        else:
            j = -h
            # Recursion order: j..b first (it runs first), then a..j-1.
            stack.append((a, j - 1, u))
            stack.append((j, b, u + int(X[a][j])))
    return out


def nested_cost(tables: NestedTables, budget_bytes: int | None = None) -> float:
    """The model's recompute cost of the optimum (inf when nothing fits)."""
    n = len(tables.model.kept)
    u0 = tables.start(budget_bytes)
    return float(tables.opt[(0, n - 1)][u0] - np.sum(tables.model.forward_cost)) if n else 0.0


# ------------------------------------------------------------ from a problem
def backward_blocks(problem, chain) -> list[int]:
    """Per backward node (problem order), the block whose backward it belongs to (as ``_price`` assigns)."""
    block_of, fwd_preds = chain.block_of, problem._fwd_preds
    current = len(chain.blocks) - 1
    out = []
    for v in problem._backward_idx:
        b = max((block_of[u] for u in fwd_preds[v]), default=-1)
        if 0 <= b < current:
            current = b
        out.append(current)
    return out


def _crossing_spans(problem, chain, bwd_block: list[int]) -> list[tuple[int, int, int]]:
    """(value, producing block, last block reading it) for the values that cross blocks."""
    block_of = chain.block_of
    where = {v: bwd_block[i] for i, v in enumerate(problem._backward_idx)}
    spans = []
    for v in chain.fixed:
        p = block_of[v]
        if p < 0:
            continue
        last = p
        for c in problem._consumers[v]:
            r = block_of[c] if block_of[c] >= 0 else where.get(c, -1)
            last = max(last, r)
        if last > p:
            spans.append((v, p, last))
    return spans


def chain_model(problem, menu) -> ChainModel:
    """The :class:`ChainModel` of a priced menu."""
    chain = menu.chain
    n = len(chain.blocks)
    nbytes, root, kind, cost = problem._bytes, problem._alias_root, problem._kind, problem._cost
    forward_cost = np.array([sum(cost[v] for v in b.nodes if kind[v] == FORWARD_CODE) for b in chain.blocks])
    forward_need = np.array([int(np.min(menu.need_bytes[k])) for k in range(n)], dtype=np.int64)
    crossing = np.zeros((n + 1, n + 1), dtype=np.int64)
    for v, p, last in _crossing_spans(problem, chain, backward_blocks(problem, chain)):
        r = root[v]
        if kind[r] == INPUT_CODE:
            continue
        # Made in a..j-1 (a <= p < j) and read at or after j (j <= last).
        crossing[: p + 1, p + 1 : last + 1] += nbytes[r]
    return ChainModel(
        list(menu.kept_bytes), list(menu.need_bytes), list(menu.cost), forward_cost, forward_need, crossing
    )


def nested_schedule(problem, menu, steps: list[tuple[int, int, int]]) -> tuple[frozenset[str], tuple[Step, ...]]:
    """The explicit schedule of the DP's decisions: (kept names, steps).

    Forward phase: what the top-level decisions keep, as the derived schedule
    computes it.  Backward phase, per segment: recompute the forward values it
    holds from the held input (in backward, unless the forward phase made them),
    do the later segment, then the block's backward, materializing what it reads
    depth first (as the derived schedule does).  Values a segment does not hold
    are never read again, so the simulator frees them after their last use.
    """
    chain = menu.chain
    n = len(chain.blocks)
    block_of, fwd_preds, output, kind = chain.block_of, problem._fwd_preds, problem._output, problem._kind
    fixed = chain.fixed
    bwd_block = backward_blocks(problem, chain)
    runs: list[list[int]] = [[] for _ in range(n)]
    loose: list[tuple[int, int]] = []  # backward nodes before any block's run (none in practice)
    for i, v in enumerate(problem._backward_idx):
        if bwd_block[i] >= 0:
            runs[bwd_block[i]].append(v)
        else:
            loose.append((i, v))
    spans = {v: (p, last) for v, p, last in _crossing_spans(problem, chain, bwd_block)}
    policy = problem._policy
    # Always kept: data, crossing values no later block reads, and values whose policy is "save"
    # (random states); values whose policy is "recompute" are never kept, only recomputed.
    data = {v for v in fixed if v not in spans} | {v for v in problem._forward_idx if policy[v] == SAVE_CODE}
    own_fixed = [[] for _ in range(n)]
    for v in fixed:
        if block_of[v] >= 0:
            own_fixed[block_of[v]].append(v)

    def holds_of(a: int, b: int, h: int) -> set[int]:
        if h >= 0:
            return set(menu.kept[a][h]) | set(own_fixed[a])
        j = -h
        return {v for v, (p, last) in spans.items() if a <= p < j <= last}

    # Top level: which segments are made by the forward phase.
    top: set[tuple[int, int]] = set()
    a, b = 0, n - 1
    by_segment = {(s_a, s_b): h for s_a, s_b, h in steps}
    while a <= b:
        top.add((a, b))
        h = by_segment[(a, b)]
        a = a + 1 if h >= 0 else -h
    kept_idx: set[int] = set(data)
    for s_a, s_b, h in steps:
        if (s_a, s_b) in top:
            kept_idx |= holds_of(s_a, s_b, h)
    kept_idx = {v for v in kept_idx if policy[v] != RECOMPUTE_CODE}
    mask = bytearray(len(problem.nodes))
    for v in kept_idx:
        mask[v] = 1
    from solvers.simulator import derived_schedule, step_table

    nodes, n_fwd = derived_schedule(problem, mask)
    forward_step, backward_step = step_table(problem)
    out: list[Step] = [forward_step[v] for v in nodes[:n_fwd]]
    live = bytearray(len(problem.nodes))
    for v in problem._forward_idx:
        if mask[v] or output[v]:
            live[v] = 1
    names = problem.nodes

    def materialize(target: int) -> None:
        stack = [(target, 0)]
        while stack:
            v, k = stack[-1]
            preds = fwd_preds[v]
            while k < len(preds) and (live[preds[k]] or kind[preds[k]] == INPUT_CODE):
                k += 1
            if k < len(preds):
                stack[-1] = (v, k + 1)
                stack.append((preds[k], 0))
            else:
                stack.pop()
                if not live[v]:
                    live[v] = 1
                    out.append(backward_step[v])

    def drop(blocks: range, keep: set[int]) -> None:
        for k in blocks:
            for v in chain.blocks[k].nodes:
                if live[v] and v not in keep and v not in data and not output[v]:
                    live[v] = 0

    def run(a: int, b: int) -> None:
        if a > b:
            return
        h = by_segment[(a, b)]
        holds = holds_of(a, b, h)
        if (a, b) not in top:
            for v in sorted(holds):
                if not live[v]:
                    materialize(v)
            drop(range(a, a + 1 if h >= 0 else -h), holds)
        if h >= 0:
            run(a + 1, b)
            for v in runs[a]:
                for p in fwd_preds[v]:
                    if not live[p] and kind[p] != INPUT_CODE:
                        materialize(p)
                out.append(backward_step[v])
            drop(range(a, a + 1), set())
        else:
            j = -h
            run(j, b)
            drop(range(j, j), set())
            run(a, j - 1)

    run(0, n - 1)
    for _, v in loose:  # backward nodes no block claims run last, reading what they need
        for p in fwd_preds[v]:
            if not live[p] and kind[p] != INPUT_CODE:
                materialize(p)
        out.append(backward_step[v])
    kept = frozenset(names[v].name for v in kept_idx)
    return kept, tuple(out)
