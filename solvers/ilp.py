"""Optimal rematerialization as a mixed-integer linear program (Checkmate-style).

Problem
-------
Find the explicit schedule with the least recomputation cost whose peak, as
measured by :func:`solvers.simulate`, fits a memory budget.

Reference
---------
Paras Jain, Ajay Jain, Aniruddha Nrusimha, Amir Gholami, Pieter Abbeel,
Kurt Keutzer, Ion Stoica, Joseph E. Gonzalez, "Checkmate: Breaking the Memory
Wall with Optimal Tensor Rematerialization", MLSys 2020. Checkmate's matrices
``R`` (compute value i in stage t), ``S`` (value i is alive entering stage t)
and its memory accounting ``U``/``FREE`` are kept in spirit, but re-derived
for this package's memory model, so that the MILP's peak *is* the simulator's
peak on the schedules it describes (Checkmate's own model frees differently).

The family of schedules ("stage schedules")
-------------------------------------------
* forward phase: forward nodes in problem order, each at most once; a subset
  ``K`` is kept;
* backward phase: one stage per backward node, in problem order; stage t
  recomputes a set of forward values in problem order (each at most once per
  stage) and then runs backward node t.

Formulation
-----------
Binary ``C[i]`` (i computed in forward; fixed to 1 for ancestors of outputs),
``K[i]`` (kept), ``R[t,i]`` (recomputed in stage t); continuous ``S[t,i]`` in
[0, 1] (i alive entering stage t, ``S[0,i] = K[i]``) and liveness helpers.

* correctness: a recomputation or backward node finds each forward pred
  alive or recomputed earlier in the stage (``R[t,j] <= R[t,i] + S[t,i]``,
  ``1 <= R[t,i] + S[t,i]``); ``S[t+1,i] <= S[t,i] + R[t,i]``;
  ``R[t,i] + S[t,i] <= 1`` (no second copy of a live value);
* memory, one constraint per step (peak right after an allocation): resident
  bytes + backward values alive then (fixed by the order) + the allocation +
  every forward value alive then. A forward value before the step is alive
  iff it is read at or after the step in the same stage, read by the stage's
  backward node, or alive into the next stage (``S[t+1,i]``); a value after
  the step is alive iff ``S[t,i]``. The forward phase is the same with ``C``
  and ``K``. Alias groups count their root's bytes once while any member is
  alive; recomputing a root while an older view is alive is forbidden (it
  would need two copies).
* objective: minimise the sum of ``cost[i] * R[t,i]``.

Size: O(B·F) binaries for B backward and F forward nodes (fewer: a value is
only a candidate in stages that may still need it). Graphs whose model exceeds
``max_variables`` (default 300,000) are refused with :class:`SolverError`.

Solver: HiGHS through pulp when highspy is importable (warm-started with the
hierarchical plan when it fits), else CBC (``pulp.PULP_CBC_CMD``). On time-out the best
integer solution is returned with ``info.status == "time_limit"`` and the
solver's gap and bound, and a warning is logged.

Example
-------
>>> from solvers import Problem, simulate
>>> p = Problem.training_chain(6)
>>> plan = ilp(p, 5, time_limit=10)
>>> simulate(p, plan).peak_bytes <= 5, plan.info.status
(True, 'optimal')
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import time
from dataclasses import dataclass
from typing import Any, Callable, Iterator

from solvers.errors import InfeasibleBudgetError, SolverError, format_bytes
from solvers.graph import storage_roots
from solvers.plan import BACKWARD_PHASE, FORWARD_PHASE, Plan, SolveInfo, Step
from solvers.problem import Problem
from solvers.simulator import simulate

__all__ = ["ilp", "build_model", "MAX_VARIABLES"]

log = logging.getLogger("solvers.ilp")

Progress = Callable[[float, str], None]

_INPUT, _FORWARD, _BACKWARD = 0, 1, 2
_SAVE, _RECOMPUTE = 1, 2

#: Models with more variables than this are refused (pulp builds them too slowly).
MAX_VARIABLES = 300_000
_RETRIES = 3


# ============================================================== model data
def _scratch(problem: Problem) -> list[int]:
    return problem._scratch


@dataclass
class _Graph:
    """Index data of the problem restricted to what the MILP needs."""

    forward: list[int]  # relevant forward nodes, problem order
    backward: list[int]
    pos: dict[int, int]  # forward node -> position in `forward`
    forced: set[int]  # computed in forward no matter what (ancestors of outputs)
    recomputable: list[bool]  # by forward position
    keepable: list[bool]
    needed_from: list[int]  # by forward position: first stage... (see _graph)
    last_stage: list[int]  # by forward position: last stage that may need it, -1 if none
    fwd_consumers: list[list[int]]  # by forward position: forward consumers' positions
    reads: list[list[int]]  # by stage: forward positions (non-output) the backward node reads
    G: list[int]
    H: list[int]
    storage: list[int]  # by forward position: storage root node (-1: none/resident)
    view_holds: dict[int, list[tuple[int, int]]]  # forward root -> [(birth, death) stages of backward views]
    resident: list[bool]  # by forward position: output-like (alive from its forward step on, never recomputed)
    out_groups: set[int]  # storage roots shared with an output


def _graph(problem: Problem) -> _Graph:
    kind, output, policy = problem._kind, problem._output, problem._policy

    nbytes, consumers = problem._bytes, problem._consumers
    alias_root = storage_roots(problem)
    fwd_preds = problem._fwd_preds
    backward = list(problem._backward_idx)
    B = len(backward)
    stage = {b: q for q, b in enumerate(backward)}

    # A storage that an output shares (output views, getitems) is resident from its
    # forward allocation on. Its other members are then free to keep: they are
    # treated as outputs ("resident"), except "recompute" ones, whose backward
    # copies are real new storages.
    out_groups = {alias_root[v] for v in problem._forward_idx
                  if output[v] and kind[alias_root[v]] == _FORWARD}
    resident_value = [bool(output[v]) or (alias_root[v] in out_groups and policy[v] != _RECOMPUTE)
                      if kind[v] == _FORWARD else False for v in range(len(problem.nodes))]

    # Forward values a stage >= t may read: ancestors of what backward t.. reads.
    last_stage: dict[int, int] = {}
    for q in range(B - 1, -1, -1):
        frontier = [v for v in fwd_preds[backward[q]] if not resident_value[v]]
        while frontier:
            v = frontier.pop()
            if v in last_stage:
                continue
            last_stage[v] = q
            frontier.extend(p for p in fwd_preds[v] if not resident_value[p])
    forced = set()
    for v in reversed(problem._forward_idx):
        if resident_value[v] or v in forced:
            forced.add(v)
            forced.update(fwd_preds[v])
    forward = [v for v in problem._forward_idx if v in forced or v in last_stage]
    pos = {v: k for k, v in enumerate(forward)}
    recomputable = [not resident_value[v] and policy[v] != _SAVE for v in forward]
    keepable = [not resident_value[v] and policy[v] != _RECOMPUTE for v in forward]
    fwd_consumers = [[pos[c] for c in consumers[v] if kind[c] == _FORWARD and c in pos] for v in forward]
    reads = [[pos[v] for v in dict.fromkeys(fwd_preds[b]) if not resident_value[v] and v in pos] for b in backward]

    # Backward storages (fixed by the order): alive at G[q] (node q's allocation)
    # and H[q] (before recomputations of stage q). Forward outputs are resident.
    resident = problem.resident_bytes
    out_bytes = 0
    seen: set[int] = set()
    for v in problem._forward_idx:
        r = alias_root[v]
        if output[v] and kind[r] == _FORWARD and r not in seen:
            seen.add(r)
            out_bytes += nbytes[r]
    birth: dict[int, int] = {}
    death: dict[int, int] = {}
    view_holds: dict[int, list[tuple[int, int]]] = {}
    for q, b in enumerate(backward):
        if output[b]:
            d = B
        else:
            d = max([q] + [stage[c] for c in consumers[b] if kind[c] == _BACKWARD])
        r = alias_root[b]
        if kind[r] == _FORWARD:
            view_holds.setdefault(r, []).append((q, d))
            continue
        if kind[r] != _BACKWARD or nbytes[r] == 0:
            continue
        birth.setdefault(r, stage[r])
        death[r] = max(death.get(r, -1), d)
    delta = [0] * (B + 2)
    born = [0] * (B + 1)
    for r, b0 in birth.items():
        delta[b0] += nbytes[r]
        delta[death[r] + 1] -= nbytes[r]
        born[b0] += nbytes[r]
    G, live = [], resident + out_bytes
    for q in range(B + 1):
        live += delta[q]
        G.append(live)
    H = [G[q] - born[q] for q in range(B + 1)]
    scratch = _scratch(problem)
    for q, b in enumerate(backward):
        G[q] += scratch[b]

    storage = []
    for v in forward:
        r = alias_root[v]
        if r in out_groups and v != r:
            # A view or getitem of a resident storage allocates nothing new.
            storage.append(-1)
        else:
            storage.append(r if kind[r] == _FORWARD and nbytes[r] > 0 and not output[r] else -1)
    return _Graph(forward, backward, pos, {pos[v] for v in forced if v in pos}, recomputable, keepable,
                  [], [last_stage.get(v, -1) for v in forward], fwd_consumers, reads, G, H, storage, view_holds,
                  [resident_value[v] for v in forward], out_groups)


# ============================================================== the model
class _Model:
    """The MILP in pulp form, plus what is needed to read a schedule back."""

    def __init__(self, problem: Problem, graph: _Graph, budget: int | None, max_variables: int) -> None:
        import pulp

        self.pulp = pulp
        self.problem, self.g = problem, graph
        self.budget = budget
        # Auxiliary "alive" variables and their lower bounds, to complete warm starts.
        self.aux: list[tuple[Any, list[Any]]] = []
        self._n_aux = 0
        self.estimated = self._estimate(max_variables)
        self.lp = pulp.LpProblem("ckptc_remat", pulp.LpMinimize)
        self.add_variables()
        self.add_constraints()
        self.add_objective()
        self.n_variables = len(self.lp.variables())

    # -- variables ---------------------------------------------------------
    def _new_var(self, name: str, **bounds: Any) -> Any:
        # pulp >= 3.3 attaches variables to their model (the old constructor is deprecated).
        if hasattr(self.lp, "add_variable"):
            return self.lp.add_variable(name, **bounds)
        return self.pulp.LpVariable(name, **bounds)  # pragma: no cover - older pulp

    def _binary(self, name: str) -> Any:
        return self._new_var(name, lowBound=0, upBound=1, cat="Binary")

    def _unit(self, name: str) -> Any:
        return self._new_var(name, lowBound=0, upBound=1)

    def add_variables(self) -> None:
        """C[i] (computed in forward), K[i] (kept for backward), R[t][i] (recomputed in stage t),
        S[t][i] (alive entering stage t), and the peak itself in the minimum-memory variant."""
        g = self.g
        F, B = len(g.forward), len(g.backward)
        # Minimum-memory variant (no budget): the peak becomes the objective.
        self.peak_var = self._new_var("peak", lowBound=0) if self.budget is None else None
        self.cap = self.peak_var if self.budget is None else self.budget
        C: dict[int, Any] = {}
        K: dict[int, Any] = {}
        for i in range(F):
            C[i] = 1 if i in g.forced else self._binary(f"C_{i}")
            if g.keepable[i] and g.last_stage[i] >= 0:
                K[i] = self._binary(f"K_{i}")
        R: list[dict[int, Any]] = [dict() for _ in range(B)]
        S: list[dict[int, Any]] = [dict() for _ in range(B + 1)]
        for t in range(B):
            for i in range(F):
                if g.last_stage[i] < t:
                    continue
                if g.recomputable[i]:
                    R[t][i] = self._binary(f"R_{t}_{i}")
                if t == 0:
                    if i in K:
                        S[0][i] = K[i]
                else:
                    S[t][i] = self._unit(f"S_{t}_{i}")
        self.C, self.K, self.R, self.S = C, K, R, S

    def s_of(self, t: int, i: int) -> Any:
        return self.S[t].get(i, 0) if t < len(self.g.backward) else 0

    def r_of(self, t: int, i: int) -> Any:
        return self.R[t].get(i, 0)

    # -- constraints -------------------------------------------------------
    def add_constraints(self) -> None:
        """Forward order, correctness (every read available), aliasing, and memory under the cap."""
        self._add_forward_order()
        self._add_correctness()
        self._add_alias_rules()
        self._add_forward_memory()
        self._add_backward_memory()

    def _add_forward_order(self) -> None:
        lp, g, C, K = self.lp, self.g, self.C, self.K
        for i in range(len(g.forward)):
            if i in K and not isinstance(C[i], int):
                lp += K[i] <= C[i]
            for j in g.fwd_consumers[i]:
                if not isinstance(C[i], int) and not isinstance(C[j], int):
                    lp += C[j] <= C[i]
                elif not isinstance(C[i], int) and isinstance(C[j], int):
                    lp += C[i] >= 1

    def _add_correctness(self) -> None:
        lp, g, R, S = self.lp, self.g, self.R, self.S
        B = len(g.backward)
        for t in range(B):
            for j, rj in R[t].items():
                for p in self.problem._fwd_preds[g.forward[j]]:
                    ip = g.pos[p]
                    if g.resident[ip]:
                        continue
                    lp += rj <= self.r_of(t, ip) + self.s_of(t, ip)
            for i in g.reads[t]:
                lp += self.r_of(t, i) + self.s_of(t, i) >= 1
            if t + 1 < B:
                for i, nxt in S[t + 1].items():
                    lp += nxt <= self.s_of(t, i) + self.r_of(t, i)
            for i in set(R[t]) & set(S[t]):
                lp += R[t][i] + S[t][i] <= 1

    def _add_alias_rules(self) -> None:
        """Forbid a second copy of an alias root while an older view still pins the first."""
        lp, g, R, S = self.lp, self.g, self.R, self.S
        B = len(g.backward)
        members: dict[int, list[int]] = {}
        for i, st in enumerate(g.storage):
            if st >= 0:
                members.setdefault(st, []).append(i)
        for root, group in members.items():
            if root not in g.pos or len(group) < 2:
                continue
            ir = g.pos[root]
            for t in range(B):
                if ir in R[t]:
                    for u in group:
                        if u != ir and u in S[t]:
                            lp += R[t][ir] + S[t][u] <= 1
        for root, holds in g.view_holds.items():
            if root in g.pos:
                ir = g.pos[root]
                for (b0, d0) in holds:
                    for t in range(b0 + 1, min(d0, B - 1) + 1):
                        if ir in R[t]:
                            lp += R[t][ir] == 0

    def _alive(self, bounds: list[Any], name: str) -> Any:
        """A unit variable at least every expression of ``bounds`` (alive while any use is pending)."""
        alive = self._unit(name)
        for e in bounds:
            self.lp += alive >= e
        self.aux.append((alive, bounds))
        return alive

    def _add_memory(self, terms: list[tuple[int, Any]], constant: int, label: str, extra: Any = 0) -> None:
        """Memory at one step within the cap; ``terms`` are (forward position, liveness expression),
        summed once per storage group."""
        nbytes = self.problem._bytes
        by_group: dict[int, list[Any]] = {}
        for i, expr in terms:
            st = self.g.storage[i]
            if st < 0 or (isinstance(expr, int) and expr == 0):
                continue
            by_group.setdefault(st, []).append(expr)
        total = []
        const = constant
        for st, exprs in by_group.items():
            size = nbytes[st]
            if any(isinstance(e, int) and e >= 1 for e in exprs):
                const += size
                continue
            if len(exprs) == 1:
                total.append(size * exprs[0])
            else:
                self._n_aux += 1
                total.append(size * self._alive(exprs, f"A_{label}_{st}"))
        self.lp.addConstraint(self.pulp.lpSum(total) + extra + const <= self.cap)

    def _add_forward_memory(self) -> None:
        """Forward phase: at the step of k, each earlier value alive until its last use or kept."""
        problem, g, C, K = self.problem, self.g, self.C, self.K
        nbytes = problem._bytes
        roots = storage_roots(problem)
        scratch = _scratch(problem)
        out_before = 0
        out_seen: set[int] = set()
        for k in range(len(g.forward)):
            terms: list[tuple[int, Any]] = []
            vk = g.forward[k]
            for i in range(k):
                if g.resident[i] or roots[g.forward[i]] in g.out_groups:
                    continue
                cons_after = [j for j in g.fwd_consumers[i] if j >= k]
                if not cons_after and i not in K:
                    continue
                if not cons_after:
                    terms.append((i, K[i]))
                elif len(cons_after) == 1 and i not in K:
                    terms.append((i, C[cons_after[0]]))
                elif any(isinstance(C[j], int) for j in cons_after):
                    terms.append((i, 1 if isinstance(C[i], int) else C[i]))
                else:
                    bounds = [C[j] for j in cons_after] + ([K[i]] if i in K else [])
                    terms.append((i, self._alive(bounds, f"LF_{k}_{i}")))
            r = roots[vk]
            if r in g.out_groups:
                # Resident from the first member's allocation on (counted once).
                if r not in out_seen:
                    out_seen.add(r)
                    out_before += nbytes[r]
            else:
                terms.append((k, C[k]))
            self._add_memory(terms, problem.resident_bytes + out_before, f"f{k}", scratch[vk] * C[k])

    def _add_backward_memory(self) -> None:
        """Backward stages: at each recomputation of stage t, and at the stage's own step."""
        g, R, S = self.g, self.R, self.S
        scratch = _scratch(self.problem)
        for t in range(len(g.backward)):
            reads_t = set(g.reads[t])
            for k in sorted(R[t]):
                terms = []
                for i in set(S[t]) | set(R[t]):
                    if i == k:
                        terms.append((i, R[t][k]))
                        continue
                    if i > k:
                        if i in S[t]:
                            terms.append((i, S[t][i]))
                        continue
                    if i in reads_t:
                        terms.append((i, 1))
                        continue
                    cons_after = [R[t][j] for j in g.fwd_consumers[i] if j >= k and j in R[t]]
                    nxt = self.s_of(t + 1, i)
                    if not cons_after:
                        terms.append((i, nxt))
                    elif isinstance(nxt, int) and len(cons_after) == 1:
                        terms.append((i, cons_after[0]))
                    else:
                        bounds = cons_after + ([nxt] if not isinstance(nxt, int) else [])
                        terms.append((i, self._alive(bounds, f"LB_{t}_{k}_{i}")))
                for root, holds in g.view_holds.items():
                    if root in g.pos and any(b0 < t <= d0 for b0, d0 in holds):
                        terms.append((g.pos[root], 1))
                self._add_memory(terms, g.H[t], f"b{t}_{k}", scratch[g.forward[k]] * R[t][k])
            terms = []
            for i in set(S[t]) | set(R[t]):
                terms.append((i, 1 if i in reads_t else self.s_of(t + 1, i)))
            for root, holds in g.view_holds.items():
                if root in g.pos and any(b0 <= t <= d0 for b0, d0 in holds):
                    terms.append((g.pos[root], 1))
            self._add_memory(terms, g.G[t], f"b{t}")

    # -- objective ---------------------------------------------------------
    def add_objective(self) -> None:
        """Least recompute cost under the budget, or (no budget) the least peak."""
        if self.budget is None:
            self.lp += self.peak_var
            return
        cost, g = self.problem._cost, self.g
        self.lp += self.pulp.lpSum(cost[g.forward[i]] * r for t in range(len(g.backward)) for i, r in self.R[t].items())

    def _estimate(self, max_variables: int) -> int:
        return self._estimate_size(self.g, max_variables)

    @staticmethod
    def _estimate_size(g: _Graph, max_variables: int) -> int:
        B = len(g.backward)
        estimate = sum(2 * (last + 1) for last in g.last_stage if last >= 0)
        estimate += sum(len(c) for c in g.fwd_consumers) * max(B, 1)
        if estimate > max_variables:
            raise SolverError(
                f"ilp: the MILP for this graph would have about {estimate:,} variables "
                f"({len(g.forward)} forward x {B} backward nodes), more than max_variables="
                f"{max_variables:,}; use method='hierarchical' (auto does)"
            )
        return estimate

    # ------------------------------------------------------------ read back
    def schedule(self) -> tuple[set[int], list[int], list[list[int]]]:
        """(kept forward positions, forward steps, recomputations per stage) from the solution."""
        value = lambda x: x if isinstance(x, int) else (x.varValue or 0.0)  # noqa: E731
        g = self.g
        kept = {i for i, k in self.K.items() if value(k) > 0.5}
        rec = [[i for i, r in sorted(self.R[t].items()) if value(r) > 0.5] for t in range(len(g.backward))]
        return kept, [], rec


