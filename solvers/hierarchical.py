"""The hierarchical solver: an option menu per block, an exact DP across the chain.

Problem. Keep the forward values that make a training step fit a byte budget
at the least recomputation, on graphs of thousands of nodes, in seconds, and
never do worse than the plans users already know (keep everything, per-block
checkpointing, selective recomputation).

Method (Rockmate's split; Zhao et al., ICML 2023, on rotor's chain DP,
Beaumont et al., ACM TOMS 2021):

1. :func:`solvers.blocks.find_blocks` cuts the forward graph into a chain of
   blocks whose crossing values are always kept, and groups identical blocks.
2. :func:`block_options` builds a menu per block class: keep everything the
   block's backward reads; keep only its inputs (per-block checkpointing);
   selective (keep the expensive ops' outputs, recompute pointwise ones);
   cheap-recompute (the fewest bytes with no expensive op recomputed, what
   PyTorch's min-cut partitioner aims at); and MILP options (least recompute
   under a kept-bytes cap, swept over several caps; pulp with HiGHS).
3. :func:`price_menu` prices every option of every block exactly: plans that
   apply one option to all blocks at once go through the simulator, and each
   block's kept bytes, memory need above what earlier blocks keep, and
   recompute cost are read off the simulated timeline.  Options no better
   than another in all three are dropped.
4. :func:`chain_dp` picks one option per block: the least total recompute such
   that, at every block, the bytes kept by earlier blocks plus the block's own
   need fit the budget.  Memory is discretized in about
   :data:`MEMORY_UNITS` units, rounded up; the DP returns its tables and
   :func:`choices_from_tables` reads the choice off them.
5. :func:`hierarchical` assembles the plan, re-simulates it on the whole graph,
   tightens the DP's budget by any excess and solves again (a few rounds), and
   returns the cheapest fitting plan among it and the uniform plans (keep all,
   per-block...), which are therefore never beaten.

Every option is a kept set, so these plans are derived-schedule plans: the
rewriter recomputes each block just before its backward.  6. Nested
recomputation (:mod:`solvers.nested`, rotor's checkpoint-and-continue) also
drops block inputs and recomputes them from an earlier held one; its explicit
schedules are candidates judged by the same simulator, in :func:`hierarchical`
and in the floor's bisection.  It runs on two chains (:func:`nested_menus`):
the blocks, and the blocks also cut inside at values that carry everything
after them (a pre-norm transformer layer's residual stream between attention
and MLP), where it holds only a layer's input through its MLP's backward and
recomputes the attention afterwards: a leaner backward inside a block.

Complexity: one MILP per class and cap (small: one block), one simulation
per option index, and a DP in O(blocks x options x units) numpy operations.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Callable

import numpy as np

from solvers.blocks import BlockChain, find_blocks
from solvers.errors import InfeasibleBudgetError, format_bytes
from solvers.graph import keep_all_mask
from solvers.plan import Plan, SolveInfo
from solvers.problem import FORWARD_CODE, INPUT_CODE, RECOMPUTE_CODE, SAVE_CODE, Problem
from solvers.simulator import evaluate_mask, evaluate_mask_schedule, honour_policies_mask, names_of

__all__ = [
    "hierarchical",
    "lowest_peak_plan",
    "block_options",
    "price_menu",
    "chain_dp",
    "choices_from_tables",
    "Menu",
    "MEMORY_UNITS",
    "per_block_plan",
]

log = logging.getLogger("solvers.hierarchical")

Progress = Callable[[float, str], None]

MEMORY_UNITS = 4096
# An op is expensive to recompute when it costs more than this many cost units
# per byte it writes: matmuls and convolutions cost hundreds, pointwise ops
# (priced by elements touched) about one.
EXPENSIVE_COST_PER_BYTE = 4.0
# Kept-bytes caps of the MILP options, as fractions of the keep-everything bytes.
MILP_LEVELS = (0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9)
# The MILP options stop after this much deterministic work (HiGHS checkpoints,
# one thread), never at a wall-clock limit: the menu, so the plan, must be the
# same at any machine load.  Most block MILPs are solved to optimality well
# within it.  The seconds are a safety only: an option cut by them is dropped.
MILP_WORK_LIMIT = 200
MILP_SAFETY_SECONDS = 60.0
_CORRECTION_ROUNDS = 6
# Blocks with at most this many candidate values get every kept set as an option.
_ENUMERATE_UP_TO = 5


# ------------------------------------------------------------------ the menu
@dataclass(frozen=True)
class Menu:
    """Every block's options with what each costs, priced by exact simulation.

    Attributes:
        chain: the blocks.
        names: per block, the option names.
        kept: per block, the kept set of each option (problem indices).
        kept_bytes: per block, bytes each option keeps through the forward phase.
        need_bytes: per block, each option's peak minus what earlier blocks keep.
        cost: per block, each option's recompute cost.
        uniform: plans applying one option index to every block, with their
            simulated (peak, cost): exact candidates for free.
    """

    chain: BlockChain
    names: list[tuple[str, ...]]
    kept: list[tuple[frozenset[int], ...]] = field(repr=False)
    kept_bytes: list[np.ndarray] = field(repr=False)
    need_bytes: list[np.ndarray] = field(repr=False)
    cost: list[np.ndarray] = field(repr=False)
    uniform: list[tuple[str, bytearray, int, float]] = field(repr=False)

    def __repr__(self) -> str:
        sizes = [len(n) for n in self.names]
        return f"Menu({len(self.names)} blocks, {min(sizes, default=0)}-{max(sizes, default=0)} options per block)"


def block_options(
    problem: Problem, chain: BlockChain, *, work_limit: int = MILP_WORK_LIMIT, levels: tuple[float, ...] = MILP_LEVELS
) -> list[list[tuple[str, tuple[int, ...]]]]:
    """Candidate kept sets per block class, as positions in the class's node list.

    Returns, per class, ``(option name, kept positions)`` pairs without
    duplicates. The MILP options need pulp; without it the menu has the
    rule-based options only.
    """
    menus = []
    keep_all_values = keep_all_mask(problem)
    for members in chain.classes:
        block = chain.blocks[members[0]]
        nodes = block.nodes
        key = (_class_signature(problem, nodes, chain.fixed, keep_all_values), work_limit, levels)
        if key in _SOLVED_CLASSES:
            _SOLVED_CLASSES.move_to_end(key)
            menus.append(_SOLVED_CLASSES[key])
            continue
        local = {v: k for k, v in enumerate(nodes)}
        found: dict[frozenset[int], str] = {}

        def add(name: str, kept: set[int], local=local, found=found) -> None:
            found.setdefault(frozenset(local[v] for v in kept), name)

        keep_all = _block_keep_all(problem, nodes, chain.fixed)
        add("keep_all", keep_all)
        add("input_only", set())
        add("selective", _selective(problem, nodes, chain.fixed))
        milp = _BlockMilp(problem, nodes, chain.fixed)
        choices = [v for v in milp.nodes if problem._policy[v] != RECOMPUTE_CODE and problem._kind[v] == FORWARD_CODE]
        if len(choices) <= _ENUMERATE_UP_TO:
            # A tiny block: every kept set is an option (the exact menu).
            for bits in range(1 << len(choices)):
                add(f"subset_{bits}", {v for k, v in enumerate(choices) if bits >> k & 1})
        else:
            cheap = milp.solve(cheap_only=True, work_limit=work_limit)
            if cheap is not None:
                add("cheap_recompute", cheap)
            total = milp.bytes_of(keep_all)
            for level in levels:
                kept = milp.solve(max_kept_bytes=int(level * total), work_limit=work_limit)
                if kept is not None:
                    add(f"milp_{int(level * 100)}", kept)
        menus.append([(name, tuple(sorted(kept))) for kept, name in found.items()])
        _SOLVED_CLASSES[key] = menus[-1]
        if len(_SOLVED_CLASSES) > _SOLVED_CLASSES_KEPT:
            _SOLVED_CLASSES.popitem(last=False)
    return menus


# Block classes whose options were found, by everything the options depend on: the same block
# in another problem (the graph planned again under another baseline, a capture then its
# optimize, a budget sweep) is not solved again.  Bounded; the options are deterministic.
_SOLVED_CLASSES: OrderedDict[tuple, list[tuple[str, tuple[int, ...]]]] = OrderedDict()
_SOLVED_CLASSES_KEPT = 256


def forget_solved_classes() -> None:
    """Forget the block classes solved so far in this process (a cold start, for benchmarks)."""
    _SOLVED_CLASSES.clear()


def _class_signature(problem: Problem, nodes: tuple[int, ...], fixed: frozenset[int], keep_all: bytearray) -> tuple:
    """What :func:`block_options` reads of a block: each node's bytes, cost, policy, kind, whether it is
    an output, fixed, read by backward or kept by keep-everything, its storage and its inputs, as
    positions in the block (-1: outside it).  Equal signatures give equal options."""
    local = {v: k for k, v in enumerate(nodes)}
    p = problem
    rows = []
    for v in nodes:
        r = p._alias_root[v]
        rows.append(
            (
                p._bytes[v],
                p._cost[v],
                p._policy[v],
                p._kind[v],
                p._output[v],
                p._read_by_backward[v],
                keep_all[v],
                v in fixed,
                local.get(r, -1),
                p._kind[r],
                p._bytes[r],
                tuple(local.get(u, -1) for u in p._fwd_preds[v]),
            )
        )
    return tuple(rows)


def price_menu(problem: Problem, chain: BlockChain, options: list[list[tuple[str, tuple[int, ...]]]]) -> Menu:
    """Price every block's options by simulating plans that apply one option index everywhere."""
    n_blocks = len(chain.blocks)
    width = max((len(o) for o in options), default=1)
    names: list[list[str]] = [[] for _ in range(n_blocks)]
    kept_sets: list[list[frozenset[int]]] = [[] for _ in range(n_blocks)]
    rows: list[list[tuple[int, int, float]]] = [[] for _ in range(n_blocks)]
    uniform = []
    for i in range(width):
        mask = bytearray(len(problem.nodes))
        for v in chain.fixed:
            mask[v] = 1
        chosen = []
        for block in chain.blocks:
            menu = options[block.klass]
            name, positions = menu[min(i, len(menu) - 1)]
            kept = frozenset(block.nodes[p] for p in positions)
            chosen.append((name, kept))
            for v in kept:
                mask[v] = 1
        mask = honour_policies_mask(problem, mask) if any(problem._policy) else mask
        per_block, peak, cost = _price(problem, chain, mask)
        largest = max(range(len(chain.classes)), key=lambda k: len(chain.classes[k]), default=None)
        label = chosen[chain.classes[largest][0]][0] if largest is not None else "none"
        uniform.append((f"every block {label}", mask, peak, cost))
        for b, (name, kept) in enumerate(chosen):
            if kept in kept_sets[b]:
                continue
            names[b].append(name)
            kept_sets[b].append(kept)
            rows[b].append(per_block[b])
    # Keeping everything (no fixed values) is a candidate too: it may keep less
    # than every block's keep_all, which also keeps crossing values backward never reads.
    keep_all = keep_all_mask(problem)
    core = evaluate_mask(problem, keep_all)
    uniform.append(("keep everything", keep_all, core.peak_bytes, core.recompute_cost))
    own = keep_all_mask(problem, own_checkpoints=True)
    if own != keep_all:  # what the model's own torch.utils.checkpoint does: never do worse
        core = evaluate_mask(problem, own)
        uniform.append(("the model's own checkpointing", own, core.peak_bytes, core.recompute_cost))
    kept_bytes, need, costs, final_names, final_kept = [], [], [], [], []
    for b in range(n_blocks):
        keep = _pareto([r for r in rows[b]])
        kept_bytes.append(np.array([rows[b][j][0] for j in keep], dtype=np.int64))
        need.append(np.array([rows[b][j][1] for j in keep], dtype=np.int64))
        costs.append(np.array([rows[b][j][2] for j in keep], dtype=np.float64))
        final_names.append(tuple(names[b][j] for j in keep))
        final_kept.append(tuple(kept_sets[b][j] for j in keep))
    return Menu(chain, final_names, final_kept, kept_bytes, need, costs, uniform)


