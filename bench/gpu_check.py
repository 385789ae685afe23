"""ckptc on one GPU: predicted peaks against ``torch.cuda.max_memory_allocated``, side by side with
per-block checkpointing and PyTorch's ``activation_memory_budget`` (issue 21).

Run from the repository root on a machine with a CUDA GPU, in one call (about 3-6 minutes on one GPU)::

    python -m bench.gpu_check                      # writes bench/results/gpu.md and gpu.json

or one process per model at once (compiling is single-threaded; the models' peaks are each process's own),
then the tables joined::

    for m in gpt2 llama enformer; do python -m bench.gpu_check --models $m --out out/$m & done; wait
    python -m bench.gpu_check --merge out/*/gpu.json --out bench/results

For GPT-2, Llama and Enformer at the bench sizes it measures, on the GPU, one
training step of: eager PyTorch; ckptc at 3 budgets between its floor and the
unoptimized peak, with and without its run-time check (predicted peak, measured
``max_memory_allocated``, their ratio, what the check read, recompute, loss equal
to eager); per-block ``torch.utils.checkpoint``;
and ``torch.compile(backend="aot_eager")`` under ``activation_memory_budget``
0, 0.5 and 1.  Every figure is absolute: ``max_memory_allocated`` after
``reset_peak_memory_stats``, with the model's weights, inputs and cuBLAS
workspaces resident, as ckptc's prediction counts them (CUDA memory model:
``ckptc/pricing/devices.py``).  Step times are the median of ``--reps`` steps after a
warm-up.  Optimizer state is not part of any figure.

``--explain`` records the measured step's caching-allocator events and stores in
``gpu.json`` what was alive at its peak (by compiled-graph line or model code) and how far the allocator's count
is above the requested bytes (:func:`peak_breakdown`): the data a finer model of the allocator needs.

Without CUDA it refuses (exit status 2) and says so; ``--cpu-smoke`` runs the
same code on the CPU (tiny sizes, the CPU allocator's events instead of
``max_memory_allocated``) so that its logic is tested where no GPU is.
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import functools
import gc
import json
import linecache
import platform
import statistics
import sys
import time
import traceback
from pathlib import Path
from typing import Any, Callable, Sequence

import torch

import ckptc
import ckptc._torch_internals as internals
from bench.alternatives import Alternative, Skip, fmt_mib
from ckptc.meter import measure_peak, steps_to_verify
from tests.zoo import ModelCase, get_case

MODELS = ("gpt2", "llama", "enformer")
FRACTIONS = (0.0, 0.5, 1.0)  # ckptc budgets: floor, halfway, unoptimized peak
AOT_BUDGETS = (0.0, 0.5, 1.0)
DEADLINE_S = 7 * 60  # stop starting new rows after this (the script must finish within 8 minutes)


def moved(case: ModelCase, device: torch.device) -> ModelCase:
    """``case`` with its model and every input tensor on ``device``."""

    def to(value: Any) -> Any:
        return value.to(device) if isinstance(value, torch.Tensor) else value

    loss = case.loss
    if isinstance(loss, functools.partial):  # a loss bound to its targets (Enformer's, the classifiers')
        loss = functools.partial(loss.func, *map(to, loss.args), **{k: to(v) for k, v in loss.keywords.items()})
    return ModelCase(
        case.name,
        case.model.to(device),
        tuple(to(t) for t in case.example_inputs),
        {k: to(v) for k, v in case.example_kwargs.items()},
        loss,
    )


class Meter:
    """One training step's absolute peak on the device, and step times; with ``explain``, what was alive at
    that step's peak (:func:`peak_breakdown`)."""

    def __init__(self, device: torch.device, reps: int, explain: bool = False) -> None:
        self.device = device
        self.reps = reps
        self.explain = explain and device.type == "cuda"

    def sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def step(self, case: ModelCase, run: Callable[..., Any], params: Any) -> torch.Tensor:
        for p in params:
            p.grad = None
        torch.manual_seed(0)
        loss = case.loss(run(*case.example_inputs, **case.example_kwargs))
        loss.backward()
        return loss.detach()

    def measure(self, case: ModelCase, run: Callable[..., Any], module: torch.nn.Module) -> dict[str, Any]:
        params = list(module.parameters())
        # Warm-up: plans, compiles, allocates cuBLAS workspaces, and lets ckptc's run-time check measure the
        # steps it verifies a plan on: the measured step is the first after them.
        for _ in range(max(2, steps_to_verify(self.device))):
            self.step(case, run, params)
        for p in params:
            p.grad = None
        gc.collect()  # what the warm-up left in reference cycles is not part of the step
        self.sync()
        resident, breakdown = None, None
        if self.device.type == "cuda":
            failed = None
            try:
                resident, peak, loss, breakdown = self._cuda_step(case, run, params, self.explain)
            except SystemError as error:
                if not self.explain:
                    raise
                failed = str(error)[:200]  # not the error itself: its frames hold the failed step's tensors
            if failed is not None:
                # Recording Python stacks fails inside torch.utils.checkpoint's recompute on autograd's
                # thread (torch 2.11: "returned NULL without setting an exception"): measured unrecorded.
                for p in params:
                    p.grad = None
                gc.collect()
                resident, peak, loss, _ = self._cuda_step(case, run, params, False)
                breakdown = {"error": f"recording the allocator's events failed: {failed}"}
        else:  # --cpu-smoke: the CPU allocator's events, above what the model and inputs hold
            resident = sum(t.untyped_storage().nbytes() for t in [*params, *module.buffers(), *_tensors(case)])
            loss, measured = measure_peak(lambda: self.step(case, run, params), baseline_bytes=resident)
            peak = measured.peak_bytes
        times = []
        for _ in range(self.reps):
            self.sync()
            start = time.perf_counter()
            self.step(case, run, params)
            self.sync()
            times.append(time.perf_counter() - start)
        row = {
            "measured_peak_bytes": int(peak),
            "resident_at_start_bytes": resident,
            "step_s": statistics.median(times),
            "loss": float(loss),
        }
        if breakdown is not None:
            row["peak_breakdown"] = breakdown
        for p in params:
            p.grad = None  # copies made from this model later must not carry gradients
        return row

    def _cuda_step(
        self, case: ModelCase, run: Callable[..., Any], params: Any, explain: bool
    ) -> tuple[int, int, torch.Tensor, dict[str, Any] | None]:
        """One measured step on the GPU: resident bytes at its start, ``max_memory_allocated``, the loss, and
        with ``explain`` what was alive at the peak."""
        if explain:  # the allocator's events of the measured step itself (host-side: no memory)
            internals.record_cuda_memory_history(True)
            _mark_step_start(self.device)
        try:
            resident = torch.cuda.memory_allocated(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
            loss = self.step(case, run, params)
            self.sync()
            peak = torch.cuda.max_memory_allocated(self.device)
            breakdown = _breakdown_or_error(internals.cuda_memory_snapshot(), resident, peak) if explain else None
        finally:
            if explain:
                internals.record_cuda_memory_history(False)
        return resident, peak, loss, breakdown


def _mark_step_start(device: torch.device) -> None:
    """An allocation :func:`peak_breakdown` finds in the recorded events: the step starts after it."""
    torch.empty(3, device=device)


def peak_breakdown(snapshot: dict[str, Any], start: int, peak: int, top: int = 15) -> dict[str, Any]:
    """Replay a step's recorded allocator events (after :func:`_mark_step_start`) from the level ``start``: the
    allocations alive at the replayed peak, grouped by where they were made (a line of a compiled graph, or
    the innermost frames of the model's code), and how far ``peak`` (``max_memory_allocated``, whole blocks)
    is above the replayed peak (the events carry requested sizes: the difference is the allocator's rounding
    and the cached blocks it did not split)."""
    trace = snapshot["device_traces"][0] if snapshot.get("device_traces") else []
    marks = [
        i
        for i, e in enumerate(trace)
        if e.get("action") == "alloc" and any(f.get("name") == "_mark_step_start" for f in e.get("frames") or [])
    ]
    if not marks:
        return {"error": "the recorded events do not reach back to the step's start"}
    live: dict[int, tuple[int, str]] = {}
    level = best = start
    at_peak: dict[int, tuple[int, str]] = {}
    for event in trace[marks[-1] + 1 :]:
        if event["action"] == "alloc":
            live[event["addr"]] = (event["size"], _where(event.get("frames")))
            level += event["size"]
            if level > best:
                best, at_peak = level, dict(live)
        elif event["action"] == "free_completed" and event["addr"] in live:
            level -= live.pop(event["addr"])[0]
    groups: dict[str, list[int]] = {}
    for size, where in at_peak.values():
        group = groups.setdefault(where, [0, 0])
        group[0] += size
        group[1] += 1
    largest = sorted(groups.items(), key=lambda item: -item[1][0])[:top]
    return {
        "start_bytes": start,
        "max_memory_allocated": peak,
        "replayed_peak_bytes": best,
        "unsplit_and_rounding_bytes": peak - best,
        "alive_at_peak": [{"bytes": b, "blocks": n, "made_by": where} for where, (b, n) in largest],
    }


def _breakdown_or_error(snapshot: dict[str, Any], start: int, peak: int) -> dict[str, Any]:
    try:
        return peak_breakdown(snapshot, start, peak)
    except Exception as error:  # the row's own figures stand without it
        return {"error": f"{type(error).__name__}: {error}"[:300]}


def _where(frames: list[dict[str, Any]] | None) -> str:
    """Where an allocation was made: the compiled graph's line, else the innermost frames of the model's code."""
    found = []
    for frame in frames or []:
        name = frame.get("filename", "")
        if name.startswith("<eval_with_key"):
            return "graph: " + linecache.getline(name, frame.get("line", 0)).strip()[:120]
        if "/torch/" not in name and "/bench/" not in name:
            found.append(f"{name.rsplit('/', 1)[-1]}:{frame.get('line')}:{frame.get('name')}")
        if len(found) == 3:
            break
    return " < ".join(found) or "(no Python frame: autograd's thread)"


def _tensors(case: ModelCase) -> list[torch.Tensor]:
    values = [*case.example_inputs, *case.example_kwargs.values()]
    return [t for t in values if isinstance(t, torch.Tensor)]


class Rows:
    """The rows of one model; a configuration that fails is a row saying how, and the others still run."""

    def __init__(self, started: float, deadline_s: float) -> None:
        self.rows: list[dict[str, Any]] = []
        self.started = started
        self.deadline_s = deadline_s

    def add(self, config: str, measure: Callable[[], dict[str, Any]]) -> dict[str, Any] | None:
        if time.perf_counter() - self.started > self.deadline_s:
            self.rows.append({"config": config, "skipped": "time"})
            return None
        try:
            row = {"config": config, **measure()}
        except Exception as error:  # the table says which configuration failed and why; the run goes on
            print(f"[gpu_check] {config} failed:\n{traceback.format_exc()}", file=sys.stderr, flush=True)
            row = {"config": config, "failed": f"{type(error).__name__}: {str(error).splitlines()[0][:300]}"}
        release()
        self.rows.append(row)
        return row


def release() -> None:
    """Free what a configuration held (its model copy, compiled graphs) before the next one is measured:
    every peak here is absolute, so a copy left alive would count in the next configuration's."""
    gc.collect()
    torch.compiler.reset()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def check_model(
    name: str, size: str, device: torch.device, meter: Meter, rows: Rows, fractions: Sequence[float] = FRACTIONS
) -> dict[str, Any]:
    """Every row of one model.  The model stays on the CPU; each configuration runs its own copy on ``device``
    (alone there with the inputs: peaks are absolute)."""
    original = get_case(name, size=size)
    case = moved(dataclasses.replace(original, model=torch.nn.Module()), device)  # inputs and targets

    def fresh() -> torch.nn.Module:
        return copy.deepcopy(original.model).to(device)

    result: dict[str, Any] = {"model": name, "size": size, "parameters": original.num_parameters(), "rows": rows.rows}

    def eager_row() -> dict[str, Any]:
        model = fresh()
        return meter.measure(case, model, model)

    eager = rows.add("eager", eager_row)
    captured = ckptc.capture(fresh(), case.example_inputs, case.example_kwargs, loss_fn=case.loss)
    floor, unoptimized = captured.floor_bytes, captured.unoptimized_peak_bytes
    del captured
    release()
    result.update(floor_bytes=floor, unoptimized_peak_bytes=unoptimized)

    def planned(budget: int, verify: bool = False) -> dict[str, Any]:
        model = fresh()
        fast = ckptc.optimize(model, budget_bytes=budget, verify=verify)
        row = meter.measure(case, fast, model)
        row.update(
            budget_bytes=budget,
            predicted_peak_bytes=fast.plan.predicted_peak_bytes,
            recompute_percent=fast.plan.recompute_percent,
            checked_peak_bytes=fast.plan.measured_peak_bytes,
        )
        if eager is not None and "loss" in eager:
            row["loss_equal"] = abs(row["loss"] - eager["loss"]) <= 1e-4 * max(1.0, abs(eager["loss"]))
        return row

    for fraction in fractions:
        budget = floor + int((unoptimized - floor) * fraction)
        rows.add(f"ckptc @{fraction:g} (budget {fmt_mib(budget)} MiB)", functools.partial(planned, budget))
    # The default entry point, run-time check on: ckptc measures its first steps itself and plans again if over.
    for fraction in fractions:
        budget = floor + int((unoptimized - floor) * fraction)
        label = f"ckptc @{fraction:g} verified (budget {fmt_mib(budget)} MiB)"
        rows.add(label, functools.partial(planned, budget, True))
    alternatives = [Alternative("ckpt_every", "per-block checkpoint")] + [
        Alternative("aot_eager", f"aot_eager activation_memory_budget={b:g}", budget_fraction=b) for b in AOT_BUDGETS
    ]

    def alternative_row(alternative: Alternative) -> dict[str, Any]:
        try:
            runner = alternative.build(fresh())
        except Skip as why:
            return {"skipped": str(why)}
        return meter.measure(case, runner.call, runner.module)

    for alternative in alternatives:
        rows.add(alternative.label, functools.partial(alternative_row, alternative))
    return result


def markdown(results: list[dict[str, Any]], header: dict[str, Any]) -> str:
    """The results as ``gpu.md``."""
    lines = [
        "# ckptc on a GPU: predicted against measured peaks",
        "",
        f"Made by `python -m bench.gpu_check` on {header['device']} (torch {header['torch']}, "
        f"{header['when']}). Peaks are {header['meter']} of one training step "
        "(weights, inputs, gradients, activations, cuBLAS workspaces; no optimizer state); times are medians. "
        "Each configuration runs alone on the device: its own copy of the model, the others freed "
        "(resident at start: what the device held when the measured step began).",
        "",
    ]
    if header.get("note"):
        lines += [header["note"], ""]
    for result in results:
        lines += [
            f"## {result['model']} ({result['size']}, {result['parameters'] / 1e6:.1f} M parameters)",
            "",
            f"ckptc floor {fmt_mib(result['floor_bytes'])} MiB, unoptimized peak "
            f"{fmt_mib(result['unoptimized_peak_bytes'])} MiB (predicted)."
            if "floor_bytes" in result
            else "ckptc could not capture this model (see the rows).",
            "",
            "| configuration | predicted peak | measured peak | measured / predicted | ckptc's own check | recompute | "
            "step time | loss = eager | resident at start |",
            "| --- | --- | --- | --- | --- | --- | --- | --- | --- |",
        ]
        for row in result["rows"]:
            if "skipped" in row or "failed" in row:
                why = f"skipped: {row['skipped']}" if "skipped" in row else f"**failed**: {row['failed']}"
                lines.append(f"| {row['config']} | {why} | | | | | | | |")
                continue
            predicted = row.get("predicted_peak_bytes")
            ratio = "-" if not predicted else f"{row['measured_peak_bytes'] / predicted:.3f}"
            shown = "-" if predicted is None else f"{fmt_mib(predicted)} MiB"
            checked = row.get("checked_peak_bytes")
            check = "-" if checked is None else f"{fmt_mib(checked)} MiB"
            resident = row.get("resident_at_start_bytes")
            held = "-" if resident is None else f"{fmt_mib(resident)} MiB"
            recompute = row.get("recompute_percent")
            recomputed = "-" if recompute is None else f"{recompute:.1f}%"
            lines.append(
                f"| {row['config']} | {shown} | {fmt_mib(row['measured_peak_bytes'])} MiB | {ratio} | "
                f"{check} | {recomputed} | {row['step_s'] * 1000:.1f} ms | {row.get('loss_equal', '-')} | "
                f"{held} |"
            )
        lines.append("")
    return "\n".join(lines)


def write(out: Path, stem: str, header: dict[str, Any], results: list[dict[str, Any]]) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{stem}.json").write_text(json.dumps({"header": header, "results": results}, indent=1) + "\n")
    (out / f"{stem}.md").write_text(markdown(results, header) + "\n")


def merge(paths: list[str], out: Path, note: str = "") -> int:
    """Join the ``gpu.json`` of runs made one model per process into one table (``note``: said under it)."""
    runs = [json.loads(Path(path).read_text()) for path in paths]
    header = dict(runs[0]["header"])
    header["seconds"] = max(run["header"]["seconds"] for run in runs)
    header["note"] = (
        f"The {len(runs)} models ran at once, one process each, on the one GPU: each peak is its own process's; "
        f"step times may include the other processes' kernels. {note}"
    ).strip()
    write(out, "gpu", header, [result for run in runs for result in run["results"]])
    print(f"[gpu_check] joined {len(runs)} runs into {out / 'gpu'}.md", file=sys.stderr)
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.gpu_check", description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", nargs="+", default=list(MODELS), help="models of tests.zoo (default: %(default)s)")
    parser.add_argument("--size", default="bench", help="zoo size (default: bench)")
    parser.add_argument("--reps", type=int, default=3, help="timed steps per configuration (default: 3)")
    parser.add_argument(
        "--fractions",
        type=float,
        nargs="+",
        default=list(FRACTIONS),
        help="ckptc's budgets, from its floor (0) to the unoptimized peak (1) (default: %(default)s)",
    )
    parser.add_argument("--out", default="bench/results", help="folder for gpu.md and gpu.json")
    parser.add_argument(
        "--deadline", type=float, default=DEADLINE_S, help="start no configuration after this many seconds"
    )
    parser.add_argument(
        "--explain", action="store_true", help="record the measured step's allocator events: what was alive at its peak"
    )
    parser.add_argument("--merge", nargs="+", metavar="JSON", help="join the gpu.json of earlier runs and exit")
    parser.add_argument("--note", default="", help="with --merge: a paragraph said under the table's header")
    parser.add_argument(
        "--cpu-smoke", action="store_true", help="run on the CPU (tiny sizes; tests the script where no GPU is)"
    )
    args = parser.parse_args(argv)
    if args.merge:
        return merge(args.merge, Path(args.out), args.note)
    if args.cpu_smoke:
        device = torch.device("cpu")
    elif not torch.cuda.is_available():
        print(
            f"bench.gpu_check needs a CUDA GPU: torch.cuda.is_available() is False here (torch "
            f"{torch.__version__}). Run it on a GPU machine: python -m bench.gpu_check "
            "(or --cpu-smoke to test the script on the CPU).",
            file=sys.stderr,
        )
        return 2
    else:
        device = torch.device("cuda")
    started = time.perf_counter()
    meter = Meter(device, args.reps, explain=args.explain)
    header = {
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else f"CPU ({platform.processor()})",
        "torch": torch.__version__,
        "when": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "meter": "absolute `torch.cuda.max_memory_allocated`"
        if device.type == "cuda"
        else "the CPU allocator's events (--cpu-smoke: a test of the script, not GPU figures)",
    }
    out, stem = Path(args.out), "gpu" if device.type == "cuda" else "gpu_cpu_smoke"
    results: list[dict[str, Any]] = []
    for name in args.models:
        print(f"[gpu_check] {name} ({time.perf_counter() - started:.0f} s)", file=sys.stderr, flush=True)
        rows = Rows(started, args.deadline)
        try:
            results.append(check_model(name, args.size, device, meter, rows, args.fractions))
        except Exception as error:  # a model ckptc cannot capture is a result too
            print(f"[gpu_check] {name} failed:\n{traceback.format_exc()}", file=sys.stderr, flush=True)
            rows.rows.append({"config": "capture", "failed": f"{type(error).__name__}: {str(error)[:300]}"})
            results.append({"model": name, "size": args.size, "parameters": 0, "rows": rows.rows})
        torch.compiler.reset()
        header["seconds"] = time.perf_counter() - started
        write(out, stem, header, results)  # after every model: a run stopped for time keeps what it measured
    print(f"[gpu_check] wrote {out / stem}.md in {header['seconds']:.0f} s", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
