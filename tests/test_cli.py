"""The ``ckptc`` command line, run in-process through ``ckptc.cli.main``.

Real models: Hugging Face GPT-2 (tiny config) for plan/show, a tiny MLP for
the commands that plan or run many times (report, pareto, budget errors), so
the file stays well under a minute and a half on 2 CPU cores.
"""

from __future__ import annotations

import copy
import io
import json
import math
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import ckptc
from ckptc import report
from ckptc.cli import ProgressLine, main

REPO = Path(__file__).resolve().parents[1]
FACTORIES = REPO / "tests" / "factories.py"


def factory(name: str) -> str:
    return f"{FACTORIES}:{name}"


def run(capsys: pytest.CaptureFixture[str], *argv: object) -> tuple[int, str, str]:
    """``ckptc ARGV...`` in-process: (exit status, stdout, stderr)."""
    code = main([str(a) for a in argv])
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def assert_one_line_error(code: int, err: str, *expected: str) -> None:
    assert code != 0
    assert "Traceback" not in err
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    for text in expected:
        assert text in lines[0], lines[0]


def assert_sensible_png(path: Path) -> None:
    """A real image: at least 200x200 pixels and not a single flat colour."""
    image = pytest.importorskip("matplotlib.image").imread(path)
    assert image.shape[0] >= 200 and image.shape[1] >= 200, image.shape
    assert image.std() > 0.01


def budget_bounds(model: object, inputs: tuple, kwargs: dict | None = None, loss_fn: object = None) -> tuple[int, int]:
    """(smallest feasible budget, unoptimized peak), from a keep-everything plan."""
    baseline = ckptc.plan(model, inputs, kwargs, strategy="none", loss_fn=loss_fn)
    return baseline.min_feasible_bytes, baseline.unoptimized_peak_bytes


