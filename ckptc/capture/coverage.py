"""What of the model's training step ckptc's graphs cover, and what they cannot.

Two concerns, one home:

* **Refusals.**  Code that Dynamo does not capture runs eagerly between the
  graphs ckptc plans: its activations are never checkpointed, and counted
  only as far as a later graph finds them saved for backward as it plans,
  so the budget could silently not hold.  Recurrent modules (``nn.LSTM``,
  ``nn.GRU``, ``nn.RNN``) are the common case.  ckptc captures them (Dynamo's
  ``allow_rnn``, enabled around ckptc's compiles, unrolls them into the graph),
  but that trace drops the dropout between stacked layers, and packed
  sequences are still skipped.  :func:`refuse_before_capture` refuses a
  training call whose RNNs would train with wrong gradients;
  :func:`refuse_uncaptured` refuses a call after which an RNN's parameters
  were in no planned graph (it ran eagerly, unplanned).  Both raise
  :class:`~ckptc.errors.UntraceableModelError` naming the module.
* **The coverage report** (:class:`Coverage`): per captured graph, its share of
  the eager forward's FLOPs and saved activations, and Dynamo's reasons for
  the step's graph breaks (per step, not per graph: Dynamo counts reasons, it
  does not say which graph a break ended).
"""

from __future__ import annotations

import collections
import dataclasses
import linecache
import logging
import os
import re
import weakref
from typing import TYPE_CHECKING, Any, Iterable

import torch

from ckptc import _torch_internals as internals
from ckptc.errors import UntraceableModelError, warn_once
from ckptc.pricing.costs import op_flops
from solvers.errors import human_bytes

if TYPE_CHECKING:
    from ckptc.records import GraphRecord

log = logging.getLogger("ckptc.capture.coverage")

_WHAT_TO_DO = (
    "What to do: optimize only the submodules that do not contain '{name}' (each with ckptc.optimize and a "
    "share of the budget) and run '{name}' as it is, or checkpoint the model yourself with "
    "torch.utils.checkpoint."
)


def recurrent_modules(model: torch.nn.Module) -> list[tuple[str, torch.nn.RNNBase]]:
    """Every ``nn.LSTM``/``nn.GRU``/``nn.RNN`` in ``model`` with its qualified name (``encoder.rnn``)."""
    return [(name, m) for name, m in model.named_modules() if isinstance(m, torch.nn.RNNBase)]


_told_unrolled: weakref.WeakSet[torch.nn.Module] = weakref.WeakSet()


def _drops_dropout(rnn: torch.nn.RNNBase) -> bool:
    """Whether the captured (unrolled) RNN would differ from eager: dropout between stacked layers."""
    return rnn.training and rnn.dropout > 0 and rnn.num_layers > 1


def refuse_before_capture(model: torch.nn.Module) -> None:
    """Refuse a training call of ``model`` whose capture would train differently from eager.

    Raises:
        UntraceableModelError: an RNN applies dropout between its layers; the
            captured graph would silently leave it out (gradients differ).
    """
    for name, rnn in recurrent_modules(model):
        if _drops_dropout(rnn):
            raise UntraceableModelError(
                f"ckptc cannot train {type(model).__name__} within a budget: its {type(rnn).__name__} "
                f"'{name}' applies dropout={rnn.dropout} between its {rnn.num_layers} layers, and "
                "torch.compile's trace of recurrent modules leaves that dropout out (gradients would differ "
                "from eager PyTorch), while running it eagerly would leave its activations unplanned.\n"
                + _WHAT_TO_DO.format(name=name)
                + f" Or set dropout=0 on '{name}' (captured exactly, unrolled over time steps)."
            )
        if rnn.training and rnn not in _told_unrolled:
            _told_unrolled.add(rnn)
            log.warning(
                "ckptc captures %s '%s' unrolled over its time steps: gradients equal eager, but capture "
                "and planning grow with the sequence length and each step runs slower than PyTorch's "
                "fused RNN kernel.",
                type(rnn).__name__,
                name,
            )


