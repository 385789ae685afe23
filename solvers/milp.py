"""The Checkmate MILP behind :func:`solvers.ilp.ilp`: stage graph, model and solver.

:func:`stage_graph` reduces a :class:`~solvers.problem.Problem` to positions
and stages; :class:`MilpModel` builds the MILP in pulp with
:meth:`~MilpModel.add_variables`, :meth:`~MilpModel.add_constraints` and
:meth:`~MilpModel.add_objective` (the formulation is described in
:mod:`solvers.ilp`); :func:`solve_model` runs HiGHS (or CBC) on it
(:func:`make_milp_solver`, also used by the hierarchical solver's MILP options).
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
from dataclasses import dataclass
from typing import Any, Iterator

from solvers.errors import SolverError
from solvers.graph import storage_roots
from solvers.problem import BACKWARD_CODE, FORWARD_CODE, RECOMPUTE_CODE, SAVE_CODE, Problem

log = logging.getLogger("solvers.ilp")


# ============================================================== model data
def scratch_bytes(problem: Problem) -> list[int]:
    return problem._scratch


@dataclass
class StageGraph:
    """Index data of the problem restricted to what the MILP needs."""

    forward: list[int]  # relevant forward nodes, problem order
    backward: list[int]
    pos: dict[int, int]  # forward node -> position in `forward`
    forced: set[int]  # computed in forward no matter what (ancestors of outputs)
    recomputable: list[bool]  # by forward position
    keepable: list[bool]
    needed_from: list[int]  # by forward position: first stage... (see stage_graph)
    last_stage: list[int]  # by forward position: last stage that may need it, -1 if none
    fwd_consumers: list[list[int]]  # by forward position: forward consumers' positions
    reads: list[list[int]]  # by stage: forward positions (non-output) the backward node reads
    G: list[int]
    H: list[int]
    storage: list[int]  # by forward position: storage root node (-1: none/resident)
    view_holds: dict[int, list[tuple[int, int]]]  # forward root -> [(birth, death) stages of backward views]
    resident: list[bool]  # by forward position: output-like (alive from its forward step on, never recomputed)
    out_groups: set[int]  # storage roots shared with an output


def stage_graph(problem: Problem) -> StageGraph:
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
    out_groups = {alias_root[v] for v in problem._forward_idx if output[v] and kind[alias_root[v]] == FORWARD_CODE}
    resident_value = [
        bool(output[v]) or (alias_root[v] in out_groups and policy[v] != RECOMPUTE_CODE)
        if kind[v] == FORWARD_CODE
        else False
        for v in range(len(problem.nodes))
    ]

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
    recomputable = [not resident_value[v] and policy[v] != SAVE_CODE for v in forward]
    keepable = [not resident_value[v] and policy[v] != RECOMPUTE_CODE for v in forward]
    fwd_consumers = [[pos[c] for c in consumers[v] if kind[c] == FORWARD_CODE and c in pos] for v in forward]
    reads = [[pos[v] for v in dict.fromkeys(fwd_preds[b]) if not resident_value[v] and v in pos] for b in backward]

    # Backward storages (fixed by the order): alive at G[q] (node q's allocation)
    # and H[q] (before recomputations of stage q). Forward outputs are resident.
    resident = problem.resident_bytes
    out_bytes = 0
    seen: set[int] = set()
    for v in problem._forward_idx:
        r = alias_root[v]
        if output[v] and kind[r] == FORWARD_CODE and r not in seen:
            seen.add(r)
            out_bytes += nbytes[r]
    birth: dict[int, int] = {}
    death: dict[int, int] = {}
    view_holds: dict[int, list[tuple[int, int]]] = {}
    for q, b in enumerate(backward):
        if output[b]:
            d = B
        else:
            d = max([q] + [stage[c] for c in consumers[b] if kind[c] == BACKWARD_CODE])
        r = alias_root[b]
        if kind[r] == FORWARD_CODE:
            view_holds.setdefault(r, []).append((q, d))
            continue
        if kind[r] != BACKWARD_CODE or nbytes[r] == 0:
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
    scratch = scratch_bytes(problem)
    for q, b in enumerate(backward):
        G[q] += scratch[b]

    storage = []
    for v in forward:
        r = alias_root[v]
        if r in out_groups and v != r:
            # A view or getitem of a resident storage allocates nothing new.
            storage.append(-1)
        else:
            storage.append(r if kind[r] == FORWARD_CODE and nbytes[r] > 0 and not output[r] else -1)
    return StageGraph(
        forward,
        backward,
        pos,
        {pos[v] for v in forced if v in pos},
        recomputable,
        keepable,
        [],
        [last_stage.get(v, -1) for v in forward],
        fwd_consumers,
        reads,
        G,
        H,
        storage,
        view_holds,
        [resident_value[v] for v in forward],
        out_groups,
    )


# ============================================================== the model
class MilpBuildTimeout(SolverError):
    """Building the MILP took longer than its solver's time limit (pulp builds large models slowly)."""


