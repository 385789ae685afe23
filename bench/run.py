"""Benchmark ckptc against every alternative, side by side, in one run.

    python -m bench.run [--models gpt2 llama ...] [--size bench|tiny] [--quick] [--headline] [--out bench/results]

For each model (built by :func:`tests.zoo.get_case`, random weights), every
alternative of :mod:`bench.alternatives` runs the same training step on a
fresh copy of the model:

* eager; per-block ``torch.utils.checkpoint`` on every / every other block;
  a library's own checkpointing switch where there is one;
* ``torch.compile(backend="aot_eager")`` with ``activation_memory_budget`` swept;
* ckptc with each solver at budgets from below the smallest feasible one to
  the unoptimized peak, and ckptc's strategies "layer", "segment", "selective".

Per point: measured peak bytes (``ckptc.meter.measure_peak``, baseline
``resident_bytes(model, inputs)`` with gradients set to None, after two warm-up
steps); recompute FLOPs as a share of eager's step, counted exactly with
``torch.utils.flop_counter``'s formulas around one step (compiled graphs
included, see :func:`bench.alternatives.count_flops`); step time against eager,
interleaved repetitions, median; wall time of the first step (capture, solve,
compile) and ckptc's solve time; whether loss and every gradient equal eager's
(``torch.allclose``, rtol 1e-4, atol 1e-5, same seed before every step).

ckptc points are first decided on the step captured once per model, by
ckptc's own planner (:mod:`bench.sweep`; each measured point records whether
its real plan's predicted peak equals the offline one, ``offline_matches_run``):
a budget no plan fits is recorded as infeasible without running it, and a
(solver, budget) whose plan is identical to one already measured shares that
measurement (``same_plan_as``).

Files: this module is the command line and the orchestration (resume, order,
time budgets); :mod:`bench.points` measures one point; :mod:`bench.sweep`
decides ckptc's points on one capture; :mod:`bench.headline` is the
longest-sequence experiment; :mod:`bench.report` writes the tables and plots.

Writes ``<out>/<model>.json`` (all points, rewritten after each), ``<model>.md``,
``<model>_pareto.png`` and ``SUMMARY.md``.  ``--headline`` runs the
longest-sequence experiment instead, writing ``headline.json`` and ``headline.md``.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import platform
import time
import traceback
from pathlib import Path
from typing import Any

import torch

import ckptc
import solvers
from bench import report
from bench.alternatives import Alternative, alternatives_for, count_flops, fmt_mib
from bench.environment import loadavg, provenance, rockmate_status
from bench.headline import headline
from bench.points import ATOL, RTOL, SEED, Reference, error_text, grads_of, run_point, timed, zero_grads
from bench.sweep import Sweep, capture_step
from ckptc.meter import measure_peak, resident_bytes
from tests.zoo import MODEL_SIZES, get_case

log = logging.getLogger("bench.run")

DEFAULT_MODELS = ("gpt2", "llama", "bert", "enformer", "hyena", "vit", "mamba", "caduceus")
QUICK_MODELS = ("mlp", "gpt2")
# Alternatives whose measured peak ckptc is also run at, and how the point names them (None: the label).
MATCHED_FAMILIES = {
    "ckpt_every": "per-block",
    "ckpt_every_other": "every-other-block",
    "aot_eager": None,
    "eager": None,
}


# --------------------------------------------------------------------------- #
# Per model                                                                    #
# --------------------------------------------------------------------------- #


def size_for(name: str, size: str) -> str:
    sizes = MODEL_SIZES[name]
    if size in sizes:
        return size
    if size == "bench" and "long" in sizes:  # mamba's larger size is "long"
        return "long"
    return "tiny"


class ModelBench:
    """Runs every alternative on one model and collects the points."""

    def __init__(
        self,
        name: str,
        size: str,
        out: Path,
        *,
        reps: int = 3,
        point_timeout: float | None = 900,
        model_budget_s: float | None = None,
        ilp_time_limit: float = 30.0,
        dedupe: bool = True,
        alt_options: dict[str, Any] | None = None,
        seq_len: int | None = None,
        batch: int | None = None,
        resume: bool = False,
        file_suffix: str = "",
    ) -> None:
        self.name, self.out, self.reps = name, out, reps
        self.key = name + file_suffix  # results file name (a suffix keeps other sizes apart)
        self.size = size_for(name, size)
        self.point_timeout, self.model_budget_s = point_timeout, model_budget_s
        self.ilp_time_limit, self.dedupe = ilp_time_limit, dedupe
        self.alt_options = alt_options or {}
        self.case_kwargs = {k: v for k, v in dict(seq_len=seq_len, batch=batch).items() if v is not None}
        self.previous: dict[str, dict[str, Any]] = {}
        if resume:
            self.previous = self._load_previous()
        self.started = time.perf_counter()
        self.result: dict[str, Any] = {}

    def _load_previous(self) -> dict[str, dict[str, Any]]:
        """Points of an earlier run of the same model and shapes that need not run again."""
        path = self.out / f"{self.key}.json"
        try:
            data = json.loads(path.read_text())
        except (OSError, json.JSONDecodeError):
            return {}
        if data.get("size") != self.size or data.get("case_kwargs") != self.case_kwargs:
            return {}
        return {p["label"]: p for p in data.get("points", []) if p.get("status") not in ("skipped", "timeout")}

    # -- helpers ----------------------------------------------------------
    def log(self, msg: str) -> None:
        print(f"[{time.strftime('%H:%M:%S')}] {self.name}: {msg}", flush=True)

    def save(self) -> None:
        self.out.mkdir(parents=True, exist_ok=True)
        (self.out / f"{self.key}.json").write_text(json.dumps(self.result, indent=1, default=str) + "\n")

    # -- the run ----------------------------------------------------------
    def run(self) -> dict[str, Any]:
        t0 = time.perf_counter()
        self.case = case = get_case(self.name, size=self.size, **self.case_kwargs)
        shapes = {
            k: list(v.shape)
            for k, v in [(f"input{i}", t) for i, t in enumerate(case.example_inputs)]
            + list(case.example_kwargs.items())
        }
        self.result = {
            "model": self.key,
            "case": self.name,
            "size": self.size,
            "case_kwargs": self.case_kwargs,
            "input_shapes": shapes,
            "parameters": case.num_parameters(),
            "torch": torch.__version__,
            "ckptc": ckptc.__version__,
            "machine": {
                "platform": platform.platform(),
                "threads": torch.get_num_threads(),
                "cpus": os.cpu_count(),
                "load_avg_start": loadavg(),
            },
            "settings": {
                "reps": self.reps,
                "rtol": RTOL,
                "atol": ATOL,
                "seed": SEED,
                "ilp_time_limit_s": self.ilp_time_limit,
                "dedupe": self.dedupe,
                **{k: list(v) if isinstance(v, tuple) else v for k, v in self.alt_options.items()},
            },
            "rockmate": rockmate_status(),
            "source": provenance(),
            "points": [],
            "notes": [],
        }
        self.log(f"size={self.size} {shapes} params={case.num_parameters() / 1e6:.2f}M")

        # eager reference: loss, gradients, FLOPs
        self.reference = Reference(case, loss=torch.zeros(()), grads={}, flops=0.0)
        step = self.reference.eager_step()
        ref_loss, first_s = timed(step)
        self.reference.loss, self.reference.grads = ref_loss, grads_of(case.model)
        step()
        with count_flops() as tally:
            step()
        self.reference.flops = tally.total
        self.reference.every_op_flops = tally.every_op_total
        zero_grads(case.model)
        baseline = resident_bytes(case.model, case.example_inputs, case.example_kwargs)
        _, eager_peak = measure_peak(step, baseline_bytes=baseline)
        self.result["eager"] = {
            "flops": tally.total,
            "every_op_flops": tally.every_op_total,
            "peak_bytes": eager_peak.peak_bytes,
            "baseline_bytes": eager_peak.baseline_bytes,
            "first_step_s": first_s,
            "loss": float(ref_loss),
        }
        self.log(
            f"eager: peak {fmt_mib(eager_peak.peak_bytes)} MiB, {tally.total / 1e9:.2f} GFLOP, "
            f"first step {first_s:.1f}s"
        )

        # probe: capture the step once with ckptc for the budget range and the offline decisions
        self.sweep: Sweep | None = None
        try:
            captured = capture_step(case)
            self.sweep = Sweep(captured, time_limit=self.ilp_time_limit)
            self.result["probe"] = captured.to_dict()
            self.log(
                f"probe: {captured.graphs} graph(s), unoptimized {fmt_mib(captured.unoptimized_peak_bytes)} "
                f"MiB, smallest feasible {fmt_mib(captured.floor_bytes)} MiB, capture {captured.capture_s:.1f}s"
            )
        except Exception as error:  # noqa: BLE001
            self.log(f"probe failed: {error_text(error)}")
            self.result["probe"] = {
                "status": "error",
                "error": error_text(error),
                "traceback": traceback.format_exc(limit=-6),
            }
        self.save()

        probe = self.result["probe"]
        unopt = probe.get("unoptimized_peak_bytes") or eager_peak.peak_bytes
        floor = probe.get("min_feasible_bytes") or unopt // 2
        # Hard lower bound of any plan: parameters, buffers, inputs and every gradient.
        lower = eager_peak.baseline_bytes + sum(
            p.numel() * p.element_size() for p in case.model.parameters() if p.requires_grad
        )
        self.result["lower_bound_bytes"] = lower
        alts = alternatives_for(case.model, unopt, floor, lower=lower, **self.alt_options)
        alts = _order(alts)
        probe_failed = probe.get("status") == "error"
        # If ckptc's probe step failed, one ckptc point (auto at the largest budget, where no
        # budget error can hide the failure) records what happens; the rest would repeat it.
        ckptc_alts = [a for a in alts if a.family == "ckptc" and a.solver == "auto"]
        designated = max(ckptc_alts, key=lambda a: a.budget_bytes or 0) if ckptc_alts else None
        for alt in alts:
            if probe_failed and alt.family in ("ckptc", "ckptc_strategy") and alt is not designated:
                self.add(
                    {
                        **alt.to_dict(),
                        "status": "skipped",
                        "reason": f"ckptc's capture of the step failed: {probe.get('error')}",
                    }
                )
                continue
            elapsed = time.perf_counter() - self.started
            if self.model_budget_s is not None and elapsed > self.model_budget_s:
                self.add(
                    {
                        **alt.to_dict(),
                        "status": "skipped",
                        "reason": f"model time budget of {self.model_budget_s:.0f} s used up",
                    }
                )
                continue
            self.add(self.point(alt))
        # ckptc at exactly the peak each alternative measured (hand-written checkpointing,
        # PyTorch's budget points, eager): the like-for-like comparison (recompute and step
        # time at the same memory), interleaved in this run.
        for reference in [p for p in self.result["points"] if p.get("family") in MATCHED_FAMILIES]:
            if reference.get("status") != "ok" or not reference.get("matches_eager") or probe_failed:
                continue
            name = MATCHED_FAMILIES[reference["family"]] or reference["label"]
            alt = Alternative(
                "ckptc",
                f"ckptc auto @{name} peak",
                solver="auto",
                budget_bytes=reference["peak_bytes"],
                budget_kind="matched",
                compiled=True,
            )
            self.add({**self.point(alt), "matched_to": reference["label"]})
        self.result["total_seconds"] = time.perf_counter() - t0
        self.result["machine"]["load_avg_end"] = loadavg()
        self.save()
        return self.result

    def add(self, point: dict[str, Any]) -> None:
        self.result["points"].append(point)
        self.save()
        status = point["status"]
        if status == "ok":
            self.log(
                f"{point['label']:<38} peak {fmt_mib(point['peak_bytes']):>8} MiB  recompute "
                f"{point['recompute_pct']:6.2f}%  time x{point.get('time_ratio', float('nan')):.2f}  "
                f"match={point['matches_eager']}"
                + (f"  (= {point['same_plan_as']})" if point.get("same_plan_as") else "")
            )
        else:
            self.log(f"{point['label']:<38} {status}: {point.get('reason') or point.get('error')}")

    def point(self, alt: Alternative) -> dict[str, Any]:
        """One point: resumed from an earlier run, decided offline (infeasible, or the same plan as
        a point already measured), or measured."""
        point: dict[str, Any] = alt.to_dict()
        earlier = self.previous.get(alt.label)
        ckptc_point = alt.family in ("ckptc", "ckptc_strategy")
        sweep = self.sweep if self.dedupe and ckptc_point else None
        if earlier is not None and sweep is None:
            return {**earlier, "resumed": True}
        signature = None
        if sweep is not None:
            decision = sweep.decide(alt)
            point["offline_solve_s"] = decision.seconds
            if decision.kind == "infeasible":
                return {
                    **point,
                    "status": "infeasible",
                    "reason": error_text(decision.error),
                    "min_feasible_bytes": getattr(decision.error, "min_feasible_bytes", None),
                }
            if earlier is not None and decision.plan is None:
                return {**earlier, "resumed": True}
            if decision.kind == "error" and isinstance(decision.error, solvers.SolverError):
                # the same solver on the same capture would raise the same at the first step
                return {**point, "status": "error", "error": error_text(decision.error), "decided": "offline"}
            if decision.plan is not None:
                point.update(
                    offline_predicted_peak_bytes=decision.plan.predicted_peak_bytes,
                    offline_method=decision.plan.graphs[0].plan.method,
                )
                signature = decision.signature
                if earlier is not None:  # measured in an earlier run: register it for dedupe, do not rerun
                    if earlier.get("status") == "ok" and not earlier.get("same_plan_as"):
                        sweep.measured.setdefault(signature, earlier)
                    return {**earlier, "resumed": True}
                shared = sweep.shared(signature, point)
                if shared is not None:
                    return shared
        result = run_point(
            alt, point, self.reference, reps=self.reps, time_limit=self.ilp_time_limit, point_timeout=self.point_timeout
        )
        if sweep is not None and signature is not None and result.get("status") == "ok":
            sweep.measured[signature] = result
        return result


def _order(alts: list[Alternative]) -> list[Alternative]:
    """Run order: baselines, then ckptc auto at every budget, then the other solvers, strategies, aot_eager.

    With a model time budget, what is cut first is what matters least.
    """
    rank = {"eager": 0, "ckpt_every": 1, "ckpt_every_other": 2, "library_ckpt": 3}
    solver_rank = {"auto": 0, "hierarchical": 2, "chen_greedy": 3, "chen_sqrt": 4, "ilp": 5}

    def key(a: Alternative) -> tuple[Any, ...]:
        if a.family in rank:
            return (rank[a.family],)
        if a.family == "aot_eager":
            return (5, a.budget_fraction)
        if a.family == "ckptc":
            # the floor and the range first, then below the floor (often infeasible, decided offline)
            return (6, solver_rank.get(a.solver or "", 9), a.budget_kind != "range", abs(a.budget_fraction or 0))
        return (6, 1, a.strategy)  # ckptc's presets right after auto

    # aot_eager right after the baselines: it is the other compiler-based baseline
    return sorted(alts, key=key)


# --------------------------------------------------------------------------- #
# CLI                                                                          #
# --------------------------------------------------------------------------- #


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bench.run", description=__doc__.splitlines()[0])
    p.add_argument("--models", nargs="+", default=None, help=f"default: {' '.join(DEFAULT_MODELS)}")
    p.add_argument("--size", default="bench", help="bench (mamba: long) or tiny")
    p.add_argument("--quick", action="store_true", help="tiny sizes, few points (< 2 minutes)")
    p.add_argument("--headline", action="store_true", help="run the longest-sequence experiment instead")
    p.add_argument("--headline-budget-gb", type=float, default=1.0)
    p.add_argument("--headline-minutes", type=float, default=15.0)
    p.add_argument("--out", default="bench/results")
    p.add_argument("--budgets", type=int, default=None, help="number of ckptc budgets in [floor, unoptimized]")
    p.add_argument("--below", type=int, default=None, help="number of ckptc budgets below the floor")
    p.add_argument("--solvers", nargs="+", default=None)
    p.add_argument("--strategies", nargs="*", default=None)
    p.add_argument("--aot-budgets", nargs="*", type=float, default=None)
    p.add_argument("--reps", type=int, default=3, help="interleaved timing repetitions (median)")
    p.add_argument("--seq-len", type=int, default=None)
    p.add_argument("--batch", type=int, default=None)
    p.add_argument(
        "--override",
        nargs="*",
        default=[],
        metavar="MODEL:KEY=VALUE",
        help="per-model seq_len/batch, e.g. gpt2:batch=1 enformer:seq_len=16384",
    )
    p.add_argument("--model-minutes", type=float, default=None, help="skip a model's remaining points after this")
    p.add_argument("--point-timeout", type=float, default=900.0)
    p.add_argument("--ilp-time-limit", type=float, default=30.0)
    p.add_argument("--no-dedupe", action="store_true", help="run every ckptc point even if its plan was measured")
    p.add_argument("--file-suffix", default="", help="append to result file names, e.g. _long")
    p.add_argument(
        "--resume",
        action="store_true",
        help="keep the points of <out>/<model>.json (same shapes) and run only those skipped or missing",
    )
    return p.parse_args(argv)


def _fractions(n: int) -> tuple[float, ...]:
    return (0.0,) if n <= 1 else tuple(i / (n - 1) for i in range(n))


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    for noisy in ("solvers", "ckptc", "torch._dynamo", "torch._functorch"):
        logging.getLogger(noisy).setLevel(logging.ERROR)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if args.headline:
        kwargs = {"models": tuple(args.models)} if args.models else {}
        headline(out, args.headline_budget_gb, args.headline_minutes * 60, **kwargs)
        return 0
    size = "tiny" if args.quick else args.size
    models = tuple(args.models or (QUICK_MODELS if args.quick else DEFAULT_MODELS))
    n_budgets = args.budgets if args.budgets is not None else (2 if args.quick else 4)
    n_below = args.below if args.below is not None else (1 if args.quick else 2)
    alt_options: dict[str, Any] = {
        "fractions": _fractions(n_budgets),
        "below": {0: (), 1: (0.5,), 2: (0.5, 0.85)}.get(n_below, (0.3, 0.6, 0.9)),
        "aot_budgets": (
            tuple(args.aot_budgets)
            if args.aot_budgets is not None
            else ((0.0, 0.5, 1.0) if args.quick else (0.0, 0.25, 0.5, 0.75, 1.0))
        ),
    }
    if args.solvers:
        alt_options["solvers"] = tuple(args.solvers)
    if args.strategies is not None:
        alt_options["strategies"] = tuple(args.strategies)
    print(
        f"bench.run: models {' '.join(models)}, size {size}, out {out}; torch {torch.__version__}, "
        f"{torch.get_num_threads()} threads",
        flush=True,
    )
    overrides: dict[str, dict[str, int]] = {}
    for item in args.override:
        model_name, _, setting = item.partition(":")
        key, _, value = setting.partition("=")
        if key not in ("seq_len", "batch") or not value:
            raise SystemExit(f"bad --override {item!r}; expected MODEL:seq_len=N or MODEL:batch=N")
        overrides.setdefault(model_name, {})[key] = int(value)
    for name in models:
        shape = {"seq_len": args.seq_len, "batch": args.batch, **overrides.get(name, {})}
        bench = ModelBench(
            name,
            size,
            out,
            reps=args.reps,
            point_timeout=args.point_timeout,
            model_budget_s=None if args.model_minutes is None else args.model_minutes * 60,
            ilp_time_limit=args.ilp_time_limit,
            dedupe=not args.no_dedupe,
            alt_options=alt_options,
            seq_len=shape["seq_len"],
            batch=shape["batch"],
            resume=args.resume,
            file_suffix=args.file_suffix,
        )
        try:
            result = bench.run()
        except Exception as error:  # noqa: BLE001 - one model failing must not lose the others
            bench.log(f"FAILED: {error_text(error)}")
            bench.result.setdefault("model", bench.key)
            bench.result.setdefault("points", [])
            bench.result.update(status="error", error=error_text(error), traceback=traceback.format_exc(limit=-8))
            bench.save()
            result = bench.result
        report.write_model(out, result)
        report.write_summary(out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
