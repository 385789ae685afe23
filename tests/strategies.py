"""Hypothesis strategies for random training-step Problems (shared by the solvers tests).

A generated problem looks like what autograd builds:

* inputs: the data ``x`` and a few parameters ``w0..``;
* a forward graph of one of three shapes (``"chain"``, ``"skip"``: a chain
  with skip connections like residual adds, ``"dag"``: each node reads 1-3
  random earlier nodes), with optional views (alias nodes of 0 bytes),
  optional node policies, a ``loss`` output reading every forward sink, and
  sometimes an extra forward output;
* up to two forward values that only backward reads (a weight transpose,
  sometimes a view), so the derived forward phase skips them unless kept;
* sometimes a multi-output op (``mo{i}``, like native_batch_norm) whose
  getitems (``part_of``) are the forward value ``f{i}`` and an auxiliary
  output ``aux{i}`` that only backward reads;
* sometimes transient ``scratch`` bytes on a node;
* a backward graph mirroring the forward in reverse: each forward node f gets
  ``d_f`` reading f's incoming gradient (``acc_f`` sums several when f has
  several consumers) and f's preds and/or f itself; forward nodes that read
  a parameter get a parameter-gradient output ``dw_f``; some gradients are
  views of their incoming gradient.

Usage::

    from tests.strategies import training_problems
    @given(training_problems(max_forward=8))
    def test_x(problem): ...
"""

from __future__ import annotations

import dataclasses

from hypothesis import strategies as st

from solvers import Node, Problem

SHAPES = ("chain", "skip", "dag")


