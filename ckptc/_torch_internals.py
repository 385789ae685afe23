"""The one home of every private PyTorch API that ckptc uses.

A torch upgrade that moves or renames one of these touches this file only.
Everything here is a thin alias or adapter: no ckptc logic lives here.
"""

from __future__ import annotations

import contextlib
import contextvars
import gc
import logging
import os
import traceback
import weakref
from typing import Any, Callable, Hashable, Iterable, Iterator, Mapping, Sequence

import torch
import torch.fx as fx
import torch.utils._pytree as _pytree

# Joint-graph capture and the AOTAutograd runtime (autograd.Function wrapper,
# input mutations, aliasing, boxed calling convention).
from torch._dynamo.backends.common import aot_autograd as _aot_autograd
from torch._functorch.aot_autograd import make_boxed_func
from torch._functorch.partitioners import _extract_fwd_bwd_modules
from torch.fx._lazy_graph_module import _LazyGraphModule, _make_graph_module, _use_lazy_graph_module
from torch.fx.graph import _BoxedCodeGen
from torch.multiprocessing.reductions import StorageWeakRef as _StorageWeakRef

__all__ = [
    "aot_backend",
    "boxed",
    "mark_boxed",
    "share_registries",
    "split_joint_graph",
    "reset_dynamo",
    "dynamo_explain",
    "inductor_compile",
    "is_tangent",
    "is_primal",
    "BackendCompilerFailed",
    "DynamoError",
    "compile_config",
    "outside_fake_mode",
    "is_op_overload",
    "op_name",
    "op_schema_name",
    "is_mutable_op",
    "is_random_op",
    "is_pointwise_op",
    "is_reduction_op",
    "tree_leaves",
    "tree_map",
    "version_counter",
    "storage_key",
    "profiler_events",
    "cpu_allocations",
    "clear_cublas_workspaces",
    "record_cuda_memory_history",
    "called_weakly",
    "cuda_memory_snapshot",
    "profiler_mark",
    "made_by_compiled_graph",
    "current_graph_task_id",
    "has_gradient_hooks",
    "module_hooks",
    "running_gradient_accumulator",
    "backward_accumulates",
    "workaround_decompositions",
    "upper_bound",
    "binds_unbacked_symbols",
    "graph_break_reasons",
    "observe_ops",
    "mark_dynamic",
    "is_dynamic_shape_conflict",
    "unmark_dynamic",
    "graph_break_after",
    "saves_tensors_only",
    "graph_module",
    "donate_no_saved_tensors",
    "tensors_held_for_backward",
    "callers_saved_tensor_hooks",
    "inside_checkpoint_region",
    "trainable_leaf_or_view",
    "pass_missing_grads_as_none",
    "fake_tensor_mode",
    "is_fake",
    "is_storeless",
]


# Ops, pytrees, storages and profiler events: small named wrappers so the rest
# of ckptc never spells a private module or attribute.


def is_op_overload(target: Any) -> bool:
    """True if ``target`` is an aten (or custom) op overload such as ``aten.mm.default``."""
    return isinstance(target, torch._ops.OpOverload)


def op_name(target: Any) -> str:
    """The short op name of an overload (``"mm"`` for ``aten.mm.default``), else the callable's name."""
    if is_op_overload(target):
        return target._opname
    return getattr(target, "__name__", str(target))


def is_view_op(target: Any) -> bool:
    """True if ``target`` is an op overload whose output views its input (``view``, ``expand``...)."""
    return is_op_overload(target) and bool(target.is_view)


def op_schema_name(target: Any) -> str | None:
    """The schema's qualified name (``"aten::alias"``) of an op overload; ``None`` for anything else."""
    return target._schema.name if is_op_overload(target) else None


def is_mutable_op(target: Any) -> bool:
    """True if ``target`` is an op overload that writes to one of its arguments (``copy_``, ``add_``)."""
    return is_op_overload(target) and target._schema.is_mutable


def is_random_op(target: Any) -> bool:
    """True if ``target`` is an op overload that draws from a random number generator (dropout, rand)."""
    return is_op_overload(target) and torch.Tag.nondeterministic_seeded in target.tags


def is_pointwise_op(target: Any) -> bool:
    """True if ``target`` is an op overload computed element by element (``add``, ``gelu``, ``where``):
    the ops Inductor fuses into the kernels of their consumers."""
    return is_op_overload(target) and torch.Tag.pointwise in target.tags


def is_reduction_op(target: Any) -> bool:
    """True if ``target`` is an op overload that reduces over dimensions (``sum``, ``amax``, ``var_mean``)."""
    return is_op_overload(target) and torch.Tag.reduction in target.tags


def tree_leaves(tree: Any, is_leaf: Callable[[Any], bool] | None = None) -> list[Any]:
    """The leaves of a nested structure of tuples, lists and dicts, in order."""
    return _pytree.tree_leaves(tree, is_leaf=is_leaf)


def tree_flatten(tree: Any) -> tuple[list[Any], Any]:
    """The leaves of a nested structure and a description of its structure (printable, comparable)."""
    return _pytree.tree_flatten(tree)


def call_leaves(args: tuple, kwargs: dict) -> tuple[list[Any], Any, list[bool]]:
    """The leaves of a call's ``(args, kwargs)``, a description of their structure (as :func:`tree_flatten`),
    and for each leaf whether it is an argument itself rather than inside a container argument."""
    leaves, spec = _pytree.tree_flatten((args, kwargs))
    own = [child.is_leaf() for part in spec.children() for child in part.children() for _ in range(child.num_leaves)]
    return leaves, spec, own


def tree_map(fn: Callable[[Any], Any], tree: Any) -> Any:
    """``tree`` with ``fn`` applied to every leaf, structure unchanged."""
    return _pytree.tree_map(fn, tree)


def version_counter(tensor: torch.Tensor) -> int:
    """How many in-place updates ``tensor`` (and every view of its storage) has seen."""
    return tensor._version


def storage_key(tensor: torch.Tensor) -> Hashable:
    """A hashable key equal for tensors sharing one storage (views, tied weights), without keeping it alive.

    Raises ``NotImplementedError`` or ``RuntimeError`` for tensors without a
    storage (sparse, nested), as ``Tensor.untyped_storage`` does.
    """
    return _StorageWeakRef(tensor.untyped_storage())


def strided_parts(tensor: torch.Tensor) -> list[torch.Tensor]:
    """The strided tensors holding a tensor's memory: itself, or a sparse tensor's indices and values
    (COO; compressed layouts: their index arrays and values), which have storages of their own."""
    if tensor.layout == torch.strided:
        return [tensor]
    if tensor.layout == torch.sparse_coo:
        return [tensor._indices(), tensor._values()]
    if tensor.layout in (torch.sparse_csr, torch.sparse_bsr):
        return [tensor.crow_indices(), tensor.col_indices(), tensor.values()]
    if tensor.layout in (torch.sparse_csc, torch.sparse_bsc):
        return [tensor.ccol_indices(), tensor.row_indices(), tensor.values()]
    return [tensor]


def views_of(tensors: Iterable[torch.Tensor], state: Sequence[torch.Tensor]) -> dict[int, torch.Tensor]:
    """By id of each view among ``tensors``, the tensor of ``state`` whose storage it shares (a
    parameter's slice taken in eager code); views of nothing in ``state`` are left out."""
    views = [t for t in tensors if t._base is not None]
    if not views:
        return {}
    owners: dict[Hashable, torch.Tensor] = {}
    for t in state:
        try:
            owners.setdefault(storage_key(t), t)
        except (NotImplementedError, RuntimeError):  # sparse or nested tensors have no storage
            continue
    found = {}
    for view in views:
        try:
            owner = owners.get(storage_key(view))
        except (NotImplementedError, RuntimeError):
            continue
        if owner is not None:
            found[id(view)] = owner
    return found


def leaves_reached(tensor: torch.Tensor, limit: int = 4096) -> list[torch.Tensor]:
    """The leaf tensors (parameters, inputs that require grad) whose gradients ``tensor``'s autograd graph
    accumulates, walking at most ``limit`` nodes back from it."""
    leaves, seen = [], set()
    stack = [tensor.grad_fn]
    while stack and len(seen) < limit:
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        variable = getattr(node, "variable", None)
        if isinstance(variable, torch.Tensor):
            leaves.append(variable)
        stack.extend(f for f, _ in node.next_functions)
    return leaves


#: Autograd nodes that gather the gradients of several views into one buffer once all are in (``split``,
#: ``chunk``, ``unbind``), or that an earlier compiled graph differentiates itself.
_GATHERING_NODES = ("SplitBackward", "SplitWithSizesBackward", "UnbindBackward", "CompiledFunction")


def gradient_scattered_into_own_buffer(view: torch.Tensor, owner: torch.Tensor) -> bool:
    """Whether autograd writes the gradient of ``view``, a view of the leaf ``owner`` taken in eager code
    (``table[1]``, ``weight[:, :k]``, ``weight.expand(...)``), into a buffer of ``owner``'s size of its own
    as soon as that gradient arrives: each step back to ``owner``'s accumulator is a single-input view
    backward and ``view`` is not the whole of ``owner`` reshaped.  Pieces of a ``split``/``chunk``/``unbind``
    share one buffer made when all their gradients are in, and a view an earlier compiled graph made is
    differentiated inside that graph: neither is."""
    if not view.requires_grad or view.numel() == owner.numel():
        return False
    node = view.grad_fn
    for _ in range(32):
        if node is None or node.name().startswith(_GATHERING_NODES):
            return False
        if node.name().endswith("AccumulateGrad"):
            return getattr(node, "variable", None) is owner
        inputs = [f for f, _ in node.next_functions if f is not None]
        if len(inputs) != 1:
            return False
        node = inputs[0]
    return False