def _pareto(rows: list[tuple[int, int, float]]) -> list[int]:
    """Indices of rows not dominated in (kept bytes, need, cost), first of equals kept."""
    keep = []
    for j, r in enumerate(rows):
        dominated = any(
            k != j and all(a <= b for a, b in zip(rows[k], r, strict=True)) and (rows[k] != r or k < j)
            for k in range(len(rows))
        )
        if not dominated:
            keep.append(j)
    return keep


def _price(problem: Problem, chain: BlockChain, mask: bytearray) -> tuple[list[tuple[int, int, float]], int, float]:
    """(kept bytes, need, recompute cost) of each block under ``mask``, and the plan's peak and cost."""
    nodes, n_fwd, core = evaluate_mask_schedule(problem, mask)
    n_blocks = len(chain.blocks)
    if not n_blocks:  # no cut point: the menu is the uniform plans alone
        return [], core.peak_bytes, core.recompute_cost
    timeline = core.timeline
    block_of = chain.block_of
    nbytes, root, kind = problem._bytes, problem._alias_root, problem._kind

    kept_bytes = [0] * n_blocks
    seen: set[int] = set()
    for v in problem._forward_idx:
        b = block_of[v]
        if b < 0 or not mask[v]:
            continue
        r = root[v]
        if kind[r] == INPUT_CODE or r in seen:
            continue
        seen.add(r)
        kept_bytes[b] += nbytes[r]
    before = [0] * n_blocks
    for b in range(1, n_blocks):
        before[b] = before[b - 1] + kept_bytes[b - 1]

    need = [-(1 << 62)] * n_blocks
    cost = [0.0] * n_blocks
    current = 0
    for i in range(n_fwd):
        b = block_of[nodes[i]]
        if b > current:
            current = b
        need[current] = max(need[current], timeline[i] - before[current])
    current = n_blocks - 1
    fwd_preds, costs = problem._fwd_preds, problem._cost
    for i in range(n_fwd, len(nodes)):
        v = nodes[i]
        if kind[v] == FORWARD_CODE:
            b = block_of[v]
        else:
            b = max((block_of[u] for u in fwd_preds[v]), default=-1)
        if 0 <= b < current:
            current = b
        need[current] = max(need[current], timeline[i] - before[current])
        if kind[v] == FORWARD_CODE:
            cost[current] += costs[v]
    rows = [(kept_bytes[b], need[b] if need[b] > -(1 << 61) else 0, cost[b]) for b in range(n_blocks)]
    return rows, core.peak_bytes, core.recompute_cost