@pytest.fixture(scope="module")
def gpt2_plan_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """``ckptc plan`` on GPT-2 with a budget halfway between the smallest feasible and the unoptimized peak."""
    from tests.factories import gpt2

    case = gpt2()
    low, high = budget_bounds(case.model, case.example_inputs, case.example_kwargs, case.loss)
    path = tmp_path_factory.mktemp("plans") / "gpt2.json"
    code = main(["plan", factory("gpt2"), "--budget-bytes", str((low + high) // 2), "-o", str(path)])
    assert code == 0
    return path


@pytest.fixture(scope="module")
def mlp_bounds() -> tuple[int, int]:
    """(smallest feasible budget, unoptimized peak) of the tiny MLP."""
    from tests.factories import mlp

    model, inputs = mlp()
    return budget_bounds(model, inputs)


# --------------------------------------------------------------------------- #
# plan and show                                                                #
# --------------------------------------------------------------------------- #


def test_plan_writes_a_plan_file_that_loads(gpt2_plan_file: Path) -> None:
    path = gpt2_plan_file
    model_plan = ckptc.load_plan(path)
    assert model_plan.predicted_peak_bytes <= model_plan.budget_bytes < model_plan.unoptimized_peak_bytes
    assert model_plan.values("recomputed") and model_plan.values("kept")
    assert model_plan.parameter_bytes and model_plan.gradient_bytes


def test_plan_prints_one_summary_line(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    path = tmp_path / "mlp.json"
    code, out, err = run(capsys, "plan", factory("mlp"), "--budget-gb", "1", "-o", path)
    assert code == 0, err
    lines = out.strip().splitlines()
    assert len(lines) == 1
    assert lines[0].startswith(f"{path}: parameters ")
    for field in ("gradients", "kept activations", "predicted peak", "unoptimized", "% of step FLOPs"):
        assert field in lines[0]
    assert ckptc.load_plan(path).budget_bytes == 1024**3


def test_show_prints_the_module_table(capsys: pytest.CaptureFixture[str], gpt2_plan_file: Path) -> None:
    path = gpt2_plan_file
    code, out, err = run(capsys, "show", path)
    assert code == 0, err
    lines = out.strip().splitlines()
    assert lines[0].split()[:2] == ["module", "kept"] and "recompute FLOPs" in lines[0] and "decision" in lines[0]
    table = lines[: lines.index("")]  # the table, then a blank line, then the summary
    body = {line.split()[0]: line for line in table[2:]}
    # One row per module of the real GPT-2, each ending with its decision.
    assert "transformer.h.0.attn" in body and "transformer.h.1.mlp.act" in body
    decisions = {line.split()[-1] for name, line in body.items() if name != "total"}
    assert decisions <= {"keep", "recompute", "mixed", "free"} and decisions & {"recompute", "mixed"}
    model_plan = ckptc.load_plan(path)
    total = body["total"].split()
    assert int(total[1]) == len(model_plan.values("kept"))
    summary = lines[-1]
    assert summary.startswith("parameters ") and "predicted peak" in summary


def test_budget_error_names_the_smallest_feasible_budget_and_it_works(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    path = tmp_path / "plan.json"
    code, out, err = run(capsys, "plan", factory("mlp_dict"), "--budget-bytes", "1000", "-o", path)
    assert_one_line_error(code, err, "smallest feasible budget", "use --budget-bytes")
    assert not path.exists()
    suggested = int(re.search(r"--budget-bytes (\d+)", err).group(1))
    code, out, err = run(capsys, "plan", factory("mlp_dict"), "--budget-bytes", suggested, "-o", path)
    assert code == 0, err
    assert ckptc.load_plan(path).predicted_peak_bytes <= suggested


# --------------------------------------------------------------------------- #
# report and pareto                                                            #
# --------------------------------------------------------------------------- #


def test_report_plots_timelines_and_prints_peaks(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, mlp_bounds: tuple[int, int]
) -> None:
    low, high = mlp_bounds
    png = tmp_path / "memory.png"
    code, out, err = run(capsys, "report", factory("mlp"), "--budget-bytes", (low + high) // 2, "--plot", png)
    assert code == 0, err
    assert_sensible_png(png)
    plan_line = next(line for line in out.splitlines() if line.startswith("plan"))
    assert "predicted peak" in plan_line and "measured peak" in plan_line
    assert f"wrote {png}" in out


def test_pareto_plots_curves_and_prints_points(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    png = tmp_path / "pareto.png"
    code, out, err = run(
        capsys, "pareto", factory("mlp"), "--solvers", "chen_greedy", "hierarchical", "--points", "3", "--plot", png
    )
    assert code == 0, err
    assert_sensible_png(png)
    rows = [line.split() for line in out.splitlines() if line.startswith(("chen_greedy ", "hierarchical "))]
    assert len(rows) == 6  # 3 budgets x 2 solvers, infeasible ones included and marked
    assert any(row[0] == "chen_greedy" and row[-1].endswith("%") for row in rows)


def test_the_report_shows_the_plan_of_the_step_it_measured() -> None:
    """A loss computed outside the model that takes memory between forward and backward (``square()``) is
    measured on the step that plans, and the next step plans again pricing it: the report's plan and its
    predicted timeline are those of the step it measured (they were the first plan's)."""
    torch.manual_seed(0)
    layers: list[torch.nn.Module] = [torch.nn.Linear(64, 256), torch.nn.Tanh()]
    for _ in range(3):
        layers += [torch.nn.Linear(256, 256), torch.nn.Tanh()]
    model = torch.nn.Sequential(*layers)
    x = torch.randn(2048, 64, generator=torch.Generator().manual_seed(1))

    def loss(out: torch.Tensor) -> torch.Tensor:
        return out.square().mean()

    captured = ckptc.capture(copy.deepcopy(model), (x,), loss_fn=loss)
    budget = (captured.floor_bytes + captured.unoptimized_peak_bytes) // 2
    timelines = report.memory_timelines(model, (x,), budget_bytes=budget, loss_fn=loss)
    predicted = timelines.get(optimized=True, measured=False)
    measured = timelines.get(optimized=True, measured=True)
    assert predicted is not None and measured is not None
    assert max(predicted.values) == timelines.model_plan.predicted_peak_bytes
    assert max(measured.values) <= budget
    # The plan that ran prices the loss at what it measured: its prediction covers the measured step (the
    # first plan's missed the loss) and is within a few percent of it.
    assert max(measured.values) <= max(predicted.values) <= 1.05 * max(measured.values), (
        max(measured.values),
        max(predicted.values),
    )


# --------------------------------------------------------------------------- #
# help and errors                                                              #
# --------------------------------------------------------------------------- #


@pytest.mark.parametrize("command", [[], ["plan"], ["show"], ["report"], ["pareto"]])
def test_help(capsys: pytest.CaptureFixture[str], command: list[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main([*command, "--help"])
    assert exit_info.value.code == 0
    assert capsys.readouterr().out.startswith(f"usage: {' '.join(['ckptc', *command])}")


def test_python_dash_m_help() -> None:
    result = subprocess.run(
        [sys.executable, "-m", "ckptc", "--help"], cwd=REPO, capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stderr
    assert "plan" in result.stdout and "pareto" in result.stdout


@pytest.mark.parametrize(
    "argv, expected",
    [
        (["plan", "missing.py:make"], "no such file"),
        (["plan", "mypackage.models:make"], "names a Python file, not a module"),
        (["plan", str(FACTORIES)], "is not FILE.py:FACTORY"),
        (["plan", f"{FACTORIES}:"], "is not FILE.py:FACTORY"),
        (["plan", f"{FACTORIES}:no_such_factory"], "has no 'no_such_factory'"),
        (["plan", f"{FACTORIES}:wrong_shape"], "returned an int"),
        (["plan", f"{FACTORIES}:not_a_model"], "not a torch.nn.Module"),
        (["plan", f"{FACTORIES}:mlp", "--budget-gb", "-1"], "--budget-gb"),
        (["plan", f"{FACTORIES}:mlp", "--budget-gb", "nan"], "positive finite"),
        (["plan", f"{FACTORIES}:mlp", "--budget-bytes", "lots"], "not a number"),
        (["plan", f"{FACTORIES}:mlp", "--budget-gb", "1", "--budget-bytes", "5"], "not allowed with"),
        (["plan", f"{FACTORIES}:mlp", "--solver", "magic"], "invalid choice"),
        (["plan", f"{FACTORIES}:mlp", "-o", "/no/such/folder/plan.json"], "does not exist"),
        pytest.param(
            ["plan", f"{FACTORIES}:mlp", "-o", "/proc/version"],
            "/proc/version: cannot write the plan",
            marks=pytest.mark.skipif(not Path("/proc/version").is_file(), reason="a file no one can write: Linux"),
        ),
        (["pareto", f"{FACTORIES}:mlp", "--points", "0"], "at least 1"),
        (["show", "missing.json"], "no such file"),
        (["bogus"], "invalid choice"),
    ],
)
def test_bad_input_gives_one_line_error(capsys: pytest.CaptureFixture[str], argv: list[str], expected: str) -> None:
    code, _, err = run(capsys, *argv)
    assert_one_line_error(code, err, expected)


def test_an_input_the_model_cannot_take_gives_one_line_without_torchs_log() -> None:
    """Fake tensors log the failed op's traceback through torch's logger before the error reaches ckptc:
    the command still prints one line (run in a process of its own: that logger writes to the real stderr)."""
    result = subprocess.run(
        [sys.executable, "-m", "ckptc", "plan", f"{FACTORIES}:input_of_the_wrong_width"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert_one_line_error(result.returncode, result.stderr, "could not capture", "RuntimeError")


@pytest.mark.parametrize(
    "content, expected",
    [
        ('{"format": "ckptc-plan", "schema_version": 1, "graphs": [', "not valid JSON"),
        ('{"some": "json"}', "not a ckptc plan file"),
        ('{"format": "ckptc-plan", "schema_version": 1, "graphs": [{"fingerprint": 1}]}', "damaged"),
        (b"\xff\xfe\x00binary", "not a text file"),
    ],
)
def test_corrupt_plan_file_gives_one_line_error(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, content: str | bytes, expected: str
) -> None:
    path = tmp_path / "plan.json"
    path.write_bytes(content if isinstance(content, bytes) else content.encode())
    code, _, err = run(capsys, "show", path)
    assert_one_line_error(code, err, expected)


def test_factory_file_errors_give_one_line(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    broken = tmp_path / "broken.py"
    broken.write_text("def make(:\n")
    assert_one_line_error(*run(capsys, "plan", f"{broken}:make")[::2], "syntax error")
    raising = tmp_path / "raising.py"
    raising.write_text("def make():\n    raise RuntimeError('no GPU here\\nsecond line')\n")
    assert_one_line_error(*run(capsys, "plan", f"{raising}:make")[::2], "RuntimeError: no GPU here second line")


# --------------------------------------------------------------------------- #
# report.py pieces                                                             #
# --------------------------------------------------------------------------- #


def test_resample_keeps_the_peak_and_spans_the_step() -> None:
    values = [0] * 999 + [7] + [1] * 1000
    resampled = report.resample_peaks(values, 50)
    assert len(resampled) == 50 and max(resampled) == 7
    assert report.resample_peaks([3, 5], 4) == [3, 3, 5, 5]


def test_budget_range_spans_smallest_to_unoptimized() -> None:
    assert report.budget_range(100, 200, 3) == [100, 150, 200]
    assert report.budget_range(100, 100, 5) == [100]
    assert all(math.isfinite(b) for b in report.budget_range(1, 10**12, 6))


def test_summary_of_an_old_plan_file_without_parameter_sizes(gpt2_plan_file: Path, tmp_path: Path) -> None:
    data = json.loads(gpt2_plan_file.read_text())
    del data["parameter_bytes"], data["gradient_bytes"]
    old = tmp_path / "old.json"
    old.write_text(json.dumps(data))
    assert report.summary_line(ckptc.load_plan(old)).startswith("parameters ?, gradients ?")


class _Stream(io.StringIO):
    def __init__(self, tty: bool) -> None:
        super().__init__()
        self.tty = tty

    def isatty(self) -> bool:
        return self.tty


def test_progress_line_is_silent_for_quick_solves_and_one_line_on_a_terminal() -> None:
    quiet = _Stream(tty=True)
    line = ProgressLine(quiet, delay=60.0)
    line(0.5, "dp"), line(1.0, "dp: done"), line.finish()
    assert quiet.getvalue() == ""

    terminal = _Stream(tty=True)
    line = ProgressLine(terminal, delay=0.0, min_interval=0.0)
    line(0.25, "dp: sub-chains"), line(1.0, "dp: done"), line.finish()
    assert terminal.getvalue().count("\n") == 1 and "\r" in terminal.getvalue()
    assert terminal.getvalue().rstrip().endswith("100% dp: done")

    log_file = _Stream(tty=False)
    line = ProgressLine(log_file, delay=0.0)
    for i in range(101):
        line(i / 100, "ilp")
    assert len(log_file.getvalue().splitlines()) == 11  # every 10 %, no carriage returns


def test_plan_offline_from_the_cli(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    """`--fake` runs the factory under fake tensors; a factory building on meta plans for `--device`."""
    from tests.factories import mlp

    model, inputs = mlp()
    real = ckptc.plan(model, inputs, budget_gb=1, measure_scratch=False)
    path = tmp_path / "fake.json"
    code, _, err = run(capsys, "plan", factory("mlp"), "--budget-gb", "1", "--fake", "-o", path)
    assert code == 0, err
    assert ckptc.load_plan(path).graphs[0].to_dict() == real.graphs[0].to_dict()
    code, out, err = run(capsys, "plan", factory("llama_on_meta"), "--budget-gb", "1", "-o", tmp_path / "meta.json")
    assert code == 0, err
    assert "predicted peak" in out
    code, _, err = run(
        capsys, "plan", factory("llama_on_meta"), "--budget-gb", "1", "--device", "meta", "-o", tmp_path / "x.json"
    )
    assert_one_line_error(code, err, "'meta' device")


def test_a_plan_made_for_a_loop_holding_its_output_carries_that_and_fits_from_the_first_step(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    """The Hugging Face docs' loop keeps the output object through backward (``out = model(**batch);
    out.loss.backward()``).  ``ckptc plan`` had no way to plan for it: a file made for that loop's budget
    measured 1.041x it on the first step (a 2-layer GPT-2, 1,717,824 B against 1,650,000 B), and the
    refusal after it did not say how to plan for the loop.  ``--hold-outputs`` now does, and the first step
    measures within the budget, independently, with eager's gradients.  The file carries the setting: a plan
    made with ``hold_outputs=True`` was refused as damaged ("the file was edited") unless the same option
    was passed again when applying it; now it applies as made, and another setting is refused naming it."""
    from ckptc.meter import measure_peak, resident_bytes
    from tests.factories import gpt2

    case = gpt2()
    low, high = budget_bounds(case.model, case.example_inputs, case.example_kwargs, case.loss)
    budget = (low + high) // 2
    path = tmp_path / "held.json"
    code, _, err = run(capsys, "plan", factory("gpt2"), "--budget-bytes", budget, "--hold-outputs", "-o", path)
    assert code == 0, err
    assert json.loads(path.read_text())["hold_outputs"] is True
    with pytest.raises(ckptc.InvalidArgumentError, match="hold_outputs=True"):
        ckptc.optimize(copy.deepcopy(case.model), plan=str(path), hold_outputs=False)

    eager, model = copy.deepcopy(case.model), copy.deepcopy(case.model)
    fast = ckptc.optimize(model, plan=str(path))
    (ids,), labels = case.example_inputs, case.example_kwargs["labels"]

    def step(net: torch.nn.Module) -> None:
        torch.manual_seed(0)
        out = net(ids, labels=labels)
        out.loss.backward()

    _, first = measure_peak(lambda: step(fast), baseline_bytes=resident_bytes(model, (ids, labels)))
    assert first.peak_bytes <= budget, (first.peak_bytes, budget)
    step(eager)
    for (name, p), q in zip(model.named_parameters(), eager.parameters(), strict=True):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-4, atol=1e-5, msg=name)
