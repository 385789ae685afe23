"""ckptc with Inductor against ``torch.compile`` and its own memory savers, at matched measured peaks.

Run (CPU, 2 shared cores; a few minutes, most of it Inductor compiling)::

    nice -n 10 python -m bench.inductor --layers 4 --width 256 --batch 4 --seq-len 256 --reps 7

On a Hugging Face GPT-2 (dropout off, so every configuration's gradients can be
checked against eager), one process builds every configuration from the same
weights, checks its loss and gradients against eager PyTorch, measures its peak
(``ckptc.meter.measure_peak``, the step from ``None`` gradients, parameters and
inputs counted), then times all of them in interleaved repetitions (one step of
each configuration per round, medians over the rounds), so load from other
processes on the shared cores hits all of them alike.  Configurations:

* ``eager``; ``torch.compile`` (Inductor, the reference of the ratios);
* ``torch.compile`` of the model with Hugging Face's per-block checkpointing
  (``gradient_checkpointing_enable(use_reentrant=False)``);
* ``torch.compile`` with ``torch._functorch.config.activation_memory_budget`` at
  0.5 and 0.25 (PyTorch's min-cut partitioner under a budget), kept only where
  its gradients equal eager's;
* ``ckptc.optimize(..., compiler="inductor")`` with no budget (keep-everything),
  with the budget set to each rival's measured peak, and at ckptc's floor.

Writes ``bench/results/inductor.md`` and ``.json``.
"""

from __future__ import annotations

import argparse
import copy
import json
import platform
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import torch

import ckptc
from ckptc.meter import measure_peak, resident_bytes
from tests.zoo import gpt2_without_dropout

RESULTS = Path(__file__).resolve().parent / "results"
GRAD_RTOL, GRAD_ATOL = 1e-3, 1e-4  # fused kernels sum in another order than eager


@dataclass
class Point:
    """One configuration: how it runs a step, and what it measured."""

    label: str
    model: torch.nn.Module
    call: Callable[..., Any]
    matched: str = ""  # the rival whose measured peak is this ckptc point's budget
    budget_bytes: int | None = None
    correct: bool | None = None
    peak_bytes: int | None = None
    build_seconds: float = 0.0
    times: list[float] = field(default_factory=list)

    @property
    def median(self) -> float:
        return statistics.median(self.times)


def train_step(point: Point, ids: torch.Tensor) -> torch.Tensor:
    for p in point.model.parameters():
        p.grad = None
    loss = point.call(ids, labels=ids).loss
    loss.backward()
    return loss.detach()


def with_memory_budget(model: torch.nn.Module, fraction: float) -> Callable[..., Any]:
    """``torch.compile`` with PyTorch's activation memory budget (read when the graph is partitioned).

    A backend object of its own: Dynamo reuses a compiled graph for another instance of the
    same model class under the same backend, which would skip the partition under this budget.
    The compile caches' keys miss the budget too, so they are off for this compile.
    """
    from torch._inductor.compile_fx import compile_fx

    def inductor_under_budget(gm: torch.fx.GraphModule, example_inputs: Any) -> Any:
        with (
            torch._functorch.config.patch(activation_memory_budget=fraction, enable_autograd_cache=False),
            torch._inductor.config.patch(fx_graph_cache=False),
        ):
            return compile_fx(gm, example_inputs)

    return torch.compile(model, backend=inductor_under_budget)


