"""Where a training step begins and ends, and its measured peak: one tracker for both run-time checks.

``ckptc.optimize``'s :class:`~ckptc.runtime.step.StepRuntime` sees every training call;
``torch.compile(backend="ckptc")``'s :class:`~ckptc.runtime.watch.BackendStepCheck` sees only its
graphs.  Both follow a step through one :class:`StepTracker`:

* a step is *open* from the first call (or graph) after the last step ended until a backward that
  reaches its results ends (a hook on the results queues a callback on the autograd engine); a second
  call before that backward belongs to the same step, and a step whose results need no gradient
  ends when they are returned (an inference call);
* its owner may measure it (:class:`ckptc.meter.StepMeter`, from the owner's baseline) and stops
  measuring it when something plans during it (planning profiles ops itself, and profilers do not
  nest); a step whose meter stopped so is not measured again.  That stop comes from inside a
  graph's run, inside the record-function scopes torch opens around compiled code ("Torch-Compiled
  Region"), which opened while the meter's profiler ran; a profiler started before they close
  (a second meter, right there) receives their late end events, written through the stopped
  profiler's freed records: torch 2.13 then corrupts whatever memory took their place (saved
  activations: wrong gradients in some processes, crashes in others);
* a CPU meter is stopped on the first Python event after the engine returns
  (:func:`ckptc.meter.after_backward_returns`): stopped inside the engine's callback, the profiler
  would come back as a stale "enabled" one; so is the meter of a step whose backward raised inside a
  compiled graph (:meth:`StepTracker.backward_failed`), which ends unmeasured;
* after a step ended by a backward its hooks stay until the next step begins: a second backward of
  the same step (``retain_graph=True``: another autograd graph task) is reported once;
* when a backward ends a step, whether the caller still holds a result other than a scalar (logits
  beside ``.loss``) is noted (:attr:`StepTracker.results_held`), from weak references: nothing
  the caller dropped is kept alive;
* a step whose autograd graph dies without a backward (a forward with gradients enabled whose
  output the caller drops: monitoring without ``torch.no_grad()``) ends when it dies, so its meter's
  profiler never outlives it (left running, it disturbs the user's profilers and can crash the
  interpreter at exit).  The graph, not the results: ``loss = model(a) + model(b)`` drops both
  results at once, and the backward still comes through ``loss``.

Beside the tracker, :class:`ResultLifetimes` notes whether each graph's results are still alive when
a later graph of the step starts or plans: the eager code after a graph break often uses a graph's
results and lets them go (``hidden = embeddings + positions``), so later graphs need not count them held.
"""

from __future__ import annotations

import gc
import itertools
import sys
import weakref
from typing import Any, Callable, Hashable, Iterable, Protocol, Sequence, TypeVar

import torch

from ckptc import _torch_internals as internals
from ckptc.errors import warn_once
from ckptc.meter import MemoryMeasurement, StepMeter, after_backward_returns, gradient_of, resident_bytes
from ckptc.records import GraphRecord

V = TypeVar("V")


class StepEvents(Protocol):
    """What a run-time check hears from the compiler about the graphs of a step."""

    def planned(self, new_graph: bool = False) -> None:
        """A graph plans (again) now: planning profiles ops, so the step is not measured across it
        (``new_graph``: a graph torch.compile just compiled, not one planned again in place)."""

    def graph_starts(self, record: GraphRecord, args: Sequence[Any]) -> None:
        """Graph ``record`` runs now on ``args`` (Dynamo's real inputs, parameters included),
        under its current plan."""

    def graph_returned(self, record: GraphRecord, outputs: Any) -> None:
        """Graph ``record`` returned ``outputs``."""

    def results_beside(
        self, index: int, inputs: Sequence[Any], records: Sequence[GraphRecord]
    ) -> list[tuple[GraphRecord, int, int]]:
        """How many runs of each graph of ``records`` that ran earlier in the open step have their results
        dead as graph ``index`` starts (or plans) on ``inputs`` (:meth:`ResultLifetimes.results_beside`)."""

    def backward_failed(self) -> None:
        """A graph's backward raised: the open step ends unmeasured (:meth:`StepTracker.backward_failed`)."""

    def saved_by_eager_code(self, inputs: Sequence[Any], model: torch.nn.Module | None) -> int:
        """Bytes eager code of the open step saved for its backward upstream of a graph that plans on
        ``inputs`` (:meth:`ResultLifetimes.saved_by_eager_code`)."""


