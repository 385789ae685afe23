"""The one judge: execution order and memory of a plan.

:func:`schedule` turns a :class:`~solvers.Plan` into the exact list of steps
the rewriter in ``ckptc/`` emits, and :func:`simulate` replays that list and
counts live bytes after every allocation. Every solver's answer is checked
here, so this module is the product's prediction of real memory: it is kept
exact and simple rather than clever.

Memory model (see the package contract for the full text)
-----------------------------------------------------------
* Inputs and ``baseline_bytes`` are resident at every point.
* A step allocates its node's bytes as a new *instance* of that value; the
  peak is sampled right after the allocation, then every instance whose last
  use was this step is freed.
* A step reads the most recent instance of each pred. An instance dies after
  the last step that reads it, except: ``output`` nodes never die; a kept
  node's forward instance lives at least to the end of the forward phase; a
  forward instance of a non-kept node cannot be read in backward (it must be
  recomputed first).
* An alias instance pins the storage of the alias-root instance it was made
  from; a storage is counted while any instance referencing it is alive.
* A getitem (``part_of``) takes its bytes over from the multi-output
  instance it reads (net zero at its step); the multi-output storage frees
  what is left when it dies, the getitem's storage lives at least as long.
* A node's ``scratch`` bytes count at its own step only.

Both functions run in O((len(schedule) + edges) log len(schedule)) time: the
replay is a few array passes (numpy, imported on first use, so ``import
solvers`` stays light), the same rules as above, one vectorized step each.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any, Iterable

from solvers.errors import InvalidPlanError
from solvers.plan import BACKWARD_PHASE, FORWARD_PHASE, Plan, Step
from solvers.problem import (
    ABSORBED_CODE,
    BACKWARD_CODE,
    FORWARD_CODE,
    INPUT_CODE,
    POINTWISE_CODE,
    RECOMPUTE_CODE,
    REDUCTION_CODE,
    SAVE_CODE,
    Problem,
)

__all__ = ["SimResult", "schedule", "simulate", "honour_policies"]

log = logging.getLogger("solvers.simulator")

#: How many results :func:`simulate` remembers per problem (a plan is judged by the solver that made
#: it, by :func:`solvers.solve` and by the caller; the floor and keep-everything plans on every call).
RECENT_RESULTS = 8


@dataclass(frozen=True)
class SimResult:
    """What :func:`simulate` measured.

    Attributes
    ----------
    peak_bytes : int
        Maximum of ``timeline`` (resident bytes if the schedule is empty).
    peak_step : int
        Index into ``steps`` of the first step reaching the peak (-1 if empty).
    recompute_cost : float
        Sum of the costs of forward nodes executed in the backward phase.
    forward_cost : float
        Sum of the costs of the forward-phase steps.
    timeline : tuple of int
        Live bytes right after each step's allocation (resident included).
    steps : tuple of Step
        The schedule that was simulated.
    forward_peak_bytes : int
        Maximum of the timeline over the forward phase.
    kept_bytes : int
        Bytes of the storages held by kept values at the end of forward.
    recompute_steps : int
        Number of recomputations (forward nodes in the backward phase).
    """

    peak_bytes: int
    peak_step: int
    recompute_cost: float
    forward_cost: float
    timeline: tuple[int, ...] = field(repr=False)
    steps: tuple[Step, ...] = field(repr=False)
    forward_peak_bytes: int = 0
    kept_bytes: int = 0
    recompute_steps: int = 0

    @property
    def peak_node(self) -> str | None:
        """Name of the node executed at the peak step."""
        return self.steps[self.peak_step].node if self.peak_step >= 0 else None


# --------------------------------------------------------------------------- public
def schedule(problem: Problem, plan: Plan) -> tuple[Step, ...]:
    """The execution order of ``plan``: its explicit schedule, or the derived one.

    Derived schedule (``plan.schedule is None``):

    * forward phase: in problem order, every forward node that is an
      ancestor-or-self, through forward nodes, of an ``output`` forward node
      or of a kept node;
    * backward phase: for each backward node b in order, for each forward pred
      p of b not materialised, recompute p after recursively (depth first,
      preds in order) recomputing its own missing forward preds; then b.
      A recomputed multi-output node is followed at once by its getitems
      (``part_of`` it): it holds all its results until its last getitem runs.
      Materialised means kept, ``output``, or already recomputed in this
      backward phase, so each value is recomputed at most once.

    An explicit schedule is validated exactly as :func:`simulate` does.

    Raises
    ------
    InvalidPlanError
        If the plan or its schedule breaks a rule of the memory model.

    Examples
    --------
    >>> p = Problem.training_chain(3)
    >>> [tuple(s) for s in schedule(p, Plan(kept={"f1"}))]  # doctest: +NORMALIZE_WHITESPACE
    [('f1', 'forward'), ('f2', 'forward'), ('f3', 'forward'), ('f2', 'backward'),
     ('b3', 'backward'), ('b2', 'backward'), ('b1', 'backward')]
    """
    nodes, n_fwd, kept = _resolve(problem, plan)
    _run(problem, nodes, n_fwd, kept)  # validates; results unused
    if plan.schedule is not None:
        return plan.schedule
    return _to_steps(problem, nodes, n_fwd)


def simulate(problem: Problem, plan: Plan) -> SimResult:
    """Replay ``schedule(problem, plan)`` and measure its memory and compute.

    Complexity: O((len(schedule) + edges) log len(schedule)) time, O(len(schedule) + edges) memory.

    Raises
    ------
    InvalidPlanError
        Naming the step and the missing value or broken rule, if the schedule
        reads a value that is not alive, computes a backward node twice or
        never, computes a forward node twice in forward, keeps a node that is
        not a forward node computed in forward, skips an output forward node,
        or breaks a node's policy.

    Examples
    --------
    >>> p = Problem.training_chain(3)   # f1, f2, f3 (loss) of 1 byte each
    >>> simulate(p, Plan(kept={"f1", "f2"})).peak_bytes
    4
    """
    recent = problem._cache.setdefault("simulator.recent", {})
    key = (id(plan.kept), id(plan.schedule))
    hit = recent.pop(key, None)
    if hit is not None:
        recent[key] = hit  # most recently used last
        return hit[2]
    nodes, n_fwd, kept = _resolve(problem, plan)
    core = _run(problem, nodes, n_fwd, kept)
    log.debug(
        "simulate: %d steps (%d forward), peak %d bytes at step %d, recompute cost %g",
        len(nodes),
        n_fwd,
        core.peak_bytes,
        core.peak_step,
        core.recompute_cost,
    )
    steps = plan.schedule if plan.schedule is not None else _to_steps(problem, nodes, n_fwd)
    result = SimResult(
        peak_bytes=core.peak_bytes,
        peak_step=core.peak_step,
        recompute_cost=core.recompute_cost,
        forward_cost=core.forward_cost,
        timeline=tuple(core.timeline),
        steps=steps,
        forward_peak_bytes=core.forward_peak_bytes,
        kept_bytes=core.kept_bytes,
        recompute_steps=core.recompute_steps,
    )
    # The entry holds the kept set and schedule themselves, so their ids cannot be reused while it lives.
    recent[key] = (plan.kept, plan.schedule, result)
    while len(recent) > RECENT_RESULTS:
        del recent[next(iter(recent))]
    return result


def honour_policies(problem: Problem, kept: Iterable[str]) -> frozenset[str]:
    """Adjust a kept set so that its derived schedule respects node policies.

    Removes ``"recompute"`` nodes, adds ``"save"`` nodes that a backward node
    reads, and adds the ``"save"`` nodes the derived schedule would otherwise
    recompute (adding kept nodes only shrinks the set of recomputations, so
    one extra pass settles it). O(nodes + edges).
    """
    mask = _kept_mask(problem, kept)
    return _names(problem, honour_policies_mask(problem, mask))


# ------------------------------------------------------------- package internals
# Solver modules use these index-based variants to avoid building Step objects
# and name sets in their inner loops.


def honour_policies_mask(problem: Problem, mask: bytearray) -> bytearray:
    """Index-based :func:`honour_policies`; returns a new mask."""
    policy = problem._policy
    mask = bytearray(mask)
    read_by_backward = problem._read_by_backward
    for v in problem._forward_idx:
        if policy[v] == RECOMPUTE_CODE:
            mask[v] = 0
        elif policy[v] == SAVE_CODE and read_by_backward[v]:
            mask[v] = 1
    if SAVE_CODE not in policy:
        return mask  # no value must be kept: no derived schedule to look at
    for _ in range(3):
        nodes, n_fwd = derived_schedule(problem, mask)
        recomputed_saves = [v for v in nodes[n_fwd:] if policy[v] == SAVE_CODE]
        if not recomputed_saves:
            break
        for v in recomputed_saves:
            mask[v] = 1
    return mask


def evaluate_mask(problem: Problem, mask: bytearray, *, check: bool = True) -> "_Core":
    """Simulate the derived schedule of a kept mask (bytearray over node positions).

    ``check=False`` skips the structural checks, for a mask already adjusted by
    :func:`honour_policies_mask` (a derived schedule breaks no other rule).
    """
    return evaluate_mask_schedule(problem, mask, check=check)[2]


def evaluate_mask_schedule(problem: Problem, mask: bytearray, *, check: bool = True) -> tuple[list[int], int, "_Core"]:
    """:func:`evaluate_mask` with the derived schedule it simulated: (node indices, forward steps, result)."""
    nodes, n_fwd = derived_schedule(problem, mask)
    return nodes, n_fwd, _run(problem, nodes, n_fwd, mask, check=check)


def mask_of(problem: Problem, kept: Iterable[str]) -> bytearray:
    """Kept names -> mask over node positions (validated)."""
    return _kept_mask(problem, kept)


def names_of(problem: Problem, mask: bytearray) -> frozenset[str]:
    """Mask over node positions -> frozenset of names."""
    return _names(problem, mask)


@dataclass
class _Core:
    peak_bytes: int
    peak_step: int
    recompute_cost: float
    forward_cost: float
    timeline: list[int]
    forward_peak_bytes: int
    kept_bytes: int
    recompute_steps: int


def _names(problem: Problem, mask: bytearray) -> frozenset[str]:
    nodes = problem.nodes
    return frozenset(nodes[i].name for i, flag in enumerate(mask) if flag)


def _kept_mask(problem: Problem, kept: Iterable[str]) -> bytearray:
    mask = bytearray(len(problem.nodes))
    index, kind = problem.index, problem._kind
    for name in kept:
        i = index.get(name)
        if i is None:
            raise InvalidPlanError(f"kept names {name!r}, which is not a node of the problem")
        if kind[i] != FORWARD_CODE:
            raise InvalidPlanError(
                f"kept names {name!r}, a {problem.nodes[i].kind} node; only forward nodes can be kept"
            )
        mask[i] = 1
    return mask


def _resolve(problem: Problem, plan: Plan) -> tuple[list[int], int, bytearray]:
    """Plan -> (node index per step, number of forward-phase steps, kept mask)."""
    kept = _kept_mask(problem, plan.kept)
    if plan.schedule is None:
        nodes, n_fwd = derived_schedule(problem, kept)
        return nodes, n_fwd, kept
    index = problem.index
    nodes: list[int] = []
    n_fwd = 0
    in_backward = False
    for i, step in enumerate(plan.schedule):
        j = index.get(step.node)
        if j is None:
            raise InvalidPlanError(f"step {i} ({step.node!r}, {step.phase}): unknown node")
        if step.phase == FORWARD_PHASE:
            if in_backward:
                raise InvalidPlanError(
                    f"step {i} ({step.node!r}, forward) comes after a backward-phase step; "
                    "all forward-phase steps must precede the backward phase"
                )
            n_fwd += 1
        elif step.phase == BACKWARD_PHASE:
            in_backward = True
        else:
            raise InvalidPlanError(f"step {i} ({step.node!r}, {step.phase!r}): phase must be 'forward' or 'backward'")
        nodes.append(j)
    return nodes, n_fwd, kept


def derived_schedule(problem: Problem, kept: bytearray) -> tuple[list[int], int]:
    """Derived schedule of a kept mask as (node indices, number of forward steps)."""
    output, fwd_preds = problem._output, problem._fwd_preds
    forward_idx = problem._forward_idx

    # Forward phase: ancestors-or-self of kept and output forward nodes. The ancestors
    # of the outputs are needed by every plan: swept once per problem (preds come
    # earlier in the order, so one reverse sweep propagates the marks); a plan adds the
    # ancestors of the kept values outside them (values only backward reads), depth first.
    always = problem._cache.get("simulator.output_ancestors")
    if always is None:
        import numpy as np

        needed = bytearray(len(problem.nodes))
        for v in reversed(forward_idx):
            if needed[v] or output[v]:
                needed[v] = 1
                for q in fwd_preds[v]:
                    needed[q] = 1
        is_forward = np.frombuffer(problem._kind, dtype=np.uint8) == FORWARD_CODE
        always = problem._cache["simulator.output_ancestors"] = (
            needed,
            [v for v in forward_idx if needed[v]],
            is_forward & (np.frombuffer(needed, dtype=np.uint8) == 0),  # forward nodes outside them
            np.frombuffer(problem._output, dtype=np.uint8).astype(bool) & is_forward,
        )
    import numpy as np

    kept_array = np.frombuffer(kept, dtype=np.uint8).astype(bool)
    outside = np.flatnonzero(kept_array & always[2])
    nodes = list(always[1])
    if len(outside):
        needed = bytearray(always[0])
        stack = outside.tolist()
        while stack:
            v = stack.pop()
            if not needed[v]:
                needed[v] = 1
                nodes.append(v)
                stack.extend(fwd_preds[v])
        nodes.sort()
    n_fwd = len(nodes)

    # Backward phase: materialise missing forward preds depth first. Iterative,
    # because a chain with nothing kept recurses as deep as the chain is long.
    # Materialised values stay so, so a backward step whose forward reads all are at
    # the start needs nothing: only the others are walked in Python.
    reads = problem._cache.get("simulator.backward_reads")
    if reads is None:
        backward_idx = problem._backward_idx
        reads = problem._cache["simulator.backward_reads"] = (
            np.fromiter((p for b in backward_idx for p in fwd_preds[b]), dtype=np.int64),
            np.repeat(np.arange(len(backward_idx)), [len(fwd_preds[b]) for b in backward_idx]),
        )
    at_start = kept_array | always[3]  # kept or a forward output
    materialised = bytearray(at_start.view(np.uint8))
    backward = problem._backward_idx
    parts = _parts(problem)
    done = 0
    for position in np.unique(reads[1][~at_start[reads[0]]]).tolist():
        nodes.extend(backward[done:position])
        done = position + 1
        b = backward[position]
        for p in fwd_preds[b]:
            if materialised[p]:
                continue
            stack = [(p, 0)]
            while stack:
                v, k = stack[-1]
                preds = fwd_preds[v]
                while k < len(preds) and materialised[preds[k]]:
                    k += 1
                if k < len(preds):
                    stack[-1] = (v, k + 1)
                    stack.append((preds[k], 0))
                else:
                    stack.pop()
                    if materialised[v]:
                        continue  # a getitem taken with its multi-output value while it waited here
                    materialised[v] = 1
                    nodes.append(v)
                    # A multi-output value's results are taken from it at once: it holds every one of
                    # them (its largest too) until its last getitem runs, which a part read only at
                    # the end of backward would otherwise put off.
                    stack.extend((q, 0) for q in reversed(parts.get(v, ())) if not materialised[q])
        nodes.append(b)
    nodes.extend(backward[done:])
    return nodes, n_fwd


def _parts(problem: Problem) -> dict[int, tuple[int, ...]]:
    """Each multi-output forward node's getitems (``part_of`` it), by node index."""
    parts = problem._cache.get("simulator.parts")
    if parts is None:
        found: dict[int, list[int]] = {}
        for i, whole in enumerate(problem._part_of):
            if whole >= 0 and problem._kind[i] == FORWARD_CODE:
                found.setdefault(whole, []).append(i)
        parts = problem._cache["simulator.parts"] = {v: tuple(q) for v, q in found.items()}
    return parts


