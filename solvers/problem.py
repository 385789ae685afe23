"""The checkpointing problem: one training step as an ordered graph of values.

A :class:`Problem` lists every value of a training step (inputs, forward
activations, backward gradients) in execution order, with how many bytes each
one allocates, what it costs to compute, and which earlier values it reads.
Solvers choose which forward values to keep for the backward phase; the
simulator (:mod:`solvers.simulator`) says what that choice costs in memory.

The class is a frozen, plain data object. Construction validates the order
invariants once, in time linear in the number of nodes plus edges, and builds
integer index arrays that the rest of the package uses for fast passes.
"""

from __future__ import annotations

import dataclasses
import threading
import weakref
from collections import OrderedDict
from dataclasses import dataclass, field
from functools import cached_property
from typing import TYPE_CHECKING, Any, Iterable, Mapping, Sequence

from solvers.errors import human_bytes

if TYPE_CHECKING:  # networkx is imported lazily: "import solvers" stays cheap.
    import networkx as nx

__all__ = ["Node", "Problem", "SizeGroup", "INPUT", "FORWARD", "BACKWARD", "SAVE", "RECOMPUTE"]

INPUT = "input"
FORWARD = "forward"
BACKWARD = "backward"
KINDS = (INPUT, FORWARD, BACKWARD)

SAVE = "save"
RECOMPUTE = "recompute"
POLICIES = (None, SAVE, RECOMPUTE)
# The integer codes of kinds and policies in the index arrays solver modules read
# (``Problem._kind``, ``Problem._policy``): defined here once, imported by name.
INPUT_CODE, FORWARD_CODE, BACKWARD_CODE = 0, 1, 2
SAVE_CODE, RECOMPUTE_CODE = 1, 2
_KIND_CODE = {INPUT: INPUT_CODE, FORWARD: FORWARD_CODE, BACKWARD: BACKWARD_CODE}
_POLICY_CODE = {None: 0, SAVE: SAVE_CODE, RECOMPUTE: RECOMPUTE_CODE}
POINTWISE_CODE, REDUCTION_CODE, ABSORBED_CODE = 1, 2, 3
_FUSION_CODE = {"": 0, "pointwise": POINTWISE_CODE, "reduction": REDUCTION_CODE, "absorbed": ABSORBED_CODE}


#: How many memo dicts of the most recently built problem contents are kept after their problems die,
#: and the most bytes of arrays they may hold together (the floor's nested-DP tables of a 64-block chain
#: take about 50 MB; a 4-layer model's, under 1 MB).
SHARED_CACHES_KEPT = 32
SHARED_CACHES_BYTES = 256 * 2**20
# Every live problem's memo by content (an entry dies with the last problem holding its memo), and the
# memos of the most recently built contents, held strongly.
_shared_caches: "weakref.WeakValueDictionary[_Content, _Memo]" = weakref.WeakValueDictionary()
_recent_caches: "OrderedDict[_Content, _Memo]" = OrderedDict()
_shared_caches_lock = threading.Lock()


class _Memo(dict):
    """A problem's memo dict (a ``dict`` subclass, so that it can be weakly referenced)."""

    __slots__ = ("__weakref__",)


class _Content:
    """A problem's fields as a dictionary key, hashed once (a tuple of thousands of nodes is not)."""

    __slots__ = ("fields", "hash")

    def __init__(self, problem: "Problem") -> None:
        self.fields = (problem.nodes, problem.baseline_bytes, problem.size_groups)
        self.hash = hash(self.fields)

    def __hash__(self) -> int:
        return self.hash

    def __eq__(self, other: object) -> bool:
        return isinstance(other, _Content) and self.hash == other.hash and self.fields == other.fields