def refuse_uncaptured(model: torch.nn.Module, ran: Iterable[GraphRecord], eager: EagerForward | None = None) -> None:
    """Refuse a training call in which an RNN ran outside every planned graph.

    ``ran`` are the graphs the call ran; each records the ids of its inputs
    (parameters included).  An RNN with trainable parameters that no graph
    took ran eagerly: its activations were not counted.  ``eager``, the
    reference forward of the call's plan, tells which RNNs the forward calls
    at all (an unused one is not refused).

    Raises:
        UntraceableModelError: naming the first such module.
    """
    if eager is not None and eager.recurrent_modules_run is None:
        return  # no graph break: every RNN the forward called ran in a graph
    if eager is not None:  # the RNNs it calls, without walking every module on every call
        rnns = [(name, model.get_submodule(name)) for name in sorted(eager.recurrent_modules_run)]
    else:
        rnns = recurrent_modules(model)
    if not rnns:
        return
    seen: set[int] = set().union(*(r.inputs.ids for r in ran))
    for name, rnn in rnns:
        trainable = [p for p in rnn.parameters() if p.requires_grad]
        if trainable and not any(id(p) in seen for p in trainable):
            raise UntraceableModelError(
                f"ckptc cannot train {type(model).__name__} within a budget: its {type(rnn).__name__} "
                f"'{name}' ran outside the captured graphs (torch.compile does not capture recurrent "
                "modules called with packed sequences or in code it skips), so its activations would be "
                "neither counted nor checkpointed and the budget would not hold.\n"
                + _WHAT_TO_DO.format(name=name)
                + " Padded (not packed) inputs are captured."
            )


#: The most ops one captured graph may have.  Capture, pricing and planning grow faster than a graph's
#: size: transformers' Mamba slow path (3 layers) unrolls 27 ops per token, and its capture took 140 s
#: and 765 MiB at 128 tokens (3,663 ops) while 1,024 tokens (~28,000 ops) grew one process past 24 GB.
#: Layer stacks stay below it: GPT-2 is 46 ops per layer, so 170 layers fit.
MAX_GRAPH_OPS = 8_000


def refuse_oversized(gm: torch.fx.GraphModule, model_name: str) -> None:
    """Refuse a graph Dynamo captured that is too large to plan, before anything prices or traces it
    further, naming the line of the model's code that repeats most (an unrolled Python loop).

    Raises:
        UntraceableModelError: the graph has more than :data:`MAX_GRAPH_OPS` ops.
    """
    ops = [n for n in gm.graph.nodes if n.op in ("call_function", "call_method", "call_module")]
    if len(ops) <= MAX_GRAPH_OPS:
        return
    lines = collections.Counter(_innermost_frame(n.meta.get("stack_trace")) for n in ops)
    lines.pop(None, None)
    cause = ""
    if lines:
        (where, code), count = lines.most_common(1)[0]
        cause = (
            f" {count:,} of them come from one line, {where}: `{code}`; a line that gives that many ops is "
            "in a Python loop that Dynamo unrolls into the graph (a recurrence over time steps, a loop over "
            "positions)."
        )
    routed = sum(1 for n in ops if internals.binds_unbacked_symbols(n))
    if routed > MAX_GRAPH_OPS // 100:
        # Sizes that depend on the data, many of them: tokens routed to each expert, a mixture of experts
        # unrolling its expert loop in every layer.
        what_to_do = (
            f"What to do: the graph selects tokens for an expert {routed:,} times (a mixture of experts' loop "
            "over its experts, in every layer): break the graph before each layer, so that each layer is a "
            "graph of its own, compiled once and planned for every layer: `for layer in <the decoder layers>: "
            "layer.register_forward_pre_hook(lambda module, args: torch._dynamo.graph_break())`; or plan fewer "
            "layers."
        )
    else:
        what_to_do = (
            "What to do: replace the loop with a parallel or vectorized form (a state-space model's sequential "
            "scan with a parallel scan, e.g. mamba.py's, which transformers' Mamba uses with use_mambapy=True); "
            "shorten the sequence; or leave that module out of ckptc (torch.compiler.disable on it) and "
            "checkpoint it with torch.utils.checkpoint."
        )
    raise UntraceableModelError(
        f"ckptc will not capture {model_name}: one of its graphs has {len(ops):,} ops, more than the "
        f"{MAX_GRAPH_OPS:,} ckptc plans, and capturing, pricing and planning it would take memory and time "
        f"that grow with its size.{cause}\n{what_to_do}"
    )


