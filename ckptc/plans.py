"""Plans for a whole model: inspect, save as JSON, load and apply later.

A :class:`ModelPlan` gathers the :class:`solvers.Plan` of every captured graph
(graph breaks give several) with what is needed to check that it still fits:
a fingerprint of each joint graph, the input shapes and dtypes, the torch and
ckptc versions.  Decisions are keyed by stable, readable node names
(``transformer.h.3.attn.mm_1``), not by FX's internal names.

Plan files are plain JSON, written with sorted keys so the same model, inputs
and budget give a byte-identical file.  Loading never runs code.
"""

from __future__ import annotations

import dataclasses
import errno
import hashlib
import json
import os
import re
import stat
import types
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Iterable, NamedTuple, NoReturn

import torch

import solvers
import solvers.plan
from ckptc._torch_internals import is_op_overload
from ckptc.errors import (
    ArgumentTypeError,
    CorruptPlanError,
    InvalidArgumentError,
    PlanFileNotFoundError,
    PlanMismatchError,
)
from ckptc.options import SOLVER_NAMES, STRATEGY_NAMES, CheckpointOptions

if TYPE_CHECKING:
    from ckptc.capture.coverage import Coverage
    from ckptc.pricing.problem import JointProblem
    from ckptc.records import GraphRecord

SCHEMA_VERSION = 1
CKPTC_VERSION = "0.1.0"


@dataclass(frozen=True)
class KeptValue:
    """One forward value and what the plan does with it (for reports)."""

    name: str
    module: str
    op: str
    bytes: int
    flops: int
    decision: str  # "kept", "recomputed" or "free" (recomputed views, never allocated)


@dataclass
class GraphPlan:
    """The plan of one captured graph, in stable names."""

    fingerprint: str
    inputs: list[list[Any]]  # [shape, dtype] per input placeholder
    plan: solvers.Plan
    predicted_peak_bytes: int
    unoptimized_peak_bytes: int
    min_feasible_bytes: int
    baseline_bytes: int
    recompute_flops: float
    forward_flops: float
    backward_flops: float
    values: list[KeptValue] = field(default_factory=list, repr=False)

    def to_dict(self) -> dict[str, Any]:
        return {
            "fingerprint": self.fingerprint,
            "inputs": self.inputs,
            "plan": self.plan.to_dict(),
            "predicted_peak_bytes": self.predicted_peak_bytes,
            "unoptimized_peak_bytes": self.unoptimized_peak_bytes,
            "min_feasible_bytes": self.min_feasible_bytes,
            "baseline_bytes": self.baseline_bytes,
            "recompute_flops": self.recompute_flops,
            "forward_flops": self.forward_flops,
            "backward_flops": self.backward_flops,
            "values": [v.__dict__ for v in self.values],
        }

    @classmethod
    def from_dict(cls, data: Any, *, source: str = "plan", where: str = "graphs[0]") -> "GraphPlan":
        """Read one graph's entry of a plan file; :class:`CorruptPlanError` names a bad field."""
        r = _Reader(source)
        data = r.mapping(data, where)
        values = r.get(data, "values", where, default=[])
        return cls(
            fingerprint=r.name(r.get(data, "fingerprint", where), f"{where}.fingerprint"),
            inputs=r.inputs(r.get(data, "inputs", where), f"{where}.inputs"),
            plan=r.plan(r.get(data, "plan", where), f"{where}.plan"),
            predicted_peak_bytes=r.count(r.get(data, "predicted_peak_bytes", where), f"{where}.predicted_peak_bytes"),
            unoptimized_peak_bytes=r.count(
                r.get(data, "unoptimized_peak_bytes", where), f"{where}.unoptimized_peak_bytes"
            ),
            min_feasible_bytes=r.count(r.get(data, "min_feasible_bytes", where), f"{where}.min_feasible_bytes"),
            baseline_bytes=r.count(r.get(data, "baseline_bytes", where), f"{where}.baseline_bytes"),
            recompute_flops=r.number(r.get(data, "recompute_flops", where), f"{where}.recompute_flops"),
            forward_flops=r.number(r.get(data, "forward_flops", where), f"{where}.forward_flops"),
            backward_flops=r.number(r.get(data, "backward_flops", where), f"{where}.backward_flops"),
            values=[r.kept_value(v, f"{where}.values[{i}]") for i, v in enumerate(r.array(values, f"{where}.values"))],
        )