def warn_if_sparse_gradients_resident(owner: Any, parameters: Iterable[Any], stacklevel: int) -> None:
    """Warn once (per ``owner``) when a step begins with a sparse gradient resident (``nn.Embedding(sparse=True)``
    under accumulation): a sparse gradient accumulates by concatenation, so each micro-batch starts with more
    resident and adds more than the one before, while a verified state (gradients resident) is not measured
    again."""
    gradients = [gradient_of(p) for p in parameters if isinstance(p, torch.Tensor)]
    sparse = [g for g in gradients if g is not None and g.is_sparse]
    if not sparse:
        return
    held = resident_bytes(sparse)
    warn_once(
        owner,
        "sparse-gradients",
        f"ckptc: a step begins with sparse gradients resident ({len(sparse)} gradients, {held} bytes now: "
        "nn.Embedding(sparse=True) or EmbeddingBag under gradient accumulation). A sparse gradient accumulates by "
        "concatenating, so every micro-batch starts with more of it and adds more than the one before, while ckptc "
        "verifies the first micro-batches only: later ones can exceed the budget by that growth. What to do: leave "
        "room in the budget for the largest accumulation, accumulate fewer micro-batches, or use dense gradients "
        "(sparse=False).",
        stacklevel=stacklevel,
    )


class ResultLifetimes:
    """Whether each graph's results (other than scalars) are alive beside later graphs of the step, from
    weak references to their storages (nothing the caller dropped is kept alive; a result alive only
    as a view, or as a later graph's saved input, is alive): a run's results are alive beside a later
    graph (not another run of its own) when one's storage exists as that graph starts or is planned
    and is not one of its inputs' (an input is counted by the graph that takes it).  For
    :meth:`ckptc.planning.replan.Replans.observed_results_let_go`."""

    def __init__(self, *, watch_results: bool = False) -> None:
        self._watch_results = watch_results  # keep references to the results for results_alive
        # The open step's graph runs so far, each with its results' storages (weak references) and their bytes.
        self._returned: list[tuple[GraphRecord, list[tuple[Any, int]]]] = []
        # Storages by ``cdata`` with their weak references: a freed storage's address is soon another's,
        # so an entry whose storage was freed is dropped before any storage is looked up.
        self._inputs: dict[int, Any] = {}  # storages of the open step's graphs' tensor inputs
        self._walked: set[Hashable] = set()  # the open step's eager autograd nodes walked already
        self._saved: dict[int, tuple[Any, int]] = {}  # storages those saved, counted already, and their bytes
        self._results: list[weakref.ref] = []  # the open step's graph results that need a gradient
        self._left: dict[Any, int] = {}  # the last step's results' storages (weak references) and their bytes
        self._told = False  # warn_if_last_step_held warned

    def begin(self) -> None:
        """A new step: nothing of the last one is judged in it (what of its results is still alive is
        told: :meth:`warn_if_last_step_held`)."""
        self._left = {ref: nbytes for _, results in self._returned for ref, nbytes in results if ref is not None}
        self._returned, self._results = [], []
        self._inputs, self._walked, self._saved = {}, set(), {}

    def warn_if_last_step_held(self, owner: Any, inputs: Any, stacklevel: int) -> None:
        """Warn once (for ``owner``, the step runtime or the backend's check) when a step begins with results
        of the last step still alive, other than its inputs (``inputs``): the budget does not count them.

        A loop that keeps the output object until the next iteration rebinds it (``out = model(**batch);
        out.loss.backward()``, the Hugging Face docs' loop, a metric read from ``out.logits`` after
        ``backward()``) holds the last step's logits through this step's forward, and a model storing
        features in an attribute holds them until its forward overwrites them: memory the step's peak may
        include, which the budget leaves out (OPT tiny at the floor a refusal named: 1.077x, the excess exactly
        what the loop held, ckptc's own check within it).  Counting them as resident for the whole step was
        tried and reverted: they die early in the step (the rebinding, the overwrite), and the meter's
        baseline cannot fall when a block allocated before it began is freed, so budgets that train were
        refused (a model keeping 256 KiB of features: its halfway budget refused, naming 1.24x it)."""
        left = {ref: nbytes for ref, nbytes in self._left.items() if not ref.expired()} if not self._told else {}
        if not left:
            return  # the common case: nothing walked (the backend's inputs are every parameter)
        seen: set[Hashable] = set()
        resident_bytes(inputs, seen=seen)
        alive = sum(nbytes for ref, nbytes in left.items() if ref not in seen)
        if alive:
            self._told = True
            warn_once(
                owner,
                "last step held",
                f"ckptc: {alive} bytes of the last step's results are still alive as this step begins (the output "
                "object kept until the next iteration rebinds it, or features a model stores in an attribute); "
                "the budget does not count them, so this step's peak can exceed it by up to that much. What to "
                "do: drop the output once the step is done (del out after backward and the metrics), or leave "
                "room for it in the budget.",
                stacklevel=stacklevel,
            )

    def saved_by_eager_code(self, inputs: Sequence[Any], model: torch.nn.Module | None) -> int:
        """Bytes of the storages that eager code of the open step (between graphs, or before the first)
        saved for its backward in the autograd nodes upstream of ``inputs`` (a graph's, as it plans),
        each counted once in the step (:func:`ckptc._torch_internals.tensors_held_for_backward`): a
        dropout mask, a norm's statistics, an input an eager layer reads in backward.  Left out: leaves
        that require a gradient and their views (parameters, ``weight.t()``), the model's parameters and
        buffers, the tensor inputs of the step's graphs so far (they count them) and earlier graphs'
        results (counted by their graphs).  They stay alive until that eager code's backward, which runs
        after this graph's: ``StepAccount.eager_saved_before``.

        Less, where this graph takes as an input a storage counted so at an earlier graph: from this
        graph on its baseline counts that input, so the earlier count stops here (the result can be
        negative)."""
        self._saved = _alive(self._saved, lambda entry: entry[0])
        taken = self._note_inputs(inputs)
        handed_over = sum(self._saved.pop(storage)[1] for storage in taken & self._saved.keys())
        known = self._inputs.keys() | {
            ref.cdata for _, refs in self._returned for ref, _ in refs if ref is not None and not ref.expired()
        }
        if model is not None:
            known |= _storages(itertools.chain(model.parameters(), model.buffers()))
        total = -handed_over
        for tensor in internals.tensors_held_for_backward(
            [t for t in inputs if isinstance(t, torch.Tensor)], self._walked
        ):
            if internals.trainable_leaf_or_view(tensor):
                continue
            ref = internals.storage_ref(tensor)
            if ref is None or ref.cdata in known or ref.cdata in self._saved:
                continue
            nbytes = resident_bytes(tensor)
            self._saved[ref.cdata] = (ref, nbytes)
            total += nbytes
        return total

    # As the StepEvents of a step nobody measures (ckptc.capture's reference step):
    def planned(self, new_graph: bool = False) -> None:
        pass

    def backward_failed(self) -> None:
        pass

    def graph_starts(self, record: GraphRecord, args: Sequence[Any]) -> None:
        pass

    def graph_returned(self, record: GraphRecord, outputs: Any) -> None:
        results = [t for t in internals.tree_leaves(outputs) if isinstance(t, torch.Tensor) and t.numel() > 1]
        if results:
            # A None (no storage to watch) counts as alive.
            self._returned.append((record, [(internals.storage_ref(t), resident_bytes(t)) for t in results]))
        if self._watch_results:
            self._results.extend(
                _non_scalar_refs(t for t in internals.tree_leaves(outputs) if isinstance(t, torch.Tensor))
            )

    def results_alive(self) -> bool:
        """Whether a result of the open step's graphs that needs a gradient (not a scalar) is alive, after a
        garbage collection (a reference cycle holds nothing for the step).  Asked by a step that holds
        none of them itself (``ckptc.capture``'s, once its backward ran): one alive then is held by the
        model (a forward hook storing a layer's output in an attribute; Dynamo returns it from the graph
        beside the call's results).  Needs ``watch_results``."""
        if not any(ref() is not None for ref in self._results):
            return False
        gc.collect()
        return any(ref() is not None for ref in self._results)

    def held_through_backward(self, ran: Sequence[GraphRecord]) -> dict[int, int]:
        """By position in ``ran`` (the runs of one call's graphs, in run order): the bytes of that run's results
        still alive as the open step's backward ends, which the caller (or the model) held through it.  A
        storage two results share is counted once."""
        held: dict[int, int] = {}
        seen: set[int] = set()
        position = 0
        for record, refs in self._returned:
            later = next((k for k in range(position, len(ran)) if ran[k] is record), None)
            if later is None:
                continue  # another compiler's graph
            position = later + 1
            for ref, nbytes in refs:
                if ref is not None and not ref.expired() and ref.cdata not in seen:
                    seen.add(ref.cdata)
                    held[later] = held.get(later, 0) + nbytes
        return held

    def results_beside(
        self, index: int, inputs: Sequence[Any], records: Sequence[GraphRecord]
    ) -> list[tuple[GraphRecord, int, int]]:
        """``(earlier, index, dead)`` for each graph of ``records`` (one compiler's) that ran before graph
        ``index`` in the open step, as graph ``index`` starts on ``inputs``: how many of its runs have
        their results dead beside it."""
        taken = self._note_inputs(inputs)
        mine = {id(r) for r in records}
        if any(r.index == index and id(r) in mine for r, _ in self._returned):
            return []  # planned again after it ran in this step: the graphs after it are not before it

        def alive(ref: Any) -> bool:
            return ref is None or (not ref.expired() and ref.cdata not in taken)

        verdicts: dict[int, tuple[GraphRecord, int, int]] = {}
        for earlier, refs in self._returned:
            if id(earlier) not in mine or earlier.index == index:
                continue  # another compiler's graph, or another run of its own (StepAccount.repeat_runs)
            alive_run = any(alive(ref) for ref, _ in refs)
            dead = verdicts[id(earlier)][2] if id(earlier) in verdicts else 0
            verdicts[id(earlier)] = (earlier, index, dead + (not alive_run))
        return list(verdicts.values())

    def _note_inputs(self, inputs: Sequence[Any]) -> set[int]:
        """The storages of a graph's tensor inputs other than parameters (never a graph's results, and
        counted apart), noted among the open step's graphs' inputs."""
        refs = _storage_refs(a for a in inputs if not isinstance(a, torch.nn.Parameter))
        self._inputs = _alive(self._inputs, lambda ref: ref)
        self._inputs.update(refs)
        return set(refs)


