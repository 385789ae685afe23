"""An exact memory meter for one training step, independent of any plan.

On CPU it reads the allocator's own events from ``torch.profiler``
(``profile_memory=True``): every allocation and free in order, including
scratch memory inside ops (oneDNN convolutions, matmul packing).  On CUDA and
other accelerators it reads the caching allocator's peak counters.  Memory
that was already allocated when the step began (parameters, buffers, inputs)
is not seen by the allocator events, so the caller passes it in as
``baseline_bytes``; :func:`resident_bytes` computes it from the tensors.

Warm up one step before measuring: the first call of a compiled model also
compiles and plans.
"""

from __future__ import annotations

import atexit
import bisect
import contextlib
import logging
import os
import sys
import weakref
from dataclasses import dataclass, field
from typing import Any, Callable, Hashable, Iterable, Iterator, Mapping, Sequence

import torch

from ckptc._torch_internals import (
    clear_cublas_workspaces,
    cpu_allocations,
    local_shard,
    outside_fake_mode,
    outside_user_compile,
    profiler_step_count,
    restore_profiler_step_count,
    storage_key,
    strided_parts,
)
from ckptc.pricing.devices import memory_model

log = logging.getLogger("ckptc.meter")

#: Marks ckptc's compiled graphs put in a measured step (:func:`ckptc._torch_internals.profiler_mark`):
#: where a graph's forward starts and returns, and where a graph's backward starts.
GRAPH_STARTS = "ckptc::graph_starts"
FORWARD_RETURNED = "ckptc::forward_returned"
BACKWARD_STARTS = "ckptc::backward_starts"


#: Measured steps within the budget after which a plan counts as verified, by device type (others: the
#: default).  A CPU step allocates the same blocks every time, and measuring it profiles every op.  An
#: accelerator's caching allocator serves a step from what the steps before it left in its cache (a cached
#: block is not split when at most 1 MiB would remain, so it counts more than the request), and its peak
#: counters cost nothing to read: on an H200 the first step after planning measured up to 5 MiB below the
#: third (``bench/results/gpu.md``), so the first three steps are measured.
STEPS_TO_VERIFY = {"cpu": 1}
DEFAULT_STEPS_TO_VERIFY = 3


def steps_to_verify(device: torch.device) -> int:
    """How many measured steps within the budget verify a plan on ``device`` (:data:`STEPS_TO_VERIFY`)."""
    return STEPS_TO_VERIFY.get(device.type, DEFAULT_STEPS_TO_VERIFY)


@dataclass(frozen=True)
class MemoryMeasurement:
    """Peak memory of one measured call.

    Attributes:
        peak_bytes: ``baseline_bytes`` plus the highest allocation level reached.
        baseline_bytes: memory resident when the call began.
        end_bytes: ``baseline_bytes`` plus what was still allocated at the end.
        timeline: allocation level after each allocator event (CPU only).
        loss_bytes: between the last graph's forward returning and the first graph's backward
            starting (where the caller computes the loss and runs its backward), the most the step
            held above what it held when that forward returned; None without those marks (CPU only).
        peak_in_loss: whether the step's peak was reached there.
        eager_after: by graph index, between that graph's forward returning and the next graph
            starting (eager code between graphs: a graph break's), the most the step held above what
            it held when that forward returned (the largest over its runs; CPU only).
        peak_after: the graph after whose forward the step's peak was reached, there (None: elsewhere).
    """

    peak_bytes: int
    baseline_bytes: int
    end_bytes: int
    timeline: tuple[int, ...] = field(default=(), repr=False)
    loss_bytes: int | None = None
    peak_in_loss: bool = False
    eager_after: Mapping[int, int] = field(default_factory=dict)
    peak_after: int | None = None


