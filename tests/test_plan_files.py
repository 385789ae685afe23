"""Plan files are a promise too: the same bytes in every process, no silent wrong
answer from damaged content, no plan applied under a budget it does not fit;
and ckptc's errors share one base class and are ValueErrors where a value is wrong.

A tiny MLP with dropout (tests/factories.py:mlp_dropout) keeps the file fast.
"""

from __future__ import annotations

import copy
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import ckptc
import solvers
from ckptc import report
from ckptc.cli import main
from ckptc.plans import MAX_PLAN_FILE_BYTES, ModelPlan, plan_source_for
from tests.factories import mlp_dropout

REPO = Path(__file__).resolve().parents[1]
FACTORIES = REPO / "tests" / "factories.py"

_SAVE_PLAN = textwrap.dedent(
    """
    import sys
    import ckptc
    from tests.factories import mlp_dropout

    model, inputs = mlp_dropout()
    ckptc.plan(model, inputs, budget_bytes=int(sys.argv[2])).save(sys.argv[1])
    """
)


def _eager_equal_step(
    optimized: torch.nn.Module, model: torch.nn.Module, reference: torch.nn.Module, inputs: tuple[torch.Tensor, ...]
) -> None:
    losses = []
    for m in (optimized, reference):
        torch.manual_seed(5)
        loss = m(*inputs).sum()
        loss.backward()
        losses.append(loss.detach())
    assert torch.allclose(losses[0], losses[1], rtol=1e-5, atol=1e-6)
    for (name, p), q in zip(model.named_parameters(), reference.parameters(), strict=False):
        assert torch.allclose(p.grad, q.grad, rtol=1e-4, atol=1e-6), name


def _planned(budget_fraction: float = 0.5) -> tuple[ckptc.OptimizedModule, dict[str, Any]]:
    """An optimized mlp_dropout after one step, and its plan as file data."""
    model, inputs = mlp_dropout()
    none = ckptc.plan(copy.deepcopy(model), inputs, strategy="none")
    budget = int(none.min_feasible_bytes + budget_fraction * (none.unoptimized_peak_bytes - none.min_feasible_bytes))
    optimized = ckptc.optimize(model, budget_bytes=budget)
    optimized(*inputs).sum().backward()
    return optimized, json.loads(optimized.plan.to_json())


@pytest.fixture(scope="module")
def planned() -> tuple[dict[str, Any], Any]:
    """(plan file data, the captured graph's JointProblem) to apply damaged plans to without compiling."""
    optimized, data = _planned()
    assert optimized.plan.values("recomputed"), "the budget must force recomputation"
    return data, optimized.compiler.records[0].joint_problem


# -- the same file in every process ---------------------------------------------------
def test_plan_files_are_byte_identical_across_processes_and_apply_in_another(tmp_path: Path) -> None:
    model, inputs = mlp_dropout()
    none = ckptc.plan(copy.deepcopy(model), inputs, strategy="none")
    budget = (none.min_feasible_bytes + none.unoptimized_peak_bytes) // 2
    paths = [tmp_path / f"plan{i}.json" for i in range(2)]
    env = dict(os.environ, PYTHONPATH=str(REPO))
    runs = [
        subprocess.Popen(
            [sys.executable, "-c", _SAVE_PLAN, str(path), str(budget)],
            cwd=REPO,
            env=env,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
        )
        for path in paths
    ]
    for run in runs:
        _, stderr = run.communicate(timeout=300)
        assert run.returncode == 0, stderr[-2000:]
    assert paths[0].read_bytes() == paths[1].read_bytes()
    assert "0x" not in paths[0].read_text()  # no memory address anywhere

    # a third process (this one) accepts it: the fingerprint does not depend on the process
    reference = copy.deepcopy(model)
    applied = ckptc.optimize(model, plan=paths[0])
    _eager_equal_step(applied, model, reference, inputs)
    assert applied.plan.values("recomputed")
    assert applied.plan.graphs[0].plan.info.applied_from_file