# ============================================================== solving
@contextlib.contextmanager
def _quiet_stdout() -> Iterator[None]:
    """Silence C-level stdout (HiGHS prints a banner when its first instance is created)."""
    try:
        fd = os.dup(1)
    except OSError:
        yield
        return
    try:
        with open(os.devnull, "w") as devnull:
            os.dup2(devnull.fileno(), 1)
            try:
                yield
            finally:
                os.dup2(fd, 1)
    finally:
        os.close(fd)


def _highs_available() -> bool:
    try:
        import highspy  # noqa: F401
    except ImportError:
        return False
    return True


def make_milp_solver(time_limit: float, start: dict[str, float] | None, threads: int | None, gap: float):
    """A pulp solver: HiGHS when ``highspy`` is installed, else the CBC binary pulp ships (also used by
    the hierarchical solver's MILP options)."""
    import pulp

    if not _highs_available():
        return pulp.PULP_CBC_CMD(msg=False, timeLimit=time_limit, gapRel=gap, threads=threads,
                                 warmStart=start is not None)

    class _HiGHS(pulp.HiGHS):
        """pulp's HiGHS, created quietly and optionally given a starting solution."""

        def createAndConfigureSolver(self, lp):  # noqa: N802 (pulp's name)
            with _quiet_stdout():
                super().createAndConfigureSolver(lp)
            lp.solverModel.setOptionValue("output_flag", False)

        def callSolver(self, lp):  # noqa: N802
            if start:
                import highspy

                solution = highspy.HighsSolution()
                solution.col_value = [float(start.get(v.name, 0.0)) for v in lp.variables()]
                solution.value_valid = True
                lp.solverModel.setSolution(solution)
            super().callSolver(lp)

    return _HiGHS(msg=False, timeLimit=time_limit, gapRel=gap, threads=threads)