def profiler_events(prof: Any) -> Iterable[Any]:
    """Every event of a finished ``torch.profiler.profile`` run, memory events included.

    Each has ``name()``, ``start_ns()``, ``end_ns()``, ``nbytes()`` and
    ``device_type()``; allocator events are named ``"[memory]"``.
    """
    return prof.profiler.kineto_results.events()


def made_by_compiled_graph(tensor: torch.Tensor) -> bool:
    """Whether ``tensor`` is a result of a ``torch.compile``'d graph's forward (its autograd node is
    AOTAutograd's ``CompiledFunction``)."""
    node = tensor.grad_fn
    return node is not None and type(node).__name__.startswith("CompiledFunction")


def cpu_allocations(
    prof: Any, marks: frozenset[str] = frozenset()
) -> tuple[list[tuple[int, int, int]], list[tuple[int, str]]]:
    """The CPU allocator's events of a finished ``torch.profiler.profile(profile_memory=True)``
    run as ``(time_ns, address, nbytes)`` in time order (``nbytes`` negative for a free), and the
    instants :func:`profiler_mark` put there under the names in ``marks`` (or a name in ``marks``
    followed by ``:`` and a suffix, such as a graph's index), as ``(time_ns, name)`` in time order
    (one walk of the run's events for both, on the same clock).

    The address matters: the CPU allocator reports a free with the size it
    recorded when the block was allocated under *some* profiler session,
    including an earlier one whose block has since been freed unseen and its
    address reused, so only frees paired with an allocation of the same run are
    trustworthy.
    """
    from torch._C._profiler import _EventType

    allocations, found = [], []
    stack = list(prof.profiler.kineto_results.experimental_event_tree())
    while stack:
        event = stack.pop()
        stack.extend(event.children)
        if event.tag == _EventType.Allocation:
            fields = event.extra_fields
            if fields.device.type == "cpu":
                allocations.append((event.start_time_ns, fields.ptr, fields.alloc_size))
        elif event.tag == _EventType.TorchOp and (event.name in marks or event.name.rsplit(":", 1)[0] in marks):
            found.append((event.start_time_ns, event.name))
    allocations.sort()
    found.sort()
    return allocations, found


def profiler_mark(name: str) -> None:
    """Put an instant named ``name`` in the running ``torch.profiler`` session's events (nothing
    when none runs): a point in the step that :func:`cpu_allocations` finds again."""
    if torch._C._autograd._profiler_enabled():
        with torch.profiler.record_function(name):
            pass


def _unbounded(top: Any) -> bool:
    """Whether a symbolic range's top is infinite: sympy's ``oo``, or torch's ``int_oo`` (whose
    ``is_finite`` says True)."""
    import sympy
    from torch.utils._sympy.numbers import int_oo

    return top == int_oo or top == sympy.oo or not top.is_finite


# None outside dynamic_sizes_at_hints; inside, the sizes some dimensions' symbols are priced at least at.
_DYNAMIC_AT_HINTS: contextvars.ContextVar[Mapping[Any, int] | None] = contextvars.ContextVar(
    "ckptc_dynamic_at_hints", default=None
)


@contextlib.contextmanager
def dynamic_sizes_at_hints(at_least: Mapping[Any, int] | None = None) -> Iterator[None]:
    """Inside: :func:`upper_bound` gives a size of dynamic dimensions its hint, the size it was captured
    with, even where guards gave its range a finite top (``torch.compile(dynamic=True)``: a sequence
    length bounded by a 2048-position table would be priced at 2048).  ``at_least`` maps a dimension's
    symbol (``SymInt.node.expr``) to a size to price it at where that is larger than its hint, and
    sizes computed from it accordingly (:func:`symbols_of_sizes`)."""
    token = _DYNAMIC_AT_HINTS.set(dict(at_least or {}))
    try:
        yield
    finally:
        _DYNAMIC_AT_HINTS.reset(token)


def symbols_of_sizes(shape: Sequence[Any]) -> list[tuple[int, Any]]:
    """``(dimension, symbol)`` of the sizes of ``shape`` that are a dynamic dimension's own symbol."""
    found = []
    for dim, size in enumerate(shape):
        if isinstance(size, torch.SymInt) and size.node.maybe_as_int() is None and size.node.expr.is_Symbol:
            found.append((dim, size.node.expr))
    return found


def dynamo_example_value(placeholder: fx.Node, default: Any) -> Any:
    """The fake value Dynamo traced a graph input as (its symbolic sizes: the real example input a
    backend is given has concrete ones), or ``default`` where Dynamo recorded none."""
    return placeholder.meta.get("example_value", default)


def size_hint(size: Any) -> int | None:
    """A size as the int it is, or the value a symbolic one ran with (its hint); None without one."""
    if isinstance(size, int):
        return size
    if isinstance(size, torch.SymInt) and size.node.has_hint():
        return int(size.node.hint)
    return None


def _at_hint(node: Any, at_least: Mapping[Any, int]) -> Any:
    """``node``'s hint, with the symbols ``at_least`` names raised to their sizes there where larger."""
    hint = node.hint
    free = node.expr.free_symbols
    if not at_least or not any(symbol in at_least for symbol in free):
        return hint
    # torch 2.13 renamed var_to_val (a FutureWarning on every read); older releases have only the old name
    backed = getattr(node.shape_env, "backed_var_to_val", None)
    if backed is None:
        backed = node.shape_env.var_to_val
    values = {}
    for symbol in free:
        value = backed.get(symbol)
        if value is None:
            return hint
        values[symbol] = max(int(value), at_least.get(symbol, 0))
    try:
        raised = float(node.expr.xreplace(values))
    except TypeError:  # a symbol left free: priced at its hint
        return hint
    return max(hint, raised)


def upper_bound(value: Any) -> int | None:
    """The largest value an int-like can take: itself if concrete, else the top of its symbolic range.

    Sizes in a captured graph are symbolic when they depend on data (the
    number of tokens routed to an expert, from ``nonzero``: "unbacked", ranging
    up to the input's size) or on an input dimension marked dynamic (ranging
    up to the ``max`` it was marked with).  A dynamic dimension without a top
    (``torch.compile(dynamic=True)``) is priced at its hint, the size it was
    captured with.  ``None`` when a data-dependent range has no finite top.
    Never adds a guard.
    """
    if isinstance(value, bool):
        return int(value)
    if isinstance(value, int):
        return value
    if isinstance(value, (torch.SymInt, torch.SymFloat)):
        node = value.node
        constant = node.maybe_as_int() if isinstance(value, torch.SymInt) else None
        if constant is not None:
            return constant
        at_least = _DYNAMIC_AT_HINTS.get()
        if at_least is not None and node.has_hint():
            hint = _at_hint(node, at_least)
            return int(hint) if isinstance(value, torch.SymInt) else int(float(hint)) + 1
        top = node.shape_env.bound_sympy(node.expr).upper
        if _unbounded(top):
            # A dimension made dynamic without a max (torch.compile(dynamic=True)) is priced at the
            # size it was captured with (its hint); one that depends on data has no price.
            hint = node.hint if node.has_hint() else None
            return None if hint is None else (int(hint) if isinstance(value, torch.SymInt) else int(float(hint)) + 1)
        return int(top) if isinstance(value, torch.SymInt) else int(float(top)) + 1
    try:
        return int(value)  # sympy numbers, numpy integers
    except TypeError:
        return None


def size_expression(value: Any) -> Any:
    """A size as a sympy expression over its symbols (a SymInt's), or the int it is; None for anything else."""
    if isinstance(value, bool):
        return None
    if isinstance(value, int):
        return value
    if isinstance(value, torch.SymInt):
        return value.node.expr
    return None


def storage_size_expression(tensor: torch.Tensor) -> Any:
    """The bytes of ``tensor``'s storage as a sympy expression (see :func:`size_expression`)."""
    try:
        return size_expression(tensor.untyped_storage().nbytes())
    except (NotImplementedError, RuntimeError):  # sparse or nested tensors
        return None


def binds_unbacked_symbols(node: fx.Node) -> bool:
    """True if ``node`` creates a data-dependent size or scalar (``nonzero``, ``item``, boolean indexing)."""
    return bool(node.meta.get("unbacked_bindings"))


def func_transform_running() -> str | None:
    """The innermost ``torch.func`` transform running the caller (``"grad"``, ``"vmap"``, ``"jvp"``,
    ``"functionalize"``), or None outside them (functorch's interpreter stack)."""
    interpreter = torch._C._functorch.peek_interpreter_stack()
    if interpreter is None:
        return None
    return interpreter.key().name.lower()


def size_recompiles() -> dict[str, tuple[int, str]]:
    """Frames Dynamo compiled again because a tensor's size changed, by frame (``"forward in
    modeling_x.py:255"``): how many of its guards failed on a size, and the latest such failure
    (``"tensor 'x' size mismatch at index 0. expected 37, actual 31"``).  From Dynamo's record of failed
    guards, which lives for the process."""
    from torch._dynamo.utils import guard_failures

    found = {}
    for code, reasons in list(guard_failures.items()):
        sized = [str(r) for r in reasons if "size mismatch" in str(r)]
        if sized:
            name, resumed, line = code.co_name.removeprefix("torch_dynamo_resume_in_").rpartition("_at_")
            if not (resumed and code.co_name.startswith("torch_dynamo_resume_in_")):
                name = code.co_name
            else:
                name = f"{name} resumed after line {line}"
            where = f"{name} in {code.co_filename.rsplit('/', 1)[-1]}:{code.co_firstlineno}"
            found[where] = (len(sized), sized[-1].split(": ", 1)[-1])
    return found


_BREAK_COUNTERS = ("graph_break", "unimplemented")  # Dynamo's counters of graph breaks and skipped frames


