"""The planner: one capture planned under many budgets, options checked once, one place that decides.

* ``ckptc.capture`` runs the model once; ``CapturedStep.plan`` then plans any
  budget from the captured graphs without running (or capturing) the model
  again, and gives exactly the plan that ``ckptc.optimize`` makes at its first
  training step (the compiler asks the same planner).
* With a graph break, the captured step plans the later graph with what the
  earlier one keeps under its new plan, and reports the whole step's floor.
* ``CheckpointOptions`` refuses unknown names (naming the valid ones) and bad
  values (quoting them), for ``optimize``, ``backend`` and ``torch.compile``'s
  ``options={...}`` alike.
* Only ``ckptc/planning/planner.py`` calls a solver, a preset or the floor (checked on
  the source, like ``tests/test_boundaries.py``).
"""

from __future__ import annotations

import ast
import copy
import inspect
import logging
from pathlib import Path

import pytest
import torch

import ckptc
from ckptc.options import CheckpointOptions

REPO = Path(__file__).resolve().parent.parent


def _mlp() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(*[torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.GELU()) for _ in range(6)])


def _refuse_to_run(*args, **kwargs):
    raise AssertionError("the model ran again: CapturedStep.plan must not capture again")


def test_one_capture_plans_many_budgets_without_running_the_model_again():
    model = _mlp()
    x = torch.randn(64, 64)
    step = ckptc.capture(model, (x,))
    assert "CapturedStep(Sequential, graphs=1" in repr(step) and ".plan(budget_bytes=...)" in repr(step)
    floor, top = step.floor_bytes, step.unoptimized_peak_bytes
    assert 0 < floor < top
    reference = copy.deepcopy(model)
    model.forward = _refuse_to_run  # any capture from here on would call it
    budgets = [floor, (floor + top) // 2, top * 2]
    plans = [step.plan(budget_bytes=b) for b in budgets]
    peaks = [p.predicted_peak_bytes for p in plans]
    recompute = [p.recompute_flops for p in plans]
    assert all(peak <= b for peak, b in zip(peaks, budgets, strict=True))
    assert recompute[0] >= recompute[1] >= recompute[2] == 0  # more budget never recomputes more
    with pytest.raises(ckptc.InfeasibleBudgetError) as info:
        step.plan(budget_bytes=floor - 1)
    assert info.value.min_feasible_bytes == floor
    assert step.plan(budget_bytes=budgets[1], strategy="layer").strategy == "layer"
    # A preset is applied as it is: under a budget it cannot meet it is refused, naming its peak.
    none_peak = step.plan(strategy="none").predicted_peak_bytes
    with pytest.raises(ckptc.InfeasibleBudgetError, match="strategy 'none' peaks at") as refused:
        step.plan(budget_bytes=none_peak - 1, strategy="none")
    assert refused.value.min_feasible_bytes == none_peak
    # A budget ckptc can plan but the chosen solver cannot: the error says which and what to do.
    with pytest.raises(ckptc.InfeasibleBudgetError, match="solver 'chen_sqrt' found no plan.*solver='auto' plans"):
        step.plan(budget_bytes=floor, solver="chen_sqrt")

    # The compiler at a first training step decides exactly what the captured step decided.
    fast = ckptc.optimize(reference, budget_bytes=budgets[1], verify=False)
    fast(x).sum().backward()
    assert fast.plan.to_json() == plans[1].to_json()


class _WithGraphBreak(torch.nn.Module):
    """A narrow first graph, then a wide second one: at a tight budget the first graph's plan keeps
    too much for the second to fit, and the step is planned again with the first keeping less."""

    def __init__(self) -> None:
        super().__init__()
        self.first = torch.nn.Sequential(
            *[torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Tanh()) for _ in range(6)]
        )
        self.second = torch.nn.Sequential(torch.nn.Linear(64, 1024), torch.nn.Tanh(), torch.nn.Linear(1024, 64))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.first(x)
        torch._dynamo.graph_break()
        return self.second(h).square().mean()


def test_a_captured_step_with_a_graph_break_plans_the_whole_step(caplog):
    torch.manual_seed(0)
    model = _WithGraphBreak()
    x = torch.randn(128, 64)
    step = ckptc.capture(copy.deepcopy(model), (x,), loss_fn=lambda out: out)
    assert step.graphs == 2
    budget = step.floor_bytes
    with caplog.at_level(logging.INFO, logger="ckptc.planning.replan"):
        planned = step.plan(budget_bytes=budget)
    assert "earlier graphs keep less" in caplog.text  # the step-wide retry ran
    assert planned.predicted_peak_bytes <= budget
    assert planned.min_feasible_bytes == step.floor_bytes
    with pytest.raises(ckptc.InfeasibleBudgetError) as info:
        step.plan(budget_bytes=budget - 1)
    assert info.value.min_feasible_bytes == budget
    # The run-time path (StepRuntime's retry around the compiler) decides the same.
    fast = ckptc.optimize(model, budget_bytes=budget, verify=False)
    fast(x).backward()
    assert fast.plan.to_json() == planned.to_json()