def prepare(point: Point, ids: torch.Tensor, reference: list[torch.Tensor]) -> Point:
    """Compile (first step), check gradients against eager, measure the peak of a later step."""
    start = time.perf_counter()
    train_step(point, ids)
    point.build_seconds = time.perf_counter() - start
    train_step(point, ids)  # ckptc verifies its first planned step here
    for _ in range(4):  # a step measured above the budget plans again: run until a plan is verified
        plan = point.call.plan if isinstance(point.call, ckptc.OptimizedModule) else None
        if plan is None or point.budget_bytes is None:
            break
        if plan.measured_peak_bytes is not None and plan.measured_peak_bytes <= point.budget_bytes:
            break
        train_step(point, ids)
    point.correct = all(
        torch.allclose(p.grad, g, rtol=GRAD_RTOL, atol=GRAD_ATOL)
        for p, g in zip(point.model.parameters(), reference, strict=True)
    )
    for p in point.model.parameters():
        p.grad = None
    baseline = resident_bytes(point.model, ids)
    _, measured = measure_peak(lambda: train_step(point, ids), baseline_bytes=baseline)
    point.peak_bytes = measured.peak_bytes
    print(
        f"  {point.label:<44} peak {point.peak_bytes / 2**20:8.1f} MiB  grads {'ok' if point.correct else 'WRONG'}"
        f"  first step {point.build_seconds:.1f} s",
        flush=True,
    )
    return point


def paired(times: list[float], reference: list[float]) -> float | None:
    """Median over rounds of the step time over torch.compile's step in the same round: load that
    hits one round hits both, so this ratio is steadier than the ratio of medians."""
    if not times or len(times) != len(reference):
        return None
    return statistics.median(t / r for t, r in zip(times, reference, strict=True))


def run(layers: int, width: int, batch: int, seq_len: int, vocab: int, reps: int) -> dict[str, Any]:
    torch.manual_seed(0)
    base = gpt2_without_dropout(layers, width, vocab)
    ids = torch.randint(0, vocab, (batch, seq_len), generator=torch.Generator().manual_seed(1))
    reference_model = copy.deepcopy(base)
    eager = Point("eager", reference_model, reference_model)
    train_step(eager, ids)
    reference = [p.grad.clone() for p in reference_model.parameters()]

    def fresh() -> torch.nn.Module:
        return copy.deepcopy(base)

    print("rivals:", flush=True)
    points = [prepare(eager, ids, reference)]
    m = fresh()
    compiled = prepare(Point("torch.compile", m, torch.compile(m)), ids, reference)
    points.append(compiled)
    m = fresh()
    m.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    points.append(prepare(Point("torch.compile + per-block checkpoint", m, torch.compile(m)), ids, reference))
    for fraction in (0.5, 0.25):
        m = fresh()
        label = f"torch.compile + activation_memory_budget={fraction}"
        points.append(prepare(Point(label, m, with_memory_budget(m, fraction)), ids, reference))

    captured = ckptc.capture(fresh(), (ids,), {"labels": ids}, compiler="inductor")
    budgets: list[tuple[str, int | None]] = [("keep-everything", None)]
    budgets += [(p.label, p.peak_bytes) for p in points[2:] if p.correct]
    budgets.append(("ckptc floor", captured.floor_bytes))
    print(f"ckptc (floor {captured.floor_bytes / 2**20:.1f} MiB):", flush=True)
    for matched, budget in budgets:
        m = fresh()
        label = "ckptc inductor " + ("keep-everything" if budget is None else f"@ {matched}")
        if budget is not None and budget < captured.floor_bytes:
            print(f"  {label}: budget {budget} below ckptc's floor {captured.floor_bytes}", flush=True)
            continue
        fast = ckptc.optimize(m, budget_bytes=budget, compiler="inductor")
        try:
            points.append(prepare(Point(label, m, fast, matched=matched, budget_bytes=budget), ids, reference))
        except (ckptc.CkptcError, ckptc.InfeasibleBudgetError) as error:
            print(f"  {label}: refused: {str(error).splitlines()[0][:200]}", flush=True)

    timed = [p for p in points if p.correct]
    for p in timed:  # warm: the first steps compiled and verified
        train_step(p, ids)
    for round_ in range(reps):
        for p in timed:
            start = time.perf_counter()
            train_step(p, ids)
            p.times.append(time.perf_counter() - start)
        print(f"  round {round_ + 1}/{reps}", flush=True)
    by_label = {p.label: p for p in points}
    reference_time = compiled.median
    rows = []
    for p in points:
        rival = by_label.get(p.matched)
        rows.append(
            {
                "label": p.label,
                "grads_equal_eager": p.correct,
                "peak_bytes": p.peak_bytes,
                "budget_bytes": p.budget_bytes,
                "median_step_s": p.median if p.times else None,
                "vs_torch_compile": p.median / reference_time if p.times else None,
                "vs_torch_compile_paired": paired(p.times, compiled.times),
                "matched": p.matched or None,
                "vs_matched_rival_time": p.median / rival.median if rival is not None and rival.times else None,
                "vs_matched_rival_peak": p.peak_bytes / rival.peak_bytes if rival is not None else None,
                "first_step_s": p.build_seconds,
                "step_times_s": p.times,
            }
        )
    return {
        "model": f"GPT-2 (transformers), {layers} layers, width {width}, vocab {vocab}, batch {batch} x {seq_len}",
        "reps": reps,
        "torch": torch.__version__,
        "machine": f"{platform.processor() or platform.machine()}, {torch.get_num_threads()} threads",
        "ckptc_floor_bytes": captured.floor_bytes,
        "ckptc_unoptimized_peak_bytes": captured.unoptimized_peak_bytes,
        "rows": rows,
    }