@st.composite
def training_problems(
    draw: st.DrawFn,
    *,
    shapes: tuple[str, ...] = SHAPES,
    min_forward: int = 1,
    max_forward: int = 8,
    max_bytes: int = 16,
    aliases: bool = True,
    policies: bool = True,
    baseline: bool = True,
    multi_outputs: bool = True,
    scratch: bool = True,
) -> Problem:
    """A random, valid training-step Problem (see the module docstring).

    Parameters
    ----------
    shapes : which forward shapes to draw from.
    min_forward, max_forward : number of forward nodes before the loss.
    max_bytes : upper bound of a node's bytes.
    aliases : draw view nodes (forward and backward).
    policies : draw "save"/"recompute" policies (rarely).
    baseline : draw a non-zero baseline_bytes sometimes.
    multi_outputs : draw multi-output ops with getitems (``part_of``).
    scratch : draw transient scratch bytes on some nodes.
    """
    shape = draw(st.sampled_from(shapes))
    n = draw(st.integers(min_forward, max_forward))
    sizes = st.integers(0, max_bytes)
    costs = st.integers(0, 5).map(float)
    scratches = st.sampled_from([0] * 7 + [5]) if scratch else st.just(0)

    nodes: list[Node] = []
    n_params = draw(st.integers(0, 2))
    nodes.append(Node("x", draw(st.integers(0, max_bytes)), 0.0, "input"))
    params = [f"w{k}" for k in range(n_params)]
    for w in params:
        nodes.append(Node(w, draw(st.integers(0, max_bytes)), 0.0, "input"))

    forward: list[str] = []
    fpreds: dict[str, tuple[str, ...]] = {}  # forward node -> its forward/input activations read
    reads_param: dict[str, str] = {}
    aux_of: dict[str, str] = {}  # multi-output op -> its backward-only getitem
    getitems: set[str] = set()
    backward_only: list[str] = []  # forward values only backward reads
    for i in range(n):
        name = f"f{i}"
        activations = [f for f in forward if f not in aux_of]  # never the tuple of a multi-output op
        prev = forward[-1] if forward else "x"
        if shape == "chain" or not forward:
            acts = [prev]
        elif shape == "skip":
            acts = [prev]
            if len(activations) >= 2 and draw(st.booleans()):
                acts.append(draw(st.sampled_from(activations[:-1])))
        else:  # dag
            pool = ["x", *activations]
            k = draw(st.integers(1, min(3, len(pool))))
            acts = draw(st.lists(st.sampled_from(pool), min_size=k, max_size=k, unique=True))
        preds = list(acts)
        if params and draw(st.booleans()):
            w = draw(st.sampled_from(params))
            preds.append(w)
            reads_param[name] = w
        policy = None
        if policies:
            policy = draw(st.sampled_from([None] * 12 + ["save", "recompute"]))
        if multi_outputs and draw(st.integers(0, 5)) == 0:
            # mo{i} allocates both outputs; getitems f{i} and aux{i} take them over.
            op, aux = f"mo{i}", f"aux{i}"
            main, extra = draw(sizes), draw(st.integers(1, max_bytes))
            nodes.append(
                Node(op, main + extra, draw(costs), "forward", tuple(preds), policy=policy, scratch=draw(scratches))
            )
            nodes.append(Node(name, main, 0.0, "forward", (op,), part_of=op))
            nodes.append(Node(aux, extra, 0.0, "forward", (op,), part_of=op))
            forward += [op, name]
            fpreds[op], fpreds[name] = tuple(acts), (op,)
            aux_of[op] = aux
            getitems.add(name)
            if name in reads_param:
                reads_param[op] = reads_param.pop(name)
            continue
        view_of = None
        forward_acts = [a for a in acts if a != "x"]
        if aliases and forward_acts and draw(st.integers(0, 5)) == 0:
            view_of = forward_acts[0]
        nbytes = 0 if view_of else draw(sizes)
        nodes.append(
            Node(
                name,
                nbytes,
                draw(costs),
                "forward",
                tuple(preds),
                alias_of=view_of,
                policy=policy,
                scratch=draw(scratches),
            )
        )
        forward.append(name)
        fpreds[name] = tuple(acts)

    # Extra forward output (e.g. logits returned to the user), sometimes.
    extra_output = draw(st.sampled_from([None] * 4 + forward))
    if extra_output is not None:
        k = next(i for i, nd in enumerate(nodes) if nd.name == extra_output)
        nd = nodes[k]
        nodes[k] = dataclasses.replace(nd, output=True)

    # Forward values only backward reads (like the weight transposes a joint
    # graph computes before backward): computed in forward only when kept.
    for k in range(draw(st.integers(0, 2))):
        name = f"t{k}"
        source = draw(st.sampled_from(params + [f for f in forward if f not in aux_of]))
        view = aliases and draw(st.booleans())
        nodes.append(
            Node(name, 0 if view else draw(sizes), draw(costs), "forward", (source,), alias_of=source if view else None)
        )
        backward_only.append(name)

    # The loss reads every forward sink, so every forward node contributes to it.
    consumed = {p for f in forward for p in fpreds[f]}
    sinks = [f for f in forward if f not in consumed]
    nodes.append(Node("loss", draw(st.integers(0, 4)), draw(costs), "forward", tuple(sinks), output=True))
    forward.append("loss")
    fpreds["loss"] = tuple(sinks)

    consumers: dict[str, list[str]] = {a: [] for a in ["x", *forward]}
    for f in forward:
        for a in fpreds[f]:
            consumers[a].append(f)

    # Backward: reverse order, one gradient node per forward node.
    grad_of_inputs: dict[str, str] = {}  # forward node f -> d_f (gradient w.r.t. f's inputs)
    for f in reversed(forward):
        if f == "loss":
            incoming = None
        else:
            sources = [grad_of_inputs[c] for c in consumers[f]]
            if len(sources) == 1:
                incoming = sources[0]
            else:
                incoming = f"acc_{f}"
                nodes.append(Node(incoming, draw(sizes), 1.0, "backward", tuple(sources)))
        if f in aux_of:  # backward of a multi-output op: its inputs and its auxiliary output
            saved_pool = [*fpreds[f], aux_of[f]]
        elif f in getitems:  # a getitem's backward only forwards the gradient
            saved_pool = [f]
        else:
            saved_pool = [*fpreds[f], f]
        saved = draw(st.lists(st.sampled_from(saved_pool), min_size=1, max_size=len(saved_pool), unique=True))
        if f in aux_of and aux_of[f] not in saved:
            saved.append(aux_of[f])
        if f == forward[0]:
            saved += backward_only  # make sure each one has a backward reader
        elif backward_only and draw(st.booleans()):
            saved.append(draw(st.sampled_from(backward_only)))
        preds = ([incoming] if incoming else []) + list(dict.fromkeys(saved))
        grad_view = aliases and incoming is not None and draw(st.integers(0, 7)) == 0
        nodes.append(
            Node(
                f"d_{f}",
                0 if grad_view else draw(sizes),
                1.0,
                "backward",
                tuple(preds),
                alias_of=incoming if grad_view else None,
                output=(f == forward[0]),  # the gradient of x
                scratch=draw(scratches),
            )
        )
        grad_of_inputs[f] = f"d_{f}"
        if f in reads_param:
            wgrad_preds = ([incoming] if incoming else []) + list(fpreds[f])
            nodes.append(
                Node(f"dw_{f}", draw(st.integers(1, max_bytes)), 1.0, "backward", tuple(wgrad_preds), output=True)
            )

    baseline_bytes = draw(st.sampled_from([0, 0, 0, 7])) if baseline else 0
    return Problem(nodes=tuple(nodes), baseline_bytes=baseline_bytes)


def chains(max_forward: int = 8, **kwargs) -> st.SearchStrategy[Problem]:
    """Chain-shaped problems only."""
    return training_problems(shapes=("chain",), max_forward=max_forward, **kwargs)


def skip_chains(max_forward: int = 8, **kwargs) -> st.SearchStrategy[Problem]:
    """Chains with skip connections (residual blocks)."""
    return training_problems(shapes=("skip",), max_forward=max_forward, **kwargs)


def random_dags(max_forward: int = 8, **kwargs) -> st.SearchStrategy[Problem]:
    """Random forward DAGs."""
    return training_problems(shapes=("dag",), max_forward=max_forward, **kwargs)
