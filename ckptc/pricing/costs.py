"""Cost model: price every node of a joint forward+backward graph.

One pass, :func:`annotate_costs`, walks the aten-level joint graph in order and
writes a :class:`NodeCost` into ``node.meta["ckptc"]``: which phase the node
belongs to, the bytes of storage it allocates (views and aliases share their
base's storage and are counted once), the FLOPs to recompute it, the source
module it came from and a stable readable name.  :func:`measure_runtimes` can
replace FLOPs by measured seconds.  Nothing here allocates real tensors except
the optional runtime measurement.

The prices depend on the compiler that will run the plan (``compiler``):

* ``"eager"`` runs op by op, so a pointwise op costs the elements it reads
  and writes;
* ``"inductor"`` fuses chains of pointwise ops into one kernel, so a
  recomputed pointwise op costs only the elements it reads from outside its
  chain (the chain's intermediates never reach memory), and keeping a value
  costs its traffic (``keep_cost``: written in forward, read in backward),
  which the planner weighs against recomputing it
  (:func:`ckptc.planning.planner.for_target_compiler`); and a pointwise output that
  only one fused op or reduction of its own phase reads never reaches memory
  (0 bytes, :func:`inlined_in_kernels`), so it is never kept: backward recomputes
  it inside the kernel that reads it (kept, it would be written at bytes no plan
  counted).
"""

from __future__ import annotations

import logging
import operator
import re
import time
from collections import Counter
from dataclasses import dataclass, replace
from typing import Any, Hashable, Iterable, NamedTuple

import torch
import torch.fx as fx
from torch.utils.flop_counter import flop_registry

from ckptc._torch_internals import (
    RUN_MEMORY_FORMAT,
    is_mutable_op,
    is_op_overload,
    is_pointwise_op,
    is_random_op,
    is_reduction_op,
    is_tangent,
    op_name,
    op_schema_name,
    outside_fake_mode,
    profiler_active,
    profiler_events,
    storage_key,
    tree_leaves,
    tree_map,
    upper_bound,
)
from ckptc.errors import UnboundedSizeError, UntraceableModelError
from ckptc.meter import quiet_profiler
from ckptc.pricing.devices import kernel_workspace_bytes, memory_model

log = logging.getLogger("ckptc.pricing.costs")

INPUT, FORWARD, BACKWARD = "input", "forward", "backward"

#: Compilers whose kernels fuse chains of pointwise ops (priced by :func:`fused_flops`).
FUSING_COMPILERS = ("inductor",)
#: ``NodeCost.fusion`` of the kernels that compute the pointwise values they read inside themselves
#: (as ``solvers.simulator`` reads ``solvers.Node.fusion``).
FUSING_KERNELS = ("pointwise", "reduction")


@dataclass(frozen=True)
class NodeCost:
    """What one joint-graph node costs.

    Attributes:
        kind: ``"input"`` (parameters, buffers, user inputs), ``"forward"`` or
            ``"backward"`` (tangents count as backward: autograd creates them
            when backward starts; so does every op traced after backward began,
            even one no gradient flows into, since eager runs it in backward).
        bytes: storage bytes the node allocates; 0 for a view or alias.
        flops: floating-point operations to (re)compute it.  Pointwise ops and
            reductions are counted by elements touched; under a fusing
            compiler a pointwise op counts only the elements it reads from
            outside its fused chain (:func:`fused_flops`).
        alias_of: name of the node whose storage this one views, if any.
        op: the operator's name (``mm``, ``add``, ``getitem``...).
        part_of: for a ``getitem`` of a multi-output op, that op's node: the
            op allocates all outputs (its ``bytes`` is their sum) and this node
            takes over its own output's ``bytes`` from it.
        module: dotted path of the ``nn.Module`` it came from ("" if unknown).
        stable_name: ``module.op`` with an ordinal, e.g. ``layers.3.attn.mm_1``;
            stable across runs of the same model, used in plan files and reports.
        random: it draws from a random number generator (dropout, rand, ...).
        seconds: measured run time, if :func:`measure_runtimes` ran.
        scratch_bytes: memory the op allocates while it runs and frees before
            it returns (im2col buffers, oneDNN reorders), if
            :func:`measure_scratch` ran.
        keep_cost: what keeping its output for backward costs, in the units
            of :attr:`cost`: its elements written once and read once.
        fusion: how a fusing compiler runs it (``solvers.Node.fusion``): ``"pointwise"`` (:attr:`fused`),
            ``"reduction"`` (a kernel that computes the fused values it reads), ``"absorbed"`` (a
            matrix product computed inside the add that reads it, :func:`absorbed_matmuls`), else ``""``.
        inlined: a fused op whose output never reaches memory (:func:`inlined_in_kernels`):
            it has no bytes, and it cannot be kept (a kept output would be written), so
            backward recomputes it inside the kernel that reads it.
    """

    kind: str
    bytes: int
    flops: int
    alias_of: str | None
    module: str
    stable_name: str
    part_of: str | None = None
    op: str = ""
    random: bool = False
    seconds: float | None = None
    scratch_bytes: int = 0
    keep_cost: float = 0.0
    fusion: str = ""
    inlined: bool = False

    @property
    def fused(self) -> bool:
        """A pointwise op that a fusing compiler computes inside the kernel of its consumer
        (False under the eager compiler)."""
        return self.fusion == "pointwise"

    @property
    def cost(self) -> float:
        """Recompute cost: measured seconds when available, else FLOPs."""
        return self.seconds if self.seconds is not None else float(self.flops)


