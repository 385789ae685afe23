"""Benchmark of the checkpointing solvers on random training graphs.

For graphs of about 100, 1,000 and 10,000 nodes (forward + backward) this
times every method of :data:`solvers.METHODS` at the budget halfway between
:func:`solvers.min_feasible_budget` and the keep-all peak, and reports

* solve time (wall clock, seconds),
* recompute cost relative to the ILP optimum; when the ILP times out or
  refuses the graph (too many variables), relative to the best lower bound
  known (the ILP's bound, else 0) and the table says which,
* simulated peak relative to the budget.

Results go to ``bench/results/solvers.json``; a markdown table is printed.

Usage::

    python bench/bench_solvers.py            # full run (ILP time limit 60 s)
    python bench/bench_solvers.py --quick    # < 1 minute (ILP limit 10 s, fewer graphs)
"""

from __future__ import annotations

import argparse
import json
import logging
import random
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from solvers import METHODS, InfeasibleBudgetError, Node, Problem, SolverError, min_feasible_budget, simulate  # noqa: E402
from solvers.chen import keep_all_plan  # noqa: E402

SHAPES = ("chain", "skip", "dag")


def random_training_graph(n_nodes: int, *, shape: str = "skip", seed: int = 0) -> Problem:
    """A random training step of about ``n_nodes`` nodes, shaped like what autograd builds.

    Forward: ``n`` activations in a chain, a chain with residual skips, or a
    DAG (each node reads 1-3 of the 8 previous ones), some reading one of a
    few parameters, a few views; a loss reading the sinks. Backward mirrors it:
    a gradient per forward node reading its incoming gradient and its saved
    inputs/outputs, gradient accumulation where a value has several consumers,
    and a parameter-gradient output per parameter use. Sizes are in MiB-ish
    units with a heavy tail, costs roughly proportional to sizes.
    """
    rng = random.Random(seed)
    n = max(2, n_nodes // 2 - 2)
    nodes: list[Node] = [Node("x", 4 << 20, 0.0, "input")]
    params = [f"w{k}" for k in range(4)]
    nodes += [Node(w, rng.randint(1, 8) << 20, 0.0, "input") for w in params]
    forward: list[str] = []
    fpreds: dict[str, list[str]] = {}
    uses_param: dict[str, str] = {}
    for i in range(n):
        name = f"f{i}"
        prev = forward[-1] if forward else "x"
        acts = [prev]
        if shape == "skip" and len(forward) >= 4 and i % 4 == 0:
            acts.append(forward[-4])
        elif shape == "dag" and forward:
            pool = forward[-8:]
            acts = list(dict.fromkeys([prev] + rng.sample(pool, min(len(pool), rng.randint(0, 2)))))
        preds = list(acts)
        if rng.random() < 0.4:
            w = rng.choice(params)
            preds.append(w)
            uses_param[name] = w
        view = rng.random() < 0.08 and acts[0] != "x"
        size = 0 if view else int(rng.choice([1, 1, 2, 2, 4, 8]) * rng.uniform(0.5, 1.5) * (1 << 20))
        cost = (size or (1 << 18)) * rng.uniform(0.5, 2.0) / (1 << 20)
        nodes.append(Node(name, size, cost, "forward", tuple(preds), alias_of=acts[0] if view else None))
        forward.append(name)
        fpreds[name] = acts
    consumed = {a for f in forward for a in fpreds[f]}
    sinks = [f for f in forward if f not in consumed]
    nodes.append(Node("loss", 4, 1.0, "forward", tuple(sinks), output=True))
    forward.append("loss")
    fpreds["loss"] = sinks
    consumers: dict[str, list[str]] = {a: [] for a in ["x", *forward]}
    for f in forward:
        for a in fpreds[f]:
            consumers[a].append(f)
    sizes = {nd.name: nd.bytes for nd in nodes}
    grad: dict[str, str] = {}
    for f in reversed(forward):
        if f == "loss":
            incoming = None
        else:
            sources = [grad[c] for c in consumers[f]]
            incoming = sources[0]
            if len(sources) > 1:
                incoming = f"acc_{f}"
                nodes.append(Node(incoming, sizes[f] or (1 << 20), 0.1, "backward", tuple(sources)))
        saved = [a for a in fpreds[f] if rng.random() < 0.7] or [f]
        if rng.random() < 0.3:
            saved.append(f)
        preds = ([incoming] if incoming else []) + list(dict.fromkeys(saved))
        nodes.append(Node(f"d_{f}", sizes.get(f, 0) or (1 << 20), 1.0, "backward", tuple(preds),
                          output=(f == forward[0])))
        grad[f] = f"d_{f}"
        if f in uses_param:
            wp = ([incoming] if incoming else []) + list(fpreds[f])
            nodes.append(Node(f"dw_{f}", sizes[uses_param[f]], 1.0, "backward", tuple(wp), output=True))
    return Problem(nodes=tuple(nodes))


def _run(problem: Problem, method: str, budget: int, time_limit: float) -> dict[str, Any]:
    started = time.perf_counter()
    try:
        plan = METHODS[method](problem, budget, time_limit=time_limit)
    except InfeasibleBudgetError as e:
        return {"status": "infeasible", "seconds": time.perf_counter() - started,
                "min_feasible_bytes": e.min_feasible_bytes}
    except SolverError as e:
        return {"status": "refused", "seconds": time.perf_counter() - started, "error": str(e).split(";")[0]}
    seconds = time.perf_counter() - started
    result = simulate(problem, plan)
    row = {"status": plan.info.get("status", "ok"), "seconds": seconds, "recompute_cost": result.recompute_cost,
           "peak_bytes": result.peak_bytes}
    for key in ("gap", "bound"):
        if key in plan.info:
            row[key] = plan.info[key]
    return row


def bench(sizes: list[int], shapes: list[str], ilp_time_limit: float, seed: int) -> list[dict[str, Any]]:
    records = []
    for n_nodes in sizes:
        for shape in shapes:
            problem = random_training_graph(n_nodes, shape=shape, seed=seed)
            lowest = min_feasible_budget(problem)
            highest = simulate(problem, keep_all_plan(problem)).peak_bytes
            budget = (lowest + highest) // 2
            record: dict[str, Any] = {"nodes": len(problem), "shape": shape, "forward": len(problem._forward_idx),
                                      "budget_bytes": budget, "min_feasible_bytes": lowest,
                                      "keep_all_bytes": highest, "methods": {}}
            for method in ("chen_sqrt", "chen_greedy", "hierarchical", "ilp", "auto"):
                if method not in METHODS:
                    continue
                row = _run(problem, method, budget, ilp_time_limit)
                record["methods"][method] = row
                print(f"  {len(problem):>6} nodes {shape:<5} {method:<11} {row['status']:<12} {row['seconds']:8.3f} s",
                      file=sys.stderr, flush=True)
            ilp_row = record["methods"].get("ilp", {})
            if ilp_row.get("status") == "optimal":
                record["reference"], record["reference_cost"] = "ilp optimum", ilp_row["recompute_cost"]
            elif ilp_row.get("status") == "time_limit" and ilp_row.get("bound") is not None:
                record["reference"], record["reference_cost"] = "ilp bound (time limit)", max(0.0, ilp_row["bound"])
            else:
                record["reference"], record["reference_cost"] = "0 (ilp too big)", 0.0
            records.append(record)
    return records


def table(records: list[dict[str, Any]]) -> str:
    lines = ["| nodes | shape | method | status | time (s) | cost / reference | reference | peak / budget |",
             "|---:|---|---|---|---:|---:|---|---:|"]
    for rec in records:
        ref = rec["reference_cost"]
        for method, row in rec["methods"].items():
            if "recompute_cost" in row:
                cost = row["recompute_cost"]
                if ref > 0:
                    rel = f"{cost / ref:.3f}"
                else:
                    rel = "1.000" if cost == 0 else f"+{cost:.3g} (abs)"
                peak = f"{row['peak_bytes'] / rec['budget_bytes']:.3f}"
            else:
                rel, peak = "-", "-"
            lines.append(f"| {rec['nodes']} | {rec['shape']} | {method} | {row['status']} | {row['seconds']:.3f} | "
                         f"{rel} | {rec['reference']} | {peak} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="fewer graphs and a 10 s ILP limit (< 1 minute)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "solvers.json")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.ERROR)
    if args.quick:
        sizes, shapes, limit = [100, 1000, 10000], ["skip"], 10.0
    else:
        sizes, shapes, limit = [100, 1000, 10000], list(SHAPES), 60.0
    started = time.perf_counter()
    records = bench(sizes, shapes, limit, args.seed)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"quick": args.quick, "seed": args.seed, "ilp_time_limit": limit,
                                    "seconds": time.perf_counter() - started, "graphs": records}, indent=2) + "\n")
    print(table(records))
    print(f"\n(total {time.perf_counter() - started:.1f} s; written to {args.out.relative_to(ROOT)})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