# -- a plan and a budget it does not fit -------------------------------------------------
def test_plan_with_an_explicit_budget_it_does_not_fit_is_refused_with_both_figures(tmp_path: Path) -> None:
    optimized, data = _planned()
    path = tmp_path / "plan.json"
    path.write_text(json.dumps(data))
    peak = data["predicted_peak_bytes"]
    model, inputs = mlp_dropout()
    with pytest.raises(ckptc.InfeasibleBudgetError) as info:  # naming the plan's peak
        ckptc.optimize(model, budget_bytes=peak - 1, plan=path)
    assert str(peak) in str(info.value) and str(peak - 1) in str(info.value)
    assert info.value.min_feasible_bytes == peak
    assert isinstance(info.value, ValueError)
    # a budget the plan fits is accepted and trains like eager
    reference = copy.deepcopy(model)
    _eager_equal_step(ckptc.optimize(model, budget_bytes=peak, plan=path), model, reference, inputs)


# -- damaged content: CorruptPlanError naming the field, never another exception --------
def _write(tmp_path: Path, data: Any) -> Path:
    path = tmp_path / "plan.json"
    path.write_text(data if isinstance(data, str) else json.dumps(data))
    return path


@pytest.mark.parametrize("budget", [0, -1, -5.0, "1GB", 1.5, True, [], {}, 2**70, "NaN", "Infinity", "-Infinity"])
def test_budget_in_a_plan_file_must_be_a_positive_whole_number(planned, tmp_path: Path, budget: Any) -> None:
    data = copy.deepcopy(planned[0])
    data["budget_bytes"] = budget
    text = json.dumps(data)
    if budget in ("NaN", "Infinity", "-Infinity"):  # JSON's non-standard literals, which json.loads accepts
        text = text.replace(f'"budget_bytes": "{budget}"', f'"budget_bytes": {budget}')
    with pytest.raises(ckptc.CorruptPlanError, match="'budget_bytes'"):
        ckptc.load_plan(_write(tmp_path, text))


@pytest.mark.parametrize(
    "field, value",
    [
        ("predicted_peak_bytes", "lots"),
        ("min_feasible_bytes", -1),
        ("recompute_flops", float("nan")),
        ("fingerprint", 42),
        ("inputs", "x"),
        ("plan", []),
        ("values", {}),
    ],
)
def test_wrong_types_in_a_graph_are_named(planned, tmp_path: Path, field: str, value: Any) -> None:
    data = copy.deepcopy(planned[0])
    data["graphs"][0][field] = value
    with pytest.raises(ckptc.CorruptPlanError, match=rf"'graphs\[0\]\.{field}'"):
        ckptc.load_plan(_write(tmp_path, data))


def test_missing_fields_are_named(planned, tmp_path: Path) -> None:
    data = copy.deepcopy(planned[0])
    del data["graphs"][0]["plan"]["kept"]
    with pytest.raises(ckptc.CorruptPlanError, match=r"'graphs\[0\]\.plan\.kept' is missing"):
        ckptc.load_plan(_write(tmp_path, data))


@pytest.mark.parametrize("field", ["kept", "schedule"])
def test_unknown_node_names_are_refused_when_applied(planned, field: str) -> None:
    data, jp = planned
    data = copy.deepcopy(data)
    plan = data["graphs"][0]["plan"]
    if field == "kept":
        plan["kept"].append("no.such.node")
    else:
        if plan["schedule"] is None:  # a derived schedule: give it an explicit one
            plan["schedule"] = [
                [jp.stable_names[s.node], s.phase] for s in solvers.schedule(jp.problem, solvers.Plan(kept=frozenset()))
            ]
        plan["schedule"][0][0] = "no.such.node"
    source = plan_source_for(ModelPlan.from_dict(data))
    with pytest.raises(ckptc.CorruptPlanError, match=rf"'graphs\[0\]\.plan\.{field}.*no\.such\.node"):
        source(0, jp)


def test_a_plan_file_saved_by_an_editor_with_a_byte_order_mark_or_crlf_loads_unchanged(planned, tmp_path: Path) -> None:
    original = ckptc.load_plan(_write(tmp_path, planned[0]))
    path = tmp_path / "edited.json"
    path.write_bytes(b"\xef\xbb\xbf" + json.dumps(planned[0], indent=2).replace("\n", "\r\n").encode())
    assert ckptc.load_plan(path).to_json() == original.to_json()


