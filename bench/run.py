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

ckptc points are first decided on the problem captured once per model, by
ckptc's own decision code (``CheckpointCompiler._decide``, as at its first
step; each measured point records whether its real plan's predicted peak
equals the offline one, ``offline_matches_run``): a budget no
plan fits is recorded as infeasible without running it, and a (solver, budget)
whose plan is identical to one already measured shares that measurement
(``same_plan_as``).  Models captured as several graphs run every point.

Writes ``<out>/<model>.json`` (all points, rewritten after each), ``<model>.md``,
``<model>_pareto.png`` and ``SUMMARY.md`` (:mod:`bench.report`).  ``--headline``
runs the longest-sequence experiment (:func:`headline`) instead, writing
``headline.json`` and ``headline.md``.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import gc
import importlib
import json
import logging
import os
import platform
import signal
import statistics
import sys
import time
import traceback
from pathlib import Path
from typing import Any, Callable, Iterator

import torch

import ckptc
import solvers
from bench import report
from bench.alternatives import Alternative, Runner, Skip, alternatives_for, count_flops, fmt_mib, wrap_blocks
from ckptc.compiler import CheckpointCompiler
from ckptc.meter import measure_peak, resident_bytes
from tests.zoo import MODEL_SIZES, ModelCase, get_case

log = logging.getLogger("bench.run")

SEED = 1234
RTOL, ATOL = 1e-4, 1e-5
DEFAULT_MODELS = ("gpt2", "llama", "bert", "enformer", "hyena", "vit", "mamba", "caduceus")
QUICK_MODELS = ("mlp", "gpt2")

ROCKMATE_NOTE = (
    "Rockmate not included. `pip install rockmate==2.0.0` (tried once) installs rockmate 2.0.0 and rkgb 2.0.0 "
    "but pins pulp==2.7.0, downgrading PuLP 3.3.2 below ckptc's requirement pulp>=2.8; after restoring "
    "PuLP 3.3.2, `import rockmate` fails with \"ModuleNotFoundError: No module named 'rkgb.core'\": the "
    "rkgb 2.0.0 wheel on PyPI ships only rkgb/__init__.py and rkgb/rkgb.py, without the rkgb.core and "
    "rkgb.lowlevel subpackages its __init__ imports. It was uninstalled again (with the dependencies it "
    "added); the environment is as before (pip check clean, transformers imports)."
)


def provenance() -> dict[str, Any]:
    """Which code produced the results: the commit (``BENCH_SOURCE_COMMIT`` when run from a
    snapshot of the tree, else ``git rev-parse HEAD``) and where ckptc was imported from."""
    commit = os.environ.get("BENCH_SOURCE_COMMIT")
    dirty = None
    if not commit:
        import subprocess

        root = Path(__file__).resolve().parent.parent
        try:
            commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=root, capture_output=True, text=True,
                                    timeout=10).stdout.strip() or None
            status = subprocess.run(["git", "status", "--porcelain", "--", "ckptc", "solvers", "bench/*.py"],
                                    cwd=root, capture_output=True, text=True, timeout=10).stdout
            dirty = bool(status.strip())
        except (OSError, subprocess.SubprocessError):
            commit = None
    # Relative to the repository: results never record this machine's paths.
    root = Path(__file__).resolve().parent.parent
    package = Path(ckptc.__file__).resolve().parent
    where = str(package.relative_to(root)) if package.is_relative_to(root) else "installed package"
    return {"commit": commit, "code_modified_since_commit": dirty, "ckptc_path": where}


def rockmate_status() -> dict[str, Any]:
    """Whether Rockmate can be used here, checked at run time, with the known reason if not."""
    try:
        importlib.import_module("rockmate")
    except Exception as error:  # noqa: BLE001 - any import failure means "not usable"
        return {"usable": False, "import_error": f"{type(error).__name__}: {error}", "note": ROCKMATE_NOTE}
    return {"usable": False, "import_error": None,
            "note": "rockmate imports, but this benchmark has no Rockmate runner (the install attempt failed); "
                    + ROCKMATE_NOTE}


# --------------------------------------------------------------------------- #
# One training step                                                            #
# --------------------------------------------------------------------------- #


def zero_grads(module: torch.nn.Module) -> None:
    for p in module.parameters():
        p.grad = None