class MilpModel:
    """The MILP in pulp form, plus what is needed to read a schedule back."""

    def __init__(
        self,
        problem: Problem,
        graph: StageGraph,
        budget: int | None,
        max_variables: int,
        deadline: float | None = None,
    ) -> None:
        import pulp

        self.pulp = pulp
        self.problem, self.g = problem, graph
        self.budget = budget
        self.deadline = deadline  # time.perf_counter() past which building stops (MilpBuildTimeout)
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
            self._check_deadline()
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

    def _check_deadline(self) -> None:
        if self.deadline is not None and time.perf_counter() > self.deadline:
            raise MilpBuildTimeout(
                f"building the MILP ({len(self.g.forward)} forward values, {len(self.g.backward)} backward stages) "
                "took longer than the time limit"
            )

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
                for b0, d0 in holds:
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
        scratch = scratch_bytes(problem)
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
        scratch = scratch_bytes(self.problem)
        for t in range(len(g.backward)):
            self._check_deadline()
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
        return self.estimate_size(self.g, max_variables)

    @staticmethod
    def estimate_size(g: StageGraph, max_variables: int) -> int:
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


def highs_available() -> bool:
    try:
        import highspy  # noqa: F401
    except ImportError:
        return False
    return True


def make_milp_solver(
    time_limit: float, start: dict[str, float] | None, threads: int | None, gap: float, work_limit: int | None = None
):
    """A pulp solver: HiGHS when ``highspy`` is installed, else the CBC binary pulp ships (also used by
    the hierarchical solver's MILP options).

    ``work_limit`` stops the search after that many units of work: with HiGHS, the MIP solver's
    interrupt checkpoints (it reaches them at fixed points of its search: after presolve, after each
    root cut round and heuristic, at every branch-and-bound node); with CBC, branch-and-bound nodes.
    Unlike ``time_limit`` it cuts the search at the same point at any machine load, so with one
    thread the same model gives the same solution (:data:`WORK_LIMIT_STATUS` when it cut).
    """
    import pulp

    if not highs_available():
        return pulp.PULP_CBC_CMD(
            msg=False,
            timeLimit=time_limit,
            gapRel=gap,
            threads=threads,
            warmStart=start is not None,
            maxNodes=work_limit,
        )

    class _HiGHS(pulp.HiGHS):
        """pulp's HiGHS, created quietly, optionally given a starting solution and a work limit."""

        work_done = 0

        def createAndConfigureSolver(self, lp):  # noqa: N802 (pulp's name)
            _restart_highs_scheduler()
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
            if work_limit is not None:

                def checkpoint(event, solver=self) -> None:
                    solver.work_done += 1
                    if solver.work_done > work_limit:
                        event.interrupt()

                lp.solverModel.cbMipInterrupt.subscribe(checkpoint)
            super().callSolver(lp)

    return _HiGHS(msg=False, timeLimit=time_limit, gapRel=gap, threads=int(threads or 0))


WORK_LIMIT_STATUS = "work_limit"


def _restart_highs_scheduler() -> None:
    """Restart HiGHS's process-wide thread scheduler before each of ckptc's solves.

    HiGHS starts one scheduler per process with the first solve's ``threads``; a later solve asking
    for another count fails without a solution (status kNotset), so which MILPs succeeded would
    depend on which solve ran first in the process -- a solve ckptc did not make included (a user's
    pulp model, another library: remembering ckptc's own last count missed those).  A restart of
    an idle scheduler costs under a microsecond; the next solve starts it with its own ``threads``.
    """
    import highspy

    highspy.Highs.resetGlobalScheduler(True)


@dataclass
class SolveOutcome:
    status: str
    objective: float | None
    bound: float | None
    gap: float | None
    seconds: float


def solve_model(
    model: MilpModel,
    time_limit: float,
    start: dict[str, float] | None,
    threads: int | None,
    gap: float,
    work_limit: int | None = None,
) -> SolveOutcome:
    import pulp

    lp = model.lp
    solver = make_milp_solver(time_limit, start, threads, gap, work_limit)
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
        elif model_status in (highspy.HighsModelStatus.kInfeasible, highspy.HighsModelStatus.kUnboundedOrInfeasible):
            status = "infeasible"
        elif model_status == highspy.HighsModelStatus.kTimeLimit:
            status = "time_limit" if has_solution else "time_limit_no_solution"
        elif model_status in (highspy.HighsModelStatus.kInterrupt, highspy.HighsModelStatus.kSolutionLimit):
            status = WORK_LIMIT_STATUS if has_solution else f"{WORK_LIMIT_STATUS}_no_solution"
        else:
            status = (
                "optimal"
                if has_solution and lp.sol_status == pulp.LpSolutionOptimal
                else ("feasible" if has_solution else str(model_status))
            )
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
        elif seconds >= time_limit * 0.95:
            status = "time_limit"
        elif lp.sol_status == pulp.LpSolutionIntegerFeasible:
            status = WORK_LIMIT_STATUS if work_limit is not None else "time_limit"
        if status == "optimal":
            bound, gap_value = objective, 0.0
    if status == "optimal" and gap_value is None:
        bound, gap_value = objective, 0.0
    if status == "optimal" and bound is not None and objective is not None:
        gap_value = 0.0 if abs(objective - bound) <= 1e-9 * max(1.0, abs(objective)) else gap_value
    return SolveOutcome(status, objective, bound, gap_value, seconds)