# ---------------------------------------------------------------- options
def _block_keep_all(problem: Problem, nodes: tuple[int, ...], fixed: frozenset[int]) -> set[int]:
    mask = keep_all_mask(problem)
    return {v for v in nodes if mask[v] and v not in fixed}


def _expensive(problem: Problem, v: int) -> bool:
    return problem._cost[v] > EXPENSIVE_COST_PER_BYTE * max(problem._bytes[v], 1)


def _selective(problem: Problem, nodes: tuple[int, ...], fixed: frozenset[int]) -> set[int]:
    """Keep expensive ops' outputs that backward or a recomputation reads (Megatron's selective)."""
    inside = set(nodes)
    needed = _block_keep_all(problem, nodes, fixed)
    kept = {v for v in needed if _expensive(problem, v)}
    # Walk back from each cheap value backward needs to the expensive values it is recomputed from.
    stack = [v for v in needed if v not in kept]
    seen = set(stack)
    while stack:
        v = stack.pop()
        for u in problem._fwd_preds[v]:
            if u in inside and u not in fixed and u not in seen:
                seen.add(u)
                if _expensive(problem, u):
                    kept.add(u)
                else:
                    stack.append(u)
    return kept


class _BlockMilp:
    """Keep/recompute MILP of one block, in the derived-schedule space.

    Variables: ``keep[v]`` (kept through forward), ``rec[v]`` (recomputed in
    backward), ``store[r]`` (storage r is pinned by a kept value). Backward
    reads need ``keep + rec >= 1``; a recomputation needs each input kept or
    recomputed; values outside the block, fixed values and outputs are always
    there. Built once per block class and re-solved per objective and cap.
    """

    def __init__(self, problem: Problem, nodes: tuple[int, ...], fixed: frozenset[int]) -> None:
        self.problem = problem
        inside = set(nodes)
        output, policy = problem._output, problem._policy
        self.free = {v for v in nodes if v in fixed or output[v]}
        self.nodes = [v for v in nodes if v not in self.free]
        self.inside = inside
        self.storage = {}
        root, nbytes, kind = problem._alias_root, problem._bytes, problem._kind
        for v in self.nodes:
            r = root[v]
            if (
                policy[v] != RECOMPUTE_CODE
                and kind[r] != INPUT_CODE
                and r in inside
                and r not in self.free
                and nbytes[r]
            ):
                self.storage[v] = r

    def bytes_of(self, kept: set[int]) -> int:
        nbytes = self.problem._bytes
        return sum(nbytes[r] for r in {self.storage[v] for v in kept if v in self.storage})

    def solve(
        self, *, cheap_only: bool = False, max_kept_bytes: int | None = None, work_limit: int = MILP_WORK_LIMIT
    ) -> set[int] | None:
        import pulp

        from solvers.milp import make_milp_solver

        p = self.problem
        policy, read, cost, nbytes = p._policy, p._read_by_backward, p._cost, p._bytes
        model = pulp.LpProblem("block", pulp.LpMinimize)
        # pulp 3 attaches variables to the model (and deprecates bare LpVariable).
        add = getattr(model, "add_variable", None)

        def binary(name: str):
            return add(name, cat="Binary") if add is not None else pulp.LpVariable(name, cat="Binary")

        keep, rec = {}, {}
        for v in self.nodes:
            if policy[v] != RECOMPUTE_CODE:
                keep[v] = binary(f"k{v}")
            if policy[v] != SAVE_CODE and not (cheap_only and _expensive(p, v)):
                rec[v] = binary(f"r{v}")
        store = {r: binary(f"s{r}") for r in set(self.storage.values())}
        for v, r in self.storage.items():
            if v in keep:
                model += store[r] >= keep[v]
        zero = 0
        for v in self.nodes:
            if read[v]:
                if v not in keep and v not in rec:
                    return None  # policies forbid both: no plan of this kind
                model += keep.get(v, zero) + rec.get(v, zero) >= 1
        for v, r_v in rec.items():
            for u in p._fwd_preds[v]:
                if u in self.inside and u not in self.free:
                    model += keep.get(u, zero) + rec.get(u, zero) >= r_v
        total_bytes = sum(nbytes[r] for r in store) or 1
        total_cost = sum(cost[v] for v in rec) or 1.0
        kept_bytes = pulp.lpSum((nbytes[r] / total_bytes) * s for r, s in store.items())
        recompute = pulp.lpSum((cost[v] / total_cost) * x for v, x in rec.items())
        if cheap_only:
            model += kept_bytes + 1e-4 * recompute
        else:
            model += recompute + 1e-4 * kept_bytes
        if max_kept_bytes is not None:
            model += pulp.lpSum(nbytes[r] * s for r, s in store.items()) <= max_kept_bytes
        started = time.perf_counter()
        model.solve(make_milp_solver(MILP_SAFETY_SECONDS, None, 1, 1e-4, work_limit))
        if pulp.LpStatus[model.status] != "Optimal" and model.sol_status not in (1, 2):
            return None
        if time.perf_counter() - started >= 0.95 * MILP_SAFETY_SECONDS:
            log.warning(
                "hierarchical: a block MILP option was still solving after its %g s safety limit "
                "(a very slow or overloaded machine); it is dropped so that planning stays deterministic",
                MILP_SAFETY_SECONDS,
            )
            return None
        return {v for v, x in keep.items() if (x.value() or 0) > 0.5}