@dataclass
class _Outcome:
    status: str
    objective: float | None
    bound: float | None
    gap: float | None
    seconds: float


def _solve(model: _Model, time_limit: float, start: dict[str, float] | None, threads: int | None,
           gap: float) -> _Outcome:
    import pulp

    lp = model.lp
    solver = make_milp_solver(time_limit, start, threads, gap)
    if start is not None and not isinstance(solver, pulp.HiGHS):
        for v in lp.variables():
            if v.name in start:
                v.setInitialValue(start[v.name])
    started = time.perf_counter()
    with _quiet_stdout():
        lp.solve(solver)
    seconds = time.perf_counter() - started
    objective = pulp.value(lp.objective)
    bound = gap_value = None
    status = "optimal"
    highs = getattr(lp, "solverModel", None)
    if isinstance(solver, pulp.HiGHS) and highs is not None:
        import highspy

        model_status = highs.getModelStatus()
        info = highs.getInfo()
        has_solution = int(info.primal_solution_status) == 2 and objective is not None
        if model_status == highspy.HighsModelStatus.kOptimal:
            status = "optimal"
        elif model_status in (highspy.HighsModelStatus.kInfeasible,
                              highspy.HighsModelStatus.kUnboundedOrInfeasible):
            status = "infeasible"
        elif model_status == highspy.HighsModelStatus.kTimeLimit:
            status = "time_limit" if has_solution else "time_limit_no_solution"
        else:
            status = "optimal" if has_solution and lp.sol_status == pulp.LpSolutionOptimal else (
                "feasible" if has_solution else str(model_status))
        if has_solution:
            bound = float(info.mip_dual_bound)
            gap_value = float(info.mip_gap)
            reported = float(info.objective_function_value)
            if objective is not None and abs(reported - objective) > 1e-6 * max(1.0, abs(objective)):
                # Seen with a start solution: HiGHS proves an optimum but hands back the
                # start's columns. The caller re-solves without the start.
                status = "inconsistent"
    else:
        if lp.status == pulp.LpStatusInfeasible:
            status = "infeasible"
        elif lp.status != pulp.LpStatusOptimal or objective is None:
            status = "time_limit_no_solution" if seconds >= time_limit * 0.95 else "not_solved"
        elif lp.sol_status == pulp.LpSolutionIntegerFeasible or seconds >= time_limit * 0.95:
            status = "time_limit"
        if status == "optimal":
            bound, gap_value = objective, 0.0
    if status == "optimal" and gap_value is None:
        bound, gap_value = objective, 0.0
    if status == "optimal" and bound is not None and objective is not None:
        gap_value = 0.0 if abs(objective - bound) <= 1e-9 * max(1.0, abs(objective)) else gap_value
    return _Outcome(status, objective, bound, gap_value, seconds)