def _forward_results_and_inputs(joint: fx.GraphModule, num_fwd_outputs: int | None) -> set[fx.Node]:
    """The joint graph's forward results and the nodes they are computed from (none if not given)."""
    if not num_fwd_outputs:
        return set()
    output = next(iter(joint.graph.find_nodes(op="output")))
    stack = [a for a in tree_leaves(output.args[0][:num_fwd_outputs]) if isinstance(a, fx.Node)]
    found: set[fx.Node] = set()
    while stack:
        node = stack.pop()
        if node not in found and node.op == "call_function":
            found.add(node)
            stack.extend(node.all_input_nodes)
    return found


def annotate_costs(
    joint: fx.GraphModule, compiler: str = "eager", num_fwd_outputs: int | None = None
) -> dict[fx.Node, NodeCost]:
    """Write a :class:`NodeCost` into ``node.meta["ckptc"]`` for every node.

    ``compiler`` is the one that will run the plan (see the module docstring).
    ``num_fwd_outputs``: how many leading outputs of the joint graph are the forward's results
    (AOTAutograd's partitioner gets it); those and what they are computed from are forward ops
    wherever the trace put them.  Requires fake-tensor metadata (``node.meta["val"]``), which
    AOTAutograd and ``make_fx`` graphs carry.  Returns the same mapping for convenience.
    """
    fusing = compiler in FUSING_COMPILERS
    forward_results = _forward_results_and_inputs(joint, num_fwd_outputs)
    tangent_dependent: set[fx.Node] = set()
    backward_started = False
    storage_owner: dict[Hashable, str] = {}
    root_of: dict[str, str] = {}
    name_counts: Counter[str] = Counter()
    costs: dict[fx.Node, NodeCost] = {}
    for node in joint.graph.nodes:
        if node.op == "output":
            continue
        inputs = node.all_input_nodes
        if is_tangent(node) or any(n in tangent_dependent for n in inputs):
            tangent_dependent.add(node)
            backward_started = backward_started or node.op == "call_function"
        if node.op in ("placeholder", "get_attr"):
            kind = BACKWARD if is_tangent(node) else INPUT
        else:
            # Ops traced after backward began are backward ops even when no gradient flows
            # into them (RMSNorm's backward re-derives x * rsqrt): eager runs them in
            # backward, so keeping them from forward would hold memory eager never holds.
            # Buffer updates (copy_ of BatchNorm statistics) come last in the graph but belong to forward.
            # A forward result can come after backward began too (a view of an MoE layer's index_add
            # output): the forward returns it, so it and what it is made from are forward ops.
            born_in_backward = backward_started and not is_mutable_op(node.target) and node not in forward_results
            kind = BACKWARD if node in tangent_dependent or born_in_backward else FORWARD

        new_bytes, alias_root = _storage_bytes(node, storage_owner)
        part_of = _part_of(node)
        alias_of = None
        if alias_root is not None:
            # Name the argument this node views (the simulator follows the chain).
            alias_of = next((n.name for n in inputs if root_of.get(n.name) == alias_root), None)
        root_of[node.name] = root_of.get(alias_of, alias_of) if alias_of else node.name
        module = _module_path(node)
        op_name = _op_name(node)
        base = f"{module}.{op_name}" if module else op_name
        if node.op == "placeholder":
            base = f"input.{node.target}"
        ordinal = name_counts[base]
        name_counts[base] += 1
        fused = fusing and is_fused(node)
        cost = NodeCost(
            kind=kind,
            bytes=new_bytes,
            flops=0 if node.op != "call_function" else fused_flops(node) if fused else count_flops(node),
            alias_of=alias_of,
            part_of=part_of,
            module=module,
            stable_name=base if ordinal == 0 else f"{base}_{ordinal}",
            op=op_name,
            random=is_random(node),
            fusion="pointwise" if fused else "reduction" if fusing and _is_reduction(node) else "",
            keep_cost=2.0 * _output_elements(node) if new_bytes else 0.0,
        )
        node.meta["ckptc"] = cost
        costs[node] = cost
    if fusing:
        absorbed = absorbed_matmuls(costs)
        for node in absorbed:
            # The add that absorbs the product is an extern addmm: it reads its other operand from memory
            # (written by its own kernel, not computed inline) and computes nothing inline itself.
            (add,) = node.users
            costs[add] = add.meta["ckptc"] = replace(costs[add], fusion="")
        for node in inlined_in_kernels(costs):
            costs[node] = node.meta["ckptc"] = replace(costs[node], bytes=0, keep_cost=0.0, inlined=True)
        for node in absorbed:
            costs[node] = node.meta["ckptc"] = replace(
                costs[node], bytes=0, keep_cost=0.0, inlined=True, fusion="absorbed"
            )
    return costs


def absorbed_matmuls(costs: dict[fx.Node, NodeCost]) -> list[fx.Node]:
    """Matrix products Inductor computes inside the add that reads them (``mm`` then ``add`` becomes one
    ``addmm``, ``torch._inductor.fx_passes.post_grad.addmm``): the product is never written on its own,
    and what it reads is read where the add runs (for the weight shared by an embedding and an output
    layer, at the end of backward).  On GPUs Inductor keeps them apart when only pointwise ops read the sum.
    """
    found = []
    for node, cost in costs.items():
        if _op_name(node) != "mm" or len(node.users) != 1 or not cost.bytes:
            continue
        (add,) = node.users
        if add.target is not torch.ops.aten.add.Tensor or add.kwargs or costs[add].kind != cost.kind:
            continue
        others = [a for a in add.args if a is not node]
        product, other = node.meta.get("val"), others[0].meta.get("val") if len(others) == 1 else None
        if not isinstance(other, torch.Tensor) or not isinstance(product, torch.Tensor):
            continue
        if other.dtype != product.dtype or not _expandable(other.shape, product.shape):
            continue
        if product.device.type != "cpu" and all(costs.get(u, cost).fused for u in add.users):
            continue
        found.append(node)
    return found


