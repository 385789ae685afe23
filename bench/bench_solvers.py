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
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from solvers import METHODS, InfeasibleBudgetError, Problem, SolverError, min_feasible_budget, simulate  # noqa: E402
from solvers.chen import keep_all_plan  # noqa: E402
from tests.graphs import random_training_graph  # noqa: E402

SHAPES = ("chain", "skip", "dag")


def _run(problem: Problem, method: str, budget: int, time_limit: float) -> dict[str, Any]:
    started = time.perf_counter()
    try:
        plan = METHODS[method](problem, budget, time_limit=time_limit)
    except InfeasibleBudgetError as e:
        return {
            "status": "infeasible",
            "seconds": time.perf_counter() - started,
            "min_feasible_bytes": e.min_feasible_bytes,
        }
    except SolverError as e:
        return {"status": "refused", "seconds": time.perf_counter() - started, "error": str(e).split(";")[0]}
    seconds = time.perf_counter() - started
    result = simulate(problem, plan)
    row = {
        "status": plan.info.status or "ok",
        "seconds": seconds,
        "recompute_cost": result.recompute_cost,
        "peak_bytes": result.peak_bytes,
    }
    row.update({k: v for k, v in (("gap", plan.info.gap), ("bound", plan.info.bound)) if v is not None})
    return row


def bench(sizes: list[int], shapes: list[str], ilp_time_limit: float, seed: int) -> list[dict[str, Any]]:
    records = []
    for n_nodes in sizes:
        for shape in shapes:
            problem = random_training_graph(n_nodes, shape=shape, seed=seed)
            lowest = min_feasible_budget(problem)
            highest = simulate(problem, keep_all_plan(problem)).peak_bytes
            budget = (lowest + highest) // 2
            record: dict[str, Any] = {
                "nodes": len(problem),
                "shape": shape,
                "forward": len(problem.forward_nodes),
                "budget_bytes": budget,
                "min_feasible_bytes": lowest,
                "keep_all_bytes": highest,
                "methods": {},
            }
            for method in ("chen_sqrt", "chen_greedy", "hierarchical", "ilp", "auto"):
                if method not in METHODS:
                    continue
                row = _run(problem, method, budget, ilp_time_limit)
                record["methods"][method] = row
                print(
                    f"  {len(problem):>6} nodes {shape:<5} {method:<11} {row['status']:<12} {row['seconds']:8.3f} s",
                    file=sys.stderr,
                    flush=True,
                )
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
    lines = [
        "| nodes | shape | method | status | time (s) | cost / reference | reference | peak / budget |",
        "|---:|---|---|---|---:|---:|---|---:|",
    ]
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
            lines.append(
                f"| {rec['nodes']} | {rec['shape']} | {method} | {row['status']} | {row['seconds']:.3f} | "
                f"{rel} | {rec['reference']} | {peak} |"
            )
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
    args.out.write_text(
        json.dumps(
            {
                "quick": args.quick,
                "seed": args.seed,
                "ilp_time_limit": limit,
                "seconds": time.perf_counter() - started,
                "graphs": records,
            },
            indent=2,
        )
        + "\n"
    )
    print(table(records))
    print(f"\n(total {time.perf_counter() - started:.1f} s; written to {args.out.relative_to(ROOT)})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