# --------------------------------------------------------------------- DP
@dataclass(frozen=True)
class DPTables:
    """The chain DP's tables.

    ``opt[k][u]``: least recompute cost of blocks ``< k`` whose kept bytes
    total ``u`` memory units (inf: unreachable); ``what[k][u]``: the option
    block ``k - 1`` took to reach that state. ``quantum``: bytes per unit.
    """

    opt: list[np.ndarray]
    what: list[np.ndarray]
    quantum: int
    kept_units: list[np.ndarray]


def chain_dp(menu: Menu, budget_bytes: int, units: int = MEMORY_UNITS) -> DPTables:
    """Least-cost option per block such that, at each block k, kept(<k) + need_k(option) <= budget.

    Sizes are rounded up to ``quantum = ceil(budget / units)`` bytes, so every
    state the DP accepts fits the budget under the block model.  Exact for that
    model; O(blocks x options x units).
    """
    quantum = max(1, -(-budget_bytes // units))
    capacity = budget_bytes // quantum
    opt = [np.full(capacity + 1, np.inf)]
    opt[0][0] = 0.0
    what: list[np.ndarray] = [np.zeros(0, dtype=np.int16)]
    kept_units = []
    for b in range(len(menu.names)):
        current = opt[-1]
        new = np.full(capacity + 1, np.inf)
        choice = np.full(capacity + 1, -1, dtype=np.int16)
        ku = -(-menu.kept_bytes[b] // quantum)
        nu = -(-menu.need_bytes[b] // quantum)
        kept_units.append(ku)
        for o in range(len(ku)):
            # Prefix u must leave room for the block's need, and the new prefix must fit.
            top = min(capacity - int(nu[o]), capacity - int(ku[o]))
            if top < 0:
                continue
            candidate = current[: top + 1] + menu.cost[b][o]
            target = new[int(ku[o]) : int(ku[o]) + top + 1]
            better = candidate < target
            target[better] = candidate[better]
            choice[int(ku[o]) : int(ku[o]) + top + 1][better] = o
        opt.append(new)
        what.append(choice)
    return DPTables(opt, what, quantum, kept_units)


def choices_from_tables(tables: DPTables) -> list[int] | None:
    """The option of each block in the DP's optimum, or None when no state is reachable."""
    final = tables.opt[-1]
    if not np.isfinite(final).any():
        return None
    u = int(np.argmin(final))
    choices = []
    for b in range(len(tables.opt) - 1, 0, -1):
        o = int(tables.what[b][u])
        choices.append(o)
        u -= int(tables.kept_units[b - 1][o])
    return choices[::-1]


# ------------------------------------------------------------------ solver
def build_menu(problem: Problem, *, progress: Progress | None = None) -> Menu:
    """Blocks, options and prices of ``problem``; cached on it (budget-independent)."""
    cached = problem._cache.get("hierarchical.menu")
    if cached is not None:
        return cached
    started = time.perf_counter()
    chain = find_blocks(problem)
    if progress is not None:
        progress(0.1, f"hierarchical: {len(chain.blocks)} blocks in {len(chain.classes)} classes")
    options = block_options(problem, chain)
    if progress is not None:
        progress(0.6, "hierarchical: pricing options")
    menu = price_menu(problem, chain, options)
    log.info("hierarchical: %r, %r built in %.2f s", chain, menu, time.perf_counter() - started)
    problem._cache["hierarchical.menu"] = menu
    return menu


def nested_menus(problem: Problem) -> tuple[Menu, ...]:
    """The menus nested recomputation plans on: the blocks' menu, and when some block has a cut
    inside (``find_blocks(inside=True)``) and the finer chain is short enough for the nested DP,
    that chain's menu too, on which a block's first part is freed while its second part's backward
    runs (a lean backward inside a block).  Neither space contains the other: both are searched.
    Cached."""
    from solvers.nested import MAX_NESTED_BLOCKS

    cached = problem._cache.get("hierarchical.nested_menus")
    if cached is not None:
        return cached
    menus = (build_menu(problem),)
    chain = find_blocks(problem, inside=True)
    if len(chain.blocks) != len(menus[0].chain.blocks) and len(chain.blocks) <= MAX_NESTED_BLOCKS:
        started = time.perf_counter()
        inside = price_menu(problem, chain, block_options(problem, chain))
        seconds = time.perf_counter() - started
        log.info("hierarchical: blocks cut inside: %r, %r built in %.2f s", chain, inside, seconds)
        menus += (inside,)
    problem._cache["hierarchical.nested_menus"] = menus
    return menus


def _assemble(problem: Problem, menu: Menu, choices: list[int]) -> bytearray:
    mask = bytearray(len(problem.nodes))
    for v in menu.chain.fixed:
        mask[v] = 1
    for b, o in enumerate(choices):
        for v in menu.kept[b][o]:
            mask[v] = 1
    return honour_policies_mask(problem, mask) if any(problem._policy) else mask


def _solve_mask(problem: Problem, menu: Menu, budget_bytes: int) -> tuple[bytearray, int, float] | None:
    """DP, simulate, tighten by the excess; the best fitting (mask, peak, cost) found."""
    target = budget_bytes
    best = None
    for _ in range(_CORRECTION_ROUNDS):
        if target <= 0:
            break
        choices = choices_from_tables(chain_dp(menu, target))
        if choices is None:
            break
        mask = _assemble(problem, menu, choices)
        core = evaluate_mask(problem, mask)
        if core.peak_bytes <= budget_bytes:
            if best is None or core.recompute_cost < best[2]:
                best = (mask, core.peak_bytes, core.recompute_cost)
            break
        target -= core.peak_bytes - budget_bytes + max(1, target // MEMORY_UNITS)
    for _, mask, peak, cost in menu.uniform:
        if peak <= budget_bytes and (best is None or cost < best[2]):
            best = (mask, peak, cost)
    return best


def _nested_tables(problem: Problem, menu: Menu, budget_bytes: int):
    """The nested DP's tables for budgets up to ``budget_bytes`` (None where it does not apply); cached.

    One table answers every budget from its own down to half of it (at a quantum at most
    twice as coarse); the tables built for a problem are kept, so planning it again under
    another budget in that range builds none.
    """
    from solvers.nested import MAX_NESTED_BLOCKS, chain_model, nested_dp

    n = len(menu.chain.blocks)
    if n < 2 or n > MAX_NESTED_BLOCKS:
        return None
    # (the menus of nested_menus have chains of different lengths)
    built = problem._cache.setdefault(("hierarchical.nested", n), [])
    # (a budget rounds down to whole units: the one a table was built for reads its last unit)
    fitting = [
        t for t in built if t.capacity >= budget_bytes // t.quantum and budget_bytes >= t.capacity * t.quantum // 2
    ]
    if fitting:
        return min(fitting, key=lambda t: t.quantum)
    model = built[0].model if built else chain_model(problem, menu)
    tables = nested_dp(model, budget_bytes)
    built.append(tables)
    return tables


def _solve_nested(
    problem: Problem, menu: Menu, budget_bytes: int, tables=None
) -> tuple[frozenset[str], tuple, int, float] | None:
    """The nested (checkpoint-and-continue) DP's plan, simulated, tightened by any excess; None if none fits.

    Only plans that recompute some block input are returned: the others are the plain DP's space.
    """
    from solvers.nested import decisions

    tables = tables if tables is not None else _nested_tables(problem, menu, budget_bytes)
    if tables is None:
        return None
    target = budget_bytes
    for _ in range(_CORRECTION_ROUNDS):
        if target <= 0:
            return None
        steps = decisions(tables, target)
        if steps is None or all(h >= 0 for _, _, h in steps):
            return None
        kept, schedule, peak, cost = _nested_plan(problem, menu, steps)
        if peak <= budget_bytes:
            return kept, schedule, peak, cost
        target -= peak - budget_bytes + max(tables.quantum, target // 1024)
    return None


_NESTED_PLANS_KEPT = 32


def _nested_plan(
    problem: Problem, menu: Menu, steps: list[tuple[int, int, int]]
) -> tuple[frozenset[str], tuple, int, float]:
    """The DP's decisions as a simulated plan (kept, schedule, peak, cost); cached on the problem: the
    floor's bisection and later budgets read the same decisions off the tables again and again."""
    from solvers.nested import nested_schedule
    from solvers.simulator import simulate

    cache = problem._cache.setdefault("hierarchical.nested_plans", OrderedDict())
    key = (len(menu.chain.blocks), *steps)
    if key in cache:
        cache.move_to_end(key)
        return cache[key]
    kept, schedule = nested_schedule(problem, menu, steps)
    result = simulate(problem, Plan(kept=kept, schedule=schedule))
    cache[key] = (kept, schedule, result.peak_bytes, result.recompute_cost)
    if len(cache) > _NESTED_PLANS_KEPT:
        cache.popitem(last=False)
    return cache[key]


def hierarchical(
    problem: Problem, budget_bytes: int, *, time_limit: float = 60.0, progress: Progress | None = None, **_: object
) -> Plan:
    """The cheapest plan of the block-option space that fits ``budget_bytes``.

    Never worse than keeping everything or per-block checkpointing (both are
    plans of the space and candidates). Raises InfeasibleBudgetError with the
    lowest peak of the space when nothing fits. ``time_limit`` is accepted for
    the common signature and does not change the plan: the MILP options stop at
    deterministic work limits (:data:`MILP_WORK_LIMIT`).

    Example:
        >>> from solvers import Problem, simulate
        >>> p = Problem.training_chain(12)
        >>> plan = hierarchical(p, 10)
        >>> simulate(p, plan).peak_bytes <= 10
        True
    """
    started = time.perf_counter()
    menu = build_menu(problem, progress=progress)
    found = _solve_mask(problem, menu, budget_bytes)
    nested = min(
        (plan for inner in nested_menus(problem) if (plan := _solve_nested(problem, inner, budget_bytes))),
        key=lambda plan: plan[3],
        default=None,
    )
    if nested is not None and nested[2] < lowest_peak_plan(problem).info.predicted_peak_bytes:
        # The floor is one promise (every method's errors and ckptc's reports read it): a plan
        # below it found by this budget's search is not offered, so the floor stays exact.
        nested = None
    if progress is not None:
        progress(1.0, "hierarchical: done")
    details = {"blocks": len(menu.chain.blocks), "block_classes": len(menu.chain.classes)}
    if nested is not None and (found is None or nested[3] < found[2]):
        kept, schedule, peak, cost = nested
        log.info("hierarchical: nested recomputation, peak %s, recompute cost %.4g", format_bytes(peak), cost)
        return Plan(
            kept=kept,
            schedule=schedule,
            method="hierarchical",
            budget_bytes=budget_bytes,
            info=SolveInfo(
                predicted_peak_bytes=peak,
                recompute_cost=cost,
                candidate="nested",
                details=details,
            ),
        )
    if found is None:
        lowest = lowest_peak_plan(problem)
        floor = lowest.info.predicted_peak_bytes
        if floor > budget_bytes:
            raise InfeasibleBudgetError(budget_bytes, floor)
        return dataclasses.replace(lowest, budget_bytes=budget_bytes)
    kept = names_of(problem, found[0])
    _, peak, cost = found
    log.info(
        "hierarchical: peak %s within %s, recompute cost %.4g (%.2f s)",
        format_bytes(peak),
        format_bytes(budget_bytes),
        cost,
        time.perf_counter() - started,
    )
    return Plan(
        kept=kept,
        method="hierarchical",
        budget_bytes=budget_bytes,
        info=SolveInfo(
            predicted_peak_bytes=peak,
            recompute_cost=cost,
            details=details,
        ),
    )


def lowest_peak_plan(problem: Problem) -> Plan:
    """The lowest-peak plan of the block-option space (bisection over the DP's budget)."""
    cached = problem._cache.get("hierarchical.lowest")
    if cached is not None:
        return cached
    menu = build_menu(problem)
    best = min(((peak, cost, mask) for _, mask, peak, cost in menu.uniform), key=lambda t: t[:2])
    lo, hi = problem.resident_bytes, best[0]
    for _ in range(24):
        if hi - lo <= max(1, hi // 2048):
            break
        mid = (lo + hi) // 2
        found = _solve_mask(problem, menu, mid)
        if found is not None:
            mask, peak, cost = found
            if (peak, cost) < best[:2]:
                best = (peak, cost, mask)
            hi = min(mid, peak)
        else:
            lo = mid + 1
    kept, schedule = names_of(problem, best[2]), None
    # Nested recomputation reaches below: bisect again with its DP, one table for every budget.
    inners = nested_menus(problem)
    tables = [_nested_tables(problem, inner, best[0]) for inner in inners]  # at the floor without nesting
    for inner, table in zip(inners, tables, strict=True):
        if table is None:
            continue
        lo, hi = problem.resident_bytes, best[0]
        for _ in range(24):
            if hi - lo <= max(1, hi // 2048):
                break
            mid = (lo + hi) // 2
            nested = _solve_nested(problem, inner, mid, table)
            if nested is not None:
                if (nested[2], nested[3]) < best[:2]:
                    best = (nested[2], nested[3], None)
                    kept, schedule = nested[0], nested[1]
                hi = min(mid, nested[2])
            else:
                lo = mid + 1
    plan = Plan(
        kept=kept,
        schedule=schedule,
        method="hierarchical",
        info=SolveInfo(predicted_peak_bytes=best[0], recompute_cost=best[1], candidate="nested" if schedule else None),
    )
    problem._cache["hierarchical.lowest"] = plan
    # Every budget worth planning lies between the floor and keeping everything: one more table,
    # built now with the floor's, answers the upper half of that range for every later plan.
    top = next(peak for name, _, peak, _ in menu.uniform if name == "keep everything")
    for inner, table in zip(inners, tables, strict=True):
        if table is not None and top > best[0]:
            _nested_tables(problem, inner, top)
    return plan


def per_block_plan(problem: Problem) -> Plan:
    """Per-block checkpointing: keep only what crosses blocks (each block's inputs), recompute the rest.

    What ``torch.utils.checkpoint`` around every block (Hugging Face's
    ``gradient_checkpointing_enable``) keeps, on the blocks of
    :func:`solvers.blocks.find_blocks`.
    """
    chain = find_blocks(problem)
    mask = bytearray(len(problem.nodes))
    for v in chain.fixed:
        mask[v] = 1
    mask = honour_policies_mask(problem, mask) if any(problem._policy) else mask
    return Plan(kept=names_of(problem, mask), method="per_block")