def _expandable(shape: Any, target: Any) -> bool:
    """``shape`` broadcasts to ``target``; False where a size is symbolic (unknown here, and comparing it
    would put a guard on a data-dependent size)."""
    if len(shape) > len(target) or not all(isinstance(d, int) for d in (*shape, *target)):
        return False
    return all(a == 1 or a == b for a, b in zip(reversed(shape), reversed(target), strict=False))


def inlined_in_kernels(costs: dict[fx.Node, NodeCost]) -> list[fx.Node]:
    """Fused pointwise ops whose outputs a fusing compiler never writes to memory.

    Inductor computes a pointwise op inside the kernel of its consumer when that
    consumer is a pointwise op or a reduction, so an output that only such ops of
    its own phase read (not backward, not a view, not a graph output) stays in
    registers, unless its expression (with the inlined values it reads) exceeds
    :class:`ExpressionLimits`.  With several readers, each computes it again, which
    Inductor does only for a light expression (``should_realize_on_reuse``): one
    that reads at most :data:`REUSED_READS_LIMIT` buffers and, on CPUs, has none of
    :data:`HEAVY_OPS`.  A forward value that backward reads is written when kept,
    so it keeps its bytes.
    """

    def computes_it_inline(user: fx.Node, kind: str) -> bool:
        cost = costs.get(user)
        return cost is not None and cost.kind == kind and cost.fusion in FUSING_KERNELS

    def buffer_read(arg: fx.Node) -> fx.Node | None:
        """The buffer a kernel reads for ``arg``: its view's base; None for what Inductor makes an
        index expression or a constant (``iota``, ``full``)."""
        while costs.get(arg) is not None and costs[arg].alias_of is not None and arg.all_input_nodes:
            arg = arg.all_input_nodes[0]
        if arg.op == "call_function" and _op_name(arg) in ("iota", "arange", "full", "scalar_tensor"):
            return None
        return arg

    inlined: dict[fx.Node, None] = {}  # in graph order
    reads: dict[fx.Node, frozenset[fx.Node]] = {}  # a fused value's expression: buffers read ...
    ops: dict[fx.Node, list[str]] = {}  # ... and ops
    for node, cost in costs.items():
        if not cost.fused:
            continue
        chain = [arg for arg in node.all_input_nodes if arg in inlined]
        buffers = {buffer_read(a) for a in node.all_input_nodes if a not in chain} - {None}
        reads[node] = frozenset(buffers).union(*(reads[a] for a in chain))
        ops[node] = [cost.op, *(op for a in chain for op in ops[a])]
        if not cost.bytes or not node.users or not all(computes_it_inline(u, cost.kind) for u in node.users):
            continue
        cpu = all(t.device.type == "cpu" for t in tree_leaves(node.meta.get("val")) if isinstance(t, torch.Tensor))
        limits = CPU_EXPRESSION_LIMITS if cpu else EXPRESSION_LIMITS
        if len(reads[node]) > limits.reads or len(ops[node]) > limits.ops:
            continue  # Inductor writes a long expression out (``has_exceeded_max_reads``)
        if len(node.users) == 1 or (
            len(reads[node]) <= REUSED_READS_LIMIT and not (cpu and HEAVY_OPS.intersection(ops[node]))
        ):
            inlined[node] = None
    return list(inlined)


class ExpressionLimits(NamedTuple):
    """How large an expression Inductor computes inside its readers' kernels before it writes it out."""

    reads: int  # buffers read (``realize_acc_reads_threshold``)
    ops: int  # ops (``realize_opcount_threshold``)


EXPRESSION_LIMITS = ExpressionLimits(reads=8, ops=30)
CPU_EXPRESSION_LIMITS = ExpressionLimits(reads=12, ops=50)  # ``realize_cpu_*`` thresholds
#: A value read by several kernels is computed inside each only if its expression reads at most
#: this many buffers (``realize_reads_threshold``) and, on CPUs, has none of :data:`HEAVY_OPS`
#: (``should_realize_on_reuse``).
REUSED_READS_LIMIT = 4
HEAVY_OPS = frozenset({"exp", "log", "log10", "log1p", "log2", "sigmoid", "tanh"})


def priced_size(value: Any, what: str = "a size") -> int:
    """A size (bytes, elements, FLOPs) as a concrete int, at the top of its range if symbolic.

    Data-dependent sizes (tokens routed to an expert) and dynamic dimensions are
    priced at the largest value they can take, so a plan that fits at that size
    fits at every size the graph can run with.

    Raises:
        UnboundedSizeError: the size depends on data without a known upper
            bound (a size read with ``.item()``), so no price is safe.
    """
    top = upper_bound(value)
    if top is None:
        raise UnboundedSizeError(
            f"ckptc cannot price {what} of the captured graph: it is {value}, which depends on the data with no "
            "upper bound known, so no plan could promise to fit the budget.\n"
            "What to do: bound it where it is computed (torch._check(n <= N) after n = t.item()), or compute it "
            "outside the model's forward."
        )
    return top


def _numel(t: torch.Tensor) -> int:
    return priced_size(t.numel(), "the number of elements of a tensor")


def _is_reduction(node: fx.Node) -> bool:
    return node.op == "call_function" and is_reduction_op(node.target)


