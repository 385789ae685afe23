"""Graph coverage and variable lengths, measured on the zoo's tiny models.

    python -m bench.coverage [--models olmoe mixtral opt] [--lengths 20 24 28 31 40 50 60 64]

For each model: ``ckptc.plan(..., strategy="none")`` and its coverage report
(graphs, share of the forward's FLOPs and activations, graph-break reasons).
Then tiny GPT-2 trained over ``--lengths`` sequence lengths: seconds per call
and how many plans exist after it (``ckptc.runtime.lengths`` plans one per
power-of-two bucket once the length varies).  The README's tables come from
this script.
"""

from __future__ import annotations

import argparse
import time

import torch

import ckptc
from tests.zoo import get_case


def coverage(names: list[str]) -> None:
    for name in names:
        torch.compiler.reset()
        case = get_case(name)
        start = time.perf_counter()
        plan = ckptc.plan(case.model, case.example_inputs, case.example_kwargs, strategy="none", loss_fn=case.loss)
        print(f"== {name}: {len(plan.graphs)} graph(s), planned in {time.perf_counter() - start:.1f} s")
        print(plan.coverage)


def lengths(values: list[int]) -> None:
    torch.compiler.reset()
    case = get_case("gpt2", seq_len=max(values))
    fast = ckptc.optimize(case.model, budget_bytes=10**9)
    total = time.perf_counter()
    for n in values:
        ids = case.example_inputs[0][:, :n].contiguous()
        for p in case.model.parameters():
            p.grad = None
        start = time.perf_counter()
        fast(ids, labels=ids.clone()).loss.backward()
        print(f"length {n:4d}: {time.perf_counter() - start:6.2f} s, plans {len(fast.step_runtime.plans)}")
    print(f"{len(values)} lengths in {time.perf_counter() - total:.1f} s")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.coverage", description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="*", default=["olmoe", "mixtral", "opt"])
    parser.add_argument("--lengths", nargs="*", type=int, default=[20, 24, 28, 31, 40, 50, 60, 64])
    args = parser.parse_args(argv)
    coverage(args.models)
    if args.lengths:
        lengths(args.lengths)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