def step_table(problem: Problem) -> tuple[list[Step], list[Step]]:
    """One :class:`Step` per node and phase (forward, backward), by node index: shared by every
    schedule of the problem instead of built step by step."""
    steps = problem._cache.get("simulator.steps")
    if steps is None:
        names = [node.name for node in problem.nodes]
        steps = problem._cache["simulator.steps"] = (
            [Step(name, FORWARD_PHASE) for name in names],
            [Step(name, BACKWARD_PHASE) for name in names],
        )
    return steps


def _to_steps(problem: Problem, nodes: list[int], n_fwd: int) -> tuple[Step, ...]:
    forward, backward = step_table(problem)
    return tuple(map(forward.__getitem__, nodes[:n_fwd])) + tuple(map(backward.__getitem__, nodes[n_fwd:]))


def _step_label(problem: Problem, nodes: list[int], n_fwd: int, i: int) -> str:
    phase = FORWARD_PHASE if i < n_fwd else BACKWARD_PHASE
    return f"step {i} ({problem.nodes[nodes[i]].name!r}, {phase})"


def _check_structure(problem: Problem, nodes: list[int], n_fwd: int, kept: bytearray) -> None:
    """The rules that do not depend on liveness: who may run where, and how often."""
    if _structure_holds(problem, nodes, n_fwd, kept):
        return
    # Something is broken: walk the steps to name the first broken rule.
    kind, policy, output = problem._kind, problem._policy, problem._output
    names = problem.nodes
    in_forward = bytearray(len(names))
    in_backward = bytearray(len(names))
    for i, v in enumerate(nodes):
        k = kind[v]
        problem_text = None
        if k == INPUT_CODE:
            problem_text = "computes an input node; inputs are resident and never computed"
        elif i < n_fwd:
            if k == BACKWARD_CODE:
                problem_text = "computes a backward node in the forward phase"
            elif in_forward[v]:
                problem_text = f"computes {names[v].name!r} a second time in the forward phase"
            in_forward[v] = 1
        elif k == BACKWARD_CODE:
            if in_backward[v]:
                problem_text = f"computes backward node {names[v].name!r} a second time"
            in_backward[v] = 1
        elif policy[v] == SAVE_CODE:
            problem_text = f"recomputes {names[v].name!r}, whose policy is 'save': it must be kept, not recomputed"
        if problem_text is not None:
            raise InvalidPlanError(f"{_step_label(problem, nodes, n_fwd, i)} {problem_text}")
    for b in problem._backward_idx:
        if not in_backward[b]:
            raise InvalidPlanError(f"backward node {names[b].name!r} is never computed in the backward phase")
    for v in problem._forward_idx:
        if kept[v]:
            if not in_forward[v]:
                raise InvalidPlanError(f"kept node {names[v].name!r} is not computed in the forward phase")
            if policy[v] == RECOMPUTE_CODE:
                raise InvalidPlanError(f"kept node {names[v].name!r} has policy 'recompute': it must not be kept")
        if output[v] and not in_forward[v]:
            raise InvalidPlanError(f"output node {names[v].name!r} is not computed in the forward phase")