@dataclass
class ModelPlan:
    """What ckptc decided for one training step of a model.

    Attributes:
        graphs: one :class:`GraphPlan` per captured graph, in execution order.
        budget_bytes: the budget planned for (None: no limit).
        strategy / solver: how the plans were chosen.
        torch_version / ckptc_version: versions that made the plan.
        parameter_bytes / gradient_bytes: the model's parameters and the
            gradients of its trainable ones (None if the model was not known,
            or the file predates these fields): reports cannot derive them
            from the graphs, whose inputs mix parameters and data.
        hold_outputs: the ``hold_outputs`` option the plans were made under (None: ckptc watched what
            the loop does); applying the plan captures the step under the same (``hold_outputs=True``
            gives the graphs the results' gradients as inputs).
    """

    graphs: list[GraphPlan]
    budget_bytes: int | None
    strategy: str
    solver: str
    torch_version: str = torch.__version__
    ckptc_version: str = CKPTC_VERSION
    parameter_bytes: int | None = None
    gradient_bytes: int | None = None
    hold_outputs: bool | None = None
    # Measured at run time (ckptc.optimize(..., verify=True)); not saved in plan files.
    measured_peak_bytes: int | None = None
    # What the graphs cover of the step and why it is split (ckptc.capture.coverage); not saved in plan files.
    coverage: Coverage | None = field(default=None, repr=False, compare=False)

    # -- summaries --------------------------------------------------------
    @property
    def predicted_peak_bytes(self) -> int:
        """Peak of the step: the highest peak over graphs (each includes its baseline)."""
        return max(g.predicted_peak_bytes for g in self.graphs)

    @property
    def unoptimized_peak_bytes(self) -> int:
        return max(g.unoptimized_peak_bytes for g in self.graphs)

    @property
    def min_feasible_bytes(self) -> int:
        return max(g.min_feasible_bytes for g in self.graphs)

    @property
    def recompute_flops(self) -> float:
        return sum(g.recompute_flops for g in self.graphs)

    @property
    def step_flops(self) -> float:
        """FLOPs of one unoptimized step (forward plus backward)."""
        return sum(g.forward_flops + g.backward_flops for g in self.graphs)

    @property
    def recompute_percent(self) -> float:
        return 100.0 * self.recompute_flops / self.step_flops if self.step_flops else 0.0

    def values(self, decision: str | None = None) -> list[KeptValue]:
        """Forward values with their decision, optionally only one decision."""
        return [v for g in self.graphs for v in g.values if decision is None or v.decision == decision]

    def saved_residuals(self) -> list[tuple[str, str, int]]:
        """(stable name, module, bytes) of every value kept for backward, largest first."""
        kept = [(v.name, v.module, v.bytes) for v in self.values("kept") if v.bytes]
        return sorted(kept, key=lambda t: (-t[2], t[0]))

    def __repr__(self) -> str:
        budget = "none" if self.budget_bytes is None else solvers.format_bytes(self.budget_bytes)
        return (
            f"ModelPlan(graphs={len(self.graphs)}, budget={budget}, "
            f"predicted_peak={solvers.format_bytes(self.predicted_peak_bytes)}, "
            f"unoptimized_peak={solvers.format_bytes(self.unoptimized_peak_bytes)}, "
            + (
                ""
                if self.measured_peak_bytes is None
                else f"measured_peak={solvers.format_bytes(self.measured_peak_bytes)}, "
            )
            + f"recompute={self.recompute_percent:.1f}% of step FLOPs, "
            f"kept={len(self.values('kept'))}, recomputed={len(self.values('recomputed'))}, "
            f"strategy={self.strategy!r}, solver={self.solver!r})"
            + ("" if self.coverage is None else f"\n{self.coverage}")
        )

    # -- construction -----------------------------------------------------
    @classmethod
    def from_records(
        cls, records: Iterable["GraphRecord"], options: "CheckpointOptions", model: torch.nn.Module | None = None
    ) -> "ModelPlan":
        return cls(
            graphs=[graph_plan(r) for r in records],
            budget_bytes=options.budget_bytes,
            strategy=options.strategy,
            solver=options.solver,
            hold_outputs=options.hold_outputs,
            **_parameter_sizes(model),
        )

    # -- files --------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        return {
            "format": "ckptc-plan",
            "schema_version": SCHEMA_VERSION,
            "torch_version": self.torch_version,
            "ckptc_version": self.ckptc_version,
            "budget_bytes": self.budget_bytes,
            "strategy": self.strategy,
            "solver": self.solver,
            "predicted_peak_bytes": self.predicted_peak_bytes,
            "recompute_flops": self.recompute_flops,
            "graphs": [g.to_dict() for g in self.graphs],
            "parameter_bytes": self.parameter_bytes,
            "gradient_bytes": self.gradient_bytes,
            "hold_outputs": self.hold_outputs,
        }

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), sort_keys=True, indent=1) + "\n"

    def save(self, path: str | os.PathLike[str]) -> None:
        """Write the plan as JSON (deterministic: same plan, same bytes)."""
        with open(path, "w", encoding="utf-8") as f:
            f.write(self.to_json())

    @classmethod
    def from_dict(cls, data: Any, *, source: str = "plan") -> "ModelPlan":
        """Read plan-file data (parsed JSON).

        Every field is checked for its type and range before use, so damaged
        or edited content raises :class:`CorruptPlanError` naming the field,
        never a ``KeyError`` or ``TypeError`` from deep inside ckptc.
        """
        if not isinstance(data, dict) or data.get("format") != "ckptc-plan":
            raise CorruptPlanError(f"{source} is not a ckptc plan file (no 'format': 'ckptc-plan' field)")
        if data.get("schema_version") != SCHEMA_VERSION or isinstance(data.get("schema_version"), bool):
            raise CorruptPlanError(
                f"{source} has plan schema version {_show(data.get('schema_version'))} (field 'schema_version'); "
                f"this ckptc reads version {SCHEMA_VERSION}. Plan the model again with this version."
            )
        r = _Reader(source)
        graphs = r.array(r.get(data, "graphs"), "graphs")
        if not graphs:
            raise CorruptPlanError(
                f"{source} holds no graphs (field 'graphs' is empty): there are no decisions to "
                "apply or show. Plan the model again."
            )

        model_plan = cls(
            graphs=[GraphPlan.from_dict(g, source=source, where=f"graphs[{i}]") for i, g in enumerate(graphs)],
            budget_bytes=r.budget(r.get(data, "budget_bytes"), "budget_bytes"),
            strategy=r.choice(r.get(data, "strategy"), "strategy", STRATEGY_NAMES),
            solver=r.choice(r.get(data, "solver"), "solver", SOLVER_NAMES),
            torch_version=r.version(r.get(data, "torch_version"), "torch_version"),
            ckptc_version=r.version(r.get(data, "ckptc_version"), "ckptc_version"),
            parameter_bytes=r.optional_count(data.get("parameter_bytes"), "parameter_bytes"),
            gradient_bytes=r.optional_count(data.get("gradient_bytes"), "gradient_bytes"),
            hold_outputs=r.optional_flag(data.get("hold_outputs"), "hold_outputs"),
        )
        # Derived from the graphs; a different figure means the file was edited.
        for name, read, verb in (
            ("predicted_peak_bytes", r.count, "peak at"),
            ("recompute_flops", r.number, "recompute"),
        ):
            if name in data:
                stored, derived = read(data[name], name), getattr(model_plan, name)
                if stored != derived:
                    r.fail(name, f"is {stored} but its graphs {verb} {derived} ({_per_graph(model_plan, name)})")
        return model_plan


