"""Smoke test of the benchmark (bench.run): one tiny model, two budgets, files written.

Nothing here is timed: the benchmark's numbers are not checked, only that
every alternative ran (or said why not) and the outputs were written.  The
tests never import ``bench`` (``tests/test_boundaries.py``): the benchmark
runs as users run it, ``python -m bench.run`` from the repository root, in a
subprocess.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def _run_python(*args: str, timeout: float = 600) -> subprocess.CompletedProcess:
    """``python ARGS`` from the repository root; fails the test with its stderr if it exits non-zero."""
    done = subprocess.run([sys.executable, *args], cwd=REPO, capture_output=True, text=True, timeout=timeout)
    assert done.returncode == 0, f"python {' '.join(args)} exited {done.returncode}:\n{done.stderr[-4000:]}"
    return done


def test_bench_run_help_works_from_the_repository_root():
    assert "--models" in _run_python("-m", "bench.run", "--help").stdout


def test_bench_run_writes_results_for_every_alternative(tmp_path):
    out = tmp_path / "results"
    _run_python(
        "-m",
        "bench.run",
        "--models",
        "mlp",
        "--size",
        "tiny",
        "--out",
        str(out),
        "--budgets",
        "2",
        "--below",
        "0",
        "--solvers",
        "auto",
        "--strategies",
        "--aot-budgets",
        "0.5",
        "--reps",
        "1",
    )
    data = json.loads((out / "mlp.json").read_text())
    families = {p["family"] for p in data["points"]}
    assert {"eager", "ckpt_every", "ckpt_every_other", "aot_eager", "ckptc"} <= families
    ckptc_points = [p for p in data["points"] if p["family"] == "ckptc" and p.get("budget_kind") != "matched"]
    assert len(ckptc_points) == 2
    # ckptc also runs at the peak of every alternative that trained like eager (here: eager, PyTorch's budget).
    matched = {p.get("matched_to") for p in data["points"] if p.get("budget_kind") == "matched"}
    assert matched == {"eager", "aot_eager budget=0.5"}
    for p in data["points"]:
        assert p["status"] in ("ok", "infeasible", "skipped", "error", "timeout"), p
        if p["status"] == "ok":
            assert p["peak_bytes"] > 0 and "recompute_pct" in p and "matches_eager" in p
    by_family = {p["family"]: p for p in data["points"]}
    assert by_family["eager"]["status"] == "ok" and by_family["eager"]["matches_eager"]
    # the MLP is one nn.Sequential of Linear/GELU: no repeated blocks, so per-block checkpointing says why it is skipped
    assert by_family["ckpt_every"]["status"] == "skipped" and by_family["ckpt_every"]["reason"]
    assert by_family["aot_eager"]["status"] == "ok"
    assert any(p["status"] == "ok" and p["matches_eager"] for p in ckptc_points)
    table = (out / "mlp.md").read_text()
    for label in ("eager", "ckpt every block", "ckpt every other block", "aot_eager budget=0.5", "ckptc auto"):
        assert label in table
    assert (out / "mlp_pareto.png").exists()
    assert "mlp" in (out / "SUMMARY.md").read_text()
    assert data["rockmate"]["note"]


def test_block_helper_and_flop_counter_on_a_tiny_model():
    """bench.alternatives' block finder, per-block wrapper and FLOP counters (FlopCounterMode's formulas and
    every op's), and the report's dominance on either count, in a fresh interpreter."""
    script = textwrap.dedent(
        """
        import torch
        from bench.alternatives import count_flops, find_block_containers, wrap_blocks
        from tests.zoo import get_case

        case = get_case("gpt2", size="tiny")
        containers, _ = find_block_containers(case.model)
        assert [path for path, _ in containers] == ["transformer.h"], containers
        assert find_block_containers(get_case("mlp", size="tiny").model)[0] == []
        with count_flops() as eager:
            case.forward_loss().backward()
        with torch.utils.flop_counter.FlopCounterMode(display=False) as reference:
            case.forward_loss().backward()
        assert eager.total == reference.get_total_flops() > 0, (eager.total, reference.get_total_flops())
        wrapped, _ = wrap_blocks(case.model, every=2)
        assert wrapped == ["transformer.h.0"], wrapped
        with count_flops() as checkpointed:
            case.forward_loss().backward()
        assert checkpointed.total > eager.total  # block 0's forward runs again in backward
        # Every op counted too: pointwise ops and reductions, which FlopCounterMode counts as 0.
        assert eager.every_op_total > eager.total and checkpointed.every_op_total > eager.every_op_total

        # A point that recomputes only pointwise ops shows 0% on FlopCounterMode's formulas; the report
        # judges it again counting every op where both sides were measured that way.
        from bench.report import analyse

        def point(label, family, peak, flop_counter, every_op=None, time=1.0):
            p = {"label": label, "family": family, "status": "ok", "peak_bytes": peak, "matches_eager": True,
                 "recompute_pct": flop_counter, "time_ratio": time}
            if every_op is not None:
                p["recompute_pct_every_op"] = every_op
            return p

        pytorch = point("aot_eager budget=0.5", "aot_eager", 100, 0.0, 20.0, time=3.0)
        ours = point("ckptc auto", "ckptc", 99, 4.0, 9.0, time=2.0)
        assert analyse({"points": [pytorch, ours]})["dominated_on_every_op"]
        assert analyse({"points": [pytorch, ours]})["dominates"]
        assert not analyse({"points": [point("aot_eager", "aot_eager", 100, 0.0), ours]})["dominates"]
        assert not analyse({"points": [point("aot_eager", "aot_eager", 100, 0.0, 5.0, time=3.0), ours]})["dominates"]
        assert not analyse({"points": [point("aot_eager", "aot_eager", 100, 0.0, 20.0, time=1.5), ours]})["dominates"]
        print("ok")
        """
    )
    assert _run_python("-c", script).stdout.strip().endswith("ok")


def test_gpu_check_refuses_without_cuda_and_its_logic_runs_on_the_cpu(tmp_path):
    """bench/gpu_check.py is the prepared GPU run (issue 21): without CUDA it says so (exit 2); its
    CPU smoke mode runs every configuration on a tiny model and writes the table."""
    import torch

    if not torch.cuda.is_available():
        done = subprocess.run(
            [sys.executable, "-m", "bench.gpu_check"], cwd=REPO, capture_output=True, text=True, timeout=300
        )
        assert done.returncode == 2 and "needs a CUDA GPU" in done.stderr
    out = tmp_path / "gpu"
    options = "--cpu-smoke --models mlp --size tiny --reps 1 --fractions 0.5".split()
    _run_python("-m", "bench.gpu_check", *options, "--out", str(out))
    data = json.loads((out / "gpu_cpu_smoke.json").read_text())
    rows = {r["config"].split(" (")[0]: r for r in data["results"][0]["rows"]}
    assert {"eager", "ckptc @0.5", "ckptc @0.5 verified", "aot_eager activation_memory_budget=0.5"} <= set(rows)
    for fraction in ("0.5",):
        row = rows[f"ckptc @{fraction}"]
        assert row["loss_equal"] and row["measured_peak_bytes"] <= row["budget_bytes"]
        checked = rows[f"ckptc @{fraction} verified"]  # the default entry point: ckptc's own check ran
        assert checked["loss_equal"] and checked["checked_peak_bytes"] <= checked["budget_bytes"]
        assert checked["measured_peak_bytes"] <= checked["budget_bytes"]
    assert "| ckptc @0.5" in (out / "gpu_cpu_smoke.md").read_text()


def test_gpu_checks_peak_breakdown_replays_the_recorded_events_from_the_steps_start():
    """``--explain`` (GPU only) replays the caching allocator's recorded events; the replay is plain data."""
    script = textwrap.dedent(
        """
        from bench.gpu_check import peak_breakdown

        def alloc(addr, size, line):
            return {"action": "alloc", "addr": addr, "size": size,
                    "frames": [{"filename": "m.py", "line": line, "name": "f"}]}

        mark = {"action": "alloc", "addr": 1, "size": 512,
                "frames": [{"filename": "g.py", "line": 1, "name": "_mark_step_start"}]}
        before = alloc(9, 10_000, 1)  # an earlier step's: not replayed
        trace = [before, mark, {"action": "free_completed", "addr": 1}, alloc(2, 100, 10), alloc(3, 50, 20)]
        trace += [{"action": "free_completed", "addr": 2}, alloc(4, 30, 30), {"action": "free_completed", "addr": 7}]
        found = peak_breakdown({"device_traces": [trace]}, start=1000, peak=1700)
        assert found["replayed_peak_bytes"] == 1000 + 150 and found["unsplit_and_rounding_bytes"] == 550
        assert [(g["bytes"], g["made_by"]) for g in found["alive_at_peak"]] == [(100, "m.py:10:f"), (50, "m.py:20:f")]
        assert "error" in peak_breakdown({"device_traces": [[before]]}, start=0, peak=0)
        print("ok")
        """
    )
    assert _run_python("-c", script).stdout.strip().endswith("ok")
