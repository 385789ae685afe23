"""Headline experiment: the longest sequence that trains within a fixed budget.

    python -m bench.run --headline --headline-budget-gb 0.5

For each model, eager PyTorch, per-block checkpointing and ckptc: doubling then
bisection over the sequence length until the longest length whose peak fits
is bracketed.  Eager and per-block peaks are measured; ckptc's is its floor,
predicted from one capture of the step, and the longest length found is then
trained under the budget and measured.  Writes ``headline.json`` and
``headline.md``.
"""

from __future__ import annotations

import gc
import json
import time
from pathlib import Path
from typing import Any

import ckptc
from bench import report
from bench.alternatives import fmt_mib, wrap_blocks
from bench.environment import provenance
from bench.points import error_text, make_step, reset_compiler_state, zero_grads
from ckptc.meter import measure_peak, resident_bytes
from tests.zoo import get_case

HEADLINE_MODELS = {
    # model: (start length, granularity)
    "enformer": (16384, 128 * 16),
    "hyena": (8192, 1024),
    # mamba.py's parallel scan pads the length to a power of two, so the peak steps at powers of two.
    "caduceus": (2048, 256),
}


def _headline_peak(name: str, method: str, seq_len: int, budget: int) -> dict[str, Any]:
    """Peak of one step at ``seq_len``: measured (eager, per-block) or ckptc's predicted smallest feasible."""
    reset_compiler_state()
    case = get_case(name, size="bench", seq_len=seq_len)
    model = case.model
    out: dict[str, Any] = {"seq_len": seq_len, "method": method}
    start = time.perf_counter()
    if method == "ckptc":
        # The smallest budget ckptc can plan for (auto): predicted from the captured step.
        step = ckptc.capture(model, case.example_inputs, case.example_kwargs, loss_fn=case.loss)
        out.update(
            peak_bytes=step.floor_bytes,
            kind="predicted (ckptc min feasible)",
            unoptimized_predicted=step.unoptimized_peak_bytes,
            floor_breakdown=floor_breakdown(step),
        )
    else:
        if method == "per_block":
            wrapped, how = wrap_blocks(model, every=1)
            out["how"] = how
        step = make_step(case, model, model)
        zero_grads(model)
        _, m = measure_peak(step, baseline_bytes=resident_bytes(model, case.example_inputs, case.example_kwargs))
        out.update(peak_bytes=m.peak_bytes, kind="measured (first step)")
    out["seconds"] = time.perf_counter() - start
    out["fits"] = out["peak_bytes"] <= budget
    del case, model
    gc.collect()
    return out


def floor_breakdown(step: ckptc.CapturedStep) -> dict[str, int]:
    """What ckptc's floor is made of, for the graph that sets it: resident bytes (parameters, inputs,
    what the step holds outside the graph), activations kept for backward, the working set on top of
    them at the peak (recomputation and backward temporaries), and the planning margin."""
    record = max(step.records, key=lambda r: r.min_feasible_bytes)
    resident = record.joint_problem.problem.resident_bytes
    return {
        "floor_bytes": record.min_feasible_bytes,
        "resident_bytes": resident,
        "kept_bytes": record.floor_kept_bytes,
        "working_set_bytes": record.floor_peak_bytes - resident - record.floor_kept_bytes,
        "margin_bytes": record.min_feasible_bytes - record.floor_peak_bytes,
    }


def _verify_ckptc(name: str, seq_len: int, budget: int) -> dict[str, Any]:
    """Train two steps of ckptc at ``seq_len`` under ``budget`` and measure the second."""
    reset_compiler_state()
    case = get_case(name, size="bench", seq_len=seq_len)
    model = case.model
    start = time.perf_counter()
    fast = ckptc.optimize(model, budget_bytes=budget)
    step = make_step(case, fast, model)
    step()
    zero_grads(model)
    _, m = measure_peak(step, baseline_bytes=resident_bytes(model, case.example_inputs, case.example_kwargs))
    plan = fast.plan
    out = {
        "seq_len": seq_len,
        "measured_peak_bytes": m.peak_bytes,
        "predicted_peak_bytes": plan.predicted_peak_bytes,
        "recompute_pct_predicted": plan.recompute_percent,
        "within_budget": m.peak_bytes <= budget,
        "seconds": time.perf_counter() - start,
    }
    del fast, case, model
    reset_compiler_state()
    return out