# -- reading plan files ----------------------------------------------------------
# Sizes that no real plan reaches: a larger file or a deeper "inputs" entry is
# damage, refused before it can exhaust memory or the recursion limit.
MAX_PLAN_FILE_BYTES = 1 << 30
MAX_INPUT_NESTING = 16
MAX_BYTES = 2**63 - 1  # allocators count bytes in 64-bit integers
DECISIONS = ("kept", "recomputed", "free")


def known_methods() -> list[str]:
    """Every ``Plan.method`` ckptc writes: the solvers', the presets' and their building blocks'."""
    return sorted({*solvers.METHODS, *STRATEGY_NAMES, "keep_all", "per_block", "manual"})


# Solve-info fields that have a value in every plan (the others may be null: not known).
NOT_NULL_INFO = ("refined", "applied_from_file", "details")
# What a plan file stores of a SolveInfo: every field but the timings, each checked by the reader
# method named by its type (``chosen`` names a method).  Derived, so a new field cannot go unchecked.
_CHECK_OF_TYPE = {"int | None": "count", "float | None": "number", "str | None": "name", "bool": "boolean"}
_NOT_IN_FILES = ("solve_seconds", "tried")
SOLVE_INFO_CHECKS: dict[str, str] = {
    f.name: "method" if f.name == "chosen" else "details" if f.type.startswith("Mapping") else _CHECK_OF_TYPE[f.type]
    for f in dataclasses.fields(solvers.SolveInfo)
    if f.name not in _NOT_IN_FILES
}
# Details solvers report whose type is known (the rest: any JSON scalar).
DETAIL_CHECKS = {
    "blocks": "count",
    "block_classes": "count",
    "variables": "count",
    "constraints": "count",
    "solver": "name",
    "solver_status": "name",
    "warm_start": "boolean",
}


def _per_graph(model_plan: ModelPlan, name: str) -> str:
    """Each graph's field, named: the figure a derived total disagrees with may be the edited one."""
    return ", ".join(f"'graphs[{i}].{name}' {getattr(g, name)}" for i, g in enumerate(model_plan.graphs[:4]))


def _show(value: Any, limit: int = 60) -> str:
    """``repr(value)``, shortened: a damaged field may hold a huge string or list."""
    if isinstance(value, (dict, list)):
        return f"a JSON {'object' if isinstance(value, dict) else 'array'}"
    if isinstance(value, int) and not isinstance(value, bool) and abs(value) > 10**30:
        return f"a {len(str(abs(value)))}-digit number"
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