def test_options_are_checked_once_with_the_valid_names_and_the_bad_value():
    with pytest.raises(ValueError, match=r"option\(s\) \['budget_gib'\]; valid options are .*'budget_gb'"):
        CheckpointOptions.from_user(budget_gib=1)
    with pytest.raises(ValueError, match=r"unknown ckptc option\(s\) \['solvr'\]"):
        ckptc.backend(budget_gb=1, solvr="ilp")
    for name, value in (
        ("strategy", "fastest"),
        ("solver", "magic"),
        ("compiler", "tvm"),
        ("time_limit", -1),
        ("hold_outputs", "yes"),
        ("must_save", "*.mm"),
    ):
        with pytest.raises(ValueError, match=repr(value).replace("*", r"\*")):
            CheckpointOptions.from_user(**{name: value})
    with pytest.raises(ValueError, match="unknown strategy 'fastest'"):
        ckptc.optimize(_mlp(), budget_gb=1, strategy="fastest")
    options = CheckpointOptions.from_user(budget_gb=1, solver="ilp", must_save=["*.mm"])
    assert options.budget_bytes == 2**30 and options.must_save == ("*.mm",)
    assert "budget_gb" in CheckpointOptions.user_names() and "graph_budgets" not in CheckpointOptions.user_names()
    model = _mlp()
    compiled = torch.compile(model, backend="ckptc", options={"budget_gb": 1, "strategy": "fastest"})
    with pytest.raises(Exception, match="unknown strategy 'fastest'"):
        compiled(torch.randn(4, 64)).sum().backward()


def test_optimize_and_capture_take_exactly_the_options():
    """``optimize`` spells its options out for users; they are exactly CheckpointOptions' (plus the step's own)."""
    step_only = {"model", "progress", "verify", "max_plans", "unknown"}  # **unknown: refused, listing the rest
    assert set(inspect.signature(ckptc.optimize).parameters) - step_only == set(CheckpointOptions.user_names())


DECIDING_CALLS = {"solve", "lowest_peak_plan", "min_feasible_budget", "PRESETS", "keep_everything"}


def _imports_ckptc(tree: ast.AST) -> bool:
    for node in ast.walk(tree):
        names = [a.name for a in node.names] if isinstance(node, ast.Import) else []
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = [node.module]
        if any(name == "ckptc" or name.startswith("ckptc.") for name in names):
            return True
    return False


def test_only_the_planner_decides():
    """No module that plans a model (every module of ckptc, every bench module that imports ckptc) but
    the planner calls a solver, a preset or the floor: there is one place where a plan is chosen.  The
    policies (``ckptc/planning/policies.py``) only say what may be kept: they neither solve nor score a plan (the
    planner simulates it).  Bench modules that never import ckptc time the solvers on solver problems."""
    offenders = []
    for path in sorted([*(REPO / "ckptc").rglob("*.py"), *(REPO / "bench").glob("*.py")]):
        tree = ast.parse(path.read_text(), str(path))
        if path.parent.name == "bench" and not _imports_ckptc(tree):
            continue
        if path.relative_to(REPO).as_posix() == "ckptc/planning/planner.py":
            continue  # the one place
        deciding = DECIDING_CALLS | {"simulate"} if path.name == "policies.py" else DECIDING_CALLS
        for node in ast.walk(tree):
            name = node.attr if isinstance(node, ast.Attribute) else node.id if isinstance(node, ast.Name) else None
            if name in deciding:
                offenders.append(f"{path.relative_to(REPO)}:{node.lineno} {name}")
    assert offenders == []


def test_capture_builds_no_training_wrapper(monkeypatch):
    """``ckptc.capture`` runs its one planning call itself (``ShapePlan.plan_call``, the call that
    ``optimize``'s step runtime makes too), without an ``OptimizedModule`` or a ``StepRuntime``."""
    from ckptc.runtime import step as step_module

    def refuse(*args, **kwargs):
        raise AssertionError("capture built a training wrapper")

    monkeypatch.setattr(step_module.StepRuntime, "__init__", refuse)
    monkeypatch.setattr(ckptc.OptimizedModule, "__init__", refuse)
    model = _mlp()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    captured = ckptc.capture(model, (torch.randn(64, 64),))
    assert captured.graphs == 1 and captured.coverage is not None  # the reference forward ran
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())
    assert all(p.grad is None for p in model.parameters())
    with pytest.raises(ckptc.InvalidArgumentError, match="eval mode"):
        ckptc.capture(model.eval(), (torch.randn(64, 64),))