# ============================================================== plans
def _prune(problem: Problem, graph: _Graph, kept: set[int], rec: list[list[int]]) -> tuple[set[int], list[list[int]]]:
    """Drop recomputations nobody reads and kept values backward never reads (both only free memory)."""
    fwd_preds = problem._fwd_preds
    g = graph
    B = len(g.backward)
    changed = True
    rec = [list(r) for r in rec]
    while changed:
        changed = False
        # Which instance each read resolves to, walking the backward phase.
        latest: dict[int, tuple[int, int]] = {}  # forward pos -> (stage, index) of its latest recompute
        read_inst: set[tuple[int, int, int]] = set()
        kept_read: set[int] = set()
        for t in range(B):
            for idx, i in enumerate(rec[t]):
                for p in fwd_preds[g.forward[i]]:
                    ip = g.pos.get(p)
                    if ip is None or g.resident[ip]:
                        continue
                    if ip in latest:
                        read_inst.add((ip,) + latest[ip])
                    else:
                        kept_read.add(ip)
                latest[i] = (t, idx)
            for ip in g.reads[t]:
                if ip in latest:
                    read_inst.add((ip,) + latest[ip])
                else:
                    kept_read.add(ip)
        for t in range(B):
            keep = [i for idx, i in enumerate(rec[t]) if (i, t, idx) in read_inst]
            if len(keep) != len(rec[t]):
                rec[t] = keep
                changed = True
        unused = {i for i in kept if i not in kept_read}
        if unused:
            kept -= unused
            changed = True
    return kept, rec