class _Reader:
    """Checked access to the fields of a plan file; errors name the field."""

    def __init__(self, source: str) -> None:
        self.source = source

    def fail(self, field: str, problem: str) -> NoReturn:
        raise CorruptPlanError(
            f"{self.source} is damaged: field '{field}' {problem}. "
            "Plan files are written by ckptc and not meant to be edited; plan the model again."
        )

    def get(self, data: dict[str, Any], key: str, where: str = "", default: Any = ...) -> Any:
        if key in data:
            return data[key]
        if default is not ...:
            return default
        self.fail(f"{where}.{key}" if where else key, "is missing")

    def mapping(self, value: Any, field: str) -> dict[str, Any]:
        if not isinstance(value, dict):
            self.fail(field, f"must be a JSON object, got {_show(value)}")
        return value

    def array(self, value: Any, field: str) -> list[Any]:
        if not isinstance(value, list):
            self.fail(field, f"must be a JSON array, got {_show(value)}")
        return value

    def string(self, value: Any, field: str) -> str:
        if not isinstance(value, str):
            self.fail(field, f"must be a string, got {_show(value)}")
        return value

    def name(self, value: Any, field: str) -> str:
        """A non-empty string without surrounding whitespace (a version, a node or method name)."""
        text = self.string(value, field)
        if not text or text != text.strip():
            self.fail(field, f"must be a non-empty name, got {_show(value)}")
        return text

    def choice(self, value: Any, field: str, choices: tuple[str, ...]) -> str:
        if not isinstance(value, str) or value not in choices:
            self.fail(field, f"must be one of {list(choices)}, got {_show(value)}")
        return value

    def method(self, value: Any, field: str) -> str:
        """A method that makes plans: a solver's (``hierarchical``), a preset's (``layer``) or a
        building block's (``keep_all``, ``per_block``)."""
        methods = known_methods()
        if not isinstance(value, str) or value not in methods:
            self.fail(field, f"must be one of {methods}, got {_show(value)}")
        return value

    def version(self, value: Any, field: str) -> str:
        """A version such as ``0.1.0`` or ``2.13.0+cpu``."""
        text = self.string(value, field)
        if not re.fullmatch(r"\d+(\.\d+)*([.+-]?[0-9A-Za-z]+)*", text):
            self.fail(field, f"must be a version such as '0.1.0', got {_show(value)}")
        return text

    def count(self, value: Any, field: str) -> int:
        """A whole number of bytes (or FLOPs), from 0 to 2**63 - 1."""
        if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= MAX_BYTES:
            self.fail(field, f"must be a whole number from 0 to 2**63-1, got {_show(value)}")
        return value

    def optional_count(self, value: Any, field: str) -> int | None:
        return None if value is None else self.count(value, field)

    def optional_flag(self, value: Any, field: str) -> bool | None:
        if value is not None and not isinstance(value, bool):
            self.fail(field, f"must be null, true or false, got {_show(value)}")
        return value

    def budget(self, value: Any, field: str) -> int | None:
        """None (no limit) or a positive whole number of bytes."""
        if value is None:
            return None
        if isinstance(value, bool) or not isinstance(value, int) or not 0 < value <= MAX_BYTES:
            self.fail(field, f"must be null or a positive whole number of bytes below 2**63, got {_show(value)}")
        return value

    def number(self, value: Any, field: str) -> float:
        """A finite, non-negative number (FLOPs, recompute cost)."""
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value <= 1e300:
            self.fail(field, f"must be a finite number >= 0, got {_show(value)}")
        return float(value)

    def inputs(self, value: Any, field: str) -> list[list[Any]]:
        entries = self.array(value, field)
        for i, entry in enumerate(entries):
            self.array(entry, f"{field}[{i}]")
            self._shallow_json(entry, f"{field}[{i}]", MAX_INPUT_NESTING)
        return entries

    def _shallow_json(self, value: Any, field: str, depth: int) -> None:
        # Iterative, so a deeply nested entry fails here, not with a RecursionError.
        stack = [(value, depth)]
        while stack:
            item, left = stack.pop()
            if isinstance(item, list):
                if left == 0:
                    self.fail(field, f"is nested more than {MAX_INPUT_NESTING} levels deep")
                stack.extend((x, left - 1) for x in item)
            elif (
                isinstance(item, bool)
                or not isinstance(item, (str, int))
                or (isinstance(item, int) and abs(item) > MAX_BYTES)
            ):
                self.fail(field, f"must hold shapes (whole numbers) and dtype names, got {_show(item)}")

    def plan(self, value: Any, field: str) -> solvers.Plan:
        data = self.mapping(value, field)
        kept = self.array(self.get(data, "kept", field), f"{field}.kept")
        for i, name in enumerate(kept):
            self.name(name, f"{field}.kept[{i}]")
        schedule = self.get(data, "schedule", field, default=None)
        steps = None
        if schedule is not None:
            steps = []
            for i, step in enumerate(self.array(schedule, f"{field}.schedule")):
                where = f"{field}.schedule[{i}]"
                if not isinstance(step, list) or len(step) != 2:
                    self.fail(where, f"must be a [node, phase] pair, got {_show(step)}")
                node, phase = step
                self.name(node, f"{where}[0]")
                if phase not in solvers.plan.PHASES:
                    self.fail(f"{where}[1]", f"must be one of {list(solvers.plan.PHASES)}, got {_show(phase)}")
                steps.append(solvers.Step(node, phase))
        info = self.solve_info(self.get(data, "info", field, default={}), f"{field}.info")
        return solvers.Plan(
            kept=frozenset(kept),
            schedule=None if steps is None else tuple(steps),
            method=self.method(self.get(data, "method", field), f"{field}.method"),
            budget_bytes=self.budget(self.get(data, "budget_bytes", field, default=None), f"{field}.budget_bytes"),
            info=info,
        )

    def solve_info(self, value: Any, field: str) -> solvers.SolveInfo:
        """A :class:`solvers.SolveInfo` as plan files store it (no timings): every field checked."""
        data = self.mapping(value, field)
        checks = {name: getattr(self, check) for name, check in SOLVE_INFO_CHECKS.items()}
        for key, item in data.items():
            check = checks.get(key)
            if check is None:
                self.fail(f"{field}.{key}", "is not a field of a plan's solve info")
            if item is not None or key in NOT_NULL_INFO:
                check(item, f"{field}.{key}")
        return solvers.SolveInfo(**data)

    def boolean(self, value: Any, field: str) -> bool:
        if not isinstance(value, bool):
            self.fail(field, f"must be true or false, got {_show(value)}")
        return value

    def details(self, value: Any, field: str) -> dict[str, Any]:
        """A solver's details: the known ones by their type (``blocks`` a count), any other
        a number, string, boolean or null."""
        data = self.mapping(value, field)
        for key, item in data.items():
            check = DETAIL_CHECKS.get(key)
            if check is not None:
                getattr(self, check)(item, f"{field}.{key}")
            elif isinstance(item, (dict, list)):
                self.fail(f"{field}.{key}", f"must be a number, string, boolean or null, got {_show(item)}")
        return data

    def kept_value(self, value: Any, field: str) -> KeptValue:
        data = self.mapping(value, field)
        unknown = sorted(set(data) - {f.name for f in dataclasses.fields(KeptValue)})
        if unknown:
            self.fail(f"{field}.{unknown[0]}", "is not a field of a value")
        decision = self.string(self.get(data, "decision", field), f"{field}.decision")
        if decision not in DECISIONS:
            self.fail(f"{field}.decision", f"must be one of {list(DECISIONS)}, got {_show(decision)}")
        name = self.name(self.get(data, "name", field), f"{field}.name")
        op = self.name(self.get(data, "op", field), f"{field}.op")
        if name.rsplit(".", 1)[-1] != op:
            self.fail(f"{field}.name", f"is {_show(name)}, which is not an {_show(op)} as field '{field}.op' says")
        return KeptValue(
            name=name,
            module=self.string(self.get(data, "module", field), f"{field}.module"),
            op=op,
            bytes=self.count(self.get(data, "bytes", field), f"{field}.bytes"),
            flops=self.count(self.get(data, "flops", field), f"{field}.flops"),
            decision=decision,
        )


def _parameter_sizes(model: torch.nn.Module | None) -> dict[str, int | None]:
    """Bytes of the model's distinct parameters and of its trainable ones' gradients."""
    if model is None:
        return {"parameter_bytes": None, "gradient_bytes": None}
    params = list(model.parameters())  # distinct: tied weights appear once
    return {
        "parameter_bytes": sum(p.numel() * p.element_size() for p in params),
        "gradient_bytes": sum(p.numel() * p.element_size() for p in params if p.requires_grad),
    }