def _shared_cache(problem: "Problem") -> dict[str, Any]:
    """The memo dict of every problem with ``problem``'s nodes, baseline and size groups.

    Everything solvers memoise on a problem is a function of those fields, so a problem built
    again from the same graph (a step planned again, a layer compiled as its own graph six times,
    a budget sweep) starts with the floor, the option menus and the plans already found for it:
    while any problem of that content is alive, and for the :data:`SHARED_CACHES_KEPT` most
    recently built contents after (the oldest of them without their arrays beyond
    :data:`SHARED_CACHES_BYTES`).
    """
    try:
        key = _Content(problem)
    except TypeError:  # a field built from a list (``preds=[...]``): this problem memoises alone
        return _Memo()
    with _shared_caches_lock:
        cache = _shared_caches.get(key)
        if cache is not None:
            _recent_caches[key] = cache
            _recent_caches.move_to_end(key)
            return cache
        cache = _shared_caches[key] = _recent_caches[key] = _Memo()
        # A new content: the oldest beyond the count are let go, and over the byte cap the oldest memos let
        # their arrays go (rebuilt if asked for again) and keep the rest: plans, floors and menus are small.
        while len(_recent_caches) > SHARED_CACHES_KEPT:
            _recent_caches.popitem(last=False)
        total = sum(_array_bytes(memo) for memo in _recent_caches.values())
        for memo in list(_recent_caches.values())[:-1]:
            if total <= SHARED_CACHES_BYTES:
                break
            for name in [name for name, value in memo.items() if _value_bytes(value)]:
                total -= _value_bytes(memo.pop(name))
        return cache


def _value_bytes(value: Any) -> int:
    """The bytes of the arrays in a memo's entry (anything with ``nbytes``, or a list of such)."""
    total = 0
    for item in value if isinstance(value, list) else (value,):
        nbytes = getattr(item, "nbytes", None)
        if isinstance(nbytes, int):
            total += nbytes
    return total


def _array_bytes(memo: dict[str, Any]) -> int:
    """The bytes of the arrays a memo holds, which dominate it."""
    return sum(_value_bytes(value) for value in memo.values())


def clear_shared_caches() -> None:
    """Forget every problem's memoised results (the floor, menus, plans) for the problems built from
    now on: what a solver's module constant changes (a test's monkeypatch) is not part of their keys."""
    with _shared_caches_lock:
        _shared_caches.clear()
        _recent_caches.clear()


@dataclass(frozen=True, slots=True)
class Node:
    """One value of the training step.

    Parameters
    ----------
    name : str
        Unique name.
    bytes : int
        Bytes of the storage its output allocates; 0 for views/aliases and
        for nodes producing no tensor.
    cost : float
        Cost to (re)compute it (FLOPs, seconds...; only forward costs matter).
    kind : str
        ``"input"`` (resident for the whole step, never computed),
        ``"forward"`` (computed in forward; kept for backward or recomputed) or
        ``"backward"`` (computed exactly once in backward).
    preds : tuple of str
        The values this node reads, in argument order; all earlier in the order.
    output : bool
        The value stays alive until the end of the step once computed.
    alias_of : str or None
        The node whose storage this node's output views. Must be one of
        ``preds`` (a view reads its base). ``bytes`` must then be 0.
    policy : str or None
        None, ``"save"`` (must be kept if backward needs it; it is never
        recomputed) or ``"recompute"`` (must not be kept). Only meaningful
        for forward nodes; ignored on inputs and backward nodes.
    scratch : int
        Transient bytes the op allocates while it runs and frees before it
        returns; counted at its step only.
    part_of : str or None
        For a getitem of a multi-output op: that op (one of ``preds``). The
        op's ``bytes`` is the sum of its outputs; this node takes its own
        ``bytes`` over from the op's storage, so outputs die one by one.
    module : str
        Dotted path of the module that produced it (``"layers.3.mlp"``), or
        ``""``. Block finding groups forward nodes by it.
    op : str
        Operator name (``"mm"``, ``"add"``...), for structural hashing and
        reports; ``""`` if unknown.
    differentiable : bool
        A gradient flows through this value. False for forward values computed
        from non-trainable inputs alone (attention masks, rotary tables,
        position ids): they are kept as computed, never a decision.
    checkpointed : bool
        The model checkpoints this value itself (inside ``torch.utils.checkpoint``):
        run as written, it is recomputed in backward. The plan the user already
        had is a candidate every solver must match.
    fusion : str
        How a fusing compiler (Inductor) runs it: ``"pointwise"``, computed inside the
        kernel of its reader when it has one reader and that reader fuses (so a
        recomputation with one such reader allocates nothing); ``"reduction"``, a
        kernel that computes the pointwise values it reads inside itself;
        ``"absorbed"``, computed inside the kernel of its one reader (a matrix
        product inside the add that reads it); ``""`` otherwise, and for every node
        under compilers that do not fuse.  A pointwise or absorbed node with 0
        bytes that is not a view never reaches memory: what it reads is read where
        its readers run.
    """

    name: str
    bytes: int
    cost: float
    kind: str
    preds: tuple[str, ...] = ()
    output: bool = False
    alias_of: str | None = None
    policy: str | None = None
    scratch: int = 0
    part_of: str | None = None
    module: str = ""
    op: str = ""
    differentiable: bool = True
    checkpointed: bool = False
    fusion: str = ""

    def to_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "bytes": self.bytes,
            "cost": self.cost,
            "kind": self.kind,
            "preds": list(self.preds),
            "output": self.output,
            "alias_of": self.alias_of,
            "policy": self.policy,
            "scratch": self.scratch,
            "part_of": self.part_of,
            "module": self.module,
            "op": self.op,
            "differentiable": self.differentiable,
            "checkpointed": self.checkpointed,
            "fusion": self.fusion,
        }