def longest_fitting(
    name: str, method: str, budget: int, deadline_at: float, start: int, grain: int, max_len: int = 2**22
) -> dict[str, Any]:
    """Doubling then bisection over sequence length (multiples of ``grain``) until peak <= budget is bracketed."""
    trials: list[dict[str, Any]] = []
    stopped = []

    def fits(length: int) -> bool | None:
        if time.perf_counter() > deadline_at:
            stopped.append(length)
            return None
        try:
            r = _headline_peak(name, method, length, budget)
        except Exception as error:  # noqa: BLE001 - an out-of-memory or capture failure is "does not fit"
            r = {"seq_len": length, "method": method, "error": error_text(error), "fits": False}
        trials.append(r)
        print(
            f"[{time.strftime('%H:%M:%S')}] headline {name} {method} L={length}: "
            f"{fmt_mib(r.get('peak_bytes'))} MiB fits={r['fits']}",
            flush=True,
        )
        return bool(r["fits"])

    lo, hi = 0, None
    length = start
    while hi is None and length <= max_len:
        ok = fits(length)
        if ok is None:
            break
        if ok:
            lo, length = length, length * 2
        else:
            hi = length
    if lo == 0 and hi is not None:  # even the start is too long: go down
        length = hi // 2
        while length >= grain:
            ok = fits(length)
            if ok is None:
                break
            if ok:
                lo = length
                break
            hi, length = length, length // 2
    while lo and hi is not None and hi - lo > grain and hi / lo > 1.0625:
        mid = (lo + hi) // 2 // grain * grain
        if mid <= lo or mid >= hi:
            break
        ok = fits(mid)
        if ok is None:
            break
        lo, hi = (mid, hi) if ok else (lo, mid)
    return {
        "method": method,
        "longest_fitting": lo or None,
        "shortest_failing": hi,
        "trials": trials,
        "grain": grain,
        "complete": not stopped,
    }


def headline(
    out: Path, budget_gb: float = 1.0, time_budget_s: float = 900.0, models: tuple[str, ...] = tuple(HEADLINE_MODELS)
) -> dict[str, Any]:
    budget = int(budget_gb * 2**30)
    started = time.perf_counter()
    result: dict[str, Any] = {
        "budget_bytes": budget,
        "time_budget_s": time_budget_s,
        "models": {},
        "source": provenance(),
        "method_notes": {
            "none": "eager PyTorch, measured peak of the first step",
            "per_block": "torch.utils.checkpoint(use_reentrant=False) on every repeated block "
            "(bench.alternatives.wrap_blocks), measured peak of the first step",
            "ckptc": "ckptc's smallest feasible budget (predicted from the captured step) "
            "<= budget; the longest length found is then trained under the budget "
            "and measured",
        },
    }
    methods = ("none", "per_block", "ckptc")
    share = time_budget_s / (len(models) * len(methods))
    for name in models:
        start_len, grain = HEADLINE_MODELS[name]
        entry: dict[str, Any] = {}
        for method in methods:
            deadline_at = time.perf_counter() + share
            entry[method] = longest_fitting(name, method, budget, deadline_at, start_len, grain)
        best = entry["ckptc"]["longest_fitting"]
        if best:
            try:
                entry["ckptc"]["verified"] = _verify_ckptc(name, best, budget)
            except Exception as error:  # noqa: BLE001
                entry["ckptc"]["verified"] = {"error": error_text(error)}
        result["models"][name] = entry
        out.mkdir(parents=True, exist_ok=True)
        (out / "headline.json").write_text(json.dumps(result, indent=1, default=str) + "\n")
    result["seconds"] = time.perf_counter() - started
    (out / "headline.json").write_text(json.dumps(result, indent=1, default=str) + "\n")
    (out / "headline.md").write_text(report.headline_markdown(result))
    return result