def resident_bytes(*objects: Any, seen: set[Hashable] | None = None) -> int:
    """Bytes the device's allocator counts for the distinct storages behind tensors, modules' parameters
    and buffers (on CUDA whole blocks: :mod:`ckptc.pricing.devices`).

    Tensors sharing a storage (tied weights, views) are counted once; gradients
    already present on a module's parameters are included; a ``DTensor`` (FSDP2)
    counts its local shard.  ``seen`` (storage keys) carries the storages already
    counted across calls: those are skipped, and those counted are added to it.
    """
    return sum(_allocated(t) for t in _new_storages(_tensors(objects), set() if seen is None else seen))


def allocated_bytes(tensor: torch.Tensor) -> int:
    """Bytes the device's allocator counts for a new tensor of ``tensor``'s size on this rank (its
    gradient, say): its local shard's bytes, on CUDA as a whole block."""
    local = local_shard(tensor)
    return memory_model(tensor.device).storage_bytes(local.numel() * local.element_size())


def gradient_of(tensor: torch.Tensor) -> torch.Tensor | None:
    """``tensor``'s allocated gradient: its ``.grad`` where autograd keeps one (a leaf, or a tensor that
    retains its gradient), else None.  Reading a non-leaf's ``.grad`` warns, and a model's parameters can
    be non-leaf tensors while it runs (``torch.func.functional_call`` with weights computed from others)."""
    return tensor.grad if tensor.is_leaf or tensor.retains_grad else None


def resident_storages(tensors: Iterable[torch.Tensor], seen: set[Hashable]) -> list[tuple[int, int]]:
    """``(address, bytes)`` of the distinct storages behind ``tensors`` (real ones) not in ``seen``
    (storage keys, added to it), counted as :func:`resident_bytes` counts them."""
    return [(t.untyped_storage().data_ptr(), _allocated(t)) for t in _new_storages(tensors, seen)]


def _allocated(tensor: torch.Tensor) -> int:
    """What the allocator counts for ``tensor``'s storage (a fake CUDA tensor's too: its storage is on meta)."""
    return memory_model(tensor.device).storage_bytes(tensor.untyped_storage().nbytes())


def _new_storages(tensors: Iterable[torch.Tensor], seen: set[Hashable]) -> Iterator[torch.Tensor]:
    """One tensor (this rank's shard) per distinct storage behind ``tensors`` not in ``seen``."""
    for tensor in tensors:
        tensor = local_shard(tensor)  # a sharded parameter holds only its shard on this rank
        if tensor.is_meta:
            continue
        ref = storage_key(tensor)
        if ref not in seen:
            seen.add(ref)
            yield tensor


def _tensors(objects: Iterable[Any]) -> Iterable[torch.Tensor]:
    for obj in objects:
        if isinstance(obj, torch.nn.Module):
            for p in obj.parameters():
                yield p
                if (grad := gradient_of(p)) is not None:
                    yield from strided_parts(grad)  # a sparse embedding's gradient is sparse
            yield from obj.buffers()
        elif isinstance(obj, torch.Tensor):
            yield from strided_parts(obj)
        elif isinstance(obj, dict):
            yield from _tensors(obj.values())
        elif isinstance(obj, (list, tuple)):
            yield from _tensors(obj)


def measure_peak(
    fn: Callable[[], Any], *, baseline_bytes: int = 0, device: torch.device | str = "cpu"
) -> tuple[Any, MemoryMeasurement]:
    """Run ``fn()`` once and measure the peak memory on ``device``.

    Returns ``fn``'s result and the measurement.  The result is kept alive
    until the end of the measurement, as a training step keeps its loss.
    """
    device = torch.device(device)
    if device.type == "cpu":
        return _measure_cpu(fn, baseline_bytes)
    return _measure_accelerator(fn, baseline_bytes, device)


def _measure_cpu(fn: Callable[[], Any], baseline_bytes: int) -> tuple[Any, MemoryMeasurement]:
    # A StepMeter is quiet only while its session starts and stops: what ``fn`` prints to stderr (a
    # warning, ckptc's among them) stays the caller's.
    meter = StepMeter("cpu", baseline_bytes).start()
    try:
        result = fn()
    except BaseException:
        meter.abort()
        raise
    return result, meter.stop()