def load_plan(path: str | os.PathLike[str]) -> ModelPlan:
    """Read a plan file.  Raises :class:`CorruptPlanError` with the reason if it is unusable.

    Only a regular file is read (a device, a pipe or a link to one is refused: ``/dev/zero`` never
    ends), and never more than :data:`MAX_PLAN_FILE_BYTES`, whatever its size said.
    """
    if not isinstance(path, (str, os.PathLike)):
        raise ArgumentTypeError(
            f"a plan is a path (str or os.PathLike) or a ckptc.ModelPlan, not {type(path).__name__} {_show(path)}"
        )
    try:
        status = os.stat(path)  # follows links: what would be read
    except FileNotFoundError:
        raise PlanFileNotFoundError(
            errno.ENOENT,
            f"no plan file at {os.fspath(path)!r}. What to do: check the path, or write the plan first "
            "(fast.plan.save(path), or `python -m ckptc plan ... -o path`)",
            os.fspath(path),
        ) from None
    except OSError:
        status = None  # let open() report the error with its own message
    if status is not None and not stat.S_ISREG(status.st_mode):
        raise CorruptPlanError(f"{path} is not a regular file (a device, pipe or directory); plan files are JSON files")
    if status is not None and status.st_size > MAX_PLAN_FILE_BYTES:
        raise CorruptPlanError(
            f"{path} is {status.st_size} bytes, more than any plan file ({MAX_PLAN_FILE_BYTES} bytes at most); "
            "it is not a plan written by ckptc. Plan the model again."
        )
    with open(path, "rb") as f:
        raw = f.read(MAX_PLAN_FILE_BYTES + 1)  # the file may have grown since stat()
    if len(raw) > MAX_PLAN_FILE_BYTES:
        raise CorruptPlanError(
            f"{path} holds more than any plan file ({MAX_PLAN_FILE_BYTES} bytes at most); "
            "it is not a plan written by ckptc. Plan the model again."
        )
    try:
        text = raw.decode("utf-8-sig")  # an editor's byte-order mark is not a change to the plan
    except UnicodeDecodeError:
        raise CorruptPlanError(f"{path} is not a text file; plan files are JSON") from None
    del raw
    try:
        data = json.loads(text, object_pairs_hook=_unique_keys)
    except _DuplicateKey as duplicate:
        raise CorruptPlanError(
            f"{path} is damaged: field '{duplicate.args[0]}' appears twice in one JSON object (which one "
            "counts is ambiguous). Plan files are written by ckptc and not meant to be edited; plan the model again."
        ) from None
    except json.JSONDecodeError as error:
        raise CorruptPlanError(
            f"{path} is not valid JSON ({error.msg} at line {error.lineno}); "
            "the file is truncated or corrupt. Plan the model again."
        ) from None
    except RecursionError:
        raise CorruptPlanError(
            f"{path} is JSON nested too deeply to be a plan file; it is corrupt. Plan the model again."
        ) from None
    except ValueError as error:  # e.g. an integer with more digits than Python converts
        raise CorruptPlanError(f"{path} is not a usable JSON document ({error}). Plan the model again.") from None
    return ModelPlan.from_dict(data, source=str(path))


class _DuplicateKey(Exception):
    """A JSON object names one key twice (``json`` keeps the last silently)."""


def _unique_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    result = dict(pairs)
    if len(result) != len(pairs):
        seen: set[str] = set()
        for key, _ in pairs:
            if key in seen:
                raise _DuplicateKey(key)
            seen.add(key)
    return result


# -- graph <-> plan ------------------------------------------------------
def fingerprint(jp: "JointProblem") -> str:
    """A hash of the joint graph's structure: ops, shapes, dtypes and edges in order.

    It holds nothing that differs between processes (no memory addresses, no
    timings), so a plan saved by one process is accepted by another.  Computed
    once per captured graph (every budget's plan of it carries the same one).
    """
    cached = jp.__dict__.get("_fingerprint")
    if cached is not None:
        return cached
    h = hashlib.sha256()
    for name, node in jp.nodes.items():
        val = node.meta.get("val")
        h.update(
            repr(
                (
                    jp.stable_names[name],
                    target_name(node.target) if node.op == "call_function" else node.op,
                    _describe(val),
                    tuple(jp.stable_names[n.name] for n in node.all_input_nodes),
                )
            ).encode()
        )
    jp.__dict__["_fingerprint"] = h.hexdigest()
    return jp.__dict__["_fingerprint"]


def torch_release(version: str) -> str:
    """``2.13.0`` of ``2.13.0+cpu`` / ``2.13.0+cu128``: the local build suffix names the wheel's
    accelerator, not the release, and captured graphs follow the release."""
    return str(version).split("+", 1)[0]


# Aten ops that are one decision made by different kernels on different devices: a
# plan made on one device type names the other's op (and the tensors it saves).
_DEVICE_VARIANTS = {
    "_scaled_dot_product_flash_attention_for_cpu": "CPU",
    "_scaled_dot_product_flash_attention": "CUDA",
    "_scaled_dot_product_efficient_attention": "CUDA",
    "_scaled_dot_product_cudnn_attention": "CUDA",
    "_flash_attention_forward": "CUDA",
    "_efficient_attention_forward": "CUDA",
}


def _op_differences(expected: GraphPlan, jp: "JointProblem") -> str:
    """Why a fingerprint differs, in words: the forward ops that one side has and the other has not."""
    planned = {re.sub(r"_\d+$", "", v.op) for v in expected.values}  # ordinals: mm_1 is mm
    captured = {jp.node_cost(n).op for n in jp.graph_nodes(jp.problem.forward_nodes)}
    only_plan, only_model = sorted(planned - captured), sorted(captured - planned)
    variants = [(a, b) for a in only_plan for b in only_model if a in _DEVICE_VARIANTS and b in _DEVICE_VARIANTS]
    if variants:
        a, b = variants[0]
        return (
            f"the plan has aten op {a!r}, a {_DEVICE_VARIANTS[a]} kernel, where this graph has {b!r}, a "
            f"{_DEVICE_VARIANTS[b]} kernel: the plan was made for another device type, whose kernels save other "
            "tensors for backward; plan for this device (ckptc.plan(..., device=...) plans offline)"
        )
    words = []
    names = set(jp.stable_names.values())
    missing = [v.name for v in expected.values if v.name not in names]
    if missing:
        # Only the plan's kept and recomputed values are in the file: what the graph has beyond them is unknown.
        words.append(f"values of the plan this graph does not have: {', '.join(missing[:5])}")
    words.append(
        "the plan was made with other parameters trainable (requires_grad: a frozen parameter gets no "
        "gradient, so backward changes), for the other compiler (compiler='eager' or 'inductor': their graphs "
        "are traced with different decompositions; plan with the compiler you train with), or the model's code "
        "or configuration changed"
    )
    # The file names only kept and recomputed values' ops: a kernel it does not name may still be in the plan.
    kernels = sorted(op for op in captured if op in _DEVICE_VARIANTS and op not in planned)
    if kernels:
        words.append(
            f"or it was made on another device type: this graph runs aten op {kernels[0]!r}, a "
            f"{_DEVICE_VARIANTS[kernels[0]]} kernel, where another device's kernel saves other tensors for "
            "backward (plan for this device; ckptc.plan(..., device=...) plans offline)"
        )
    return "; ".join(words)