def is_fused(node: fx.Node) -> bool:
    """True for ops a fusing compiler computes inside their consumers' kernels: pointwise ops
    that draw no random numbers (those run as eager kernels under ckptc, see
    :func:`ckptc._torch_internals.inductor_compile`), and the ops Inductor lowers to pointwise
    expressions: constants (``full``) and scatters into a slice or an index (``where`` on the index)."""
    if node.op != "call_function" or is_random_op(node.target):
        return False
    return is_pointwise_op(node.target) or _op_name(node) in _LOWERED_TO_POINTWISE


_LOWERED_TO_POINTWISE = frozenset({"full", "select_scatter", "slice_scatter"})


def fused_flops(node: fx.Node) -> int:
    """What recomputing the pointwise ``node`` adds inside a fused kernel: the elements it reads
    from values outside its fused chain (kept activations, inputs, matmul outputs), one per element.
    Its output and the values of the chain it reads stay in registers."""
    return sum(
        _output_elements(arg) for arg in node.all_input_nodes if not (arg.op == "call_function" and is_fused(arg))
    )


def written_bytes(node: fx.Node) -> int:
    """The bytes of ``node``'s outputs once written to memory (an inlined value's, when it is kept),
    as the device's allocator counts them (see :func:`_storage_bytes`)."""
    return sum(
        memory_model(t.device).storage_bytes(_numel(t) * t.element_size())
        for t in tree_leaves(node.meta.get("val"))
        if isinstance(t, torch.Tensor)
    )


def _output_elements(node: fx.Node) -> int:
    return sum(_numel(t) for t in tree_leaves(node.meta.get("val")) if isinstance(t, torch.Tensor))


def is_random(node: fx.Node) -> bool:
    """True for ops that draw from a random number generator."""
    return is_random_op(node.target)


def _storage_bytes(node: fx.Node, storage_owner: dict[Hashable, str]) -> tuple[int, str | None]:
    """Bytes of storage first allocated by ``node``, and the node it aliases.

    Storage identity of the fake tensors decides aliasing, so every view op is
    recognised without an op list.  A multi-output op allocates all its
    outputs; each ``getitem`` then takes over the storage it extracts (see
    ``part_of`` in :class:`NodeCost`), so outputs die one by one.
    """
    val = node.meta.get("val")
    tensors = [t for t in tree_leaves(val) if isinstance(t, torch.Tensor)]
    multi_output = isinstance(val, (tuple, list))
    new_bytes = 0
    aliased: str | None = None
    for t in tensors:
        try:
            ref = storage_key(t)
            nbytes = t.untyped_storage().nbytes()
        except (NotImplementedError, RuntimeError):  # e.g. sparse or nested tensors
            new_bytes += _numel(t) * t.element_size()
            continue
        # What the device's allocator counts for it (the CUDA caching allocator rounds to blocks).
        nbytes = memory_model(t.device).storage_bytes(priced_size(nbytes, f"the bytes of {node.name}"))
        owner = storage_owner.get(ref)
        if owner is None:
            if not multi_output:
                storage_owner[ref] = node.name
            new_bytes += nbytes
        elif aliased is None:
            aliased = owner
    if new_bytes:
        # A node that allocates anything owns its storage; partial aliasing of an
        # input (rare: ops returning one view and one new tensor) is ignored.
        return new_bytes, None
    return 0, aliased


def _part_of(node: fx.Node) -> str | None:
    """The multi-output node whose output this ``getitem`` extracts, if any."""
    if node.target is operator.getitem and isinstance(node.args[0], fx.Node):
        if isinstance(node.args[0].meta.get("val"), (tuple, list)):
            return node.args[0].name
    return None


_PATH_PART = re.compile(r"\['([^']*)'\]|\[(\d+)\]")


def _module_path(node: fx.Node) -> str:
    """Dotted path of the innermost module that produced ``node``."""
    stack = node.meta.get("nn_module_stack") or node.meta.get("fwd_nn_module_stack")
    if not stack:
        return ""
    path = list(stack.values())[-1][0]
    return normalize_module_path(path)


def normalize_module_path(path: str) -> str:
    """``L['self'].h[0].attn`` / ``L__self___h_0_attn``-style paths to ``h.0.attn``."""
    path = re.sub(r"^L\['[^']*'\]", "", path)
    path = _PATH_PART.sub(lambda m: "." + (m.group(1) or m.group(2)), path)
    path = re.sub(r"\._modules\.|\._parameters\.|\._buffers\.", ".", path)
    return path.strip(".").replace("..", ".")


def _op_name(node: fx.Node) -> str:
    if node.op != "call_function":
        return str(node.target)
    target = node.target
    if target is operator.getitem:
        return "getitem"
    return op_name(target)


def _vals(args: Any) -> Any:
    return torch.fx.node.map_arg(args, lambda n: n.meta.get("val"))


def count_flops(node: fx.Node) -> int:
    """FLOPs of one aten node from its fake-tensor metadata (see :func:`op_flops`)."""
    if not is_op_overload(node.target):
        return 0
    return op_flops(node.target, _vals(node.args), _vals(node.kwargs), node.meta.get("val"), node.name)


def op_flops(target: Any, args: Any, kwargs: Any, out: Any, name: str = "an op") -> int:
    """FLOPs of one call of the aten op ``target`` (fake or real tensors).

    Matmuls, convolutions and attention use ``torch.utils.flop_counter``'s
    formulas; every other op is priced by the elements it reads and writes, so
    pointwise ops and reductions are cheap but never free.  Views cost 0.
    """
    formula = flop_registry.get(target.overloadpacket)
    if formula is not None:
        try:
            return priced_size(formula(*args, **kwargs, out_val=out), f"the FLOPs of {name}")
        except UntraceableModelError:
            raise
        except Exception:  # a formula that does not fit this overload's arguments
            log.debug("flop formula failed for %s", target, exc_info=True)
    if "scaled_dot_product" in op_name(target):
        return priced_size(_attention_flops(op_name(target), args), f"the FLOPs of {name}")
    if target.is_view or op_schema_name(target) in ("aten::alias",):
        return 0
    touched = 0
    for t in tree_leaves((args, kwargs, out)):
        if isinstance(t, torch.Tensor):
            touched += _numel(t)
    return touched


