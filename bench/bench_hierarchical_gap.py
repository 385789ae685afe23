"""How far the hierarchical solver (and auto) is from the MILP optimum on small random graphs.

For random training graphs (chains, chains with skips, random DAGs) of a few
dozen nodes, at budgets a quarter, half and three quarters of the way from
:func:`solvers.min_feasible_budget` to the keep-all peak, solves with
``hierarchical``, ``auto`` and ``ilp`` (to proven optimality) and reports each
method's recompute cost divided by the MILP optimum's: the worst, the mean,
and the share of points where it equals the optimum.  Points where the MILP
is not proved optimal, or where the optimum recomputes nothing, are skipped
(counted in the output).

Results go to ``bench/results/hierarchical_gap.json``; a markdown table is printed.

Usage::

    python bench/bench_hierarchical_gap.py                         # 3 sizes x 3 shapes x 4 seeds x 3 budgets
    python bench/bench_hierarchical_gap.py --sizes 40 60 --ilp-time-limit 20   # the README's run (~5 min)
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

from solvers import InfeasibleBudgetError, min_feasible_budget, simulate, solve  # noqa: E402
from solvers.chen import keep_all_plan  # noqa: E402
from tests.graphs import random_training_graph  # noqa: E402

SIZES = (40, 60, 80)
SHAPES = ("chain", "skip", "dag")
FRACTIONS = (0.25, 0.5, 0.75)
METHODS = ("hierarchical", "auto")


def bench(seeds: int, ilp_time_limit: float, sizes: tuple[int, ...] = SIZES) -> dict[str, Any]:
    points, skipped = [], 0
    for n_nodes in sizes:
        for shape in SHAPES:
            for seed in range(seeds):
                problem = random_training_graph(n_nodes, shape=shape, seed=seed)
                lowest = min_feasible_budget(problem)
                highest = simulate(problem, keep_all_plan(problem)).peak_bytes
                for fraction in FRACTIONS:
                    budget = int(lowest + fraction * (highest - lowest))
                    try:
                        exact = solve(problem, budget, method="ilp", time_limit=ilp_time_limit)
                    except InfeasibleBudgetError:
                        skipped += 1
                        continue
                    if exact.info.status != "optimal" or exact.info.recompute_cost <= 0:
                        skipped += 1
                        continue
                    point = {
                        "nodes": len(problem),
                        "shape": shape,
                        "seed": seed,
                        "fraction": fraction,
                        "ilp": exact.info.recompute_cost,
                    }
                    for method in METHODS:
                        point[method] = solve(problem, budget, method=method).info.recompute_cost
                    points.append(point)
                    print(
                        f"  {len(problem):>4} nodes {shape:<5} seed {seed} at {fraction:.2f}: "
                        + ", ".join(f"{m} {point[m] / point['ilp']:.3f}" for m in METHODS),
                        file=sys.stderr,
                        flush=True,
                    )
    summary = {}
    for method in METHODS:
        ratios = [p[method] / p["ilp"] for p in points]
        worst = max(range(len(points)), key=lambda k: ratios[k]) if points else None
        summary[method] = {
            "worst": max(ratios, default=None),
            "mean": sum(ratios) / len(ratios) if ratios else None,
            "optimal_share": sum(r <= 1 + 1e-9 for r in ratios) / len(ratios) if ratios else None,
            "worst_point": points[worst] if worst is not None else None,
        }
    return {"points": points, "skipped": skipped, "summary": summary}


def table(result: dict[str, Any]) -> str:
    lines = [
        "| method | worst cost / MILP optimum | mean | at the optimum | worst point |",
        "|---|---:|---:|---:|---|",
    ]
    for method, s in result["summary"].items():
        w = s["worst_point"] or {}
        where = f"{w.get('shape')} {w.get('nodes')} nodes, seed {w.get('seed')}, budget at {w.get('fraction')}"
        lines.append(f"| {method} | {s['worst']:.3f} | {s['mean']:.3f} | {100 * s['optimal_share']:.0f}% | {where} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seeds", type=int, default=4)
    parser.add_argument("--sizes", type=int, nargs="+", default=list(SIZES), help="random_training_graph sizes")
    parser.add_argument("--ilp-time-limit", type=float, default=60.0)
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "hierarchical_gap.json")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.ERROR)
    started = time.perf_counter()
    result = bench(args.seeds, args.ilp_time_limit, tuple(args.sizes))
    result["seconds"] = time.perf_counter() - started
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1, sort_keys=True) + "\n")
    print(table(result))
    print(f"\n{len(result['points'])} points ({result['skipped']} skipped), {result['seconds']:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
