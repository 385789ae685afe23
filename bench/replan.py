"""What a plan made again costs against the first plan, through ``ckptc.optimize`` and the backend.

    python -m bench.replan [--layers 4] [--width 128] [--reps 2]

A transformers GPT-2 (random weights) trains with gradient accumulation: the
first call plans from ``None`` gradients; the second starts with gradients
resident, so its graphs plan again counting them (each from its priced joint
graph, kept from the first call: solved and rewritten again, swapped in behind
the AOTAutograd function traced by the first call, nothing traced or priced
again); the third is a steady call.  Wall-clock seconds on this machine; the
ratios are the figures to read (the last one leaves out the step the call runs).
Each round starts cold (Dynamo reset, no block class solved before).
"""

from __future__ import annotations

import argparse
import copy
import gc
import time
from typing import Any, Callable

import torch

import ckptc
from solvers.hierarchical import forget_solved_classes


def _gpt2(layers: int, width: int) -> torch.nn.Module:
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    config = GPT2Config(n_layer=layers, n_embd=width, n_head=4, vocab_size=2048, n_positions=256)
    return GPT2LMHeadModel(config).train()


def _timed(call: Callable[[], Any]) -> float:
    gc.collect()  # not a collection of an earlier round's graphs inside the timed call
    start = time.perf_counter()
    call()
    return time.perf_counter() - start


def measure(entry: str, model: torch.nn.Module, ids: torch.Tensor, budget_bytes: int) -> dict[str, float]:
    """Seconds of the first call, the call that plans again and a steady call, for one entry point."""
    torch.compiler.reset()
    forget_solved_classes()  # the first call starts cold, as in a new process
    net = copy.deepcopy(model)
    if entry == "optimize":
        trained: Any = ckptc.optimize(net, budget_bytes=budget_bytes)
    else:
        trained = torch.compile(net, backend=ckptc.backend(budget_bytes=budget_bytes, model=net))

    def call() -> None:
        trained(ids, labels=ids).loss.backward()  # gradients accumulate: resident from the second call on

    first, again, steady = _timed(call), _timed(call), _timed(call)
    return {"first": first, "again": again, "steady": steady}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--width", type=int, default=128)
    parser.add_argument("--reps", type=int, default=2, help="rounds, the entry points interleaved")
    parser.add_argument("--budget-mib", type=int, default=300)
    args = parser.parse_args(argv)
    model = _gpt2(args.layers, args.width)
    ids = torch.randint(0, 2048, (4, 256), generator=torch.Generator().manual_seed(0))
    print(
        "| entry point | first call (s) | call that plans again (s) | steady call (s) | again / first "
        "| (again - steady) / first |"
    )
    print("| --- | ---: | ---: | ---: | ---: | ---: |")
    for _ in range(args.reps):
        for entry in ("optimize", "backend"):
            r = measure(entry, model, ids, args.budget_mib * 2**20)
            print(
                f"| {entry} | {r['first']:.2f} | {r['again']:.2f} | {r['steady']:.2f} | "
                f"{r['again'] / r['first']:.2f}x | {(r['again'] - r['steady']) / r['first']:.2f}x |",
                flush=True,
            )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