def test_only_the_replan_loop_changes_what_a_step_showed():
    """What a step shows (graph budgets, repeats, a measured correction, resident gradients, held
    outputs) becomes the next account in ``ckptc/planning/replan.py`` only: the capture path, the step runtime
    and the backend's check hold a ``Replans`` and never write those fields of the account themselves."""
    fields = {
        "graph_budgets",
        "repeat_bytes",
        "repeat_runs",
        "outside_baseline_bytes",
        "correction_bytes",
        "gradients_resident",
        "hold_outputs",
        "earlier_calls_planned",
        "eager_bytes_after",
        "results_let_go",
        "eager_saved_before",
    }
    offenders = []
    for path in sorted((REPO / "ckptc").rglob("*.py")):
        if path.name in ("replan.py", "account.py"):
            continue
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)):
                continue
            changes = {k.arg for k in node.keywords} & fields
            # The user's planning options (CheckpointOptions, named `checked` where they are) share the name
            # hold_outputs: a plan file's setting applies to them, not to an account.
            on_options = isinstance(node.func.value, ast.Name) and node.func.value.id == "checked"
            replaces = node.func.attr == "replace" and changes and not on_options
            if replaces or node.func.attr in ("counting_repeats", "tighter_graph_budgets"):
                offenders.append(f"{path.name}:{node.lineno} {node.func.attr}({', '.join(sorted(changes))})")
    assert offenders == []


def test_a_captured_step_plans_what_optimize_plans_with_breaks_and_repeated_graphs():
    """OPT's layer loop breaks (LayerDrop draws a random number per layer): 3 graphs, one of them run for
    both layers.  ``capture(...).plan`` and ``optimize``'s first call go through the same replan loop
    (``ckptc.planning.replan.settle``), so they make the same plan; they used to count repeats and tighten earlier
    graphs in different orders, and disagreed at this budget (969,220 against 972,036 bytes)."""
    from tests.helpers import step
    from tests.zoo import get_case

    case = get_case("opt", size="tiny")
    captured = ckptc.capture(copy.deepcopy(case.model), case.example_inputs, case.example_kwargs, loss_fn=case.loss)
    assert captured.graphs > 1 and len(captured.sequence) > captured.graphs
    budget = int(captured.floor_bytes + 0.25 * (captured.unoptimized_peak_bytes - captured.floor_bytes))
    planned = captured.plan(budget_bytes=budget)
    fast = ckptc.optimize(case.model, budget_bytes=budget, verify=False)
    step(case, fast)
    assert fast.plan.predicted_peak_bytes == planned.predicted_peak_bytes
    assert fast.plan.recompute_flops == planned.recompute_flops
    assert [g.plan.kept for g in fast.plan.graphs] == [g.plan.kept for g in planned.graphs]