def _structure_holds(problem: Problem, nodes: list[int], n_fwd: int, kept: bytearray) -> bool:
    """:func:`_check_structure`'s rules in array passes: True when none is broken."""
    import numpy as np

    a = _arrays(problem)
    node = np.array(nodes, dtype=np.int64)
    kind = a["kind"][node]
    forward, backward = node[:n_fwd], node[n_fwd:]
    in_backward = backward[kind[n_fwd:] == BACKWARD_CODE]
    recomputed = backward[kind[n_fwd:] == FORWARD_CODE]
    if (kind == INPUT_CODE).any() or (kind[:n_fwd] == BACKWARD_CODE).any() or a["save"][recomputed].any():
        return False
    if len(np.unique(forward)) != n_fwd or len(np.unique(in_backward)) != len(in_backward):
        return False
    if len(in_backward) != len(problem._backward_idx):
        return False  # with no backward node twice, one is missing
    in_forward = np.zeros(len(problem.nodes), dtype=bool)
    in_forward[forward] = True
    is_forward = a["kind"] == FORWARD_CODE
    kept_forward = np.frombuffer(bytes(kept), dtype=np.uint8).astype(bool) & is_forward
    must_run = kept_forward | (a["output"] & is_forward)
    return not (must_run & ~in_forward).any() and not (kept_forward & a["recompute"]).any()