def graph_breaks_found() -> int:
    """How many graph breaks (and skipped frames) Dynamo has met since the process began: the sum of
    :func:`graph_break_reasons`, without building it."""
    from torch._dynamo.utils import counters

    return sum(sum(counters[kind].values()) for kind in _BREAK_COUNTERS)


def graph_break_reasons() -> dict[str, int]:
    """How often Dynamo broke a graph (or skipped a frame) for each reason, since the process began.

    Reasons are Dynamo's messages (``"Dynamic shape operator\\n Explanation: ..."``);
    diff two snapshots to get the breaks of one capture.
    """
    from torch._dynamo.utils import counters

    reasons: dict[str, int] = {}
    for kind in _BREAK_COUNTERS:
        for reason, count in counters[kind].items():
            reasons[reason] = reasons.get(reason, 0) + count
    return reasons


def unskip_forwards(model: torch.nn.Module) -> None:
    """Let Dynamo trace ``model``'s ``forward`` methods again after a call that raised in them.

    When an exception leaves a frame Dynamo is tracing and no graph came of it (the model's own
    ``raise ValueError``), Dynamo runs that frame eagerly and marks its code object to be skipped
    from then on, for every later call under any ``torch.compile``: every later training call
    would then run without a plan.  Setting the default strategy back only costs a trace where
    Dynamo would skip the code anyway.
    """
    from torch._C._dynamo.eval_frame import _FrameAction, _FrameExecStrategy, set_code_exec_strategy

    codes = set()
    for module in model.modules():
        for forward in (getattr(type(module), "forward", None), getattr(module, "forward", None)):
            code = getattr(getattr(forward, "__func__", forward), "__code__", None)
            if code is not None:
                codes.add(code)
    for code in codes:
        set_code_exec_strategy(code, _FrameExecStrategy(_FrameAction.DEFAULT, _FrameAction.DEFAULT))


def raised_running_eagerly(error: BaseException, entry: str) -> bool:
    """Whether ``error`` was raised by code running eagerly below the frame of function ``entry`` (the
    call into ``torch.compile``'s module): the model's own code, after Dynamo gave up tracing a frame and
    ran it as Python, or between graphs.  False where any frame under ``entry`` is Dynamo tracing or
    compiling, AOTAutograd, fake tensors, FX or a compiled graph (a capture failure there can look like
    any error), or a part of torch other than module calls, so a doubtful case is never taken for the model's.
    """
    torch_dir = os.path.dirname(torch.__file__) + os.sep
    allowed = (os.path.join(torch_dir, "_dynamo", "eval_frame.py"), os.path.join(torch_dir, "nn", "modules", ""))
    ckptc_dir = os.path.dirname(os.path.abspath(__file__)) + os.sep
    frames = traceback.extract_tb(error.__traceback__)
    below = next((i for i, frame in enumerate(frames) if frame.name == entry), None)
    if below is None or below == len(frames) - 1:
        return False
    for frame in frames[below + 1 :]:
        name = os.path.abspath(frame.filename) if not frame.filename.startswith("<") else frame.filename
        if name.startswith("<") or name.startswith(ckptc_dir):
            return False  # a compiled graph's generated code, or ckptc's own
        if name.startswith(torch_dir) and not name.startswith(allowed):
            return False
    return True


def user_gradient_hook_count(tensor: torch.Tensor) -> int:
    """How many hooks ``tensor.register_hook`` put on ``tensor`` other than torch's and ckptc's own (a multi-grad
    hook watching for the end of backward); ``retain_grad()`` is not one of them."""
    hooks = (tensor._backward_hooks or {}).values()
    return sum(not str(getattr(hook, "__module__", None) or "").startswith(("torch", "ckptc")) for hook in hooks)


def graph_break_after(gm: fx.GraphModule) -> str | None:
    """Why Dynamo ended the graph ``gm`` at a graph break, and where in the model's code; None if it did not.

    Dynamo hands every graph to the backend with the reason it stopped
    tracing (``compile_subgraph_reason``): the end of the frame, or a break
    with the user's stack at that point.
    """
    reason = getattr(gm, "compile_subgraph_reason", None)
    if reason is None or not getattr(reason, "graph_break", False):
        return None
    text = str(reason.reason).strip().splitlines()[0] if str(reason.reason).strip() else "graph break"
    stack = list(getattr(reason, "user_stack", None) or [])
    if stack:
        frame = stack[-1]
        where = f"{frame.filename.rsplit('/', 1)[-1]}:{frame.lineno} in {frame.name}"
        code = (frame.line or "").strip()
        text += f" (at {where}{': ' + code if code else ''})"
    return text


def observe_ops(callback: Callable[[Any, tuple, dict, Any], None]) -> Any:
    """A context manager calling ``callback(op, args, kwargs, out)`` after every aten op run inside it."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class _Observer(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001
            kwargs = kwargs or {}
            out = func(*args, **kwargs)
            callback(func, args, kwargs, out)
            return out

    return _Observer()


def dynamo_disabled() -> bool:
    """Whether Dynamo compiles nothing in this process (``TORCH_COMPILE_DISABLE=1`` sets
    ``torch._dynamo.config.disable``): ``torch.compile`` then runs every call eagerly."""
    return bool(torch._dynamo.config.disable)


def dynamo_runs_eagerly_after(error: BaseException) -> bool:
    """Whether Dynamo, its backend having raised ``error``, breaks the graph there and runs that code
    eagerly instead of raising (fake-tensor errors: data-dependent output sizes, unsupported operators)."""
    from torch._dynamo.exc import exceptions_allowed_to_be_fallback

    return isinstance(error, exceptions_allowed_to_be_fallback)


def frame_compiles() -> tuple[int, int] | None:
    """While Dynamo compiles a frame (inside a backend): how many compiled entries its code holds already
    (the graphs compiled for it before, for any model of its class), and Dynamo's recompile limit
    (``torch._dynamo.config.recompile_limit``, or the ``torch.compile`` call's own, which Dynamo patches
    in while compiling).  None outside a compile.  Once the entries reach the limit Dynamo compiles the
    code no more: a call none of their guards pass runs eagerly, with a log line only."""
    from torch._dynamo.eval_frame import _debug_get_cache_entry_list
    from torch._dynamo.symbolic_convert import InstructionTranslator

    tx = getattr(torch._dynamo.symbolic_convert.tls, "current_tx", None)
    if not isinstance(tx, InstructionTranslator):
        return None
    return len(_debug_get_cache_entry_list(tx.f_code)), int(torch._dynamo.config.recompile_limit)


def dynamo_traces_rnns() -> bool:
    """Whether the caller's Dynamo configuration traces ``nn.LSTM``/``GRU``/``RNN`` (``allow_rnn``; off by
    default, when Dynamo runs them eagerly)."""
    return bool(torch._dynamo.config.allow_rnn)


#: Higher-order control flow whose branches or body are subgraphs: ckptc's rewrite cannot split their
#: subgraphs into forward and recomputation (AOTAutograd then fails compiling the backward: "KeyError: 'val'").
_CONTROL_FLOW_OPS = ("cond", "while_loop")


def control_flow_ops(gm: torch.fx.GraphModule) -> list[str]:
    """The higher-order control-flow operators (``torch.cond``, ``while_loop``) Dynamo's graph ``gm`` calls."""
    found = []
    for node in gm.graph.nodes:
        name = getattr(node.target, "__name__", "")
        if isinstance(node.target, torch._ops.HigherOrderOperator) and name in _CONTROL_FLOW_OPS:
            found.append(f"torch.{name}")
    return sorted(set(found))


def mark_dynamic(tensor: torch.Tensor, dim: int, low: int, high: int) -> None:
    """Let ``tensor``'s dimension ``dim`` take any size in ``[low, high]`` without capturing again.

    Sizes in the captured graph that depend on it become symbolic, ranging
    over ``[low, high]`` (see :func:`upper_bound`).  If the model's code
    needs the exact size (a branch on it), capture fails with an error
    :func:`is_dynamic_shape_conflict` recognises.
    """
    torch._dynamo.mark_dynamic(tensor, dim, min=low, max=high)


def unmark_dynamic(tensor: torch.Tensor) -> None:
    """Undo :func:`mark_dynamic` on every dimension of ``tensor`` (marks live on the tensor object,
    so a tensor passed again would keep its dimensions dynamic)."""
    for attribute in (
        "_dynamo_dynamic_indices",
        "_dynamo_dynamic_range",
        "_dynamo_hint_overrides",
        "_has_dynamo_dim_marking",
        "_dynamo_propagated_dynamic_indices",  # Dynamo's, after a capture with it dynamic
    ):
        if attribute in tensor.__dict__:
            delattr(tensor, attribute)


def is_dynamic_shape_conflict(error: BaseException) -> bool:
    """True if ``error`` says a dimension marked dynamic had to be specialized by the model's code."""
    from torch.fx.experimental.symbolic_shapes import ConstraintViolationError

    while error is not None:
        if isinstance(error, ConstraintViolationError) or "Constraints violated" in str(error):
            return True
        error = getattr(error, "inner_exception", None) or error.__cause__  # type: ignore[assignment]
    return False


def workaround_decompositions() -> dict[Any, Callable]:
    """Decompositions that ckptc's capture always applies, each working around a PyTorch bug.

    * ``aten.softplus_backward`` (torch 2.13): its fake-tensor kernel lays the
      result out like ``self`` (the forward input), while the eager kernel
      follows ``grad_output``.  When the two differ (Mamba's ``dt``, whose
      incoming gradient is transposed), ops traced after it, such as ``view``,
      were planned for strides the real tensor does not have, and backward
      fails with "view size is not compatible with input tensor's size and
      stride".  Its decomposition into pointwise ops (``exp``, ``mul``,
      ``div``, ``where``) has fake strides that match eager, and computes the
      same formula.  ``tests/test_models_ssm.py`` checks that the bug is still
      there, so it says when this entry can go.
    """
    from torch._decomp import get_decompositions

    return get_decompositions([torch.ops.aten.softplus_backward])