_TORCH_DIR = os.path.dirname(os.path.abspath(torch.__file__)) + os.sep


def _innermost_frame(stack_trace: str | None) -> tuple[str, str] | None:
    """``("file.py:123", "code")`` of the last frame of an FX node's ``stack_trace`` outside torch itself
    (an ``nn.Linear`` called from the loop counts for the loop's line, whether or not Dynamo recorded
    the module's own frame)."""
    if not stack_trace:
        return None
    # A frame's code line is missing when linecache had no copy of the file at trace time: read it again.
    found = re.findall(r'File "([^"]+)", line (\d+), in [^\n]*(?:\n(?! *File ") +([^\n]*))?', stack_trace)
    outside_torch = [f for f in found if not os.path.abspath(f[0]).startswith(_TORCH_DIR)]
    if not (outside_torch or found):
        return None
    path, line, code = (outside_torch or found)[-1]
    code = code or linecache.getline(path, int(line))
    return f"{os.path.basename(path)}:{line}", code.strip()


# -- the coverage report ------------------------------------------------------
PARTIAL_COVERAGE_WARNING = 0.95  # warn when graphs cover less of the forward's FLOPs than this


@dataclasses.dataclass
class EagerForward:
    """What the forward of a call that plans does, the reference the graphs are compared to.

    Measured by running the forward eagerly once more (:meth:`measure`) only where graph breaks
    left code outside the graphs; a step Dynamo captured whole is its own reference
    (:meth:`whole`), and its forward runs once, Python side effects included.

    Attributes:
        flops: FLOPs of every aten op of the forward (priced like the graphs' nodes).
        saved_bytes: activations eager autograd saves for backward (distinct
            storages, parameters and inputs excluded).
        recurrent_modules_run: qualified names of the RNNs the forward called (None: not
            measured; no break, so every RNN that ran is in a graph).
        breaks: Dynamo's reasons for the graph breaks of the capture, most frequent first.
    """

    flops: int
    saved_bytes: int
    recurrent_modules_run: frozenset[str] | None = None
    breaks: list[tuple[str, int]] = dataclasses.field(default_factory=list)

    @classmethod
    def whole(cls, ran: Iterable[GraphRecord]) -> "EagerForward":
        """The reference of a step without graph breaks: its graphs are the whole forward."""
        flops = saved = 0
        for r in ran:
            flops += _forward_flops(r)
            saved += r.unoptimized_kept_bytes
        return cls(flops, saved)

    @classmethod
    def measure(cls, model: torch.nn.Module, args: tuple, kwargs: dict) -> "EagerForward":
        """Run ``model(*args, **kwargs)`` once, keeping nothing for backward.

        Saved tensors are counted and dropped (a pack hook), so the run needs
        no more memory than inference.  The caller restores the buffers and the
        random state the forward changed.  Raises what the forward raises
        (tensor subclasses or custom autograd that unpacks saved tensors in
        forward cannot run this way).
        """
        state = {internals.storage_key(t) for t in _tensors_of(model, args, kwargs)}
        seen: set[Any] = set()
        totals = {"flops": 0, "saved": 0}

        def count(op: Any, op_args: tuple, op_kwargs: dict, out: Any) -> None:
            totals["flops"] += op_flops(op, op_args, op_kwargs, out)

        def pack(tensor: torch.Tensor) -> None:
            key = internals.storage_key(tensor)
            if key not in state and key not in seen:
                seen.add(key)
                totals["saved"] += tensor.untyped_storage().nbytes()

        def unpack(_: None) -> torch.Tensor:
            raise UntraceableModelError(
                f"A tensor made by ckptc's reference run of {type(model).__name__}'s forward reached a "
                "backward. On a call that plans a model with graph breaks, ckptc runs the forward once "
                "more eagerly (keeping nothing for backward) to measure what the graphs leave out, and "
                "the forward stored a result of it outside its outputs (a list or attribute on the "
                "module).\nWhat to do: return such values from forward, or clear what the forward "
                "stores before each training call; or remove the graph breaks (TORCH_LOGS=graph_breaks)."
            )

        called: set[str] = set()
        hooks = [
            rnn.register_forward_pre_hook(lambda *_, name=name: called.add(name))
            for name, rnn in recurrent_modules(model)
        ]
        try:
            with (
                torch.enable_grad(),
                torch.autograd.graph.saved_tensors_hooks(pack, unpack),
                internals.observe_ops(count),
            ):
                model(*args, **kwargs)
        finally:
            for hook in hooks:
                hook.remove()
        return cls(totals["flops"], totals["saved"], frozenset(called))

    def capture_ended(self, model: torch.nn.Module, ran: Iterable[GraphRecord]) -> None:
        """Warn if the graphs that ran leave part of the forward to eager code (unplanned, only the
        run-time check sees it)."""
        if not self.breaks:  # a step captured whole is its own reference: nothing left out
            return
        report = Coverage.of(self, ran)
        if report.flops_share < PARTIAL_COVERAGE_WARNING:
            warn_once(
                model,
                "coverage",
                f"ckptc: {type(model).__name__}'s training step is split: {report.summary()}. Code outside the "
                "graphs runs eagerly and unplanned: its activations are never checkpointed, and only what it "
                "saves for backward is counted before a step is measured (the measured check corrects the budget "
                "for the rest, at more recompute than needed). What to do: "
                "`fast.plan.coverage` lists each break with the line that caused it; remove those breaks "
                "(TORCH_LOGS=graph_breaks shows them) to bring that code into a plan.",
                stacklevel=7,
            )