def _arrays(problem: Problem) -> dict:
    """The problem's per-node fields as numpy arrays, and its non-input preds in CSR form (built once)."""
    arrays = problem._cache.get("simulator.arrays")
    if arrays is not None:
        return arrays
    import numpy as np

    kind = problem._kind
    indptr = [0]
    indices: list[int] = []
    for preds in problem._preds:
        indices.extend(p for p in preds if kind[p] != INPUT_CODE)
        indptr.append(len(indices))
    arrays = problem._cache["simulator.arrays"] = {
        "indptr": np.array(indptr, dtype=np.int64),
        "indices": np.array(indices, dtype=np.int64),
        "kind": np.frombuffer(kind, dtype=np.uint8),
        "bytes": np.array(problem._bytes, dtype=np.int64),
        "alias_of": np.array(problem._alias_of, dtype=np.int64),
        "part_of": np.array(problem._part_of, dtype=np.int64),
        "output": np.frombuffer(problem._output, dtype=np.uint8).astype(bool),
        "save": np.frombuffer(bytes(problem._policy), dtype=np.uint8) == SAVE_CODE,
        "recompute": np.frombuffer(bytes(problem._policy), dtype=np.uint8) == RECOMPUTE_CODE,
        "scratch": np.array(problem._scratch, dtype=np.int64),
        "fusion": np.frombuffer(problem._fusion, dtype=np.uint8),
        "fuses": any(problem._fusion),
        "groups": _group_arrays(problem),
    }
    return arrays