def aot_backend(
    fw_compiler: Callable[[fx.GraphModule, Sequence[Any]], Callable],
    bw_compiler: Callable[[fx.GraphModule, Sequence[Any]], Callable],
    partition_fn: Callable[..., tuple[fx.GraphModule, fx.GraphModule]],
    *,
    for_inductor: bool = False,
) -> Callable:
    """A ``torch.compile`` backend built on AOTAutograd with our partitioner.

    ``partition_fn(joint_module, joint_inputs, *, num_fwd_outputs, **kw)`` receives
    the aten-level joint forward+backward graph (fake-tensor metadata in
    ``node.meta["val"]``) and returns the forward and backward graph modules.
    The joint graph is traced with :func:`workaround_decompositions`.
    """
    extra: dict[str, Any] = {"decompositions": workaround_decompositions()}
    if for_inductor:
        # Inductor lowers only graphs traced with its own decomposition table.  Some of its
        # decompositions consult its lowerings (max_pool's), which compile_fx imports first.
        import torch._inductor.lowering  # noqa: F401
        from torch._inductor.decomposition import select_decomp_table

        # Random ops stay whole (and run eagerly, see inductor_compile) so they draw
        # exactly the numbers eager PyTorch draws.
        extra["decompositions"] |= {op: fn for op, fn in select_decomp_table().items() if not is_random_op(op)}
    backend = _aot_autograd(
        fw_compiler=fw_compiler,
        bw_compiler=bw_compiler,
        inference_compiler=fw_compiler,
        partition_fn=partition_fn,
        keep_inference_input_mutations=True,
        **extra,
    )

    def compile_without_caches(gm: fx.GraphModule, example_inputs: Sequence[Any]) -> Callable:
        # AOTAutograd's and Inductor's caches key on the graph, not on our plan:
        # a hit would skip the partitioner and silently drop the plan.
        from torch._functorch import config as functorch_config
        from torch._inductor import config as inductor_config

        with (
            functorch_config.patch(enable_autograd_cache=False),
            inductor_config.patch(fx_graph_cache=False, fx_graph_remote_cache=False),
        ):
            return backend(gm, example_inputs)

    return compile_without_caches


def boxed(gm: fx.GraphModule) -> Callable:
    """Make ``gm`` run with the boxed calling convention.

    The generated code takes its inputs as one list and clears it, so each input
    (a saved activation, in backward) is freed right after its last use instead of
    living until the graph returns.
    """
    gm.graph.set_codegen(_BoxedCodeGen())
    gm.recompile()
    return make_boxed_func(gm.forward) if not getattr(gm, "_boxed_call", False) else gm


def saves_tensors_only(forward: fx.GraphModule, num_fwd_outputs: int) -> bool:
    """Whether AOTAutograd saves ``forward``'s outputs after the first ``num_fwd_outputs`` as one
    open-ended run of tensors, whatever their number.

    AOTAutograd's runtime saves ``fw_outs[num_forward:]`` for the backward when nothing trails the
    saved tensors (sizes, opaque objects, tensors stashed without version checks: its
    ``ViewAndMutationMeta.tensors_saved_for_backwards_slice``) and hands the backward
    ``len(ctx.saved_tensors)`` of them.  Then a forward that saves another number of tensors (a
    new plan) can run behind the same traced function, with a backward built for it.
    """
    if forward.graph.find_nodes(op="call_function", target=torch.ops.higher_order.with_effects):
        return False  # effect tokens: AOTAutograd rewrites the modules it partitions around them
    (outputs,) = (n.args[0] for n in forward.graph.find_nodes(op="output"))
    for out in outputs[num_fwd_outputs:]:
        if not isinstance(out, fx.Node) or out.meta.get("saved_tensor_with_no_vc_check", False):
            return False
        if not isinstance(out.meta.get("val"), torch.Tensor):
            return False
    return True


def donate_no_saved_tensors() -> None:
    """Tell AOTAutograd that the backward of the function it is compiling owns none of its saved tensors.

    AOTAutograd marks saved tensors a backward may free or reuse (donated buffers, for
    Inductor's backward), and then refuses a ``retain_graph`` or ``create_graph`` backward of a
    function whose backward was compiled for a plain one.  ckptc's eager backward frees its
    inputs as it goes anyway (boxed), and one function runs several plans
    (:class:`ckptc.capture.compiler.GraphPlans`): nothing is donated.  Call from a forward compiler.
    """
    context = torch._guards.TracingContext.try_get()
    if context is not None and context.fw_metadata is not None:
        context.fw_metadata.bw_donated_idxs = []


def inputs_written_back(joint: fx.GraphModule) -> frozenset[str]:
    """The placeholders of AOTAutograd's joint graph whose inputs it writes new values into after the forward.

    A mutation AOTAutograd keeps out of the graph (``embedding_renorm_`` under
    ``nn.Embedding(max_norm=...)`` renormalizes the weight in place) is a forward result that its
    runtime copies into the input once the forward has run: a backward reading the input reads the
    new values, and the input saved for backward fails autograd's version check.  Read from the
    descriptors AOTAutograd gives the joint graph's inputs and outputs (none: nothing found).
    """
    from torch._functorch._aot_autograd.descriptors import InputMutationAOTOutput

    output = next(iter(joint.graph.find_nodes(op="output")))
    written = {d.mutated_input for d in output.meta.get("desc") or () if isinstance(d, InputMutationAOTOutput)}
    return frozenset(n.name for n in joint.graph.find_nodes(op="placeholder") if n.meta.get("desc") in written)


def mark_boxed(fn: Any) -> Any:
    """Tell AOTAutograd that ``fn`` already takes its inputs as one list (the boxed convention); returns ``fn``.

    Set on the object itself (an instance's dict, not its class), so that wrappers copying it
    (``functools.wraps``) keep the mark.
    """
    fn._boxed_call = True
    return fn


def share_registries(module: torch.nn.Module, model: torch.nn.Module) -> None:
    """Make ``module`` use ``model``'s parameter, buffer and submodule registries (the same dicts),
    so it has ``model``'s parameters, buffers and state_dict keys without registering ``model`` as a child."""
    module._parameters = model._parameters
    module._buffers = model._buffers
    module._modules = model._modules


def compile_module(model: torch.nn.Module, backend: Any) -> Any:
    """``torch.compile(model, backend=backend, dynamic=False)`` through the function PyTorch defines.

    Frameworks may wrap ``torch.compile`` when imported (Lightning's wrapper deep-copies
    every argument, which for ckptc's backend means its model and planned graphs, and fails
    on fake tensors); ckptc's own compiles are internal and skip such wrappers.
    """
    import inspect

    marked = "_is_torch_compile" in model.__dict__
    compiled = inspect.unwrap(torch.compile)(model, backend=called_weakly(backend), dynamic=False)
    if not marked and model.__dict__.pop("_is_torch_compile", None) is not None:
        # Dynamo marks its result, and OptimizedModule sets attributes on the module it wraps: the
        # user's model kept the mark after ckptc was removed.  The mark goes on the wrapper itself.
        object.__setattr__(compiled, "_is_torch_compile", True)
    return compiled


@contextlib.contextmanager
def compiled_code_forgotten() -> Iterator[None]:
    """Drop, at the block's end, what Dynamo compiled in it for code that held nothing compiled before.

    Dynamo keeps a compiled entry on each code object it compiles (a model class's ``forward``, its
    layers' after a graph break) for the whole process, whichever backend made it, and stops compiling a
    code once its entries reach the recompile limit: a one-off capture left an entry that no call can run
    again (its backend is gone) and that took one of the caller's later ``torch.compile`` of the class.
    Code the caller compiled before keeps every entry (Dynamo cannot drop one alone)."""
    from torch._C._dynamo.eval_frame import reset_code
    from torch._dynamo import convert_frame, pgo
    from torch._dynamo.eval_frame import _debug_get_cache_entry_list

    def holding() -> dict[int, Any]:
        codes = (ref() for ref in convert_frame.input_codes.seen)
        return {id(code): code for code in codes if code is not None and _debug_get_cache_entry_list(code)}

    before, sizes_seen = holding(), set(pgo.get_code_state())
    try:
        yield
    finally:
        with convert_frame.compile_lock:
            for key, code in holding().items():
                if key not in before:
                    reset_code(code)
                    # The sizes it was compiled for too: the caller's first compile at another batch size
                    # would otherwise make them dynamic (Dynamo's automatic dynamic shapes, kept per code).
                    code_id = pgo.CodeId.make(code)
                    if code_id not in sizes_seen:
                        pgo.get_code_state().pop(code_id, None)


def compiled_module_called() -> torch.nn.Module | None:
    """The module whose compiled call is on the Python stack (Dynamo compiling it, or running the graphs it
    compiled for it); None if there is none.

    ``torch.compile(model, backend=...)`` returns an ``OptimizedModule`` whose call is on the stack
    while Dynamo hands a backend each of the model's graphs (after a graph break too) and while they
    run; ``model.compile(...)`` compiles the model's own call, which its ``_wrapped_call_impl`` runs.
    The innermost one is the model being compiled or run.  A compiled function
    (``torch.compile(train_step)``) has none: the one module among the arguments it was called with
    stands for the model (none, or several: None).
    """
    import sys

    from torch._dynamo.eval_frame import OptimizedModule

    frame = sys._getframe(1)
    arguments: list[torch.nn.Module] | None = None
    while frame is not None:
        if arguments is None and _is_compiled_call(frame):
            call = frame.f_locals
            values = [*call.get("args", ()), *call.get("kwargs", {}).values()]
            arguments = list({id(v): v for v in values if isinstance(v, torch.nn.Module)}.values())
        if "self" in frame.f_code.co_varnames:
            owner = frame.f_locals.get("self")
            if isinstance(owner, OptimizedModule):
                return owner._orig_mod
            if (
                frame.f_code is torch.nn.Module._wrapped_call_impl.__code__
                and getattr(owner, "_compiled_call_impl", None) is not None
            ):
                return owner
        frame = frame.f_back
    return arguments[0] if arguments is not None and len(arguments) == 1 else None


