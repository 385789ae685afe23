"""What depth costs: capture and plan time of a Llama at 2 to 64 layers, under fake tensors (issue 21).

    python -m bench.depth                       # prints a markdown table; --layers 2 8 32 64 --reps 3

Each model (hidden 512, seq 512, bf16 weights of a Llama-3-shaped block) is
built under ``FakeTensorMode``, so nothing is allocated and the time is
ckptc's own: capture (Dynamo, AOTAutograd, pricing, and what a graph needs
once whatever the budget: its floor, block menus, nested tables and
fingerprint) and a plan at the halfway budget between the floor and the
unoptimized peak (solver ``auto``).  The plan time is the best of ``--reps``
plans of the one capture, each at a budget it has not planned before (the
halfway budget plus 0, 1, 2... bytes), so nothing budget-dependent is reused.
"""

from __future__ import annotations

import argparse
import sys
import time

import torch
from torch._subclasses.fake_tensor import FakeTensorMode

import ckptc


def llama(layers: int, hidden: int, seq: int) -> tuple[torch.nn.Module, torch.Tensor]:
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=1024,
        hidden_size=hidden,
        intermediate_size=hidden * 43 // 16,
        num_hidden_layers=layers,
        num_attention_heads=max(1, hidden // 128),
        num_key_value_heads=max(1, hidden // 512),
        max_position_embeddings=seq,
        use_cache=False,
        attn_implementation="sdpa",
    )
    default = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)  # built in bf16 (a fake tensor cannot be converted in place)
    try:
        model = LlamaForCausalLM(config).train()
    finally:
        torch.set_default_dtype(default)
    return model, torch.randint(0, 1024, (1, seq))


def measure(layers: int, hidden: int, seq: int, reps: int) -> dict[str, float]:
    torch.compiler.reset()
    with FakeTensorMode():
        model, ids = llama(layers, hidden, seq)
        start = time.perf_counter()
        step = ckptc.capture(model, (ids,), {"labels": ids})
        capture = time.perf_counter() - start
    nodes = sum(len(r.problem) for r in step.records)
    budget = (step.floor_bytes + step.unoptimized_peak_bytes) // 2
    best_plan = float("inf")
    for rep in range(reps):
        start = time.perf_counter()
        step.plan(budget_bytes=budget + rep)
        best_plan = min(best_plan, time.perf_counter() - start)
    return {"layers": layers, "nodes": nodes, "capture_s": capture, "plan_s": best_plan}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.depth", description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", nargs="+", type=int, default=[2, 8, 16, 32, 64])
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--seq", type=int, default=512)
    parser.add_argument("--reps", type=int, default=3)
    args = parser.parse_args(argv)
    rows = []
    for layers in args.layers:
        rows.append(measure(layers, args.hidden, args.seq, args.reps))
        print(f"[depth] {rows[-1]}", file=sys.stderr, flush=True)
    base = next((r for r in rows if r["layers"] == 8), rows[0])
    print("| layers | joint-graph nodes | capture | plan (halfway budget) | plan / plan at 8 layers |")
    print("| --- | --- | --- | --- | --- |")
    for r in rows:
        ratio = r["plan_s"] / base["plan_s"] if base["plan_s"] else float("nan")
        print(f"| {r['layers']} | {r['nodes']:,} | {r['capture_s']:.1f} s | {r['plan_s']:.2f} s | {ratio:.2f}x |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
