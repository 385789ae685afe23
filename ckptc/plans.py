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

import hashlib
import json
import os
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Iterable

import torch

import solvers
from ckptc.errors import CorruptPlanError, PlanMismatchError

if TYPE_CHECKING:
    from ckptc.compiler import CheckpointCompiler, GraphRecord
    from ckptc.problem import JointProblem

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
    def from_dict(cls, data: dict[str, Any]) -> "GraphPlan":
        return cls(
            fingerprint=str(data["fingerprint"]),
            inputs=list(data["inputs"]),
            plan=solvers.Plan.from_dict(data["plan"]),
            predicted_peak_bytes=int(data["predicted_peak_bytes"]),
            unoptimized_peak_bytes=int(data["unoptimized_peak_bytes"]),
            min_feasible_bytes=int(data["min_feasible_bytes"]),
            baseline_bytes=int(data["baseline_bytes"]),
            recompute_flops=float(data["recompute_flops"]),
            forward_flops=float(data["forward_flops"]),
            backward_flops=float(data["backward_flops"]),
            values=[KeptValue(**v) for v in data.get("values", [])],
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
    """

    graphs: list[GraphPlan]
    budget_bytes: int | None
    strategy: str
    solver: str
    torch_version: str = torch.__version__
    ckptc_version: str = CKPTC_VERSION
    parameter_bytes: int | None = None
    gradient_bytes: int | None = None
    # Measured at run time (ckptc.optimize(..., verify=True)); not saved in plan files.
    measured_peak_bytes: int | None = None

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
            + (""
               if self.measured_peak_bytes is None
               else f"measured_peak={solvers.format_bytes(self.measured_peak_bytes)}, ")
            + f"recompute={self.recompute_percent:.1f}% of step FLOPs, "
            f"kept={len(self.values('kept'))}, recomputed={len(self.values('recomputed'))}, "
            f"strategy={self.strategy!r}, solver={self.solver!r})"
        )

    # -- construction -----------------------------------------------------
    @classmethod
    def from_records(cls, records: Iterable["GraphRecord"], compiler: "CheckpointCompiler") -> "ModelPlan":
        return cls(
            graphs=[graph_plan(r) for r in records],
            budget_bytes=compiler.budget_bytes,
            strategy=compiler.strategy,
            solver=compiler.solver,
            **_parameter_sizes(compiler.model),
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
        }

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), sort_keys=True, indent=1) + "\n"

    def save(self, path: str | os.PathLike[str]) -> None:
        """Write the plan as JSON (deterministic: same plan, same bytes)."""
        with open(path, "w", encoding="utf-8") as f:
            f.write(self.to_json())

    @classmethod
    def from_dict(cls, data: Any, *, source: str = "plan") -> "ModelPlan":
        if not isinstance(data, dict) or data.get("format") != "ckptc-plan":
            raise CorruptPlanError(f"{source} is not a ckptc plan file (no 'format': 'ckptc-plan' field)")
        if data.get("schema_version") != SCHEMA_VERSION:
            raise CorruptPlanError(
                f"{source} has plan schema version {data.get('schema_version')!r}; this ckptc "
                f"reads version {SCHEMA_VERSION}. Plan the model again with this version."
            )
        try:
            return cls(
                graphs=[GraphPlan.from_dict(g) for g in data["graphs"]],
                budget_bytes=data["budget_bytes"],
                strategy=str(data["strategy"]),
                solver=str(data["solver"]),
                torch_version=str(data["torch_version"]),
                ckptc_version=str(data["ckptc_version"]),
                parameter_bytes=_optional_int(data.get("parameter_bytes")),
                gradient_bytes=_optional_int(data.get("gradient_bytes")),
            )
        except (KeyError, TypeError, ValueError) as error:
            raise CorruptPlanError(f"{source} is damaged: missing or invalid field {error}") from None


def _parameter_sizes(model: torch.nn.Module | None) -> dict[str, int | None]:
    """Bytes of the model's distinct parameters and of its trainable ones' gradients."""
    if model is None:
        return {"parameter_bytes": None, "gradient_bytes": None}
    params = list(model.parameters())  # distinct: tied weights appear once
    return {
        "parameter_bytes": sum(p.numel() * p.element_size() for p in params),
        "gradient_bytes": sum(p.numel() * p.element_size() for p in params if p.requires_grad),
    }


def _optional_int(value: Any) -> int | None:
    return None if value is None else int(value)


def load_plan(path: str | os.PathLike[str]) -> ModelPlan:
    """Read a plan file.  Raises :class:`CorruptPlanError` with the reason if it is unusable."""
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
    except UnicodeDecodeError:
        raise CorruptPlanError(f"{path} is not a text file; plan files are JSON") from None
    try:
        data = json.loads(text)
    except json.JSONDecodeError as error:
        raise CorruptPlanError(
            f"{path} is not valid JSON ({error.msg} at line {error.lineno}); "
            "the file is truncated or corrupt. Plan the model again."
        ) from None
    return ModelPlan.from_dict(data, source=str(path))


# -- graph <-> plan ------------------------------------------------------
def fingerprint(jp: "JointProblem") -> str:
    """A hash of the joint graph's structure: ops, shapes, dtypes and edges in order."""
    h = hashlib.sha256()
    for name, node in jp.nodes.items():
        val = node.meta.get("val")
        h.update(
            repr(
                (
                    jp.stable_names[name],
                    str(node.target) if node.op == "call_function" else node.op,
                    _describe(val),
                    tuple(jp.stable_names[n.name] for n in node.all_input_nodes),
                )
            ).encode()
        )
    return h.hexdigest()


def _describe(val: Any) -> Any:
    if isinstance(val, torch.Tensor):
        return (tuple(int(s) for s in val.shape), str(val.dtype).replace("torch.", ""))
    if isinstance(val, (tuple, list)):
        return tuple(_describe(v) for v in val)
    return type(val).__name__


def _inputs(jp: "JointProblem") -> list[list[Any]]:
    described = []
    for node in jp.nodes.values():
        if node.op == "placeholder":
            desc = _describe(node.meta.get("val"))
            pair = isinstance(desc, tuple) and len(desc) == 2 and isinstance(desc[0], tuple)
            described.append([list(desc[0]), desc[1]] if pair else [desc])
    return described


def graph_plan(record: "GraphRecord") -> GraphPlan:
    """The stable-name form of one graph's plan, with per-value decisions."""
    jp = record.joint_problem
    problem = jp.problem
    stable = jp.stable_names
    plan = record.plan
    recomputed = {s.node for s in record.result.steps if s.phase == "backward" and problem[s.node].kind == "forward"}
    # A value whose storage stays alive through a kept view (a detach of it) is kept too.
    kept_storages = {problem.alias_root(k) for k in plan.kept}
    values = []
    for name in jp.graph_nodes(problem.forward_nodes):
        cost = jp.node_cost(name)
        if name in plan.kept or (cost.bytes and problem.alias_root(name) in kept_storages):
            decision = "kept"
        elif name in recomputed:
            decision = "recomputed"
        else:
            continue
        op = stable[name].rsplit(".", 1)[-1]
        values.append(KeptValue(stable[name], cost.module, op, cost.bytes, cost.flops, decision))
    stable_plan = solvers.Plan(
        kept=frozenset(stable[k] for k in plan.kept),
        schedule=None if plan.schedule is None else tuple(solvers.Step(stable[s.node], s.phase) for s in plan.schedule),
        method=plan.method,
        budget_bytes=plan.budget_bytes,
        info=_json_safe(plan.info),
    )
    forward_flops = sum(jp.node_cost(n).flops for n in jp.graph_nodes(problem.forward_nodes))
    backward_flops = sum(jp.node_cost(n).flops for n in jp.graph_nodes(problem.backward_nodes))
    recomputed_steps = [
        s.node for s in record.result.steps if s.phase == "backward" and problem[s.node].kind == "forward"
    ]
    recompute_flops = sum(jp.node_cost(n).flops for n in jp.graph_nodes(recomputed_steps))
    return GraphPlan(
        fingerprint=fingerprint(jp),
        inputs=_inputs(jp),
        plan=stable_plan,
        predicted_peak_bytes=record.result.peak_bytes,
        unoptimized_peak_bytes=record.unoptimized_peak_bytes,
        min_feasible_bytes=record.min_feasible_bytes,
        baseline_bytes=record.baseline_bytes,
        recompute_flops=float(recompute_flops),
        forward_flops=float(forward_flops),
        backward_flops=float(backward_flops),
        values=values,
    )


def _json_safe(info: dict[str, Any]) -> dict[str, Any]:
    # solve times differ run to run; keep files byte-identical for the same plan
    return {
        k: v
        for k, v in sorted(info.items())
        if k not in ("solve_seconds",) and isinstance(v, (int, float, str, bool, type(None)))
    }


def plan_source_for(model_plan: ModelPlan) -> Callable[[int, "JointProblem"], solvers.Plan]:
    """A ``plan_source`` that applies ``model_plan`` to freshly captured graphs.

    Refuses, with what differs, a graph whose torch version, fingerprint or
    input shapes do not match the plan.
    """

    def source(index: int, jp: "JointProblem") -> solvers.Plan:
        if model_plan.torch_version != torch.__version__:
            raise PlanMismatchError(
                f"the plan was made with torch {model_plan.torch_version}, this is torch "
                f"{torch.__version__}; captured graphs differ between versions. Plan again."
            )
        if index >= len(model_plan.graphs):
            raise PlanMismatchError(
                f"the model produced graph #{index + 1} but the plan has {len(model_plan.graphs)} "
                "graph(s): it was made for another model or other inputs. Plan again."
            )
        expected = model_plan.graphs[index]
        inputs = _inputs(jp)
        if inputs != expected.inputs:
            diffs = [
                f"input {i}: plan {a}, model {b}"
                for i, (a, b) in enumerate(zip(expected.inputs, inputs, strict=False))
                if a != b
            ]
            if len(inputs) != len(expected.inputs):
                diffs.insert(0, f"plan has {len(expected.inputs)} inputs, model has {len(inputs)}")
            raise PlanMismatchError(
                f"graph #{index + 1}: input shapes or dtypes differ from the plan's ({'; '.join(diffs[:3])}). "
                "Plan again for these inputs."
            )
        if fingerprint(jp) != expected.fingerprint:
            raise PlanMismatchError(
                f"graph #{index + 1}: the captured graph's fingerprint differs from the plan's "
                "(the model's code or configuration changed). Plan again."
            )
        by_stable = {s: n for n, s in jp.stable_names.items()}
        saved = expected.plan
        plan = solvers.Plan(
            kept=frozenset(by_stable[k] for k in saved.kept),
            schedule=(
                None if saved.schedule is None
                else tuple(solvers.Step(by_stable[s.node], s.phase) for s in saved.schedule)
            ),
            method=saved.method,
            budget_bytes=saved.budget_bytes,
            info=dict(saved.info, applied_from_file=True),
        )
        solvers.simulate(jp.problem, plan)  # validates the plan against this graph
        return plan

    return source