class StepMeter:
    """Measure the peak of a span that does not fit in one function call.

    :func:`measure_peak` measures ``fn()``; a training step begins in one
    call (the first forward) and ends in another (a callback when backward
    ends), so this meter is started and stopped explicitly.  Same method: on
    CPU the allocator's events from ``torch.profiler`` (which must not already
    be running), on accelerators the allocator's peak counter.
    """

    def __init__(self, device: torch.device | str, baseline_bytes: int) -> None:
        self.device = torch.device(device)
        self.baseline_bytes = baseline_bytes
        self._profile: Any = None
        self._start = 0
        self._maybe_resident: list[tuple[int, int]] = []  # see add_baseline_unless_allocated

    def start(self) -> "StepMeter":
        if self.device.type == "cpu":
            from torch.profiler import ProfilerActivity, profile

            _running.add(self)

            # Quiet only while it starts and stops: stderr stays the caller's during the step (an error raised
            # in it, with the meter still running, is printed).
            made_before = torch.empty(1)
            with quiet_profiler():
                self._profile = profile(activities=[ProfilerActivity.CPU], profile_memory=True)
                self._profile.__enter__()
                # PyTorch's C++ allocator logs the first free of a block made before a memory profiler
                # started ("Memory block of unknown size ..."), then every 1000th: the first is this one.
                del made_before
        else:
            self._start, workspaces = _start_accelerator_span(self.device)
            self.baseline_bytes += workspaces
        return self

    def add_baseline(self, nbytes: int) -> None:
        """Memory that existed before the span but joined it later (a second call's inputs)."""
        self.baseline_bytes += nbytes

    def add_baseline_unless_allocated(self, storages: Sequence[tuple[int, int]]) -> None:
        """Memory that joined the span later and may have existed before it, as ``(address, nbytes)``
        of storages: a later graph's leaf inputs are a second call's inputs, made before the step, or
        a mask made between two graphs.  On the CPU the allocator's events tell them apart at
        :meth:`stop` (a storage allocated in the span is in its events already); an accelerator's
        peak counter cannot, so they all count (never less than the step held)."""
        if self.device.type == "cpu":
            self._maybe_resident.extend(storages)
        else:
            self.baseline_bytes += sum(nbytes for _, nbytes in storages)

    def stop(self) -> MemoryMeasurement:
        if self.device.type != "cpu":
            module = torch.get_device_module(self.device.type)
            module.synchronize(self.device)
            peak = module.max_memory_allocated(self.device) - self._start
            end = module.memory_allocated(self.device) - self._start
            return MemoryMeasurement(self.baseline_bytes + peak, self.baseline_bytes, self.baseline_bytes + end)
        with quiet_profiler():
            self._profile.__exit__(None, None, None)
        _running.discard(self)
        allocations, marks = cpu_allocations(
            self._profile, frozenset({GRAPH_STARTS, FORWARD_RETURNED, BACKWARD_STARTS})
        )
        allocated = {address for _, address, nbytes in allocations if nbytes > 0}
        self.baseline_bytes += sum(nbytes for address, nbytes in self._maybe_resident if address not in allocated)
        peak, level, timeline = _peak_of_events(allocations)
        regions = _eager_regions(marks, [time for time, _, _ in allocations], timeline, peak)
        return MemoryMeasurement(
            peak_bytes=self.baseline_bytes + peak,
            baseline_bytes=self.baseline_bytes,
            end_bytes=self.baseline_bytes + level,
            timeline=timeline,
            loss_bytes=regions.loss_bytes,
            peak_in_loss=regions.peak_in_loss,
            eager_after=regions.after,
            peak_after=regions.peak_after,
        )

    def abort(self) -> None:
        """Stop without a result (the step failed)."""
        if self.device.type == "cpu" and self._profile is not None:
            with quiet_profiler():
                self._profile.__exit__(None, None, None)
            self._profile = None
        _running.discard(self)


