"""How close the first verified step comes to the prediction, on every model of the zoo.

    python -m bench.first_step [--models gpt2 llama ...] [--size tiny] [--at 0.5] [--loss outside]
                               [--compiler inductor] [--out bench/results/first_step.md]

For each model: :func:`ckptc.capture` gives the step's floor and unoptimized
peak; ``ckptc.optimize`` at a budget ``--at`` of the way from the floor to the
unoptimized peak trains until ckptc's own run-time check has measured a step
under plans that stay (the call that plans, when the model is one graph; else
the next).  The step that plans counts the results (logits) held through
backward until a step shows the caller drops them; a model that returns its own
loss is then planned once more, and its first step under that plan is the one
compared.  The table gives the step that planned against the budget (ckptc's
measurement, when that step was measured), the first measured step under plans
that stay (0: the one that planned), its peak against the plan's prediction,
whether ckptc planned again for a measured excess over the budget, and the peak
of a later step measured independently of ckptc's check (allocator events plus
the resident parameters and inputs, :func:`tests.helpers.measure`).

``--loss outside``: models given ``labels=`` compute no loss of their own; the
caller computes cross-entropy on their logits, as many training loops do (a loss
ckptc does not capture, so only the measured step shows what it takes).

``--compiler inductor``: capture, plans and training with Inductor kernels (the
memory model of the compiler the plan targets).
"""

from __future__ import annotations

import argparse
import copy
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

import ckptc
from tests.helpers import measure, step
from tests.zoo import MODELS, ModelCase, get_case

MAX_STEPS = 4


def loss_outside(case: ModelCase) -> ModelCase:
    """``case`` with its labels taken out of the model's call: cross-entropy on the logits, computed by
    the caller (``case`` itself when its model gets no labels)."""
    kwargs = dict(case.example_kwargs)
    labels = kwargs.pop("labels", None)
    if labels is None:
        return case

    def loss(output) -> torch.Tensor:
        logits = output.logits
        return F.cross_entropy(logits.flatten(0, -2).float(), labels.flatten(), ignore_index=-100)

    return ModelCase(case.name, case.model, case.example_inputs, kwargs, loss=loss)


def first_verified_step(name: str, size: str, at: float, outside: bool = False, compiler: str = "eager") -> dict:
    """One model's row (see the module docstring)."""
    case = get_case(name, size=size)
    if outside:
        case = loss_outside(case)
    captured = ckptc.capture(
        copy.deepcopy(case.model), case.example_inputs, case.example_kwargs, loss_fn=case.loss, compiler=compiler
    )
    floor, unoptimized = captured.floor_bytes, captured.unoptimized_peak_bytes
    budget = int(floor + at * (unoptimized - floor))
    fast = ckptc.optimize(case.model, budget_bytes=budget, compiler=compiler)
    measured = predicted = at_step = planning = None
    for i in range(MAX_STEPS):
        step(case, fast)
        if i == 0:
            planning = fast.plan.measured_peak_bytes
        if fast.plan.measured_peak_bytes is not None and not any(
            shape.needs_replan for shape in fast.step_runtime.plans.values()
        ):
            # The plan the measured step ran: the next call makes a new one if it was over the budget.
            measured, predicted, at_step = fast.plan.measured_peak_bytes, fast.plan.predicted_peak_bytes, i
            break
    later = measure(case, fast).peak_bytes
    # Read after the later step: a measured excess is counted (and planned again) when the next step begins.
    replans = max(shape.replans.replans for shape in fast.step_runtime.plans.values())
    return {
        "model": name,
        "budget": budget,
        "planning": planning,
        "predicted": predicted,
        "measured": measured,
        "step": at_step,
        "replans": replans,
        "later": later,
    }


def _mib(n: int | None) -> str:
    return "-" if n is None else f"{n / 2**20:.2f}"


def table(rows: list[dict]) -> str:
    lines = [
        "| model | budget MiB | step that planned / budget | first measured step of the plans that stay | "
        "predicted MiB | measured MiB | measured / predicted | replanned | later step (independent) / budget |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | --- | ---: |",
    ]
    for r in rows:
        ratio = "-" if r["measured"] is None or not r["predicted"] else f"{r['measured'] / r['predicted']:.4f}"
        planning = "-" if r["planning"] is None else f"{r['planning'] / r['budget']:.4f}"
        lines.append(
            f"| {r['model']} | {_mib(r['budget'])} | {planning} | {'-' if r['step'] is None else r['step']} | "
            f"{_mib(r['predicted'])} | {_mib(r['measured'])} | {ratio} | "
            f"{'yes' if r['replans'] else 'no'} | {r['later'] / r['budget']:.4f} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.first_step", description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=list(MODELS), help="models of tests.zoo (default: all)")
    parser.add_argument("--size", default="tiny", help="zoo size (default: %(default)s)")
    parser.add_argument("--at", type=float, default=0.5, help="budget between floor (0) and unoptimized (1)")
    parser.add_argument(
        "--loss", choices=("model", "outside"), default="model", help="who computes the loss (default: %(default)s)"
    )
    parser.add_argument(
        "--compiler", choices=("eager", "inductor"), default="eager", help="the plans' compiler (default: %(default)s)"
    )
    parser.add_argument("--out", type=Path, default=None, help="also write the table to this markdown file")
    args = parser.parse_args(argv)
    torch.manual_seed(0)
    rows = []
    for name in args.models:
        try:
            rows.append(
                first_verified_step(name, args.size, args.at, outside=args.loss == "outside", compiler=args.compiler)
            )
        except ckptc.CkptcError as error:
            print(f"{name}: {type(error).__name__}: {str(error).splitlines()[0]}", file=sys.stderr)
            continue
        print(table(rows[-1:]).splitlines()[-1], flush=True)
    text = (
        f"First verified step against the prediction (`python -m bench.first_step --size {args.size} "
        f"--at {args.at} --loss {args.loss} --compiler {args.compiler}`; budget {args.at} of the way from the "
        f"floor to the unoptimized peak)\n\n{table(rows)}\n"
    )
    print(text)
    if args.out is not None:
        args.out.write_text(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