def compiled_call_inputs() -> list[torch.Tensor]:
    """The tensors among the arguments of the innermost ``torch.compile``d call on the Python stack (the
    compiled model's or function's call, whose graphs run or compile now); empty if there is none.

    The caller holds them through the step, but a graph sees only those it takes: an input the model's
    eager code alone reads (an augmentation run under ``torch.compiler.disable`` before the first graph)
    reaches no graph."""
    import sys

    frame = sys._getframe(1)
    while frame is not None:
        if _is_compiled_call(frame):
            call = frame.f_locals
            leaves = tree_leaves((call.get("args", ()), call.get("kwargs", {})))
            return [t for t in leaves if isinstance(t, torch.Tensor)]
        frame = frame.f_back
    return []


def _is_compiled_call(frame: Any) -> bool:
    """Whether ``frame`` is the function ``torch.compile`` wraps a callable in, called with its arguments."""
    from torch._dynamo import eval_frame

    return frame.f_code.co_name == "compile_wrapper" and frame.f_code.co_filename == eval_frame.__file__


def called_weakly(target: Callable) -> Callable:
    """A function calling ``target``, which it holds weakly, for Dynamo to keep instead of ``target``.

    Dynamo keeps every backend a ``torch.compile`` call was given (``torch._dynamo.eval_frame.cached_backends``)
    and what a backend returns (in the compiled frame's module globals) until ``torch.compiler.reset()``.
    ckptc's backend and its compiled graphs reach the model and its step, so the model's weights would stay
    alive, on a GPU on the device, for the whole process after the caller let it go.  Whoever owns the
    compiled model holds ``target`` itself (the step runtime its compiler, the compiler its graphs' runs)."""
    ref = weakref.ref(target)

    def call(*args: Any, **kwargs: Any) -> Any:
        live = ref()
        if live is None:
            raise RuntimeError(
                "ckptc: a model's compiled graph ran after its ckptc wrapper was released; optimize the model again"
            )
        return live(*args, **kwargs)

    if getattr(target, "_boxed_call", False):
        call._boxed_call = True  # type: ignore[attr-defined]  # Dynamo's calling convention: one list
    return call


def tensor_registries(module: torch.nn.Module) -> tuple[dict[str, Any], dict[str, Any]]:
    """``module``'s own parameter and buffer dicts (not its children's), to swap entries in place."""
    return module._parameters, module._buffers


def graph_module(root: torch.nn.Module, graph: fx.Graph) -> fx.GraphModule:
    """A module running ``graph`` whose Python code is generated on its first call, not now.

    A plan's graphs pass through several rewrites before they run (split, specialized,
    written in place, boxed); generating each intermediate module's code cost a replan
    as much as planning itself.
    """
    return _make_graph_module(root, graph, graph_module_cls=_LazyGraphModule)


def split_joint_graph(
    joint: fx.GraphModule,
    saved_values: list[fx.Node],
    saved_sym_nodes: list[fx.Node],
    num_fwd_outputs: int,
) -> tuple[fx.GraphModule, fx.GraphModule]:
    """Cut a joint graph into AOTAutograd's forward and backward modules.

    The forward returns ``fwd_outputs + saved_values + saved_sym_nodes``; the
    backward takes ``saved_sym_nodes + saved_values + tangents``.  Both keep the
    node order of ``joint`` (dead code removed), so the joint graph's order is the
    execution order.
    """
    with _use_lazy_graph_module(True):
        return _extract_fwd_bwd_modules(
            joint,
            saved_values,
            saved_sym_nodes,
            num_fwd_outputs=num_fwd_outputs,
        )


def is_tangent(node: fx.Node) -> bool:
    return node.op == "placeholder" and "tangents" in str(node.target)


def is_primal(node: fx.Node) -> bool:
    return node.op == "placeholder" and "tangents" not in str(node.target)


def reset_dynamo() -> None:
    torch.compiler.reset()


def dynamo_explain(fn: Callable, *args: Any, **kwargs: Any) -> Any:
    return torch._dynamo.explain(fn)(*args, **kwargs)


def placeholder_values_laid_out_as(gm: fx.GraphModule, args: Sequence[Any]) -> list[Any]:
    """``gm``'s placeholder values (fake tensors), each with the strides of the tensor ``args`` passes
    there where they differ (same static sizes): example inputs to compile kernels for the layouts a
    run gives them, as AOTAutograd restrides a lazily compiled backward's inputs to the strides its
    compiled forward's outputs have."""
    values = []
    for node, arg in zip(gm.graph.find_nodes(op="placeholder"), args, strict=False):
        value = node.meta.get("val")
        if (
            isinstance(value, torch._subclasses.fake_tensor.FakeTensor)
            and isinstance(arg, torch.Tensor)
            and value.stride() != arg.stride()
            and all(isinstance(n, int) for n in value.shape)
            and tuple(value.shape) == tuple(arg.shape)
        ):
            with value.fake_mode:
                value = torch.empty_strided(value.shape, arg.stride(), dtype=value.dtype, device=value.device)
        values.append(value)
    return values


def inductor_compile(gm: fx.GraphModule, example_inputs: Sequence[Any]) -> Callable:
    """Inductor kernels for one graph; random ops fall back to eager so they match eager.

    The FX-graph cache is off here, not only around :func:`aot_backend`'s call:
    AOTAutograd compiles the backward lazily, at the first backward, outside that
    call.  Its key pickles the graph module with its ``meta`` (ckptc's record of the
    plan: fake tensors, cyclic dicts), which the key's pickler cannot do.
    """
    from torch._inductor import config
    from torch._inductor.compile_fx import compile_fx_inner

    with (
        config.patch(fallback_random=True, fx_graph_cache=False, fx_graph_remote_cache=False),
        _cpu_kernels_free_after_their_last_reader(),
    ):
        return compile_fx_inner(gm, example_inputs)


@contextlib.contextmanager
def _cpu_kernels_free_after_their_last_reader() -> Iterator[None]:
    """Inductor's C++ backend frees a buffer after its last reader's kernel, as on GPUs.

    On CPU Inductor writes consecutive kernels (everything between two extern calls such as a
    convolution) into one C++ function, and frees what they read only after that function
    returns: a value's last reader and a recomputation later in the group then hold both at
    once (a Conv2d + BatchNorm block's backward held a recomputed activation beside the two it
    had finished with, and ran at its unoptimized peak, 1.21x the plan's prediction).  The plan
    frees a value after its last reader, as Triton's one kernel per fused node does, so the group
    is ended there: after any kernel that leaves a buffer to free.
    """
    from torch._inductor.codegen.cpp import CppScheduling
    from torch._inductor.virtualized import V

    ready = CppScheduling.ready_to_flush

    def ready_to_flush(self: Any) -> bool:
        scheduler = self.scheduler
        return ready(self) or bool(scheduler and scheduler.buffer_names_to_free - V.graph.removed_buffers)

    CppScheduling.ready_to_flush = ready_to_flush
    try:
        yield
    finally:
        CppScheduling.ready_to_flush = ready


def inductor_joint_passes(joint: fx.GraphModule) -> fx.GraphModule:
    """Inductor's own rewrites of a joint graph (pattern replacements such as attention into
    ``scaled_dot_product_attention``, constant folding, no-op removal), as ``torch.compile``
    runs them before partitioning: ckptc then plans the graph Inductor compiles."""
    from torch._inductor.compile_fx import _recursive_joint_graph_passes

    devices = {
        t.device
        for n in joint.graph.find_nodes(op="placeholder")
        for t in [n.meta.get("val")]
        if isinstance(t, torch.Tensor)
    }
    joint = _recursive_joint_graph_passes(joint, input_device=next(iter(devices), None))
    _channels_last_convolutions(joint)
    return joint


RUN_MEMORY_FORMAT = "ckptc_memory_format"
"""``node.meta`` key: the memory format a compiler writes the node's value in when its fake
value says otherwise (:func:`ckptc.pricing.costs.measure_scratch` runs its readers on it)."""

INPUT_LAYOUT_COPY = "ckptc_input_layout_copy"
"""``node.meta`` key: a copy of a graph input in the layout Inductor runs a convolution in
(:func:`_channels_last_convolutions`).  Inductor does not recompute such a copy for the backward:
it drops it and oneDNN reorders the input inside the backward convolution, as scratch the plan
does not see, so the copy is always kept (:func:`ckptc.pricing.problem.joint_to_problem`)."""