def _to_plan(problem: Problem, graph: _Graph, kept: set[int], rec: list[list[int]], budget: int | None) -> Plan:
    g = graph
    names = problem.nodes
    output = problem._output
    kept_nodes = {g.forward[i] for i in kept}
    # Members of storages an output shares: their forward instances serve backward.
    kept_nodes |= {v for i, v in enumerate(g.forward) if g.resident[i] and not output[v]}
    needed = set(kept_nodes) | {v for v in problem._forward_idx if output[v]}
    for v in reversed(problem._forward_idx):
        if v in needed:
            needed.update(problem._fwd_preds[v])
    steps = [Step(names[v].name, FORWARD_PHASE) for v in problem._forward_idx if v in needed]
    for t, b in enumerate(g.backward):
        steps += [Step(names[g.forward[i]].name, BACKWARD_PHASE) for i in rec[t]]
        steps.append(Step(names[b].name, BACKWARD_PHASE))
    return Plan(kept=frozenset(names[v].name for v in kept_nodes), schedule=tuple(steps), method="ilp",
                budget_bytes=budget)


def _start_from_plan(problem: Problem, model: _Model, plan: Plan) -> dict[str, float] | None:
    """Variable values of a stage schedule (e.g. the hierarchical plan's), to warm-start the MILP."""
    g = model.g
    index = problem.index
    B = len(g.backward)
    values: dict[str, float] = {}
    kept = {g.pos[index[n]] for n in plan.kept if index[n] in g.pos}
    stage = -1
    rec: list[list[int]] = [[] for _ in range(B)]
    stage_of = {b: q for q, b in enumerate(g.backward)}
    forward_done: set[int] = set()
    for step in plan.schedule or ():
        v = index[step.node]
        if step.phase == FORWARD_PHASE:
            if v in g.pos:
                forward_done.add(g.pos[v])
            continue
        if problem._kind[v] == _BACKWARD:
            stage = stage_of[v]
            continue
        if v not in g.pos:
            return None
        rec[stage + 1].append(g.pos[v]) if stage + 1 < B else None
    # Stage schedules only: each value at most once per stage, in problem order.
    for r in rec:
        if r != sorted(set(r)):
            return None
    for i, var in model.K.items():
        values[var.name] = 1.0 if i in kept else 0.0
    for i, var in model.C.items():
        if not isinstance(var, int):
            values[var.name] = 1.0 if i in forward_done else 0.0
    # Liveness S from reads: an instance is alive entering stage t if read at or after t before being replaced.
    fwd_preds = problem._fwd_preds
    latest_stage: dict[int, int] = {i: 0 for i in kept}  # stage the current instance appeared (0: kept)
    holds: list[tuple[int, int, int]] = []  # (pos, from_stage_exclusive_or_0, read_stage)
    for t in range(B):
        rset = set(rec[t])
        for i in rec[t]:
            for p in fwd_preds[g.forward[i]]:
                ip = g.pos.get(p)
                if ip is None or g.resident[ip] or ip in rset and ip < i:
                    continue
                holds.append((ip, latest_stage.get(ip, 0), t))
        for ip in g.reads[t]:
            if ip in rset:
                continue
            holds.append((ip, latest_stage.get(ip, 0), t))
        for i in rec[t]:
            latest_stage[i] = t + 1
    S_val: dict[tuple[int, int], float] = {}
    for ip, since, until in holds:
        for t in range(since, until + 1):
            if t == 0:
                continue
            S_val[(t, ip)] = 1.0
    for t in range(1, B):
        for i, var in model.S[t].items():
            values[var.name] = S_val.get((t, i), 0.0)
    for t in range(B):
        for i, var in model.R[t].items():
            values[var.name] = 1.0 if i in rec[t] else 0.0
    # Auxiliary liveness variables: the least value their lower bounds allow.
    def val(e: Any) -> float:
        if isinstance(e, (int, float)):
            return float(e)
        name = getattr(e, "name", None)
        if name is not None and name in values:
            return values[name]
        return 0.0

    for var, bounds in model.aux:
        values[var.name] = min(1.0, max([0.0] + [val(e) for e in bounds]))
    return values