def breaks_since(before: dict[str, int]) -> list[tuple[str, int]]:
    """Dynamo's graph-break reasons counted since ``before`` (:func:`ckptc._torch_internals.graph_break_reasons`),
    shortened and merged, most frequent first."""
    merged: dict[str, int] = {}
    for reason, count in internals.graph_break_reasons().items():
        new = count - before.get(reason, 0)
        if new > 0:
            short = _short_reason(reason)
            merged[short] = merged.get(short, 0) + new
    return sorted(merged.items(), key=lambda t: -t[1])


def _forward_flops(record: GraphRecord) -> int:
    jp = record.joint_problem
    return sum(jp.node_cost(n).flops for n in jp.graph_nodes(record.problem.forward_nodes))


@dataclasses.dataclass(frozen=True)
class GraphCoverage:
    """One captured graph's share of the step.

    Attributes:
        index: the graph's position in the step.
        forward_flops: its forward FLOPs (data-dependent sizes at their upper bound).
        saved_bytes: what it keeps for backward when nothing is recomputed.
        flops_share / memory_share: those as fractions of the eager forward's
            FLOPs and saved activations.
        data_dependent: it has sizes that depend on data (``nonzero``, MoE
            routing), priced at their upper bound: its shares then overstate
            what one step runs (they can exceed 1).
        break_after: why Dynamo ended this graph at a graph break and where in
            the model's code (None: the graph ends with its frame).
        runs: how many times the step runs it (layers compiled once run once per layer);
            the shares count every run.
    """

    index: int
    forward_flops: int
    saved_bytes: int
    flops_share: float
    memory_share: float
    data_dependent: bool = False
    break_after: str | None = None
    runs: int = 1