def _channels_last_convolutions(joint: fx.GraphModule) -> None:
    """Write into the joint graph the layout Inductor's layout optimization gives convolutions.

    Where Inductor decides for a graph with 2-d convolutions that they run channels-last
    (always on CPU with oneDNN, by its heuristics elsewhere), each convolution's input and
    weight are made channels-last.  A graph input (an image, a weight) has a fixed layout, so
    Inductor copies it, and the copies, not the originals, are what the forward saves for the
    backward: copies the plan never saw.  They become explicit ``clone`` nodes here, priced,
    kept or recomputed like any value.  A value computed in the graph is written channels-last
    by its producer instead (no copy); it is only marked (:data:`RUN_MEMORY_FORMAT`) so that
    the convolutions' scratch is measured in the layout they run in (oneDNN reorders what
    comes in another layout, at up to three times the weight's size).
    """
    from torch._inductor.graph import GraphLowering

    convolutions = list(joint.graph.find_nodes(op="call_function", target=torch.ops.aten.convolution.default))
    if not convolutions or not GraphLowering.decide_layout_opt(joint, is_inference=False):
        return
    copies: dict[fx.Node, fx.Node] = {}

    def channels_last(value: Any, reader: fx.Node) -> Any:
        val = value.meta.get("val") if isinstance(value, fx.Node) else None
        if not isinstance(val, torch.Tensor) or val.dim() != 4:
            return value
        if val.is_contiguous(memory_format=torch.channels_last):
            return value
        if value.op != "placeholder":
            if not (is_op_overload(value.target) and value.target.is_view):
                value.meta[RUN_MEMORY_FORMAT] = torch.channels_last  # a view's layout is its base's
            return value
        if value not in copies:
            with joint.graph.inserting_before(reader):
                copy = joint.graph.call_function(
                    torch.ops.aten.clone.default, (value,), {"memory_format": torch.channels_last}
                )
            copy.meta = {k: v for k, v in reader.meta.items() if k not in ("val", "tensor_meta")}
            copy.meta["val"] = val.clone(memory_format=torch.channels_last)
            copy.meta[INPUT_LAYOUT_COPY] = True
            copies[value] = copy
        return copies[value]

    for conv in convolutions:
        x, weight, *rest = conv.args
        conv.args = (channels_last(x, conv), channels_last(weight, conv), *rest)
    # Inductor's backward receives the saved copies: the gradients are computed from them.
    for node in joint.graph.find_nodes(op="call_function", target=torch.ops.aten.convolution_backward.default):
        grad, x, weight, *rest = node.args
        node.args = (channels_last(grad, node), copies.get(x, x), copies.get(weight, weight), *rest)
    if copies:
        joint.recompile()


from torch._dynamo.exc import BackendCompilerFailed  # noqa: E402
from torch._dynamo.exc import ShortenTraceback as _PassedThroughDynamo  # noqa: E402

_passing_through: dict[type, type] = {}


def _no_attribute(self: BaseException, value: Any = None) -> Any:
    raise AttributeError("real_stack")


# Dynamo appends its user-code stack and "Set TORCHDYNAMO_VERBOSE=1 ... reporting a bug to PyTorch" to an
# error that has a ``real_stack``; ckptc's errors say what to do themselves, so they never have one.
_no_real_stack = property(_no_attribute, lambda self, value: None)


def raised_through_dynamo(error: BaseException) -> BaseException:
    """``error`` (raised by a backend while Dynamo compiles) re-typed so that Dynamo hands it to the
    caller as it is: Dynamo wraps whatever a backend raises in its ``BackendCompilerFailed``, except
    its own ``ShortenTraceback`` family, which it re-raises (with its frames stripped).  The new type
    subclasses ``error``'s, with the same name and module, so ``except ckptc.InfeasibleBudgetError``
    catches it."""
    cls = type(error)
    if issubclass(cls, _PassedThroughDynamo):
        return error
    through = _passing_through.get(cls)
    if through is None:
        through = type(
            cls.__name__, (cls, _PassedThroughDynamo), {"__module__": cls.__module__, "real_stack": _no_real_stack}
        )
        through.__qualname__ = cls.__qualname__
        _passing_through[cls] = through
    error.__class__ = through
    error.first_useful_frame = None  # ShortenTraceback's: keep every frame
    return error


from torch._dynamo.exc import TorchDynamoException as DynamoError  # noqa: E402


@contextlib.contextmanager
def compile_config(*, scalar_outputs: bool = True) -> Iterator[None]:
    """Dynamo's configuration while ckptc-compiled code runs (and is captured).

    * Recompile limits raised: every ``optimize`` call compiles the model's
      code again with its own backend; past Dynamo's default limit of 8 it
      would silently fall back to eager execution, dropping the plan.
    * ``allow_rnn``: ``nn.LSTM``/``GRU``/``RNN`` are traced (unrolled) instead
      of skipped; :mod:`ckptc.capture.coverage` refuses the cases the trace gets wrong.
    * ``capture_scalar_outputs`` and ``capture_dynamic_output_shape_ops``:
      ``.item()``, ``nonzero`` and boolean indexing (MoE routing) stay in the
      graph instead of breaking it; their unbacked sizes are priced at their
      upper bound (:func:`concrete_upper_bound`).  ``scalar_outputs=False`` leaves them off (they
      break the graph, as in plain ``torch.compile``): Dynamo fails to trace some models with them
      on (unbacked sizes it cannot bind, asserts on data-dependent sizes).
    * Logging below ``error`` is a no-op in the graph instead of a graph break
      (:func:`traced_logging_functions`).
    * ``use_numpy_random_stream``: ``np.random`` calls break the graph and draw from numpy's own
      generator, as eager does (traced, they drew other numbers from torch's, and a SpecAugment
      mask differed from eager's).
    * A CPU LSTM is unrolled op by op while it trains (:func:`_lstm_unrolled_for_training`).
    * Dynamo's warning that a backend failed and it added a graph break instead (a traceback ending
      "Report an issue to the backend compiler repo") and its advice to set ``capture_scalar_outputs``
      go to ckptc's log at info level (:class:`_DynamoAdviceToLog`): with ``.item()`` kept in the graph,
      Dynamo breaks the graph where ckptc's capture meets a size it cannot bind, as plain
      ``torch.compile`` does there; ckptc tried the setting first; the coverage report names every break.
    * Two errors Dynamo logs with their tracebacks and ckptc catches go to ckptc's log at info level too
      (:class:`_CaughtErrorsToLog`): a dimension ckptc marked dynamic that the model's code specialized,
      and an op the inputs do not fit (the error ckptc raises quotes it).
    """
    patch = torch._dynamo.config.patch(
        recompile_limit=256,
        accumulated_recompile_limit=4096,
        allow_rnn=True,
        capture_scalar_outputs=scalar_outputs,
        capture_dynamic_output_shape_ops=scalar_outputs,
        ignore_logging_functions=torch._dynamo.config.ignore_logging_functions | traced_logging_functions(),
        use_numpy_random_stream=True,
    )
    to_log = _DynamoAdviceToLog()  # one per entry: a nested entry's exit leaves the outer one's in place
    caught = _CaughtErrorsToLog()
    for logger in _DYNAMO_ADVICE_LOGGERS:
        logger.addFilter(to_log)
    for logger in _CAUGHT_ERROR_LOGGERS:
        logger.addFilter(caught)
    try:
        with patch, _lstm_unrolled_for_training():
            yield
    finally:
        for logger in _DYNAMO_ADVICE_LOGGERS:
            logger.removeFilter(to_log)
        for logger in _CAUGHT_ERROR_LOGGERS:
            logger.removeFilter(caught)


class _DynamoAdviceToLog(logging.Filter):
    """Drops two of Dynamo's warnings that do not apply under ckptc (see :func:`compile_config`), saying
    each in ``ckptc``'s log at info level: a backend's failure it turned into a graph break (ckptc's
    capture with ``.item()`` kept in the graph), and, once ckptc captured again without, the advice to
    set ``capture_scalar_outputs``, which ckptc tried first."""

    _ADVICE = ("Backend compiler exception", "Graph break from `Tensor.item()`")

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        if record.levelno != logging.WARNING or not any(advice in message for advice in self._ADVICE):
            return True
        detail = next((line.strip() for line in message.splitlines() if line.strip().startswith("Exception:")), "")
        logging.getLogger("ckptc.capture").info(
            "Dynamo breaks the graph where it cannot keep a data-dependent value (%s), as plain torch.compile does",
            detail.removeprefix("Exception:") or "Tensor.item()",
        )
        return False


_DYNAMO_ADVICE_LOGGERS = (logging.getLogger("torch._dynamo.exc"), logging.getLogger("torch._dynamo.variables.tensor"))


class _CaughtErrorsToLog(logging.Filter):
    """Drops the error Dynamo logs, with its traceback, when the model's code specializes a dimension that
    ckptc marked dynamic (a length bucket; with a graph break the resumed frame may read the length as a
    constant): ckptc catches that conflict and captures the call at its exact sizes
    (:func:`is_dynamic_shape_conflict`), so it is said in ``ckptc``'s log at info level instead (it printed
    some 80 lines of "Error while creating guard" on stderr during correct training).  So is the fake-tensor
    traceback of an op the inputs do not fit, which the error ckptc raises quotes."""

    def __init__(self) -> None:
        super().__init__()
        self._dropped = False

    def filter(self, record: logging.LogRecord) -> bool:
        error = record.exc_info[1] if record.exc_info else None
        if error is not None and is_dynamic_shape_conflict(error):
            self._dropped = True
            logging.getLogger("ckptc.capture").info(
                "the model's code specialized a dimension marked dynamic (%s); captured at exact sizes",
                str(error).splitlines()[0],
            )
            return False
        if record.getMessage().startswith("failed while attempting to run meta"):
            # A shape or dtype the model does not take: the error ckptc raises (UntraceableModelError)
            # quotes it; Dynamo's traceback printed once per capture attempt.
            logging.getLogger("ckptc.capture").info("%s: %s", record.getMessage(), error)
            return False
        if self._dropped and record.getMessage().startswith("Created at:"):
            self._dropped = False  # the dropped error's second record
            return False
        self._dropped = False
        return True


_CAUGHT_ERROR_LOGGERS = (logging.getLogger("torch._guards"), logging.getLogger("torch._subclasses.fake_tensor"))