def _keep_all(problem: Problem) -> tuple[Plan, Any]:
    from solvers.chen import keep_all_plan

    plan = keep_all_plan(problem)
    return dataclasses.replace(plan, method="ilp"), simulate(problem, plan)


def _explicit(problem: Problem, plan: Plan) -> Plan:
    from solvers.simulator import schedule

    return Plan(kept=plan.kept, schedule=schedule(problem, plan), method=plan.method, budget_bytes=plan.budget_bytes)


def build_model(problem: Problem, budget_bytes: int | None, *, max_variables: int = MAX_VARIABLES) -> Any:
    """The pulp ``LpProblem`` of the MILP (``budget_bytes=None``: minimise the peak instead).

    Exposed for inspection and tests; :func:`ilp` builds and solves it.
    """
    return _Model(problem, _graph(problem), budget_bytes, max_variables).lp


def ilp(
    problem: Problem,
    budget_bytes: int,
    *,
    time_limit: float = 60.0,
    progress: Progress | None = None,
    max_variables: int = MAX_VARIABLES,
    threads: int | None = None,
    mip_gap: float = 1e-6,
    warm_start: bool = True,
) -> Plan:
    """Least-recomputation stage schedule within ``budget_bytes``, by MILP (Checkmate).

    Problem: minimise total recomputation cost over the stage schedules (see
    the module docstring) whose :func:`solvers.simulate` peak is at most
    ``budget_bytes``. On graphs without aliases the MILP's memory accounting
    equals the simulator's, so the optimum is exact for that family.

    Parameters
    ----------
    problem : Problem
    budget_bytes : int
    time_limit : float
        Seconds for the MILP solver (model building is not counted).
    progress : callable(fraction, message) or None
    max_variables : int
        Refuse (SolverError) models larger than this.
    threads : int or None
        Solver threads (None: solver default).
    mip_gap : float
        Relative optimality gap at which the solver stops.
    warm_start : bool
        Give the solver the hierarchical plan as a first incumbent when it fits (HiGHS/CBC).

    Returns
    -------
    Plan
        Explicit schedule; ``info``: status ("optimal" or "time_limit"),
        gap, bound (lower bound on the recompute cost), solve_seconds,
        build_seconds, variables, constraints, predicted_peak_bytes and
        recompute_cost (from simulate), solver.

    Raises
    ------
    InfeasibleBudgetError
        If no stage schedule fits; min_feasible_bytes is the least peak the
        MILP can reach (solved as a second MILP within the time left).
    SolverError
        If the model is too large, or the solver found no integer solution in time.

    Complexity: model size O(B·F + B·E_f) for B backward nodes, F forward nodes
    and E_f forward edges; solving is exponential in the worst case.

    Examples
    --------
    >>> p = Problem.training_chain(8)
    >>> ilp(p, 6).info.recompute_cost
    3.0
    """
    started = time.perf_counter()
    keep_all, keep_all_core = _keep_all(problem)
    if keep_all_core.peak_bytes <= budget_bytes and keep_all_core.recompute_cost == 0:
        plan = _explicit(problem, keep_all)
        return _finish(problem, plan, budget_bytes, started,
                       SolveInfo(status="optimal", gap=0.0, bound=0.0, candidate="keep_all"))
    graph = _graph(problem)
    if not graph.backward:
        plan = _explicit(problem, keep_all)
        return _finish(problem, plan, budget_bytes, started, SolveInfo(status="optimal", gap=0.0, bound=0.0))
    _Model._estimate_size(graph, max_variables)  # refuse huge graphs before any work
    start_plan = None
    if warm_start:
        try:
            from solvers.hierarchical import hierarchical

            start_plan = _explicit(problem, hierarchical(problem, budget_bytes))
        except (InfeasibleBudgetError, SolverError):
            start_plan = None
    target = budget_bytes
    last_error = None
    solving_spent = 0.0
    for _attempt in range(_RETRIES):
        attempt = _build_and_solve(problem, graph, target, max_variables, start_plan,
                                   max(0.5, time_limit - solving_spent), threads, mip_gap, progress)
        model, outcome = attempt.model, attempt.outcome
        solving_spent += attempt.solving_seconds
        if outcome.status not in ("optimal", "time_limit", "feasible"):
            remaining = max(1.0, time_limit - (time.perf_counter() - started))
            plan, info = _without_a_solution(problem, graph, outcome, budget_bytes, keep_all, keep_all_core.peak_bytes,
                                             start_plan, time_limit, remaining, max_variables, threads)
            return _finish(problem, plan, budget_bytes, started, info)
        kept, _, rec = model.schedule()
        kept, rec = _prune(problem, graph, kept, rec)
        plan = _to_plan(problem, graph, kept, rec, budget_bytes)
        result = simulate(problem, plan)
        if result.peak_bytes <= budget_bytes:
            if keep_all_core.peak_bytes <= budget_bytes and keep_all_core.recompute_cost < result.recompute_cost:
                log.info("ilp: keep-all is cheaper than the MILP's plan (conservative multi-output model)")
                return _finish(problem, _explicit(problem, keep_all), budget_bytes, started,
                               SolveInfo(status="fallback", bound=outcome.bound, candidate="keep_all"))
            info = attempt.solve_info()
            if info.status == "time_limit":
                log.warning("ilp: time limit of %.1f s reached; returning the best plan found "
                            "(recompute cost %g, lower bound %s, gap %s)", time_limit, result.recompute_cost,
                            outcome.bound, outcome.gap)
            return _finish(problem, plan, budget_bytes, started, info)
        # Aliases shared with the backward phase can make the model optimistic.
        last_error = result.peak_bytes
        log.debug("ilp: model peak within %d but simulate() says %d; retrying", target, result.peak_bytes)
        target -= result.peak_bytes - budget_bytes
    raise SolverError(f"ilp: the MILP's plans exceed the budget in simulate() (last peak {last_error} bytes "
                      f"for budget {budget_bytes}); the graph uses aliases the model does not capture")