# CPU meters started and not yet stopped: a step whose backward never came (the caller's loss raised on
# the first step and the script ended) leaves one running, and a profiler still enabled when the
# interpreter shuts down crashed it (exit 139, after the caller's traceback).
_running: weakref.WeakSet[StepMeter] = weakref.WeakSet()


def _abort_running() -> None:
    for meter in list(_running):
        meter.abort()


atexit.register(_abort_running)


def _peak_of_events(allocations: list[tuple[int, int, int]]) -> tuple[int, int, tuple[int, ...]]:
    """The highest and the final level of what a run allocated (its allocator's events,
    :func:`ckptc._torch_internals.cpu_allocations`), and the level after each event.

    A free counts only when the run allocated that block: the allocator reports
    no free of a block allocated before profiling began, and a stale size for an
    address an earlier profiler session saw (which would make the level, and the
    peak, too low).  Memory resident before the run is the caller's baseline.
    """
    live: dict[int, int] = {}
    level = peak = 0
    timeline = []
    for _, address, nbytes in allocations:
        if nbytes > 0:
            live[address] = live.get(address, 0) + nbytes
        else:
            nbytes = -live.pop(address, 0)
        level += nbytes
        peak = max(peak, level)
        timeline.append(level)
    return peak, level, tuple(timeline)


@dataclass
class _Regions:
    loss_bytes: int | None = None
    peak_in_loss: bool = False
    after: dict[int, int] = field(default_factory=dict)
    peak_after: int | None = None


def _eager_regions(marks: list[tuple[int, str]], times: list[int], timeline: tuple[int, ...], peak: int) -> _Regions:
    """From the level after each allocator event (``timeline``) at its time (``times``) and the marks
    the graphs put in the step (``marks``, ``(time, name)``): what the step held above the level at
    each graph's :data:`FORWARD_RETURNED` mark (``name:index``) up to the next :data:`GRAPH_STARTS`
    mark (eager code between graphs, by graph index), and up to the first :data:`BACKWARD_STARTS` mark
    after the last one (the caller's loss), and where ``peak`` was reached among them."""
    regions = _Regions()
    end = next((t for t, name in marks if name == BACKWARD_STARTS), None)
    if end is None:
        return regions
    starts = [t for t, name in marks if name == GRAPH_STARTS]
    returned = [(t, name) for t, name in marks if name.startswith(FORWARD_RETURNED) and t < end]
    for k, (begin, name) in enumerate(returned):
        following = bisect.bisect_right(starts, begin)
        stop = starts[following] if following < len(starts) and starts[following] < end else end
        first, last = bisect.bisect_right(times, begin), bisect.bisect_right(times, stop)
        at_return = timeline[first - 1] if first > 0 else 0
        highest = max(timeline[first:last], default=at_return)
        reached = last > first and highest == peak
        if stop == end:
            if k == len(returned) - 1:  # the caller's loss, after the last graph's forward
                regions.loss_bytes, regions.peak_in_loss = highest - at_return, reached
            continue
        index = int(name[len(FORWARD_RETURNED) + 1 :])
        regions.after[index] = max(regions.after.get(index, 0), highest - at_return)
        if reached:
            regions.peak_after = index
    return regions


def _start_accelerator_span(device: torch.device) -> tuple[int, int]:
    """Begin measuring on an accelerator.  Returns the allocated level at the start, and the bytes of the
    matrix-product workspaces resident from the start, which the step's account counts for the whole step
    (:mod:`ckptc.pricing.devices`) and the baseline of resident tensors does not.

    cuBLAS keeps a workspace per thread that ran a product (the caller's, autograd's), allocated through the
    caching allocator at its first product and held for good.  Subtracted as memory from before the span,
    they made the check read 35-67 MB low on an H200 (a step over its budget read as within it); counted only
    where the span allocates them again, a peak reached before backward's first product missed autograd's.
    So they are given back and allocated again here, on both threads, and their bytes measured."""
    module = torch.get_device_module(device.type)
    module.synchronize(device)
    workspaces = 0
    if device.type == "cuda":
        clear_cublas_workspaces()
        before = module.memory_allocated(device)
        _allocate_matmul_workspaces(device)
        module.synchronize(device)
        workspaces = max(0, module.memory_allocated(device) - before)
    module.reset_peak_memory_stats(device)
    return module.memory_allocated(device), workspaces


