"""ckptc under FSDP2 with 2 ranks (gloo, CPU): per-rank measured peak and recompute FLOPs.

    python -m bench.distributed                      # writes bench/results/distributed.md
    python -m bench.distributed --size tiny --quick  # a smoke run

Side by side in one run (one process group, the same model and inputs per rank):

* FSDP2 without checkpointing (``fully_shard`` on every block and the root);
* FSDP2 with ``apply_activation_checkpointing`` on every block (checkpoint wrappers
  applied before ``fully_shard``, the usual order);
* ``ckptc.optimize`` after ``fully_shard`` at several per-rank budgets: the
  per-block run's measured peak, points between it and the no-checkpointing
  peak, and ckptc's floor (from the ``InfeasibleBudgetError`` of a budget
  below it).

Peaks are per rank, measured with ``ckptc.meter`` (allocator events plus the
local shards and inputs resident when the step begins), after ckptc's closed
loop has verified its plan; the table gives the larger rank's.  Recompute is
the step's FLOPs above the no-checkpointing step's (FlopCounterMode formulas,
compiled graphs included).
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import socket
import sys
import time
from pathlib import Path
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

RESULTS = Path(__file__).resolve().parent / "results"
WORLD = 2
MiB = 2**20


def _model(size: str, seq_len: int | None, batch: int | None) -> tuple[torch.nn.Module, torch.Tensor]:
    from tests.zoo import get_case

    case = get_case("gpt2", size=size, seq_len=seq_len, batch=batch)
    return case.model, case.example_inputs[0]


def _shard(model: torch.nn.Module) -> torch.nn.Module:
    from torch.distributed.fsdp import fully_shard

    for block in model.transformer.h:
        fully_shard(block)
    fully_shard(model)
    return model


def _per_block_checkpointing(model: torch.nn.Module) -> torch.nn.Module:
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import apply_activation_checkpointing

    block_type = type(model.transformer.h[0])
    apply_activation_checkpointing(model, check_fn=lambda m: isinstance(m, block_type))
    return model


def _step(module: Any, ids: torch.Tensor, seed: int) -> torch.Tensor:
    torch.manual_seed(seed)
    out = module(ids, labels=ids.clone())
    out.loss.backward()
    return out.loss.detach()


def _zero(model: torch.nn.Module) -> None:
    for p in model.parameters():
        p.grad = None


def _largest(value: int) -> int:
    t = torch.tensor([value], dtype=torch.int64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return int(t)


def _measure(
    label: str,
    model: torch.nn.Module,
    module: Any,
    ids: torch.Tensor,
    rank: int,
    warmup: int,
    log: Callable[[str], None],
) -> dict[str, Any]:
    from bench.alternatives import count_flops
    from ckptc.meter import measure_peak, resident_bytes

    start = time.perf_counter()
    for i in range(warmup):  # ckptc: plan, measure, correct, verify
        _zero(model)
        _step(module, ids, seed=i)
    _zero(model)
    _, m = measure_peak(lambda: _step(module, ids, seed=99 + rank), baseline_bytes=resident_bytes(model, ids))
    _zero(model)
    with count_flops() as tally:
        _step(module, ids, seed=99 + rank)
    _zero(model)
    t0 = time.perf_counter()
    _step(module, ids, seed=99 + rank)
    step_s = time.perf_counter() - t0
    row = {
        "label": label,
        "peak_bytes": m.peak_bytes,
        "max_rank_peak_bytes": _largest(m.peak_bytes),
        "flops": tally.total,
        "step_seconds": step_s,
        "seconds": time.perf_counter() - start,
    }
    log(
        f"{label}: rank {rank} peak {m.peak_bytes / MiB:.1f} MiB (max over ranks "
        f"{row['max_rank_peak_bytes'] / MiB:.1f}), {tally.total / 1e9:.2f} GFLOP, step {step_s:.2f} s"
    )
    return row


def _worker(rank: int, port: int, options: dict[str, Any], out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=WORLD)
    import ckptc

    def log(message: str) -> None:
        if rank == 0:
            print(message, flush=True)

    template, like = _model(options["size"], options["seq_len"], options["batch"])
    ids = torch.randint(0, template.config.vocab_size, like.shape, generator=torch.Generator().manual_seed(rank))
    rows = []
    model = _shard(copy.deepcopy(template))
    rows.append(_measure("FSDP2, no checkpointing", model, model, ids, rank, 1, log))
    del model
    model = _shard(_per_block_checkpointing(copy.deepcopy(template)))
    rows.append(_measure("FSDP2 + apply_activation_checkpointing (every block)", model, model, ids, rank, 1, log))
    del model
    none_peak, per_block_peak = rows[0]["max_rank_peak_bytes"], rows[1]["max_rank_peak_bytes"]

    budgets = [("per-block peak", per_block_peak)]
    for fraction in options["fractions"]:
        between = int(per_block_peak + fraction * (none_peak - per_block_peak))
        budgets.append((f"{fraction:.0%} of the way to no-ckpt", between))
    budgets.append(("ckptc floor", int(0.5 * per_block_peak)))  # below the floor: the error names it
    for name, budget in budgets:
        for attempt in range(3):  # below the floor: the error names a budget that works; take it
            torch.compiler.reset()
            model = _shard(copy.deepcopy(template))
            fast = ckptc.optimize(model, budget_bytes=budget)
            try:
                row = _measure(f"ckptc @ {name}", model, fast, ids, rank, options["warmup"], log)
                break
            except (ckptc.InfeasibleBudgetError, ckptc.BudgetExceededError) as error:
                floor = getattr(error, "min_feasible_bytes", None)
                if floor is None or attempt == 2:
                    raise
                floor = _largest(floor)
                log(f"ckptc at {budget / MiB:.2f} MiB: {type(error).__name__}, it names {floor / MiB:.2f} MiB")
                if name != "ckptc floor":
                    row = {"label": f"ckptc @ {name}", "budget_bytes": budget, "infeasible_floor_bytes": floor}
                    break
                budget = floor
        if "infeasible_floor_bytes" in row:
            rows.append(row)
            continue
        row["budget_bytes"] = budget
        plan = fast.plan
        row["predicted_peak_bytes"] = plan.predicted_peak_bytes if plan else None
        row["graphs"] = len(fast.step_runtime.step_records())
        rows.append(row)
        del model, fast
    if rank == 0:
        Path(out).write_text(json.dumps({"rows": rows, "options": options}))
    dist.destroy_process_group()


def _render(data: dict[str, Any], command: str, seconds: float) -> str:
    rows, options = data["rows"], data["options"]
    base = rows[0]["flops"]
    lines = [
        "# ckptc under FSDP2, 2 ranks (gloo, CPU)",
        "",
        f"Made with `{command}` ({seconds:.0f} s), torch {torch.__version__}: transformers GPT-2 from "
        f"`tests.zoo` size `{options['size']}` (seq_len {options['seq_len'] or 'default'}, batch "
        f"{options['batch'] or 'default'} per rank, dropout 0.1), `fully_shard` on every block and the root.",
        "Peak: per rank, allocator events plus what the rank holds when the step begins (local shards, inputs), "
        "after ckptc's closed loop verified its plan; the larger rank's. Recompute: FLOPs above the "
        "no-checkpointing step's.",
        "",
        "| configuration | per-rank budget | per-rank measured peak | within budget | recompute | step time |",
        "| --- | ---: | ---: | :---: | ---: | ---: |",
    ]
    for r in rows:
        budget = r.get("budget_bytes")
        budget_s = "-" if budget is None else f"{budget / MiB:.1f} MiB"
        if "infeasible_floor_bytes" in r:
            lines.append(
                f"| {r['label']} | {budget_s} | infeasible (floor {r['infeasible_floor_bytes'] / MiB:.1f} MiB)"
                " | - | - | - |"
            )
            continue
        peak = r["max_rank_peak_bytes"]
        within = "-" if budget is None else ("yes" if peak <= budget else "**no**")
        recompute = 100.0 * (r["flops"] - base) / base if base else 0.0
        lines.append(
            f"| {r['label']} | {budget_s} | {peak / MiB:.1f} MiB | {within} | {recompute:.1f}% | "
            f"{r['step_seconds']:.2f} s |"
        )
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", default="bench", choices=["tiny", "bench"])
    parser.add_argument("--seq-len", type=int, default=None)
    parser.add_argument("--batch", type=int, default=None)
    parser.add_argument("--fractions", type=float, nargs="*", default=[0.5, 0.75, 0.9])
    parser.add_argument("--warmup", type=int, default=6, help="steps before measuring (ckptc's closed loop)")
    parser.add_argument("--quick", action="store_true", help="one budget between per-block and no checkpointing")
    parser.add_argument("-o", "--output", type=Path, default=RESULTS / "distributed.md")
    args = parser.parse_args(argv)
    options = {
        "size": args.size,
        "seq_len": args.seq_len,
        "batch": args.batch,
        "fractions": [0.5] if args.quick else args.fractions,
        "warmup": args.warmup,
    }
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    raw = args.output.with_suffix(".json")
    args.output.parent.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    mp.spawn(_worker, args=(port, options, str(raw)), nprocs=WORLD, join=True)
    command = "python -m bench.distributed " + " ".join(sys.argv[1:] if argv is None else argv)
    args.output.write_text(_render(json.loads(raw.read_text()), command.strip(), time.perf_counter() - start))
    print(args.output.read_text())


if __name__ == "__main__":
    main()