def test_deeply_nested_huge_and_oversized_documents_are_refused(planned, tmp_path: Path) -> None:
    nested = _write(tmp_path, "[" * 200_000 + "]" * 200_000)
    with pytest.raises(ckptc.CorruptPlanError, match="nested too deeply"):
        ckptc.load_plan(nested)

    data = copy.deepcopy(planned[0])
    data["graphs"][0]["inputs"][0] = json.loads("[" * 500 + "]" * 500)
    with pytest.raises(ckptc.CorruptPlanError, match=r"'graphs\[0\]\.inputs\[0\]' is nested"):
        ckptc.load_plan(_write(tmp_path, data))

    huge_number = json.dumps(planned[0]).replace('"baseline_bytes": ', '"baseline_bytes": 9' + "9" * 5000, 1)
    with pytest.raises(ckptc.CorruptPlanError):
        ckptc.load_plan(_write(tmp_path, huge_number))

    oversized = tmp_path / "huge.json"
    with open(oversized, "wb") as f:
        f.truncate(MAX_PLAN_FILE_BYTES + 1)  # sparse: costs no disk space
    with pytest.raises(ckptc.CorruptPlanError, match="more than any plan file"):
        ckptc.load_plan(oversized)


def _paths(value: Any, prefix: tuple = ()) -> list[tuple]:
    """Every path to a value inside a JSON document."""
    found = [prefix] if prefix else []
    if isinstance(value, dict):
        for k, v in value.items():
            found += _paths(v, prefix + (k,))
    elif isinstance(value, list):
        for i, v in enumerate(value[:8]):  # the first few elements of long lists are enough
            found += _paths(v, prefix + (i,))
    return found


_JSON_VALUES = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-(2**80), max_value=2**80),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=12),
    st.sampled_from(["forward", "backward", "kept", "no.such.node", "input.primals_1", "float32", ""]),
    st.lists(st.one_of(st.integers(-3, 3), st.text(max_size=3)), max_size=3),
    st.dictionaries(st.text(max_size=5), st.integers(), max_size=2),
    st.integers(min_value=20, max_value=200).map(lambda n: json.loads("[" * n + "]" * n)),
)