def _storages(tensors: Iterable[Any]) -> set[int]:
    """The storages (``StorageWeakRef.cdata``) behind the tensors among ``tensors``."""
    return set(_storage_refs(tensors))


def _storage_refs(tensors: Iterable[Any]) -> dict[int, Any]:
    """Weak references to the storages behind the tensors among ``tensors``, by ``cdata``."""
    return {r.cdata: r for t in tensors if isinstance(t, torch.Tensor) and (r := internals.storage_ref(t)) is not None}


def _alive(entries: dict[int, V], ref_of: Callable[[V], Any]) -> dict[int, V]:
    """``entries`` (by storage ``cdata``) without those whose storage was freed: its address can name
    a new storage now."""
    return {cdata: entry for cdata, entry in entries.items() if not ref_of(entry).expired()}


class StepTracker:
    """One owner's steps (see the module docstring).

    Args:
        on_end: called as ``on_end(measured, measurement)`` when a step ends: ``measured`` is True when
            a backward ended it and nothing disturbed its measurement; ``measurement`` is the step's
            measured peak when it was measured (else None).
        on_second_backward: called once when a second backward of the last step runs after it ended.

    Attributes:
        open: whether a step is open.
        results_held: when a backward ended the last step, whether a result of it other than a
            scalar was still alive (the caller holds it through backward); None when no backward
            ended it.
    """

    def __init__(
        self,
        on_end: Callable[[bool, MemoryMeasurement | None], None],
        on_second_backward: Callable[[], None],
    ) -> None:
        self.open = False
        self._on_end = on_end
        self._on_second_backward = on_second_backward
        self._meter: StepMeter | None = None
        self._handles: list[Any] = []  # backward-end hooks on the step's results
        self._graphs: list[weakref.ref] = []  # the results' autograd nodes (or the results, for leaves)
        self._non_scalar: list[weakref.ref] = []  # results other than a loss
        self.results_held: bool | None = None
        self._held_after_collection = False  # a step's results were alive even after a garbage collection
        self._end_scheduled = False  # the step ends on the first Python event after backward returns
        self._ended_backward: int | None = None  # the autograd graph task that ended the last step
        self._meter_stopped = False  # a meter of the open step stopped before its end: none starts again
        self._backward_running = False  # a backward reaching the open step's results began and has not ended
        self._backward_differentiable = False  # that backward runs with create_graph=True
        self._meter_to_stop: StepMeter | None = None  # one a backward ended under a Python profiler

    def __repr__(self) -> str:
        return f"StepTracker(open={self.open}, measuring={self.measuring})"

    @property
    def measuring(self) -> bool:
        return self._meter is not None

    def begin(self) -> None:
        """Open a step (the last one's hooks go: a backward from now on belongs to this step)."""
        self._forget_hooks()
        self._backward_running = False
        self._graphs = []
        self._non_scalar = []
        self.results_held = None
        self._meter_stopped = False
        if self._meter_to_stop is not None:
            self._meter_to_stop.abort()
            self._meter_to_stop = None
            self._meter_stopped = True  # stopped inside this call: no meter starts again in it
        self.open = True
        others = [tracker for tracker in _OPEN_STEPS if tracker is not self and tracker.open]
        _OPEN_STEPS.add(self)
        if others:
            self._overlaps_another_model(others)

    def _overlaps_another_model(self, others: list[StepTracker]) -> None:
        """Steps of two optimized models are open at once (one backward for both): a meter measures
        the whole device, so each model's would count the other's memory (a budget breach, a
        correction, a refusal that is not this model's).  Neither step is measured; say why, once."""
        for tracker in (self, *others):
            tracker.unmeasured()
            tracker._meter_stopped = True
        warn_once(
            self,
            "overlapping-steps",
            "ckptc: this model's training step ran while a step of another model optimized by ckptc was open "
            "(two optimized models before one backward: a generator and a discriminator, two towers of one "
            "loss). A step's peak is measured over the whole device, so each model's measurement would count "
            "the other's memory: neither step is verified against its budget. What to do: put both models in "
            "one nn.Module whose forward runs them, and optimize that with one budget for the step.",
        )

    def measure(self, device: torch.device, baseline_bytes: int) -> None:
        """Measure the open step from now on, ``baseline_bytes`` resident from its start; not a step
        whose meter stopped before (see the module docstring), nor one under a Python profiler."""
        if self._meter_stopped:
            return
        if torch.device(device).type == "cpu" and sys.getprofile() is not None:
            self._under_python_profiler()
            return
        self._meter = StepMeter(device, baseline_bytes).start()

    def _under_python_profiler(self) -> None:
        warn_once(
            self,
            "python-profiler",
            "ckptc cannot verify a step's peak memory while a Python profiler hooked in with sys.setprofile "
            "(cProfile, a tracer) runs: its CPU meter stops on the first Python event after backward returns, "
            "through that hook. The step runs on the predicted plan; verification resumes on a step run "
            "without it.",
        )

    def add_baseline(self, nbytes: int) -> None:
        """Bytes resident from the step's start that the baseline did not hold yet."""
        if self._meter is not None:
            self._meter.add_baseline(nbytes)

    def add_baseline_unless_allocated(self, storages: Sequence[tuple[int, int]]) -> None:
        """Storages, as ``(address, nbytes)``, that joined the step and may have been resident from its
        start (:meth:`ckptc.meter.StepMeter.add_baseline_unless_allocated`)."""
        if self._meter is not None and storages:
            self._meter.add_baseline_unless_allocated(storages)

    def unmeasured(self) -> None:
        """Something plans during the step (and profiles ops): the step is not measured."""
        if self._meter is not None:
            self._meter.abort()
            self._meter = None
            self._meter_stopped = True

    def results_of_a_graph(self, tensors: Sequence[torch.Tensor]) -> None:
        """A graph of the open step returned ``tensors``: one still alive when backward ends is held
        through it, by the caller or by the model (a forward hook storing a layer's output in an
        attribute: Dynamo returns it from the graph beside the call's results)."""
        self._non_scalar.extend(_non_scalar_refs(tensors))

    def returned(self, tensors: Sequence[torch.Tensor]) -> None:
        """A call (or graph) of the open step returned ``tensors``, the results that need a gradient:
        the backward that reaches them ends the step.  With none, and none before in the step, no
        backward will come (an inference call): the step ends now, unmeasured."""
        if tensors:
            died = internals.outside_user_compile(self._graph_died)  # a graph may die inside a compiled step
            self._graphs.extend(_graph_ref(t, died) for t in tensors)
            self._non_scalar.extend(_non_scalar_refs(tensors))
            self._handles.append(internals.on_backward_end(list(tensors), self._backward_ended, self._backward_began))
        elif not self._handles:
            self.end(measured=False)

    def results_died(self) -> bool:
        """The open step's autograd graph died without a backward (a forward whose loss was dropped)."""
        return self.open and bool(self._graphs) and all(ref() is None for ref in self._graphs)

    def _graph_died(self, _: weakref.ref) -> None:
        """Part of the open step's graph died: if all did and no backward runs, the step ends, unmeasured."""
        if self.results_died() and internals.current_graph_task_id() < 0:
            self.end(measured=False)

    def abort(self) -> None:
        """Forget the step in progress (its call failed)."""
        self.unmeasured()
        self.end(measured=False)

    def backward_failed(self) -> None:
        """The open step's backward raised (a kernel failed): it ends unmeasured, its meter stopped on the
        first Python event after the engine returns (not inside it: module docstring), so no profiler
        of ckptc's outlives the failed step."""
        if not self.open or self._end_scheduled:
            return
        self._end_after_engine(self.abort)

    def end(self, *, measured: bool) -> None:
        """End the open step (``measured``: its measurement, if any, stands)."""
        if not self.open:
            return
        self.open = False
        _OPEN_STEPS.discard(self)
        self._end_scheduled = False
        if self._ended_backward is None:  # not ended by a backward: nothing more can reach it
            self._forget_hooks()
        self._graphs = []
        self._non_scalar = []
        meter, self._meter = self._meter, None
        measurement = meter.stop() if meter is not None else None
        self._on_end(measured, measurement if measured else None)

    def _backward_began(self) -> None:
        self._backward_running = self.open
        self._backward_differentiable = self.open and torch.is_grad_enabled()  # the engine's create_graph

    def backward_raised(self) -> bool:
        """Whether the open step's backward began and never ended, seen from outside any backward (the
        next call): it raised somewhere (eager code's own backward, say), and the step is over."""
        return self.open and self._backward_running and internals.current_graph_task_id() < 0

    def _backward_ended(self) -> None:
        self._backward_running = False
        task = internals.current_graph_task_id()
        if not self.open:
            if self._ended_backward is not None and task != self._ended_backward:
                self._ended_backward = None  # once per step
                self._on_second_backward()
            return  # otherwise a second call's results reach the same backward: one end per step
        if self._end_scheduled:
            return
        self._ended_backward = task
        if self._backward_differentiable:
            # A gradient penalty's autograd.grad(create_graph=True): torch.compile's graphs have no double
            # backward (torch raises at the next backward), so this is no step the budget plans for, and
            # what it measured (the gradients' own autograd graph) is not counted against later steps.
            warn_once(
                self,
                "differentiable-backward",
                "ckptc does not verify a step whose backward builds a graph of the gradients "
                "(autograd.grad(..., create_graph=True), backward(create_graph=True)): the budget plans the "
                "step's forward and first-order backward, not what that graph keeps, so such a step is not "
                "measured and its peak can exceed the budget (a gradient-norm penalty on an MLP measured 1.26x "
                "it); and a backward through that graph of the gradients that reaches ckptc's graphs (a "
                "gradient penalty's) raises PyTorch's RuntimeError \"does not currently support double "
                'backward", as under plain torch.compile. What to do: leave headroom for it in the budget, or '
                "compute the penalty without create_graph=True (or on a copy of the model without ckptc).",
            )
            self._end_after_engine(self.abort)
            return
        self.results_held = self._results_alive()
        if not self._end_after_engine(self._end_scheduled_step):
            self._under_python_profiler()  # not disturbed, and the step is not verified

    def _end_after_engine(self, end: Callable[[], None]) -> bool:
        """End the open step by ``end`` from inside the autograd engine: at once without a CPU meter, else
        on the first Python event after the engine returns (a meter cannot stop inside the engine's
        callback: module docstring).  False where a Python profiler hooked in and that event never comes:
        the step ends now, unmeasured, and the next step stops its meter."""
        if self._meter is None or self._meter.device.type != "cpu":
            end()
        elif after_backward_returns(end):
            self._end_scheduled = True
        else:
            self._meter_to_stop, self._meter = self._meter, None
            self.end(measured=False)
            return False
        return True

    def _results_alive(self) -> bool:
        """Whether the step's results other than a loss are alive as its backward ends (the caller holds
        them).  Results only a reference cycle keeps (an exception's frames, a model's own cycles) are
        not the caller's: a garbage collection frees them, until a step shows results held after one
        (then the caller does hold them, and no step collects again)."""
        alive = any(ref() is not None for ref in self._non_scalar)
        if alive and not self._held_after_collection:
            gc.collect()
            alive = self._held_after_collection = any(ref() is not None for ref in self._non_scalar)
        return alive

    def _end_scheduled_step(self) -> None:
        self.end(measured=True)

    def _forget_hooks(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []
        self._ended_backward = None


# Trackers with a step open, of every optimized model of the process (StepTracker._overlaps_another_model).
_OPEN_STEPS: weakref.WeakSet[StepTracker] = weakref.WeakSet()


class _GraphAlive:
    """Kept in a C++ autograd node's ``metadata``: it dies with the node (which takes no weak reference)."""


def _graph_ref(tensor: torch.Tensor, callback: Callable[[weakref.ref], None]) -> weakref.ref:
    """A weak reference that dies with ``tensor``'s autograd graph: to its node (a compiled graph's is a
    Python object), or to a marker the node holds (a node made in C++, as the results of code run
    eagerly after a graph break; the result itself may die long before its graph, ``sum(losses)``);
    to ``tensor`` itself for a leaf."""
    node = tensor.grad_fn
    if node is None:
        return weakref.ref(tensor, callback)
    try:
        return weakref.ref(node, callback)
    except TypeError:
        return weakref.ref(node.metadata.setdefault("ckptc.graph_alive", _GraphAlive()), callback)


def _non_scalar_refs(tensors: Iterable[torch.Tensor]) -> list[weakref.ref]:
    """Weak references to the results among ``tensors`` whose being held matters: those that need a
    gradient, other than scalars (a loss the caller holds while calling backward on it)."""
    return [weakref.ref(t) for t in tensors if t.requires_grad and t.numel() > 1]
