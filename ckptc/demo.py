"""Demo: plan and train a real Hugging Face GPT-2 under a memory budget.

    python -m ckptc.demo [--layers 4] [--seq 256] [--batch 8] [--fraction 0.5]

Builds GPT-2 from a config with random weights (nothing is downloaded),
measures its unoptimized peak, plans it under a budget between the smallest
feasible budget and that peak, trains a few steps with the optimized model and
prints what was saved: unoptimized peak, budget, predicted and measured peak,
recompute FLOPs as a share of the step, and the step-time ratio against eager
PyTorch measured in the same run.
"""

from __future__ import annotations

import argparse
import copy
import statistics
import time
from typing import Any, Callable

import torch

import ckptc
from ckptc.meter import measure_peak, resident_bytes
from solvers.errors import format_bytes


def build_gpt2(layers: int, seq: int, batch: int, seed: int = 0) -> tuple[torch.nn.Module, dict[str, torch.Tensor]]:
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(seed)
    config = GPT2Config(
        n_layer=layers, n_embd=256, n_head=4, vocab_size=2048, n_positions=max(seq, 128), use_cache=False
    )
    config._attn_implementation = "eager"
    model = GPT2LMHeadModel(config).train()
    model.loss_type = "ForCausalLM"  # transformers' default; saying so avoids a warning (and a graph break) per step
    ids = torch.randint(0, config.vocab_size, (batch, seq))
    return model, {"input_ids": ids, "labels": ids}


def train_step(
    model: Callable[..., Any], batch: dict[str, torch.Tensor], params: list[torch.nn.Parameter]
) -> torch.Tensor:
    """One training step of the demo's model: clear ``params``' gradients, run ``model(**batch).loss`` backward."""
    for p in params:
        p.grad = None
    loss = model(**batch).loss
    loss.backward()
    return loss.detach()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m ckptc.demo", description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument(
        "--fraction",
        type=float,
        default=0.5,
        help="budget = smallest feasible + fraction * (unoptimized - smallest feasible)",
    )
    parser.add_argument(
        "--steps",
        type=int,
        default=15,
        help="interleaved timed steps per model; the ratio is the median of per-pair ratios",
    )
    args = parser.parse_args(argv)

    torch.set_num_threads(max(1, torch.get_num_threads()))
    eager, batch = build_gpt2(args.layers, args.seq, args.batch)
    print(
        f"GPT-2 ({args.layers} layers, {sum(p.numel() for p in eager.parameters()) / 1e6:.1f} M parameters), "
        f"batch {args.batch} x {args.seq} tokens, on CPU"
    )

    t0 = time.perf_counter()
    baseline_plan = ckptc.plan(copy.deepcopy(eager), example_kwargs=batch, strategy="none")
    unoptimized = baseline_plan.unoptimized_peak_bytes
    floor = baseline_plan.min_feasible_bytes
    budget = int(floor + args.fraction * max(0, unoptimized - floor))
    print(f"captured and priced the step in {time.perf_counter() - t0:.1f} s")

    model = copy.deepcopy(eager)
    optimized = ckptc.optimize(model, budget_bytes=budget)
    params = list(model.parameters())
    eager_params = list(eager.parameters())
    t0 = time.perf_counter()
    train_step(optimized, batch, params)  # first call: capture, solve, rewrite
    print(f"planned under the budget in {time.perf_counter() - t0:.1f} s (first step included)")
    for _ in range(2):  # warm-up: the first runs allocate one-time buffers
        train_step(optimized, batch, params)
        train_step(eager, batch, eager_params)
    plan = optimized.plan

    for p in params + eager_params:  # each step starts from None gradients
        p.grad = None
    _, measured = measure_peak(
        lambda: train_step(optimized, batch, params), baseline_bytes=resident_bytes(model, batch)
    )
    _, measured_eager = measure_peak(
        lambda: train_step(eager, batch, eager_params), baseline_bytes=resident_bytes(eager, batch)
    )

    ratios = []
    for _ in range(args.steps):  # interleaved pairs, so machine noise hits both alike
        t0 = time.perf_counter()
        train_step(eager, batch, eager_params)
        eager_seconds = time.perf_counter() - t0
        t0 = time.perf_counter()
        train_step(optimized, batch, params)
        ratios.append((time.perf_counter() - t0) / eager_seconds)
    ratio = statistics.median(ratios)
    quartiles = statistics.quantiles(ratios, n=4) if len(ratios) >= 2 else [ratio, ratio, ratio]

    rows = [
        ("eager PyTorch peak (measured)", format_bytes(measured_eager.peak_bytes)),
        # Below eager's peak: ckptc keeps one copy of each storage where eager autograd
        # may save a view and a contiguous copy of it.
        ("ckptc keeping everything (predicted)", format_bytes(unoptimized)),
        ("smallest feasible budget", format_bytes(floor)),
        ("budget", format_bytes(budget)),
        ("predicted peak", f"{format_bytes(plan.predicted_peak_bytes)} ({plan.predicted_peak_bytes:,} bytes)"),
        ("measured peak", f"{format_bytes(measured.peak_bytes)} ({measured.peak_bytes:,} bytes)"),
        ("memory saved vs eager", f"{100 * (1 - measured.peak_bytes / measured_eager.peak_bytes):.1f} %"),
        ("recompute FLOPs", f"{plan.recompute_percent:.1f} % of the step"),
        (
            "step time vs eager",
            f"{ratio:.2f}x (median of {args.steps} interleaved pairs; quartiles {quartiles[0]:.2f}-{quartiles[2]:.2f})",
        ),
        ("kept / recomputed values", f"{len(plan.values('kept'))} / {len(plan.values('recomputed'))}"),
    ]
    width = max(len(r[0]) for r in rows)
    print()
    for label, value in rows:
        print(f"  {label:<{width}}  {value}")
    within = measured.peak_bytes <= budget
    print(f"\nmeasured peak {'is within' if within else 'EXCEEDS'} the budget")
    return 0 if within else 1


if __name__ == "__main__":
    raise SystemExit(main())