class _ProductsOnBothThreads(torch.autograd.Function):
    """Matrix products in forward (the caller's thread) and backward (autograd's device thread), through
    cuBLAS (``mm``) and cuBLASLt (``addmm`` with a bias), as a training step runs them: each thread's
    workspaces are allocated."""

    @staticmethod
    def forward(ctx: Any, bias: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(bias, a, b)
        return torch.addmm(bias, a, b) + a @ b

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        bias, a, b = ctx.saved_tensors
        grad = grad + torch.addmm(bias, a, b)  # a forward product recomputed in backward, as plans do
        return grad.sum(0), grad @ b.t(), a.t() @ grad


def _allocate_matmul_workspaces(device: torch.device) -> None:
    # Outside the caller's dispatch modes: an op observer must not see these products as the step's.
    with outside_fake_mode(), torch.enable_grad():
        bias = torch.ones(16, device=device, requires_grad=True)
        a = torch.ones(16, 16, device=device, requires_grad=True)
        b = torch.ones(16, 16, device=device, requires_grad=True)
        torch.autograd.grad(_ProductsOnBothThreads.apply(bias, a, b).sum(), (bias, a, b))


def _measure_accelerator(
    fn: Callable[[], Any], baseline_bytes: int, device: torch.device
) -> tuple[Any, MemoryMeasurement]:
    module = torch.get_device_module(device.type)
    start, workspaces = _start_accelerator_span(device)
    baseline_bytes += workspaces
    result = fn()
    module.synchronize(device)
    peak = module.max_memory_allocated(device) - start
    end = module.memory_allocated(device) - start
    return result, MemoryMeasurement(baseline_bytes + peak, baseline_bytes, baseline_bytes + end)


def after_backward_returns(callback: Callable[[], None]) -> bool:
    """Call ``callback()`` on the first Python event after the autograd engine's ``run_backward`` returns.

    A CPU meter cannot be stopped in a callback the engine runs when backward ends: the engine runs
    it under the thread-local state captured when backward began and restores that state afterwards,
    so a profiler stopped there comes back as a stale "enabled" profiler.  Returns False (and does
    nothing) when another ``sys.setprofile`` hook is set: it is not disturbed.
    """
    if sys.getprofile() is not None:
        return False

    ended = outside_user_compile(callback)  # not the hook itself: it sees every call while backward runs

    def hook(frame: Any, event: str, arg: Any) -> None:
        if event == "return" and frame.f_code.co_name == "_engine_run_backward":
            sys.setprofile(None)
            ended()

    sys.setprofile(hook)
    return True


@contextlib.contextmanager
def quiet_profiler():
    """Where a profiler session of ckptc's own is made, started or stopped: Kineto prints start/stop lines
    on stderr, kept out of users' output, and every ``torch.profiler.profile`` registers its step count
    under one name and erases it at its exit, so the count of the caller's open profiler is put back
    (:func:`~ckptc._torch_internals.profiler_step_count`, which tells that one is open)."""
    count = profiler_step_count()
    try:
        stderr_fd = os.dup(2)
    except OSError:
        try:
            yield
        finally:
            restore_profiler_step_count(count)
        return
    with open(os.devnull, "w") as devnull:
        os.dup2(devnull.fileno(), 2)
        try:
            yield
        finally:
            os.dup2(stderr_fd, 2)
            os.close(stderr_fd)
            restore_profiler_step_count(count)


def training_step(
    model: torch.nn.Module, loss_fn: Callable[[Any], torch.Tensor], *args: Any, **kwargs: Any
) -> Callable[[], torch.Tensor]:
    """A closure running one forward+backward step from zeroed (``None``) gradients."""

    def step() -> torch.Tensor:
        loss = loss_fn(model(*args, **kwargs))
        loss.backward()
        return loss.detach()

    return step