def _attention_flops(opname: str, args: Iterable[Any]) -> int:
    """FLOPs of fused attention kernels the flop counter does not know (CPU ones)."""
    q, k = list(args)[:2]
    *batch, lq, d = q.shape
    lk = k.shape[-2]
    b = 1
    for s in batch:
        b *= s
    forward = 4 * b * lq * lk * d
    return forward * 2 if "backward" in opname else forward


def measure_runtimes(joint: fx.GraphModule, repeats: int = 3) -> None:
    """Time each forward node on real random tensors and store it in the meta.

    An optional estimator: recompute cost becomes measured seconds instead of
    FLOPs (the minimum over ``repeats`` runs).  Ops a fusing compiler fuses
    (``NodeCost.fused``) are not timed alone, which would price a kernel launch
    and a round trip to memory that the fused kernel does not make: they, and
    every value's ``keep_cost``, are priced by their element counts times the
    measured seconds per element of a streaming read.  Timing the compiled
    fused regions themselves would need one Inductor compile per region, which
    costs more than planning.  Needs :func:`annotate_costs` first.
    """
    with outside_fake_mode():
        _measure_runtimes(joint, repeats, _seconds_per_element(repeats))


def _seconds_per_element(repeats: int, elements: int = 1 << 22) -> float:
    """Seconds to read one float32 element as a kernel streaming through memory does (sum of 4M floats)."""
    x = torch.rand(elements)
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        x.sum()
        best = min(best, time.perf_counter() - start)
    return best / elements


def _measure_runtimes(joint: fx.GraphModule, repeats: int, per_element: float) -> None:
    real: dict[fx.Node, Any] = {}
    materialize = _materialize
    for node in joint.graph.nodes:
        cost: NodeCost | None = node.meta.get("ckptc")
        if cost is None or node.op == "output":
            continue
        if node.op != "call_function" or cost.kind != FORWARD or cost.fused:
            real[node] = tree_map(materialize, node.meta.get("val"))
            if cost.fused and cost.kind == FORWARD:
                node.meta["ckptc"] = replace(
                    cost, seconds=cost.flops * per_element, keep_cost=cost.keep_cost * per_element
                )
            continue
        args = torch.fx.node.map_arg(node.args, lambda n: real[n])
        kwargs = torch.fx.node.map_arg(node.kwargs, lambda n: real[n])
        best = float("inf")
        result = None
        for _ in range(repeats):
            start = time.perf_counter()
            result = node.target(*args, **kwargs)
            best = min(best, time.perf_counter() - start)
        real[node] = result
        node.meta["ckptc"] = replace(cost, seconds=best, keep_cost=cost.keep_cost * per_element)


def _materialize(v: Any, memory_format: torch.memory_format | None = None, sizes: dict[int, int] | None = None) -> Any:
    """A real tensor laid out like a fake one (same strides: kernels copy
    non-contiguous inputs, and that copy is scratch memory too), or in
    ``memory_format`` where the compiler writes it so: random floats,
    zeros for integers (safe indices), ones for booleans; symbolic sizes at
    their upper bound.  ``sizes`` maps sizes to the smaller ones to make it at
    (:func:`_shrunk_sizes`), dense in the same order of strides."""
    if sizes:
        if isinstance(v, torch.Tensor):
            shape = tuple(sizes.get(n, n) for n in _priced_shape(v.shape))
            if memory_format is not None:
                return _filled(torch.empty(shape, dtype=v.dtype, device=v.device, memory_format=memory_format))
            return _filled(
                torch.empty_strided(
                    shape, _dense_strides(shape, _priced_shape(v.stride())), dtype=v.dtype, device=v.device
                )
            )
        if isinstance(v, (torch.SymInt, torch.SymFloat)):
            v = priced_size(v, "a size argument")
        return sizes.get(v, v) if type(v) is int else v
    if isinstance(v, torch.Tensor):
        shape = _priced_shape(v.shape)
        try:
            if memory_format is not None:
                real = torch.empty(shape, dtype=v.dtype, device=v.device, memory_format=memory_format)
            else:
                # Filled as the flat storage it views: strides may overlap (an expanded input, stride 0),
                # and an in-place fill of overlapping memory is refused.
                strides = _priced_shape(v.stride())
                extent = 1 + sum((n - 1) * st for n, st in zip(shape, strides, strict=True)) if all(shape) else 0
                flat = _filled(torch.empty(extent, dtype=v.dtype, device=v.device))
                return flat.as_strided(shape, strides)
        except RuntimeError:  # layouts without strides (sparse, nested)
            real = torch.empty(shape, dtype=v.dtype, device=v.device)
        return _filled(real)
    if isinstance(v, (torch.SymInt, torch.SymFloat)):
        # A real op given a symbolic size would pin it to one value (the graph would lose its range).
        return priced_size(v, "a size argument")
    return v


def _filled(real: torch.Tensor) -> torch.Tensor:
    """``real`` filled in place: random floats, zeros for integers (safe indices), ones for booleans."""
    if real.dtype.is_floating_point or real.dtype.is_complex:
        return real.normal_()
    return real.fill_(1 if real.dtype == torch.bool else 0)