def _has_symbolic_size(inputs: list[list[Any]]) -> bool:
    """Whether described inputs hold a symbolic size: a tensor's (``[[2, 's70'], 'int64']``) or a size
    input of its own (``['SymInt']``)."""
    return any(
        entry == ["SymInt"] or (isinstance(entry[0], list) and any(isinstance(size, str) for size in entry[0]))
        for entry in inputs
        if entry
    )


_ALIASED_INPUTS = (
    "the extra input is shaped like another one, as when one side passed one tensor as two arguments: "
    "`input_ids=ids, labels=ids` is a single graph input, two tensors (`labels=ids.clone()`, a data loader's "
    "batch) are two; pass the arguments as the plan was made with them, or plan with the inputs you train with"
)


def _an_extra_input_repeats_another(planned: list[list[Any]], captured: list[list[Any]]) -> bool:
    """Whether the side with more inputs has one or two extras, each shaped like an input both sides have
    and holding integers (token ids, labels): the same tensor passed twice on one side (Dynamo makes one
    graph input of it) and two tensors on the other.  (A layer added or removed changes floating-point
    inputs, its parameters.)"""
    extra, fewer = _extra_inputs(planned, captured)
    return 0 < len(extra) <= 2 and all(described in fewer and not _floating(described) for described in extra)


def _extra_inputs(planned: list[list[Any]], captured: list[list[Any]]) -> tuple[list[list[Any]], list[list[Any]]]:
    """The inputs the side with more has beyond the other's (as a multiset of descriptions), and the other side."""
    more, fewer = (planned, captured) if len(planned) > len(captured) else (captured, planned)
    extra = list(more)
    for described in fewer:
        if described in extra:
            extra.remove(described)
    return extra, fewer


def _floating(described: list[Any]) -> bool:
    return str(described[-1]).startswith(("float", "bfloat", "complex"))


def _floating_inputs_differ(planned: list[list[Any]], captured: list[list[Any]]) -> str | None:
    """What to say when the sides differ by floating-point inputs only (parameters and buffers: a model
    with more or fewer layers than the one planned, or another width), else None."""
    extra, fewer = _extra_inputs(planned, captured)
    if not extra or not all(map(_floating, extra)):
        return None
    side = "the plan" if fewer is captured else "the model"
    return (
        f"{side} has {len(extra)} floating-point input(s) more, as parameters or buffers: the model has other "
        "layers or sizes than the one planned (a plan is for one model)"
    )


def _input_differences(planned: list[list[Any]], captured: list[list[Any]]) -> list[str]:
    """The inputs one side has and the other has not (aligned on the rest), by position and shape."""
    import difflib

    matcher = difflib.SequenceMatcher(a=[repr(i) for i in planned], b=[repr(i) for i in captured], autojunk=False)
    found = []
    for tag, a0, a1, b0, b1 in matcher.get_opcodes():
        if tag in ("delete", "replace"):
            found += [f"input {i} only in the plan: {planned[i]}" for i in range(a0, a1)]
        if tag in ("insert", "replace"):
            found += [f"input {i} only in the model: {captured[i]}" for i in range(b0, b1)]
    return found


def target_name(target: Any) -> str:
    """A process-independent name for an FX node's target.

    ``str()`` of an aten op is its name (``aten.mm.default``), but ``str()`` of a
    plain Python function (ckptc's ``capture_rng_state``, inserted before every
    dropout) includes its memory address, which differs in every process.
    """
    if is_op_overload(target):
        return str(target)
    module = getattr(target, "__module__", None) or ""
    qualname = getattr(target, "__qualname__", None) or getattr(target, "__name__", None)
    if qualname is None:
        return type(target).__qualname__
    return f"{module}.{qualname}" if module else qualname


def _describe(val: Any) -> Any:
    if isinstance(val, torch.Tensor):
        # A symbolic size (data-dependent, or a dynamic dimension) is named by its expression ("u0").
        return (tuple(s if isinstance(s, int) else str(s) for s in val.shape), str(val.dtype).replace("torch.", ""))
    if isinstance(val, (tuple, list)):
        return tuple(_describe(v) for v in val)
    return type(val).__name__


def _inputs(jp: "JointProblem") -> list[list[Any]]:
    """The graph's inputs (shape, dtype), described once per captured graph like :func:`fingerprint`."""
    cached = jp.__dict__.get("_inputs")
    if cached is None:
        cached = jp.__dict__["_inputs"] = []
        for node in jp.nodes.values():
            if node.op == "placeholder":
                desc = _describe(node.meta.get("val"))
                pair = isinstance(desc, tuple) and len(desc) == 2 and isinstance(desc[0], tuple)
                cached.append([list(desc[0]), desc[1]] if pair else [desc])
    return [[list(part) if isinstance(part, list) else part for part in entry] for entry in cached]  # its own copy