def _group_arrays(problem: Problem) -> list[dict[str, Any]]:
    """Per size group (:class:`solvers.problem.SizeGroup`): its total, each member's bound, and for
    each node that grows with a member, which one and by how many bytes per unit."""
    import numpy as np

    groups = []
    for group in problem.size_groups:
        member = np.full(len(problem.nodes), -1, dtype=np.int64)
        unit = np.zeros(len(problem.nodes), dtype=np.int64)
        for m, (_, nodes) in enumerate(group.members):
            for name, per_unit in nodes:
                member[problem.index[name]] = m
                unit[problem.index[name]] = per_unit
        bounds = np.array([bound for bound, _ in group.members], dtype=np.int64)
        groups.append({"total": group.total, "bounds": bounds, "member": member, "unit": unit})
    return groups


def _worst_split(group: dict[str, Any], node: Any, grows: Any, death: Any, n_steps: int) -> Any:
    """What a size group adds at each step of the schedule under the worst split of its total
    (``grows``: the steps allocating a node of the group that live, ``death``: when each dies).

    At each step, each member holds some bytes per unit of its size (its live nodes' units); the
    worst split gives the members holding the most the largest shares, each up to its bound,
    until the total is spent.  O(members * changes), changes being the steps where a live
    node of the group is allocated or dies.
    """
    import numpy as np

    member = group["member"][node]
    added = np.zeros(n_steps, dtype=np.int64)
    if not len(grows):
        return added
    units = group["unit"][node[grows]]
    starts, ends = grows, death[grows] + 1
    changes = np.unique(np.concatenate([starts, ends]))
    changes = changes[changes < n_steps]
    n_members = len(group["bounds"])
    per_unit = np.zeros((n_members, len(changes) + 1), dtype=np.int64)
    np.add.at(per_unit, (member[starts], np.searchsorted(changes, starts)), units)
    np.add.at(per_unit, (member[starts], np.searchsorted(changes, ends)), -units)
    per_unit = np.cumsum(per_unit, axis=1)[:, : len(changes)]
    order = np.argsort(-per_unit, axis=0, kind="stable")
    held = np.take_along_axis(per_unit, order, axis=0)
    bounds = group["bounds"][order]
    before = np.cumsum(bounds, axis=0) - bounds
    share = np.clip(group["total"] - before, 0, bounds)
    worst = (held * share).sum(axis=0)
    at = np.searchsorted(changes, np.arange(n_steps), side="right") - 1
    added[at >= 0] = worst[at[at >= 0]]
    return added


