"""What the run-time budget check (``verify=True``) costs.

    python -m bench.closed_loop [--layers 2] [--seq 128] [--batch 4] [--models 3] [--steps 9]

ckptc measures the first step after each plan (on CPU through the allocator's
events in ``torch.profiler``; on CUDA through ``max_memory_allocated``).  This
script builds GPT-2 (random weights), and for each of ``--models`` fresh copies
optimizes it twice at the same budget, with ``verify=True`` and
``verify=False``, and times, interleaved, the first call (planning), the second
call (the verified one when ``verify=True``) and ``--steps`` ordinary steps.
It prints the verified step's time over an ordinary step's, and the same for
``verify=False``, so the overhead of the check is read off side by side.
"""

from __future__ import annotations

import argparse
import copy
import statistics
import time

import torch

import ckptc
from ckptc.demo import build_gpt2, train_step


def _timed(fn) -> float:  # noqa: ANN001
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.closed_loop", description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--models", type=int, default=3, help="fresh models per setting (each plans once)")
    parser.add_argument("--steps", type=int, default=9, help="ordinary steps timed after the verified one")
    args = parser.parse_args(argv)

    eager, batch = build_gpt2(args.layers, args.seq, args.batch)
    baseline = ckptc.plan(copy.deepcopy(eager), example_kwargs=batch, strategy="none")
    floor, unoptimized = baseline.min_feasible_bytes, baseline.unoptimized_peak_bytes
    budget = int(floor + 0.5 * (unoptimized - floor))

    seconds: dict[bool, dict[str, list[float]]] = {v: {"plan": [], "second": [], "ordinary": []} for v in (True, False)}
    measured: list[int | None] = []
    for _ in range(args.models):
        runs = {}
        for verify in (True, False):
            model = copy.deepcopy(eager)
            runs[verify] = (ckptc.optimize(model, budget_bytes=budget, verify=verify), list(model.parameters()))
        for key in ("plan", "second"):
            for verify in (True, False):
                fast, params = runs[verify]
                seconds[verify][key].append(_timed(lambda: train_step(fast, batch, params)))  # noqa: B023
        measured.append(runs[True][0].plan.measured_peak_bytes)
        for _ in range(args.steps):
            for verify in (True, False):
                fast, params = runs[verify]
                seconds[verify]["ordinary"].append(_timed(lambda: train_step(fast, batch, params)))  # noqa: B023

    print(
        f"GPT-2 {args.layers} layers, batch {args.batch} x {args.seq}, budget {budget:,} B "
        f"(halfway between floor {floor:,} and unoptimized {unoptimized:,}); {args.models} models per setting"
    )
    print(f"measured peaks of the verified steps: {measured}")
    print("| verify | planning call (s) | second call (s) | ordinary step (s) | second / ordinary |")
    print("| --- | ---: | ---: | ---: | ---: |")
    for verify in (True, False):
        s = seconds[verify]
        plan, second, ordinary = (statistics.median(s[k]) for k in ("plan", "second", "ordinary"))
        print(f"| {verify} | {plan:.2f} | {second:.3f} | {ordinary:.3f} | {second / ordinary:.2f}x |")
    return 0


if __name__ == "__main__":
    torch.manual_seed(0)
    raise SystemExit(main())