@dataclass(frozen=True)
class SizeGroup:
    """Sizes that depend on the data and share a total: the tokens routed to each expert of one
    mixture-of-experts layer, at most ``bound`` each and ``total`` together.

    A node of a member allocates ``bytes - unit * bound`` plus ``unit`` bytes per unit of that
    member's size (its ``Node.bytes`` is the price at the bound).  The simulator prices every
    point of the step at the worst split of ``total`` among the members (the largest share
    to the member holding the most bytes per unit there), which is at most the sum of the
    members' bounds: a plan that fits it fits every routing.

    Attributes:
        total: the members' sizes sum to at most this.
        members: per member, its bound and the ``(node name, bytes per unit)`` of the nodes whose
            bytes grow with it.
    """

    total: int
    members: tuple[tuple[int, tuple[tuple[str, int], ...]], ...]

    def to_dict(self) -> dict[str, Any]:
        return {"total": self.total, "members": [[bound, [list(n) for n in nodes]] for bound, nodes in self.members]}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> "SizeGroup":
        members = tuple(
            (int(bound), tuple((str(name), int(unit)) for name, unit in nodes)) for bound, nodes in data["members"]
        )
        return cls(total=int(data["total"]), members=members)


@dataclass(frozen=True)
class Problem:
    """A training-step graph in execution order.

    Parameters
    ----------
    nodes : sequence of Node
        All values of the step in execution order (a topological order in
        which every forward node precedes every backward node).
    baseline_bytes : int
        Memory held outside this graph for the whole step; added to every
        point of the simulated timeline.
    size_groups : tuple of SizeGroup
        Data-dependent sizes that share a total (tokens routed to experts):
        the simulator prices their worst split instead of every member at its bound.

    Raises
    ------
    ValueError
        If a name is duplicated, a pred or alias is unknown or not earlier,
        a forward node follows a backward node, an input has preds, or a field
        has an invalid value. The message names the node.

    Notes
    -----
    Besides the public fields, construction builds package-internal integer
    arrays indexed by node position: ``_kind`` (0 input, 1 forward,
    2 backward), ``_bytes``, ``_cost``, ``_preds``, ``_fwd_preds`` (forward
    preds, deduplicated), ``_alias_of`` (-1 if none), ``_alias_root``,
    ``_output`` (0/1), ``_policy`` (0 none, 1 save, 2 recompute). Solver
    modules of this package read them for linear-time passes; they are not
    part of the public API.

    Examples
    --------
    >>> p = Problem.training_chain(3)
    >>> p
    Problem(7 nodes: 1 input, 3 forward, 3 backward; forward 3 B, resident 0 B, baseline 0 B)
    >>> p.forward_nodes
    ('f1', 'f2', 'f3')
    """

    nodes: tuple[Node, ...]
    baseline_bytes: int = 0
    size_groups: tuple[SizeGroup, ...] = ()
    # name -> position in `nodes`, for O(1) lookups.
    index: dict[str, int] = field(init=False, repr=False, compare=False, hash=False)
    # Solvers memoise results derived from the fields here (keyed by a string); shared by every
    # problem of the same content (:func:`_shared_cache`).
    _cache: dict[str, Any] = field(init=False, repr=False, compare=False, hash=False)

    def __post_init__(self) -> None:
        nodes = tuple(self.nodes)
        object.__setattr__(self, "nodes", nodes)
        if not isinstance(self.baseline_bytes, int) or self.baseline_bytes < 0:
            raise ValueError(f"baseline_bytes must be a non-negative int, got {self.baseline_bytes!r}")

        index: dict[str, int] = {}
        kind = bytearray(len(nodes))
        nbytes: list[int] = [0] * len(nodes)
        preds_idx: list[tuple[int, ...]] = [()] * len(nodes)
        fwd_preds: list[tuple[int, ...]] = [()] * len(nodes)
        alias_of = [-1] * len(nodes)
        alias_root = list(range(len(nodes)))
        output = bytearray(len(nodes))
        policy = bytearray(len(nodes))
        part_of = [-1] * len(nodes)
        first_backward: str | None = None

        for i, node in enumerate(nodes):
            if not isinstance(node, Node):
                raise ValueError(f"nodes[{i}] is a {type(node).__name__}, expected solvers.Node")
            name = node.name
            if name in index:
                raise ValueError(f"duplicate node name {name!r} (positions {index[name]} and {i})")
            if node.kind not in _KIND_CODE:
                raise ValueError(f"node {name!r}: kind must be one of {KINDS}, got {node.kind!r}")
            if not isinstance(node.bytes, int) or node.bytes < 0:
                raise ValueError(f"node {name!r}: bytes must be a non-negative int, got {node.bytes!r}")
            if not node.cost >= 0:  # also rejects NaN
                raise ValueError(f"node {name!r}: cost must be >= 0, got {node.cost!r}")
            if node.policy not in POLICIES:
                raise ValueError(f"node {name!r}: policy must be None, 'save' or 'recompute', got {node.policy!r}")
            if node.fusion not in _FUSION_CODE:
                raise ValueError(f"node {name!r}: fusion must be one of {sorted(_FUSION_CODE)}, got {node.fusion!r}")
            code = _KIND_CODE[node.kind]
            if node.kind == INPUT and node.preds:
                raise ValueError(f"input node {name!r} must have no preds, got {node.preds!r}")
            if node.kind == BACKWARD and first_backward is None:
                first_backward = name
            if node.kind == FORWARD and first_backward is not None:
                raise ValueError(
                    f"forward node {name!r} comes after backward node {first_backward!r}; "
                    "every forward node must precede every backward node"
                )
            p_idx = []
            for p in node.preds:
                j = index.get(p)
                if j is None:
                    raise ValueError(
                        f"node {name!r} reads {p!r}, which is not an earlier node "
                        "(unknown name, or the order is not topological)"
                    )
                p_idx.append(j)
            if node.alias_of is not None:
                j = index.get(node.alias_of)
                if j is None:
                    raise ValueError(f"node {name!r} is an alias of {node.alias_of!r}, which is not an earlier node")
                if node.bytes != 0:
                    raise ValueError(f"alias node {name!r} must have bytes=0 (it views {node.alias_of!r}'s storage)")
                if node.kind != INPUT and node.alias_of not in node.preds:
                    raise ValueError(
                        f"alias node {name!r} must read its base: alias_of {node.alias_of!r} is not in its preds"
                    )
                alias_of[i] = j
                alias_root[i] = alias_root[j]
            if not isinstance(node.scratch, int) or node.scratch < 0:
                raise ValueError(f"node {name!r}: scratch must be a non-negative int, got {node.scratch!r}")
            if node.part_of is not None and node.alias_of is None:
                if node.part_of not in node.preds:
                    raise ValueError(f"node {name!r}: part_of {node.part_of!r} is not in its preds")
                part_of[i] = index[node.part_of]
            index[name] = i
            kind[i] = code
            nbytes[i] = node.bytes
            preds_idx[i] = tuple(p_idx)
            # Forward preds without duplicates: what a recomputation must materialise.
            fwd_preds[i] = tuple(dict.fromkeys(j for j in p_idx if kind[j] == FORWARD_CODE))
            output[i] = 1 if node.output else 0
            # A policy only constrains forward nodes (inputs are never computed,
            # backward nodes never kept); elsewhere it is accepted and ignored.
            policy[i] = _POLICY_CODE[node.policy] if code == FORWARD_CODE else 0

        object.__setattr__(self, "index", index)
        object.__setattr__(self, "_kind", bytes(kind))
        object.__setattr__(self, "_bytes", nbytes)
        object.__setattr__(self, "_preds", preds_idx)
        object.__setattr__(self, "_fwd_preds", fwd_preds)
        object.__setattr__(self, "_alias_of", alias_of)
        object.__setattr__(self, "_alias_root", alias_root)
        object.__setattr__(self, "_output", bytes(output))
        object.__setattr__(self, "_policy", bytes(policy))
        object.__setattr__(self, "_cost", [float(n.cost) for n in nodes])
        object.__setattr__(self, "_scratch", [n.scratch for n in nodes])
        object.__setattr__(self, "_part_of", part_of)
        object.__setattr__(self, "_fusion", bytes(_FUSION_CODE[n.fusion] for n in nodes))
        self._check_size_groups(index, nodes)
        object.__setattr__(self, "_cache", _shared_cache(self))

    def _check_size_groups(self, index: Mapping[str, int], nodes: tuple[Node, ...]) -> None:
        object.__setattr__(self, "size_groups", tuple(self.size_groups))
        seen: set[str] = set()
        for group in self.size_groups:
            if not isinstance(group, SizeGroup) or group.total < 0:
                raise ValueError(f"size_groups: expected SizeGroup with total >= 0, got {group!r}")
            for bound, members in group.members:
                for name, unit in members:
                    i = index.get(name)
                    if i is None:
                        raise ValueError(f"size group member {name!r} is not a node")
                    if name in seen:
                        raise ValueError(f"node {name!r} is in more than one size group member")
                    seen.add(name)
                    node = nodes[i]
                    if unit <= 0 or bound < 0 or unit * bound > node.bytes:
                        raise ValueError(
                            f"node {name!r}: {unit} bytes per unit up to {bound} exceed its {node.bytes} bytes"
                        )
                    if node.alias_of is not None or node.part_of is not None:
                        raise ValueError(f"node {name!r}: a view or a part of a multi-output value cannot grow")

    # ------------------------------------------------------------------ basics
    def __len__(self) -> int:
        return len(self.nodes)

    def __contains__(self, name: object) -> bool:
        return name in self.index

    def __getitem__(self, name: str) -> Node:
        return self.nodes[self.index[name]]

    def __repr__(self) -> str:
        return (
            f"Problem({len(self.nodes)} nodes: {len(self._input_idx)} input, "
            f"{len(self._forward_idx)} forward, {len(self._backward_idx)} backward; "
            f"forward {human_bytes(self.forward_bytes)}, resident {human_bytes(self.input_bytes)}, "
            f"baseline {human_bytes(self.baseline_bytes)})"
        )

    # ---------------------------------------------------------- derived data
    @cached_property
    def _input_idx(self) -> tuple[int, ...]:
        return tuple(i for i, k in enumerate(self._kind) if k == INPUT_CODE)

    @cached_property
    def _forward_idx(self) -> tuple[int, ...]:
        return tuple(i for i, k in enumerate(self._kind) if k == FORWARD_CODE)

    @cached_property
    def _backward_idx(self) -> tuple[int, ...]:
        return tuple(i for i, k in enumerate(self._kind) if k == BACKWARD_CODE)

    @cached_property
    def input_nodes(self) -> tuple[str, ...]:
        """Names of input nodes, in order."""
        return tuple(self.nodes[i].name for i in self._input_idx)

    @cached_property
    def forward_nodes(self) -> tuple[str, ...]:
        """Names of forward nodes, in order."""
        return tuple(self.nodes[i].name for i in self._forward_idx)

    @cached_property
    def backward_nodes(self) -> tuple[str, ...]:
        """Names of backward nodes, in order."""
        return tuple(self.nodes[i].name for i in self._backward_idx)

    @cached_property
    def _consumers(self) -> tuple[tuple[int, ...], ...]:
        cons: list[list[int]] = [[] for _ in self.nodes]
        for i, preds in enumerate(self._preds):
            for j in dict.fromkeys(preds):
                cons[j].append(i)
        return tuple(tuple(c) for c in cons)

    @cached_property
    def consumers(self) -> dict[str, tuple[str, ...]]:
        """name -> names of the nodes that read it (each once, in order)."""
        names = [n.name for n in self.nodes]
        return {names[i]: tuple(names[j] for j in c) for i, c in enumerate(self._consumers)}

    @cached_property
    def total_forward_cost(self) -> float:
        """Sum of the costs of all forward nodes (the cost of one forward pass)."""
        return float(sum(self.nodes[i].cost for i in self._forward_idx))

    @cached_property
    def forward_bytes(self) -> int:
        """Sum of the bytes of all forward nodes (everything kept, aliases shared)."""
        return sum(self._bytes[i] for i in self._forward_idx)

    @cached_property
    def input_bytes(self) -> int:
        """Bytes of the input nodes (resident for the whole step)."""
        return sum(self._bytes[i] for i in self._input_idx)

    @cached_property
    def largest_scratch(self) -> int:
        """The largest scratch (bytes a node's kernel allocates and frees while it runs) of any node."""
        return max(self._scratch, default=0)

    @cached_property
    def resident_bytes(self) -> int:
        """Bytes alive at every point of the step: inputs plus baseline."""
        return self.input_bytes + self.baseline_bytes

    @cached_property
    def _read_by_backward(self) -> bytes:
        """Flag per node: some backward node reads it directly."""
        flags = bytearray(len(self.nodes))
        for b in self._backward_idx:
            for j in self._preds[b]:
                flags[j] = 1
        return bytes(flags)

    def alias_root(self, name: str) -> str:
        """The node owning the storage that ``name`` views (itself if not an alias)."""
        return self.nodes[self._alias_root[self.index[name]]].name

    # ----------------------------------------------------------- conversions
    @classmethod
    def from_networkx(cls, graph: "nx.DiGraph", order: Sequence[str], baseline_bytes: int = 0) -> "Problem":
        """Build a Problem from a DiGraph whose edge ``u -> v`` means "v reads u".

        Node attributes: ``bytes``, ``cost``, ``kind`` (required) and optional
        ``output``, ``alias_of``, ``policy``, ``scratch``, ``part_of``, ``module``, ``op``,
        ``differentiable``, ``checkpointed``. ``order`` lists every node once in
        execution order. A node's preds are its in-neighbours sorted by their
        position in ``order`` (DiGraph keeps no argument order or duplicates).
        """
        order = list(order)
        if len(order) != graph.number_of_nodes() or set(order) != set(graph.nodes):
            missing = set(graph.nodes) - set(order)
            extra = set(order) - set(graph.nodes)
            raise ValueError(
                f"order must list every graph node exactly once (missing {sorted(missing)[:5]}, "
                f"unknown {sorted(extra)[:5]}, {len(order)} entries for {graph.number_of_nodes()} nodes)"
            )
        position = {name: i for i, name in enumerate(order)}
        nodes = []
        for name in order:
            attrs = graph.nodes[name]
            try:
                nbytes, cost, kind = attrs["bytes"], attrs["cost"], attrs["kind"]
            except KeyError as e:
                raise ValueError(f"node {name!r} lacks attribute {e.args[0]!r}") from None
            preds = tuple(sorted(graph.predecessors(name), key=position.__getitem__))
            nodes.append(
                Node(
                    name=name,
                    bytes=nbytes,
                    cost=cost,
                    kind=kind,
                    preds=preds,
                    output=bool(attrs.get("output", False)),
                    alias_of=attrs.get("alias_of"),
                    policy=attrs.get("policy"),
                    scratch=int(attrs.get("scratch", 0)),
                    part_of=attrs.get("part_of"),
                    module=str(attrs.get("module", "")),
                    op=str(attrs.get("op", "")),
                    differentiable=bool(attrs.get("differentiable", True)),
                    checkpointed=bool(attrs.get("checkpointed", False)),
                )
            )
        return cls(nodes=tuple(nodes), baseline_bytes=baseline_bytes)

    def to_networkx(self) -> "nx.DiGraph":
        """The graph as a DiGraph (edge ``u -> v``: v reads u), node attributes as in from_networkx."""
        import networkx as nx

        attributes = [f.name for f in dataclasses.fields(Node) if f.name not in ("name", "preds")]
        g = nx.DiGraph()
        for n in self.nodes:
            g.add_node(n.name, **{a: getattr(n, a) for a in attributes})
        for n in self.nodes:
            for p in n.preds:
                g.add_edge(p, n.name)
        return g

    def to_dict(self) -> dict[str, Any]:
        """Plain JSON-able data; ``Problem.from_dict(p.to_dict()) == p``."""
        data: dict[str, Any] = {"baseline_bytes": self.baseline_bytes, "nodes": [n.to_dict() for n in self.nodes]}
        if self.size_groups:
            data["size_groups"] = [g.to_dict() for g in self.size_groups]
        return data

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> "Problem":
        nodes = tuple(
            Node(
                name=d["name"],
                bytes=d["bytes"],
                cost=d["cost"],
                kind=d["kind"],
                preds=tuple(d.get("preds", ())),
                output=bool(d.get("output", False)),
                alias_of=d.get("alias_of"),
                policy=d.get("policy"),
                scratch=int(d.get("scratch", 0)),
                part_of=d.get("part_of"),
                module=str(d.get("module", "")),
                op=str(d.get("op", "")),
                differentiable=bool(d.get("differentiable", True)),
                checkpointed=bool(d.get("checkpointed", False)),
                fusion=str(d.get("fusion", "")),
            )
            for d in data["nodes"]
        )
        return cls(
            nodes=nodes,
            baseline_bytes=int(data.get("baseline_bytes", 0)),
            size_groups=tuple(SizeGroup.from_dict(g) for g in data.get("size_groups", ())),
        )

    # --------------------------------------------------------------- helpers
    @classmethod
    def training_chain(
        cls,
        n: int,
        *,
        node_bytes: int | Iterable[int] = 1,
        node_cost: float | Iterable[float] = 1.0,
        input_bytes: int = 0,
        grad_bytes: int | None = None,
        baseline_bytes: int = 0,
    ) -> "Problem":
        """A chain ``x -> f1 -> ... -> fn`` with the backward pass autograd would build.

        ``x`` is the input; ``fn`` is the loss (an output). Backward node
        ``b{i}`` (for i = n..1) reads the incoming gradient (``b{i+1}``, or
        ``fn`` for i = n) and the forward input of ``f{i}`` (``f{i-1}`` or
        ``x``); ``b1`` (the gradient of x) is an output. Gradients allocate
        ``grad_bytes`` (default: the bytes of the matching forward node).
        """
        sizes = [node_bytes] * n if isinstance(node_bytes, int) else list(node_bytes)
        costs = [float(node_cost)] * n if isinstance(node_cost, (int, float)) else list(node_cost)
        if len(sizes) != n or len(costs) != n:
            raise ValueError("node_bytes and node_cost must have n entries")
        nodes = [Node("x", input_bytes, 0.0, INPUT)]
        prev = "x"
        for i in range(1, n + 1):
            nodes.append(Node(f"f{i}", sizes[i - 1], costs[i - 1], FORWARD, (prev,), output=(i == n)))
            prev = f"f{i}"
        grad = f"f{n}"
        for i in range(n, 0, -1):
            gb = sizes[i - 1] if grad_bytes is None else grad_bytes
            inp = f"f{i - 1}" if i > 1 else "x"
            nodes.append(Node(f"b{i}", gb, costs[i - 1], BACKWARD, (grad, inp), output=(i == 1)))
            grad = f"b{i}"
        return cls(nodes=tuple(nodes), baseline_bytes=baseline_bytes)