def make_step(case: ModelCase, call: Callable[..., Any], module: torch.nn.Module) -> Callable[[], torch.Tensor]:
    def step() -> torch.Tensor:
        zero_grads(module)
        torch.manual_seed(SEED)
        loss = case.loss(call(*case.example_inputs, **case.example_kwargs))
        loss.backward()
        return loss.detach()

    return step


def timed(fn: Callable[[], Any]) -> tuple[Any, float]:
    start = time.perf_counter()
    result = fn()
    return result, time.perf_counter() - start


def grads_of(module: torch.nn.Module) -> dict[str, torch.Tensor | None]:
    return {n: (None if p.grad is None else p.grad.detach().clone()) for n, p in module.named_parameters()}


def compare(loss: torch.Tensor, module: torch.nn.Module, ref_loss: torch.Tensor,
            ref_grads: dict[str, torch.Tensor | None]) -> dict[str, Any]:
    """Loss and every gradient against eager's, with the largest differences."""
    out: dict[str, Any] = {"loss_equal": bool(torch.allclose(loss, ref_loss, rtol=RTOL, atol=ATOL)),
                           "loss_abs_diff": float((loss - ref_loss).abs().max())}
    mismatched, worst, worst_name = [], 0.0, None
    for name, p in module.named_parameters():
        ref = ref_grads.get(name)
        if (p.grad is None) != (ref is None):
            mismatched.append(name)
            continue
        if ref is None:
            continue
        diff = float((p.grad - ref).abs().max())
        if diff > worst:
            worst, worst_name = diff, name
        if not torch.allclose(p.grad, ref, rtol=RTOL, atol=ATOL):
            mismatched.append(name)
    out.update(grads_equal=not mismatched, grad_mismatches=mismatched[:5], n_grad_mismatches=len(mismatched),
               grad_max_abs_diff=worst, grad_max_abs_diff_param=worst_name)
    out["matches_eager"] = out["loss_equal"] and out["grads_equal"]
    return out


# --------------------------------------------------------------------------- #
# Time limits                                                                  #
# --------------------------------------------------------------------------- #


class PointTimeout(Exception):
    pass


@contextlib.contextmanager
def deadline(seconds: float | None) -> Iterator[None]:
    """Raise :class:`PointTimeout` in the main thread after ``seconds`` (between bytecodes)."""
    if not seconds or not hasattr(signal, "SIGALRM") or sys.platform == "win32":
        yield
        return

    def handler(signum: int, frame: Any) -> None:
        raise PointTimeout(f"point exceeded its time limit of {seconds:.0f} s")

    previous = signal.signal(signal.SIGALRM, handler)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def error_text(error: BaseException) -> str:
    text = f"{type(error).__name__}: {error}".strip()
    lines = [ln for ln in text.splitlines() if ln.strip()]
    return " ".join(lines[:3])[:400]


def reset_compiler_state() -> None:
    torch._dynamo.reset()
    gc.collect()


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


def plan_signature(plan: solvers.Plan) -> tuple[Any, ...]:
    schedule = None if plan.schedule is None else tuple((s.node, s.phase) for s in plan.schedule)
    return (frozenset(plan.kept), schedule)