def test_below_the_entry_points_the_budget_is_read_from_the_step_account():
    """Issue 19 item 6: the budget is validated where the user gives it and enters one step account;
    the compiler, the replan loop and the planner's decisions read it from the account they are given."""
    root = Path(ckptc.__file__).parent
    from_options: set[tuple[str, str]] = set()
    validated: set[tuple[str, str]] = set()
    for path in sorted(root.rglob("*.py")):
        tree = ast.parse(path.read_text())
        for function in ast.walk(tree):
            if not isinstance(function, (ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            for node in ast.walk(function):
                if (
                    isinstance(node, ast.Attribute)
                    and node.attr == "budget_bytes"
                    and ast.unparse(node.value).split(".")[-1] == "options"
                ):
                    from_options.add((path.name, function.name))
                if isinstance(node, ast.Call) and ast.unparse(node.func).endswith("budget_to_bytes"):
                    validated.add((path.name, function.name))
    # Where an account is made (one per step, or per budget of a captured step), and where a plan records it.
    assert from_options == {
        ("step.py", "first"),
        ("compiler.py", "__init__"),
        ("planner.py", "_decide_under"),
        ("planner.py", "plan"),
        ("plans.py", "from_records"),
    }
    # The entry points where users give a budget: options, CapturedStep.plan, the CLI's arguments.
    assert {(file, f) for file, f in validated if file != "cli.py"} == {
        ("options.py", "__post_init__"),
        ("options.py", "from_user"),
        ("planner.py", "_options"),
    }
    from ckptc.planning.planner import decide

    assert "budget_bytes" not in inspect.signature(decide).parameters


def test_a_refusal_says_what_the_step_holds_beyond_its_activations() -> None:
    """Under DDP the floor counts the gradient buckets, and the refusal gave only the floor."""
    import solvers
    from ckptc.options import CheckpointOptions
    from ckptc.planning.account import StepAccount
    from ckptc.planning.planner import _refusal

    account = StepAccount(budget_bytes=1000, rank_bytes=400, gradients_resident=True)
    error = _refusal(solvers.InfeasibleBudgetError(1000, 1500), 1500, CheckpointOptions(), account)
    message = str(error)
    assert error.min_feasible_bytes == 1500 and "400 bytes DDP or FSDP2" in message and "bucket_cap_mb" in message
    assert "zero_grad(set_to_none=True)" in message and "at least 1500 bytes" in message
    plain = _refusal(
        solvers.InfeasibleBudgetError(1000, 1500), 1500, CheckpointOptions(), StepAccount(budget_bytes=1000)
    )
    # A plain step holds nothing more, and its refusal still says what to do (it gave only the floor).
    assert "What to do: give a budget of at least 1500 bytes" in str(plain) and "DDP" not in str(plain)


def test_a_refusal_counting_eager_codes_bytes_names_the_callers_code_between_calls_as_well_as_a_break() -> None:
    """What a measured step held between graphs comes from the model's code after a graph break or from the
    caller's code between two calls of the model: an MLP called twice before one backward (no break) was told
    "5056 bytes held by eager code between graphs (after a graph break)" and only to remove the break (found by
    a probe)."""
    from ckptc.planning.account import StepAccount

    (said,) = StepAccount(budget_bytes=1000, eager_bytes_after={0: 5056}).beyond_a_plain_step()
    assert "5056 bytes held by eager code between graphs" in said, said
    assert "the caller's code between two calls of the model" in said and "remove the break" in said, said


def test_graphs_that_cannot_fit_together_after_the_retries_name_the_budget_the_last_one_needs():
    """After its retries (the graphs before it keeping as little as they can) a graph still short of room
    was refused with "give a few percent more budget" and no number (Whisper and BART called twice before
    one backward at 0.75x eager's peak).  The refusal now names the budget that graph needs at its floor
    beside them (both then trained at the budgets named in turn: 0.836x and 0.901x)."""
    from types import SimpleNamespace

    from ckptc.planning.replan import MAX_STEP_RETRIES, tighter_graph_budgets

    earlier = SimpleNamespace(index=0, infeasible=False, min_feasible_bytes=400, earlier=())
    short = SimpleNamespace(
        index=1, infeasible=True, min_feasible_bytes=900, floor_peak_bytes=1_000, margin_bytes=20, earlier=(earlier,)
    )
    with pytest.raises(ckptc.InfeasibleBudgetError) as refused:
        tighter_graph_budgets([earlier, short], 950, MAX_STEP_RETRIES, {})
    assert refused.value.min_feasible_bytes == 1_020
    assert "at least 1020 bytes" in str(refused.value)


def test_a_plan_of_a_step_split_by_graph_breaks_reports_the_steps_unoptimized_peak_at_every_budget() -> None:
    """A plan's ``unoptimized_peak_bytes`` was the largest of its graphs' own unoptimized peaks, each planned
    beside what the earlier graphs' chosen plans keep: below the unoptimized peak it fell with the budget,
    to the predicted peak itself (transformers' Funnel, five graphs: 0.000463 GiB reported at a budget of
    552,323 bytes against a keep-everything peak of 646,740).  It is now the step's peak with every graph
    keeping everything, whatever the budget."""
    from transformers import FunnelConfig, FunnelForMaskedLM

    torch.manual_seed(0)
    config = FunnelConfig(
        vocab_size=128, block_sizes=[1, 1], block_repeats=None, num_decoder_layers=1, d_model=32, n_head=4,
        d_head=8, d_inner=64, hidden_dropout=0.0, attention_dropout=0.0, activation_dropout=0.0,
        max_position_embeddings=64,
    )  # fmt: skip
    ids = torch.randint(4, 128, (2, 24))
    batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids}
    step = ckptc.capture(FunnelForMaskedLM(config).train(), (), batch)
    assert len(step.records) > 1  # split by graph breaks
    for fraction in (0.25, 1.0):
        budget = int(step.floor_bytes + fraction * (step.unoptimized_peak_bytes - step.floor_bytes))
        plan = step.plan(budget_bytes=budget)
        assert plan.unoptimized_peak_bytes == step.unoptimized_peak_bytes, (fraction, plan)