@dataclass
class _Attempt:
    """One MILP built for a target peak and solved."""

    model: _Model
    outcome: _Outcome
    build_seconds: float
    solving_seconds: float
    warm_started: bool

    def solve_info(self) -> SolveInfo:
        outcome = self.outcome
        return SolveInfo(status="optimal" if outcome.status == "optimal" else "time_limit",
                         gap=outcome.gap, bound=outcome.bound, objective=outcome.objective,
                         details={"build_seconds": self.build_seconds, "milp_seconds": outcome.seconds,
                                  "variables": self.model.n_variables,
                                  "constraints": self.model.lp.numConstraints(),
                                  "solver": "HiGHS" if _highs_available() else "CBC",
                                  "warm_start": self.warm_started})


def _build_and_solve(problem: Problem, graph: _Graph, target: int, max_variables: int, start_plan: Plan | None,
                     time_limit: float, threads: int | None, mip_gap: float,
                     progress: Progress | None) -> _Attempt:
    """Build the MILP for peak ``target`` and solve it (from ``start_plan`` when given); if the solver's
    solution disagrees with its objective, solve again without the start."""
    build_started = time.perf_counter()
    if progress is not None:
        progress(0.05, "ilp: building the MILP")
    model = _Model(problem, graph, target, max_variables)
    build_seconds = time.perf_counter() - build_started
    start = _start_from_plan(problem, model, start_plan) if start_plan is not None else None
    if progress is not None:
        progress(0.2, f"ilp: solving ({model.n_variables:,} variables)")
    outcome = _solve(model, time_limit, start, threads, mip_gap)
    spent = outcome.seconds
    if outcome.status == "inconsistent":
        log.debug("ilp: the solver's solution disagrees with its objective; re-solving without a start")
        start = None
        model = _Model(problem, graph, target, max_variables)
        outcome = _solve(model, max(0.5, time_limit - spent), None, threads, mip_gap)
        spent += outcome.seconds
    log.debug("ilp: %s in %.2f s (objective %s, bound %s)", outcome.status, outcome.seconds,
              outcome.objective, outcome.bound)
    return _Attempt(model, outcome, build_seconds, spent, start is not None)