@dataclasses.dataclass(frozen=True)
class Coverage:
    """How much of the training step ckptc's graphs cover, and why the step is split.

    What runs outside every graph (eager code between graph breaks, frames
    Dynamo skipped) is never checkpointed, and of what it holds only what it
    saves for its backward is counted as the graphs after it plan
    (``StepAccount.eager_saved_before``); the run-time check (``verify=True``)
    corrects the plan by what it measures beyond that.

    Attributes:
        graphs: per graph, its share of the eager forward's FLOPs and activations.
        eager_flops / eager_saved_bytes: the whole forward, run eagerly.
        breaks: Dynamo's reasons for splitting the step, with their counts.
    """

    graphs: list[GraphCoverage]
    eager_flops: int
    eager_saved_bytes: int
    breaks: list[tuple[str, int]]

    @property
    def flops_share(self) -> float:
        """Fraction of the forward's FLOPs inside graphs (at most 1; sizes at their bounds can overshoot)."""
        return min(1.0, sum(g.flops_share for g in self.graphs))

    @property
    def memory_share(self) -> float:
        """Fraction of the forward's activations saved inside graphs (at most 1)."""
        return min(1.0, sum(g.memory_share for g in self.graphs))

    @classmethod
    def of(cls, eager: EagerForward, ran: Iterable[GraphRecord]) -> "Coverage":
        """The coverage of the graphs ``ran`` (in run order, a graph once per run) against ``eager``."""
        runs: dict[int, tuple[GraphRecord, int]] = {}
        for r in ran:
            runs[id(r)] = (r, runs[id(r)][1] + 1 if id(r) in runs else 1)
        graphs = []
        for r, count in runs.values():
            flops = _forward_flops(r)
            saved = r.unoptimized_kept_bytes
            graphs.append(
                GraphCoverage(
                    index=r.index,
                    forward_flops=flops,
                    saved_bytes=saved,
                    flops_share=count * flops / eager.flops if eager.flops else 1.0,
                    memory_share=count * saved / eager.saved_bytes if eager.saved_bytes else 1.0,
                    data_dependent=any(internals.binds_unbacked_symbols(n) for n in r.joint_problem.nodes.values()),
                    break_after=r.break_after,
                    runs=count,
                )
            )
        return cls(graphs, eager.flops, eager.saved_bytes, list(eager.breaks))

    def summary(self) -> str:
        """One line: graphs, shares, the most frequent break reason."""
        text = (
            f"{len(self.graphs)} graph(s) cover {100 * self.flops_share:.0f}% of forward FLOPs and "
            f"{100 * self.memory_share:.0f}% of activations"
        )
        if self.breaks:
            text += f"; {sum(n for _, n in self.breaks)} break(s), most often: {self.breaks[0][0].rstrip('.')}"
        return text

    def __str__(self) -> str:
        lines = [f"coverage: {self.summary()}"]
        for g in self.graphs:
            lines.append(
                f"  graph {g.index}: {100 * g.flops_share:5.1f}% of forward FLOPs, "
                f"{100 * g.memory_share:5.1f}% of activations ({human_bytes(g.saved_bytes)}"
                + (f" per run, run {g.runs} times)" if g.runs > 1 else ")")
                + (", data-dependent sizes at their upper bound" if g.data_dependent else "")
            )
            if g.break_after:
                lines.append(f"    ends at a graph break: {g.break_after}")
        outside = max(0.0, 1.0 - self.flops_share)
        if outside:
            lines.append(f"  outside graphs (eager, unplanned): {100 * outside:.1f}% of forward FLOPs")
        for reason, count in self.breaks:
            lines.append(f"  break x{count}: {reason}")
        return "\n".join(lines)


def _short_reason(reason: str) -> str:
    """Dynamo's break message in one line: its title and its explanation."""
    lines = [line.strip() for line in reason.strip().splitlines() if line.strip()]
    title = lines[0] if lines else reason
    explanation = next(
        (line.removeprefix("Explanation:").strip() for line in lines[1:] if line.startswith("Explanation:")), ""
    )
    text = f"{title}: {explanation}" if explanation else title
    if len(text) <= 240:
        return text
    # Whole sentences where they fit, else whole words: a cut mid-word followed by the caller's own
    # full stop read "does not currently know how to ."
    sentence_end = text.rfind(". ", 0, 240)
    if sentence_end > len(title):
        return text[: sentence_end + 1]
    cut = text.rfind(" ", 0, 234)
    return text[: cut if cut > 0 else 234] + " (...)"


def _tensors_of(model: torch.nn.Module, args: tuple, kwargs: dict) -> list[torch.Tensor]:
    inputs = [t for t in internals.tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
    return [*model.parameters(), *model.buffers(), *inputs]