def _dense_strides(shape: tuple[int, ...], strides: tuple[int, ...]) -> tuple[int, ...]:
    """Strides of a dense tensor of ``shape`` whose dimensions are ordered as ``strides`` orders them
    (innermost first); broadcast dimensions (stride 0) stay broadcast."""
    dense = [0] * len(shape)
    step = 1
    for i in sorted(range(len(shape)), key=lambda i: (strides[i], shape[i])):
        if strides[i]:
            dense[i] = step
            step *= max(shape[i], 1)
    return tuple(dense)


def _materialize_node(node: fx.Node, sizes: dict[int, int] | None = None) -> Any:
    """:func:`_materialize` of a node's value, in the layout the compiler runs it in."""
    return _materialize(node.meta.get("val"), node.meta.get(RUN_MEMORY_FORMAT), sizes)


def _priced_shape(sizes: Iterable[Any]) -> tuple[int, ...]:
    """Sizes or strides at the top of their ranges (see :func:`priced_size`)."""
    return tuple(priced_size(s, "a dimension") for s in sizes)


def _signature(node: fx.Node) -> tuple:
    def describe(v: Any) -> Any:
        if isinstance(v, fx.Node):
            val = v.meta.get("val")
            if isinstance(val, torch.Tensor):
                layout = v.meta.get(RUN_MEMORY_FORMAT) or _priced_shape(val.stride())
                return ("T", _priced_shape(val.shape), layout, val.dtype, val.device)
            return ("V", repr(val))
        return repr(v)

    leaves = tree_leaves((node.args, node.kwargs), is_leaf=lambda x: isinstance(x, fx.Node))
    return (node.target, tuple(describe(a) for a in leaves))


class OpMemory(NamedTuple):
    """What one run of an op on random data showed about its memory (:func:`measure_scratch`)."""

    #: Bytes it allocated and freed before returning.
    scratch_bytes: int
    #: Bytes its output's storage holds beyond the output's elements: a kernel that reduces
    #: inside a buffer it allocated returns its result in that buffer (the CPU ``mse_loss``
    #: returns a scalar whose storage is the elementwise loss), which stays allocated as long
    #: as the result does.
    surplus_bytes: int = 0


def measure_scratch(joint: fx.GraphModule, known: dict[tuple, OpMemory] | None = None) -> int:
    """Measure the temporary memory each op allocates while it runs, and what its output really holds.

    Kernels allocate workspace that their outputs do not show: CPU
    convolutions' im2col buffers, oneDNN reorders, cuDNN workspaces, a CUDA
    kernel's copy of an input it needs laid out otherwise.  The budget counts
    it, so the simulator must too.  Each distinct op (target, argument shapes,
    strides and device) runs once on random tensors, in isolation, on the
    device the graph runs on: on the CPU the allocator's events give its peak
    above its end level, on an accelerator the allocator's peak counter does
    (:func:`_scratch_on_accelerator`).  An output whose storage the kernel
    allocated larger than its elements (a reduction returned inside its
    elementwise buffer) is priced at that storage (:attr:`OpMemory.surplus_bytes`):
    fake tensors show only the elements.  An op whose inputs and outputs take
    more than :data:`FULL_SIZE_SCRATCH_BYTES` runs with its largest sizes
    shrunk and its scratch scaled up (:func:`_shrunk_sizes`), so a step far
    larger than this machine (planned under fake tensors) is priced too.  Ops
    that cannot run on random data (data-dependent ones) are skipped (0 bytes).
    Ops on a device this process cannot reach (a plan for CUDA made without a
    GPU) are priced from their kernels' known workspaces where
    :func:`~ckptc.pricing.devices.kernel_workspace_bytes` has them (flash
    attention's backward), else at 0 bytes (logged; the run-time check measures
    what that leaves out).  ``known`` maps signatures
    measured before (by an earlier graph, or the same graph planned again) to
    their scratch: those are not run again, and what this call measures is
    added to it.  Needs :func:`annotate_costs` first.  Returns the number of
    distinct ops run.
    """
    by_signature: dict[tuple, list[fx.Node]] = {}
    for node in joint.graph.nodes:
        if node.op == "call_function" and is_op_overload(node.target) and "ckptc" in node.meta:
            if node.target.is_view:
                continue
            by_signature.setdefault(_signature(node), []).append(node)
    if known is not None:
        for signature in [sig for sig in by_signature if sig in known]:
            for node in by_signature.pop(signature):
                _price_memory(node, known[signature])
    on_device: dict[torch.device, dict[tuple, fx.Node]] = {}
    for signature, nodes in by_signature.items():
        on_device.setdefault(_node_device(nodes[0]), {})[signature] = nodes[0]
    measured: dict[tuple, OpMemory] = {}
    # Random ops (dropout allocates a temporary mask) run too; fork_rng keeps the
    # program's random stream as it was.
    unreachable = [d for d in on_device if d.type != "cpu" and not torch.get_device_module(d.type).is_available()]
    for device in unreachable:
        unmeasured = on_device.pop(device)
        modelled = {signature: _modelled_scratch(node, device) for signature, node in unmeasured.items()}
        measured.update({signature: memory for signature, memory in modelled.items() if memory is not None})
        log.info(
            "kernels' scratch memory on %s: no %s device here to measure it on; %d of %d distinct ops priced "
            "from their kernels' known workspaces, the rest at 0 bytes (the run-time check measures what that "
            "leaves out on the first step)",
            device,
            device.type,
            sum(memory is not None for memory in modelled.values()),
            len(unmeasured),
        )
    cpu = torch.device("cpu")
    if cpu in on_device and profiler_active():
        # The CPU's events come from a torch.profiler session of ckptc's own, and one started inside the
        # caller's ends the caller's (profilers do not nest): it was left empty.  Priced at 0 here and not
        # remembered, so a graph compiled outside the profiler measures them; the run-time check measures
        # what a plan made now leaves out on its first step outside the profiler.
        unmeasured = on_device.pop(cpu)
        log.info(
            "kernels' scratch memory of %d distinct CPU ops priced at 0 bytes: a torch.profiler session runs, "
            "and measuring it would end that session",
            len(unmeasured),
        )
    with outside_fake_mode(), torch.random.fork_rng(devices=[d for d in on_device if d.type == "cuda"]):
        for device, nodes in on_device.items():
            if device.type == "cpu":
                measured.update(_scratch_on_cpu(nodes))
            else:
                measured.update(_scratch_on_accelerator(nodes, device))
    for signature, memory in measured.items():
        for node in by_signature[signature]:
            _price_memory(node, memory)
        if known is not None:
            known[signature] = memory
    failed = [node for nodes in on_device.values() for signature, node in nodes.items() if signature not in measured]
    if failed:
        names = sorted({op_name(node.target) for node in failed})
        log.info(
            "kernels' scratch of %d distinct ops is priced at 0 bytes: they could not run on random data here "
            "(data-dependent, or shrunk sizes their shapes do not allow, and too large to run at full size): %s",
            len(failed),
            ", ".join(names[:8]) + (", ..." if len(names) > 8 else ""),
        )
    return len(measured)