def _run(problem: Problem, nodes: list[int], n_fwd: int, kept: bytearray, *, check: bool = True) -> _Core:
    """Validate (unless ``check`` is off) and replay a schedule given as node indices.

    Array passes over the schedule's steps and reads (numpy): O((steps + edges) log steps).
    """
    import numpy as np

    if check:
        _check_structure(problem, nodes, n_fwd, kept)
    a = _arrays(problem)
    nbytes = a["bytes"]
    n_steps = len(nodes)
    if n_steps == 0:
        r = problem.resident_bytes
        return _Core(r, -1, 0.0, 0.0, [], r, 0, 0)
    node = np.array(nodes, dtype=np.int64)
    step = np.arange(n_steps, dtype=np.int64)
    kept_arr = np.frombuffer(bytes(kept), dtype=np.uint8).astype(bool)

    # Every instance of a node, ordered by (node, step): the most recent instance of
    # node p before step i is found by one binary search.
    by_node = np.lexsort((step, node))
    instance_key = node[by_node] * n_steps + step[by_node]

    def latest_before(values: np.ndarray, at: np.ndarray) -> np.ndarray:
        """Step of the most recent instance of each ``values[k]`` before step ``at[k]``; -1 if none."""
        pos = np.searchsorted(instance_key, values * n_steps + at) - 1
        found = pos >= 0
        found[found] = node[by_node[pos[found]]] == values[found]
        return np.where(found, by_node[np.maximum(pos, 0)], -1)

    # Pass 1: the instance each read resolves to, and each instance's last reader.
    count = a["indptr"][node + 1] - a["indptr"][node]
    reader = np.repeat(step, count)
    first = np.repeat(a["indptr"][node], count)
    offset = np.arange(len(reader), dtype=np.int64) - np.repeat(np.cumsum(count) - count, count)
    read = a["indices"][first + offset]
    inst = latest_before(read, reader)
    missing = inst < 0
    dead = (reader >= n_fwd) & (inst < n_fwd) & ~kept_arr[read] & ~a["output"][read] & ~missing
    if missing.any() or dead.any():
        k = int(np.argmax(missing | dead))
        i, p = int(reader[k]), int(read[k])
        if missing[k]:
            raise InvalidPlanError(
                f"{_step_label(problem, nodes, n_fwd, i)} reads {problem.nodes[p].name!r}, "
                "which has not been computed before this step"
            )
        hint = " (its policy is 'save', so it must be kept)" if a["save"][p] else ""
        raise InvalidPlanError(
            f"{_step_label(problem, nodes, n_fwd, i)} reads {problem.nodes[p].name!r}, which has no live "
            f"value: its forward value is not kept and it was not recomputed before this step{hint}"
        )
    last_read = np.full(n_steps, -1, dtype=np.int64)
    np.maximum.at(last_read, inst, reader)
    inline = _computed_inline(a, node, n_fwd, inst, last_read)
    if inline.any():
        # Computed inside its readers' kernels: what it reads lives until they run (chains of them too).
        by_inline = inline[reader]
        while True:
            before = last_read.copy()
            np.maximum.at(last_read, inst[by_inline], last_read[reader[by_inline]])
            if np.array_equal(before, last_read):
                break

    # The storage (root instance) each instance pins, -1 if none.  A getitem (part_of)
    # takes its bytes over from the multi-output instance it reads; extracting the same
    # output of the same instance again gives the same storage.
    alias = a["alias_of"][node]
    is_alias = alias >= 0
    own_bytes = np.where(inline, 0, nbytes[node])
    is_part = ~is_alias & (a["part_of"][node] >= 0) & (own_bytes > 0)
    storage = np.where(~is_alias & (own_bytes > 0), step, -1)
    part_steps = step[is_part]
    whole = latest_before(a["part_of"][node[is_part]], part_steps)
    _, first_at, group = np.unique(whole * len(problem.nodes) + node[is_part], return_index=True, return_inverse=True)
    storage[part_steps] = part_steps[first_at][group]
    extracting = part_steps[first_at]  # getitem instances that take bytes over
    whole_of = np.full(n_steps, -1, dtype=np.int64)
    whole_of[extracting] = whole[first_at]
    taken = np.zeros(n_steps, dtype=np.int64)
    np.add.at(taken, whole[first_at], own_bytes[extracting])
    # An alias pins the storage of its base instance (none when the base is an input: resident
    # anyway); chains of aliases (views of views, gradients accumulated in place) by pointer doubling.
    base = step.copy()
    base[is_alias] = latest_before(alias[is_alias], step[is_alias])
    base[base < 0] = step[base < 0]
    while True:
        further = base[base]
        if np.array_equal(further, base):
            break
        base = further
    storage = storage[base]

    # Pass 2: each storage lives until the last death of an instance pinning it.
    last = n_steps - 1
    forward_kept = (step < n_fwd) & kept_arr[node] & ~a["output"][node]
    death = np.where(
        a["output"][node], last, np.where(forward_kept, np.maximum(n_fwd - 1, last_read), np.maximum(step, last_read))
    )
    pins = storage >= 0
    storage_death = np.full(n_steps, -1, dtype=np.int64)
    if len(extracting):
        # The multi-output value (a tuple) references an extracted output until it dies too:
        # the death, so far in step order, of the storage of the instance it was taken from
        # (a running maximum per storage; again while a tuple taken from a tuple moves).
        holder = pins & np.isin(storage, whole_of[extracting])
        h_key = storage[holder] * n_steps + step[holder]
        order = np.argsort(h_key)
        h_key, h_steps, segment = h_key[order], step[holder][order], storage[holder][order] * n_steps
        pos = np.searchsorted(h_key, whole_of[extracting] * n_steps + extracting) - 1
        ok = pos >= 0
        ok[ok] = h_key[pos[ok]] // n_steps == whole_of[extracting][ok]
        at, own_death = pos[ok], death[extracting][ok]
        while True:
            running = np.maximum.accumulate(death[h_steps] + segment) - segment
            moved = np.maximum(own_death, running[at])
            if np.array_equal(moved, death[extracting[ok]]):
                break
            death[extracting[ok]] = moved
    np.maximum.at(storage_death, storage[pins], death[pins])

    # Pass 3: live bytes after each allocation, from +bytes/-bytes events.
    # A getitem's bytes move out of its multi-output storage: net zero at its step;
    # the output dies when both the getitem and the multi-output value are dead.
    alive = step[storage_death >= 0]
    # Nodes that grow with a data-dependent size of a group count their fixed part here, the rest at
    # the group's worst split (none of them is a view or a part of a multi-output value).
    fixed_bytes = own_bytes.copy()
    growing = []
    for group in a["groups"]:
        grows = (group["member"][node] >= 0) & (own_bytes > 0)  # computed inline: no bytes at all
        fixed_bytes[grows] -= group["unit"][node[grows]] * group["bounds"][group["member"][node[grows]]]
        growing.append(grows)
    delta = np.zeros(n_steps + 1, dtype=np.int64)
    delta[alive] += fixed_bytes[alive]
    np.add.at(delta, storage_death[alive] + 1, -(fixed_bytes[alive] - taken[alive]))
    delta[extracting] -= own_bytes[extracting]
    timeline = problem.resident_bytes + np.cumsum(delta[:n_steps]) + a["scratch"][node]
    for group, grows in zip(a["groups"], growing, strict=True):
        timeline = timeline + _worst_split(group, node, alive[grows[alive]], storage_death, n_steps)
    peak_step = int(np.argmax(timeline))
    recomputed = node[n_fwd:][a["kind"][node[n_fwd:]] == FORWARD_CODE].tolist()
    cost = problem._cost
    # A kept value that no backward step reads dies with the forward (the rewritten graphs free
    # it after its last use): only storages a kept value carries into backward are kept bytes.
    kept_storages = np.zeros(n_steps, dtype=bool)
    kept_storages[storage[forward_kept & pins & (death >= n_fwd)]] = True
    return _Core(
        peak_bytes=int(timeline[peak_step]),
        peak_step=peak_step,
        recompute_cost=float(sum([cost[v] for v in recomputed])),
        forward_cost=float(sum([cost[v] for v in nodes[:n_fwd]])),
        timeline=timeline.tolist(),
        forward_peak_bytes=int(timeline[:n_fwd].max()) if n_fwd else problem.resident_bytes,
        kept_bytes=int((own_bytes[kept_storages] - taken[kept_storages]).sum()),
        recompute_steps=len(recomputed),
    )


def _computed_inline(arrays: dict[str, Any], node: Any, n_fwd: int, inst: Any, last_read: Any) -> Any:
    """Steps that compute a pointwise value inside the kernels of its readers (``Node.fusion``): those
    the pricing found so (no bytes, not a view), and recomputations in backward with one reader,
    which fuses.  They allocate nothing."""
    import numpy as np

    if not arrays["fuses"]:  # a problem for a compiler that does not fuse
        return np.zeros(len(node), dtype=bool)
    fusion, kind = arrays["fusion"][node], arrays["kind"][node]
    pointwise = fusion == POINTWISE_CODE
    inline = (pointwise | (fusion == ABSORBED_CODE)) & (arrays["bytes"][node] == 0) & (arrays["alias_of"][node] < 0)
    recomputed = pointwise & ~inline & (kind == FORWARD_CODE)
    recomputed[:n_fwd] = False
    if recomputed.any():
        readers = np.bincount(inst, minlength=len(node))
        recomputed &= (readers == 1) & (last_read >= 0)
        recomputed[recomputed] = np.isin(fusion[last_read[recomputed]], (POINTWISE_CODE, REDUCTION_CODE))
    return inline | recomputed