class ModelBench:
    """Runs every alternative on one model and collects the points."""

    def __init__(self, name: str, size: str, out: Path, *, reps: int = 3, point_timeout: float | None = 900,
                 model_budget_s: float | None = None, ilp_time_limit: float = 30.0, dedupe: bool = True,
                 alt_options: dict[str, Any] | None = None, seq_len: int | None = None, batch: int | None = None,
                 resume: bool = False, file_suffix: str = "") -> None:
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

    def eager_step(self) -> Callable[[], torch.Tensor]:
        return make_step(self.case, self.case.model, self.case.model)

    # -- the run ----------------------------------------------------------
    def run(self) -> dict[str, Any]:
        t0 = time.perf_counter()
        self.case = case = get_case(self.name, size=self.size, **self.case_kwargs)
        shapes = {k: list(v.shape) for k, v in [(f"input{i}", t) for i, t in enumerate(case.example_inputs)]
                  + list(case.example_kwargs.items())}
        self.result = {
            "model": self.key, "case": self.name, "size": self.size, "case_kwargs": self.case_kwargs,
            "input_shapes": shapes,
            "parameters": case.num_parameters(), "torch": torch.__version__, "ckptc": ckptc.__version__,
            "machine": {"platform": platform.platform(), "threads": torch.get_num_threads(),
                        "cpus": os.cpu_count(), "load_avg_start": _loadavg()},
            "settings": {"reps": self.reps, "rtol": RTOL, "atol": ATOL, "seed": SEED,
                         "ilp_time_limit_s": self.ilp_time_limit, "dedupe": self.dedupe, **{
                             k: list(v) if isinstance(v, tuple) else v for k, v in self.alt_options.items()}},
            "rockmate": rockmate_status(), "source": provenance(),
            "points": [], "notes": [],
        }
        self.log(f"size={self.size} {shapes} params={case.num_parameters() / 1e6:.2f}M")

        # eager reference: loss, gradients, FLOPs
        step = self.eager_step()
        ref_loss, first_s = timed(step)
        self.ref_loss, self.ref_grads = ref_loss, grads_of(case.model)
        step()
        with count_flops() as tally:
            step()
        self.eager_flops = tally.total
        zero_grads(case.model)
        baseline = resident_bytes(case.model, case.example_inputs, case.example_kwargs)
        _, eager_peak = measure_peak(step, baseline_bytes=baseline)
        self.result["eager"] = {"flops": self.eager_flops, "peak_bytes": eager_peak.peak_bytes,
                                "baseline_bytes": eager_peak.baseline_bytes, "first_step_s": first_s,
                                "loss": float(ref_loss)}
        self.log(f"eager: peak {fmt_mib(eager_peak.peak_bytes)} MiB, {self.eager_flops / 1e9:.2f} GFLOP, "
                 f"first step {first_s:.1f}s")

        # probe: capture the step once with ckptc (keep everything) for the budget range
        self.problems: list[Any] | None = None
        try:
            self.probe()
        except Exception as error:  # noqa: BLE001
            self.log(f"probe failed: {error_text(error)}")
            self.result["probe"] = {"status": "error", "error": error_text(error),
                                    "traceback": traceback.format_exc(limit=-6)}
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
        measured: dict[tuple[Any, ...], dict[str, Any]] = {}
        probe_failed = probe.get("status") == "error"
        # If ckptc's probe step failed, one ckptc point (auto at the largest budget, where no
        # budget error can hide the failure) records what happens; the rest would repeat it.
        ckptc_alts = [a for a in alts if a.family == "ckptc" and a.solver == "auto"]
        designated = max(ckptc_alts, key=lambda a: a.budget_bytes or 0) if ckptc_alts else None
        for alt in alts:
            if probe_failed and alt.family in ("ckptc", "ckptc_strategy") and alt is not designated:
                self.add({**alt.to_dict(), "status": "skipped",
                          "reason": f"ckptc's probe step (capture + first training step) failed: {probe.get('error')}"})
                continue
            elapsed = time.perf_counter() - self.started
            if self.model_budget_s is not None and elapsed > self.model_budget_s:
                self.add({**alt.to_dict(), "status": "skipped",
                          "reason": f"model time budget of {self.model_budget_s:.0f} s used up"})
                continue
            self.add(self.point(alt, measured))
        # ckptc at exactly the peaks the hand-written alternatives measured: the like-for-like
        # comparison (recompute and step time at the same memory), interleaved in this run.
        for family, name in (("ckpt_every", "per-block"), ("ckpt_every_other", "every-other-block")):
            reference = next((p for p in self.result["points"]
                              if p.get("family") == family and p.get("status") == "ok"), None)
            if reference is None or probe_failed:
                continue
            alt = Alternative("ckptc", f"ckptc auto @{name} peak", solver="auto", budget_bytes=reference["peak_bytes"],
                              budget_kind="matched", compiled=True)
            self.add({**self.point(alt, measured), "matched_to": family})
        self.result["total_seconds"] = time.perf_counter() - t0
        self.result["machine"]["load_avg_end"] = _loadavg()
        self.save()
        return self.result

    def add(self, point: dict[str, Any]) -> None:
        self.result["points"].append(point)
        self.save()
        status = point["status"]
        if status == "ok":
            self.log(f"{point['label']:<38} peak {fmt_mib(point['peak_bytes']):>8} MiB  recompute "
                     f"{point['recompute_pct']:6.2f}%  time x{point.get('time_ratio', float('nan')):.2f}  "
                     f"match={point['matches_eager']}"
                     + (f"  (= {point['same_plan_as']})" if point.get("same_plan_as") else ""))
        else:
            self.log(f"{point['label']:<38} {status}: {point.get('reason') or point.get('error')}")

    def probe(self) -> None:
        case = self.case
        reset_compiler_state()
        model = copy.deepcopy(case.model)
        fast = ckptc.optimize(model, strategy="none")
        _, seconds = timed(make_step(case, fast, model))
        plan = fast.plan
        records = list(fast.compiler.records)
        self.result["probe"] = {
            "status": "ok", "first_step_s": seconds, "graphs": len(plan.graphs),
            "unoptimized_peak_bytes": plan.unoptimized_peak_bytes, "min_feasible_bytes": plan.min_feasible_bytes,
            "nodes": [len(r.problem) for r in records],
            "predicted_step_flops": plan.step_flops,
        }
        self.log(f"probe: {len(plan.graphs)} graph(s), unoptimized {fmt_mib(plan.unoptimized_peak_bytes)} MiB, "
                 f"smallest feasible {fmt_mib(plan.min_feasible_bytes)} MiB, first step {seconds:.1f}s")
        if len(records) == 1:
            self.problems = [r.joint_problem for r in records]
        else:
            self.result["notes"].append(
                f"{len(records)} graphs captured: every ckptc point is run (no offline solving/dedupe)")
        del fast, model
        reset_compiler_state()

    def offline_plan(self, alt: Alternative) -> tuple[str, Any, float]:
        """('plan', plan, seconds) or ('infeasible', error, seconds) from the probe's problem."""
        jp = self.problems[0]  # type: ignore[index]
        start = time.perf_counter()
        # Decide exactly as ckptc's backend does at the first step (CheckpointCompiler._decide,
        # configured as Alternative.build configures ckptc.optimize), on the problem it captured.
        if alt.family == "ckptc":
            compiler = CheckpointCompiler(alt.budget_bytes, strategy="auto", solver=alt.solver or "auto",
                                          time_limit=self.ilp_time_limit if alt.solver in ("ilp", "auto") else None)
        else:
            compiler = CheckpointCompiler(alt.budget_bytes, strategy=alt.strategy or "auto")
        try:
            plan = compiler._decide(0, jp)
        except solvers.InfeasibleBudgetError as error:
            return "infeasible", error, time.perf_counter() - start
        return "plan", plan, time.perf_counter() - start

    def point(self, alt: Alternative, measured: dict[tuple[Any, ...], dict[str, Any]]) -> dict[str, Any]:
        point: dict[str, Any] = alt.to_dict()
        signature = None
        earlier = self.previous.get(alt.label)
        if earlier is not None and (alt.family not in ("ckptc", "ckptc_strategy") or not self.dedupe
                                    or self.problems is None):
            return {**earlier, "resumed": True}
        if self.dedupe and self.problems is not None and alt.family in ("ckptc", "ckptc_strategy"):
            try:
                kind, value, seconds = self.offline_plan(alt)
            except Exception as error:  # noqa: BLE001 - measured below, where the error is recorded
                kind, value, seconds = "error", error, 0.0
            point["offline_solve_s"] = seconds
            if kind == "infeasible":
                return {**point, "status": "infeasible", "reason": error_text(value),
                        "min_feasible_bytes": getattr(value, "min_feasible_bytes", None)}
            if earlier is not None and kind != "plan":
                return {**earlier, "resumed": True}
            if kind == "error" and isinstance(value, solvers.SolverError):
                # the same solver on the same problem would raise the same at the first step
                return {**point, "status": "error", "error": error_text(value), "decided": "offline"}
            if kind == "plan":
                sim = solvers.simulate(self.problems[0].problem, value)  # type: ignore[index]
                point.update(offline_predicted_peak_bytes=sim.peak_bytes, offline_method=value.method)
                signature = plan_signature(value)
                if earlier is not None:  # measured in an earlier run: register it for dedupe, do not rerun
                    if earlier.get("status") == "ok" and not earlier.get("same_plan_as"):
                        measured.setdefault(signature, earlier)
                    return {**earlier, "resumed": True}
                if signature in measured:
                    first = measured[signature]
                    shared = {k: first[k] for k in ("peak_bytes", "baseline_bytes", "flops", "recompute_pct",
                                                    "time_ratio", "time_s", "eager_time_s", "matches_eager",
                                                    "loss_equal", "grads_equal", "grad_max_abs_diff",
                                                    "predicted_peak_bytes", "predicted_recompute_pct",
                                                    "kept", "recomputed") if k in first}
                    return {**point, **shared, "status": "ok", "same_plan_as": first["label"]}
        try:
            with deadline(self.point_timeout):
                result = self.measure(alt, point)
        except Skip as reason:
            result = {**point, "status": "skipped", "reason": str(reason)}
        except Exception as error:  # noqa: BLE001 - every failure is a result
            status = "timeout" if isinstance(error, PointTimeout) else (
                "infeasible" if isinstance(error, solvers.InfeasibleBudgetError) else "error")
            result = {**point, "status": status, "error": error_text(error),
                      "traceback": traceback.format_exc(limit=-4)[-1500:]}
        finally:
            reset_compiler_state()
        if signature is not None and result.get("status") == "ok":
            measured[signature] = result
        return result

    def measure(self, alt: Alternative, point: dict[str, Any]) -> dict[str, Any]:
        case = self.case
        reset_compiler_state()
        model = copy.deepcopy(case.model)
        runner: Runner = alt.build(model, time_limit=self.ilp_time_limit)
        point["how"] = runner.info
        step = make_step(case, runner.call, runner.module)
        loss, first_s = timed(step)  # capture/solve/compile happen here
        point["first_step_s"] = first_s
        point.update(compare(loss, runner.module, self.ref_loss, self.ref_grads))
        if runner.optimized is not None:
            plan = runner.optimized.plan
            records = runner.optimized.compiler.records
            point.update(
                predicted_peak_bytes=plan.predicted_peak_bytes, predicted_recompute_pct=plan.recompute_percent,
                plan_min_feasible_bytes=plan.min_feasible_bytes, plan_method=[g.plan.method for g in plan.graphs],
                kept=len(plan.values("kept")), recomputed=len(plan.values("recomputed")),
                partition_s=sum(r.solve_seconds for r in records),
                solve_s=sum(float(r.plan.info.get("solve_seconds", 0.0)) for r in records),
                auto_choice=([(g.plan.info.get("auto") or {}).get("chosen") for g in plan.graphs]
                             if alt.solver == "auto" else None),
            )
            if "offline_predicted_peak_bytes" in point:
                # Scratch memory is measured by running ops, so predictions may differ by a few KiB.
                diff = plan.predicted_peak_bytes - point["offline_predicted_peak_bytes"]
                point["offline_peak_diff_bytes"] = diff
                point["offline_matches_run"] = abs(diff) <= max(64 * 1024, plan.predicted_peak_bytes // 1000)
        with count_flops() as tally:  # second warm-up step
            step()
        point["flops"] = tally.total
        point["recompute_pct"] = (
            100.0 * (tally.total - self.eager_flops) / self.eager_flops if self.eager_flops else 0.0
        )
        zero_grads(runner.module)
        baseline = resident_bytes(runner.module, case.example_inputs, case.example_kwargs)
        _, measurement = measure_peak(step, baseline_bytes=baseline)
        point.update(peak_bytes=measurement.peak_bytes, baseline_bytes=measurement.baseline_bytes)
        if alt.budget_bytes is not None:
            point["within_budget"] = measurement.peak_bytes <= alt.budget_bytes
        eager_times, times = [], []
        eager_step = self.eager_step()
        for _ in range(self.reps):  # interleaved: machine noise hits both alike
            eager_times.append(timed(eager_step)[1])
            times.append(timed(step)[1])
        point.update(time_s=statistics.median(times), eager_time_s=statistics.median(eager_times),
                     time_ratio=statistics.median(times) / statistics.median(eager_times),
                     times_s=times, eager_times_s=eager_times, status="ok")
        del runner, model
        return point


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


def _loadavg() -> list[float] | None:
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except OSError:
        return None


# --------------------------------------------------------------------------- #
# Headline: longest sequence under a fixed budget                              #
# --------------------------------------------------------------------------- #

HEADLINE_MODELS = {
    # model: (start length, granularity)
    "enformer": (16384, 128 * 16),
    "hyena": (8192, 1024),
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
        plan = ckptc.plan(model, case.example_inputs, case.example_kwargs, strategy="none", loss_fn=case.loss)
        out.update(peak_bytes=plan.min_feasible_bytes, kind="predicted (ckptc min feasible)",
                   unoptimized_predicted=plan.unoptimized_peak_bytes)
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
    out = {"seq_len": seq_len, "measured_peak_bytes": m.peak_bytes, "predicted_peak_bytes": plan.predicted_peak_bytes,
           "recompute_pct_predicted": plan.recompute_percent, "within_budget": m.peak_bytes <= budget,
           "seconds": time.perf_counter() - start}
    del fast, case, model
    reset_compiler_state()
    return out


def longest_fitting(name: str, method: str, budget: int, deadline_at: float, start: int, grain: int,
                    max_len: int = 2**22) -> dict[str, Any]:
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
        print(f"[{time.strftime('%H:%M:%S')}] headline {name} {method} L={length}: "
              f"{fmt_mib(r.get('peak_bytes'))} MiB fits={r['fits']}", flush=True)
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
    return {"method": method, "longest_fitting": lo or None, "shortest_failing": hi, "trials": trials,
            "grain": grain, "complete": not stopped}


def headline(out: Path, budget_gb: float = 1.0, time_budget_s: float = 900.0,
             models: tuple[str, ...] = ("enformer", "hyena")) -> dict[str, Any]:
    budget = int(budget_gb * 2**30)
    started = time.perf_counter()
    result: dict[str, Any] = {"budget_bytes": budget, "time_budget_s": time_budget_s, "models": {},
                              "source": provenance(),
                              "method_notes": {
                                  "none": "eager PyTorch, measured peak of the first step",
                                  "per_block": "torch.utils.checkpoint(use_reentrant=False) on every repeated block "
                                               "(bench.alternatives.wrap_blocks), measured peak of the first step",
                                  "ckptc": "ckptc's smallest feasible budget (predicted from the captured step) "
                                           "<= budget; the longest length found is then trained under the budget "
                                           "and measured"}}
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
    p.add_argument("--override", nargs="*", default=[], metavar="MODEL:KEY=VALUE",
                   help="per-model seq_len/batch, e.g. gpt2:batch=1 enformer:seq_len=16384")
    p.add_argument("--model-minutes", type=float, default=None, help="skip a model's remaining points after this")
    p.add_argument("--point-timeout", type=float, default=900.0)
    p.add_argument("--ilp-time-limit", type=float, default=30.0)
    p.add_argument("--no-dedupe", action="store_true", help="run every ckptc point even if its plan was measured")
    p.add_argument("--file-suffix", default="", help="append to result file names, e.g. _long")
    p.add_argument("--resume", action="store_true",
                   help="keep the points of <out>/<model>.json (same shapes) and run only those skipped or missing")
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
        headline(out, args.headline_budget_gb, args.headline_minutes * 60)
        return 0
    size = "tiny" if args.quick else args.size
    models = tuple(args.models or (QUICK_MODELS if args.quick else DEFAULT_MODELS))
    n_budgets = args.budgets if args.budgets is not None else (2 if args.quick else 4)
    n_below = args.below if args.below is not None else (1 if args.quick else 2)
    alt_options: dict[str, Any] = {
        "fractions": _fractions(n_budgets),
        "below": {0: (), 1: (0.5,), 2: (0.5, 0.85)}.get(n_below, (0.3, 0.6, 0.9)),
        "aot_budgets": (tuple(args.aot_budgets) if args.aot_budgets is not None
                        else ((0.0, 0.5, 1.0) if args.quick else (0.0, 0.25, 0.5, 0.75, 1.0))),
    }
    if args.solvers:
        alt_options["solvers"] = tuple(args.solvers)
    if args.strategies is not None:
        alt_options["strategies"] = tuple(args.strategies)
    print(f"bench.run: models {' '.join(models)}, size {size}, out {out}; torch {torch.__version__}, "
          f"{torch.get_num_threads()} threads", flush=True)
    overrides: dict[str, dict[str, int]] = {}
    for item in args.override:
        model_name, _, setting = item.partition(":")
        key, _, value = setting.partition("=")
        if key not in ("seq_len", "batch") or not value:
            raise SystemExit(f"bad --override {item!r}; expected MODEL:seq_len=N or MODEL:batch=N")
        overrides.setdefault(model_name, {})[key] = int(value)
    for name in models:
        shape = {"seq_len": args.seq_len, "batch": args.batch, **overrides.get(name, {})}
        bench = ModelBench(name, size, out, reps=args.reps, point_timeout=args.point_timeout,
                           model_budget_s=None if args.model_minutes is None else args.model_minutes * 60,
                           ilp_time_limit=args.ilp_time_limit, dedupe=not args.no_dedupe, alt_options=alt_options,
                           seq_len=shape["seq_len"], batch=shape["batch"], resume=args.resume,
                           file_suffix=args.file_suffix)
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