def _modelled_scratch(node: fx.Node, device: torch.device) -> OpMemory | None:
    """``node``'s scratch from its kernel's known workspaces (:func:`kernel_workspace_bytes`), or None."""
    args = _vals(node.args)
    tensors = [a for a in args if isinstance(a, torch.Tensor)]
    if not tensors:
        return None
    shapes = [tuple(priced_size(size) for size in a.shape) if isinstance(a, torch.Tensor) else None for a in args]
    nbytes = kernel_workspace_bytes(node.target, shapes, tensors[0].element_size(), device)
    return None if nbytes is None else OpMemory(nbytes)


def _price_memory(node: fx.Node, memory: OpMemory) -> None:
    """Record ``memory`` in ``node``'s cost: its scratch, and its bytes grown by the surplus where
    it allocates one tensor of its own (not a view, not one output of several)."""
    cost = node.meta["ckptc"]
    val = node.meta.get("val")
    nbytes = cost.bytes
    if memory.surplus_bytes and cost.bytes and cost.alias_of is None and isinstance(val, torch.Tensor):
        elements = priced_size(val.untyped_storage().nbytes(), f"the bytes of {node.name}")
        nbytes = memory_model(val.device).storage_bytes(elements + memory.surplus_bytes)
    node.meta["ckptc"] = replace(cost, scratch_bytes=memory.scratch_bytes, bytes=max(nbytes, cost.bytes))


def _surplus_bytes(out: Any, args: Any, kwargs: Any) -> int:
    """Bytes the storage of ``out`` (one tensor the op allocated) holds beyond its elements; 0 for an
    output that is not one tensor, or that shares an argument's storage (an in-place op, a view)."""
    if not isinstance(out, torch.Tensor) or out.layout != torch.strided:
        return 0
    storage = out.untyped_storage().data_ptr()
    arguments = [a for a in tree_leaves((args, kwargs)) if isinstance(a, torch.Tensor) and a.layout == torch.strided]
    if any(a.untyped_storage().data_ptr() == storage for a in arguments):
        return 0
    return max(0, out.untyped_storage().nbytes() - out.numel() * out.element_size())


def _node_device(node: fx.Node) -> torch.device:
    """Where ``node`` runs: the device of its first tensor (output or argument) off the CPU, else the CPU."""
    values = [node.meta.get("val"), *(a.meta.get("val") for a in node.all_input_nodes)]
    for t in tree_leaves(values):
        if isinstance(t, torch.Tensor) and t.device.type not in ("cpu", "meta"):
            return t.device
    return torch.device("cpu")


def _random_arguments(node: fx.Node, sizes: dict[int, int] | None = None) -> tuple[Any, Any]:
    """Random tensors of ``node``'s arguments' shapes, with ``sizes`` shrunk in them and in its integer
    arguments (:func:`_shrunk_sizes`); raises for a value without fake-tensor metadata."""
    if not sizes:
        return torch.fx.node.map_arg(node.args, _materialize_node), torch.fx.node.map_arg(
            node.kwargs, _materialize_node
        )

    def shrunk(value: Any) -> Any:
        return _materialize_node(value, sizes) if isinstance(value, fx.Node) else _materialize(value, None, sizes)

    return tree_map(shrunk, node.args), tree_map(shrunk, node.kwargs)


#: Ops whose inputs and outputs take more bytes than this run shrunk to measure their scratch:
#: their largest sizes cut (:func:`_shrunk_sizes`), the scratch scaled up by their bytes.  Running
#: every op of an 8 B-parameter step at full size took 531 s and 6.35 GiB for 2 layers (issue 21).
FULL_SIZE_SCRATCH_BYTES = 64 * 2**20
#: An op that cannot run shrunk runs at full size where its operands take at most this.
FULL_SIZE_FALLBACK_BYTES = 512 * 2**20
#: Sizes at most this are never shrunk (heads, a small batch): an op's structure stays.
_SMALLEST_SHRUNK_SIZE = 16


def _operand_shapes(node: fx.Node) -> list[tuple[tuple[int, ...], int]]:
    """(shape, bytes per element) of the tensors ``node`` reads and writes."""
    values = [node.meta.get("val"), *(a.meta.get("val") for a in node.all_input_nodes)]
    return [(_priced_shape(t.shape), t.element_size()) for t in tree_leaves(values) if isinstance(t, torch.Tensor)]