@contextlib.contextmanager
def _lstm_unrolled_for_training() -> Iterator[None]:
    """PyTorch's LSTM decomposition picks oneDNN's ``mkldnn_rnn_layer`` on CPU when the LSTM's input
    needs no gradient (meant for inference: ``select_one_layer_lstm_function``), even when its
    weights do; that kernel's traced backward saves ``None`` and crashes in oneDNN (an LSTM fed the
    model's input directly).  While gradients flow to the weights, the op-by-op layer is chosen."""
    from itertools import chain

    from torch._decomp import decompositions

    select = decompositions.select_one_layer_lstm_function

    def select_for_training(input: Any, hx: Any, params: Any) -> Any:
        if torch.is_grad_enabled() and any(p.requires_grad for p in chain.from_iterable(params)):
            return decompositions.one_layer_lstm
        return select(input, hx, params)

    decompositions.select_one_layer_lstm_function = select_for_training
    try:
        yield
    finally:
        decompositions.select_one_layer_lstm_function = select


def traced_logging_functions() -> set[Callable[..., Any]]:
    """``logging.Logger`` methods that Dynamo skips (no graph break) in ckptc's captures.

    A log call in a forward (Hugging Face's ``logger.warning_once`` in ``loss_function``
    when a model's ``loss_type`` is unset, as for ``GPT2LMHeadModel`` built from a config)
    otherwise breaks the graph right before the loss, and the step is planned as two
    graphs.  The message is still emitted by the eager forward ckptc runs on every call
    that plans (the coverage report), and on every untraced call (``eval``, ``no_grad``).
    ``error`` and ``critical`` keep breaking the graph, so they run on every call.
    """
    import logging

    names = ("debug", "info", "warning", "warn", "info_once", "warning_once")  # *_once: transformers' additions
    return {getattr(logging.Logger, name) for name in names if callable(getattr(logging.Logger, name, None))}


def outside_fake_mode():
    """Run real tensor code from inside a compiler pass (AOTAutograd's fake mode is active there)."""
    import contextlib

    from torch._subclasses.fake_tensor import unset_fake_temporarily
    from torch.utils._python_dispatch import _disable_current_modes

    stack = contextlib.ExitStack()
    stack.enter_context(unset_fake_temporarily())
    stack.enter_context(_disable_current_modes())
    return stack


def outside_user_compile(function: Callable[..., Any]) -> Callable[..., Any]:
    """``function``, run eagerly even where it is called inside a frame the user's ``torch.compile`` runs.

    ckptc's hooks and callbacks run on the thread of the backward that calls them; under a compiled
    training step (``torch.compile(train_step)``, backward inside it) Dynamo would try to trace each
    of them as a frame of the user's function (and print warnings about what it cannot trace there:
    ``os.dup``, a profiler's ``record_function``).
    """
    return torch.compiler.disable(function, reason="ckptc's run-time bookkeeping, not the user's step")


def on_backward_end(
    tensors: Sequence[torch.Tensor], callback: Callable[[], None], began: Callable[[], None] = lambda: None
) -> Any:
    """Call ``callback()`` once the backward pass that reaches any of ``tensors`` ends.

    A hook fires when backward computes the gradient of one of ``tensors``; it
    calls ``began()`` and queues ``callback`` on the autograd engine, which runs it
    when that backward call has finished (every gradient accumulated; not when it
    raised).  Returns a handle whose ``remove()`` detaches the hook.
    """
    from torch.autograd.graph import register_multi_grad_hook

    ended = outside_user_compile(callback)

    @outside_user_compile
    def hook(_: Any) -> None:
        began()
        torch.autograd.Variable._execution_engine.queue_callback(ended)

    return register_multi_grad_hook(list(tensors), hook, mode="any")


def module_hooks(model: torch.nn.Module) -> tuple:
    """The hooks registered on ``model``'s modules (forward, forward pre, backward, backward pre), by
    handle id: torch.compile does not guard on them (``skip_nnmodule_hook_guards``), so a graph traced
    before a hook was added runs without it."""
    return tuple(
        (tuple(m._forward_hooks), tuple(m._forward_pre_hooks), tuple(m._backward_hooks), tuple(m._backward_pre_hooks))
        for m in model.modules()
        if m._forward_hooks or m._forward_pre_hooks or m._backward_hooks or m._backward_pre_hooks
    )


def has_gradient_hooks(parameter: torch.Tensor) -> bool:
    """Whether hooks on ``parameter`` must see its gradient (``register_hook``,
    ``register_post_accumulate_grad_hook``)."""
    return bool(parameter._backward_hooks) or bool(getattr(parameter, "_post_accumulate_grad_hooks", None))


def running_gradient_accumulator(edge: int, edges: int) -> Any:
    """The node that accumulates into ``.grad`` the gradient the backward node running now hands on at
    its ``edge``-th next edge (a leaf's ``AccumulateGrad``, whose ``variable`` is the leaf), or None when
    that gradient goes elsewhere, no backward node runs, or the node has other than ``edges`` edges.

    A compiled graph's backward node has one edge per tensor input of its forward, in order (its
    integer and symbolic-size inputs have none)."""
    node = torch._C._current_autograd_node()
    if node is None or len(node.next_functions) != edges:
        return None
    accumulator = node.next_functions[edge][0]
    return accumulator if isinstance(getattr(accumulator, "variable", None), torch.nn.Parameter) else None


def tensors_held_for_backward(
    tensors: Iterable[torch.Tensor], walked: set[Hashable] | None = None, *, saved: bool = True
) -> list[torch.Tensor]:
    """The tensors autograd holds in the graph eager code made behind ``tensors`` (their ``grad_fn`` and
    the nodes those lead to): what its nodes saved for backward, and the leaves it accumulates gradients
    into (parameters eager code used).  What eager code that made ``tensors`` holds until its backward runs.

    The walk stops at a compiled graph's node (``CompiledFunction``: what a graph saves, its plan counts)
    and at nodes in ``walked`` (walked already; the walked ones are added, each as its id and creation
    number: a node's id alone names a new node once it is freed, which happens at once).  Read from the
    nodes' ``_saved_*`` attributes (autograd's generated accessors), ``saved_tensors`` (custom
    ``autograd.Function``s) and the ``variable`` of ``AccumulateGrad`` nodes; a node whose saved tensors
    were released already (or cannot be unpacked) gives nothing: this runs inside the caller's step and
    must not fail it.  Nothing is read under saved-tensor hooks (``save_on_cpu``, offloading), nor what
    they packed (a checkpointed region's: reading would run its forward again, :func:`_saved_under_hooks`).
    ``saved=False``: the leaves only, nothing unpacked."""
    if saved and torch._C._autograd._top_saved_tensors_default_hooks(True) is not None:
        return []
    walked = set() if walked is None else walked
    found: list[torch.Tensor] = []
    stack = [t.grad_fn for t in tensors if isinstance(t, torch.Tensor) and t.grad_fn is not None]
    while stack:
        node = stack.pop()
        if node is None or type(node).__name__.startswith("CompiledFunction"):
            continue
        # AccumulateGrad nodes share one creation number; one taken for a freed one only hides its leaf,
        # which requires a gradient and so is never counted as saved.
        key = (id(node), node._sequence_nr())
        if key in walked:
            continue
        walked.add(key)
        leaf = getattr(node, "variable", None)
        if isinstance(leaf, torch.Tensor):
            found.append(leaf)
        if not saved:
            stack.extend(next_node for next_node, _ in node.next_functions)
            continue
        names = [name for name in dir(node) if name.startswith("_saved_")]
        if not names and hasattr(node, "saved_tensors"):
            names = ["saved_tensors"]
        for name in names:
            if _saved_under_hooks(node, name):
                continue
            try:
                with outside_fake_mode():  # unpacking detaches: real tensors, also inside a compiler pass
                    value = getattr(node, name)
            except Exception:  # released by a backward that ran (retain_graph=False), or not unpackable
                continue
            values = value if isinstance(value, (tuple, list)) else (value,)
            found.extend(v for v in values if isinstance(v, torch.Tensor))
        stack.extend(next_node for next_node, _ in node.next_functions)
    return found


def callers_saved_tensor_hooks() -> bool:
    """Whether saved-tensor hooks of the caller's are active (``torch.autograd.graph.saved_tensors_hooks``,
    ``save_on_cpu``): they pack what a compiled graph saves for backward.  Not those of a non-reentrant
    ``torch.utils.checkpoint`` region (its forward or its recomputation: they keep nothing and run the
    region again) nor ckptc's own (its reference run)."""
    module = _top_saved_tensor_hooks_module()
    if module is None:
        return False
    return not (module == "torch.utils.checkpoint" or module == "ckptc" or module.startswith("ckptc."))


def inside_checkpoint_region() -> bool:
    """Whether this runs inside a non-reentrant ``torch.utils.checkpoint`` region (its forward, or its
    recomputation during backward): the saved-tensor hooks on top are the region's."""
    return _top_saved_tensor_hooks_module() == "torch.utils.checkpoint"


def _top_saved_tensor_hooks_module() -> str | None:
    """The module that defines the pack hook of the saved-tensor hooks on top (None: none active)."""
    hooks = torch._C._autograd._top_saved_tensors_default_hooks(True)
    if hooks is None:
        return None
    return getattr(hooks[0], "__module__", None) or ""


def _saved_under_hooks(node: Any, name: str) -> bool:
    """Whether a tensor of autograd ``node``'s saved attribute ``name`` was packed by saved-tensor hooks:
    unpacking runs their unpack hook, which for a non-reentrant ``torch.utils.checkpoint`` region runs the
    region's forward again (outside any backward: every op of it, its memory, and tensors that are not
    what the step holds), and for ``save_on_cpu`` copies to the device.  Read from the ``SavedTensor``
    objects behind the attribute (``_raw_saved_*``; ``_raw_saved_tensors`` of a custom function)."""
    raw = getattr(node, "_raw" + name if name.startswith("_saved_") else "_raw_saved_tensors", None)
    saved = raw if isinstance(raw, (tuple, list)) else (raw,)
    return any(getattr(t, "unpack_hook", None) is not None for t in saved)