class _ReportTable(NamedTuple):
    """What every plan's report of one graph reads, built once per captured graph (a report over a
    64-layer graph's 7,500 forward values walked them all per plan): each forward value as ``(node,
    storage owner, its entry kept, its entry recomputed)``, each forward node's storage owner (its keys
    are the graph's forward nodes), each node's FLOPs, and the forward's and backward's FLOPs."""

    entries: list[tuple[str, str, KeptValue, KeptValue]]
    roots: dict[str, str]
    flops: dict[str, int]
    forward_flops: int
    backward_flops: int


def _report_table(jp: "JointProblem") -> _ReportTable:
    cached = jp.__dict__.get("_report_table")
    if cached is None:
        problem, stable = jp.problem, jp.stable_names
        roots = {name: problem.alias_root(name) for name in problem.forward_nodes}
        entries = []
        for name in jp.graph_nodes(problem.forward_nodes):
            cost = jp.node_cost(name)
            op = stable[name].rsplit(".", 1)[-1]
            value = KeptValue(stable[name], cost.module, op, cost.bytes, cost.flops, "kept")
            entries.append((name, roots[name], value, dataclasses.replace(value, decision="recomputed")))
        flops = {name: jp.node_cost(name).flops for name in jp.nodes}
        cached = jp.__dict__["_report_table"] = _ReportTable(
            entries,
            roots,
            flops,
            *(
                sum(flops[n] for n in jp.graph_nodes(names))
                for names in (problem.forward_nodes, problem.backward_nodes)
            ),
        )
    return cached


def graph_plan(record: "GraphRecord") -> GraphPlan:
    """The stable-name form of one graph's plan, with per-value decisions."""
    jp = record.joint_problem
    problem = jp.problem
    plan = record.plan
    table = _report_table(jp)
    roots = table.roots  # (its keys: the graph's forward nodes)
    recomputed_steps = [s.node for s in record.result.steps if s.phase == "backward" and s.node in roots]
    recomputed = set(recomputed_steps)
    # A value whose storage stays alive through a kept view (a detach of it) is kept too.
    kept = plan.kept
    kept_storages = {roots[k] if k in roots else problem.alias_root(k) for k in kept}
    values = []
    for name, root, as_kept, as_recomputed in table.entries:
        if name in kept or (as_kept.bytes and root in kept_storages):
            values.append(as_kept)
        elif name in recomputed:
            values.append(as_recomputed)
    stable_plan = dataclasses.replace(
        jp.plan_in_stable_names(plan),
        # Timings differ run to run; without them files are byte-identical for the same plan.
        info=plan.info.replace(
            solve_seconds=None,
            tried={},
            details={k: v for k, v in plan.info.details.items() if not k.endswith("seconds")},
        ),
    )
    recompute_flops = sum(table.flops[n] for n in jp.graph_nodes(recomputed_steps))
    return GraphPlan(
        fingerprint=fingerprint(jp),
        inputs=_inputs(jp),
        plan=stable_plan,
        predicted_peak_bytes=record.result.peak_bytes,
        unoptimized_peak_bytes=record.step_unoptimized_peak_bytes,
        min_feasible_bytes=record.min_feasible_bytes,
        baseline_bytes=record.baseline_bytes,
        recompute_flops=float(recompute_flops),
        forward_flops=float(table.forward_flops),
        backward_flops=float(table.backward_flops),
        values=values,
    )


def applied_plan(
    plan: "str | os.PathLike[str] | ModelPlan", budget_bytes: int | None, hold_outputs: bool | None = None
) -> tuple[Callable[[int, "JointProblem"], solvers.Plan], int | None, bool | None]:
    """A plan file (or :class:`ModelPlan`) to apply instead of solving: its ``plan_source``, the
    budget it runs under (the one given, else the file's) and the ``hold_outputs`` the step is captured
    under (the file's, which one given must equal).

    Raises:
        CorruptPlanError: the file is unusable.
        InvalidArgumentError: ``hold_outputs`` is given and differs from the plan's.
        solvers.InfeasibleBudgetError: the plan predicts a peak over the budget given with it (naming the peak).
    """
    # load_plan refuses anything but a path: an int would be read as a file descriptor.
    model_plan = plan if isinstance(plan, ModelPlan) else load_plan(plan)
    if hold_outputs is not None and model_plan.hold_outputs is not None and hold_outputs != model_plan.hold_outputs:
        raise InvalidArgumentError(
            f"the plan was made with hold_outputs={model_plan.hold_outputs} and is applied with "
            f"hold_outputs={hold_outputs}: the step's graphs differ (held results' gradients are inputs of the "
            "backward). Drop hold_outputs= to apply the plan as made, or plan again with the setting you want."
        )
    if budget_bytes is not None and model_plan.predicted_peak_bytes > budget_bytes:
        # A plan does not adapt to a budget: it would silently break the promise.
        raise solvers.InfeasibleBudgetError(
            budget_bytes,
            model_plan.predicted_peak_bytes,
            f"the plan predicts a peak of {solvers.format_bytes(model_plan.predicted_peak_bytes)} "
            f"({model_plan.predicted_peak_bytes} bytes), over the budget given with it, "
            f"{solvers.format_bytes(budget_bytes)} ({budget_bytes} bytes). Plan again for this budget, or "
            "apply the plan without a budget.",
        )
    # An explicit budget is also checked against each graph as applied (the
    # peak is simulated again on the captured graph).
    budget = model_plan.budget_bytes if budget_bytes is None else budget_bytes
    hold = model_plan.hold_outputs if hold_outputs is None else hold_outputs
    return plan_source_for(model_plan, budget_bytes), budget, hold