def _operand_bytes(operands: list[tuple[tuple[int, ...], int]], sizes: dict[int, int]) -> int:
    total = 0
    for shape, itemsize in operands:
        n = itemsize
        for size in shape:
            n *= sizes.get(size, size)
        total += n
    return total


def _shrunk_sizes(node: fx.Node, limit: int) -> tuple[dict[int, int], float]:
    """Sizes to run ``node`` at so that its operands take at most about ``limit`` bytes, and the factor
    its measured scratch is scaled by (its operands' bytes at full size over those at the sizes run).

    Every size above :data:`_SMALLEST_SHRUNK_SIZE` is divided by the same power of two, and every
    occurrence of a size alike (in each tensor, and in integer arguments), so sizes that agree keep
    agreeing (a matmul's inner dimension, a norm's shape) and halved ones stay halved (a stride-2
    convolution).  The scratch kernels allocate grows with their operands (a dropout mask, a copy of
    an input laid out otherwise), so it is scaled by their bytes; a fixed workspace is overstated,
    never missed.  ``({}, 1.0)``: run at full size."""
    operands = _operand_shapes(node)
    full = _operand_bytes(operands, {})
    shrinkable = sorted({n for shape, _ in operands for n in shape if n > _SMALLEST_SHRUNK_SIZE})
    sizes: dict[int, int] = {}
    shift = 0
    while _operand_bytes(operands, sizes) > limit and shrinkable:
        shift += 1
        sizes = {n: max(_SMALLEST_SHRUNK_SIZE, -(-n >> shift)) for n in shrinkable}
        if all(m == _SMALLEST_SHRUNK_SIZE for m in sizes.values()):
            break
    return sizes, full / max(1, _operand_bytes(operands, sizes))


def _scratch_runs(node: fx.Node) -> list[tuple[dict[int, int], float]]:
    """The sizes to try running ``node`` at to measure its scratch, with their scale factors: shrunk
    (:func:`_shrunk_sizes`), then at full size where it is affordable (an op whose shapes relate other
    than by equality or halving, as a convolution's output to its input, cannot run shrunk)."""
    sizes, scale = _shrunk_sizes(node, FULL_SIZE_SCRATCH_BYTES)
    if not sizes:
        return [({}, 1.0)]
    if _operand_bytes(_operand_shapes(node), {}) <= FULL_SIZE_FALLBACK_BYTES:
        return [(sizes, scale), ({}, 1.0)]
    return [(sizes, scale)]


def _scratch_on_cpu(nodes: dict[tuple, fx.Node]) -> dict[tuple, OpMemory]:
    """Scratch of CPU ops: the allocator's events (``torch.profiler``) inside each op's labelled window."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile, record_function

    labels: dict[str, tuple] = {}  # label -> signature
    scales: dict[tuple, float] = {}
    surplus: dict[tuple, int] = {}
    with quiet_profiler(), profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        for i, (signature, node) in enumerate(nodes.items()):
            for j, (sizes, scale) in enumerate(_scratch_runs(node)):
                label = f"ckptc_scratch_{i}_{j}"
                try:
                    args, kwargs = _random_arguments(node, sizes)
                    with record_function(label):
                        out = node.target(*args, **kwargs)
                    surplus[signature] = round(_surplus_bytes(out, args, kwargs) * scale)
                    del out, args, kwargs
                except Exception:  # a value without fake-tensor metadata, a data-dependent op
                    _could_not_run(node, sizes)
                    continue
                labels[label], scales[signature] = signature, scale
                break
    events = list(profiler_events(prof))
    windows = sorted((e.start_ns(), e.end_ns(), e.name()) for e in events if e.name() in labels)
    memory = sorted(
        (e.start_ns(), e.nbytes()) for e in events if e.name() == "[memory]" and e.device_type() == DeviceType.CPU
    )
    measured = {}
    j = 0
    for start, end, label in windows:
        while j < len(memory) and memory[j][0] < start:
            j += 1
        level = peak = 0
        k = j
        while k < len(memory) and memory[k][0] <= end:
            level += memory[k][1]
            peak = max(peak, level)
            k += 1
        signature = labels[label]
        measured[signature] = OpMemory(round(max(0, peak - max(level, 0)) * scales[signature]), surplus[signature])
    return measured


def _scratch_on_accelerator(nodes: dict[tuple, fx.Node], device: torch.device) -> dict[tuple, OpMemory]:
    """Scratch of ops on an accelerator: its allocator's peak counter while the op runs, above the level
    with its outputs allocated (whole blocks, as the budget counts them).  What an op allocates once and
    keeps (a cuBLAS workspace) is in that level too, so it is not scratch: the memory model counts it."""
    module = torch.get_device_module(device.type)
    measured = {}
    for signature, node in nodes.items():
        for sizes, scale in _scratch_runs(node):
            try:
                args, kwargs = _random_arguments(node, sizes)
                module.synchronize(device)
                module.reset_peak_memory_stats(device)
                out = node.target(*args, **kwargs)
                module.synchronize(device)
                scratch = max(0, module.max_memory_allocated(device) - module.memory_allocated(device))
                measured[signature] = OpMemory(round(scratch * scale), round(_surplus_bytes(out, args, kwargs) * scale))
                del out, args, kwargs
                break
            except Exception:  # a value without fake-tensor metadata, a data-dependent op
                _could_not_run(node, sizes)
    return measured


def _could_not_run(node: fx.Node, sizes: dict[int, int]) -> None:
    log.debug(
        "could not run %s on random data at %s to measure its scratch", node.target, sizes or "full size", exc_info=True
    )