def markdown(result: dict[str, Any], command: str) -> str:
    def mib(b: int | None) -> str:
        return "" if b is None else f"{b / 2**20:.1f}"

    def ratio(r: float | None) -> str:
        return "" if r is None else f"{r:.2f}x"

    lines = [
        f"{result['model']}; torch {result['torch']}; {result['machine']}; {result['reps']} interleaved rounds, "
        "medians. CPU timings are noisy (the 2 cores are shared with other processes); read the ratios.",
        "",
        f"Command: `{command}`",
        "",
        "| configuration | grads = eager | peak (MiB) | step (s) | vs torch.compile (medians) | "
        "vs torch.compile (per round) | vs matched rival: time | peak |",
        "| --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in result["rows"]:
        step = "" if r["median_step_s"] is None else f"{r['median_step_s']:.3f}"
        lines.append(
            f"| {r['label']} | {'yes' if r['grads_equal_eager'] else 'no (not timed)'} | {mib(r['peak_bytes'])} | "
            f"{step} | {ratio(r['vs_torch_compile'])} | {ratio(r.get('vs_torch_compile_paired'))} | "
            f"{ratio(r['vs_matched_rival_time'])} | {ratio(r['vs_matched_rival_peak'])} |"
        )
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--width", type=int, default=256)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--vocab", type=int, default=8192)
    parser.add_argument("--reps", type=int, default=7)
    parser.add_argument("--out", type=Path, default=RESULTS / "inductor")
    parser.add_argument("--table-only", action="store_true", help="rewrite the .md table from the .json, run nothing")
    args = parser.parse_args(argv)
    if args.table_only:
        saved = json.loads(args.out.with_suffix(".json").read_text())
        reference = next(r for r in saved["rows"] if r["label"] == "torch.compile")
        for row in saved["rows"]:
            row["vs_torch_compile_paired"] = paired(row["step_times_s"], reference["step_times_s"])
        args.out.with_suffix(".md").write_text(markdown(saved, saved["command"]))
        print(markdown(saved, saved["command"]))
        return
    command = (
        f"nice -n 10 python -m bench.inductor --layers {args.layers} --width {args.width} --batch {args.batch} "
        f"--seq-len {args.seq_len} --vocab {args.vocab} --reps {args.reps}"
    )
    result = run(args.layers, args.width, args.batch, args.seq_len, args.vocab, args.reps)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.with_suffix(".json").write_text(json.dumps({**result, "command": command}, indent=2) + "\n")
    table = markdown(result, command)
    args.out.with_suffix(".md").write_text(table)
    print(table)


if __name__ == "__main__":
    main()