def plan_source_for(
    model_plan: ModelPlan, budget_bytes: int | None = None
) -> Callable[[int, "JointProblem"], solvers.Plan]:
    """A ``plan_source`` that applies ``model_plan`` to freshly captured graphs.

    Refuses, with what differs, a graph whose torch version, fingerprint or
    input shapes do not match the plan (:class:`PlanMismatchError`), and a plan
    whose decisions name nodes the graph does not have or break the execution
    rules (:class:`CorruptPlanError`: the file was edited).  With
    ``budget_bytes`` (a budget given next to the plan), a graph whose plan
    peaks above it is refused too.
    """

    def source(index: int, jp: "JointProblem") -> solvers.Plan:
        if torch_release(model_plan.torch_version) != torch_release(torch.__version__):
            raise PlanMismatchError(
                f"the plan was made with torch {model_plan.torch_version}, this is torch "
                f"{torch.__version__}; captured graphs differ between releases. Plan again."
            )
        if index >= len(model_plan.graphs):
            raise PlanMismatchError(
                f"the model produced graph #{index + 1} but the plan has {len(model_plan.graphs)} "
                "graph(s): it was made for another model or other inputs. Plan again."
            )
        expected = model_plan.graphs[index]
        # Through JSON, as the file stores them (tuples become lists).
        inputs = json.loads(json.dumps(_inputs(jp)))
        if inputs != expected.inputs:
            diffs = [
                f"input {i}: plan {a}, model {b}"
                for i, (a, b) in enumerate(zip(expected.inputs, inputs, strict=False))
                if a != b
            ]
            if len(inputs) != len(expected.inputs):
                diffs = [f"plan has {len(expected.inputs)} inputs, model has {len(inputs)}"]
                diffs += _input_differences(expected.inputs, inputs)
                if _an_extra_input_repeats_another(expected.inputs, inputs):
                    diffs.insert(1, _ALIASED_INPUTS)
                elif (weights := _floating_inputs_differ(expected.inputs, inputs)) is not None:
                    diffs.insert(1, weights)
            if _has_symbolic_size(inputs) and not _has_symbolic_size(expected.inputs):
                # torch.compile made a size dynamic once it saw a second one: the inputs no longer line up
                diffs = [
                    "this call's graph has symbolic sizes (torch.compile makes a size dynamic once a second "
                    "one is seen), the plan static ones: the plan is for other input shapes than this call's"
                ]
            raise PlanMismatchError(
                f"graph #{index + 1}: input shapes or dtypes differ from the plan's ({'; '.join(diffs[:3])}). "
                "Plan again for these inputs."
            )
        if fingerprint(jp) != expected.fingerprint:
            raise PlanMismatchError(
                f"graph #{index + 1}: the captured graph's fingerprint differs from the plan's "
                f"({_op_differences(expected, jp)}). Plan again."
            )
        where = f"graphs[{index}].plan"
        try:
            plan = jp.plan_in_node_names(expected.plan, where)
        except KeyError as missing:
            name, field = missing.args
            raise CorruptPlanError(
                f"the plan is damaged: field '{field}' names node {_show(name)}, which graph "
                f"#{index + 1} does not have although its fingerprint matches (the file was "
                "edited). Plan the model again."
            ) from None
        plan = dataclasses.replace(plan, info=plan.info.replace(applied_from_file=True))
        try:
            result = solvers.simulate(jp.problem, plan)  # validates the plan against this graph
        except solvers.InvalidPlanError as error:
            field = f"{where}.schedule" if plan.schedule is not None else f"{where}.kept"
            raise CorruptPlanError(
                f"the plan is damaged: field '{field}' does not give a valid execution of graph "
                f"#{index + 1} ({error}). Plan the model again."
            ) from None
        _check_against_graph(expected, jp, plan, result, index)
        if budget_bytes is not None and result.peak_bytes > budget_bytes:
            raise solvers.InfeasibleBudgetError(
                budget_bytes,
                result.peak_bytes,
                f"graph #{index + 1}: the plan peaks at {solvers.format_bytes(result.peak_bytes)} "
                f"({result.peak_bytes} bytes), over the budget given with it, "
                f"{solvers.format_bytes(budget_bytes)} ({budget_bytes} bytes). Plan again for this "
                "budget, or apply the plan without a budget.",
            )
        return plan

    return source


def _check_against_graph(
    expected: GraphPlan, jp: "JointProblem", plan: solvers.Plan, result: solvers.SimResult, index: int
) -> None:
    """Every figure of a graph's entry that the captured graph determines must be the graph's:
    its FLOPs, and each listed value's name, module, op, bytes, FLOPs and decision.

    Raises:
        CorruptPlanError: naming the first field that differs (the file was edited).
    """
    # The entry this graph and plan would have been saved as (graph_plan reads nothing else of a record).
    applied = graph_plan(
        types.SimpleNamespace(  # type: ignore[arg-type]
            joint_problem=jp,
            plan=plan,
            result=result,
            step_unoptimized_peak_bytes=0,
            min_feasible_bytes=0,
            baseline_bytes=0,
        )
    )
    where = f"graphs[{index}]"

    def fail(field: str, found: Any, wanted: Any) -> NoReturn:
        raise CorruptPlanError(
            f"the plan is damaged: field '{where}.{field}' is {_show(found)} but graph #{index + 1} gives "
            f"{_show(wanted)} although its fingerprint matches (the file was edited). Plan the model again."
        )

    for name in ("forward_flops", "backward_flops", "recompute_flops"):
        if getattr(expected, name) != getattr(applied, name):
            fail(name, getattr(expected, name), getattr(applied, name))
    by_name = {v.name: v for v in applied.values}
    listed: set[str] = set()
    for i, value in enumerate(expected.values):
        actual = by_name.get(value.name)
        if actual is None or value.name in listed:
            why = "listed twice" if value.name in listed else "not a value this plan keeps or recomputes"
            fail(f"values[{i}].name", value.name, why)
        listed.add(value.name)
        for name in ("module", "op", "bytes", "flops", "decision"):
            if getattr(value, name) != getattr(actual, name):
                fail(f"values[{i}].{name}", getattr(value, name), getattr(actual, name))
    if len(listed) != len(by_name):
        missing = sorted(set(by_name) - listed)
        fail("values", f"{len(expected.values)} values", f"{len(by_name)} (missing {missing[:3]})")
