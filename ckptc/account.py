"""The step account: the one place that says what a step's budget counts.

A budget bounds everything one training step holds on the device, from the
start of its first forward to the end of its last backward.  Each captured
graph is planned for its own activations; everything else the step holds while
that graph runs is the graph's *baseline*, and this module computes it:

* the model's parameters and buffers that the graph does not take as input;
* gradients: those resident when the step began (gradient accumulation,
  ``zero_grad(set_to_none=False)``) for the whole step, and those of parameters
  no graph run so far uses (their backward runs first, so they exist while this
  graph's backward runs);
* what earlier graphs of the step keep for their backward and the results the
  caller holds (:attr:`ckptc.records.GraphRecord.step_bytes`);
* a small reserve for results of graphs after a break (the loss, a few scalars),
  not known yet when earlier graphs are planned;
* per-rank extras under DDP/FSDP2 (:class:`ckptc.distributed.RankContext`);
* the device's own step overhead (cuBLAS workspaces, :mod:`ckptc.devices`);
* a correction measured at run time: what a measured step showed the
  prediction missed (eager code between graphs, allocator effects);

and the planning margin (:func:`planning_margin`): solvers plan a little below
the budget, sized from what the plan controls.

A :class:`StepAccount` is built once per step state by
:class:`ckptc.step.StepRuntime` (or left at its defaults by a plain
``torch.compile`` backend and by :func:`ckptc.capture`) and passed to the
compiler as an argument; :class:`~ckptc.options.CheckpointOptions` holds only
what the user sets.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Mapping, Sequence

import torch

import solvers
from ckptc.devices import graph_device, memory_model
from ckptc.distributed import local_nbytes
from ckptc.meter import resident_bytes

if TYPE_CHECKING:
    from ckptc.records import GraphRecord

#: Results of graphs after a break (the loss, a few scalars) that earlier graphs cannot see yet.
HELD_RESULTS_RESERVE_BYTES = 1024
#: The margin is 1/200 of the activations kept for backward and 1/32 of the largest scratch (see planning_margin).
PLANNING_MARGIN_DIVISOR = 200
SCRATCH_UNCERTAINTY_DIVISOR = 32


@dataclass(frozen=True)
class StepAccount:
    """What one step holds besides the activations the plans decide (see the module docstring).

    Attributes:
        gradients_at_start: the step starts with parameters' ``.grad`` allocated
            (accumulation); they count for the whole step.
        correction_bytes: what a measured step showed the prediction missed.
        rank_bytes: what this rank holds outside the graphs' view (DDP buckets, FSDP2 buffers).
        hold_outputs: whether the caller holds forward results until backward
            ends (None: decided per graph, see :func:`ckptc.problem.joint_to_problem`).
        graph_budgets: budgets of single graphs by index, lower than the step's
            (earlier graphs keeping less for later ones; set by the replan loop).
        defer_infeasible: plan a graph that cannot fit at its lowest peak and
            mark it, so the whole step is seen before deciding.
    """

    gradients_at_start: bool = False
    correction_bytes: int = 0
    rank_bytes: int = 0
    hold_outputs: bool | None = None
    graph_budgets: Mapping[int, int] = field(default_factory=dict)
    defer_infeasible: bool = False

    def replace(self, **changes: Any) -> "StepAccount":
        return dataclasses.replace(self, **changes)

    def graph_baseline(
        self,
        model: torch.nn.Module | None,
        graph_inputs: Sequence[Any],
        placeholders: Sequence[Any],
        earlier: Sequence["GraphRecord"],
    ) -> tuple[int, frozenset[int]]:
        """The baseline of a graph taking ``graph_inputs`` (real tensors) whose joint graph's
        placeholder values are ``placeholders`` (fake tensors), after the graphs ``earlier``
        in the same step.  Also returns the ids of the graph's tensor inputs."""
        tensors = [t for t in graph_inputs if isinstance(t, torch.Tensor)]
        graph_ids = frozenset(id(t) for t in tensors)
        outside = 0
        if model is not None:
            params = {id(p): p for p in model.parameters()}
            state_ids = set(params) | {id(b) for b in model.buffers()}
            state = resident_bytes(*params.values(), *model.buffers())
            in_graph = resident_bytes(*[t for t in tensors if id(t) in state_ids])
            seen = set(graph_ids).union(*(r.input_ids for r in earlier))
            grads = 0
            for i, p in params.items():
                if not p.requires_grad:
                    continue
                if p.grad is not None and self.gradients_at_start:
                    grads += local_nbytes(p.grad)  # resident from the step's start to its end
                elif i not in seen:
                    grads += local_nbytes(p)  # made by a later graph's backward, which runs first
            outside = max(0, state - in_graph) + grads
        device = graph_device([v for v in placeholders if isinstance(v, torch.Tensor)])
        return (
            outside
            + sum(r.step_bytes for r in earlier)
            + HELD_RESULTS_RESERVE_BYTES
            + self.rank_bytes
            + self.correction_bytes
            + memory_model(device).step_overhead_bytes,
            graph_ids,
        )


def planning_margin(problem: solvers.Problem, unoptimized: solvers.SimResult) -> int:
    """How far below the user's budget the solvers plan for this graph.

    What can differ between the prediction and a run is what the plan moves
    (activations kept for backward, whose kernels' scratch memory is measured
    once per op on random data and varies a little between runs), not the
    weights and gradients, which are exact.  So the margin is a share of the
    unoptimized plan's kept bytes plus a share of the largest scratch: a
    billion-parameter model whose weights dwarf its activations keeps its
    whole useful range (floor to unoptimized peak) plannable, which a share
    of the whole budget would swallow.
    """
    scratch = max((n.scratch for n in problem.nodes), default=0)
    return unoptimized.kept_bytes // PLANNING_MARGIN_DIVISOR + scratch // SCRATCH_UNCERTAINTY_DIVISOR


def gradients_resident(model: torch.nn.Module) -> bool:
    """Whether any trainable parameter of ``model`` has a gradient allocated."""
    return any(p.grad is not None for p in model.parameters() if p.requires_grad)