def is_flash_attention_backward(target: Any) -> bool:
    """Whether ``target`` is the backward of SDPA's flash-attention kernel (``aten`` names it private)."""
    return target is torch.ops.aten._scaled_dot_product_flash_attention_backward.default


def is_training_batch_norm(target: Any, args: Sequence[Any]) -> bool:
    """Whether ``target(*args)`` is BatchNorm in training mode as functionalized joint graphs hold it (``aten``'s
    ``_native_batch_norm_legit_functional``, training set: outputs 0-2 from the batch, 3-4 the new running
    statistics)."""
    return target is torch.ops.aten._native_batch_norm_legit_functional.default and args[5] is True


def batch_norm_without_statistics() -> Any:
    """``aten``'s BatchNorm taking no running statistics (``_native_batch_norm_legit.no_stats``): in training
    mode outputs 0-2 of :func:`is_training_batch_norm`'s op, computed by the same kernel."""
    return torch.ops.aten._native_batch_norm_legit.no_stats


def trainable_leaf_or_view(tensor: torch.Tensor) -> bool:
    """Whether ``tensor`` is a leaf that requires a gradient (a parameter) or a view of one (``weight.t()``,
    which eager code saves for a product's backward): the parameter's storage, not memory the step made."""
    base = tensor if tensor._base is None else tensor._base
    return base.grad_fn is None and base.requires_grad


def backward_accumulates(accumulator: Any) -> bool:
    """Whether the backward running now accumulates into ``.grad`` through ``accumulator``
    (``loss.backward()`` does; ``torch.autograd.grad`` does not)."""
    try:
        return bool(torch._C._will_engine_execute_node(accumulator))
    except RuntimeError:  # "a leaf node was passed ... while running autograd.grad()"
        return False


def current_graph_task_id() -> int:
    """The id of the backward call the autograd engine is running on this thread (-1 outside one)."""
    return torch._C._current_graph_task_id()


def dispatch_modes_disabling_compile() -> list[str]:
    """Names of the ``TorchDispatchMode``s active on this thread under which ``torch.compile`` runs no
    compiled graph (``FlopCounterMode``, ``DebugMode``): those that do not ignore compile internals."""
    from torch.utils._python_dispatch import _get_current_dispatch_mode_stack

    return [
        type(mode).__name__
        for mode in _get_current_dispatch_mode_stack()
        if not getattr(type(mode), "ignore_compile_internals", lambda: False)()
    ]


def profiler_active() -> bool:
    """Whether a ``torch.profiler`` session is running, or warming up (a ``schedule``'s warmup steps
    prepare a session before it records): ckptc's own sessions cannot be nested in either.  One started
    in the caller's warmup took the prepared session over, and the caller's later stop crashed the
    process (exit 139).  Only while a ``torch.profiler.profile`` is open (its step counter is registered)
    are the open ones looked for (``gc.get_referrers`` of their classes, tens of milliseconds)."""
    if torch._C._autograd._profiler_enabled():
        return True
    from torch.profiler import ProfilerAction, profile

    if profiler_step_count() is None:
        return False
    classes, stack = [], [profile]
    while stack:
        cls = stack.pop()
        classes.append(cls)
        stack.extend(cls.__subclasses__())
    return any(
        isinstance(found, profile) and found.current_action == ProfilerAction.WARMUP and found.profiler is not None
        for found in gc.get_referrers(*classes)
    )


def profiler_step_count() -> int | None:
    """The step count an open ``torch.profiler.profile`` registers with Kineto's step tracker (from its
    construction to its exit), or None when none is open."""
    from torch.autograd.profiler import KinetoStepTracker
    from torch.profiler.profiler import PROFILER_STEP_NAME

    return KinetoStepTracker._step_dict.get(PROFILER_STEP_NAME)


def restore_profiler_step_count(count: int | None) -> None:
    """Put back the step count :func:`profiler_step_count` read before a profiler session of ckptc's own:
    every ``torch.profiler.profile`` registers under one name and erases it at its exit, the caller's
    open profiler's count with it."""
    from torch.autograd.profiler import KinetoStepTracker
    from torch.profiler.profiler import PROFILER_STEP_NAME

    if count is None:
        KinetoStepTracker._step_dict.pop(PROFILER_STEP_NAME, None)
    else:
        KinetoStepTracker._step_dict[PROFILER_STEP_NAME] = count


def active_ddp_module() -> Any:
    """The ``DistributedDataParallel`` module whose forward is running (DDP sets it for Dynamo), or None."""
    from torch.nn.parallel import DistributedDataParallel

    return DistributedDataParallel._get_active_ddp_module()


def local_shard(tensor: torch.Tensor) -> torch.Tensor:
    """A ``DTensor``'s local shard without dispatching (works inside fake-tensor tracing); other tensors as given."""
    if not torch.distributed.is_available():
        return tensor
    from torch.distributed.tensor import DTensor

    return tensor._local_tensor if isinstance(tensor, DTensor) else tensor


def pass_missing_grads_as_none(outputs: Any, inputs: Sequence[Any]) -> bool:
    """Make the AOTAutograd function that produced ``outputs`` receive ``None`` for missing gradients.

    A compiled graph runs as one ``torch.autograd.Function``; by default autograd
    builds a tensor of zeros for each of its results that got no gradient.
    A custom Function's ``grad_fn`` is its ``ctx``, so this calls the public
    ``ctx.set_materialize_grads(False)`` on it.  The function is found from a
    result, directly or through the view AOTAutograd rebuilds outside it, and
    is one this call created: anything reachable from ``inputs`` (an earlier
    graph's function, seen through a result that aliases an input) is left
    alone.  Returns whether it was found.
    """

    def functions(tensor: Any) -> list[Any]:
        if not isinstance(tensor, torch.Tensor) or tensor.grad_fn is None:
            return []
        fn = tensor.grad_fn
        return [fn, *(f for f, _ in fn.next_functions if f is not None)]

    earlier: set[int] | None = None  # built only when a candidate turns up (inputs hold every parameter)
    for tensor in tree_leaves(outputs):
        for candidate in functions(tensor):
            forward_cls = getattr(type(candidate), "_forward_cls", None)
            if forward_cls is None or not hasattr(forward_cls, "_aot_id"):
                continue
            if earlier is None:
                earlier = {id(f) for t in inputs for f in functions(t)}
            if id(candidate) not in earlier:
                candidate.set_materialize_grads(False)
                return True
    return False


# nn.Module.__call__ runs `_compiled_call_impl` instead of `_call_impl` when it is set (the slot
# `model.compile()` fills); ckptc.apply fills it so the model keeps its class, forward and hooks.
# nn.Module.__getstate__ drops it, so copies of the model are plain.
_CALL_SLOT = "_compiled_call_impl"


def module_call_override(module: torch.nn.Module) -> Any:
    """What ``module(...)`` calls instead of its ``_call_impl`` (None: nothing)."""
    return module.__dict__.get(_CALL_SLOT)


def set_module_call_override(module: torch.nn.Module, call: Any) -> None:
    """Make ``module(...)`` call ``call`` instead of its ``_call_impl`` (None: back to it)."""
    if call is None:
        module.__dict__.pop(_CALL_SLOT, None)
    else:
        module.__dict__[_CALL_SLOT] = call


def is_fake(tensor: Any) -> bool:
    """Whether ``tensor`` is a fake tensor (shapes and dtypes, no storage)."""
    from torch._subclasses.fake_tensor import FakeTensor

    return isinstance(tensor, FakeTensor)


def clear_cublas_workspaces() -> None:
    """Give cuBLAS's and cuBLASLt's workspaces (one per handle and stream: each thread that ran a matrix
    product) back to the CUDA caching allocator; the next product on each thread allocates its own again
    (:func:`ckptc.meter._start_accelerator_span` then measures them)."""
    clear = getattr(torch._C, "_cuda_clearCublasWorkspaces", None)
    if clear is not None and torch.cuda.is_initialized():
        clear()


def record_cuda_memory_history(enabled: bool) -> None:
    """Start (with Python stacks) or stop recording the CUDA caching allocator's events, for
    :func:`cuda_memory_snapshot` (``bench/gpu_check.py --explain``)."""
    if enabled:
        torch.cuda.memory._record_memory_history(max_entries=2_000_000, stacks="python")
    else:
        torch.cuda.memory._record_memory_history(None)


def cuda_memory_snapshot() -> dict[str, Any]:
    """The caching allocator's segments and its recorded events (``device_traces``), each allocation with the
    Python frames that made it."""
    return torch.cuda.memory._snapshot()


def is_storeless(tensor: torch.Tensor) -> bool:
    """Whether ``tensor`` has no values: on the ``meta`` device or fake (offline planning)."""
    return tensor.device.type == "meta" or is_fake(tensor)


def fake_tensor_mode() -> tuple[Any, bool]:
    """The fake-tensor mode to capture under: the active one (the caller built the model in it), else a new one.

    Returns the mode and whether the caller must enter it.
    """
    from torch._guards import detect_fake_mode
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.symbolic_shapes import ShapeEnv

    active = detect_fake_mode()
    if active is not None:
        if active.shape_env is None:
            # Sizes that depend on data (``nonzero``: tokens routed to an expert) need symbols to stand for them.
            active.shape_env = ShapeEnv()
        return active, False
    return FakeTensorMode(allow_non_fake_inputs=True, shape_env=ShapeEnv()), True


def storage_ref(tensor: torch.Tensor) -> Any:
    """A weak reference to ``tensor``'s storage (``.expired()`` once it is freed, whichever tensors,
    views or saved copies held it; ``.cdata`` names it): liveness of memory, not of a Python object.
    None for a tensor without one storage (sparse, nested, a tensor subclass without storage)."""
    try:
        return storage_key(tensor)
    except (RuntimeError, NotImplementedError, TypeError):
        return None
