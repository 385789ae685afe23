"""Random training graphs shaped like what autograd builds, for solver tests and the solver benchmark.

``bench/bench_solvers.py`` imports :func:`random_training_graph` from here.
"""

from __future__ import annotations

import random

from solvers import Node, Problem


def random_training_graph(n_nodes: int, *, shape: str = "skip", seed: int = 0) -> Problem:
    """A random training step of about ``n_nodes`` nodes, shaped like what autograd builds.

    Forward: ``n`` activations in a chain, a chain with residual skips, or a
    DAG (each node reads 1-3 of the 8 previous ones), some reading one of a
    few parameters, a few views; a loss reading the sinks. Backward mirrors it:
    a gradient per forward node reading its incoming gradient and its saved
    inputs/outputs, gradient accumulation where a value has several consumers,
    and a parameter-gradient output per parameter use. Sizes are in MiB-ish
    units with a heavy tail, costs roughly proportional to sizes.
    """
    rng = random.Random(seed)
    n = max(2, n_nodes // 2 - 2)
    nodes: list[Node] = [Node("x", 4 << 20, 0.0, "input")]
    params = [f"w{k}" for k in range(4)]
    nodes += [Node(w, rng.randint(1, 8) << 20, 0.0, "input") for w in params]
    forward: list[str] = []
    fpreds: dict[str, list[str]] = {}
    uses_param: dict[str, str] = {}
    for i in range(n):
        name = f"f{i}"
        prev = forward[-1] if forward else "x"
        acts = [prev]
        if shape == "skip" and len(forward) >= 4 and i % 4 == 0:
            acts.append(forward[-4])
        elif shape == "dag" and forward:
            pool = forward[-8:]
            acts = list(dict.fromkeys([prev] + rng.sample(pool, min(len(pool), rng.randint(0, 2)))))
        preds = list(acts)
        if rng.random() < 0.4:
            w = rng.choice(params)
            preds.append(w)
            uses_param[name] = w
        view = rng.random() < 0.08 and acts[0] != "x"
        size = 0 if view else int(rng.choice([1, 1, 2, 2, 4, 8]) * rng.uniform(0.5, 1.5) * (1 << 20))
        cost = (size or (1 << 18)) * rng.uniform(0.5, 2.0) / (1 << 20)
        nodes.append(Node(name, size, cost, "forward", tuple(preds), alias_of=acts[0] if view else None))
        forward.append(name)
        fpreds[name] = acts
    consumed = {a for f in forward for a in fpreds[f]}
    sinks = [f for f in forward if f not in consumed]
    nodes.append(Node("loss", 4, 1.0, "forward", tuple(sinks), output=True))
    forward.append("loss")
    fpreds["loss"] = sinks
    consumers: dict[str, list[str]] = {a: [] for a in ["x", *forward]}
    for f in forward:
        for a in fpreds[f]:
            consumers[a].append(f)
    sizes = {nd.name: nd.bytes for nd in nodes}
    grad: dict[str, str] = {}
    for f in reversed(forward):
        if f == "loss":
            incoming = None
        else:
            sources = [grad[c] for c in consumers[f]]
            incoming = sources[0]
            if len(sources) > 1:
                incoming = f"acc_{f}"
                nodes.append(Node(incoming, sizes[f] or (1 << 20), 0.1, "backward", tuple(sources)))
        saved = [a for a in fpreds[f] if rng.random() < 0.7] or [f]
        if rng.random() < 0.3:
            saved.append(f)
        preds = ([incoming] if incoming else []) + list(dict.fromkeys(saved))
        nodes.append(
            Node(f"d_{f}", sizes.get(f, 0) or (1 << 20), 1.0, "backward", tuple(preds), output=(f == forward[0]))
        )
        grad[f] = f"d_{f}"
        if f in uses_param:
            wp = ([incoming] if incoming else []) + list(fpreds[f])
            nodes.append(Node(f"dw_{f}", sizes[uses_param[f]], 1.0, "backward", tuple(wp), output=True))
    return Problem(nodes=tuple(nodes))


def layered_training_graph(layers: int = 3) -> Problem:
    """x -> embed -> [layers.i: a -> b (views a) -> c] -> head -> loss, with a mask from x (no gradient)."""
    nodes = [Node("x", 8, 0.0, "input"), Node("w", 4, 0.0, "input")]
    nodes.append(Node("mask", 16, 1.0, "forward", ("x",), module="", op="ne", differentiable=False))
    nodes.append(Node("embed", 8, 2.0, "forward", ("x", "w"), module="embed", op="embedding"))
    previous = "embed"
    forward = []
    for i in range(layers):
        nodes.append(Node(f"a{i}", 32, 100.0, "forward", (previous, "w"), module=f"layers.{i}.attn", op="mm"))
        nodes.append(
            Node(f"v{i}", 0, 0.0, "forward", (f"a{i}",), alias_of=f"a{i}", module=f"layers.{i}.attn", op="view")
        )
        nodes.append(Node(f"s{i}", 32, 4.0, "forward", (f"v{i}", "mask"), module=f"layers.{i}.attn", op="softmax"))
        nodes.append(Node(f"c{i}", 32, 1.0, "forward", (f"s{i}",), module=f"layers.{i}", op="clone"))
        nodes.append(Node(f"o{i}", 8, 50.0, "forward", (f"c{i}", previous), module=f"layers.{i}.mlp", op="mm"))
        forward.append(i)
        previous = f"o{i}"
    nodes.append(Node("loss", 1, 1.0, "forward", (previous,), output=True, op="mean"))
    grad = "loss"
    for i in reversed(forward):
        prev = f"o{i - 1}" if i else "embed"
        nodes.append(Node(f"do{i}", 8, 1.0, "backward", (grad, f"c{i}", prev)))
        nodes.append(Node(f"ds{i}", 32, 1.0, "backward", (f"do{i}", f"s{i}", "mask")))
        nodes.append(Node(f"da{i}", 8, 1.0, "backward", (f"ds{i}", f"v{i}")))
        grad = f"da{i}"
    nodes.append(Node("dw", 4, 1.0, "backward", (grad,), output=True))
    return Problem(nodes=tuple(nodes))