@settings(max_examples=150, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_any_damaged_plan_is_refused_with_a_corrupt_plan_error_or_applies(planned, data) -> None:
    valid, jp = planned
    document = copy.deepcopy(valid)
    paths = _paths(document)
    path = data.draw(st.sampled_from(paths), label="path")
    parent = document
    for key in path[:-1]:
        parent = parent[key]
    if data.draw(st.booleans(), label="delete"):
        del parent[path[-1]]
    else:
        parent[path[-1]] = data.draw(_JSON_VALUES, label="value")
    try:
        loaded = ModelPlan.from_dict(json.loads(json.dumps(document)), source="plan.json")
        # what `ckptc show` and applying the plan do with it
        repr(loaded)
        report.summary_line(loaded)
        report.plan_table(loaded)
        for index in range(len(loaded.graphs)):
            plan_source_for(loaded, loaded.budget_bytes)(index, jp)
    except (ckptc.CorruptPlanError, ckptc.PlanMismatchError, ckptc.InfeasibleBudgetError) as error:
        assert "plan" in str(error)


# -- errors: one base class, ValueError for wrong values -----------------------------------
def test_a_missing_plan_file_is_a_ckptc_error_and_a_file_not_found_error(tmp_path: Path) -> None:
    missing = tmp_path / "nowhere" / "plan.json"
    model = torch.nn.Linear(2, 2)
    before = copy.deepcopy(model.state_dict())
    for call in (
        lambda: ckptc.load_plan(missing),
        lambda: ckptc.optimize(model, plan=missing),
        lambda: ckptc.apply(model, plan=missing),
    ):
        with pytest.raises(ckptc.PlanFileNotFoundError, match="no plan file at .*What to do") as info:
            call()
        assert isinstance(info.value, ckptc.CkptcError) and isinstance(info.value, FileNotFoundError)
        assert info.value.filename == str(missing)
    assert not ckptc.inplace.is_applied(model)
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    assert model(torch.ones(1, 2)).shape == (1, 2)


def test_every_error_shares_one_base_class_and_value_errors_are_value_errors() -> None:
    for error in (
        ckptc.InfeasibleBudgetError,
        ckptc.CorruptPlanError,
        ckptc.PlanMismatchError,
        ckptc.UntraceableModelError,
        solvers.SolverError,
        solvers.InvalidPlanError,
    ):
        assert issubclass(error, ckptc.CkptcError), error
    for error in (ckptc.InfeasibleBudgetError, ckptc.CorruptPlanError, ckptc.PlanMismatchError):
        assert issubclass(error, ValueError), error
    assert ckptc.CkptcError is solvers.errors.CkptcError


def test_solvers_import_without_torch_or_ckptc() -> None:
    script = (
        "import sys, solvers; assert 'torch' not in sys.modules and 'ckptc' not in sys.modules; "
        "assert issubclass(solvers.InfeasibleBudgetError, solvers.errors.CkptcError)"
    )
    out = subprocess.run(
        [sys.executable, "-c", script],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
        env=dict(os.environ, PYTHONPATH=str(REPO)),
    )
    assert out.returncode == 0, out.stderr[-2000:]


@pytest.mark.parametrize(
    "kwargs, quoted",
    [
        ({"budget_gb": 1e300}, "1e+300"),
        ({"budget_gb": 10**300}, "1000000"),
        ({"budget_bytes": 2**64}, str(2**64)),
        ({"budget_gb": 1e-12}, "1e-12"),
        ({"budget_bytes": 0.5}, "0.5"),
    ],
)
def test_budgets_out_of_range_are_value_errors_quoting_the_value(kwargs: dict[str, float], quoted: str) -> None:
    model, _ = mlp_dropout()
    with pytest.raises(ValueError, match=r"budget_(gb|bytes)=") as info:
        ckptc.optimize(model, **kwargs)
    assert quoted in str(info.value)


# -- CLI -----------------------------------------------------------------------------------
def _cli(capsys: pytest.CaptureFixture[str], *argv: object) -> tuple[int, str]:
    code = main([str(a) for a in argv])
    err = capsys.readouterr().err
    return code, err


def test_cli_budget_too_large_is_one_line(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    code, err = _cli(capsys, "plan", f"{FACTORIES}:mlp", "--budget-gb", "1e300", "-o", tmp_path / "p.json")
    assert code != 0 and err.count("\n") == 1 and "1e300" in err, err


def test_cli_show_of_a_plan_without_graphs_says_so(capsys: pytest.CaptureFixture[str], planned, tmp_path: Path) -> None:
    data = copy.deepcopy(planned[0])
    data["graphs"] = []
    code, err = _cli(capsys, "show", _write(tmp_path, data))
    assert code != 0 and err.count("\n") == 1 and "no graphs" in err, err


# -- issue 22: bounded reads, duplicate keys, path types, every field against the graph ---------
def test_a_path_to_a_device_is_refused_without_reading_it(tmp_path: Path) -> None:
    import resource

    link = tmp_path / "plan.json"
    link.symlink_to("/dev/zero")
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    with pytest.raises(ckptc.CorruptPlanError, match="not a regular file"):
        ckptc.load_plan(link)
    with pytest.raises(ckptc.CorruptPlanError, match="not a regular file"):
        ckptc.optimize(torch.nn.Linear(2, 2), plan=link)
    assert resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before < 64 * 1024  # KiB: nothing was read


def test_a_file_read_is_bounded_by_the_limit_whatever_its_size_said(planned, tmp_path: Path, monkeypatch) -> None:
    path = _write(tmp_path, planned[0])
    monkeypatch.setattr("ckptc.plans.MAX_PLAN_FILE_BYTES", 64)
    monkeypatch.setattr("os.stat", lambda p, *a, **k: _small_stat(p))
    with pytest.raises(ckptc.CorruptPlanError, match="more than any plan file"):
        ckptc.load_plan(path)


def _small_stat(path: Any) -> os.stat_result:
    """What stat said before the file grew: a regular file of 10 bytes."""
    real = os.lstat(path)
    return os.stat_result((real.st_mode, *tuple(real)[1:6], 10, *tuple(real)[7:10]))


def test_duplicate_keys_are_refused_naming_the_key(planned, tmp_path: Path) -> None:
    text = json.dumps(planned[0]).replace('"budget_bytes": ', '"budget_bytes": 99, "budget_bytes": ', 1)
    with pytest.raises(ckptc.CorruptPlanError, match="'budget_bytes' appears twice"):
        ckptc.load_plan(_write(tmp_path, text))


@pytest.mark.parametrize("plan", [123, 3.5, b"plan.json", ["plan.json"], {"graphs": []}])
def test_a_plan_is_a_path_or_a_model_plan(plan: Any) -> None:
    read, write = os.pipe()
    try:
        with pytest.raises(ckptc.ArgumentTypeError, match="a plan is a path"):
            ckptc.optimize(torch.nn.Linear(2, 2), plan=plan)
        os.fstat(read)  # the caller's descriptors stay open
    finally:
        os.close(read)
        os.close(write)


# Mutations each field gets.  Accepted only where the value is legitimately valid for the field:
# another boolean for a flag, a fractional figure for a solver's own numbers, free text where the
# field is free text.  Everything else must be refused with CorruptPlanError naming the field
# (or PlanMismatchError where the field says which graph the plan is for).
_MUTATIONS: list[Any] = ["", "x", -5, True, 1.5, None, [], {}]
_FREE_NUMBERS = {"gap", "bound", "objective", "recompute_cost"}
_FREE_TEXT = {"status", "candidate", "solver_status"}
_IDENTITY = {"inputs", "fingerprint", "torch_version"}


def _field_name(path: tuple) -> str:
    text = ""
    for key in path:
        text += f"[{key}]" if isinstance(key, int) else (f".{key}" if text else key)
    return text


def _legitimate(path: tuple, original: Any, value: Any) -> bool:
    leaf = next(k for k in reversed(path) if isinstance(k, str))
    if isinstance(original, bool):
        return isinstance(value, bool)
    if leaf == "hold_outputs":
        return value is None or isinstance(value, bool)  # null (ckptc watched the loop), true or false
    if value is None and (leaf in ("budget_bytes", "parameter_bytes", "gradient_bytes", "schedule") or _in_info(path)):
        return True  # "no limit", "not known", "derived from kept"
    if value == {} and leaf == "details":
        return True  # a solver that reports no details
    in_details = "details" in path
    return (leaf in _FREE_NUMBERS and value == 1.5) or ((leaf in _FREE_TEXT or in_details) and value == "x")


def _in_info(path: tuple) -> bool:
    """A solve-info field that may be unknown (null): not the flags, not details."""
    return len(path) >= 2 and path[-2] == "info" and path[-1] not in ("refined", "applied_from_file", "details")


def test_every_single_field_mutation_is_refused_naming_the_field_or_is_valid(planned) -> None:
    valid, jp = planned
    leaves = [p for p in _paths(valid) if not isinstance(_at(valid, p), (dict, list)) or p[-1] == "details"]
    accepted = []
    for path in leaves:
        original = _at(valid, path)
        for value in _MUTATIONS:
            if value == original and type(value) is type(original):
                continue
            document = copy.deepcopy(valid)
            _at(document, path[:-1])[path[-1]] = value
            try:
                loaded = ModelPlan.from_dict(json.loads(json.dumps(document)), source="plan.json")
                for index in range(len(loaded.graphs)):
                    plan_source_for(loaded, loaded.budget_bytes)(index, jp)
            except ckptc.CorruptPlanError as error:
                last_key = max(i for i, k in enumerate(path) if isinstance(k, str))
                named = {_field_name(path[:n]) for n in range(last_key + 1, len(path) + 1)}
                assert any(f"'{name}'" in str(error) for name in named), (path, value, str(error))
                continue
            except ckptc.PlanMismatchError:
                if any(k in _IDENTITY for k in path):
                    continue
                raise
            if not _legitimate(path, original, value):
                accepted.append((_field_name(path), value))
    assert accepted == [], "\n".join(map(repr, accepted))


def _at(document: Any, path: tuple) -> Any:
    for key in path:
        document = document[key]
    return document


@pytest.mark.parametrize("value", ["x", -5, True, 1.5, None])
@pytest.mark.parametrize("detail", ["blocks", "block_classes"])
def test_a_hierarchical_plans_block_counts_are_whole_numbers(planned, tmp_path: Path, detail: str, value: Any) -> None:
    data = copy.deepcopy(planned[0])
    data["graphs"][0]["plan"]["info"]["details"] = {"blocks": 4, "block_classes": 1, detail: value}
    with pytest.raises(ckptc.CorruptPlanError, match=rf"'graphs\[0\]\.plan\.info\.details\.{detail}'"):
        ckptc.load_plan(_write(tmp_path, data))


@pytest.mark.parametrize("option", [{"strategy": "none"}, {"solver": "chen_greedy"}, {"must_save": ["*"]}])
def test_a_plan_applied_with_options_that_would_change_nothing_is_refused(option: dict[str, Any]) -> None:
    """``optimize(plan=..., strategy="none")`` applied the plan and reported strategy 'none'."""
    with pytest.raises(ckptc.InvalidArgumentError, match="applies a plan as it is"):
        ckptc.optimize(torch.nn.Linear(2, 2), plan=ModelPlan([], None, "auto", "auto"), **option)


def test_a_plan_file_refused_in_place_says_the_model_stays_applied_and_how_to_undo_it(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.GELU(), torch.nn.Linear(64, 1))
    reference = copy.deepcopy(model)
    planned = ckptc.optimize(copy.deepcopy(model), strategy="none")
    planned(torch.randn(16, 32)).sum().backward()
    path = tmp_path / "plan.json"
    planned.plan.save(path)
    ckptc.apply(model, plan=path)
    other = torch.randn(8, 32)  # another batch size than the plan's
    with pytest.raises(ckptc.PlanMismatchError, match=r"stays applied to this Sequential.*ckptc\.remove\(model\)"):
        model(other).sum().backward()
    ckptc.remove(model)
    model(other).sum().backward()
    reference(other).sum().backward()
    for mine, theirs in zip(model.parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(mine.grad, theirs.grad)


def test_a_plan_for_other_trainable_parameters_names_requires_grad_and_no_difference_that_is_not_there(
    tmp_path: Path,
) -> None:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.GELU(), torch.nn.Linear(64, 1))
    planned = ckptc.optimize(copy.deepcopy(model), strategy="none")
    x = torch.randn(16, 32)
    planned(x).sum().backward()
    path = tmp_path / "plan.json"
    planned.plan.save(path)
    model[0].requires_grad_(False)  # staged fine-tuning: the first layer frozen
    fast = ckptc.optimize(model, plan=path)
    with pytest.raises(ckptc.PlanMismatchError, match="requires_grad") as info:
        fast(x).sum().backward()
    assert "this graph does not have" not in str(info.value)  # every value the plan lists is still there


def test_a_plan_file_met_by_a_second_shape_says_the_sizes_became_symbolic(tmp_path: Path) -> None:
    # torch.compile makes a size dynamic once it sees a second one; the inputs then no longer line up
    # with the plan's, and the message listed symbolic sizes against the plan's shifted inputs.
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.GELU(), torch.nn.Linear(64, 1))
    x = torch.randn(16, 32)
    planned = ckptc.optimize(copy.deepcopy(model), strategy="none")
    planned(x).sum().backward()
    path = tmp_path / "plan.json"
    planned.plan.save(path)
    fast = ckptc.optimize(model, plan=path)
    fast(x).sum().backward()
    with pytest.raises(ckptc.PlanMismatchError, match="symbolic sizes .* other input shapes than this call's"):
        fast(torch.randn(8, 32)).sum().backward()


def test_a_plan_chen_greedy_chose_is_saved_and_applied(tmp_path: Path) -> None:
    """Chen's greedy recorded its threshold as the float its search bisected (``4657025.98...``), which the
    plan file's reader, rightly strict about whole bytes, refused as damaged: no plan file made with
    ``solver="chen_greedy"``, or by ``auto`` where it chose Chen's plan, could be applied."""
    torch.manual_seed(0)
    layers: list[torch.nn.Module] = [torch.nn.Linear(64, 256), torch.nn.Tanh()]
    for _ in range(5):
        layers += [torch.nn.Linear(256, 256), torch.nn.Tanh()]
    model, x = torch.nn.Sequential(*layers), torch.randn(1024, 64)
    captured = ckptc.capture(copy.deepcopy(model), (x,))
    budget = int(captured.floor_bytes + 0.3 * (captured.unoptimized_peak_bytes - captured.floor_bytes))
    planned = captured.plan(budget_bytes=budget, solver="chen_greedy")
    assert planned.to_dict()["graphs"][0]["plan"]["method"] == "chen_greedy"
    path = tmp_path / "chen.plan.json"
    planned.save(path)
    eager = copy.deepcopy(model)
    fast = ckptc.optimize(model, plan=str(path))
    fast(x).sum().backward()
    eager(x).sum().backward()
    for p, q in zip(model.parameters(), eager.parameters(), strict=True):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-5, atol=1e-6)