def _without_a_solution(problem: Problem, graph: _Graph, outcome: _Outcome, budget_bytes: int, keep_all: Plan,
                        keep_all_peak: int, start_plan: Plan | None, time_limit: float, remaining: float,
                        max_variables: int, threads: int | None) -> tuple[Plan, SolveInfo]:
    """The plan to return when the MILP gave no solution: keep-all if it fits, else the warm start.

    Raises:
        InfeasibleBudgetError: the MILP is infeasible and keep-all does not fit (with the least peak
            the MILP can reach, solved within ``remaining`` seconds).
        SolverError: the solver found no integer solution in time and there is no warm start.
    """
    if outcome.status == "infeasible":
        if keep_all_peak <= budget_bytes:
            # The model counts multi-output storages conservatively: keep-all can
            # fit where the MILP sees no room. Never fail where keep-all fits.
            log.info("ilp: the MILP found no schedule within the budget; keep-all fits, returning it")
            return _explicit(problem, keep_all), SolveInfo(status="fallback", candidate="keep_all")
        lowest = _min_feasible(problem, graph, max_variables, remaining, threads, keep_all_peak)
        raise InfeasibleBudgetError(
            budget_bytes, lowest,
            f"ilp: budget {format_bytes(budget_bytes)} ({budget_bytes} bytes) is below the smallest feasible "
            f"budget {format_bytes(lowest)} ({lowest} bytes) of any stage schedule for this graph",
        )
    if start_plan is not None:
        log.warning("ilp: no MILP solution within %.1f s (%s); returning the hierarchical plan",
                    time_limit, outcome.status)
        return (Plan(kept=start_plan.kept, schedule=start_plan.schedule, method="ilp"),
                SolveInfo(status="time_limit", candidate="hierarchical", details={"solver_status": outcome.status}))
    raise SolverError(f"ilp: the solver found no integer solution ({outcome.status}) within "
                      f"{time_limit:g} s; try a longer time_limit or method='hierarchical'")


def _min_feasible(problem: Problem, graph: _Graph, max_variables: int, time_limit: float,
                  threads: int | None, fallback: int) -> int:
    """Least simulated peak of the minimum-memory MILP (or ``fallback`` if it cannot be solved)."""
    try:
        model = _Model(problem, graph, None, max_variables)
        outcome = _solve(model, time_limit, None, threads, 1e-6)
        if outcome.status in ("optimal", "time_limit", "feasible"):
            kept, _, rec = model.schedule()
            kept, rec = _prune(problem, graph, kept, rec)
            plan = _to_plan(problem, graph, kept, rec, None)
            return min(simulate(problem, plan).peak_bytes, fallback)
    except SolverError:
        pass
    return fallback


def _finish(problem: Problem, plan: Plan, budget_bytes: int, started: float, outcome: SolveInfo) -> Plan:
    result = simulate(problem, plan)
    info = outcome.replace(predicted_peak_bytes=result.peak_bytes, recompute_cost=result.recompute_cost,
                           solve_seconds=time.perf_counter() - started)
    log.info("ilp: %s, peak %s within %s, recompute cost %g, %.2f s", info.status,
             format_bytes(result.peak_bytes), format_bytes(budget_bytes), result.recompute_cost,
             info.solve_seconds)
    return Plan(kept=plan.kept, schedule=plan.schedule, method="ilp", budget_bytes=budget_bytes, info=info)
